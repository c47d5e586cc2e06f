"""A real multi-host job on emulated hosts (ringlet.hosts): network namespaces with their
own hostname and /dev/shm, joined by a shaped link; `ringlet run` on each."""
import os
import re
import subprocess
import sys
import time

import pytest

from ringlet.hosts import Hosts, HostsUnavailable

MACHINE_NF = "/proc/sys/net/bridge/bridge-nf-call-iptables"
MACHINE_NF_BEFORE = open(MACHINE_NF).read().strip() if os.path.exists(MACHINE_NF) else ""

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
print(f"rank {r} on {host}: {sorted(kinds.items())} machine {engine().same_machine}", flush=True)
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
        # both emulated hosts run on this one kernel: all 4 ranks share its cores (and
        # wait by yielding when they outnumber them)
        assert line.endswith("machine 4"), line


def test_hosts_are_torn_down():
    try:
        with Hosts(2, rate="10gbit") as hosts:
            names = hosts.names + [hosts.switch]
            shm = [hosts.run(i, ["sh", "-c", "touch /dev/shm/x-$(hostname); ls /dev/shm"],
                             capture_output=True, text=True).stdout.split() for i in range(2)]
            # the switch forwards frames without the firewall hooks (where br_netfilter
            # is loaded), the machine's own setting untouched
            nf = subprocess.run(["ip", "netns", "exec", hosts.switch, "sh", "-c",
                                 "cat /proc/sys/net/bridge/bridge-nf-call-iptables"],
                                capture_output=True, text=True).stdout.strip()
    except HostsUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")
    assert shm == [["x-h0"], ["x-h1"]]     # each host its own /dev/shm
    assert nf in ("", "0"), nf
    if os.path.exists(MACHINE_NF):
        with open(MACHINE_NF) as f:
            assert f.read().strip() == MACHINE_NF_BEFORE
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in left for n in names), left


KINDS = """
import time
import numpy as np, ringlet as rl
from ringlet.runtime import engine
rl.init()
r, p = rl.get_rank(), rl.get_world_size()
x = np.full(1 << 18, r + 1.0, np.float32)
rl.all_reduce(x)
assert (x == p * (p + 1) / 2).all()
# rank 0 comes late to each call, so the others are asleep when its data arrives: only a
# doorbell that reaches them wakes them at once (else they sleep out their nap)
late = []
for _ in range(6):
    if r == 0:
        time.sleep(0.3)
    t = time.perf_counter()
    rl.all_reduce(np.ones(16, np.float32))
    late.append(time.perf_counter() - t)
kinds = sorted((q, type(peer).__name__) for q, peer in engine().peers.items())
print(f"rank {r} hosts {len(set(engine().hosts))} late {sorted(late)[3]:.4f} {kinds}", flush=True)
rl.destroy()
"""


def _kinds(hosts, tmp_path, env=None):
    script = tmp_path / "kinds.py"
    script.write_text(KINDS)
    results = hosts.wait(hosts.ringlet_run(str(script), nproc=2, env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True), 90)
    for i, (code, out, err) in enumerate(results):
        assert code == 0, f"host {i}: {err}"
    found = (re.search(r"rank (\d+) hosts", line) for _, out, _ in results
             for line in out.splitlines())
    return {int(m.group(1)): m.string for m in found if m}


def _late(line):
    """The median time of the calls rank 0 came 0.3 s late to, as this rank saw them: they
    last 0.3 s and no more only if rank 0's data woke the sleeping ranks at once (else they
    sleep out their nap, up to 0.2 s more)."""
    return float(re.search(r" late ([\d.]+)", line).group(1))


@pytest.fixture
def shared_ipc_hosts():
    """Two network namespaces that share the hostname and /dev/shm (containers with one IPC
    namespace but separate networks)."""
    try:
        with Hosts(2, rate="1gbit", isolate=False) as hosts:
            yield hosts
    except HostsUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")


def test_hosts_are_detected_not_declared(shared_ipc_hosts, tmp_path):
    """One hostname for all, yet each network namespace is a host: shm inside, TCP across."""
    lines = _kinds(shared_ipc_hosts, tmp_path)
    for r, local in ((0, 1), (1, 0), (2, 3), (3, 2)):
        assert " hosts 2 " in lines[r], lines[r]
        for q in range(4):
            if q != r:
                kind = "ShmPeer" if q == local else "TcpPeer"
                assert f"({q}, '{kind}')" in lines[r], lines[r]
    assert max(map(_late, lines.values())) < 0.36, f"a sleeping rank was not woken: {lines}"


def test_declared_host_spans_network_namespaces(shared_ipc_hosts, tmp_path):
    """RINGLET_HOST_ID overrides detection: the four ranks share memory across the two
    network namespaces, and their doorbells still wake each other (a socket name would not
    reach across: each call would then wait out a nap)."""
    lines = _kinds(shared_ipc_hosts, tmp_path, env={"RINGLET_HOST_ID": "one"})
    for r in range(4):
        assert " hosts 1 " in lines[r], lines[r]
        for q in range(4):
            if q != r:
                assert f"({q}, 'ShmPeer')" in lines[r], lines[r]
    assert max(map(_late, lines.values())) < 0.36, f"a sleeping rank was not woken: {lines}"


class _Store(dict):
    def set(self, key, value):
        self[key] = value

    def get(self, key, timeout=None):
        return self[key]

    def try_get(self, key):
        return dict.get(self, key)


