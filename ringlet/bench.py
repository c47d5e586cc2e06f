"""``ringlet bench``: an nccl-tests style benchmark of ringlet's collectives, with the cost
model's prediction beside each measurement and, on request, Open MPI (mpi4py) and Gloo
(torch) measured on the same sizes in the same invocation.

Conventions (as nccl-tests): ``size`` is the per-rank buffer for all_reduce, broadcast,
reduce and all_to_all, and the whole gathered array for all_gather, reduce_scatter,
gather and scatter; time is the median over iterations of the slowest rank;
algbw = size / time; busbw = algbw x factor (all_reduce 2(p-1)/p; all_gather,
reduce_scatter, all_to_all, gather, scatter (p-1)/p; broadcast, reduce 1).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from .cost.model import parse_size
from .ops import dtype_named, fill, values
from .plotting import picture_path
from .schedule import USER_BUFFERS

FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p, "broadcast": lambda p: 1.0,
          "reduce": lambda p: 1.0, "all_gather": lambda p: (p - 1) / p,
          "reduce_scatter": lambda p: (p - 1) / p, "all_to_all": lambda p: (p - 1) / p,
          "gather": lambda p: (p - 1) / p, "scatter": lambda p: (p - 1) / p}
TOTAL_SIZED = {"all_gather", "reduce_scatter", "gather", "scatter"}
OPS = sorted(FACTOR)


def parse_sizes(spec: str) -> list[int]:
    """"8,1K,1M" or "8:256M" (doubling) or "8:256M:4" (multiply by 4); each size is read
    as everywhere in ringlet (:func:`ringlet.cost.parse_size`: 1M = 1MiB, 1MB = 10^6)."""
    if ":" in spec:
        parts = spec.split(":")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        factor = int(parts[2]) if len(parts) > 2 else 2
        if factor < 2:
            raise ValueError(f"the step {factor} of {spec!r} must be at least 2 "
                             f"(each size is the one before times the step)")
        if lo > hi:
            raise ValueError(f"{spec!r} runs from {lo} B down to {hi} B: give LO:HI")
        out, s = [], max(lo, 1)
        while s <= hi:
            out.append(s)
            s *= factor
        return out
    return [parse_size(x) for x in spec.split(",")]


def counts(op: str, nbytes: int, p: int, itemsize: int) -> tuple[int, int]:
    """(elements per rank block, elements in the full buffer) for a benchmark size."""
    n = max(nbytes // itemsize, 1)
    if op in TOTAL_SIZED or op == "all_to_all":
        n = max(n - n % p, p)
        return n // p, n
    return n, n


def iters_for(nbytes: int, iters: int | None) -> int:
    return iters if iters else max(5, min(1000, int(2e8 // max(nbytes, 1))))


def paged_empty(shape, dtype, into: int = 64) -> np.ndarray:
    """An uninitialised array starting ``into`` bytes into a page (0-4095), wherever the
    allocator puts it: two of them always meet at distance 0 within their pages, as NumPy's
    fresh large arrays do (16 bytes in), but arrays from the heap need not - and the
    kernel's copy between processes is 4-5x slow at distances of 1-31 bytes
    (transport/cma.py). A benchmark that allocates many buffers in one job uses it so every
    library meets the same placement; two with ``into`` d bytes apart meet at distance d."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + 2 * 4096, np.uint8)
    at = (-raw.ctypes.data) % 4096 + into % 4096
    return raw[at:at + n].view(dtype).reshape(shape)


def _make_call(rl, op, nbytes, p, rank, dtype, algo, zero_copy=False, fresh=False,
               plain=np.empty):
    """(call, reset, check): one collective; what restores its input between timed calls
    (outside the timer: in-place collectives overwrite their input); and a checker
    returning #wrong elements. ``zero_copy``: buffers come from rl.empty. ``fresh``: reset
    rewrites the input of every collective, not only of those that overwrite it - as a
    training step writes new gradients before it sends them. Unwritten, an input read by a
    peer stays in the peer's cache from the last call, and nothing crosses between the
    cores but what the library itself writes (a ring, a peer's output). ``call.inputs``:
    the arrays (or blocks of them) it sends from. ``plain``: what allocates the buffers
    when not ``zero_copy``."""
    inputs = []
    call, check, reset = _calls(rl, op, nbytes, p, rank, dtype, algo, zero_copy, inputs, plain)
    call.inputs = [a for a, _ in inputs]
    if fresh and reset is None and inputs:
        def reset():
            for a, value in inputs:
                fill(a, value)
    return call, reset or (lambda: None), check


