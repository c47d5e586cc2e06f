"""``ringlet calibrate``: measure how this host's transports spend time and save the profile.

For each transport (``shm``: shared memory between local ranks; ``tcp``: sockets, what
ranks on different hosts use) small jobs of ``p`` local ranks (by default p = 2, 3, 4 and 6:
on a 2-core machine the last three measure what sharing cores costs) time a few
collectives - barrier, broadcast (binomial, pipeline), all_reduce (ring, direct, recursive
doubling, binomial tree, naive ring, Rabenseifner, double binary tree), all_gather (ring,
recursive doubling, direct), reduce and gather (direct), scatter (binomial),
reduce_scatter (ring), all_to_all (direct), and a direct broadcast, a ring all_gather and
a direct gather from rl.empty buffers - at sizes from 4 KiB to 64 MiB (16 MiB when the
ranks outnumber the cores), in several passes that are separate jobs spread over time
(passes slowed down by other processes are left out or run again). Each job first
sends 8 MiB through every shared-memory ring, whose first lap page-faults. The profile
keeps the timings: ``ringlet calibrate --refit`` fits a changed model to them again.

:func:`ringlet.cost.fit_host` then fits a :class:`ringlet.cost.host.HostModel` to
the timings: the simulator prices the very schedules that ran, and its named terms
(per-message CPU alpha on each side - alpha_fast in calls run in C -, latency per hop, rendezvous latency, latency when
ranks outnumber cores, per-byte beta on each side, gamma per byte reduced, delta per byte
copied locally, memory-hierarchy stalls past the L2s and the L3, the cost of sharing
cores, the lag of one-way streams) are solved by non-negative least squares on relative
error, with the residuals reported; so is the size of the L3 the job really gets (on a
VM, less than sysfs says). The profile (JSON, see :mod:`ringlet.cost.profile`) is saved
to the user cache directory, where predictions, ``ringlet explain``, ``ringlet bench`` and
``algorithm="auto"`` find it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from .plotting import output_path
from .transport import fast, limits
from .cost.model import Link, count_of, format_size, nbytes_of, parse_size
from .cost.profile import FIT_START, Profile, fit_host, l3_candidates, machine, profile_path

#: (collective, algorithm) timed per size; barrier only once (it moves no bytes)
#: (all_gather's many concurrent messages price what all_reduce's do not; without them
#: the fit cannot tell direct from recursive doubling at a few ranks and MiB; a root that
#: receives from every rank at once (reduce, gather direct), a scatter, an exchange of
#: reductions (reduce_scatter ring), of copies (all_to_all direct) and a pipelined chain
#: are what the rooted and exchange collectives run, which all_reduce's schedules do not)
EXPERIMENTS = (("broadcast", "binomial"), ("all_reduce", "ring"), ("all_reduce", "direct"),
               ("all_reduce", "recursive_doubling"), ("all_reduce", "tree"),
               ("all_reduce", "naive_ring"), ("all_reduce", "rabenseifner"),
               ("all_reduce", "double_tree"), ("all_gather", "ring"),
               ("all_gather", "recursive_doubling"), ("all_gather", "direct"),
               ("reduce", "direct"), ("gather", "direct"), ("scatter", "binomial"),
               ("reduce_scatter", "ring"), ("all_to_all", "direct"), ("broadcast", "pipeline"))
#: ... and from rl.empty buffers, whose receivers read each message in place after an RTS
#: round trip: since messages up to the ring's size stream without one, these are what
#: shows the fit alpha_rdv at the sizes where it matters (at 64 KiB it was fitted to 0
#: without them, and rl.empty calls predicted 47-79% short); a gather's root reads every
#: rank's message in place, an all_gather ring reads while it is read
ZERO_COPY_EXPERIMENTS = (("broadcast", "direct"), ("all_gather", "ring"), ("gather", "direct"))
# 256 KiB and 1 MiB: the largest eager (one fragment) and streamed (no CTS) messages of
# shm, where the protocol changes
DEFAULT_SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
DEFAULT_RANKS = (2, 3, 4, 6)
#: the L3 the fit may find the job really has, as fractions of what sysfs reports (on a VM
#: the L3 is shared with other tenants; here 16-24 of 32 MiB fit the timings best)
L3_FRACTIONS = (0.5, 0.75, 1.0)
#: ... and every power of two from this up to them: a VM here reported 480 MiB of L3,
#: which no timing reaches past, so the fit had no term for memory beyond it and priced
#: 64 MiB calls 25-40% short
L3_FLOOR = 8 << 20
#: with more ranks than this, sizes above this are skipped (time, and first-call costs)
CROWDED_MAX_SIZE = 16 << 20
BACKEND = {"shm": None, "tcp": "tcp"}
_UNIT_LAT = Link(1.0, 1e300)   # counts messages
_UNIT_BW = Link(0.0, 1.0)      # counts bytes
_UNIT_ZERO = Link(0.0, 1e300)  # free messages


def critical_counts(collective: str, algorithm: str, nbytes: int, p: int,
                    itemsize: int = 4) -> tuple[float, float, float, float]:
    """(messages, bytes, reduce bytes, local copy bytes) on the critical path of one call:
    the schedule priced with one unit cost at a time (on a uniform link the simulator
    equals the closed forms, and it also sees the local copies)."""
    from ringlet.algorithms import build
    from .cost.model import count_of
    from .cost.simulate import Topology, simulate
    s = build(collective, algorithm, p, count_of(collective, p, nbytes, itemsize), itemsize=itemsize)
    msgs = simulate(s, Topology.uniform(p, _UNIT_LAT)).time
    byts = simulate(s, Topology.uniform(p, _UNIT_BW)).time
    red = simulate(s, Topology.uniform(p, _UNIT_ZERO, gamma=1.0)).time
    cp = simulate(s, Topology.uniform(p, _UNIT_ZERO, delta=1.0)).time
    return round(msgs), byts, red, cp


def prefault_rings(rl, nbytes: int = 8 << 20) -> None:
    """Send ``nbytes`` through every pair's shared-memory ring (a direct all-reduce), so
    that the rings' pages exist before anything is timed. A fresh job's rings are
    untouched tmpfs pages: the first lap around each one page-faults, which makes the
    first ~100 messages of 32-64 KiB two to three times slower than the rest."""
    import numpy as np
    x = np.zeros(max(nbytes // 4, 1), np.float32)
    rl.all_reduce(x, algorithm="direct")
    rl.barrier()


def _operands(rl, np, coll, p, nb, shared) -> dict:
    """A call's arrays for ``nb`` bytes in the size convention of ``ringlet.cost.model``
    (plain NumPy, or ``rl.zeros`` when ``shared``), and its ``count`` per block."""
    count = max(1, count_of(coll, p, nb))
    new = (lambda *s: rl.zeros(s, np.float32)) if shared else (lambda *s: np.zeros(s, np.float32))
    if coll in ("broadcast", "reduce", "all_reduce"):
        out = {"buf": new(count)}
    elif coll in ("all_gather", "gather"):
        out = {"in": new(count), "out": new(p, count)}
    elif coll in ("reduce_scatter", "scatter"):
        out = {"in": new(p, count), "out": new(count)}
    else:                                                    # all_to_all
        out = {"in": new(p, count), "out": new(p, count)}
    out["count"] = count
    return out


def run_collective(rl, coll, b, alg) -> None:
    """One call of ``coll`` with ``algorithm=alg`` on the arrays of :func:`_operands`
    (``bench/accuracy.py`` times its calls with it too)."""
    if coll == "broadcast":
        rl.broadcast(b["buf"], 0, algorithm=alg)
    elif coll == "reduce":
        rl.reduce(b["buf"], 0, algorithm=alg)
    elif coll == "all_reduce":
        rl.all_reduce(b["buf"], algorithm=alg)
    elif coll == "all_gather":
        rl.all_gather(b["out"], b["in"], algorithm=alg)
    elif coll == "reduce_scatter":
        rl.reduce_scatter(b["out"], b["in"], algorithm=alg)
    elif coll == "all_to_all":
        rl.all_to_all(b["out"], b["in"], algorithm=alg)
    elif coll == "gather":
        rl.gather(b["in"], b["out"], 0, algorithm=alg)
    else:
        rl.scatter(b["out"], b["in"], 0, algorithm=alg)


def _child(rank, out_path, sizes, budget, max_reps, passes=1, only=None):
    """Runs in every rank of the calibration job; rank 0 writes the timings. The whole
    list of experiments runs ``passes`` times (a slow spell of the host then spoils one
    pass, not one experiment); each timing is the slowest rank's median over repetitions.
    ``only``: ``{size: (collective, algorithm) pairs}`` - at these sizes, time only those."""
    import numpy as np

    import ringlet as rl
    from ringlet.bench import bind_like_mpirun
    p = rl.get_world_size()
    # one core per rank where they fit, as ringlet bench and bench/accuracy.py place them:
    # unbound, both ranks of p = 2 sometimes share one core for a whole job on a busy host
    # (a pass several times slower, or faster at 1 MiB than at 256 KiB)
    bind_like_mpirun(rank, p)
    rows = []

    def timed(call, warm, buf=None):
        for _ in range(warm):                    # warm up: schedules, segments, caches
            call()
        # every rank must run the same number of repetitions: agree on the slowest estimate
        t0 = time.perf_counter()
        call()
        est = np.array([time.perf_counter() - t0])
        rl.all_reduce(est, op=rl.ReduceOp.MAX, algorithm="direct")
        reps = int(min(max_reps, max(3, budget // max(float(est[0]), 1e-9))))
        ts = []
        for _ in range(reps):
            if buf is not None:
                # Like a gradient, and like ringlet bench and bench/accuracy.py: the buffer
                # is written just before the call, so the call starts with it dirty in cache.
                buf[...] = rank + 1
            rl.barrier()
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        # The slowest rank's median, as ringlet bench reports: a root that sends its last
        # message eagerly is done long before the ranks that must receive it.
        t = np.array([statistics.median(ts)])
        rl.all_reduce(t, op=rl.ReduceOp.MAX, algorithm="direct")
        return float(t[0]), reps

    prefault_rings(rl)
    for i in range(passes):
        warm = 2 if i == 0 else 1
        t, reps = timed(rl.barrier, warm)
        rows.append(("barrier", "dissemination", 0, t, reps, []))
        for nb in sizes:
            for shared, experiments in ((False, EXPERIMENTS), (True, ZERO_COPY_EXPERIMENTS)):
                bufs = {}
                for coll, alg in experiments:
                    if only and nb in only and (coll, alg) not in only[nb]:
                        continue
                    if coll not in bufs:
                        bufs[coll] = _operands(rl, np, coll, p, nb, shared)
                    b = bufs[coll]
                    t, reps = timed(lambda: run_collective(rl, coll, b, alg), warm, b.get("buf", b.get("in")))
                    rows.append((coll, alg, nbytes_of(coll, p, b["count"]), t, reps,
                                 [k for k in b if k != "count"] if shared else []))
                del bufs
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"p": p, "rows": rows}, f)


def _cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its reaped
    children) since boot; (0, 0) where /proc/stat is missing."""
    import resource
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0, 0.0
    busy = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")
    own = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                resource.getrusage(resource.RUSAGE_CHILDREN)))
    return busy, own