def test_shared_memory_needs_both_sides_to_open_it():
    from types import SimpleNamespace
    from ringlet.transport.engine import Engine, host_labels
    store = _Store()
    # rank 0 opened 1's and 2's memory, 1 opened 0's, 2 opened none (another user, say)
    for r, opened in enumerate(([1, 2], [0], [])):
        store.set(f"g0/shm/{r}", str(opened).encode())
    agreed = [Engine._agree_on_shm(SimpleNamespace(store=store, rank=r, world_size=3, timeout=1),
                                   "g0/", {q: None for q in json_list})
              for r, json_list in enumerate(([1, 2], [0], []))]
    assert agreed == [{(0, 1)}] * 3
    assert host_labels(["a", "a", "a"], {(0, 1)}) == ("a#0", "a#0", "a#2")
    assert host_labels(["a", "a", "b"], {(0, 1)}) == ("a", "a", "b")


PING = """
import socket, sys, time
n = 64 << 10
if sys.argv[1] == "listen":
    srv = socket.create_server(("0.0.0.0", 29502))
    c = srv.accept()[0]
else:
    c = socket.create_connection((sys.argv[2], 29502))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf, took = bytearray(n), []
for _ in range(20):
    t = time.perf_counter()
    if sys.argv[1] != "listen":
        c.sendall(buf)
    v, got = memoryview(buf), 0
    while got < n:
        got += c.recv_into(v[got:])
    if sys.argv[1] == "listen":
        c.sendall(buf)
    took.append(time.perf_counter() - t)
print(sorted(took)[0])
"""


def test_a_fine_bucket_makes_a_small_message_see_the_rate():
    """tbf passes a message that fits its bucket at once: with the default 2 ms (256 KiB
    at 1 Gbit/s) a 64 KiB message crosses faster than the link could carry it. With a
    200 us bucket (and GSO packets cut to a third of it) even the fastest of 20 round
    trips takes most of the wire's time."""
    from ringlet.hosts import _burst
    assert _burst("1gbit") == (256 << 10, 0)
    burst, gso = _burst("1gbit", 200e-6)
    assert burst <= 32 << 10 and 0 < gso <= burst // 3
    assert _burst("10gbit", 200e-6)[1] == 0           # 250 KB: GSO packets fit
    with pytest.raises(ValueError, match="tc's form"):
        Hosts(2, rate="fast")
    try:
        with Hosts(2, rate="1gbit", bucket=200e-6) as hosts:
            peer = hosts.popen(1, [sys.executable, "-c", PING, "listen"],
                               stdout=subprocess.PIPE, text=True)
            time.sleep(0.5)
            out = hosts.run(0, [sys.executable, "-c", PING, "connect", hosts.addrs[1]],
                            capture_output=True, text=True, timeout=60).stdout
            peer.wait(30)
            qdisc = subprocess.run(["ip", "netns", "exec", hosts.names[0], "tc", "qdisc", "show",
                                    "dev", "eth0"], capture_output=True, text=True).stdout
    except HostsUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")
    wire = 2 * (64 << 10) * 8 / 1e9          # there and back at 1 Gbit/s
    assert "tbf" in qdisc, qdisc
    assert float(out) > 0.6 * wire, (out, qdisc)


def test_link_cpu_fits_work_per_byte_apart_from_work_per_call():
    from ringlet.cost.host import link_cpu
    per_byte, per_call = 0.6e-9, 2e-3
    sizes = [2 << 20, 8 << 20, 32 << 20, 128 << 20]
    samples = [(n, per_call + per_byte * n) for n in sizes for _ in range(3)]
    samples.append((sizes[-1], 10 * (per_call + per_byte * sizes[-1])))   # one slow call
    b, c = link_cpu(samples)
    assert b == pytest.approx(per_byte, rel=1e-6) and c == pytest.approx(per_call, rel=1e-6)
    # the whole call over its bytes would read the fixed work as work per byte
    assert (per_call + per_byte * sizes[0]) / sizes[0] > 1.5 * per_byte
    # one size, or a line falling with size (noise): the largest size's CPU per byte
    assert link_cpu([(1000, 2e-6), (1000, 4e-6), (1000, 3e-6)]) == (pytest.approx(2e-9), 0.0)
    assert link_cpu([(1000, 5e-6), (2000, 4e-6)]) == (pytest.approx(2e-9), 0.0)
    for bad in ([], [(0, 1.0)], [(10, -1.0)], [(10, float("nan"))]):
        with pytest.raises(ValueError, match="link_cpu"):
            link_cpu(bad)


def test_link_cpu_is_measured_through_ringlet_per_transfer():
    """bench/hosts.py measures the CPU a byte between hosts costs through ringlet's own
    transport: only the transfer's CPU (a 64 MiB call costs far more than a 1 MiB one;
    counting the processes' start would make them alike), every pair's, per byte."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "bench_hosts", os.path.join(os.path.dirname(__file__), "..", "bench", "hosts.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    try:
        with Hosts(2, rate="1gbit") as hosts:
            per_byte, per_call, samples, rate = bench.link_cpu_ringlet(hosts, 1, turns=1,
                                                                       timeout=120)
    except HostsUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")
    assert sorted(b for b, _, _ in samples) == [2 * n for n in bench.CPU_SIZES]
    cpu = {b: c for b, c, _ in samples}
    assert cpu[2 * bench.CPU_SIZES[-1]] > 4 * cpu[2 * bench.CPU_SIZES[0]], samples
    assert 0.02e-9 < per_byte < 50e-9 and per_call >= 0, (per_byte, per_call)
    assert rate < 1e9 / 8 * 1.05, rate            # it crossed the 1 Gbit/s link
