"""The collectives users call: validate every argument before a byte moves, bind the
user's buffers to the schedule's names, pick the algorithm, and run this rank's part."""
from __future__ import annotations

import logging
import math
import os
import time

import numpy as np

from . import algorithms, buffers, fingerprint
from .buffers import locate
from .errors import CollectiveMismatch
from .group import TAG_COLLECTIVE, Group
from .profiling import profiled
from .ops import (ReduceOp, as_array, as_op, as_real, average, check_op_dtype, dtype_name,
                  dtype_named, reducer)
from . import runtime
from .runtime import _S, engine, job_profile, resolve, track
from .transport import copies, fast, limits
from .transport.protocol import ABANDONED, GAVE_UP, REFUSED
from .transport.shm import ZERO_COPY_MIN, ShmPeer
from . import tracing, tuning
from .work import CallId, Chained, CollectiveWork, check_timeout, compile_plan, record_call

log = logging.getLogger("ringlet")
_AVG = ReduceOp.AVG     # (ReduceOp.AVG goes through the Enum metaclass's __getattr__: 50 ns)
_DEBUG_ALGO = "algo" in os.environ.get("RINGLET_DEBUG", "")
_Trials = tuning.Trials     # (a module attribute less per call)


def _pick(collective: str, algorithm: str, g: Group, count: int, dtype: np.dtype, shared=()):
    """(algorithm to run, why, whether auto picked it for rl.empty buffers, whether its
    messages may be read in place) for a call."""
    table = algorithms.CATALOG[collective]
    itemsize = dtype.itemsize
    if algorithm == "auto":
        return _auto(collective, g, count, dtype, shared)
    if algorithm not in table:
        raise ValueError(f"unknown {collective} algorithm {algorithm!r}; valid: "
                         f"auto, {', '.join(table)}")
    return algorithm, (f"{collective} {count} x {itemsize} B p={g.size}: {algorithm} "
                       f"(forced by algorithm=)"), False, True


def _auto(collective: str, g: Group, count: int, dtype: np.dtype, shared=()):
    """Least predicted time under the job's profile (rank 0's, so every rank agrees).
    ``shared``: the call's buffers that are rl.empty arrays, whose large sends peers read
    in place; when that changes the pick, the fingerprint says so, and ranks that pass
    other kinds of buffers learn why they disagree instead of deadlocking. An rl.empty
    buffer's message can always take the plain path instead (as a NumPy buffer's does):
    when the plain pick is predicted faster than every pick read in place, the call runs
    it, and its messages are not read in place - the same call as with NumPy buffers."""
    return _auto_candidates(collective, g, count, dtype, shared, 1)[0][0]


def _auto_candidates(collective: str, g: Group, count: int, dtype: np.dtype, shared=(),
                     most: int = 1) -> list:
    """Up to ``most`` picks for auto, fastest predicted first, each with its predicted
    seconds: ((algorithm, why, picked for rl.empty buffers, read in place), seconds).
    The first is auto's pick; the others are the tuner's candidates (tuning.shortlist)."""
    from . import cost
    from .cost.tune import explain_line
    hosts = g.host_indices()
    hosts = hosts if len(set(hosts)) > 1 else None
    transport = "shm"
    if hosts is not None and engine().backend == "tcp" and \
            len({h.split("#")[0] for h in g.hosts}) == 1:
        # one machine whose ranks talk TCP (backend="tcp"): they share its cores, as the
        # profile's tcp host model prices; not hosts of their own
        hosts, transport = None, "tcp"
    nbytes = _priced_bytes(collective, g.size, count, dtype.itemsize)
    # (a float16 or bfloat16 reduction at its own cost per byte: cost.reduce_gamma)
    name, rows = cost.choose(collective, nbytes, g.size, topology=job_profile(), hosts=hosts,
                             dtype=dtype, shared=shared, transport=transport)
    why = explain_line(collective, nbytes, g.size, name, rows)
    if not shared:
        picks = [((r.algorithm, why, False, True), r.total) for r in rows]
    else:
        plain, prows = cost.choose(collective, nbytes, g.size, topology=job_profile(),
                                   hosts=hosts, dtype=dtype, transport=transport)
        kinds = f"rl.empty {', '.join(shared)}"
        picks = [((r.algorithm, f"{why} [{kinds}; with NumPy buffers: {plain}]",
                   r.algorithm != plain, True), r.total) for r in rows]
        # the plain path (the call a NumPy buffer makes), first where predicted faster
        picks.append(((plain, f"{explain_line(collective, nbytes, g.size, plain, prows)} "
                       f"[{kinds}: the plain path, predicted faster than {name} read in "
                       f"place]", False, False), prows[0].total))
        picks.sort(key=lambda pk: pk[1])     # (stable: a tie keeps the pick read in place)
    return picks[:min(most, tuning.shortlist([t for _, t in picks]))]


def _shared(bufs: dict) -> tuple:
    """Names of the call's buffers that are rl.empty arrays. A buffer only the root passes
    (scatter's input, gather's output: empty elsewhere) counts, on the other ranks, as the
    kind of the buffers they pass - as the root's must be, or auto picks differently."""
    names = tuple(name for name, arr in bufs.items() if locate(arr) is not None)
    return tuple(n for n, arr in bufs.items() if n in names or arr.size == 0) if names else ()


class Prepared:
    """What a call needs that does not depend on its buffers' addresses."""
    __slots__ = ("collective", "algorithm", "plan", "tmp", "pool", "ufunc", "fp", "why", "fast",
                 "in_place")

    def __init__(self, collective, algorithm, plan, tmp, pool, ufunc, fp, why, fast,
                 in_place=True):
        self.collective, self.algorithm = collective, algorithm
        self.plan = plan        # this rank's compiled plan (work.compile_plan)
        self.tmp = tmp          # elements of scratch ("tmp") it needs
        self.pool = pool        # free scratch arrays of that size and dtype
        self.ufunc = ufunc      # the reduction, or None
        self.fp = fp            # the call's fingerprint
        self.why = why          # why this algorithm (RINGLET_DEBUG=algo)
        self.fast = fast        # its fast.FastCall, or None when C cannot run it
        self.in_place = in_place   # its rl.empty messages may be read in place (else: plain path)

    def but(self, fp=None, why=None) -> "Prepared":
        """The same call with another fingerprint or reason."""
        return Prepared(self.collective, self.algorithm, self.plan, self.tmp, self.pool,
                        self.ufunc, self.fp if fp is None else fp,
                        self.why if why is None else why, self.fast, self.in_place)


_TMP: dict = {}     # (elements, dtype) -> scratch arrays free for reuse
_CALLS: dict = {}   # (collective, algorithm, group, count, dtype, root, splits, op, shared) -> Prepared
# (or tuning.Trials while auto's candidates are on trial)
_TRIALS: dict = {}  # the same keys -> tuning.Trials, until decided (kept when _CALLS is cleared)
_TUNED: dict = {}   # the same keys -> the Prepared the tuner decided on


def _forget_job() -> None:
    """At destroy: every prepared call names the job's groups and holds its peers."""
    for cache in (_TMP, _CALLS, _TRIALS, _TUNED):
        cache.clear()


runtime.AT_DESTROY.append(_forget_job)


