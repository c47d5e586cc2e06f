"""Where a large all_reduce between two hosts loses to the wire, and what several TCP
connections per peer pair buy: two emulated hosts (ringlet.hosts, unshaped veth or a tbf
link), one rank each, every variant timed turn by turn in one job (slowest rank's clock,
and CPU time: the process's, all its threads).

    .venv/bin/python bench/tcp_streams.py [--sizes 8M,64M,256M] [--turns 7] [--rate 1gbit]
    .venv/bin/python bench/tcp_streams.py --knob deal=1,2,4 [--rate 1gbit]
    .venv/bin/python bench/tcp_streams.py --knob chunk=4194304,262144
    .venv/bin/python bench/tcp_streams.py --gloo --ref gloo --knob thread_min=8388608,1099511627776
    .venv/bin/python bench/tcp_streams.py --ab RINGLET_TCP_LANES=1,RINGLET_TCP_LANES=2

Variants inside one job (default): ringlet's all_reduce; ringlet moving the same bytes
without reducing (isend/irecv of n bytes each way: the protocol's cost alone); bare
exchanges of the same bytes over k = 1, 2, 4 connections, both as threads in blocking
calls (``thread k``: bench/hosts.py's ceiling) and as one thread driving non-blocking
sockets in 4 MiB pieces (``poll 1``: what ringlet's single-threaded engine could reach),
and ``thread reduce 1``: a sender and a receiver thread whose receiver adds what it reads
into the array (a threaded all_reduce of 2 ranks, bare). ``--gloo``: torch's Gloo
all_reduce in the same job, turn by turn (``--ref gloo``: ratios against it).
``--knob thread_min=8388608,1099511627776``: messages moved by tcp.Threads from 8 MiB up,
then never (the receiver's TcpPeer.thread_min), turn by turn.

``--knob deal=1,2,4``: one job opening 4 lanes, each turn timing all_reduce and exchange
with large messages dealt over 1, 2 and 4 of them (TcpPeer.deal): A/B in one job;
``--knob chunk=4194304,262144``: the same for the bytes of a reducing piece read and
applied at a time (TcpPeer.chunk).
``--ab A,B,...``: instead, fresh jobs in turns, one per environment setting (e.g. the
stream count), each timing ringlet's all_reduce and exchange: A/B of a setting read at
init. Needs root (namespaces, tc).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIECE = 4 << 20
CHUNK = 256 << 10


def _connect(np, rl, addr, listen, streams, port_base):
    """``streams`` bare connections between the two ranks (rank 1 listens)."""
    port = port_base + streams
    if listen:
        srv = socket.create_server((addr, port))
    rl.barrier()
    socks = []
    for _ in range(streams):
        s = srv.accept()[0] if listen else socket.create_connection((addr, port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(s)
    if listen:
        srv.close()
    return socks


def _threads(socks, src, dst):
    """Blocking calls, a thread each way per connection."""
    import threading
    k, n = len(socks), len(src)
    edges = [n * i // k for i in range(k + 1)]

    def recv(sock, lo, hi):
        into, got = memoryview(dst)[lo:hi], 0
        while got < hi - lo:
            got += sock.recv_into(into[got:])

    def run():
        work = [threading.Thread(target=s.sendall, args=(memoryview(src)[lo:hi],))
                for s, lo, hi in zip(socks, edges, edges[1:])]
        work += [threading.Thread(target=recv, args=(s, lo, hi))
                 for s, lo, hi in zip(socks, edges, edges[1:])]
        for t in work:
            t.start()
        for t in work:
            t.join()
    return run


def _threads_reduce(socks, src, acc):
    """``_threads`` of one connection whose receiver reduces: it reads CHUNK bytes at a
    time into a bounce buffer and adds them into ``acc`` (float32): a threaded all_reduce
    of 2 ranks, bare (NumPy's add releases the GIL as the socket calls do)."""
    import threading
    import numpy as np
    sock, n = socks[0], len(src)
    bounce = bytearray(CHUNK)
    out = acc.reshape(-1).view(np.uint8)

    def recv():
        lo = 0
        while lo < n:
            m = min(CHUNK, n - lo)
            view, got = memoryview(bounce)[:m], 0
            while got < m:
                got += sock.recv_into(view[got:])
            a = out[lo:lo + m].view(np.float32)
            np.add(a, np.frombuffer(bounce, np.float32, m // 4), out=a)
            lo += m

    def run():
        t = threading.Thread(target=recv)
        t.start()
        sock.sendall(memoryview(src))
        t.join()
    return run


def _poll(socks, src, dst):
    """One thread, non-blocking sockets, PIECE-sized pieces dealt round robin (piece i on
    connection i % k), sleeping in select when nothing moves: ringlet's engine, bare."""
    k, n = len(socks), len(src)
    for s in socks:
        s.setblocking(False)
    pieces = [(lo, min(lo + PIECE, n)) for lo in range(0, n, PIECE)]
    sel = selectors.DefaultSelector()

    def run():
        out = [[p for i, p in enumerate(pieces) if i % k == j] for j in range(k)]
        inn = [list(o) for o in out]
        spos, rpos = [0] * k, [0] * k
        left = 2 * n
        sv, dv = memoryview(src), memoryview(dst)
        while left:
            moved = False
            for j, s in enumerate(socks):
                while out[j]:
                    lo, hi = out[j][0]
                    try:
                        m = s.send(sv[lo + spos[j]:hi])
                    except BlockingIOError:
                        break
                    moved, left = True, left - m
                    spos[j] += m
                    if lo + spos[j] == hi:
                        out[j].pop(0)
                        spos[j] = 0
                while inn[j]:
                    lo, hi = inn[j][0]
                    try:
                        m = s.recv_into(dv[lo + rpos[j]:hi])
                    except BlockingIOError:
                        break
                    moved, left = True, left - m
                    rpos[j] += m
                    if lo + rpos[j] == hi:
                        inn[j].pop(0)
                        rpos[j] = 0
            if not moved and left:
                for j, s in enumerate(socks):
                    ev = (selectors.EVENT_READ if inn[j] else 0) | \
                         (selectors.EVENT_WRITE if out[j] else 0)
                    if ev:
                        sel.register(s, ev)
                sel.select(0.1)
                for s in list(sel.get_map().values()):
                    sel.unregister(s.fileobj)
    return run


def job(spec_path: str) -> None:
    import numpy as np
    import ringlet as rl
    with open(spec_path) as f:
        spec = json.load(f)
    rl.init()
    r = rl.get_rank()
    peer = 1 - r
    addr = spec["addrs"][1]
    out = {}
    conns = {}
    if spec.get("bare", True):
        for k in (1, 2, 4):
            conns[("thread", k)] = _connect(np, rl, addr, r == 1, k, 29600)
        conns[("poll", 1)] = _connect(np, rl, addr, r == 1, 1, 29610)
        conns[("thread reduce", 1)] = _connect(np, rl, addr, r == 1, 1, 29620)
    if spec.get("gloo"):
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
    from ringlet.runtime import engine
    tcp = engine().peers[peer]

    attr, values = spec.get("knob") or ("deal", [len(tcp.lanes)])

    def knob(k, fn):      # TcpPeer.<attr> = k (both ranks switch between turns)
        def run():
            setattr(tcp, attr, k)
            fn()
        return run
    for nbytes in spec["sizes"]:
        x = np.ones(nbytes // 4, np.float32)
        src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)

        def exchange():
            w = rl.irecv(dst, peer)
            rl.send(src, peer)
            w.wait()
        runs = {}
        for k in values:
            runs[f"all_reduce {attr}={k}"] = knob(k, lambda: rl.all_reduce(x))
            runs[f"exchange {attr}={k}"] = knob(k, exchange)
        if spec.get("gloo"):
            y = torch.ones(nbytes // 4)
            runs["gloo"] = lambda: dist.all_reduce(y)
        for (how, k), socks in conns.items():
            if how == "thread reduce":
                runs[f"{how} {k}"] = _threads_reduce(socks, src, x)
            else:
                runs[f"{how} {k}"] = (_threads if how == "thread" else _poll)(socks, src, dst)
        times = {name: [] for name in runs}
        cpu = {name: [] for name in runs}
        sys_ = {name: [] for name in runs}
        for turn in range(spec["turns"] + 1):
            for name, fn in runs.items():
                rl.barrier()
                t, c = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                fn()
                c1 = resource.getrusage(resource.RUSAGE_SELF)   # (all the process's threads)
                dt = np.array([time.perf_counter() - t,
                               c1.ru_utime - c.ru_utime + c1.ru_stime - c.ru_stime,
                               c1.ru_stime - c.ru_stime])
                rl.all_reduce(dt, op=rl.ReduceOp.MAX)
                if turn:
                    times[name].append(float(dt[0]))
                    cpu[name].append(float(dt[1]))
                    sys_[name].append(float(dt[2]))
        out[nbytes] = {"time": times, "cpu": cpu, "sys": sys_}
    if r == 0:
        print("RESULT " + json.dumps(out), flush=True)
    for socks in conns.values():
        for s in socks:
            s.close()
    if spec.get("gloo"):
        dist.destroy_process_group()
    rl.destroy()


def _launch(hosts, spec, env, timeout):
    path = f"/tmp/tcp-streams-{os.getpid()}.json"
    with open(path, "w") as f:
        json.dump(spec, f)
    from hosts import tagged_job      # bench/hosts.py (this script's directory)
    try:
        return tagged_job(hosts, os.path.abspath(__file__), 1, ["--job", path],
                          {"PYTHONPATH": ROOT, **env}, timeout, "RESULT")
    finally:
        os.unlink(path)


def _size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s.rstrip("KMG")) * mult


def _table(merged, ref):
    print(f"{'size':>8}  {'variant':<28}{'median ms':>10}{'min':>8}{'max':>8}{'CPU ms':>8}"
          f"{'sys':>7}  vs {ref}")
    for nb in sorted(merged, key=int):
        cell = merged[nb]
        base = statistics.median(cell["time"][ref]) if ref in cell["time"] else None
        for name, ts in cell["time"].items():
            t = statistics.median(ts)
            print(f"{int(nb) >> 20:>6}Mi  {name:<28}{t * 1e3:>10.2f}{min(ts) * 1e3:>8.2f}"
                  f"{max(ts) * 1e3:>8.2f}{statistics.median(cell['cpu'][name]) * 1e3:>8.1f}"
                  f"{statistics.median(cell.get('sys', cell['cpu'])[name]) * 1e3:>7.1f}"
                  f"{(t / base if base else float('nan')):>8.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="8M,64M,256M")
    ap.add_argument("--turns", type=int, default=7)
    ap.add_argument("--rate", default=None, help="tc rate of the link (default: unshaped)")
    ap.add_argument("--ab", help="comma-separated VAR=VALUE settings (VAR=VALUE+VAR2=VALUE2: "
                    "both): fresh jobs in turns")
    ap.add_argument("--rounds", type=int, default=3, help="--ab: jobs per setting")
    ap.add_argument("--knob", help="NAME=V1,V2,...: in one job, TcpPeer.NAME set to each value "
                    "in turn (deal=1,2,4: lanes a large message is dealt over, opening the "
                    "most; chunk=4194304,262144: bytes of a reducing piece read at a time); "
                    "no bare variants")
    ap.add_argument("--gloo", action="store_true", help="also torch's Gloo all_reduce, in "
                    "the same job, turn by turn")
    ap.add_argument("--ref", help="the variant ratios are taken against")
    ap.add_argument("--timeout", type=float, default=500)
    a = ap.parse_args(argv)
    if a.job:
        job(a.job)
        return 0
    from ringlet import hosts as hosts_mod
    hosts_mod.PREFIX = os.environ.get("RINGLET_HOSTS_PREFIX", "tcpst")   # tcpst<pid>-<i>
    sizes = [_size(s) for s in a.sizes.split(",")]
    env = {"RINGLET_LINK_RATE": a.rate} if a.rate else {}
    if a.gloo:
        env["GLOO_SOCKET_IFNAME"] = "eth0"
    load0 = open("/proc/loadavg").read().split()[:3]
    with hosts_mod.Hosts(2, rate=a.rate) as hosts:
        spec = {"sizes": sizes, "turns": a.turns, "addrs": hosts.addrs, "gloo": a.gloo}
        if a.knob:
            name, values = a.knob.split("=")
            values = [int(v) for v in values.split(",")]
            if name == "deal":
                env["RINGLET_TCP_LANES"] = str(max(values))
            merged = _launch(hosts, {**spec, "knob": (name, values), "bare": False}, env,
                             a.timeout)
            ref = f"all_reduce {name}={values[0]}"
        elif not a.ab:
            merged = _launch(hosts, spec, env, a.timeout)
            ref = "thread 1"
        else:
            settings = a.ab.split(",")
            merged = {}
            for _ in range(a.rounds):
                for setting in settings:
                    sets = dict(kv.split("=", 1) for kv in setting.split("+"))
                    res = _launch(hosts, {**spec, "bare": False}, {**env, **sets}, a.timeout)
                    for nb, cell in res.items():
                        m = merged.setdefault(nb, {"time": {}, "cpu": {}, "sys": {}})
                        for what in ("time", "cpu", "sys"):
                            for name, ts in cell[what].items():
                                m[what].setdefault(f"{setting} {name}", []).extend(ts)
            ref = next(iter(merged[next(iter(merged))]["time"]))
    load1 = open("/proc/loadavg").read().split()[:3]
    print(f"\n== 2 hosts x 1 rank, link {a.rate or 'unshaped veth'}; load before "
          f"{' '.join(load0)}, after {' '.join(load1)}")
    _table(merged, a.ref or ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