def others_load(seconds: float = 0.2) -> float:
    """Cores kept busy by other processes (other users' jobs, tests, benchmarks) now."""
    b0, o0 = _cpu_seconds()
    t0 = time.perf_counter()
    time.sleep(seconds)
    b1, o1 = _cpu_seconds()
    return max(0.0, (b1 - b0) - (o1 - o0)) / (time.perf_counter() - t0)


def wait_quiet(max_load: float = 0.25, patience: float = 30.0) -> float:
    """Wait (up to ``patience`` seconds) until other processes use less than ``max_load``
    cores; returns the last load seen. Timings on a busy machine measure the others too."""
    deadline = time.monotonic() + patience
    load = others_load()
    while load > max_load and time.monotonic() < deadline:
        time.sleep(0.5)
        load = others_load()
    return load


def _run_pass(transport, p, sizes, budget, max_reps, timeout, only=None):
    """One job of ``p`` fresh ranks timing every experiment once: rows, and the cores
    other processes kept busy meanwhile."""
    from .launch import spawn
    fd, path = tempfile.mkstemp(prefix="ringlet-calibrate-", suffix=".json")
    os.close(fd)
    b0, o0 = _cpu_seconds()
    t0 = time.perf_counter()
    try:
        # The jobs name every algorithm they time, so they need no profile; the one being
        # replaced may be stale, and each job would warn about it.
        spawn(_child, p, args=(path, tuple(int(s) for s in sizes), float(budget), int(max_reps),
                               1, only),
              backend=BACKEND[transport], timeout=timeout,
              env={"RINGLET_PROFILE": path + ".none"})
        with open(path) as f:
            data = json.load(f)
    finally:
        os.unlink(path)
    b1, o1 = _cpu_seconds()
    load = max(0.0, (b1 - b0) - (o1 - o0)) / max(time.perf_counter() - t0, 1e-9)
    return data["rows"], load