def _mean_count(count: int, splits, p: int) -> int:
    """What a call is priced at: an uneven all-to-all at its mean block."""
    return sum(map(sum, splits)) // (p * p) if splits else count


def _priced_bytes(collective: str, p: int, count: int, itemsize: int) -> int:
    """The bytes auto prices ``count`` elements at (one price for nearby sizes:
    cost.tune.priced_size) - in a call, and in ``schedule(algorithm="auto")``."""
    from .cost import nbytes_of
    from .cost.tune import priced_size
    return priced_size(nbytes_of(collective, p, count, itemsize))


def _prepare(key: tuple):
    """Everything about a call that does not depend on the buffers' addresses, computed once
    per ``key`` (see ``_run``): the algorithm (auto asks the cost model, or its candidates
    go on trial: tuning.py), the schedule, this rank's plan, the ufunc."""
    hit = _CALLS.get(key) or _TUNED.get(key) or _TRIALS.get(key)
    collective, algorithm, g, count, dtype, root, splits, op, shared = key
    if hit is None and root is not None and collective not in fingerprint.ROOTED:
        # a label (_labelled): the unlabelled call's plan, its fingerprint stamped with the
        # label - each training object labels its pieces, and had kept a plan per piece
        plain = _prepare(key[:5] + (None,) + key[6:])
        if plain.__class__ is Prepared:
            hit = plain.but(fp=fingerprint.labelled(plain.fp, root))
    if hit is None:
        if op is not None:   # a pure function of (op, dtype), both in the key: cannot go stale
            check_op_dtype(ReduceOp(op), dtype)
        mean = _mean_count(count, splits, g.size)
        if algorithm != "auto":
            hit = _build(key, *_pick(collective, algorithm, g, mean, dtype, shared))
        else:
            trials = _S.tune if (g.size > 1 and splits is None and len(_TUNED) < tuning.LIMIT) \
                else 0
            picks = _auto_candidates(collective, g, mean, dtype, shared,
                                     tuning.MOST if trials else 1)
            calls = [_build(key, *pick) for pick, _ in picks]
            if len(calls) > 1:
                calls = [_on_trial(c, k, calls[0].algorithm, len(calls), t)
                         for k, (c, (_, t)) in enumerate(zip(calls, picks))]
                hit = _TRIALS[key] = tuning.Trials(calls, trials, [t for _, t in picks])
            else:
                hit = calls[0]
    if len(_CALLS) > 4096:
        _CALLS.clear()
    _CALLS[key] = hit
    return hit


def _on_trial(call: Prepared, k: int, pick: str, n: int, predicted: float) -> Prepared:
    """Candidate ``k`` of ``n`` on trial, saying so (RINGLET_DEBUG=algo): each candidate's
    own why was auto's, which named the model's pick whichever candidate ran."""
    plain = "" if call.in_place else " on the plain path (rl.empty buffers copied as NumPy's)"
    why = (f"on trial (RINGLET_TUNE): {call.algorithm}{plain}, candidate {k + 1} of {n}, "
           f"predicted {predicted * 1e6:.1f} us" + (
               "; the model's pick (async calls run it untimed): " + call.why if k == 0
               else f" (the model's pick is {pick})"))
    return call.but(why=why)


def _build(key: tuple, name: str, why: str, by_kind: bool, in_place: bool) -> Prepared:
    """The prepared call of ``key`` running algorithm ``name``."""
    collective, _, g, count, dtype, root, splits, op, _ = key
    op = None if op is None else ReduceOp(op)
    hosts = g.host_indices() if name == "hierarchical" else None
    # (a collective with no root keeps a label there: every rank's must match, below)
    rooted = root is not None and collective in fingerprint.ROOTED
    sched = algorithms.build(collective, name, g.size, count, itemsize=dtype.itemsize,
                             root=root if rooted else 0, hosts=hosts, splits=splits)
    fp = fingerprint.encode(collective, name, tuple(algorithms.CATALOG[collective]), dtype,
                            count, root, op, by_kind, fingerprint.members_code(g.ranks))
    tmp = sched.buffers.get("tmp", 0)
    pool = _TMP.setdefault((tmp, dtype.str), [])   # scratch arrays of this size, for reuse
    plan = compile_plan(sched.rank_plan(g.rank), g.ranks, _pieces_of(sched, g))
    ufunc = fast.reducer_in_c(reducer(op, dtype), dtype) if op is not None else None
    return Prepared(collective, name, plan, tmp, pool, ufunc, fp, why,
                    fast.prepare(engine(), plan, ufunc, dtype), in_place)


