"""Collectives on emulated hosts (ringlet.hosts: network namespaces with their own hostname
and /dev/shm, joined by tbf-shaped links): measured against the cost model's prediction.
Needs root (namespaces, tc).

    .venv/bin/python bench/hosts.py [--layouts 2x2,2x4] [--rates 1gbit,10gbit]
        [--sizes 64K,1M,16M,64M] [--collectives all_reduce,all_gather,...] [--json out.json]
        [--blocks 3] [--iters 3,1]
    .venv/bin/python bench/hosts.py --layouts 2x2 --rates 1gbit --place 2,1M,16M
    .venv/bin/python bench/hosts.py --layouts 2x1,2x2 --rates unshaped,1gbit --sizes 8M,64M --gloo
    .venv/bin/python bench/hosts.py --layouts 2x2,2x4 --rates 10gbit --calibrations 3
    .venv/bin/python bench/hosts.py --reprice out.json [--machine 2,0.7e-9[,FREE]] [--all-cores]

For every layout (hosts x ranks per host) and link rate it builds the hosts, calibrates
the link between them (the payload rate of one TCP stream each way, and what m streams
each way reach together: ``Topology.shared``; the CPU a byte between the hosts costs,
measured through ringlet's own transport by m pairs of ranks, and the cores the job's
ranks get beside other processes' load: ``cost.host.Machine``; ``--rate-only`` skips this
and prices the link from its rate), writes that into the profile every rank reads (RINGLET_PROFILE), then
launches ``ringlet run --nnodes H --node-rank i --master-addr <host 0>`` inside each
namespace (one job: shared memory inside a host, TCP between) and times every algorithm
of every collective at every size, forced and under ``auto``, as bench/accuracy.py does:
after a warm-up call of each, ``--blocks`` interleaved blocks of all of them, each block
in its own shuffled order, ``--iters`` timed calls of each per block (the slowest rank's
time of a call); an algorithm's time is its fastest block's median. Beside it: the time the
cost model predicts for the very schedule (with the profile ``auto`` used), the link
utilisation (bus bandwidth / link rate) and, per size, the measured and the predicted
winner, auto's pick (judged, as the predicted winner, by its forced time; its own call is
the same schedule timed once more, so it is judged beside with its noise), and flat
against hierarchical. ``--reprice`` prices an earlier run's cells with this model and
picks auto again as its ranks would now. Hosts are always torn down. Last, every call is
priced again for ``--what-if`` hosts x ranks (default 64x8) of the seeds' tiers, beside
what was measured.

``--place TP,TP_BYTES,DP_BYTES`` instead measures one ``ringlet place`` case: a
tensor x data parallel step's communication under the naive and the proposed rank ->
host mapping, turn by turn. ``--gloo`` instead compares all_reduce with torch's Gloo on
the same ranks, turn by turn (``unshaped``: plain veth between the namespaces).

The winner rule. The predicted winner (and auto's pick) is right where its measured time is
within 10% of the best algorithm's - or where the best two measured algorithms are tied
within the run's noise and it names either of them. Tied: the runner-up is not slower
than the winner in every block (the blocks are interleaved, so a slow spell hits both
alike, and the order flipping between blocks of the same run is its evidence that the two
differ by less than its noise). The noise is never assumed: rows of runs made before blocks
(one call per "block", not interleaved) never tie; each cell prints the runner-up's time
over the winner's in each block, and the summary says how many sizes were right only by
the tie. (2 x 4 at 10 Gbit/s, best of 2-3 single calls: two quiet runs 7.6% apart per
cell named the right winner in 10/20 and 17/20 sizes - the count turned on noise between
algorithms priced nearly equal.)

On a 2-core machine 2 x 4 ranks are 8 processes on 2 cores: oversubscribed, and the table
says so. Sizes are per-rank buffers (all_gather / reduce_scatter: the gathered array, as in
ringlet.cost.model); bus bandwidth is nccl-tests' (bytes a rank must move, over time).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accuracy import block_order, cell_times  # noqa: E402  (bench/accuracy.py: one method)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
#: algorithms left out: they only exist to be beaten (each moves p-1 times the data)
SLOW = {("all_reduce", "naive_ring"), ("all_reduce", "direct")}
#: tbf's bucket, seconds at the link rate (ringlet.hosts): the table and the placement case
#: on a link where a 64 KiB message sees the rate; --gloo (the line rate) on the wide one,
#: where a large transfer keeps all of it
FINE, WIDE = 200e-6, 2e-3


def bucket_for(rate, bucket=None):
    """FINE below 10 Gbit/s (there a 200 us bucket is 250 KB, and a late timer would cost
    rate, not spare a 64 KiB message: 52 us on such a link); else WIDE."""
    from ringlet.cost.profile import parse_rate
    if bucket:
        return bucket
    return FINE if rate not in (None, "none", "unshaped") and parse_rate(rate) < 1.25e9 else WIDE


# ---------------------------------------------------------------- the job (each rank)

def _call(rl, collective, bufs, algorithm):
    if collective == "all_reduce":
        rl.all_reduce(bufs[0], algorithm=algorithm)
    elif collective == "broadcast":
        rl.broadcast(bufs[0], 0, algorithm=algorithm)
    elif collective == "all_gather":
        rl.all_gather(bufs[0], bufs[1], algorithm=algorithm)
    elif collective == "reduce_scatter":
        rl.reduce_scatter(bufs[0], bufs[1], algorithm=algorithm)
    else:
        rl.all_to_all(bufs[0], bufs[1], algorithm=algorithm)


def _buffers(np, collective, p, nbytes):
    n = max(1, nbytes // 4)
    if collective in ("all_gather", "reduce_scatter"):
        block = max(1, n // p)
        big, small = np.ones((p, block), np.float32), np.ones(block, np.float32)
        return (big, small) if collective == "all_gather" else (small, big)
    if collective == "all_to_all":
        block = max(1, n // p)
        return np.ones((p, block), np.float32), np.ones((p, block), np.float32)
    return (np.ones(n, np.float32),)


def job(spec_path: str) -> None:
    import numpy as np
    import ringlet as rl
    from ringlet import cost
    from ringlet.runtime import job_profile
    with open(spec_path) as f:
        spec = json.load(f)
    rl.init()
    r, p = rl.get_rank(), rl.get_world_size()
    hosts = rl.runtime._S.world.host_indices()
    for collective, algorithms, nbytes, blocks, iters in spec["cells"]:
        bufs = _buffers(np, collective, p, nbytes)
        nb = max(b.nbytes for b in bufs)     # the size convention of ringlet.cost.model
        chosen = cost.choose(collective, nb, p, topology=job_profile(), hosts=hosts)[0]
        for algorithm in algorithms:         # a warm-up call of each
            _call(rl, collective, bufs, algorithm)
        # interleaved blocks, each in its own shuffled order (bench/accuracy.py): a slow
        # spell of the machine hits every algorithm of the cell alike
        times = {a: [] for a in algorithms}
        for blk in range(blocks):
            for algorithm in block_order(algorithms, (collective, nb), blk):
                for _ in range(iters):
                    rl.barrier()
                    t = time.perf_counter()
                    _call(rl, collective, bufs, algorithm)
                    times[algorithm].append(time.perf_counter() - t)
        slowest = np.array([times[a] for a in algorithms])     # the slowest rank's, per call
        rl.all_reduce(slowest, op=rl.ReduceOp.MAX)
        if r == 0:
            for algorithm, row in zip(algorithms, slowest.tolist()):
                print("CELL " + json.dumps({
                    "collective": collective, "algorithm": algorithm, "nbytes": nb,
                    "times": row, "blocks": [row[b * iters:(b + 1) * iters]
                                             for b in range(blocks)],
                    "auto": chosen}), flush=True)
    rl.destroy()


def place_job(spec: dict) -> None:
    """Time one training step's communication (every comm's groups at once, kind after
    kind, algorithm auto) under each mapping of logical ranks to hosts, turn by turn."""
    import numpy as np
    import ringlet as rl
    rl.init()
    r, m = rl.get_rank(), int(os.environ["LOCAL_WORLD_SIZE"])
    plans = {}
    for name, host_of in spec["mappings"].items():
        slots: dict = {}      # host -> its world ranks not yet given out
        world = [next(slots.setdefault(h, iter(range(h * m, (h + 1) * m)))) for h in host_of]
        mine = []
        for comm in spec["comms"]:
            for group in comm["groups"]:
                g = rl.new_group(sorted(world[x] for x in group))   # every rank, same order
                if r in g.ranks:
                    mine.append((g, np.ones(comm["nbytes"] // 4, np.float32)))
        plans[name] = mine
    times = {name: [] for name in plans}
    for turn in range(spec["turns"] + 1):
        for name, mine in plans.items():
            rl.barrier()
            t = time.perf_counter()
            for g, buf in mine:
                rl.all_reduce(buf, group=g)
            dt = np.array([time.perf_counter() - t])
            rl.all_reduce(dt, op=rl.ReduceOp.MAX)
            if turn:
                times[name].append(float(dt[0]))
    if r == 0:
        print("PLACE " + json.dumps(times), flush=True)
    rl.destroy()


def placement(rate, layout, tp, tp_bytes, dp_bytes, turns, timeout, bucket=FINE):
    """``ringlet place``'s proposal for tensor x data parallel on the hosts (their link
    calibrated first), measured."""
    from ringlet import cost
    from ringlet.cost.place import place, tensor_data_parallel
    from ringlet.hosts import Hosts
    h, m = layout
    comms = tensor_data_parallel(tp, h * m // tp, tp_bytes, dp_bytes)
    spec_path = f"/tmp/ringlet-bench-place-{os.getpid()}.json"
    try:
        with Hosts(h, rate=rate, bucket=bucket) as hosts:
            prof = calibrate_link(hosts, m, rate, cost.load_profile())
            plan = place(comms, h, m, intra=prof.link("shm"), inter=prof.link("inter"),
                         gamma=prof.gamma("shm"), shared=prof.shared())
            print(f"\n== placement: tp {tp} x dp {h * m // tp}, tp all_reduce "
                  f"{cost.format_size(tp_bytes)}, dp all_reduce {cost.format_size(dp_bytes)}, "
                  f"{h} hosts x {m} ranks, link {rate}")
            print(plan)
            spec = {"mappings": {"naive": plan.naive_hosts, "proposed": plan.hosts},
                    "turns": turns, "comms": [{"groups": c.groups, "nbytes": c.nbytes}
                                              for c in comms]}
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   "RINGLET_LINK_RATE": rate}
            procs = hosts.ringlet_run(os.path.abspath(__file__), nproc=m,
                                      args=["--place-job", spec_path], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            results = hosts.wait(procs, timeout)
    finally:
        if os.path.exists(spec_path):
            os.unlink(spec_path)
    for i, (code, o, e) in enumerate(results):
        if code:
            raise RuntimeError(f"host {i} failed ({code}): {e[-3000:]}")
    times = next(json.loads(line.split("PLACE ", 1)[1]) for _, o, _ in results
                 for line in o.splitlines() if "PLACE " in line)
    for name, pred in (("naive", plan.naive_time), ("proposed", plan.time)):
        t = times[name]
        print(f"{name:<9} predicted {pred * 1e3:9.2f} ms   measured best {min(t) * 1e3:9.2f} ms, "
              f"median {statistics.median(t) * 1e3:9.2f} ms over {len(t)} turns")
    order = (min(times["naive"]) > min(times["proposed"])) == (plan.naive_time > plan.time)
    print(f"measured in the predicted order: {'yes' if order else 'NO'}; load {os.getloadavg()[0]:.1f}")


def bare_exchange(np, peer_addr: str, nbytes: int, listen: bool, streams: int = 1,
                  sockbuf: int = 0):
    """The wire's floor for an all_reduce of two ranks: what any algorithm must move (n
    bytes each way) exchanged over ``streams`` bare TCP connections (n/streams each), both
    directions at once, with no protocol and no reduction; ``sockbuf``: SO_SNDBUF and
    SO_RCVBUF (0: the kernel's autotuning). Returns the exchange (a function) and the
    sockets."""
    import socket
    import threading
    from ringlet.launch import free_port
    import ringlet as rl
    port = np.array([free_port(peer_addr) if listen else 0], np.int64)
    if listen:
        srv = socket.create_server((peer_addr, int(port[0])))
    rl.broadcast(port, 1)                     # rank 1 listens, rank 0 connects
    socks = []
    for _ in range(streams):
        if listen:
            sock = srv.accept()[0]
        else:
            sock = socket.socket()
            if sockbuf:           # before connecting: the window scale is agreed then
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sockbuf)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sockbuf)
            sock.connect((peer_addr, int(port[0])))
        if sockbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sockbuf)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sockbuf)
        socks.append(sock)
    if listen:
        srv.close()
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    edges = [nbytes * i // streams for i in range(streams + 1)]

    def recv(sock, lo, hi):
        into, got = memoryview(dst)[lo:hi], 0
        while got < hi - lo:
            got += sock.recv_into(into[got:])

    def exchange():   # blocking calls, a thread each way per stream: no spinning
        work = [threading.Thread(target=sock.sendall, args=(memoryview(src)[lo:hi],))
                for sock, lo, hi in zip(socks, edges, edges[1:])]
        work += [threading.Thread(target=recv, args=(sock, lo, hi))
                 for sock, lo, hi in zip(socks[1:], edges[1:], edges[2:])]
        for t in work:
            t.start()
        recv(socks[0], edges[0], edges[1])
        for t in work:
            t.join()
    return exchange, socks


#: the bare exchanges --gloo times beside ringlet and Gloo: (streams, socket buffer bytes)
BARE = {"bare": (1, 0), "bare 2 streams": (2, 0), "bare 4 streams": (4, 0),
        "bare 4 MiB buffers": (1, 4 << 20), "bare 2 streams, 4 MiB": (2, 4 << 20)}


def gloo_job(spec: dict) -> None:
    """ringlet's all_reduce (auto) against torch's Gloo, turn by turn, on the same ranks;
    with two ranks also bare exchanges of the same bytes (the wire's floor), over one or
    several connections, with the kernel's or fixed socket buffers (BARE)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import ringlet as rl
    rl.init()
    dist.init_process_group("gloo")
    r, p = rl.get_rank(), rl.get_world_size()
    out = {}
    for nbytes in spec["sizes"]:
        x = np.ones(nbytes // 4, np.float32)
        y = torch.ones(nbytes // 4)
        runs = {"ringlet": lambda: rl.all_reduce(x), "gloo": lambda: dist.all_reduce(y)}
        socks = []
        if p == 2:
            for name, (streams, sockbuf) in BARE.items():
                runs[name], s = bare_exchange(np, spec["addrs"][1], nbytes, r == 1, streams,
                                              sockbuf)
                socks += s
        times = {k: [] for k in runs}
        cpu = {k: [] for k in runs}
        for turn in range(spec["turns"] + 1):
            for name, fn in runs.items():
                rl.barrier()
                t, c = time.perf_counter(), time.process_time()
                fn()
                # the clock, and the CPU the process (all its threads) spent: load moves
                # the first far more than the second
                dt = np.array([time.perf_counter() - t, time.process_time() - c])
                rl.all_reduce(dt, op=rl.ReduceOp.MAX)
                if turn:
                    times[name].append(float(dt[0]))
                    cpu[name].append(float(dt[1]))
        for s in socks:
            s.close()
        out[nbytes] = {"time": times, "cpu": cpu}
    if r == 0:
        print("GLOO " + json.dumps(out), flush=True)
    dist.destroy_process_group()
    rl.destroy()


def tagged_job(hosts, script, m, argv, env, timeout, tag, what="host"):
    """Run ``script argv`` as one ringlet job on every host (m ranks each) and return the
    JSON a rank printed after ``tag``; a failed host raises, with its stderr's tail."""
    procs = hosts.ringlet_run(script, nproc=m, args=argv, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    results = hosts.wait(procs, timeout)
    for i, (code, o, e) in enumerate(results):
        if code:
            raise RuntimeError(f"{what} {i} failed ({code}): {e[-3000:]}")
    return next(json.loads(line.split(tag + " ", 1)[1]) for _, o, _ in results
                for line in o.splitlines() if tag + " " in line)


def versus_gloo(rate, layout, sizes, turns, timeout, bucket=WIDE):
    from ringlet.cost import format_size
    from ringlet.hosts import Hosts
    h, m = layout
    p = h * m
    spec_path = f"/tmp/ringlet-bench-gloo-{os.getpid()}.json"
    with open(spec_path, "w") as f:
        json.dump({"sizes": sizes, "turns": turns}, f)
    shaped = rate not in ("none", "unshaped")
    try:
        with Hosts(h, rate=rate if shaped else None, bucket=bucket) as hosts:
            with open(spec_path, "w") as f:
                json.dump({"sizes": sizes, "turns": turns, "addrs": hosts.addrs}, f)
            env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   "GLOO_SOCKET_IFNAME": "eth0"}
            if shaped:
                env["RINGLET_LINK_RATE"] = rate
            out = tagged_job(hosts, os.path.abspath(__file__), m, ["--gloo-job", spec_path],
                             env, timeout, "GLOO")
    finally:
        os.unlink(spec_path)
    print(f"\n== all_reduce, ringlet (auto) vs Gloo, turn by turn ({turns} turns, medians): "
          f"{h} hosts x {m} ranks, link {rate if shaped else 'unshaped veth'}; "
          f"load {os.getloadavg()[0]:.1f}")
    bare = "bare" in next(iter(out.values()))["time"]
    print(f"{'size':>8}{'ringlet ms':>12}{'Gloo ms':>10}{'Gloo/ringlet':>14}"
          + (f"{'bare ms':>9}{'bare/ringlet':>14}" if bare else "")
          + f"{'CPU ms: ringlet':>17}{'Gloo':>7}" + (f"{'bare':>7}" if bare else "")
          + f"{'ringlet busbw':>15}" + ("  of the link" if shaped else ""))
    for nb, cell in out.items():
        nb, times, cpu = int(nb), cell["time"], cell["cpu"]
        ours, theirs = statistics.median(times["ringlet"]), statistics.median(times["gloo"])
        floor = ""
        if bare:
            b = statistics.median(times["bare"])
            floor = f"{b * 1e3:>9.2f}{b / ours:>14.2f}"
        work = "".join(f"{statistics.median(cpu[k]) * 1e3:>{w}.1f}"
                       for k, w in (("ringlet", 17), ("gloo", 7), ("bare", 7)) if k in cpu)
        bus = nb * 2 * (p - 1) / p / ours
        util = ""
        if shaped:
            from ringlet.cost.profile import parse_rate
            util = f"{bus / parse_rate(rate):>13.0%}"
        print(f"{format_size(nb):>8}{ours * 1e3:>12.2f}{theirs * 1e3:>10.2f}{theirs / ours:>14.2f}"
              f"{floor}{work}{bus * 8 / 1e9:>10.2f} Gbit/s{util}")
    if bare:
        print("bare: the same bytes (n each way) over one bare TCP connection, both ways at "
              "once, no protocol, no reduction: the floor for any all_reduce of 2 ranks")
        # the floor with what the kernel offers: several connections, fixed socket buffers
        print(f"{'size':>8}  {'bare variant':<24}{'median ms':>10}{'CPU ms':>8}"
              f"{'Gloo/variant':>14}{'ringlet/variant':>17}")
        for nb, cell in out.items():
            times, cpu = cell["time"], cell["cpu"]
            theirs, ours = statistics.median(times["gloo"]), statistics.median(times["ringlet"])
            variants = sorted((k for k in times if k.startswith("bare")),
                              key=lambda k: statistics.median(times[k]))
            for k in variants:
                t = statistics.median(times[k])
                print(f"{format_size(int(nb)):>8}  {k:<24}{t * 1e3:>10.2f}"
                      f"{statistics.median(cpu[k]) * 1e3:>8.1f}{theirs / t:>14.2f}{ours / t:>17.2f}")
        print("the fastest variant is the ceiling: Gloo/variant is the most any all_reduce of "
              "2 ranks could beat Gloo by on this machine")


# ---------------------------------------------------------------- the driver

def cells(collectives, sizes, blocks, iters_small, iters_large):
    from ringlet.cost.model import ALGORITHMS
    out = []
    for collective in collectives:
        algs = [a for a in ALGORITHMS[collective] if (collective, a) not in SLOW] + ["auto"]
        for nb in sizes:
            out.append((collective, algs, nb, blocks,
                        iters_small if nb < (4 << 20) else iters_large))
    return out


def block_medians(row) -> list:
    """A measured row's time per block: the median of its calls there (the slowest rank's
    each). A row of an older run (no blocks) is one block per call."""
    return [statistics.median(b) for b in row.get("blocks") or [[t] for t in row["times"]]]


def measured(row) -> float:
    """A row's measured time: its fastest block (bench/accuracy.py's cell_times)."""
    return cell_times({0: block_medians(row)})[0]


def separation(first, second) -> tuple:
    """(separated, the runner-up's time over the winner's in each block) of a cell's best
    two measured algorithms. Separated: slower in every block of the run, the blocks
    interleaved (a slow spell of the machine hits both alike); tied: the order flips in at
    least one block - the run's own evidence that they differ by less than its noise.
    Runs without blocks (one call per block), or with one block, never tie."""
    a, b = block_medians(first), block_medians(second)
    ratios = [y / x for x, y in zip(a, b) if x > 0]
    if not (first.get("blocks") and second.get("blocks")) or len(ratios) < 2:
        return True, ratios
    return min(ratios) > 1.0, ratios


_PEER = """
import resource, socket, sys, threading, time
listen, addr, nbytes, at, ports = sys.argv[1] == "1", sys.argv[2], int(sys.argv[3]), \\
    float(sys.argv[4]), sys.argv[5:]
if listen:
    srvs = [socket.create_server(("0.0.0.0", int(port))) for port in ports]
    print("ready", flush=True)
    socks = [srv.accept()[0] for srv in srvs]
else:
    socks = [socket.create_connection((addr, int(port))) for port in ports]
data = bytes(nbytes)
def send(s):
    s.sendall(data)
def recv(s):
    buf, got = bytearray(4 << 20), 0      # as ringlet's TCP receives: 4 MiB at a time
    while got < nbytes:
        got += s.recv_into(buf, min(len(buf), nbytes - got))
threads = [threading.Thread(target=f, args=(s,)) for s in socks for f in (send, recv)]
time.sleep(max(0.0, at - time.time()))     # every stream starts together
# the transfer's CPU only: the interpreter's start and bytes(n) had been ~0.1 s of it
u = resource.getrusage(resource.RUSAGE_SELF)
c, t = u.ru_utime + u.ru_stime, time.time()
for th in threads: th.start()
for th in threads: th.join()
u = resource.getrusage(resource.RUSAGE_SELF)
print(t, time.time(), u.ru_utime + u.ru_stime - c, flush=True)
"""


def link_rate(hosts, flows: int, nbytes: int) -> tuple[float, float]:
    """Payload bytes/s per direction that ``flows`` TCP streams each way between hosts 0
    and 1 reach together (each direction's data meets the other's ACKs, as in a ring),
    and the CPU seconds spent per byte carried. One process per host, as a rank: a thread
    sends and a thread receives on each stream. Its CPU includes the kernel's work that
    is charged to it - an emulated link's work, on the cores the hosts share."""
    ports = [str(30100 + f) for f in range(flows)]
    start = time.time() + 1.5
    listener = hosts.popen(1, [sys.executable, "-c", _PEER, "1", "", str(nbytes), str(start),
                               *ports], stdout=subprocess.PIPE, text=True)
    if listener.stdout.readline().strip() != "ready":
        raise RuntimeError("link calibration: the listening peer did not start")
    peers = [hosts.popen(0, [sys.executable, "-c", _PEER, "0", hosts.addrs[1], str(nbytes),
                             str(start), *ports], stdout=subprocess.PIPE, text=True), listener]
    spans = [tuple(map(float, p.communicate(timeout=120)[0].split())) for p in peers]
    seconds = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
    return flows * nbytes / seconds, sum(c for _, _, c in spans) / (2 * flows * nbytes)


#: bytes each way per call (over the m pairs) at which the link's CPU is measured through
#: ringlet: a line through them separates a call's fixed work from its work per byte
CPU_SIZES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)


def _cpu_seconds() -> float:
    import resource
    u = resource.getrusage(resource.RUSAGE_SELF)     # every thread of this rank
    return u.ru_utime + u.ru_stime


def cpu_job(spec: dict) -> None:
    """A rank of the link's CPU calibration (2 hosts x m ranks): each rank exchanges n/m
    bytes each way with its counterpart on the other host through ringlet's own transport
    (irecv + isend, as a step of a ring), every pair at once; rank 0 prints, per call, the
    bytes carried, the CPU of all ranks (user + system: the kernel's TCP and veth work
    charged to them) and the slowest rank's clock."""
    import numpy as np
    import ringlet as rl
    rl.init()
    r, p = rl.get_rank(), rl.get_world_size()
    m = p // 2
    hosts = rl.runtime._S.world.host_indices()
    peer = (r + m) % p
    if hosts[peer] == hosts[r]:
        raise RuntimeError(f"cpu_job: rank {r}'s counterpart {peer} is on its own host")
    bufs = [(nb, np.ones(max(1, nb // m), np.uint8), np.ones(max(1, nb // m), np.uint8))
            for nb in spec["sizes"]]
    samples = []
    for turn in range(spec["turns"] + 1):
        for nb, src, dst in bufs:
            rl.barrier()
            t, c = time.perf_counter(), _cpu_seconds()
            for w in [rl.irecv(dst, peer), rl.isend(src, peer)]:
                w.wait()
            cpu = np.array([_cpu_seconds() - c])
            wall = np.array([time.perf_counter() - t])
            rl.all_reduce(cpu)
            rl.all_reduce(wall, op=rl.ReduceOp.MAX)
            if turn:
                samples.append([2 * m * src.nbytes, float(cpu[0]), float(wall[0])])
    if r == 0:
        print("LINKCPU " + json.dumps(samples), flush=True)
    rl.destroy()


#: the calibration's ranks sleep as soon as they wait (no yielding, no spinning while the
#: machine is idle): a waiting rank's CPU would grow with the transfer's time, not its
#: bytes, and in a job it is given up to any rank with work (yielding) or taken from idle
#: cores. (Under load 13-17 it made no difference: 2x2 at 1 Gbit/s 1.83 and 1.81 ns per
#: byte without, 1.88 and 1.44 with; there the yields find other processes to run.)
NO_WAITING = {"RINGLET_YIELD_US": "0", "RINGLET_IDLE_SPIN_US": "0"}


def link_cpu_ringlet(hosts, m, turns=5, timeout=180.0, waiting=False):
    """CPU seconds per byte between hosts 0 and 1 and per call (``cost.host.link_cpu``),
    measured through ringlet's transport (``cpu_job``, m ranks per host; unless
    ``waiting``, ranks that sleep as soon as they wait: NO_WAITING), the samples, and the
    payload rate (bytes/s each way) of the fastest call at the largest size."""
    from ringlet.cost.host import link_cpu
    spec_path = f"/tmp/ringlet-bench-cpu-{os.getpid()}.json"
    with open(spec_path, "w") as f:
        json.dump({"sizes": list(CPU_SIZES), "turns": turns}, f)
    try:
        env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **({} if waiting else NO_WAITING)}
        samples = tagged_job(hosts, os.path.abspath(__file__), m, ["--cpu-job", spec_path],
                             env, timeout, "LINKCPU", "link CPU calibration: host")
    finally:
        os.unlink(spec_path)
    per_byte, per_call = link_cpu([(b, c) for b, c, _ in samples])
    big = max(b for b, _, _ in samples)
    rate = max(b / 2 / w for b, _, w in samples if b == big)
    return per_byte, per_call, samples, rate


_SPIN = """
import resource, sys, time
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
c, t = cpu(), time.perf_counter()
while time.perf_counter() - t < float(sys.argv[1]):
    pass
print((cpu() - c) / (time.perf_counter() - t))
"""


def cores_available(n: int, seconds: float = 1.0) -> float:
    """The cores n busy processes get together on this machine now: all of them on a
    quiet machine, their share beside the other processes that keep it busy (the ranks of
    a job share the cores with those the same way). Tables measured at load 8-17 (other
    jobs), priced with every core / with this (before and after the job, 0.4-1.4 cores):
    10 Gbit/s 2x2 median error 56% / 32%, 79% / 33%; 2x4 80% / 50%; 1 Gbit/s 2x2 31% / 21%,
    2x4 62% / 34% - the predicted winner moved by -3 to +2 sizes of 20-25 either way."""
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN, str(seconds)],
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]
    got = sum(float(p.communicate(timeout=60)[0]) for p in procs)
    cores = os.cpu_count() or 1
    return min(float(cores), max(got, 0.05))


def calibrate_link(hosts, m, rate, base, all_cores=False):
    """The profile for these hosts: the payload rate one TCP stream each way reaches on the
    link (or m streams, if faster; TCP's goodput if both are far short of it), the
    fraction of it m streams each way reach together (best of 2 each), and - the hosts
    share this machine's cores - the CPU a byte between them costs (the least of the
    runs)."""
    from ringlet.cost.profile import parse_rate
    nbytes = int(min(64 << 20, max(16 << 20, parse_rate(rate) * 0.25)))
    runs = [link_rate(hosts, 1, nbytes) for _ in range(2)]
    one = max(r for r, _ in runs)
    if m > 1:
        runs2 = [link_rate(hosts, m, nbytes // m) for _ in range(2)]
        many = max(r for r, _ in runs2)
        runs += runs2
    else:
        many = one
    shared = min(1.0, many / one)
    bare = min(c for _, c in runs)
    # the CPU a byte between hosts costs, as ringlet's own transport moves it (its packets,
    # its wake-ups; whatever the transport does, the calibration follows)
    cpu, per_call, samples, through = link_cpu_ringlet(hosts, m)
    cores = os.cpu_count() or 1
    # the cores the job's ranks will get (other processes' load takes the rest)
    free = float(cores) if all_cores else cores_available(hosts.n * m)
    spread = sorted(c / b for b, c, _ in samples if b == max(s[0] for s in samples))
    print("link CPU per byte by size (ns, each call): " + "; ".join(
        f"{b // 2 >> 20} MiB " + " ".join(f"{c / b * 1e9:.2f}" for bb, c, _ in samples if bb == b)
        for b in sorted({s[0] for s in samples})), flush=True)
    print(f"link {rate}: one stream each way {one * 8 / 1e9:.3f} Gbit/s of payload, {m} "
          f"streams each way {many * 8 / 1e9:.3f} together (shared {shared:.2f}); "
          f"{cpu * 1e9:.3f} ns of CPU per byte between hosts through ringlet + "
          f"{per_call * 1e3:.2f} ms per call ({m} pair(s); largest size per byte "
          f"{spread[0] * 1e9:.3f}-{spread[-1] * 1e9:.3f} ns; ringlet's pairs "
          f"{through * 8 / 1e9:.3f} Gbit/s; bare sockets {bare * 1e9:.3f} ns); "
          f"{cores} cores shared, {hosts.n * m} busy processes get {free:.2f} of them; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    # the link carries what the faster of the two reached - unless that is far short of
    # TCP's goodput on the wire: then the streams were short of CPU (load), which the
    # machine's cores account for, and the link is priced at the goodput
    from ringlet.cost.profile import TCP_GOODPUT
    wire = parse_rate(rate) * TCP_GOODPUT
    payload = max(one, many) if max(one, many) >= 0.8 * wire else wire
    if payload == wire:
        # ... and then what m streams reached beside one says nothing of the link either
        # (one run at load 11: 0.48, where the tbf link carries m streams as one)
        print(f"link {rate}: the streams reached {max(one, many) / wire:.0%} of TCP's goodput "
              f"on the wire (short of CPU): the link priced at the goodput, shared by "
              f"streams as one (not {shared:.2f})", flush=True)
        shared = 1.0
    prof = base.with_link_rate(rate, shared=shared, payload=payload,
                               machine=(cores, cpu, free if free < cores else 0.0))
    # kept for the record (not priced yet): the calibration's fixed CPU per call of m
    # messages each way - a candidate for the per-message cost between hosts
    prof.params("inter")["cpu_call"] = per_call / (2 * m)
    return prof


def measure(layout, rate, spec, timeout, base, calibrate=True, bucket=FINE, all_cores=False):
    """Run the job on fresh hosts (their link calibrated first, unless not ``calibrate``:
    then the link rate alone); the CELL records rank 0 printed, and the profile."""
    from ringlet.hosts import Hosts
    h, m = layout
    spec_path = f"/tmp/ringlet-bench-hosts-{os.getpid()}.json"
    prof_path = f"/tmp/ringlet-bench-profile-{os.getpid()}.json"
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    try:
        with Hosts(h, rate=rate, bucket=bucket) as hosts:
            profile = (calibrate_link(hosts, m, rate, base, all_cores) if calibrate
                       else base.with_link_rate(rate))
            with open(prof_path, "w") as f:
                json.dump(profile.to_dict(), f)
            env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   "RINGLET_PROFILE": prof_path}  # every rank prices with the measured link
            procs = hosts.ringlet_run(os.path.abspath(__file__), nproc=m,
                                      args=["--job", spec_path], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            results = hosts.wait(procs, timeout)
            inter = profile.params("inter")
            if calibrate and not all_cores:
                # the load moves while the job runs: the job is priced with the mean of the
                # cores it could get before and after (its ranks chose with the first)
                before = inter.get("available") or float(inter["cores"])
                after = cores_available(h * m)
                free = (before + after) / 2
                inter["available"] = free if free < inter["cores"] else 0.0
                print(f"after the job, {h * m} busy processes get {after:.2f} cores (before "
                      f"{before:.2f}: priced with {free:.2f}); load {os.getloadavg()[0]:.1f}")
    finally:
        os.unlink(spec_path)
        if os.path.exists(prof_path):
            os.unlink(prof_path)
    out = []
    for i, (code, o, e) in enumerate(results):
        if code:
            raise RuntimeError(f"host {i} failed ({code}): {e[-3000:]}")
        out += [json.loads(line.split("CELL ", 1)[1]) for line in o.splitlines() if "CELL " in line]
    return out, profile


def predict(collective, algorithm, nbytes, layout, profile):
    from ringlet.cost import tune
    h, m = layout
    hosts = tuple(r // m for r in range(h * m))
    env = tune.environment(h * m, profile, hosts)
    return tune.predict_terms(collective, nbytes, h * m, algorithm, env).total


def repick(collective, nbytes, layout, profile):
    """What ``algorithm="auto"`` picks for the call with ``profile`` (as a rank does)."""
    from ringlet.cost import choose
    h, m = layout
    return choose(collective, nbytes, h * m, topology=profile,
                  hosts=tuple(r // m for r in range(h * m)))[0]


def bus_factor(collective, p):
    """nccl-tests' bus bandwidth factor: bytes a rank moves per byte of the size."""
    return {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p,
            "reduce_scatter": (p - 1) / p, "broadcast": 1.0, "all_to_all": (p - 1) / p}[collective]


def report(rows, layout, rate):
    """Print one layout x rate table; returns the per-cell-group summaries."""
    from ringlet.cost import format_size
    from ringlet.cost.profile import parse_rate
    h, m = layout
    p = h * m
    link = parse_rate(rate)
    over = " (oversubscribed: %d ranks on %d cores)" % (p, os.cpu_count()) if p > (os.cpu_count() or 1) else ""
    print(f"\n== {h} hosts x {m} ranks, link {rate}{over}; load {os.getloadavg()[0]:.1f}")
    print(f"{'collective':<15}{'size':>8}  {'algorithm':<19}{'measured ms':>12}{'predicted':>10}"
          f"{'error':>8}{'link util':>10}")
    groups = {}
    for row in rows:
        groups.setdefault((row["collective"], row["nbytes"]), []).append(row)
    summary = []
    for (collective, nb), group in groups.items():
        forced = [g for g in group if g["algorithm"] != "auto"]
        for g in group:
            t = measured(g)
            util = nb * bus_factor(collective, p) / t / link if t > 0 else 0.0
            pred = g.get("predicted")
            err = f"{(pred - t) / t * 100:+.0f}%" if pred else ""
            name = g["algorithm"] + (f" ({g['auto']})" if g["algorithm"] == "auto" else "")
            print(f"{collective:<15}{format_size(nb):>8}  {name:<19}{t * 1e3:>12.3f}"
                  f"{(pred or 0) * 1e3:>10.3f}{err:>8}{util:>9.0%}")
        ranked = sorted(forced, key=measured)
        best = ranked[0]
        pbest = min(forced, key=lambda g: g["predicted"])
        t_best = measured(best)
        t_pbest = measured(pbest)
        auto = next((g for g in group if g["algorithm"] == "auto"), None)
        # the winner rule (module docstring): within 10% of the best, or - where the best
        # two are tied within the run's noise - either of them
        apart, ratios = separation(best, ranked[1]) if len(ranked) > 1 else (True, [])
        tied = {g["algorithm"] for g in ranked[:1 if apart else 2]}
        within = t_pbest <= 1.10 * t_best
        ok = within or pbest["algorithm"] in tied
        # auto judged as the predicted winner is (its pick's forced time), and by its own
        # call - the same schedule measured once more, so its noise too; after --reprice
        # only where the pick is the run's
        picked = next((g for g in forced if auto and g["algorithm"] == auto["auto"]), None)
        pick_ok = picked is not None and (measured(picked) <= 1.10 * t_best
                                          or picked["algorithm"] in tied)
        own = auto is not None and auto.get("auto_run", auto["auto"]) == auto["auto"]
        auto_ok = own and measured(auto) <= 1.10 * t_best
        flat = [g for g in forced if g["algorithm"] in ("ring", "pipeline", "pairwise")]
        hier = [g for g in forced if g["algorithm"] == "hierarchical"]
        ratio = (measured(flat[0]) / measured(hier[0]), flat[0]["predicted"] / hier[0]["predicted"]) \
            if flat and hier else None
        sep = ("" if not ratios else f"; runner-up {ranked[1]['algorithm']} "
               f"{min(ratios):.2f}-{max(ratios):.2f}x the winner by block: "
               + ("separated" if apart else "TIED within the run's noise"))
        verdict = "ok" if within else "ok, tied" if ok else "WRONG"
        print(f"{'':<15}{'':>8}  winner measured {best['algorithm']}, predicted {pbest['algorithm']}"
              f" ({t_pbest / t_best:.2f}x the best: {verdict}){sep}; auto picked "
              f"{auto['auto'] if auto else '-'} ({'ok' if pick_ok else 'WRONG'}; its call "
              f"{'ok' if auto_ok else 'WRONG' if own else 'not measured'})"
              + (f"; flat/hierarchical measured {ratio[0]:.2f}, predicted {ratio[1]:.2f}" if ratio else ""))
        summary.append({"collective": collective, "nbytes": nb, "winner_ok": ok, "auto_ok": auto_ok,
                        "winner_strict": within, "tied": not apart,
                        "pick_ok": pick_ok, "own": own,
                        "layout": layout, "rate": rate, "best": best["algorithm"], "t_best": t_best,
                        "flat_hier": ratio[0] if ratio else None,
                        "errors": [abs(g["predicted"] - measured(g)) / measured(g)
                                   for g in forced]})
    return summary


def what_if(summary, scale, intra="nvlink", inter="infiniband"):
    """Each measured (collective, size) priced again for ``scale`` = (hosts, ranks per
    host) on the seeds' tiers, beside what was measured here: auto's pick there and its
    time, flat ring against hierarchical there and here."""
    from ringlet.cost import Topology, choose, format_size
    H, R = scale
    topo = Topology(H, R, intra, inter)
    print(f"\nwhat if: the same calls on {H} hosts x {R} ranks, {intra} inside a host, "
          f"{inter} between hosts (priced, not measured)")
    print(f"{'collective':<15}{'size':>8}  {'here':<11}{'best here':<19}{'ms':>9}"
          f"{'flat/hier':>10}   {'auto there':<19}{'ms':>9}{'flat/hier':>10}")
    for row in summary:
        coll, nb = row["collective"], row["nbytes"]
        pick, rows = choose(coll, nb, H * R, topo)
        t = {r.algorithm: r.total for r in rows}
        flat = {"broadcast": "pipeline", "all_to_all": None}.get(coll, "ring")   # as report()
        there = f"{t[flat] / t['hierarchical']:>10.2f}" if flat and "hierarchical" in t else f"{'':>10}"
        here = f"{row['flat_hier']:>10.2f}" if row.get("flat_hier") else f"{'':>10}"
        h, m = row["layout"]
        where = f"{h}x{m} {row['rate']}"
        print(f"{coll:<15}{format_size(nb):>8}  {where:<11}{row['best']:<19}"
              f"{row['t_best'] * 1e3:>9.3f}{here}   {pick:<19}{t[pick] * 1e3:>9.3f}{there}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--place-job", help=argparse.SUPPRESS)
    ap.add_argument("--gloo-job", help=argparse.SUPPRESS)
    ap.add_argument("--cpu-job", help=argparse.SUPPRESS)
    ap.add_argument("--calibrations", type=int, metavar="N",
                    help="instead: calibrate the link N times on each layout and rate (the "
                         "readings' spread), measuring no collective")
    ap.add_argument("--gloo", action="store_true",
                    help="instead: all_reduce against torch's Gloo on the first layout, at "
                         "each rate ('unshaped': plain veth), sizes from --sizes")
    ap.add_argument("--place", metavar="TP,TP_BYTES,DP_BYTES",
                    help="instead: verify ringlet place for tensor x data parallel on the "
                         "first layout and rate (e.g. 2,1M,16M)")
    ap.add_argument("--turns", type=int, default=5, help="--gloo, --place: turns (default 5)")
    ap.add_argument("--layouts", default="2x2,2x4", help="hosts x ranks per host (default 2x2,2x4)")
    ap.add_argument("--rates", default="1gbit,10gbit", help="link rates, tc form")
    ap.add_argument("--sizes", default="64K,1M,16M,64M")
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    ap.add_argument("--blocks", type=int, default=3, help="interleaved blocks of every "
                    "algorithm per cell (default 3; the winner's separation needs 2)")
    ap.add_argument("--iters", default="3,1", help="timed calls per algorithm and block "
                    "below 4 MiB, from 4 MiB (default 3,1)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per layout and rate")
    ap.add_argument("--json", help="also write every cell here")
    ap.add_argument("--what-if", default="64x8", type=lambda t: tuple(int(x) for x in t.split("x")),
                    metavar="HxR", help="also price every measured call on H hosts x R ranks "
                    "of the seeds' tiers (NVLink inside, InfiniBand between; default 64x8; "
                    "0x0: no)")
    ap.add_argument("--reprice", metavar="JSON",
                    help="measure nothing: price the cells of an earlier --json again")
    ap.add_argument("--rate-only", action="store_true",
                    help="price the link from its rate alone (no calibration on the hosts)")
    ap.add_argument("--machine", metavar="CORES,S_PER_BYTE[,FREE]", help="--reprice: the "
                    "cores the hosts share, the CPU per byte between them and the cores the "
                    "job gets of them (else as measured)")
    ap.add_argument("--all-cores", action="store_true",
                    help="price as if the job had every core (do not measure, or with "
                         "--reprice do not use, the cores other processes' load leaves it)")
    ap.add_argument("--bucket", type=float, help=f"tbf's bucket in seconds at the rate "
                    f"(default {FINE:g} below 10 Gbit/s, else {WIDE:g}; --gloo {WIDE:g}): see "
                    f"ringlet.hosts")
    ap.add_argument("--shared", type=float, help="--reprice: this shared fraction instead")
    a = ap.parse_args(argv)
    if os.environ.get("RINGLET_HOSTS_PREFIX"):   # several benchmarks on one machine: own names
        import ringlet.hosts
        ringlet.hosts.PREFIX = os.environ["RINGLET_HOSTS_PREFIX"]
    if a.job:
        job(a.job)
        return 0
    if a.place_job:
        with open(a.place_job) as f:
            place_job(json.load(f))
        return 0
    if a.gloo_job:
        with open(a.gloo_job) as f:
            gloo_job(json.load(f))
        return 0
    if a.cpu_job:
        with open(a.cpu_job) as f:
            cpu_job(json.load(f))
        return 0
    if a.calibrations:
        from ringlet.cost import load_profile
        from ringlet.hosts import Hosts
        for layout in [tuple(int(x) for x in s.split("x")) for s in a.layouts.split(",")]:
            for rate in a.rates.split(","):
                with Hosts(layout[0], rate=rate, bucket=bucket_for(rate, a.bucket)) as hosts:
                    for _ in range(a.calibrations):
                        calibrate_link(hosts, layout[1], rate, load_profile(), a.all_cores)
        return 0
    from ringlet.cost import load_profile, parse_size
    if a.place:
        tp, tp_bytes, dp_bytes = a.place.split(",")
        layout = tuple(int(x) for x in a.layouts.split(",")[0].split("x"))
        placement(a.rates.split(",")[0], layout, int(tp), parse_size(tp_bytes),
                  parse_size(dp_bytes), a.turns, a.timeout, bucket_for(a.rates.split(",")[0], a.bucket))
        return 0
    if a.gloo:
        layout = tuple(int(x) for x in a.layouts.split(",")[0].split("x"))
        for rate in a.rates.split(","):
            versus_gloo(rate, layout, [parse_size(x) for x in a.sizes.split(",")], a.turns,
                        a.timeout, a.bucket or WIDE)
        return 0
    profile = load_profile()
    iters = [int(x) for x in a.iters.split(",")]
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    spec = {"cells": cells(a.collectives.split(","), sizes, a.blocks, *iters)}
    print(f"profile: {profile.source}; load before: {os.getloadavg()}")
    everything, summary = [], []
    if a.reprice:
        # the measurements of an earlier --json, priced again with this profile
        with open(a.reprice) as f:
            old = json.load(f)
        runs: dict = {}
        for row in old:
            runs.setdefault((tuple(row["layout"]), row["rate"]), []).append(row)
        def machine(row):
            if a.machine:
                return tuple(float(x) for x in a.machine.split(","))
            if "cpu" not in row:
                return None
            return (row["cores"], row["cpu"], 0.0 if a.all_cores else row.get("available", 0.0))
        measured = [(layout, rate, rows, profile.with_link_rate(
                        rate, a.shared or rows[0]["shared"], rows[0]["payload"], machine(rows[0])))
                    for (layout, rate), rows in runs.items()]
    else:
        measured = []
        for layout in [tuple(int(x) for x in s.split("x")) for s in a.layouts.split(",")]:
            for rate in a.rates.split(","):
                rows, prof = measure(layout, rate, spec, a.timeout, profile, not a.rate_only,
                                     bucket_for(rate, a.bucket), a.all_cores)
                inter = prof.params("inter")
                for row in rows:
                    row.update(layout=list(layout), rate=rate, load=os.getloadavg()[0],
                               shared=inter["shared"], payload=1 / inter["beta"])
                    if "cpu" in inter:
                        row.update(cores=inter["cores"], cpu=inter["cpu"],
                                   available=inter.get("available", 0.0),
                                   cpu_message=inter.get("cpu_call"))
                measured.append((layout, rate, rows, prof))
    for layout, rate, rows, prof in measured:
        if a.reprice:
            # auto as it would pick with this model (its ranks choose with the same
            # prediction); its row's own time was measured with the run's pick
            for row in rows:
                if row["algorithm"] == "auto":
                    row.setdefault("auto_run", row["auto"])
                    row["auto"] = repick(row["collective"], row["nbytes"], layout, prof)
        for row in rows:
            row["predicted"] = predict(row["collective"], row["auto"] if row["algorithm"] == "auto"
                                       else row["algorithm"], row["nbytes"], layout, prof)
        summary += report(rows, layout, rate)
        everything += rows
    runs = {}
    for s in summary:
        runs.setdefault(f"{s['layout'][0]}x{s['layout'][1]} {s['rate']}", []).append(s)
    for where, part_all in [("", summary)] + (list(runs.items()) if len(runs) > 1 else []):
        for label, part in (("all sizes", part_all),
                            ("16 MiB and up", [s for s in part_all if s["nbytes"] >= 16 << 20])):
            errors = [e for s in part for e in s["errors"]]
            if errors:
                strict = sum(s.get("winner_strict", s["winner_ok"]) for s in part)
                print(f"\n{where + ', ' if where else ''}{label}: median |error| "
                      f"{statistics.median(errors):.0%} over {len(errors)} cells; predicted "
                      f"winner right in {sum(s['winner_ok'] for s in part)}/{len(part)} "
                      f"sizes ({strict} within 10% of the best, "
                      f"{sum(s['winner_ok'] for s in part) - strict} more naming one of two "
                      f"tied within the run's noise; {sum(s.get('tied', False) for s in part)} "
                      f"sizes tied); auto's pick right in {sum(s['pick_ok'] for s in part)}/"
                      f"{len(part)}, its own call in {sum(s['auto_ok'] for s in part)}/"
                      f"{sum(s['own'] for s in part)}")
    if a.what_if and all(a.what_if):
        what_if(summary, a.what_if)
    print(f"load after {os.getloadavg()}")
    if a.json and not a.reprice:
        with open(a.json, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