def _calls(rl, op, nbytes, p, rank, dtype, algo, zero_copy, inputs, plain=np.empty):
    per, total = counts(op, nbytes, p, dtype.itemsize)
    alloc = rl.empty if zero_copy else plain

    def full(shape, value):
        a = alloc(shape, dtype)
        fill(a, value)
        return a

    def given(shape, value):     # an input: what a fresh reset writes again
        a = full(shape, value)
        v = np.asarray(value)
        # Blocks of one value each (a scatter's, an all_to_all's) are written again one
        # scalar fill per block, as the peers' inputs are (peers.py: x.fill): copying them
        # from an array as large reads 8 MiB more and left a p = 4 8 MiB scatter 1.4x
        # slower than the scalar fill did, in one job, alternating.
        assert v.ndim == 0 or (v == v[:, :1]).all(), "an input's blocks hold one value each"
        inputs.extend([(a, value)] if v.ndim == 0 else [(a[i], v[i, 0]) for i in range(len(v))])
        return a

    def wrong(a, want) -> int:   # elements of ``a`` not equal to ``want`` in this dtype
        w = np.empty(a.shape, dtype)
        fill(w, want)
        return int(np.count_nonzero(values(a) != values(w)))

    ranks = np.arange(p)
    expect_sum = sum(range(1, p + 1))
    if op == "all_reduce":
        x = full(total, rank + 1)
        def reset():
            fill(x, rank + 1)
        return (lambda: rl.all_reduce(x, algorithm=algo)), \
            lambda: wrong(x, expect_sum), reset
    if op == "broadcast":
        x = given(total, rank + 1) if rank == 0 else full(total, rank + 1)
        return (lambda: rl.broadcast(x, 0, algorithm=algo)), \
            lambda: wrong(x, 1), None
    if op == "reduce":
        x = full(total, rank + 1)
        def reset():
            fill(x, rank + 1)
        return (lambda: rl.reduce(x, 0, algorithm=algo)), \
            lambda: wrong(x, expect_sum) if rank == 0 else 0, reset
    blocks_of_ranks = np.repeat(ranks + 1, per).reshape(p, per)
    if op == "all_gather":
        x, y = given(per, rank + 1), full((p, per), 0)
        return (lambda: rl.all_gather(y, x, algorithm=algo)), \
            lambda: wrong(y, blocks_of_ranks), None
    if op == "reduce_scatter":
        x, y = given((p, per), rank + 1), full(per, 0)
        return (lambda: rl.reduce_scatter(y, x, algorithm=algo)), \
            lambda: wrong(y, expect_sum), None
    if op == "all_to_all":
        x = given((p, per), np.repeat(ranks + 100 * rank, per).reshape(p, per))
        y = full((p, per), 0)
        want = np.repeat(rank + 100 * ranks, per).reshape(p, per)
        return (lambda: rl.all_to_all(y, x, algorithm=algo)), \
            lambda: wrong(y, want), None
    if op == "gather":
        x = given(per, rank + 1)
        y = full((p, per), 0) if rank == 0 else None
        return (lambda: rl.gather(x, y, 0, algorithm=algo)), \
            lambda: wrong(y, blocks_of_ranks) if rank == 0 else 0, None
    if op == "scatter":
        x = given((p, per), blocks_of_ranks) if rank == 0 else None
        y = full(per, 0)
        return (lambda: rl.scatter(y, x, 0, algorithm=algo)), \
            lambda: wrong(y, rank + 1), None
    raise ValueError(f"unknown op {op!r}; valid: {', '.join(OPS)}")