def _samples(p, runs) -> list[dict]:
    """Samples for the fit from ``{(collective, algorithm, nbytes, shared): [(seconds,
    reps)]}``: the median of the passes within 1.5x of the fastest (each pass is a median
    over repetitions; other processes can only slow a pass down, and on a shared 2-core
    host they sometimes slow two passes of three several-fold), and the plain model's
    critical-path counts. ``shared``: the buffers that were rl.empty arrays. (The fastest
    pass instead, as bench/accuracy.py takes each cell's fastest block: refitted to the
    same passes and priced on the same grid, 2026-12-03, shared memory went from
    unbiased to 8-15% short, TCP from 19% long to 7%; median error 18.9% -> 19.2%.)"""
    samples = []
    for (coll, alg, nb, shared), got in runs.items():
        m, b, r, c = critical_counts(coll, alg, nb, p)
        fastest = min(t for t, _ in got)
        samples.append({"collective": coll, "algorithm": alg, "p": p, "nbytes": nb,
                        "shared": list(shared),
                        "seconds": statistics.median(t for t, _ in got if t <= 1.5 * fastest),
                        "passes": [t for t, _ in got], "reps": sum(n for _, n in got),
                        "n_messages": m, "bytes": b, "reduce_bytes": r, "copy_bytes": c})
    return samples


def measure(transport: str, p: int = 2, sizes=DEFAULT_SIZES, budget: float = 0.1,
            max_reps: int = 50, timeout: float = 600.0, passes: int = 3,
            quiet: float = 30.0, max_load: float = 0.5, retries: int = 2) -> list[dict]:
    """Time the calibration experiments on ``transport`` with ``p`` local ranks; returns
    samples (dicts with collective, algorithm, p, nbytes, seconds (see ``_samples``),
    passes, reps, and the critical-path counts n_messages, bytes, reduce_bytes,
    copy_bytes of the plain model) ready for :func:`fit_host` or :func:`fit`.

    Each pass is a separate job (fresh ranks, later in time), started once other
    processes leave the cores alone (waiting up to ``quiet`` seconds) and run again, up
    to ``retries`` times, when they kept more than ``max_load`` cores busy during it: a
    noisy neighbour then spoils a pass, whose timings are left out where the run again
    was faster (see ``_samples``)."""
    runs: dict = {}
    for _ in range(passes):
        _measure_pass(runs, transport, p, sizes, budget, max_reps, timeout, quiet, max_load,
                      retries)
    return _samples(p, runs)


def _measure_pass(runs, transport, p, sizes, budget, max_reps, timeout, quiet, max_load,
                  retries, only=None) -> float:
    if transport not in BACKEND:
        raise ValueError(f"unknown transport {transport!r}; valid: {', '.join(BACKEND)}")
    for _ in range(retries + 1):
        if quiet > 0:
            wait_quiet(max_load / 2, patience=quiet)
        rows, load = _run_pass(transport, p, sizes, budget, max_reps, timeout, only)
        # every attempt's timings are kept: when the host stays busy the run again is no
        # quieter, and _samples keeps the fast ones of each experiment
        for coll, alg, nb, t, reps, shared in rows:
            runs.setdefault((coll, alg, nb, tuple(shared)), []).append((t, reps))
        if load <= max_load:
            break
    return load


