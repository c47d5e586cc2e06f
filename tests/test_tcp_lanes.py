"""Several TCP connections (lanes) per pair of ranks on different hosts (transport/tcp.py):
large messages dealt over them in pieces and put back by offset, on real ranks against
NumPy; the pieces' order checked per lane; a peer killed mid-message fails its requests.

Hosts are labels here (RINGLET_HOST_ID_SPLIT over loopback); tests/test_hosts.py runs
ranks on emulated hosts (network namespaces)."""
import json
import os
import select
import signal
import socket
import struct
import time

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import ringlet as rl
from ringlet import algorithms
from ringlet.transport import limits
from ringlet.transport.protocol import (CTS, DATA, EAGER, HEADER, HEADER_SIZE, RTS,
                                        PeerFailure, RecvRequest)
from ringlet.transport.tcp import TcpPeer
from conftest import run
from test_collectives import in_rank_settings, matches_numpy

COLLECTIVES = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
               "all_to_all", "gather", "scatter"]


def lanes_env(p, lanes):
    # (no helper threads: they would take the large messages off the lanes)
    return {"RINGLET_HOST_ID_SPLIT": str(p // 2), "RINGLET_TCP_LANES": str(lanes),
            "RINGLET_TCP_THREADS": "0"}


def bytes_received(sock) -> int:
    """What the kernel received on this connection (struct tcp_info's tcpi_bytes_received)."""
    return struct.unpack_from("<Q", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256),
                              128)[0]


def _striped(rank, collective, examples, lanes):
    from ringlet.runtime import engine
    p = rl.get_world_size()
    tcp = [q for q in engine().peers.values() if isinstance(q, TcpPeer)]
    assert tcp and all(len(q.lanes) == lanes for q in tcp), [len(q.lanes) for q in tcp]
    algos = list(algorithms.CATALOG[collective])

    # elements per rank's block: messages from just above the eager limit to a few
    # fragments, so they split into 1 .. several pieces per lane, the last one short
    @in_rank_settings(examples)
    @given(algo=st.sampled_from(algos), nbytes=st.integers(limits.TCP_EAGER_BYTES + 1, 9 << 20),
           dtype=st.sampled_from([np.uint8, np.int16, np.float32, np.int64, np.complex128]),
           op=st.sampled_from(["SUM", "MAX"]), root=st.integers(0, p - 1),
           seed=st.integers(0, 2 ** 31))
    @example(algo=algos[0], nbytes=9 << 20, dtype=np.float32, op="SUM", root=0, seed=1)
    def check(algo, nbytes, dtype, op, root, seed):
        matches_numpy(collective, rank, p, algo, nbytes, dtype, op, root, seed)

    before = [[bytes_received(lane.sock) for lane in q.lanes] for q in tcp]
    check()
    # the test would pass on one lane too: check the others carried their share
    took = [[bytes_received(lane.sock) - b for lane, b in zip(q.lanes, bs)]
            for q, bs in zip(tcp, before)]
    got = np.array([sum(t) for t in zip(*took)], np.int64)
    rl.all_reduce(got)      # (a rank may receive nothing large over TCP: count them all)
    assert all(n > 0 for n in got[1:]), f"lanes received {got} bytes: no striping"


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_striped_messages_match_numpy(collective):
    # 3 lanes: pieces dealt unevenly (a message of 4 pieces: two on the first lane)
    run(_striped, 4, collective, 4, 3, env=lanes_env(4, 3), timeout=240)


def _exchange(rank, nbytes):
    from ringlet.runtime import engine
    assert [len(q.lanes) for q in engine().peers.values()] == [2]
    peer = 1 - rank
    src = (np.arange(nbytes, dtype=np.int64) * (rank + 3)).view(np.uint8)
    dst = np.zeros(nbytes * 8, np.uint8)
    w = rl.irecv(dst, peer)
    rl.send(src, peer)
    w.wait()
    np.testing.assert_array_equal(dst.view(np.int64), np.arange(nbytes) * (peer + 3))