def median_interval(values, level: float = 0.9, resamples: int = 2000) -> tuple:
    """The median of ``values`` and a ``level`` bootstrap interval for it (resampled with
    a fixed seed, so a table prints the same for the same measurements): (median, low,
    high). On this host a row's block pairs scatter widely (an in-job ratio of 0.6-1.9
    around a median of 1.1 is common), so whether a row meets a target is read from the
    interval, not from the median alone."""
    x = np.asarray(values, float)
    rng = np.random.default_rng(0)
    meds = np.median(x[rng.integers(0, len(x), (resamples, len(x)))], axis=1)
    lo, hi = np.quantile(meds, [(1 - level) / 2, (1 + level) / 2])
    return float(np.median(x)), float(lo), float(hi)


def verdict(interval: tuple, target: float) -> str:
    """'met' when the whole interval (median_interval) is at or above ``target``, 'missed'
    when it is all below, 'unsure' when the target lies inside it."""
    _, lo, hi = interval
    return "met" if lo >= target else "missed" if hi < target else "unsure"


def slowest_median_us(rl, call, calls: int, reset=None, barrier=None) -> float:
    """``calls`` timed calls of ``call`` (``reset`` first, untimed; then a barrier -
    ``barrier``, default ringlet's - then the call): the slowest rank's median, in
    microseconds, as every row here reports."""
    barrier = barrier or rl.barrier
    ts = np.empty(calls)
    for i in range(calls):
        if reset is not None:
            reset()
        barrier()
        t0 = time.perf_counter()
        call()
        ts[i] = time.perf_counter() - t0
    t = np.array([np.median(ts)])
    rl.all_reduce(t, op=rl.ReduceOp.MAX, algorithm="recursive_doubling")
    return float(t[0]) * 1e6


def alternating_blocks(rl, arms: dict, blocks: int, calls: int, switch=None,
                       barrier=None) -> dict:
    """An in-job A/B: ``blocks`` blocks of every arm (name -> ``(call, reset, ...)``), the
    arms in an order rotated block by block so a drift of the host hits them alike; each
    block a warm call, then :func:`slowest_median_us` of ``calls`` (after ``barrier``).
    ``switch(name)`` sets what the arm changes (a module flag) before its block and may
    return a function called with the block's time after it (to count or check something
    around the block). Returns {name: [us per block]}."""
    names = list(arms)
    res = {n: [] for n in names}
    for b in range(blocks):
        for k in range(len(names)):
            name = names[(b + k) % len(names)]
            after = switch(name) if switch is not None else None
            call, reset = arms[name][0], arms[name][1]
            reset()
            call()                      # (a warm call in this order)
            res[name].append(slowest_median_us(rl, call, calls, reset, barrier))
            if after is not None:
                after(res[name][-1])
    return res


def algorithm_ran(rl, op: str, call) -> str | None:
    """The algorithm one call of ``call`` (a collective ``op``) runs: read right after it,
    since the timing's own all_reduce (:func:`slowest_median_us`) is an all_reduce too."""
    call()
    return rl.stats()["collectives"].get(op, {}).get("algorithm")


def ab_row(rl, op: str, size: int, arms: dict, blocks: int, calls: int, switch=None) -> dict:
    """One row of an in-job A/B: :func:`alternating_blocks` of ``arms`` (name -> ``(call,
    reset, check)``), then every arm's wrong elements summed over the ranks and the
    algorithm the first arm runs. Every rank calls it."""
    first = next(iter(arms))
    if switch is not None:
        switch(first)
    ran = algorithm_ran(rl, op, arms[first][0])
    res = alternating_blocks(rl, arms, blocks, calls, switch=switch)
    wrong = np.array([sum(check() for _, _, check in arms.values())], np.int64)
    rl.all_reduce(wrong)
    return {"op": op, "size": size, "res": res, "wrong": int(wrong[0]), "ran": ran}


def spawn_rows(fn, p: int, *args, timeout: float = 1800) -> list:
    """Run ``fn(rank, *args, out)`` on ``p`` local ranks, rank 0 writing its rows to the
    JSON file ``out``; returns them."""
    import ringlet as rl
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        rl.spawn(fn, p, args=(*args, out), timeout=timeout)
        with open(out) as f:
            return json.load(f)


