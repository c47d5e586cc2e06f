"""A call stalled on TCP says what it waited for: the timeout's message names, per
connection to the ranks it waited on, the packet being read, the bytes unread and
unacknowledged in the kernel and queued in ringlet, the kernel's retransmission state, and
each message still coming in (its tag and the bytes still to come). Real ranks, hosts
split over loopback (RINGLET_HOST_ID_SPLIT)."""
import json
import os
import signal
import time

import numpy as np
import pytest

import ringlet as rl
from conftest import run, two_hosts


def _stalled_sender(rank, path):
    if rank == 1:
        w = rl.isend(np.ones(1 << 20), 0)      # 8 MiB: its RTS goes out at once
        with open(path + ".pid", "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)   # ... and its DATA never follows
        w.wait()
        return
    buf = np.zeros(1 << 20)
    try:
        rl.recv(buf, 1, timeout=1.5)
    except rl.TimeoutError as exc:
        with open(path, "w") as f:
            json.dump(str(exc), f)
        pid = int(open(path + ".pid").read())
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        raise


def test_a_stalled_tcp_receive_says_what_it_waited_for(tmp_path):
    path = str(tmp_path / "msg.json")
    with pytest.raises(rl.RingletError):
        run(_stalled_sender, 2, path, env=two_hosts(2))
    msg = json.load(open(path))
    assert "timed out after 1.5 s waiting for rank(s) [1]" in msg, msg
    assert "rank 1 over TCP: conn 0: reading a header, socket has 0 B unread" in msg, msg
    assert "8388608 of 8388608 B still to come" in msg, msg
    assert "kernel: rto" in msg and "last data out" in msg, msg