#: the full calibration's fit (see :func:`ringlet.cost.fit_host`): one start, each idle
#: share and imbalance from the best fit so far, and the L3 the job really gets, each
#: tried in 3 iterations and the best iterated on (with 500 timings of p = 2-6, full
#: iterations for every try of a finer grid took minutes per transport). A second start
#: (0.3 x) with the grid tried from it too, and L3 fractions 0.625 and 0.875, gave the
#: same fit of profile_quiet_1800's 504 shm timings (14.6% median residual, idle share
#: 0.25, imbalance 1, L3 16 MiB) in 88 simulations of every timing instead of 49 (133
#: against 73 s of CPU)
FULL_FIT = {"l3_fractions": L3_FRACTIONS, "l3_floor": L3_FLOOR, "starts": (1.0,),
            "idle_shares": (0.0, 0.25, 0.5),
            "imbalances": (0.0, 0.5, 1.0), "iterations": 8, "grid_iterations": 3}
_K, _M = 1 << 10, 1 << 20
#: at large sizes: an exchange that reduces, direct's many concurrent messages, a chain, a
#: copy-only ring, a chain of copies and a message read in place
LARGE = (("all_reduce", "ring"), ("all_reduce", "direct"), ("all_reduce", "tree"),
         ("all_gather", "ring"), ("broadcast", "binomial"), ("broadcast", "direct"))
#: ``ringlet calibrate --quick``: the cells the fit needs - every experiment at a few small
#: sizes, LARGE ones past the rendezvous limit and the L3, and 3 and 4 ranks (sharing the
#: cores) - in two passes (a spell of load then spoils one) waiting at most 2 s for a quiet
#: host, never run again, and a fit that tries one start, a 2 x 2 grid of idle share and
#: imbalance and the L3 sysfs reports (the full fit: 84 s of shm's alone on 2 busy cores).
#: Chosen by fitting subsets of a full run's timings and pricing all of them: these cells
#: came within 1-5 points of the full fit's median error, as did every subset tried on
#: the same pass; the pass mattered more (bench/quick_accuracy.py; docs/cli.md)
QUICK = {"cells": {2: {4 * _K: None, 64 * _K: None, 256 * _K: None, _M: None,
                       4 * _M: LARGE, 16 * _M: LARGE, 64 * _M: LARGE},
                   3: {4 * _K: None, _M: None, 16 * _M: LARGE},
                   4: {4 * _K: None, 256 * _K: None, 4 * _M: LARGE, 16 * _M: LARGE}},
         "passes": 2, "budget": 0.03, "quiet": 2.0, "retries": 0,
         "fit": {"starts": (1.0,), "idle_shares": (0.0, 0.5), "imbalances": (0.0, 1.0),
                 "iterations": 6}}
#: seconds the simulator takes to price one calibration sample (a quiet core), for estimates
SIMULATE_SECONDS = 1e-3


def fit_seconds(n_samples: int, fit: dict) -> float:
    """A rough duration of one transport's fit: samples x fits tried x iterations."""
    starts = len(fit.get("starts", (1.0, 0.3, 3.0)))
    grid = len(fit.get("idle_shares", (0.0, 0.25, 0.5, 0.75, 1.0))) * len(
        fit.get("imbalances", (0.0, 0.5, 1.0))) * (2 if starts > 1 else 1)
    full = fit.get("iterations", 12)
    quick = fit.get("grid_iterations") or full
    l3s = len(l3_candidates(64 << 20, fit.get("l3_fractions", (1.0,)), fit.get("l3_floor", 0)))
    tries = (starts + 2) * full + (grid + l3s - 1) * quick
    return n_samples * tries * 0.6 * SIMULATE_SECONDS


def jobs(ranks, sizes, cells=None, cores=None) -> list[tuple[int, list, dict]]:
    """What each group size's job times: ``[(p, sizes, only)]`` (``only`` as ``_child``
    takes it). ``cells``: ``{p: {size: (collective, algorithm) pairs, or None for every
    experiment}}`` instead of every experiment at every size for each of ``ranks``;
    without it, sizes above CROWDED_MAX_SIZE are left out when ranks outnumber ``cores``."""
    if cells is not None:
        return [(p, sorted(c), {nb: tuple(e) for nb, e in c.items() if e is not None})
                for p, c in cells.items()]
    cores = machine()["cores"] if cores is None else cores
    return [(p, [s for s in sizes if p <= cores or s <= CROWDED_MAX_SIZE], {}) for p in ranks]


#: a timed call's seconds, and per byte, roughly (a quiet 2-core VM, Python engine), for
#: estimates before anything is measured
CALL_SECONDS, CALL_SECONDS_PER_BYTE = 50e-6, 1e-9


