"""A call stalled on TCP says what it waited for: the timeout's message names, per
connection to the ranks it waited on, the packet being read, the bytes unread and
unacknowledged in the kernel and queued in ringlet, the kernel's retransmission state, and
each message still coming in (its tag and the bytes still to come). Real ranks, hosts
split over loopback (RINGLET_HOST_ID_SPLIT)."""
import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

import ringlet as rl
from conftest import run, two_hosts


# More than the two ends' socket buffers hold (8 MiB to send, up to 32 MiB to receive, as
# the kernel counts): with 8 MiB, a sender that wrote it all before it stopped let the
# receive complete, and the job hung until its timeout (two CI runs, 2026-12-02).
STALLED = 128 << 20


def _stalled_sender(rank, path):
    if rank == 1:
        w = rl.isend(np.ones(STALLED // 8), 0)   # its RTS goes out at once
        with open(path + ".pid", "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)   # ... and its DATA never follows in full
        w.wait()
        return
    buf = np.zeros(STALLED // 8)
    try:
        rl.recv(buf, 1, timeout=1.5)
    except BaseException as exc:     # (any other error is written too: the test names it)
        with open(path, "w") as f:
            json.dump(f"{type(exc).__name__}: {exc}", f)
        pid = int(open(path + ".pid").read())
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        raise


def test_a_stalled_tcp_receive_says_what_it_waited_for(tmp_path):
    path = str(tmp_path / "msg.json")
    with pytest.raises(rl.RingletError):
        run(_stalled_sender, 2, path, env=two_hosts(2))
    msg = json.load(open(path))
    assert msg.startswith("TimeoutError: "), msg
    assert "timed out after 1.5 s waiting for rank(s) [1]" in msg, msg
    # (its background thread may have sent a piece before the stop: some may be in)
    assert "rank 1 over TCP: conn 0: reading " in msg and "B unread" in msg, msg
    assert re.search(rf"msg 0 tag 0: [1-9]\d* of {STALLED} B still to come", msg), msg
    assert "kernel: rto" in msg and "last data out" in msg, msg
    assert "still arriving" not in msg, msg      # stopped: nothing moves


def _slow_sender(rank, path):
    if rank == 1:
        rl.send(np.ones(1 << 18), 0)            # 2 MiB through 8 KiB socket buffers
        return
    try:
        rl.recv(np.zeros(1 << 18), 1, timeout=1.5)
    except rl.TimeoutError as exc:
        with open(path, "w") as f:
            json.dump(str(exc), f)
        raise


def test_a_slow_tcp_receive_still_moving_suggests_more_time(tmp_path):
    """Socket buffers far below loopback's 64 KiB segment make the link crawl (a few KiB a
    turn of the kernel's timers): the call times out with its data still arriving, and
    the message says so and how to give it more time."""
    path = str(tmp_path / "msg.json")
    env = dict(two_hosts(2), RINGLET_TCP_SNDBUF="4096", RINGLET_TCP_RCVBUF="4096")
    with pytest.raises(rl.RingletError):
        run(_slow_sender, 2, path, env=env)
    msg = json.load(open(path))
    assert "timed out after 1.5 s" in msg and "still to come" in msg, msg
    assert "data from rank(s) [1] was still arriving in the last second" in msg, msg
    assert "timeout=" in msg and "RINGLET_TIMEOUT" in msg, msg
    assert msg.count("rank 1 over TCP") == 1, msg


# -- a healthy link must not drop at the receiver ------------------------------------------
DROPS = ("TCPRcvQDrop", "RcvPruned")     # segments the receiver had advertised room for
EXCHANGES = """
import numpy as np, ringlet as rl
rl.init()
x = np.ones(16 << 20, np.float32)             # 64 MiB: 4 MiB DATA pieces both ways
for i in range(4):
    rl.all_reduce(x, algorithm="rabenseifner")
assert (x == rl.get_world_size() ** 4).all()
rl.destroy()
"""


def tcp_counters(hosts, i) -> dict:
    """Host ``i``'s kernel TCP counters (its network namespace's /proc/net/netstat)."""
    text = hosts.run(i, ["cat", "/proc/net/netstat"], capture_output=True, text=True).stdout
    lines = text.splitlines()
    return {k: int(v) for head, vals in zip(lines[::2], lines[1::2])
            for k, v in zip(head.split()[1:], vals.split()[1:])}


def test_large_exchanges_on_a_shaped_link_drop_nothing_at_the_receiver(tmp_path):
    """Receive buffers the kernel sizes itself: a fixed SO_RCVBUF (4 MiB, the old default)
    let the kernel advertise more window than the buffer's memory holds once tbf cut the
    stream into MTU frames (more overhead per byte), so the receiver pruned and dropped
    segments it had made room for - 13-17 per 8 such calls on 2 x 2 hosts - and each drop
    cost its sender a retransmission timeout (200 ms, doubling while it repeats): the
    stalls behind the 60 s timeouts of bench/hosts.py at 1 Gbit/s. Autotuned: none."""
    from ringlet.hosts import Hosts, HostsUnavailable
    script = tmp_path / "job.py"
    script.write_text(EXCHANGES)
    try:
        with Hosts(2, rate="1gbit", bucket=200e-6) as hosts:
            before = [tcp_counters(hosts, i) for i in range(2)]
            env = {"PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
            results = hosts.wait(hosts.ringlet_run(str(script), nproc=2, env=env,
                                                   stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True), 240)
            after = [tcp_counters(hosts, i) for i in range(2)]
    except HostsUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")
    for i, (code, _, err) in enumerate(results):
        assert code == 0, f"host {i}: {err[-3000:]}"
    drops = {(i, k): after[i].get(k, 0) - before[i].get(k, 0) for i in range(2) for k in DROPS}
    timeouts = [after[i].get("TCPTimeouts", 0) - before[i].get("TCPTimeouts", 0) for i in range(2)]
    assert not any(drops.values()), f"receiver drops {drops}, retransmission timeouts {timeouts}"


def test_a_packet_read_in_part_long_ago_is_not_data_arriving():
    """A link that went down mid-packet leaves a packet read in part: counted as data still
    arriving however long ago its last byte came, a call timed out 20 s later was told to
    give the link more time (and a peer that left stayed alive to engine.departed)."""
    import socket
    from types import SimpleNamespace
    from ringlet.transport.tcp import TcpPeer
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    try:
        a.sendall(b"x" * 100)
        assert b.recv(100)
        peer = SimpleNamespace(lanes=[SimpleNamespace(sock=b, pkt=(0, 0, 0, 1, 1 << 20),
                                                      hgot=0)])
        assert TcpPeer.arriving(peer, 1000)            # its last byte just came
        time.sleep(0.3)
        assert not TcpPeer.arriving(peer, 200)         # ... and none since
        a.sendall(b"y")
        time.sleep(0.05)
        assert TcpPeer.arriving(peer, 200)             # unread in the kernel
    finally:
        for s in (a, b, srv):
            s.close()