@pytest.mark.parametrize("nbytes", [(1 << 20) + 8, 3 << 20, (9 << 20) - 24])
def test_point_to_point_over_two_lanes(nbytes):
    run(_exchange, 2, nbytes // 8, env=lanes_env(2, 2))


def _killed_mid_message(rank, path):
    from ringlet.runtime import engine
    x = np.ones(64 << 20, np.uint8)     # 64 MiB: 16 pieces over 2 lanes, more than the
    if rank == 1:                       # sockets hold while rank 0 does not read
        w = rl.isend(x, 0)
        rl.barrier()
        tcp, deadline = engine().peers[0], time.monotonic() + 10
        while tcp.sending is None:      # until its pieces are under way on both lanes
            engine().progress()
            assert time.monotonic() < deadline and not w.is_completed()
        with open(path + ".killed", "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    rl.barrier()
    w = rl.irecv(x, 1)                  # (its CTS goes now)
    time.sleep(0.5)                     # reading nothing meanwhile
    try:
        w.wait(timeout=30)
    except rl.PeerFailure as exc:
        with open(f"{path}.{rank}", "w") as f:
            json.dump({"rank": exc.rank, "msg": str(exc), "t": time.time()}, f)
        raise


def test_a_peer_killed_mid_striped_message_fails_the_receive_at_once(tmp_path):
    path = str(tmp_path / "seen")
    with pytest.raises(rl.ProcessFailed) as info:
        run(_killed_mid_message, 2, path, env={**lanes_env(2, 2), "RINGLET_PROGRESS": "0"})
    assert info.value.rank == 1 and "SIGKILL" in info.value.detail
    killed = float(open(path + ".killed").read())
    seen = json.load(open(path + ".0"))
    assert seen["rank"] == 1 and "rank 1 failed" in seen["msg"], seen
    assert seen["t"] - killed < 5.0, f"the receive failed {seen['t'] - killed:.2f} s after the kill"


# -- one TcpPeer over two socket pairs: what it accepts on which lane -------------------------

class _Engine:
    def retired(self, gid):
        return False

    def __init__(self):
        self.calls = self
        self.failed: dict = {}      # (calls failed here: none)
        self.violations: list = []

    def protocol_violation(self, peer, why):
        self.violations.append(why)
        peer.fail(PeerFailure(why, rank=peer.rank))

    def peer_failed(self, rank, exc):
        pass

    def unasked(self, *a):
        pass


def _pairs(k):
    ours, theirs = [], []
    with socket.create_server(("127.0.0.1", 0)) as srv:
        for _ in range(k):
            a = socket.create_connection(srv.getsockname())
            ours.append(a)
            theirs.append(srv.accept()[0])
    return ours, theirs


def _drive(peer, until, limit=10.0):
    deadline = time.monotonic() + limit
    while not until():
        peer.progress()
        assert time.monotonic() < deadline, "never happened"


def _lane_peer(nbytes, dtype=np.uint8, ufunc=None):
    """A receive of ``nbytes`` posted on a two-lane peer whose RTS we sent (its CTS read)."""
    ours, theirs = _pairs(2)
    eng = _Engine()
    peer = TcpPeer(eng, 1, theirs)
    for sock in ours:
        sock.settimeout(10)
    dst = np.ones(nbytes // np.dtype(dtype).itemsize, dtype)
    req = RecvRequest(1, 7, dst, ufunc)
    peer.post_recv(req)
    ours[0].sendall(HEADER.pack(RTS, 0, 7, 0, nbytes, 0, 0, 0, 0))
    got = bytearray()

    def cts_in():
        if select.select([ours[0]], [], [], 0.01)[0]:
            got.extend(ours[0].recv(64))
        return len(got) >= HEADER_SIZE
    _drive(peer, cts_in)
    assert HEADER.unpack_from(got)[0] == CTS
    return peer, eng, ours, req


def _piece(sock, msgid, aux, payload):
    sock.sendall(HEADER.pack(DATA, 0, 0, msgid, len(payload), aux, 0, 0, 0) + payload)


def test_pieces_land_by_offset_whichever_lane_comes_first():
    n = 3 << 20                      # two lanes: pieces of 1.5 MiB, lane 1 first
    peer, eng, ours, req = _lane_peer(n, np.int32, np.add)
    assert peer.piece(n) == 3 << 19
    data = np.arange(n // 4, dtype=np.int32)
    _piece(ours[1], 0, 3 << 19, data.view(np.uint8)[3 << 19:].tobytes())
    _drive(peer, lambda: req.offset == 3 << 19)
    assert not req.done
    _piece(ours[0], 0, 0, data.view(np.uint8)[:3 << 19].tobytes())
    _drive(peer, lambda: req.done)
    assert req.error is None and not eng.violations
    np.testing.assert_array_equal(req.dst, data + 1)


@pytest.mark.parametrize("case", ["wrong-lane", "short-piece", "eager-on-lane-1", "repeat"])
def test_a_piece_off_its_lane_or_order_drops_the_peer(case):
    n = 3 << 20
    peer, eng, ours, req = _lane_peer(n)
    half = bytes(3 << 19)
    if case == "wrong-lane":          # piece 0 belongs on lane 0
        _piece(ours[1], 0, 0, half)
    elif case == "short-piece":
        _piece(ours[1], 0, 3 << 19, half[:4096])
    elif case == "eager-on-lane-1":
        ours[1].sendall(HEADER.pack(EAGER, 0, 7, -1, 8, 0, 0, 0, 0) + bytes(8))
    else:                             # lane 1's only piece, twice
        _piece(ours[1], 0, 3 << 19, half)
        _piece(ours[1], 0, 3 << 19, half)
    _drive(peer, lambda: peer.dead is not None)
    assert eng.violations and req.done and isinstance(req.error, PeerFailure), eng.violations


def test_a_connection_lost_on_any_lane_fails_the_peers_requests():
    peer, eng, ours, req = _lane_peer(3 << 20)
    ours[1].close()                   # the second connection only
    _drive(peer, lambda: req.done)
    assert isinstance(req.error, PeerFailure) and "rank 1 failed" in str(req.error)


def test_lane_count_is_checked():
    from ringlet.transport.tcp import tcp_lanes
    for bad in ("0", "17", "two"):
        os.environ["RINGLET_TCP_LANES"] = bad
        try:
            with pytest.raises(ValueError, match="RINGLET_TCP_LANES"):
                tcp_lanes()
        finally:
            del os.environ["RINGLET_TCP_LANES"]
    assert tcp_lanes() == limits.TCP_LANES


def test_socket_buffer_sizes_are_checked():
    from ringlet.transport.tcp import tcp_buffers
    for name in ("RINGLET_TCP_SNDBUF", "RINGLET_TCP_RCVBUF"):
        for bad in ("-1", "4M"):
            os.environ[name] = bad
            try:
                with pytest.raises(ValueError, match=name):
                    tcp_buffers()
            finally:
                del os.environ[name]
    assert tcp_buffers() == (limits.TCP_SNDBUF, limits.TCP_RCVBUF)


MIXED = """
import os
rank = int(os.environ["RANK"])
os.environ["RINGLET_HOST_ID"] = "hostA" if rank < 2 else "hostB"
os.environ["RINGLET_TCP_LANES"] = "{lanes}".split(",")[rank]
import numpy as np, ringlet as rl
from ringlet.runtime import engine
from ringlet.transport.tcp import TcpPeer
rl.init()
mine = int(os.environ["RINGLET_TCP_LANES"])
theirs = [int(n) for n in "{lanes}".split(",")]
for r, peer in engine().peers.items():
    if isinstance(peer, TcpPeer):   # a pair opens the fewer of its two ranks' lanes
        assert len(peer.lanes) == min(mine, theirs[r]), (rank, r, len(peer.lanes))
x = np.arange(3 << 20, dtype=np.float32) * (rank + 1)
rl.all_reduce(x, algorithm="direct")      # every pair, both ways
assert np.array_equal(x, np.arange(3 << 20, dtype=np.float32) * 10)
print("ok", rank)
rl.destroy()
"""


def test_ranks_asking_for_different_lane_counts_agree_pair_by_pair(tmp_path):
    from conftest import ringlet_run
    proc, _ = ringlet_run(tmp_path, MIXED.replace("{lanes}", "1,3,2,3"), n=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(proc.stdout.split("\n"))[-4:] == [f"[{r}] ok {r}" for r in range(4)], proc.stdout


ON_HOSTS = """
import numpy as np, ringlet as rl
from ringlet.runtime import engine
rl.init()
r = rl.get_rank()
peer = engine().peers[1 - r]
assert len(peer.lanes) == 2, len(peer.lanes)
x = np.arange(4 << 20, dtype=np.float32) * (r + 1)       # 16 MiB: 4 MiB pieces on 2 lanes
rl.all_reduce(x)
assert np.array_equal(x, np.arange(4 << 20, dtype=np.float32) * 3)
print("ok", r, flush=True)
rl.destroy()
"""


def test_lanes_between_namespace_hosts(tmp_path):
    import subprocess
    from ringlet.hosts import Hosts, HostsUnavailable
    script = tmp_path / "job.py"
    script.write_text(ON_HOSTS)
    try:
        with Hosts(2, rate=None) as hosts:
            results = hosts.wait(hosts.ringlet_run(str(script), nproc=1,
                                                   env={"RINGLET_TCP_LANES": "2"},
                                                   stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True), 90)
    except HostsUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")
    for i, (code, out, err) in enumerate(results):
        assert code == 0 and f"ok {i}" in out, f"host {i}: {err[-3000:]}"
