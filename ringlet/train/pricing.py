"""Price a training step's communication before it runs: the calls a pattern will make,
each priced by the cost model as ``algorithm="auto"`` would choose it, and the bytes each
rank sends counted on the very schedule that algorithm builds.

The communication-to-computation ratio, generalised to any pattern: gamma = T_comm / T_comp,
with T_comm the sum of the step's calls (none overlapped: the upper bound a profile's blocked time can only
undercut) and T_comp a compute estimate (:func:`compute_seconds`, or measured).
"""
from __future__ import annotations

import hashlib
import time
from typing import NamedTuple

import numpy as np

from .. import buffers, cost, ops
from ..ops import ReduceOp
from ..transport.shm import ZERO_COPY_MIN
from ..cost.tune import build_schedule
from .memory import note_shared


class Call(NamedTuple):
    """One collective of a step: ``nbytes`` in :mod:`ringlet.cost.model`'s size convention
    (the per-rank buffer for all_reduce/broadcast/all_to_all, the gathered total for
    all_gather/reduce_scatter/gather), on a group of ``p`` ranks; ``times`` per step."""
    collective: str
    nbytes: int
    p: int
    itemsize: int = 4
    times: int = 1
    label: str = ""
    shared: tuple = ()      # its buffers that are rl.empty arrays, as ``shared_if_large``
    dtype: object = None    # its elements' (a float16 or bfloat16 reduction costs more)
    p2p: bool = False       # made of sends, one per message ("direct", a send's limits)


def shared_if_large(collective: str, nbytes: int, p: int, *names: str) -> tuple:
    """What auto sees of a call whose buffers ``names`` the pattern takes from ``buffer``
    or ``lent`` (rl.empty arrays when large): those names once the call's own count - the
    per-rank block of an all_gather or reduce_scatter - is past ZERO_COPY_MIN, where the
    runtime asks the cost model with them; else none. A price without them had named an
    algorithm auto does not run (4 MiB bucket: double_tree priced 1.73 ms where
    rabenseifner runs, priced 1.00)."""
    # (the call's own count in bytes, as the runtime sees it: the cost model's inverse)
    return names if cost.model.count_of(collective, p, nbytes, 1) > ZERO_COPY_MIN else ()


class Priced(NamedTuple):
    call: Call
    algorithm: str
    seconds: float          # one call
    sent_bytes: int         # by the busiest rank, one call


class StepPrice(NamedTuple):
    """The communication of one step: per call and in total (every call counted ``times``);
    ``on``: what it was priced on."""
    calls: tuple
    on: str = ""

    @property
    def comm_seconds(self) -> float:
        return sum(c.seconds * c.call.times for c in self.calls)

    @property
    def bytes_per_rank(self) -> int:
        """Bytes the busiest rank sends per step (messages to itself excluded)."""
        return sum(c.sent_bytes * c.call.times for c in self.calls)

    def gamma(self, compute_seconds: float) -> float:
        """The communication-to-computation ratio of this step: comm_seconds / compute_seconds."""
        if compute_seconds <= 0:
            raise ValueError(f"compute_seconds must be > 0, got {compute_seconds!r}")
        return self.comm_seconds / compute_seconds

    def table(self) -> str:
        lines = [f"{'call':<44}{'x':>4}{'algorithm':>20}{'us each':>11}{'sent B each':>14}"]
        for c in self.calls:
            name = f"{c.call.collective} {cost.format_size(c.call.nbytes)}" + (
                f" {c.call.label}" if c.call.label else "")
            lines.append(f"{name:<44}{c.call.times:>4}{c.algorithm:>20}{c.seconds * 1e6:>11.1f}"
                         f"{c.sent_bytes:>14,}")
        lines.append(f"per step: {self.comm_seconds * 1e3:.3f} ms, "
                     f"{self.bytes_per_rank:,} B sent by the busiest rank"
                     + (f"; priced on {self.on}" if self.on else ""))
        return "\n".join(lines)


def buffer(n: int, dtype) -> np.ndarray:
    """A communication buffer: an ``rl.empty`` array when its messages may be large enough
    for local peers to read in place (saving a copy), else a plain one. Every rank asks
    for the same sizes, so every rank passes the same kind to a collective."""
    dtype = np.dtype(dtype)
    if n * dtype.itemsize <= ZERO_COPY_MIN:
        return np.empty(n, dtype)
    out = buffers.empty(n, dtype)
    note_shared()
    return out


def averaging(flat: np.ndarray, p: int):
    """The op that averages ``flat`` (gradients in a buffer of ours) over ``p`` ranks:
    AVG, a sum divided after; for 16-bit floats the values divided first (in place) and
    SUM, since the sum of p ranks' gradients overflows where their mean need not (two
    ranks' 40000 in float16: inf)."""
    if flat.dtype.itemsize > 2 or p == 1:
        return ReduceOp.AVG
    np.multiply(flat, 1.0 / p, out=flat)
    return ReduceOp.SUM