def write_rows(rank: int, rows: list, out: str) -> None:
    """:func:`spawn_rows`' other end: rank 0 writes ``rows``."""
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def auto_priced_by() -> str:
    """Which profile ``algorithm="auto"`` picks with in jobs started from here: a run's
    picks, and so its results, depend on it (uncalibrated, an 8 MiB scatter at p = 4 once
    ran a tree 2.5-3x slower than a calibration's pick)."""
    from .cost import load_profile
    prof = load_profile()
    if prof.calibrated:
        return f"auto picks on the calibrated profile {prof.source} ({prof.created or 'undated'})"
    return "auto picks on the default profile (uncalibrated: `ringlet calibrate` fits this host)"


def bind_like_mpirun(rank: int, p: int) -> None:
    """Pin this rank to one core, as ``mpirun`` pins Open MPI's ranks by default here
    (``--report-bindings``: rank r on core r at np = 2; no binding when ranks outnumber
    the cores, as at np = 4 with ``--oversubscribe``), so both sides of a comparison run
    placed alike. Unbound, two ranks of a loaded host often share one core for a whole
    job: fresh jobs of scatter p = 2 8 MiB at load 5 took 1241-2776 us unbound against
    153-322 us bound (Open MPI 150-264). Called after init, which counts the cores a rank
    may use to decide whether ranks are crowded."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if 1 < p <= len(cores):
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _worker(rank, cfg, out_path):
    import ringlet as rl
    p = rl.get_world_size()
    if cfg.get("bind", True):
        bind_like_mpirun(rank, p)
    dtype = dtype_named(cfg["dtype"])
    rows = []
    bar = None
    total_steps = len(cfg["algos"]) * len(cfg["sizes"])
    if rank == 0 and cfg.get("progress", True):
        try:
            from tqdm import tqdm
            import shutil   # a terminal of unknown size (0 x 0) would get no bar at all
            bar = tqdm(total=total_steps, desc=f"ringlet {cfg['op']} p={p}", file=sys.stderr,
                       leave=False, ncols=shutil.get_terminal_size().columns,
                       nrows=shutil.get_terminal_size().lines)
        except ImportError:
            bar = None
    for algo in cfg["algos"]:
        for nbytes in cfg["sizes"]:
            call, reset, check = _make_call(rl, cfg["op"], nbytes, p, rank, dtype, algo,
                                            cfg.get("zero_copy", False), cfg.get("fresh", False))
            n = iters_for(nbytes, cfg["iters"])
            for _ in range(cfg["warmup"]):
                reset()      # (in place, sums grow each call: unreset, they overflow)
                call()
            times = np.empty(n)
            for i in range(n):
                reset()
                rl.barrier()
                t0 = time.perf_counter()
                call()
                times[i] = time.perf_counter() - t0
            reset()
            call()                       # the checked call starts from a fresh input
            # What ran, read before the two all_reduces below overwrite the record.
            ran = rl.stats()["collectives"].get(cfg["op"], {}).get("algorithm", algo)
            t = np.array([np.median(times)])
            rl.all_reduce(t, op=rl.ReduceOp.MAX, algorithm="recursive_doubling")
            wrong = np.array([check() if cfg["check"] else 0], np.int64)
            rl.all_reduce(wrong, algorithm="recursive_doubling")
            if rank == 0:
                rows.append({"lib": "ringlet", "op": cfg["op"], "p": p, "bytes": nbytes,
                             "dtype": cfg["dtype"], "algorithm": algo, "ran": ran,
                             "zero_copy": cfg.get("zero_copy", False), "time_us": t[0] * 1e6,
                             "wrong": int(wrong[0]) if cfg["check"] else None})
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def _finish_row(row: dict, p: int) -> dict:
    t = row["time_us"] * 1e-6
    row["algbw_GBps"] = row["bytes"] / t / 1e9
    row["busbw_GBps"] = row["algbw_GBps"] * FACTOR[row["op"]](p)
    return row


def _predict(row: dict, backend: str) -> float | None:
    """The cost model's seconds for this row (``ringlet.cost.predict_host``: this host's
    calibrated profile). An "auto" row is priced as the algorithm it ran, or - when that
    was not recorded - as the one ``choose`` picks, which is how the runtime picks."""
    try:
        from . import cost
        algo = row["algorithm"]
        if algo == "auto":
            algo = row.get("ran") or "auto"
        shared = USER_BUFFERS[row["op"]] if row.get("zero_copy") else ()   # rl.empty
        return cost.predict_host(row["op"], row["bytes"], row["p"], algo, backend, shared=shared,
                                 dtype=row.get("dtype"))
    except (ImportError, AttributeError, ValueError, KeyError, TypeError, RuntimeError):
        return None


def run_ringlet(op, n, sizes, algos, dtype="float32", iters=None, warmup=3, check=False,
                backend=None, env=None, zero_copy=False, progress=True,
                bind=True, fresh=False) -> list[dict]:
    """Measure ringlet on ``n`` local ranks; one row per (algorithm, size). ``bind``: pin
    each rank to a core as mpirun does Open MPI's (bind_like_mpirun). ``fresh``: write the
    inputs again before every timed call (_make_call)."""
    from .launch import spawn
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.json")
        cfg = {"op": op, "sizes": sizes, "algos": algos, "dtype": dtype, "iters": iters,
               "warmup": warmup, "check": check, "zero_copy": zero_copy, "progress": progress,
               "bind": bind, "fresh": fresh}
        spawn(_worker, n, args=(cfg, path), backend=backend, env=env)
        with open(path) as f:
            rows = json.load(f)
    return rows


# -- peers: Open MPI through mpi4py, Gloo through torch --------------------------------------
def run_peer(lib: str, op: str, n: int, sizes: list[int], iters: int | None,
             fresh: bool = False) -> list[dict] | str:
    """Measure a peer library the same way; returns rows, or a reason it was skipped.
    ``fresh``: Open MPI's inputs are written again before every timed call, as ours."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.jsonl")
        args = ["--op", op, "--sizes", ",".join(map(str, sizes)), "--json", out, "-n", str(n)]
        if iters:
            args += ["--iters", str(iters)]
        if fresh:
            if lib != "mpi":
                return f"--fresh is measured for Open MPI only, not {lib}"
            args.append("--fresh")
        if lib == "mpi":
            python = _python_with("mpi4py")
            if python is None:
                return ("mpi4py is not installed in this Python nor in python3 on PATH (bash "
                        "bench/install_peers.sh, or pip install mpi4py; apt-get install openmpi-bin)")
            if not shutil.which("mpirun"):
                return "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
            cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n),
                   python, "-m", "ringlet.peers", "mpi", *args]
        elif lib == "gloo":
            try:
                import torch  # noqa: F401
            except ImportError:
                return ("torch is not installed in this Python (bash bench/install_peers.sh, or "
                        "pip install torch==2.13.0)")
            cmd = [sys.executable, "-m", "ringlet.peers", "gloo", *args]
        else:
            return f"unknown peer {lib!r} (valid: mpi, gloo)"
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [here] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            return f"{lib} run failed: {proc.stderr.strip().splitlines()[-1:]}"
        with open(out) as f:
            return [json.loads(line) for line in f]