def _pass_seconds(sizes, only, budget, max_reps=50) -> tuple[float, int]:
    """(a rough duration of one pass: each experiment's repetitions (as many as fit its
    budget, 3 to max_reps) and three calls of warm-up and checks, of a call that takes
    CALL_SECONDS + its bytes x CALL_SECONDS_PER_BYTE; plus starting the ranks, the number
    of timings it makes)."""
    n_exp = len(EXPERIMENTS) + len(ZERO_COPY_EXPERIMENTS)
    t, n = 1.5, 1
    for nb in sizes:
        k = len(only[nb]) if nb in only else n_exp
        call = CALL_SECONDS + nb * CALL_SECONDS_PER_BYTE
        t += k * call * (3 + min(max_reps, max(3, budget // call)))
        n += k
    return t, n


def estimate_seconds(transports, ranks, sizes, budget, passes, fit=None, cells=None) -> float:
    """A rough duration of a calibration before it starts: each pass (see
    ``_pass_seconds``), then each transport's fit."""
    per = [_pass_seconds(szs, only, budget) for _, szs, only in jobs(ranks, sizes, cells)]
    return len(transports) * (passes * sum(t for t, _ in per)
                              + fit_seconds(sum(n for _, n in per), FULL_FIT if fit is None else fit))


class Progress:
    """Progress of the steps (passes, then fits): a bar with time left on a terminal (tqdm,
    if installed), else one plain line per step with the time so far and left (a log stays
    readable). ``weights``: each step's expected share of the time (default equal); time
    left is the remaining steps' share at the pace the finished ones went."""

    def __init__(self, steps: int, estimate: float, stream=None, weights=None):
        self.stream = stream if stream is not None else sys.stdout
        self.steps, self.done, self.estimate = steps, 0, estimate
        self.weights = list(weights) if weights is not None else [1.0] * steps
        self.t0 = time.monotonic()
        self.bar = None
        if self.stream.isatty():
            try:
                import shutil

                from tqdm import tqdm
                # a terminal that reports its size as 0 x 0 (script, some CI pseudo-terminals)
                # would show no bar at all: then 80 x 24
                size = shutil.get_terminal_size()
                # the bar counts the steps' weights, so that tqdm's time left is weighted too
                self.bar = tqdm(total=sum(self.weights), file=self.stream, leave=False,
                                ncols=size.columns, nrows=size.lines,
                                bar_format="{desc} {bar} {percentage:3.0f}% "
                                           "[{elapsed} so far, {remaining} left]")
            except ImportError:
                pass

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(f"[{self.done + 1}/{self.steps}] {label}")
        else:
            spent = time.monotonic() - self.t0
            done_w = sum(self.weights[:self.done])
            left = (spent / done_w * sum(self.weights[self.done:]) if done_w > 0
                    else self.estimate)
            print(f"[{self.done + 1}/{self.steps}] {label} ({spent:.0f} s so far, "
                  f"about {left:.0f} s left)", file=self.stream, flush=True)

    def finish_step(self) -> None:
        if self.bar is not None:
            self.bar.update(self.weights[self.done])
        self.done += 1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def calibrate(transports=("shm", "tcp"), p=DEFAULT_RANKS, sizes=DEFAULT_SIZES,
              budget: float = 0.1, verbose: bool = True, passes: int = 3,
              quiet: float = 30.0, retries: int = 2, fit=None, cells=None) -> tuple[Profile, dict]:
    """Measure every transport with each group size in ``p`` (an int or a list) and fit
    its host model; returns (profile, samples by transport). The passes alternate
    between the group sizes, so a slow spell of the host does not hit one size only.
    ``quiet``: seconds a pass may wait for other processes to leave the cores;
    ``retries``: times a pass they disturbed runs again; ``fit``: how thoroughly to fit
    (keyword arguments of ``fit_host``, default :data:`FULL_FIT`); ``cells``: what each
    group size times, instead of every experiment at every size (see :func:`jobs`; ``p``
    and ``sizes`` are then ignored). ``verbose``: show progress (each pass, then each
    transport's fit, is a step)."""
    from .cost.host import HostModel
    mc = machine()
    plan = jobs([p] if isinstance(p, int) else list(p), sizes, cells, mc["cores"])
    ranks = [n for n, _, _ in plan]
    fits, all_samples = {}, {}
    fit = FULL_FIT if fit is None else fit
    per = [_pass_seconds(szs, only, budget) for _, szs, only in plan]
    per_fit = fit_seconds(sum(k for _, k in per), fit)
    weights = ([t for t, _ in per] * passes + [per_fit]) * len(transports)
    prog = Progress(len(weights), sum(weights), weights=weights) if verbose else None
    for tr in transports:
        runs = {n: {} for n in ranks}
        busy = []                 # cores other processes kept busy during each pass
        for i in range(passes):
            for n, szs, only in plan:
                if prog is not None:
                    prog.start(f"{tr}, {n} ranks, pass {i + 1} of {passes}")
                busy.append(_measure_pass(runs[n], tr, n, szs, budget, 50, 600.0, quiet, 0.5,
                                          retries, only))
                if prog is not None:
                    prog.finish_step()
        samples = [s for n in ranks for s in _samples(n, runs[n])]
        if prog is not None:
            prog.start(f"{tr}, fitting the model to {len(samples)} timings")
        base = HostModel.from_params({**FIT_START, "l2_bytes": mc["l2_bytes"],
                                        "l3_bytes": mc["l3_bytes"], "cores": mc["cores"],
                                        **limits.facts(fast.enabled())[tr]})
        f = fit_host(samples, base, **fit)
        if prog is not None:
            prog.finish_step()
        for s_, pred in zip(samples, f.pop("predicted")):
            s_["predicted"] = pred
        f["ranks"] = ranks
        f["others_load"] = round(statistics.median(busy), 2)
        f["timings"] = [_timing(s_) for s_ in samples]   # (for `ringlet calibrate --refit`)
        fits[tr] = f
        all_samples[tr] = samples
    if prog is not None:
        prog.close()
    return Profile.from_fits(fits, sizes=sorted({nb for _, szs, _ in plan for nb in szs})), all_samples


def _timing(sample: dict) -> dict:
    """What the fit needs of a sample (saved in the profile, for a refit)."""
    return {k: sample[k] for k in ("collective", "algorithm", "p", "nbytes", "shared", "seconds",
                                   "passes") if k in sample}


def refit(prof: Profile, fit=None) -> tuple[Profile, dict]:
    """The profile's transports fitted again to the timings saved in it (a profile from
    ``ringlet calibrate`` keeps them): for a changed host model, nothing measured.
    Returns (profile, samples by transport) as :func:`calibrate`."""
    from .cost.host import HostModel
    mc = machine()
    fits, all_samples = {}, {}
    for tr, t in prof.transports.items():
        samples = [dict(s) for s in t.get("timings", ())]
        if not samples:
            continue
        base = HostModel.from_params({**FIT_START, "l2_bytes": mc["l2_bytes"],
                                        "l3_bytes": mc["l3_bytes"], "cores": mc["cores"],
                                        **limits.facts(fast.enabled())[tr]})
        f = fit_host(samples, base, **(FULL_FIT if fit is None else fit))
        for s_, pred in zip(samples, f.pop("predicted")):
            s_["predicted"] = pred
        f.update({k: t[k] for k in ("ranks", "others_load", "timings", "quick", "gamma_float16",
                                    "gamma_bfloat16") if k in t})
        fits[tr] = f
        all_samples[tr] = samples
    if not fits:
        raise ValueError(f"{prof.source} keeps no timings to fit again; run `ringlet calibrate`")
    out = Profile.from_fits({**prof.transports, **fits}, **prof.extra)
    out.created = prof.created      # (when it was measured)
    return out, all_samples


def describe(t: dict) -> str:
    """One transport's fitted terms, one per line."""
    if t.get("model") != "host":
        return (f"    alpha {t['alpha'] * 1e6:.2f} us, bandwidth {1 / t['beta'] / 1e9:.3g} GB/s, "
                f"reduce {t.get('gamma', 0):.3g} s/B, delta {t.get('delta', 0):.3g} s/B")
    rows = [
        ("alpha", t["alpha"] * 1e6, "us", "CPU per message, each side"),
        ("alpha_fast", t.get("alpha_fast", 0.0) * 1e6, "us",
         f"the same in calls run in C (messages <= {format_size(t['fast_bytes'])})"
         if t.get("fast_bytes") else "the same in calls run in C (none on this transport)"),
        ("alpha_fast_call", t.get("alpha_fast_call", 0.0) * 1e6, "us",
         "CPU per call run in C, each rank (its Python entry)"),
        ("alpha_call", t.get("alpha_call", 0.0) * 1e6, "us",
         "CPU per call run in Python, each rank (the engine's work, the wait)"),
        ("alpha_array", t.get("alpha_array", 0.0) * 1e6, "us",
         "CPU per call for a second user array (in and out: bound, checked)"),
        ("alpha_large", t.get("alpha_large", 0.0) * 1e6, "us",
         f"CPU per message above {format_size(t.get('eager', 0))}, each side, over alpha"),
        ("alpha_hop", t.get("alpha_hop", 0.0) * 1e6, "us",
         "latency per message, sender to receiver (adds up along a chain)"),
        ("alpha_rdv", t["alpha_rdv"] * 1e6, "us",
         f"rendezvous latency, messages > "
         f"{format_size(max(t['eager'], t.get('rendezvous', t['eager'])))}"),
        ("alpha_crowd", t["alpha_crowd"] * 1e6, "us",
         f"latency per message when ranks outnumber the {t['cores']} cores"),
        ("alpha_crowd_call", t.get("alpha_crowd_call", 0.0) * 1e6, "us",
         f"latency per call for each rank beyond the {t['cores']} cores"),
        ("beta", t["beta"] * 1e12, "ps/B", "CPU per byte, each side"),
        ("reduce", t["gamma"] * 1e12, "ps/B", "extra CPU per byte reduced"),
        ("delta", t["delta"] * 1e12, "ps/B", "CPU per byte of a local copy"),
        ("mem_l2", t["mem_l2"] * 1e12, "ps/B",
         f"extra per byte past the L2s ({format_size(t['l2_bytes'])}), x (1 - L2/W)"),
        ("mem_l3", t["mem_l3"] * 1e12, "ps/B",
         f"extra per byte past the L3 ({format_size(t['l3_bytes'])} as fitted), x (1 - L3/W)"),
        ("beta_share", t.get("beta_share", 0.0) * 1e12, "ps/B",
         "extra per byte per busy rank beyond the cores, x (k - 1)"),
        ("beta_crowd", t.get("beta_crowd", 0.0) * 1e12, "ps/B",
         "extra per byte moved when the job has more ranks than cores"),
        ("beta_lag", t.get("beta_lag", 0.0) * 1e12, "ps/B",
         "delay per byte of a one-way stream past its slower side (not CPU)"),
        ("beta_cma", t.get("beta_cma", 0.0) * 1e12, "ps/B",
         f"extra per byte read by cross-memory attach (exchanges' messages > "
         f"{format_size(t['cma_min'])})" if t.get("cma_min", -1) > 0 else
         "extra per byte read by cross-memory attach (none on this transport)"),
        ("idle_share", t.get("idle_share", 0.0), "core", "what a rank waiting for its turn takes"),
        ("imbalance", t.get("imbalance", 0.0), "", "1: busy ranks uneven over cores run at the worst core's pace"),
    ]
    return "\n".join(f"    {k:<16}{v:>7.3g} {u:<5} {why}" for k, v, u, why in rows)


#: a fit's median error above this, with other processes busy, is blamed on them
NOISY = 0.3


def summary_table(profile: Profile, samples: dict) -> str:
    """One line per transport: how well the model fits, and the terms a user compares."""
    head = (f"{'transport':<10}{'timings':>8}{'median err':>12}{'max err':>9}"
            f"{'alpha':>10}{'alpha (C)':>11}{'bandwidth':>11}{'reduce':>10}")
    lines = [head, f"{'':<10}{'':>8}{'':>12}{'':>9}{'us/msg':>10}{'us/msg':>11}"
                   f"{'GB/s':>11}{'GB/s':>10}"]
    for tr, t in profile.transports.items():
        if tr not in samples:
            continue
        res = t.get("residuals", {})
        beta, gamma = t.get("beta", 0.0), t.get("gamma", 0.0)
        lines.append(f"{tr:<10}{t.get('samples', 0):>8}"
                     f"{res.get('median_rel', 0) * 100:>11.1f}%{res.get('max_rel', 0) * 100:>8.0f}%"
                     f"{t.get('alpha', 0) * 1e6:>10.2f}{t.get('alpha_fast', 0) * 1e6:>11.2f}"
                     + (f"{1 / beta / 1e9:>11.3g}" if beta else f"{'-':>11}")
                     + (f"{1 / gamma / 1e9:>10.3g}" if gamma else f"{'-':>10}"))
    lines.append("alpha and bandwidth: per side of a message; reduce: bytes reduced per "
                 "second\n(-: its cost fitted as nil, hidden under the others); err: the "
                 "fitted model against\nthe timings it was fitted to")
    for tr, t in profile.transports.items():
        miss, busy = t.get("residuals", {}).get("median_rel", 0), t.get("others_load", 0)
        if tr in samples and miss > NOISY and busy > 0.5:
            import textwrap
            lines.append(textwrap.fill(
                f"{tr}: the model misses its own timings by {miss * 100:.0f}% (median): "
                f"other processes kept {busy:.1f} cores busy while they were taken. "
                f"Calibrate again on a quiet host"
                + (", or without --quick (it waits for quiet spells)." if t.get("quick") else "."),
                88, subsequent_indent="    "))
    return "\n".join(lines)


def report(profile: Profile, samples: dict, verbose: bool = True) -> str:
    """Each transport's fit and terms; with ``verbose`` every timing beside its model."""
    lines = []
    for tr, t in profile.transports.items():
        if tr not in samples:
            continue
        res = t.get("residuals", {})
        lines.append(f"{tr}: {'host model' if t.get('model') == 'host' else 'alpha-beta model'}"
                     f" fitted to {t.get('samples', 0)} timings (p = "
                     f"{', '.join(map(str, t.get('ranks', [t.get('p', '?')])))});"
                     f" residuals: median {res.get('median_rel', 0) * 100:.1f}%,"
                     f" max {res.get('max_rel', 0) * 100:.1f}%, rms {res.get('rms', 0) * 1e6:.1f} us")
        lines.append(describe(t))
        if not verbose:
            continue
        link = profile.link(tr)
        out = set(t.get("outliers", []))
        for i, s in enumerate(samples.get(tr, [])):
            pred = s.get("predicted")
            if pred is None:
                pred = (s["n_messages"] * link.alpha + s["bytes"] * link.beta
                        + s["reduce_bytes"] * t["gamma"] + s.get("copy_bytes", 0) * t.get("delta", 0))
            what = s['collective'] + '/' + s['algorithm'] + (" rl.empty" if s.get("shared") else "")
            lines.append(f"    p={s['p']} {what:<30}{format_size(s['nbytes']):>10}"
                         f"  measured {s['seconds'] * 1e6:>10.1f} us  model {pred * 1e6:>10.1f} us"
                         f"  ({(pred / s['seconds'] - 1) * 100:+.0f}%)"
                         + ("  outlier, not fitted" if i in out else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="ringlet calibrate",
        description="Measure how this host's transports spend time - per message (alpha, "
                    "rendezvous, wake-ups), per byte (beta each side, the reduce cost, delta "
                    "copied, memory-hierarchy stalls), cores shared - by timing small "
                    "collectives with local ranks, fit the host model by least squares, and "
                    "save the profile predictions use by default.")
    ap.add_argument("-n", "--nranks", default=",".join(map(str, DEFAULT_RANKS)),
                    help="comma-separated group sizes to time (default 2,3,4,6: on a 2-core "
                         "machine 3, 4 and 6 ranks measure what sharing cores costs)")
    ap.add_argument("--transports", default="shm,tcp", help="comma-separated: shm, tcp")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated sizes (default 4K,64K,256K,1M,4M,16M,64M)")
    ap.add_argument("--budget", type=float, default=0.1,
                    help="seconds of repetitions per experiment and pass (default 0.1)")
    ap.add_argument("--passes", type=int, default=3,
                    help="interleaved passes over the experiments; the median is kept (3)")
    ap.add_argument("--output", default=None, type=output_path, help=f"profile path (default {profile_path()})")
    ap.add_argument("--dry-run", action="store_true", help="measure and print, do not save")
    ap.add_argument("--quick", action="store_true",
                    help="under a minute on a quiet 2-core host instead of several: "
                         "every experiment at 4 KiB-1 MiB and six at 4-64 MiB, with 2, 3 and "
                         "4 ranks, in 2 passes that wait at most 2 s for a quiet host, and a "
                         "shorter fit. Slightly less accurate: on a quiet 2-core host 26 s "
                         "for shm and tcp, median error 11.7-12.4%% against the full "
                         "profile's 10.3%% on the full run's timings; on a busy host its own "
                         "timings are what make it worse (42-79%% at load 6-15 here: "
                         "calibrate fully there). bench/quick_accuracy.py measures both on "
                         "your host")
    ap.add_argument("--refit", action="store_true",
                    help="measure nothing: fit the host model again to the timings the "
                         "profile keeps (after a change of the model)")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="also print every timing beside the fitted model's")
    ap.add_argument("--link-rate", metavar="RATE",
                    help="the link between hosts, e.g. 1gbit or 10gbit: saved in the profile "
                         "as the inter-host link (TCP as calibrated, no faster per byte than "
                         "the link), which algorithm='auto' then weighs on multi-host groups; "
                         "with --transports '' only that, nothing measured")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if a.link_rate:
            from .cost.profile import parse_rate
            parse_rate(a.link_rate)
        sizes = [parse_size(s) for s in a.sizes.split(",")] if a.sizes else list(DEFAULT_SIZES)
        transports = [t for t in a.transports.split(",") if t]
        for t in transports:
            if t not in BACKEND:
                raise ValueError(f"unknown transport {t!r}; valid: {', '.join(BACKEND)}")
        try:
            ranks = [int(x) for x in str(a.nranks).split(",") if x]
        except ValueError:
            raise ValueError(f"-n takes comma-separated group sizes, e.g. 2,3,4; got "
                             f"{a.nranks!r}") from None
        if not ranks or min(ranks) < 2:
            raise ValueError("calibration needs at least 2 ranks")
        if min(sizes) < 1:    # (--sizes 0 started minutes of calibration)
            raise ValueError(f"--sizes must be at least 1 byte each, got {a.sizes!r}")
        if not a.budget > 0:
            raise ValueError(f"--budget must be > 0 seconds, got {a.budget}")
        if a.passes < 1:      # (--passes 0 failed with a traceback after measuring nothing)
            raise ValueError(f"--passes must be at least 1, got {a.passes}")
    except ValueError as exc:
        print(f"ringlet calibrate: error: {exc}", file=sys.stderr)
        return 2
    if a.refit:
        return _refit_only(a)
    if not transports:
        return _link_only(a)
    kw = {"passes": a.passes}
    budget = a.budget
    if a.quick:
        budget = QUICK["budget"] if a.budget == ap.get_default("budget") else a.budget
        kw = {"passes": QUICK["passes"] if a.passes == ap.get_default("passes") else a.passes,
              "quiet": QUICK["quiet"], "retries": QUICK["retries"], "fit": QUICK["fit"]}
        if not a.sizes and a.nranks == ap.get_default("nranks"):
            kw["cells"] = QUICK["cells"]   # else every experiment at the sizes given
    plan = jobs(ranks, sizes, kw.get("cells"))
    est = estimate_seconds(transports, ranks, sizes, budget, kw["passes"], kw.get("fit"),
                           kw.get("cells"))
    n_sizes = len({nb for _, szs, _ in plan for nb in szs})
    print(f"calibrating {', '.join(transports)} with {', '.join(str(n) for n, _, _ in plan)} "
          f"ranks, {n_sizes} sizes, {kw['passes']} pass(es): about {_minutes(est)}"
          + ("" if a.quick else " (--quick: under a minute)"), flush=True)
    t0 = time.monotonic()
    prof, samples = calibrate(transports, ranks, sizes, budget, **kw)
    if a.quick:
        for name in samples:
            prof.transports[name]["quick"] = True
    print(report(prof, samples, verbose=a.verbose))
    print()
    print(summary_table(prof, samples))
    print(f"took {_minutes(time.monotonic() - t0)}")
    if not a.dry_run:
        if a.output is None:
            import warnings

            from .cost.profile import load_profile
            with warnings.catch_warnings():   # a stale profile is what this run replaces
                warnings.simplefilter("ignore")
                old = load_profile()
            if old.calibrated:  # keep transports this run did not measure
                for name, t in old.transports.items():
                    prof.transports.setdefault(name, t)
        if a.link_rate:
            prof = prof.with_link_rate(a.link_rate)
            print(f"inter-host link: {a.link_rate}")
        path = prof.save(a.output)
        print(f"saved {path}")
    return 0


def _refit_only(a) -> int:
    """``--refit``: the saved profile's timings fitted again and saved."""
    from .cost.profile import load_profile
    t0 = time.monotonic()
    try:
        prof, samples = refit(load_profile(a.output, strict=True))
    except ValueError as exc:
        print(f"ringlet calibrate: error: {exc}", file=sys.stderr)
        return 2
    print(report(prof, samples, verbose=a.verbose))
    print()
    print(summary_table(prof, samples))
    print(f"took {_minutes(time.monotonic() - t0)}")
    if not a.dry_run:
        print(f"saved {prof.save(a.output)}")
    return 0


def _link_only(a) -> int:
    """``--transports '' --link-rate RATE``: the saved profile (or the default one) with
    that inter-host link, measuring nothing."""
    import warnings

    from .cost.profile import load_profile
    if not a.link_rate:
        print("ringlet calibrate: error: nothing to do: no transports and no --link-rate",
              file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = load_profile(a.output)   # (the default one if there is none yet)
    prof = prof.with_link_rate(a.link_rate)
    print(f"inter-host link: {a.link_rate} ({prof.link('inter').bandwidth / 1e6:.0f} MB/s "
          f"of payload)")
    if not a.dry_run:
        print(f"saved {prof.save(a.output)}")
    return 0


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


__all__ = ["calibrate", "refit", "estimate_seconds", "Progress", "summary_table", "QUICK", "measure", "critical_counts", "report", "describe", "main", "others_load",
           "wait_quiet", "prefault_rings"]
