"""A real multi-host job on emulated hosts (ringlet.hosts): network namespaces with their
own hostname and /dev/shm, joined by a shaped link; `ringlet run` on each."""
import subprocess

import pytest

from ringlet.hosts import Hosts, HostsUnavailable

JOB = """
import socket
import numpy as np, ringlet as rl
from ringlet.runtime import engine
from ringlet.transport.shm import ShmPeer
from ringlet.transport.tcp import TcpPeer
rl.init()
r, p = rl.get_rank(), rl.get_world_size()
host = socket.gethostname()
x = np.full(1 << 20, r + 1.0, np.float32)
w = rl.all_reduce(x, async_op=True)          # across the link, in the background
w.wait()
assert (x == p * (p + 1) / 2).all()
out = np.empty((p, 3))
rl.all_gather(out, np.full(3, float(r)))
assert (out == np.arange(p)[:, None]).all()
kinds = {q: type(peer).__name__ for q, peer in engine().peers.items()}
print(f"rank {r} on {host}: {sorted(kinds.items())}", flush=True)
rl.destroy()
"""


@pytest.fixture
def two_hosts():
    try:
        with Hosts(2, rate="1gbit") as hosts:
            yield hosts
    except HostsUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")


def test_two_host_job_uses_shm_inside_and_tcp_between(two_hosts, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    results = two_hosts.wait(two_hosts.ringlet_run(str(script), nproc=2,
                                                   stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True), 90)
    for i, (code, out, err) in enumerate(results):
        assert code == 0, f"host {i}: {err}"
    lines = "".join(out for _, out, _ in results)
    # ranks 0, 1 on h0 and 2, 3 on h1: shared memory inside a host, TCP across
    for r, host, local in ((0, "h0", 1), (1, "h0", 0), (2, "h1", 3), (3, "h1", 2)):
        line = next(x for x in lines.splitlines() if x.startswith(f"[{r}] rank {r} "))
        assert f"on {host}:" in line, line
        for q in range(4):
            if q != r:
                kind = "ShmPeer" if q == local else "TcpPeer"
                assert f"({q}, '{kind}')" in line, line


def test_hosts_are_torn_down():
    try:
        with Hosts(2, rate="10gbit") as hosts:
            names = hosts.names + [hosts.switch]
            shm = [hosts.run(i, ["sh", "-c", "touch /dev/shm/x-$(hostname); ls /dev/shm"],
                             capture_output=True, text=True).stdout.split() for i in range(2)]
    except HostsUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")
    assert shm == [["x-h0"], ["x-h1"]]     # each host its own /dev/shm
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in left for n in names), left