def _python_with(module: str) -> str | None:
    """A Python that imports ``module`` (and NumPy, which the peer scripts need): this one,
    else python3 on PATH (the system's mpi4py when this is a venv without it). The peer
    imports ringlet from this tree (run_peer puts it on PYTHONPATH)."""
    try:
        __import__(module)
        return sys.executable
    except ImportError:
        pass
    other = shutil.which("python3")
    if other and os.path.realpath(other) != os.path.realpath(sys.executable):
        ok = subprocess.run([other, "-c", f"import {module}, numpy"], capture_output=True)
        if ok.returncode == 0:
            return other
    return None


def mpi_arm(comm, op: str, nbytes: int, fresh: bool = True) -> tuple:
    """Open MPI's call of ``op`` (mpi4py, buffers from :func:`paged_empty`) as an arm of
    :func:`alternating_blocks` in an mpirun job: ``(call, reset)``, ``reset`` writing the
    input again when ``fresh`` (as ``_make_call``'s do)."""
    from .peers import mpi_call
    call, x = mpi_call(comm, op, nbytes, paged_empty)
    return call, (lambda: x.fill(1.0)) if fresh and x is not None else (lambda: None)


def mpi_job_rows(script: str, p: int, args: list, prefix: tuple = ()) -> list:
    """Run ``script --child --out FILE *args`` as a ``p``-rank mpirun job (the in-job
    benchmarks against Open MPI: bench/in_job_vs_mpi.py, bench/algorithms_vs_mpi.py) with
    ringlet importable from this tree, and return the rows rank 0 wrote to FILE (JSON).
    ``prefix``: what each rank's command runs under (bench/call_phases.py: strace).
    Raises RuntimeError when mpi4py is missing or the job fails."""
    python = _python_with("mpi4py")
    if python is None:
        raise RuntimeError("needs mpi4py and Open MPI (bench/install_peers.sh)")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [here] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]))
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(p), *prefix,
               python, os.path.abspath(script), "--child", "--out", out, *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"p = {p}: the job failed:\n{proc.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)