def _pieces_of(sched, g: Group):
    """For ``compile_plan``: elements per packet of a transfer (0: whole), by
    ``limits.pieces``, for a message to or from a local peer whose sender receives nothing
    in its round (in an exchange both cores copy anyway: pieces measured 0.90-0.95x there).
    Both ends decide alike from the schedule; None where no message can go in pieces."""
    isz = sched.itemsize
    if not limits.pieces(limits.SHM_EAGER_BYTES // isz, isz, g.size) or \
            max(sched.buffers.values(), default=0) * isz <= 2 * limits.SHM_PIECE_BYTES:
        return None
    alone = sched.sent_alone()
    peers, world = engine().peers, g.ranks

    def pieces_of(t):
        if (t.src, t.dst, t.soff, t.doff, t.n) not in alone:
            return 0
        out = t.src == g.rank
        peer = peers.get(world[t.dst if out else t.src])
        if not isinstance(peer, ShmPeer):
            return 0
        # the direction's own eager limit (a smaller ring, RINGLET_SHM_RING, lowers it):
        # both ends read it off the one ring it uses
        return limits.pieces(t.n, isz, g.size, eager=peer.eager if out else peer.eager_in)
    return pieces_of


def _run(collective: str, g: Group, algorithm: str, count: int, dtype: np.dtype, bufs: dict,
         op: ReduceOp | None, async_op: bool, timeout, root=None, splits=None, finish=None,
         numbered=None, lane=None):
    """``numbered``: the call's (sequence number, tag), if taken before (else the next).
    ``lane``: the call's key in the lane (``_lane``), where it goes once C has run it whole."""
    if timeout is not None:
        check_timeout(timeout)
    else:
        timeout = g.timeout     # (new_group's, if it gave one; else init's)
    # rl.empty buffers can change auto's pick, once some message may be read in place
    shared = _shared(bufs) if algorithm == "auto" and count * dtype.itemsize > ZERO_COPY_MIN else ()
    # What keys a prepared call. The group object itself (not its id, reused after destroy
    # and init): the plan holds its world ranks. The op by its value: an Enum member hashes
    # in Python (110 ns). _prepare is called on a miss only (a Python call less per call).
    key = (collective, algorithm, g, count, dtype, root, splits, op and op._value_, shared)
    call = _CALLS.get(key) or _prepare(key)
    if call.__class__ is _Trials:
        if not async_op:
            return _trial(call, key, collective, g, count, dtype, bufs, timeout, root, finish,
                          numbered, lane)
        call = call.first       # (async: the model's pick, not timed)
    return _execute(call, collective, g, count, dtype, bufs, async_op, timeout, root, finish,
                    numbered, lane)


def _trial(trials, key, collective, g, count, dtype, bufs, timeout, root, finish, numbered,
           lane):
    """A blocking call of a shape on trial: run the candidate whose turn it is and time
    it; the call after the last run agrees on the times with the group, keeps the fastest
    and runs it. A call that may take a lane (``lane``: _lane_key's) runs each candidate
    in a lane of its own once C ran it whole, as the chosen one will run: in a lane, a
    small call where ranks outnumber cores took 24-52 us less (16 KiB broadcast, p = 4 on
    2 cores: 50-66 us against 86-102). A run that fails counts too, as never faster
    (inf): a rank whose run timed out had stayed a run behind the others, and from then
    on every call of the shape ran another candidate there than on its peers
    (CollectiveMismatch for good)."""
    if trials.n >= len(trials.order):
        best = _decide(trials, key, collective, g, count, dtype, timeout)
        return _execute(best, collective, g, count, dtype, bufs, False, timeout, root, finish,
                        numbered, lane)
    i = trials.order[trials.n][0]
    start = time.perf_counter()
    try:
        hit = trials.lanes.get(i) if lane is not None and finish is None else None
        if hit is None or not _lane(hit, *_lane_arrays(collective, bufs), timeout):
            _execute(trials.calls[i], collective, g, count, dtype, bufs, False, timeout, root,
                     finish, numbered, None if lane is None else i, trials.lanes)
    except BaseException:
        trials.record(math.inf)
        raise
    trials.record(time.perf_counter() - start)


def _decide(trials, key, collective, g, count, dtype, timeout) -> Prepared:
    """Every rank ran every trial of ``key``: agree on the times, keep the fastest."""
    agreed = trials.medians()
    all_reduce(agreed, op=ReduceOp.MAX, group=g, algorithm="direct", timeout=timeout)
    what = (f"{collective} {count} x {dtype_name(dtype)} p={g.size} on group {g.name}"
            f"{' (rl.empty ' + ', '.join(key[-1]) + ')' if key[-1] else ''}")
    best = trials.calls[tuning.decide(trials, agreed, what)]
    why = tuning.describe(tuning.decisions()[-1])
    chosen = best.but(why=why)
    _TUNED[key] = _CALLS[key] = chosen
    del _TRIALS[key]
    if _DEBUG_ALGO:
        log.warning("ringlet rank %d: %s", _S.engine.rank, why)
    return chosen


def _execute(call, collective: str, g: Group, count: int, dtype: np.dtype, bufs: dict,
             async_op: bool, timeout, root, finish, numbered, lane, lanes=None):
    """Run this rank's part of a prepared call. Once C ran it whole, it gets a lane under
    the key ``lane`` in ``lanes`` (default: ``_S.lane``)."""
    eng = _S.engine     # (resolve(g) found it initialized)
    if _DEBUG_ALGO:
        log.warning("ringlet rank %d, %s #%d: %s", eng.rank, g.name, g.seq + 1, call.why)
    pool, fc = call.pool, call.fast
    bufs["tmp"] = scratch = pool.pop() if pool else np.empty(call.tmp, dtype)
    seq, tag = numbered or g.next_collective_tag()
    tr = resume = None
    if tracing.ON:
        from .cost.model import nbytes_of     # (the size every report and the model use)
        tr = tracing.Call(CallId(collective, seq, g.name, call.algorithm), tag,
                          nbytes_of(collective, g.size, count, dtype.itemsize), g.size,
                          call.plan, eng.peers,
                          _shared({k: v for k, v in bufs.items() if k != "tmp"}),
                          dtype_name(dtype))
    # The caller takes the engine to post its call: the progress thread may drive it, and
    # so may another thread of the user's making calls of its own (on other groups; each
    # hands the engine over in its waits). Unlocked while the progress thread was parked,
    # two threads' calls mixed their messages: wrong sums, or a rank a call behind.
    eng.enter()
    try:
        # A blocking call of EAGER messages with nothing else in flight runs in C as far as it goes.
        if fc is not None and not async_op and not eng.works and not eng.calls.aborts:
            ran = fast.run(fc, fc.arrays(bufs), tag, call.fp, eng)
            if ran is not None:
                rounds, _mask, waited, last = ran[:4]
                if tr is not None:
                    tr.ran_in_c(fast.FastRun.of(ran, fc), fc.rounds, bufs)
                if rounds == fc.rounds:
                    if fc.readers:
                        _gave_up_meanwhile(eng, fc, tag, call, collective, seq, g, pool,
                                           scratch)
                    if finish is not None:
                        finish()
                    pool.append(scratch)
                    record_call(eng, collective, call.algorithm, waited,
                                fc.peers[last].rank if last >= 0 else None, True)
                    table = _S.lane if lanes is None else lanes
                    if lane is not None and not tr and not _DEBUG_ALGO and lane not in table \
                            and len(table) < 1024 and _room_for(table, collective, root):
                        _open_lane(table, lane, collective, g, call, bufs, root)
                    return None
                resume = fast.FastRun.of(ran, fc)
        work = CollectiveWork(eng, call, g, seq, tag, bufs, finish, resume, tr)
    finally:
        eng.leave()
    if async_op:
        eng.background.watch(work)
        return track(work, timeout)
    work.wait_or_give_up(timeout)
    return None


def _gave_up_meanwhile(eng, fc, tag: int, call, collective: str, seq: int, g: Group, pool,
                       scratch) -> None:
    """A call C ran whole that read messages in place by CMA: a sender that gave up the
    call while it was read (its user may then write the buffer) had sent its ABORT, and
    said so in shared memory, before returning; the ABORT waits in the ring behind what C
    read, or behind other traffic still. Raise as the engine would have
    (C returns once its rounds are done, without reading on)."""
    if any(p.abort_waiting(tag) for p in fc.peers):
        eng.progress()          # (takes the ABORT: the call, not active, keeps it)
        given_up = eng.calls.given_up.pop(tag, None)
        if given_up is not None:
            pool.append(scratch)
            raise eng.calls.gave_up_error(str(CallId(collective, seq, g.name,
                                                     call.algorithm)), *given_up)
    # ... or it waits behind other traffic still: the sender said so in shared memory
    sender = next((p.rank for p in fc.peers if p.gave_up_on(tag)), None)
    if sender is not None:
        pool.append(scratch)
        raise eng.calls.gave_up_behind(tag, sender, str(CallId(collective, seq, g.name,
                                                               call.algorithm)))


#: the caller's buffers a collective's lane takes, in the order lane.run takes them
_LANE_BUFS = {"barrier": (), "all_reduce": ("buf",), "broadcast": ("buf",), "reduce": ("buf",)}


#: lanes of labelled calls the world's table keeps at most: every training object labels
#: its pieces afresh, and a job that made them again and again had filled the table (1024),
#: every later new call shape then running without a lane (1.3 -> 28 us an 8 B all_reduce)
LABELLED_LANES = 256


def _room_for(table: dict, collective: str, root) -> bool:
    """Whether a lane may open in ``table`` for a call of ``root`` (a labelled call's: only
    while fewer than LABELLED_LANES of the world's lanes are labelled ones)."""
    if root is None or collective in fingerprint.ROOTED or table is not _S.lane:
        return True
    return len(_S.labelled_lanes) < LABELLED_LANES


def _open_lane(table: dict, key, collective: str, g: Group, call: Prepared, bufs: dict,
               root) -> None:
    """Give a call C ran whole a lane (``_lane``) under ``key`` in ``table``, unless its plan leaves some
    caller's buffer alone (p = 1's all_reduce: C would not check the next one) or uses one
    of no bytes (a call that moves nothing takes the full path)."""
    fc, names = call.fast, _LANE_BUFS.get(collective, ("in", "out"))
    if fc.rule is not None or any((n in fc.names) != (bufs[n].size > 0) for n in names):
        return      # (a lane does not ask whether a CMA message's buffer is rl.empty)
    writes = (collective != "reduce" or g.rank == root,) if names == ("buf",) else (False, True)
    c = fast.lane(fc, names, tuple(bufs[n].nbytes for n in names), writes[:len(names)],
                  call.fp, call.pool, g, g._tag_base, TAG_COLLECTIVE, call.algorithm)
    table[key] = (g, call, c, names)
    _S.engine.lanes.setdefault(collective, []).append(c)
    if root is not None and collective not in fingerprint.ROOTED and table is _S.lane:
        _S.labelled_lanes.add(key)      # (_room_for)


def _lane_arrays(collective: str, bufs: dict) -> tuple:
    """A call's buffers as its lane takes them (``_LANE_BUFS``' order; None for one it
    does not pass on this rank, as a gather's output off the root)."""
    names = _LANE_BUFS.get(collective, ("in", "out"))
    got = [bufs[n] if bufs[n].size else None for n in names]
    return (got[0], got[1] if len(got) > 1 else None)


def _lane_key(collective: str, group, async_op: bool, algorithm, extra, a, b=False):
    """The key of a call's lane (see ``_lane``) on buffer ``a`` (and ``b``: in and out), or
    None when it cannot take one: not a blocking call (a subgroup's lane is keyed by the
    group too, so that one of several groups of a size never runs on another's), an
    algorithm that is not a string, a buffer that is not an ndarray (None: one the call ignores here, as a
    gather's output off the root), no bytes, or messages that may go by another path than
    C's (the smaller buffer above ZERO_COPY_MIN: rl.empty ones could change auto's pick).
    ``extra``: what else keys the call (its root, its op's value). Inline, not a loop: it
    runs on every small call (a loop over the buffers cost 0.7-1.0 us here)."""
    if async_op or type(algorithm) is not str:
        return None
    if group is not None and group is not _S.world:
        if type(group) is not Group:
            return None
        extra = (extra, group)        # (a subgroup's lane: drop_group forgets it)
    if b is False:
        if type(a) is np.ndarray and 0 < a.nbytes <= ZERO_COPY_MIN:
            return collective, algorithm, extra, a.dtype, a.size
        return None
    if a is None:
        a, b, flip = b, a, True      # (a scatter's input off the root)
    else:
        flip = False
    if type(a) is not np.ndarray:
        return None
    if b is None:
        n = a.nbytes
        sb = None
    elif type(b) is np.ndarray:
        n, m = a.nbytes, b.nbytes
        if m < n:
            n = m
        sb = b.dtype, b.size
    else:
        return None
    if not 0 < n <= ZERO_COPY_MIN:
        return None
    return collective, algorithm, extra, flip, a.dtype, a.size, sb


def _laned(key, timeout, a, b=None) -> bool:
    """Run the call in its lane, if it has one: True when done."""
    hit = _S.lane.get(key)
    return hit is not None and _lane(hit, a, b, timeout)


def _flat(arr: np.ndarray) -> np.ndarray:
    return arr if arr.ndim == 1 else arr.reshape(-1)    # (a reshape costs 80 ns)


def _writable(buf, name: str) -> np.ndarray:
    return as_array(buf, name, writable=True)


def _check_algorithm(algorithm):
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a string, got {type(algorithm).__name__}")


# -- broadcast, reduce, all_reduce -----------------------------------------------------------
def _refused(name: str, exc, args: dict) -> None:
    """A collective whose arguments failed a check on this rank (the ValueError or
    TypeError ``exc``, raised before the call took its number in the group's sequence):
    the group's other ranks, whose arguments passed, took the number and wait in the call.
    Left at that, this rank's next call took the number and paired with their call before
    it: a mismatch, then silently wrong results from the next call of that shape on (a
    training loop that skips a bad step summed steps i and i+1). So the numbers the call
    would have taken are taken here and given up: the others' calls fail at once, saying
    this rank refused them, and every rank's next call is the same call."""
    if getattr(exc, "_ringlet_refused", False):
        return        # (said by the call inside: all_to_all of arrays is all_to_all_single)
    exc._ringlet_refused = True
    tb = exc.__traceback__
    while tb is not None:     # raised once numbered (no argument check is): nothing to give up
        # (an uneven all_to_all gives up its own exchange: _all_to_all_v)
        if tb.tb_frame.f_code in _NUMBERED:
            return
        tb = tb.tb_next
    # An uneven all_to_all (lists, or splits) takes two numbers: its table's, its exchange's.
    uneven = (name == "all_to_all" and any(isinstance(args.get(k), (list, tuple))
                                           for k in ("out", "inp"))) or \
        (name == "all_to_all_single" and (args.get("in_splits") is not None or
                                          args.get("out_splits") is not None))
    refuse(name, exc, args.get("group"), 2 if uneven else 1)


def refuse(name: str, exc, group, numbers: int = 1) -> None:
    """Take the ``numbers`` next numbers of ``group``'s sequence and give them up, as
    refused here (``_refused``: a call whose arguments failed its checks; also the torch
    backend's, whose own checks come before ringlet's call)."""
    exc._ringlet_refused = True
    try:
        g = resolve(group)
    except Exception:      # (not initialized, no live group, not a member: no number here)
        return
    if g.size == 1:
        return
    seqs = _give_up(g, numbers, REFUSED)
    if hasattr(exc, "add_note"):     # (Python 3.11 on)
        exc.add_note(f"ringlet: rank {_S.world.rank} told the other ranks of group {g.name} "
                     f"that it refused {name} {' and '.join(seqs)}: their call fails at once, "
                     f"and every rank's next call of the group is the same call")


def abandon(group, numbers: int, exc) -> None:
    """The first part of a call of several numbers failed here with ``exc`` (the torch
    backend's reduce_scatter in Gloo's order: one all_reduce per block): take its other
    ``numbers`` and give them up, so the ranks whose parts went on fail at once, and every
    rank's next call pairs again."""
    _give_up(resolve(group), numbers, _abandoned_by(exc))


def _give_up(g: Group, numbers: int, why: int) -> list[str]:
    """Take ``g``'s next ``numbers`` numbers and give each up, told to the others as ``why``
    (protocol: REFUSED, GAVE_UP, ABANDONED); their "#seq" names."""
    eng = engine()
    with eng.held():
        seqs = []
        for _ in range(numbers):
            seq, tag = g.next_collective_tag()
            eng.calls.gave_up_unstarted(tag, g.ranks, why)
            seqs.append(f"#{seq}")
        eng.flush_aborts()      # (the error may end the process: the ABORTs go first)
    return seqs


def _abandoned_by(exc) -> int:
    """How a call's later part is given up after its earlier part failed with ``exc``: as
    a timeout where it timed out, else ABANDONED (a mismatch had read "its timeout ran
    out" there)."""
    return GAVE_UP if isinstance(exc, TimeoutError) else ABANDONED


@profiled("broadcast", refused=_refused)
def broadcast(buf, src: int, group=None, async_op: bool = False, algorithm: str = "auto",
              timeout: float | None = None):
    """Copy ``buf`` of group rank ``src`` into ``buf`` of every rank."""
    lane = _lane_key("broadcast", group, async_op, algorithm, src, buf) if type(src) is int \
        else None
    if lane is not None and _laned(lane, timeout, buf):
        return None
    g = resolve(group)
    _check_algorithm(algorithm)
    _root(src, g, "broadcast", "src")
    # (the root only reads it: a read-only array will do there, as for send)
    arr = as_array(buf, "broadcast buffer", writable=g.rank != src)
    return _run("broadcast", g, algorithm, arr.size, arr.dtype, {"buf": _flat(arr)}, None,
                async_op, timeout, root=src, lane=lane)


@profiled("all_reduce", refused=_refused)
def all_reduce(buf, op=ReduceOp.SUM, group=None, async_op: bool = False,
               algorithm: str = "auto", timeout: float | None = None, *,
               label: int | None = None):
    """Reduce ``buf`` across the group in place; every rank ends with the same bits.
    ``label``: as all_gather's (which of a model's buckets of one size this call reduces)."""
    lane = root = None
    if label is not None:     # (checked first: True would find label 1's lane)
        root = _labelled("all_reduce", label)
    if not async_op and type(buf) is np.ndarray and type(op) is ReduceOp and op is not _AVG \
            and type(algorithm) is str and buf.nbytes <= ZERO_COPY_MIN \
            and (group is None or group is _S.world or type(group) is Group):
        # (the world by name: the torch backend's; a label keys a lane of its own, whose
        # fingerprint carries it; a subgroup's is keyed by the group too: _lane_key)
        lane = ("all_reduce", buf.dtype, buf.size, op._value_, algorithm) if root is None \
            else ("all_reduce", buf.dtype, buf.size, op._value_, algorithm, root)
        if group is not None and group is not _S.world:
            lane += (group,)
        hit = _S.lane.get(lane)
        if hit is not None and _lane(hit, buf, None, timeout):
            return None
    # (the checks of the other collectives, with the common case inline: a Python call
    # costs ~500 instructions, 2% of an 8 B all_reduce)
    g = resolve(group)
    if type(algorithm) is not str:
        _check_algorithm(algorithm)
    if type(op) is not ReduceOp:
        op = as_op(op)
    arr = as_array(buf, "all_reduce buffer", True)
    if arr.dtype.kind == "c":       # (its lane key, of the complex dtype, never opens)
        arr, lane = as_real(arr, op, "all_reduce"), None
    flat = arr if arr.ndim == 1 else arr.reshape(-1)
    # (op and dtype are checked with the plan, once per kind of call: _prepare)
    return _run("all_reduce", g, algorithm, arr.size, arr.dtype, {"buf": flat}, op, async_op,
                timeout, root=root, finish=_averager(op, flat, g) if op is _AVG else None,
                lane=lane)


def _lane(hit: tuple, a, b, timeout) -> bool:
    """A small blocking collective on a group (every message at most ZERO_COPY_MIN
    bytes, so no rl.empty pick) that repeats one C ran whole - same collective, algorithm,
    root, op, dtypes and sizes (``_S.lane``, beside point-to-point's: runtime._lane) - is
    run again by its ``_fastpath.Lane`` in one C call: what the full path checked and
    prepared for it stands, and C checks the new buffers (``a`` and ``b``, in the order
    ``_LANE_BUFS`` names, None past them: C-contiguous, writable where written, aligned,
    apart from each other), numbers the call and counts it (``rl.stats`` adds the lanes'
    counts: work.fold_lanes). Not while a progress thread may drive the engine, anything else is in
    flight on it or aborts are pending, or calls are traced; nor when C declines a buffer
    or a peer is busy: False (nothing done, no sequence number taken). Where C does not
    finish it, the Python engine does, from where C stopped. The full path's Python, not
    C, is most of a small call: 8 B all_reduce at p = 2 took 5.9 us a call through the
    Python lane before, 2.4 of them in C."""
    if timeout is not None:
        check_timeout(timeout)
    else:
        timeout = hit[0].timeout    # (new_group's, if it gave one; else init's: as _run)
    eng = _S.engine
    if eng.works or eng.calls.aborts or not eng.background.idle or tracing.ON:
        return False
    if not eng.lock.acquire(False):   # another thread of the user's is in a call
        return False                  # (the full path waits for the engine)
    try:
        ran = hit[2].run(eng.fast_budget, eng.crowded, a, b)
        if ran is True:
            return True
        if ran is None:
            return False
        work = _resume(hit, ran, a, b)
    finally:
        eng.lock.release()
    work.wait_or_give_up(timeout)
    return True


def _resume(hit: tuple, ran: tuple, a, b) -> CollectiveWork:
    """A lane's call that C began and did not finish: the engine goes on from where C
    stopped. (Apart from _lane, whose every call would otherwise make a cell for the
    comprehension's variable: ~250 instructions of an 8 B call.)"""
    world, call, _, names = hit
    eng = _S.engine
    seq, tag, ran, tmp = ran
    arrays = (a, b)
    dtype = next((x.dtype for x in arrays if x is not None), np.dtype(np.uint8))
    bufs = {n: np.empty(0, dtype) if x is None else x.reshape(-1)
            for n, x in zip(names, arrays)}
    if tmp is None:     # (this rank's plan needs none, though the schedule may have some:
        # what CollectiveWork gives back to the pool must be the pool's size)
        tmp = call.pool.pop() if call.pool else np.empty(call.tmp, dtype)
    bufs["tmp"] = tmp
    return CollectiveWork(eng, call, world, seq, tag, bufs, None,
                          fast.FastRun.of(ran, call.fast))


@profiled("reduce", refused=_refused)
def reduce(buf, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False,
           algorithm: str = "auto", timeout: float | None = None):
    """Reduce ``buf`` across the group into ``buf`` of group rank ``dst``; the other
    ranks' buffers are left unchanged."""
    lane = _lane_key("reduce", group, async_op, algorithm, (dst, op._value_), buf) \
        if type(dst) is int and type(op) is ReduceOp and op is not _AVG else None
    if lane is not None and _laned(lane, timeout, buf):
        return None
    g = resolve(group)
    _check_algorithm(algorithm)
    op = as_op(op)
    _root(dst, g, "reduce", "dst")
    arr = _writable(buf, "reduce buffer") if g.rank == dst else as_array(buf, "reduce buffer")
    if arr.dtype.kind == "c":
        arr, lane = as_real(arr, op, "reduce"), None
    flat = _flat(arr)
    finish = _averager(op, flat, g) if g.rank == dst else None
    return _run("reduce", g, algorithm, arr.size, arr.dtype, {"buf": flat}, op, async_op,
                timeout, root=dst, finish=finish, lane=lane)


def _averager(op: ReduceOp, flat: np.ndarray, g: Group):
    p = g.size
    if op is not _AVG or p == 1:
        return None
    return lambda: average(flat, p)


# -- gathering and scattering ------------------------------------------------------------
def _blocks(x, p: int, like: np.ndarray, what: str, writable: bool):
    """Bind a (p, *shape) array — or a list of p arrays shaped like ``like`` — to one flat
    buffer. Returns (flat, finish): finish (None for an array) scatters a temporary back
    into the list, and returns the temporary lent for a list of rl.empty arrays."""
    if isinstance(x, (list, tuple)):
        if len(x) != p:
            raise ValueError(f"{what}: expected a list of {p} arrays (one per rank), got {len(x)}")
        arrs = [as_array(a, f"{what}[{i}]", writable=writable) for i, a in enumerate(x)]
        for i, a in enumerate(arrs):
            if a.dtype != like.dtype or a.size != like.size:
                raise ValueError(f"{what}[{i}]: expected {like.size} elements of "
                                 f"{dtype_name(like.dtype)}, got {a.size} of "
                                 f"{dtype_name(a.dtype)}")
        # A list of rl.empty arrays binds to a temporary of the same kind: the ranks that
        # pass no list (a gather's senders, a scatter's receivers) count the root's as
        # rl.empty too, and auto must price both alike (a plain temporary at a gather's
        # root picked dissemination where the senders picked direct: CollectiveMismatch)
        lent = None
        if arrs and all(locate(a) is not None for a in arrs):
            lent = buffers.lend(p * like.nbytes)
            flat = buffers.lent_view(lent, (p * like.size,), like.dtype)
        else:
            flat = np.empty(p * like.size, like.dtype)
        if not writable:
            for i, a in enumerate(arrs):
                copies.assign(flat[i * like.size:(i + 1) * like.size], _flat(a))
            return flat, (None if lent is None else lambda: buffers.give_back(lent))

        def copy_back():
            for i, a in enumerate(arrs):
                copies.assign(_flat(a), flat[i * like.size:(i + 1) * like.size])
            buffers.give_back(lent)
        return flat, copy_back
    arr = as_array(x, what, writable=writable)
    if arr.dtype != like.dtype:
        raise TypeError(f"{what}: dtype {dtype_name(arr.dtype)} differs from "
                        f"{dtype_name(like.dtype)}")
    if arr.size != p * like.size:
        raise ValueError(f"{what}: expected {p} x {like.size} = {p * like.size} elements "
                         f"(shape {(p, *like.shape)}), got {arr.size} (shape {arr.shape})")
    return _flat(arr), None


def _separate(inp: np.ndarray, out: np.ndarray, own: int | None = None) -> np.ndarray:
    """An input that aliases the output is copied first, except the in-place all_gather
    (gather at the root): an input that *is* block ``own`` of the output. Every algorithm
    reads that block only as this rank's contribution and writes it only with the same
    values (its local copy is then a self-copy, which NumPy and the C path skip or make
    harmless), so it needs neither the copy nor the allocation."""
    if not np.shares_memory(inp, out):
        return inp
    if own is not None and _is_block(inp, out, own):
        return inp
    if locate(inp) is None:
        return inp.copy()
    # an rl.empty input's copy is one too: the kind of buffers decides auto's pick, and
    # this rank's must be the others' (a plain copy made it pick apart: a mismatch)
    copy = buffers.empty(inp.shape, inp.dtype)
    copies.assign(copy, inp)
    return copy


def _is_block(inp: np.ndarray, out: np.ndarray, k: int) -> bool:
    """Is flat ``inp`` exactly block ``k`` (of inp.size elements) of flat ``out``?"""
    block = out[k * inp.size:(k + 1) * inp.size]
    return (inp.size == block.size and inp.dtype == out.dtype and inp.strides == block.strides
            and inp.__array_interface__["data"][0] == block.__array_interface__["data"][0])


@profiled("all_gather", refused=_refused)
def all_gather(out, inp, group=None, async_op: bool = False, algorithm: str = "auto",
               timeout: float | None = None, *, label: int | None = None):
    """Every rank contributes ``inp``; ``out`` (shape (p, *inp.shape), or a list of p
    arrays) receives all contributions in rank order. ``label``: a number below 2**23 - 1
    every rank must pass alike, checked with the call's messages (which of a model's
    units of one size this call gathers: ranks whose calls disagree on it raise
    CollectiveMismatch, where the sizes alone would match)."""
    root = _labelled("all_gather", label)    # (checked first: True would find label 1's lane)
    lane = _lane_key("all_gather", group, async_op, algorithm, root, inp, out)
    if lane is not None and _laned(lane, timeout, inp, out):
        return None
    g = resolve(group)
    _check_algorithm(algorithm)
    a = as_array(inp, "all_gather input")
    flat_out, copy_back = _blocks(out, g.size, a, "all_gather output", True)
    bufs = {"in": _separate(_flat(a), flat_out, own=g.rank), "out": flat_out}
    return _run("all_gather", g, algorithm, a.size, a.dtype, bufs, None, async_op, timeout,
                root=root, finish=copy_back, lane=lane)


def _labelled(name: str, label) -> int | None:
    """Where a collective with no root keeps its ``label`` (checked with the call's
    messages): the fingerprint's root field, label + 1, or None. 23 bits of it: the word is
    a signed 64-bit integer in C and on the wire, and from 2**23 on label + 1 set its sign
    bit and failed every call (OverflowError). A labelled call's lane is keyed by its label
    too (its fingerprint is its first call's)."""
    if label is None:
        return None
    if isinstance(label, bool) or not isinstance(label, (int, np.integer)) \
            or not 0 <= label < (1 << 23) - 1:
        raise ValueError(f"{name}: label must be an int in [0, 2**23 - 1), got {label!r}")
    return int(label) + 1


@profiled("reduce_scatter", refused=_refused)
def reduce_scatter(out, inp, op=ReduceOp.SUM, group=None, async_op: bool = False,
                   algorithm: str = "auto", timeout: float | None = None, *,
                   label: int | None = None):
    """Reduce ``inp`` (shape (p, *out.shape), or a list of p arrays) across the group;
    rank i receives block i of the result in ``out``. ``inp`` is left unchanged.
    ``label``: as all_gather's (which of a model's shards of one size this call reduces)."""
    root = _labelled("reduce_scatter", label)   # (checked first, as all_gather's)
    lane = _lane_key("reduce_scatter", group, async_op, algorithm,
                     op._value_ if root is None else (op._value_, root), inp, out) \
        if type(op) is ReduceOp and op is not _AVG else None
    if lane is not None and _laned(lane, timeout, inp, out):
        return None
    g = resolve(group)
    _check_algorithm(algorithm)
    op = as_op(op)
    o = _writable(out, "reduce_scatter output")
    if o.dtype.kind == "c":
        o, lane = as_real(o, op, "reduce_scatter"), None
        inp = [as_real(as_array(a, f"reduce_scatter input[{i}]"), op, "reduce_scatter")
               for i, a in enumerate(inp)] if isinstance(inp, (list, tuple)) \
            else as_real(as_array(inp, "reduce_scatter input"), op, "reduce_scatter")
    check_op_dtype(op, o.dtype)
    flat_in, done = _blocks(inp, g.size, o, "reduce_scatter input", False)
    flat_out = _flat(o)
    bufs = {"in": _separate(flat_in, flat_out), "out": flat_out}
    avg = _averager(op, flat_out, g)
    finish = avg if done is None else done if avg is None else (lambda: (avg(), done()))
    return _run("reduce_scatter", g, algorithm, o.size, o.dtype, bufs, op, async_op, timeout,
                root=root, finish=finish, lane=lane)


@profiled("gather", refused=_refused)
def gather(inp, out=None, dst: int = 0, group=None, async_op: bool = False,
           algorithm: str = "auto", timeout: float | None = None):
    """Collect every rank's ``inp`` into ``out`` on group rank ``dst`` (``out`` is only
    needed there: shape (p, *inp.shape) or a list of p arrays)."""
    lane = _lane_key("gather", group, async_op, algorithm, dst, inp, out) if type(dst) is int \
        else None
    if lane is not None and _laned(lane, timeout, inp, out):
        return None
    g = resolve(group)
    _check_algorithm(algorithm)
    _root(dst, g, "gather", "dst")
    a = as_array(inp, "gather input")
    copy_back = None
    if g.rank == dst:
        if out is None:
            raise ValueError(f"gather: the destination rank {dst} must pass an output")
        flat_out, copy_back = _blocks(out, g.size, a, "gather output", True)
    else:
        flat_out = np.empty(0, a.dtype)
    bufs = {"in": _separate(_flat(a), flat_out, own=g.rank), "out": flat_out}
    return _run("gather", g, algorithm, a.size, a.dtype, bufs, None, async_op, timeout,
                root=dst, finish=copy_back, lane=lane)


@profiled("scatter", refused=_refused)
def scatter(out, inp=None, src: int = 0, group=None, async_op: bool = False,
            algorithm: str = "auto", timeout: float | None = None):
    """Group rank ``src`` splits ``inp`` (shape (p, *out.shape) or a list of p arrays);
    rank i receives block i in ``out``."""
    lane = _lane_key("scatter", group, async_op, algorithm, src, inp, out) if type(src) is int \
        else None
    if lane is not None and _laned(lane, timeout, inp, out):
        return None
    g = resolve(group)
    _check_algorithm(algorithm)
    _root(src, g, "scatter", "src")
    o = _writable(out, "scatter output")
    if g.rank == src:
        if inp is None:
            raise ValueError(f"scatter: the source rank {src} must pass an input")
        flat_in, done = _blocks(inp, g.size, o, "scatter input", False)
    else:
        flat_in, done = np.empty(0, o.dtype), None
    bufs = {"in": _separate(flat_in, _flat(o)), "out": _flat(o)}
    return _run("scatter", g, algorithm, o.size, o.dtype, bufs, None, async_op, timeout, root=src,
                finish=done, lane=lane)


# -- all-to-all --------------------------------------------------------------------------
@profiled("all_to_all", refused=_refused)
def all_to_all(out, inp, group=None, async_op: bool = False, algorithm: str = "auto",
               timeout: float | None = None):
    """Block j of ``inp`` goes to rank j; block i of ``out`` comes from rank i. ``out`` and
    ``inp`` are arrays of shape (p, ...) or lists of p arrays (lists may differ in size:
    they go as uneven splits)."""
    if isinstance(out, (list, tuple)) or isinstance(inp, (list, tuple)):
        return _all_to_all_lists(out, inp, resolve(group), algorithm, async_op, timeout)
    return all_to_all_single(out, inp, None, None, group, async_op, algorithm, timeout)


def _all_to_all_lists(out, inp, g: Group, algorithm, async_op, timeout):
    """all_to_all of lists of p arrays (uneven splits). (Apart from all_to_all, whose every
    call would otherwise make cells for copy_back's variables.)"""
    if not (isinstance(out, (list, tuple)) and isinstance(inp, (list, tuple))):
        raise TypeError("all_to_all: pass both out and inp as lists, or both as arrays")
    for what, x in (("output", out), ("input", inp)):
        if len(x) != g.size:
            raise ValueError(f"all_to_all {what}: expected a list of {g.size} arrays, got {len(x)}")
    ins = [as_array(a, f"all_to_all input[{i}]") for i, a in enumerate(inp)]
    outs = [as_array(a, f"all_to_all output[{i}]", writable=True) for i, a in enumerate(out)]
    dtype = ins[0].dtype if ins else np.dtype(np.float32)
    for i, a in enumerate(ins + outs):
        if a.dtype != dtype:
            raise TypeError(f"all_to_all: every array must have dtype {dtype_name(dtype)}, "
                            f"one has {dtype_name(a.dtype)}")
    flat_in = np.empty(sum(a.size for a in ins), dtype)
    off = 0
    for a in ins:    # (not np.concatenate: its memcpy crawls at some distances, copies.py)
        copies.assign(flat_in[off:off + a.size], _flat(a))
        off += a.size
    flat_out = np.empty(sum(a.size for a in outs), dtype)

    def copy_back():
        off = 0
        for a in outs:
            copies.assign(_flat(a), flat_out[off:off + a.size])
            off += a.size
    return _all_to_all_v(g, flat_out, flat_in, [a.size for a in outs], [a.size for a in ins],
                         algorithm, async_op, timeout, copy_back)


@profiled("all_to_all_single", refused=_refused)
def all_to_all_single(out, inp, out_splits=None, in_splits=None, group=None,
                      async_op: bool = False, algorithm: str = "auto",
                      timeout: float | None = None):
    """All-to-all on single arrays. Without splits, dim 0 divides evenly among ranks; with
    ``in_splits`` / ``out_splits`` (rows of dim 0 per rank, as in torch) the exchange is
    uneven — the routing of mixture-of-experts tokens."""
    lane = None
    if out_splits is None and in_splits is None:
        lane = _lane_key("all_to_all", group, async_op, algorithm, None, inp, out)
        if lane is not None and _laned(lane, timeout, inp, out):
            return None
    g = resolve(group)
    _check_algorithm(algorithm)
    i = as_array(inp, "all_to_all input")
    o = as_array(out, "all_to_all output", writable=True)
    if i.dtype != o.dtype:
        raise TypeError(f"all_to_all: input dtype {dtype_name(i.dtype)} differs from output dtype "
                        f"{dtype_name(o.dtype)}")
    p = g.size
    if out_splits is None and in_splits is None:
        if i.size != o.size or i.size % p:
            raise ValueError(f"all_to_all: input ({i.size} elements) and output ({o.size}) must "
                             f"have the same size, divisible by the group size {p}; for "
                             f"uneven exchanges pass all_to_all lists of arrays, or "
                             f"all_to_all_single in_splits/out_splits")
        bufs = {"in": _separate(_flat(i), _flat(o)), "out": _flat(o)}
        return _run("all_to_all", g, algorithm, i.size // p, i.dtype, bufs, None, async_op, timeout,
                    lane=lane)
    row_i, row_o = int(np.prod(i.shape[1:])), int(np.prod(o.shape[1:]))  # elements per row
    in_rows = _splits(in_splits, i, p, "in_splits")
    out_rows = _splits(out_splits, o, p, "out_splits")
    # (np.multiply, not a comprehension over row_i: that would make a cell every call)
    return _all_to_all_v(g, _flat(o), _flat(i), np.multiply(out_rows, row_o).tolist(),
                         np.multiply(in_rows, row_i).tolist(), algorithm, async_op, timeout, None,
                         "all_to_all_single")


def _splits(splits, arr, p, what):
    rows = arr.shape[0] if arr.ndim else 0
    if splits is None:
        if rows % p:
            raise ValueError(f"all_to_all_single: {what} omitted but dim 0 ({rows}) is not "
                             f"divisible by the group size {p}")
        return [rows // p] * p
    splits = [int(s) for s in splits]
    if len(splits) != p or min(splits, default=0) < 0:
        raise ValueError(f"all_to_all_single: {what} must be {p} non-negative ints, got {splits}")
    if sum(splits) != rows:
        raise ValueError(f"all_to_all_single: {what} sums to {sum(splits)} but dim 0 has {rows} rows")
    return splits


def _all_to_all_v(g, flat_out, flat_in, out_counts, in_counts, algorithm, async_op, timeout,
                  finish, name="all_to_all"):
    """Uneven all-to-all: first every rank learns the whole split matrix (a small
    all_gather), so inconsistent splits raise on every rank before any data moves. In
    flight, the exchange starts once the matrix is in, numbered now: calls made meanwhile
    keep their places in the group's sequence."""
    # Its arguments are checked here, before the table's all_gather: refused in there (a
    # bad timeout) or in the exchange (an unknown algorithm), the call gave up one of the
    # two numbers its peers took, and every later call paired with their call before it.
    if timeout is not None:
        check_timeout(timeout)
    _check_algorithm(algorithm)
    if algorithm != "auto" and algorithm not in algorithms.CATALOG["all_to_all"]:
        raise ValueError(f"unknown all_to_all algorithm {algorithm!r}; valid: auto, "
                         f"{', '.join(algorithms.CATALOG['all_to_all'])}")
    p = g.size
    mine = np.array(list(in_counts) + list(out_counts), np.int64)
    table = np.empty((p, 2 * p), np.int64)

    def exchange(numbered=None):
        sends, recvs = table[:, :p], table[:, p:]
        bad = np.argwhere(sends != recvs.T)
        if len(bad):
            a, b = bad[0]
            raise CollectiveMismatch(
                f"rank {g.rank}: {name} of group {g.name}: ranks disagree on the splits: rank "
                f"{a} sends {sends[a, b]} elements to rank {b}, which expects {recvs[b, a]} "
                f"(check {'in_splits/out_splits' if name == 'all_to_all_single' else 'the sizes of the input and output lists'} on both)")
        splits = tuple(tuple(int(x) for x in row) for row in sends)
        bufs = {"in": _separate(flat_in, flat_out), "out": flat_out}
        return _run("all_to_all", g, algorithm, 0, flat_in.dtype, bufs, None, async_op, timeout,
                    splits=splits, finish=finish, numbered=numbered)

    first = all_gather(table, mine, group=g, algorithm="auto", async_op=True, timeout=timeout)
    numbered = g.next_collective_tag()
    if not async_op:
        # The exchange's number is taken with the table's, as in flight: a rank whose
        # all_gather timed out while a late one's completed had left that one's exchange
        # a number ahead of every later call of the group - each of them then summed with
        # the others' next (silently wrong from the second on). Here it gives the number up.
        try:
            first.wait_or_give_up(timeout)
        except BaseException as exc:
            first._reported = True     # (raised here: destroy need not say it again)
            eng = engine()
            with eng.held():
                eng.calls.gave_up_unstarted(numbered[1], first.world_of, _abandoned_by(exc))
            raise
        try:
            return exchange(numbered)
        except (ValueError, TypeError) as exc:   # (refused after both numbers were taken)
            exc._ringlet_refused = True
            eng = engine()
            with eng.held():
                eng.calls.gave_up_unstarted(numbered[1], first.world_of, REFUSED)
                eng.flush_aborts()
            raise
    return Chained(engine(), first, lambda: exchange(numbered),
                   f"all_to_all #{numbered[0]} of group {g.name} (uneven)")


@profiled("barrier", refused=_refused)
def barrier(group=None, async_op: bool = False, timeout: float | None = None, *,
            algorithm: str = "auto"):
    """Return only when every rank of the group has entered the barrier. ``algorithm``:
    "auto" or "dissemination", its one algorithm (keyword only: as the other collectives
    take it, where an older call may pass the timeout third)."""
    if algorithm != "auto" and algorithm != "dissemination":
        _check_algorithm(algorithm)
        raise ValueError(f"barrier: unknown algorithm {algorithm!r}; valid: auto, "
                         f"dissemination")
    lane = None
    if not async_op and (group is None or group is _S.world or type(group) is Group):
        lane = _BARRIER if group is None or group is _S.world else (*_BARRIER, group)
        hit = _S.lane.get(lane)     # (a repeated one: _lane)
        if hit is not None and _lane(hit, None, None, timeout):
            return None
    g = resolve(group)
    return _run("barrier", g, "dissemination", 0, np.dtype(np.uint8), {}, None, async_op, timeout,
                lane=lane)


_BARRIER = ("barrier",)     # its key in the lane


def _root(root, g: Group, what: str, name: str) -> None:
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool):
        raise TypeError(f"{what}: {name}={root!r} must be an int, a rank of {g.name}")
    if not 0 <= root < g.size:
        raise ValueError(f"{what}: {name}={root!r} is out of range for {g.name} of size {g.size}")


#: the functions past which a call has its number (an error out of one is not a refusal)
_NUMBERED = {_execute.__code__}


def schedule(collective: str, p: int, count: int, dtype="float32", algorithm: str | None = None,
             root: int = 0, hosts=None, splits=None):
    """The Schedule an algorithm runs — print it to see its rounds and transfers.

    ``algorithm``: a name from ``ringlet.algorithms.CATALOG[collective]``; None, the
    collective's usual one (``cost.DEFAULT_ALGORITHM``: ring, binomial, pairwise, ...);
    "auto", the one this host's cost model picks for ``count`` elements of ``dtype`` on
    plain arrays (what ``algorithm="auto"`` runs before any tuning; ``hosts``, one host id
    per rank, prices them on several hosts)."""
    from .cost.model import DEFAULT_ALGORITHM, check_collective
    check_collective(collective)
    dtype = dtype_named(dtype)
    hosts = tuple(hosts) if hosts is not None else None
    splits = tuple(tuple(r) for r in splits) if splits is not None else None
    if algorithm is None:
        algorithm = DEFAULT_ALGORITHM[collective]
    elif algorithm == "auto":
        from .cost import choose
        many = hosts is not None and len(set(hosts)) > 1
        nbytes = _priced_bytes(collective, p, _mean_count(count, splits, p), dtype.itemsize)
        algorithm = choose(collective, nbytes, p, hosts=hosts if many else None,
                           dtype=dtype)[0]
    return algorithms.build(collective, algorithm, p, count, itemsize=dtype.itemsize,
                            root=root, hosts=hosts, splits=splits)


__all__ = ["broadcast", "all_reduce", "reduce", "all_gather", "reduce_scatter", "gather",
           "scatter", "all_to_all", "all_to_all_single", "barrier", "schedule"]