def disagreement(values, group) -> list | None:
    """Every rank's ``values`` (a few integers), if any rank's differ from the others':
    what a pattern checks once, as it is built, that every rank passed alike (a pattern
    whose ranks differ would fail later, in a collective, or wait until its timeout).
    None when all agree."""
    from ..collectives import all_gather
    mine = np.array(values, np.int64)
    every = np.empty((group.size, mine.size), np.int64)
    all_gather(every, mine, group=group)
    return every.tolist() if (every != every[0]).any() else None


def agree_on(pattern: str, differ: str, sizes, layout, settings, group, here: str,
             advice: str) -> int:
    """Raise on every rank unless all passed the same ``sizes`` (elements of each of the
    pattern's pieces: units, buckets), ``layout`` (each array's shape and dtype, in order)
    and ``settings`` (the rest that must match), the last two compared by ``digest``:
    "rank r: PATTERN: the ranks DIFFER (each rank's count of pieces and elements; here
    HERE): ADVICE", where DIFFER names what differs: the pieces (``differ``, whose last
    word names them: "cut different buckets"), the arrays' shapes, dtypes or order, or
    the settings.

    Returns the pattern's labels' base: piece k's collectives pass ``label=base + k %
    4096`` (:func:`label`), which every rank's call must match. Two objects of one layout
    (two GradBuckets, two ZeroOptimizers) called in other orders on other ranks had
    averaged each other's buckets, silently; the base is the group's sequence number of
    this agreement, alike on every rank and other for each object built on the group."""
    every = disagreement([len(sizes), sum(sizes), digest(sizes), digest(layout),
                          digest(settings)], group)
    if every is not None:
        from ..runtime import get_rank
        rows = np.array(every)
        what = differ if (rows[:, :3] != rows[0, :3]).any() else \
            "passed arrays of other shapes, dtypes or order" if (rows[:, 3] != rows[0, 3]).any() \
            else "passed other settings"
        said = "; ".join(f"rank {r}: {n} {differ.split()[-1]} of {e} elements"
                         for r, (n, e, *_) in enumerate(every))
        raise ValueError(f"rank {get_rank()}: {pattern}: the ranks {what} ({said}; here "
                         f"{here}): {advice}")
    return (group.seq % 2047) << 12      # (labels stay below 2**23 - 1: collectives._labelled)


def label(base: int, k: int) -> int:
    """The label of piece ``k``'s collectives of the object whose base ``agree_on`` gave."""
    return base + k % 4096


def digest(layout) -> int:
    """56 bits of a SHA-256 of ``repr(layout)``: what ``disagreement`` compares of a
    description (shapes, dtypes, settings) too long to gather whole."""
    return int.from_bytes(hashlib.sha256(repr(layout).encode()).digest()[:7], "little")