def _fmt_size(n: int) -> str:
    for unit, s in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= s and n % s == 0:
            return f"{n // s}{unit}"
    return str(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ringlet bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2, help="ranks")
    ap.add_argument("--op", default="all_reduce", choices=OPS)
    ap.add_argument("--algo", "--algorithm", default="auto", help="comma-separated algorithm names")
    ap.add_argument("--sizes", default="8:64M:8", help='"8,1K,1M", "8:256M" or "8:256M:4"')
    ap.add_argument("--dtype", default="float32", help="element type (default float32)")
    ap.add_argument("--iters", type=int, default=None,
                    help="timed calls per size (default: 200 MB worth of the size, 5 to 1000)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    ap.add_argument("--check", action="store_true", help="verify results (#wrong column)")
    ap.add_argument("--zero-copy", action="store_true",
                    help="use rl.empty shared-memory buffers (read in place by local peers)")
    ap.add_argument("--fresh", action="store_true",
                    help="write every input again before each timed call, as a training step "
                         "writes new gradients (Open MPI's with --compare mpi too): unwritten, "
                         "a peer's input stays in the reader's cache from the call before")
    ap.add_argument("--backend", default=None, choices=["auto", "shm", "tcp"])
    ap.add_argument("--hosts", type=int, default=1,
                    help="emulate this many hosts with RINGLET_HOST_ID (TCP between them)")
    ap.add_argument("--compare", default="", help="peers to run too: mpi,gloo")
    ap.add_argument("--no-bind", action="store_true",
                    help="leave ranks unpinned (by default each is pinned to a core when "
                         "there are enough, as mpirun pins Open MPI's)")
    ap.add_argument("--json", help="append one JSON object per row to this file")
    ap.add_argument("--plot", metavar="FILE.png", type=picture_path,
                    help="save time and bus bandwidth vs size, the model's prediction "
                         "dashed, peers beside (needs matplotlib)")
    a = ap.parse_args(argv)
    if a.n < 2:     # (-n 1 ran, and printed a bus bandwidth of 0)
        ap.error(f"-n must be at least 2 ranks (a collective of one moves nothing), got {a.n}")
    if a.iters is not None and a.iters < 1 or a.warmup < 0:
        ap.error(f"--iters must be >= 1 and --warmup >= 0, got {a.iters} and {a.warmup}")
    unknown = [x for x in a.compare.split(",") if x and x not in ("mpi", "gloo")]
    if unknown:
        ap.error(f"--compare: unknown peer(s) {', '.join(unknown)}; valid: mpi, gloo")
    try:
        itemsize = dtype_named(a.dtype).itemsize
    except TypeError:
        ap.error(f"--dtype: unknown dtype {a.dtype!r} (e.g. float32, float16, bfloat16, int64)")
    if a.op in ("all_reduce", "reduce", "reduce_scatter"):
        from .ops import ReduceOp, check_op_dtype
        try:
            if dtype_named(a.dtype).kind != "c":    # (complex numbers sum)
                check_op_dtype(ReduceOp.SUM, dtype_named(a.dtype))
        except TypeError as exc:
            ap.error(f"--dtype {a.dtype}: {a.op} sums: {exc}")
    try:
        sizes = parse_sizes(a.sizes)
    except ValueError as exc:
        ap.error(f"--sizes: {exc}")
    # each row says the bytes the call moves: whole elements, at least one per rank's block
    # (asked 100 B of an all_gather at p = 3, it moves 96; asked 0, p elements)
    asked = sizes
    sizes = sorted({counts(a.op, s, a.n, itemsize)[1] * itemsize for s in sizes})
    rounded = sorted({s for s in asked if s not in sizes})
    if rounded:     # (said, as explain and draw say theirs: --sizes 0 had read as 4 B, unsaid)
        print(f"ringlet bench: --sizes {', '.join(map(str, rounded))} B moved as whole "
              f"{a.dtype} elements, at least one per rank's block: the rows give the bytes "
              f"each call moves", file=sys.stderr)
    algos = [x for x in a.algo.split(",") if x]
    from .algorithms import CATALOG     # unknown names fail here, before any rank starts
    bad = [x for x in algos if x != "auto" and x not in CATALOG[a.op]]
    if bad:
        ap.error(f"unknown {a.op} algorithm(s) {', '.join(bad)}; valid: auto, "
                 f"{', '.join(CATALOG[a.op])}")
    if a.plot:
        from .plotting import pyplot
        try:
            pyplot()                    # missing matplotlib is said before the ranks start
        except ValueError as exc:
            ap.error(str(exc))
    env = None
    if a.hosts > 1:
        if a.n % a.hosts:
            ap.error("--hosts must divide -n")
        env = {"RINGLET_HOST_ID_SPLIT": str(a.n // a.hosts)} if a.hosts == 2 else None
        if a.hosts != 2:
            ap.error("--hosts supports 1 or 2 emulated hosts")
    rows = run_ringlet(a.op, a.n, sizes, algos, a.dtype, a.iters, a.warmup, a.check,
                       a.backend, env, a.zero_copy, progress=sys.stdout.isatty() and sys.stderr.isatty(),
                       bind=not a.no_bind, fresh=a.fresh)
    backend = "tcp" if (a.backend == "tcp" or a.hosts > 1) else "shm"
    for r in rows:
        _finish_row(r, a.n)
        pred = _predict(r, backend)
        r["pred_us"] = pred * 1e6 if pred is not None else None
    peers = {}
    for lib in [x for x in a.compare.split(",") if x]:
        got = run_peer(lib, a.op, a.n, sizes, a.iters, fresh=a.fresh and lib == "mpi")
        if a.fresh and lib != "mpi":
            print(f"# {lib}: its inputs are written once (--fresh covers ringlet and Open MPI)")
        if isinstance(got, str):
            print(f"# {lib}: skipped — {got}")
        else:
            peers[lib] = {row["bytes"]: _finish_row(row, a.n) for row in got}
    _print(rows, peers, a.check)
    if a.json:
        with open(a.json, "a") as f:
            for r in rows + [row for v in peers.values() for row in v.values()]:
                f.write(json.dumps(r) + "\n")
    if a.plot:
        _plot(rows, peers, a.plot, a.op, a.n)
    return 0


def _print(rows, peers, check):
    aw = max([len("algorithm")] + [len(_algo_label(r)) for r in rows])
    head = (f"{'size':>8} {'count':>10} {'dtype':>8} {'op':>14} {'algorithm':>{aw}} {'time(us)':>10} "
            f"{'algbw':>8} {'busbw':>8} {'pred(us)':>9} {'err':>6}")
    if check:
        head += f" {'#wrong':>6}"
    for lib in peers:
        head += f" {lib + '(us)':>10} {'x' + lib:>7}"
    print("# pred: the cost model's time for the call; err: pred / time - 1 (+: the model "
          "prices it slower than it ran)")
    print(head)
    for r in rows:
        per, total = counts(r["op"], r["bytes"], r["p"], dtype_named(r["dtype"]).itemsize)
        pred = r.get("pred_us")
        err = f"{(pred - r['time_us']) / r['time_us'] * 100:+5.0f}%" if pred else "   n/a"
        line = (f"{_fmt_size(r['bytes']):>8} {total:>10} {r['dtype']:>8} {r['op']:>14} "
                f"{_algo_label(r):>{aw}} {r['time_us']:>10.1f} {r['algbw_GBps']:>8.3f} "
                f"{r['busbw_GBps']:>8.3f} {pred if pred is None else round(pred, 1)!s:>9} {err:>6}")
        if check:
            line += f" {r['wrong']:>6}"
        for lib, by_size in peers.items():
            pr = by_size.get(r["bytes"])
            if pr is None:
                line += f" {'-':>10} {'-':>7}"
            else:  # ratio > 1: ringlet is faster
                line += f" {pr['time_us']:>10.1f} {pr['time_us'] / r['time_us']:>6.2f}x"
        print(line)


def _plot(rows, peers, path, op, p):
    """Time and bus bandwidth vs size: a solid line per algorithm, the model's prediction
    dashed in the same colour, peers in black and grey."""
    from .plotting import pyplot
    plt = pyplot()
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.8))
    for algo in dict.fromkeys(r["algorithm"] for r in rows):
        mine = sorted((r for r in rows if r["algorithm"] == algo), key=lambda r: r["bytes"])
        xs = [r["bytes"] for r in mine]
        line, = ax_t.plot(xs, [r["time_us"] for r in mine], marker="o", ms=3,
                          label=f"ringlet {algo}")
        if algo == "auto":      # name what auto ran where its pick changes
            for i, r in enumerate(mine):
                if i == 0 or r.get("ran") != mine[i - 1].get("ran"):
                    ax_t.annotate(r.get("ran", "?"), (r["bytes"], r["time_us"]),
                                  xytext=(3, 6), textcoords="offset points", fontsize=7,
                                  color=line.get_color())
        ax_b.plot(xs, [r["busbw_GBps"] for r in mine], marker="o", ms=3, color=line.get_color(),
                  label=f"ringlet {algo}")
        pred = [(r["bytes"], r["pred_us"]) for r in mine if r.get("pred_us")]
        if pred:
            px, pt = zip(*pred)
            ax_t.plot(px, pt, ls="--", lw=1, color=line.get_color(), label=f"{algo}, model")
            ax_b.plot(px, [r["busbw_GBps"] * r["time_us"] / r["pred_us"] for r in mine
                           if r.get("pred_us")], ls="--", lw=1, color=line.get_color(),
                      label=f"{algo}, model")
    for (lib, by_size), style in zip(peers.items(), ("s-", "^-", "v-")):
        pts = sorted(by_size.items())
        xs = [b for b, _ in pts]
        colour = {"mpi": "0.15", "gloo": "0.55"}.get(lib, "0.35")
        name = {"mpi": "Open MPI", "gloo": "Gloo"}.get(lib, lib)
        ax_t.plot(xs, [r["time_us"] for _, r in pts], style, ms=3, color=colour, label=name)
        ax_b.plot(xs, [r["busbw_GBps"] for _, r in pts], style, ms=3, color=colour, label=name)
    from .plotting import size_axis
    for ax in (ax_t, ax_b):
        size_axis(ax)
        ax.set_xlabel("size in bytes (nccl-tests convention)")
        ax.grid(True, which="major", color="0.9")
    from .plotting import value_axis
    value_axis(ax_t)
    value_axis(ax_b)            # small sizes' bandwidth is orders below large ones
    ax_t.margins(x=0.08)        # (room for the name of what auto ran at the largest size)
    ax_t.set_ylabel("time per call (us, slowest rank's median)")
    ax_b.set_ylabel("bus bandwidth (GB/s)")
    ax_t.set_title("time (lower is better; auto: what it picked is named)", fontsize=9)
    ax_b.set_title("bus bandwidth (higher is better)", fontsize=9)
    ax_b.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"ringlet bench: {op}, {p} ranks (dashed: the cost model's prediction)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"# plot saved to {path}")


def _algo_label(r) -> str:
    return r["algorithm"] if r["algorithm"] != "auto" else f"auto:{r.get('ran', '?')}"


if __name__ == "__main__":
    sys.exit(main())