def lent(n: int, dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """A per-call communication buffer of ``n`` elements: when large (as ``buffer``), lent
    from ringlet's reused shared memory (``buffers.lend``). Returns (the array, what to
    ``buffers.give_back``, or None). Fresh shared pages cost a fault each (64 MiB: ~36 ms
    here, against 4 ms for a NumPy array on huge pages), so what a step needs again and
    again is lent, not allocated."""
    dtype = np.dtype(dtype)
    if n * dtype.itemsize <= ZERO_COPY_MIN:
        return np.empty(n, dtype), None
    buf = buffers.lend(n * dtype.itemsize)
    note_shared()
    return buffers.lent_view(buf, (n,), dtype), buf


def hosts_of(group):
    """The group's host of each rank, or None when it lives on one host."""
    ids = group.host_indices()
    return ids if len(set(ids)) > 1 else None


def overlaps(group, choice=None) -> bool:
    """Whether collectives on ``group`` stay in flight (``runtime.can_overlap``, the torch
    backend's rule too); ``choice``: True / False decides instead."""
    if choice is not None:
        return bool(choice)
    from ..runtime import can_overlap
    return can_overlap(group)


def _default_topology():
    from ..runtime import is_initialized, job_profile
    return job_profile() if is_initialized() else None


def price(calls, topology=None, hosts=None) -> StepPrice:
    """Price ``calls`` (:class:`Call`) on ``topology``: None (the job's profile, else this
    host's calibrated one), a :class:`ringlet.cost.Profile`, a :class:`ringlet.cost.Link`
    or tier name ("nvlink", "infiniband", ...: uniform link), or a
    :class:`ringlet.cost.Topology` (its ``p`` must match the calls'). ``hosts``: as
    :func:`ringlet.cost.choose` (None: one host)."""
    topo = _default_topology() if topology is None else topology
    out = []
    for call in calls:
        if call.p == 1 or call.nbytes == 0 and call.collective != "barrier":
            out.append(Priced(call, "-", 0.0, 0))
            continue
        on, only = topo, None
        if call.p2p:        # one send per message, with a send's limits, whole
            on = (topo if topo is not None else cost.load_profile())
            on = on.point_to_point() if hasattr(on, "point_to_point") else on
            only = ("direct",)
        algorithm, rows = cost.choose(call.collective, call.nbytes, call.p, topology=on,
                                      hosts=hosts, candidates=only, itemsize=call.itemsize,
                                      shared=call.shared, dtype=call.dtype)
        sched = build_schedule(call.collective, algorithm, call.p, call.nbytes, call.itemsize,
                               hosts=_host_ids(hosts, call.p, algorithm))
        sent = int(sched.traffic()["sent_bytes"].max())
        out.append(Priced(call, algorithm, rows[0].total, sent))
    return StepPrice(tuple(out), _describe(topo))


def _describe(topo) -> str:
    """What a price was computed on; an uncalibrated profile says so (its numbers are the
    built-in defaults, not this host's)."""
    if topo is None:
        from ..cost.profile import load_profile
        topo = load_profile()
    if hasattr(topo, "calibrated"):   # (a job's copy of the default says so, and is undated)
        return (f"this host's calibrated profile ({topo.created})" if
                topo.calibrated and topo.created else
                "the default profile (uncalibrated: run `ringlet calibrate`)")
    return str(topo)


_DTYPES = {2: np.float16, 4: np.float32, 8: np.float64}


def replay(calls, group=None, repeats: int = 20) -> float:
    """Measure ``calls`` (:class:`Call`, on ``group``'s ranks) as a step makes them, but
    back to back with nothing in between: the slowest rank's median over ``repeats`` of
    its time from a barrier to its last call's end, in seconds (``ringlet bench``'s way). Beside :func:`price` (the
    model) and ``rl.profile`` (inside the step: also waiting for peers still computing),
    the cost of the same calls on this host, now. Every rank of ``group`` calls it; calls
    on other groups (``p`` differs from the group's size) are skipped."""
    from .. import collectives as c
    from ..runtime import resolve
    g = resolve(group)
    p, runs = g.size, []
    for call in calls:
        if call.p != p or call.nbytes == 0 or p == 1:
            continue
        dt = call.dtype if call.dtype is not None else _DTYPES.get(call.itemsize, np.uint8)
        n = max(call.nbytes // np.dtype(dt).itemsize, 1)
        k = call.collective
        # (sends, as priced: one message per rank; else what auto runs)
        a = "direct" if call.p2p else "auto"
        if k in ("all_reduce", "broadcast"):
            buf = buffer(n, dt)
            ops.fill(buf, 1)
            fn = (lambda b=buf: c.all_reduce(b, group=g)) if k == "all_reduce" else \
                (lambda b=buf: c.broadcast(b, 0, group=g, algorithm=a))
        elif k in ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all",
                   "all_to_all_single"):
            m = -(-n // p)
            whole, part = buffer(p * m, dt).reshape(p, m), buffer(m, dt)
            ops.fill(whole, 1)
            ops.fill(part, 1)
            fn = {"all_gather": lambda w=whole, q=part: c.all_gather(w, q, group=g),
                  "reduce_scatter": lambda w=whole, q=part: c.reduce_scatter(q, w, group=g),
                  "gather": lambda w=whole, q=part: c.gather(q, w if g.rank == 0 else None, 0,
                                                             g, algorithm=a),
                  "scatter": lambda w=whole, q=part: c.scatter(q, w if g.rank == 0 else None, 0,
                                                               g, algorithm=a),
                  "all_to_all": lambda w=whole, q=whole.copy(): c.all_to_all(q, w, group=g),
                  "all_to_all_single": lambda w=whole, q=whole.copy():
                      c.all_to_all_single(q, w, [1] * p, [1] * p, group=g)}[k]
        else:
            raise ValueError(f"replay: no way to run {k!r}")
        runs += [fn] * call.times
    if not runs:
        return 0.0
    for fn in runs:          # plans built, algorithms picked
        fn()
    times = []
    for _ in range(repeats):
        c.barrier(group=g)
        t = time.perf_counter()
        for fn in runs:
            fn()
        times.append(time.perf_counter() - t)
    out = np.array([np.median(times)])      # as ``ringlet bench``: the slowest rank's median
    c.all_reduce(out, c.ReduceOp.MAX, group=g)
    return float(out[0])


def _host_ids(hosts, p, algorithm):
    if algorithm != "hierarchical" or hosts is None:
        return None
    from ..cost.tune import _host_ids as ids
    return ids(hosts, p)


def compute_seconds(flops: float, flop_rate: float | None = None) -> float:
    """Seconds to run ``flops`` at ``flop_rate`` FLOP/s (None: :func:`measure_flop_rate`).
    The textbook's estimate of a step is 6 * parameters * local batch FLOPs."""
    return flops / (flop_rate or measure_flop_rate())


_RATE: dict = {}


def measure_flop_rate(n: int = 192, dtype=np.float32, seconds: float = 0.05) -> float:
    """This process's sustained FLOP/s on an n x n matrix product (measured once, cached):
    the R of the planner for a model of small dense layers on this CPU."""
    key = (n, np.dtype(dtype).str)
    if key not in _RATE:
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((n, n)).astype(dtype), rng.standard_normal((n, n)).astype(dtype)
        a @ b
        reps, best, end = 0, float("inf"), time.perf_counter() + seconds
        while reps < 3 or time.perf_counter() < end:
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
            reps += 1
        _RATE[key] = 2.0 * n ** 3 / best
    return _RATE[key]
