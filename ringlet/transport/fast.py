"""The C fast path of collectives of EAGER messages over shared memory (``_fastpath.c``).

A small call (8 B all_reduce, a barrier) is all fixed cost: in Python, creating the work,
posting requests, polling every peer and matching packets is ~15 us at p = 2, while the
bytes cross in well under one; up to the EAGER limit (512 KiB) Python's fixed cost still
weighs (64 KiB all_reduce at p = 2: 23 us in Python, 10 us in C). When every message of a
rank's plan is an EAGER packet to a local peer, the runtime hands the *same compiled plan*
to C, which writes and reads the same packets the Python engine would. At the first
surprise (a packet of another call, a peer not there or a ring that stays full within the
spin budget) C stops and reports how far it got, and the Python engine resumes the plan
from there — so every failure, mismatch and timeout is still handled by the one engine
that knows how.

An exchange's messages from plain buffers past the EAGER limit run in C too, by
cross-memory attach as the Python engine would move them (``_fastpath.c`` says how; C
hands the engine whatever else it meets, a send still waiting for its answer included):
there the engine's setup of each call cost 110-190 us of a p = 2 8 MiB all_gather
(docs/results.md, "Where the p = 2 8 MiB plain rows lose").

The extension is optional: without a compiler the runtime runs everything in Python.
RINGLET_NO_FASTPATH=1 turns it off (to compare, or to rule it out). Reductions, in C as in
the engine, ignore NumPy's floating-point error state: under np.errstate(over="raise") a
float all_reduce that overflows gives inf, as MPI's would, instead of raising.
"""
from __future__ import annotations

import operator
import os
import struct
from typing import NamedTuple

import numpy as np

from ..buffers import locate
from ..ops import BFLOAT16
from ..schedule import PlanRound, RecvStep, SendStep
from . import cma, limits, protocol
from .shm import SLOT_CTRL, ShmPeer

try:
    from . import _fastpath
except ImportError:   # built without a C compiler: the Python engine does it all
    _fastpath = None

# Kernel table order of _fastpath.c: dtypes (kind, itemsize) by rows, ops by columns; the
# last row is bfloat16's (ops.BFLOAT16, a structured dtype: named, not by kind).
_DTYPES = (("i", 1), ("u", 1), ("i", 2), ("u", 2), ("i", 4), ("u", 4), ("i", 8), ("u", 8),
           ("f", 4), ("f", 8), ("f", 2), ("bfloat16", 2))
_HAVE = _fastpath.kernels() if _fastpath is not None else b""   # which this CPU has
_OPS = {"add": 0, "multiply": 1, "minimum": 2, "maximum": 3, "bitwise_and": 4,
        "bitwise_or": 5, "bitwise_xor": 6}
FAST_BYTES = limits.FAST_BYTES   # the largest message of a call C runs (see limits.py)
MAX_RECVS = 62     # receives of one round: a bit mask in one int64
MAX_BUFFERS = 8
MAX_PEERS = 64     # (_fastpath.c's MAX_LINKS)
# A call with CMA messages runs in C (False: in the Python engine, as before; for A/Bs in
# one job: bench/algorithms_vs_mpi.py --flag CMA_IN_C)
CMA_IN_C = True
# ... and so does one whose CMA sources lie in rl.empty buffers (False: the engine reads
# them in place; run() says why; --flag EMPTY_CMA_IN_C)
EMPTY_CMA_IN_C = True


def enabled() -> bool:
    """Read at engine start, so forked ranks see their own environment."""
    return _fastpath is not None and os.environ.get("RINGLET_NO_FASTPATH") != "1"


N_KERNELS = len(_DTYPES) * 7


def itemsize_of(kernel: int) -> int:
    """The element size kernel ``kernel`` works on."""
    return _DTYPES[kernel // 7][1]


def kernel(ufunc, dtype: np.dtype) -> int | None:
    """Index of the C reduce kernel for ``ufunc`` on ``dtype`` (-1 when nothing reduces),
    or None if C has none (bool, complex, byte-swapped …): then the call stays in Python."""
    if ufunc is None:
        return -1
    if ufunc.__class__ is CReduce:
        return ufunc.kernel
    kind = "bfloat16" if dtype == BFLOAT16 else dtype.kind
    if not dtype.isnative or (kind, dtype.itemsize) not in _DTYPES:
        return None
    op = _OPS.get(getattr(ufunc, "ufunc", ufunc).__name__)   # (Bfloat16Reduce: its ufunc)
    if op is None or (kind in ("f", "bfloat16") and op >= 4):
        return None
    k = _DTYPES.index((kind, dtype.itemsize)) * 7 + op
    return k if k < len(_HAVE) and _HAVE[k] else None


class CReduce:
    """``ufunc(acc, src, out=dst)`` by C's kernel: the Python engine's reductions of the
    dtypes NumPy reduces slowly, float16 and bfloat16 (in float32, rounded back; the same
    bits). Measured per input byte on this host, sums of 2 MiB: float16 26.2 GB/s against
    NumPy's 0.4, bfloat16 14.8 (AVX-512) against ops.Bfloat16Reduce's 0.2."""
    __slots__ = ("kernel", "__name__")

    def __init__(self, k: int, name: str):
        self.kernel, self.__name__ = k, name

    def __call__(self, acc, src, out):
        _fastpath.reduce(self.kernel, out, acc, src)


def reducer_in_c(ufunc, dtype: np.dtype):
    """``ufunc``, or a :class:`CReduce` of its kernel where NumPy's own loop is slow."""
    if ufunc is None or not (dtype == np.float16 or dtype == BFLOAT16):
        return ufunc
    k = kernel(ufunc, dtype)
    if k is None:
        return ufunc
    kind = "bfloat16" if dtype == BFLOAT16 else "float16"
    return CReduce(k, f"{kind}_{getattr(ufunc, 'ufunc', ufunc).__name__}")


class FastCall:
    """One prepared call's plan in the form C reads, with the rings it uses. ``cma``: the
    positions in ``names`` of the buffers its CMA messages are read from (by peers), and
    ``rule`` the switches that chose them (``_cma_rule``); ``readers``: the ``cma.Reader``
    of each peer it reads a CMA message of."""
    __slots__ = ("names", "plan", "peers", "links", "kernel", "rounds", "arrays", "cma", "rule",
                 "readers")

    def __init__(self, names, plan, peers, links, kernel, rounds, cma=(), rule=None,
                 readers=()):
        self.names, self.plan, self.peers, self.links = names, plan, peers, links
        self.kernel, self.rounds, self.cma, self.rule = kernel, rounds, cma, rule
        self.readers = readers
        # arrays(bufs): the call's buffers in the plan's order, as one tuple (a generator
        # into tuple() cost 190 ns of a 3.4 us call)
        if len(names) > 1:
            self.arrays = operator.itemgetter(*names)
        else:    # (itemgetter of one name returns the item, not a tuple; of none, fails)
            self.arrays = lambda bufs: tuple(bufs[n] for n in names)


def prepare(engine, plan: tuple, ufunc, dtype: np.dtype) -> FastCall | None:
    """A FastCall for a compiled plan (``work.compile_plan``), or None when some message
    is neither an EAGER one to a local peer nor an exchange's message the Python engine
    would move by CMA (``by_cma``), or C cannot reduce this dtype."""
    if not engine.fast or (plan and plan[0].then >= 0):   # (C runs rounds in turn only)
        return None
    k = kernel(ufunc, dtype)
    if k is None:
        return None
    order: dict[int, int] = {}      # world rank -> position in peers

    def peer(world_rank, nbytes):
        p = engine.peers.get(world_rank)
        # (zc_min <= eager: above it an rl.empty buffer's message goes by RTS, not EAGER)
        if not isinstance(p, ShmPeer) or (nbytes is not None
                                          and nbytes > min(p.zc_min, FAST_BYTES)):
            raise LookupError
        return order.setdefault(world_rank, len(order))

    sources, readers = set(), {}

    def by_cma(t, rnd, sending: bool) -> bool:
        """Whether the engine would move message ``t`` of ``rnd`` by CMA from a plain
        buffer (protocol.Peer.post_send's rule): past one EAGER packet and the peer's
        ``cma_min`` (crowded: past one EAGER packet), in a round that sends and receives,
        into a receive that copies."""
        n = (t.s1 - t.s0) if sending else (t.d1 - t.d0)
        n *= dtype.itemsize
        p = engine.peers.get(t.dst if sending else t.src)
        if not isinstance(p, ShmPeer) or p.cma_min < 0:
            return False
        least = (min(p.eager if sending else p.eager_in, p.cma_min)
                 if engine.crowded and protocol.CROWDED_EXCHANGE_CMA else p.cma_min)
        least = max(least, min(p.zc_min, FAST_BYTES))
        if n <= least or (rnd.copies_out if not sending else rnd.copies_in) == 0:
            return False
        if t.reduce:           # (a receive that reduces declines it: cma.py)
            return False
        if sending:
            sources.add(t.sbuf)
            return True
        readers[t.src] = p.cma
        return True

    try:
        names, words = encode(plan, dtype.itemsize, peer, by_cma)
    except LookupError:       # a message too big, or not to a local peer
        return None
    if len(order) > MAX_PEERS:
        return None
    peers = tuple(engine.peers[r] for r in order)
    return FastCall(names, words, peers, tuple(_link(p) for p in peers), k, len(plan),
                    tuple(names.index(b) for b in sorted(sources)),
                    _cma_rule(engine) if sources or readers else None, tuple(readers.values()))


def _cma_rule(engine) -> tuple:
    """What decides which messages go by CMA beyond their sizes: whether ranks outnumber
    cores, and whether an exchange then reads blocks past one EAGER packet (a switch
    benchmarks and tests flip between calls; a call prepared under another value is left
    to the engine, so an A/B flipping it must prepare its calls again:
    bench/algorithms_vs_mpi.py --flag)."""
    return engine.crowded, protocol.CROWDED_EXCHANGE_CMA


def encode(plan: tuple, itemsize: int, peer, by_cma=None) -> tuple:
    """(buffer names, the plan as C reads it): int64 words, offsets in bytes —
    [rounds, itemsize], then per round [locals, receives, sends] and their records:
    local (reduce, src buf, offset, bytes, dst buf, offset, acc buf or -1, offset),
    receive (peer, reduce, dst buf, offset, bytes, acc buf or -1, offset, by CMA),
    send (peer, src buf, offset, bytes, by CMA). ``peer(world rank, bytes)`` numbers the
    peers (LookupError: not one C may talk to; bytes None: a message by CMA, of any size);
    ``by_cma(step, round, sending)``: whether a message goes by CMA (default: none)."""
    names = tuple(sorted({name for rnd in plan for name in (
        *(b for t in rnd.local for b in (t.sbuf, t.dbuf, t.abuf)),
        *(b for t in rnd.recvs for b in (t.dbuf, t.abuf)),
        *(t.sbuf for t in rnd.sends))} - {None}))
    if len(names) > MAX_BUFFERS:
        raise LookupError
    index = {n: i for i, n in enumerate(names)}
    size = itemsize
    words = [len(plan), size]
    for rnd in plan:
        if len(rnd.recvs) > MAX_RECVS:
            raise LookupError
        words += [len(rnd.local), len(rnd.recvs), len(rnd.sends)]
        for t in rnd.local:
            words += [int(t.reduce), index[t.sbuf], t.s0 * size, (t.s1 - t.s0) * size,
                      index[t.dbuf], t.d0 * size, -1 if t.abuf is None else index[t.abuf],
                      t.a0 * size]
        for t in rnd.recvs:
            n = (t.d1 - t.d0) * size
            c = by_cma is not None and by_cma(t, rnd, False)
            words += [peer(t.src, None if c else n), int(t.reduce), index[t.dbuf], t.d0 * size,
                      n, -1 if t.abuf is None else index[t.abuf], t.a0 * size, int(c)]
        for k, t in enumerate(rnd.sends):
            n = (t.s1 - t.s0) * size
            c = by_cma is not None and by_cma(t, rnd, True)
            if c and k >= 64:      # (C keeps a round's CMA sends in one 64-bit mask)
                raise LookupError
            words += [peer(t.dst, None if c else n), index[t.sbuf], t.s0 * size, n, int(c)]
    return names, struct.pack(f"<{len(words)}q", *words)


def _link(peer: ShmPeer) -> bytes:
    """Addresses C needs of one pair's two rings (they live as long as the engine)."""
    def ring(r):
        data = r.data.ctypes.data
        return data - SLOT_CTRL, data, r.capacity

    asleep = peer.outbox.data.ctypes.data - peer.outbox.base   # word 0 of the peer's segment
    return pack_link(*ring(peer.inbox), *ring(peer.outbox), asleep, peer.fast_counts.ctypes.data,
                     peer.pid)


def pack_link(in_ctrl, in_data, in_cap, out_ctrl, out_data, out_cap, asleep, counts,
              pid=0) -> bytes:
    """One link as C reads it: 9 int64 (addresses, the rings' capacities, the peer's pid)."""
    return struct.pack("<9q", in_ctrl, in_data, in_cap, out_ctrl, out_data, out_cap, asleep,
                       counts, pid)


def p2p(engine, kind: str, peer: int, tag: int, data) -> tuple[bool, float]:
    """A blocking point-to-point ``kind`` ("send" or "recv") of ``data`` (a C-contiguous
    array, moved as bytes; a receive's is writable) with world rank ``peer``, in C when it
    is EAGER and local - as a one-round plan: (done, seconds of the wait C gave up on).
    Not done: the caller posts it as usual."""
    key = (kind, peer, data.nbytes)
    fc = engine.fast_p2p.get(key, False)
    if fc is False:
        n = data.nbytes
        plan = ((PlanRound((), (SendStep(peer, "buf", 0, n),), ()),) if kind == "send" else
                (PlanRound((), (), (RecvStep(peer, False, "buf", 0, n, None, 0, 0),)),))
        fc = prepare(engine, plan, None, np.dtype(np.uint8))
        if len(engine.fast_p2p) > 1024:
            engine.fast_p2p.clear()
        engine.fast_p2p[key] = fc
    if fc is None or engine.works:
        return False, 0.0
    ran = _fastpath.run(fc.plan, (data,), fc.peers, fc.links, fc.kernel, tag, 0, 0,
                        engine.fast_budget, engine.crowded, _wake)    # (as run(): a call less)
    if ran is None:
        return False, 0.0
    return ran[0] == 1, ran[4]


def run(fc: FastCall, arrays: tuple, tag: int, fp, engine):
    """Run the plan in C as far as it goes (``arrays``: ``fc.arrays`` of the call's
    buffers; the call's ``fp`` and ``engine``): None if it did not start, else C's own tuple
    (rounds done, receives done of the next round as a bit mask or -1, seconds waited,
    position in ``fc.peers`` of the peer waited on last or -1, seconds of the wait C gave
    up on, the next round's CMA sends still waiting for their answer as (send, message id)
    pairs); ``FastRun.of`` names it for a caller that keeps it. A plan with CMA messages
    does not start once the rule that chose them has changed or the kernel refused a read
    from a peer it reads. Its sources in rl.empty buffers go by CMA too, as plain ones do
    (the engine would have their receivers read them in place: one copy as well, but
    behind the engine's per-call setup - in-job A/B, 8 MiB, 10 alternating blocks, C by
    CMA / engine in place: all_gather p = 2 0.68, p = 4 0.79; all_to_all p = 2 0.83,
    p = 4 0.85); EMPTY_CMA_IN_C = False keeps them in the engine."""
    if fc.rule is not None:
        if (not CMA_IN_C or fc.rule != _cma_rule(engine)
                or (not EMPTY_CMA_IN_C
                    and any(locate(arrays[i]) is not None for i in fc.cma))
                or not all(r.ok for r in fc.readers)):    # (reads refused: the engine streams)
            return None
        _fastpath.cma_slow(*cma.slow_bits())
    return _fastpath.run(fc.plan, arrays, fc.peers, fc.links,
                         fc.kernel, tag, fp[0], fp[1], engine.fast_budget, engine.crowded,
                         _wake)


def lane(fc: FastCall, names: tuple, nbytes: tuple, writes: tuple, fp=(0, 0), pool=None,
         group=None, tag: int = 0, tag_mod: int = 0, algorithm=None):
    """A ``_fastpath.Lane`` for a blocking call C ran whole: ``fc`` run again on new buffers
    in one C call. ``names``: the call's buffers in the order ``lane.run`` takes them
    (("buf",), ("in", "out"), a barrier's ()), each ``nbytes`` long and written where
    ``writes`` says; one the plan does not use (a gather's output off the root) is
    ignored; "tmp" comes from ``pool``. With ``group``: a collective, numbered by the group
    (wire tag ``tag`` | seq % ``tag_mod``) and counted in the lane; without: a send or
    receive of wire tag ``tag``."""
    plan = fc.names
    return _fastpath.Lane(fc.plan, fc.peers, fc.links, fc.kernel, fp[0], fp[1],
                          tuple(plan.index(n) if n in plan else -1 for n in names),
                          plan.index("tmp") if "tmp" in plan else -1,
                          len(plan), nbytes, writes, pool, group, tag, tag_mod, algorithm, _wake,
                          tuple(p.rank for p in fc.peers))


class FastRun(NamedTuple):
    """How far C ran a plan (``CollectiveWork`` resumes from here)."""
    rounds: int          # rounds done
    recv_mask: int       # receives done of the next round, as a bit mask (-1: not begun)
    waited: float        # seconds waited on peers
    stalled: float       # seconds of the wait C gave up on
    waited_on: int | None   # the world rank waited on last
    pending: tuple = ()  # the next round's CMA sends awaiting their answer: (send, msgid)

    @classmethod
    def of(cls, ran: tuple, fc: FastCall) -> "FastRun":
        """The named form of ``run``'s result."""
        rounds, mask, waited, last, stalled, pending = ran
        return cls(rounds, mask, waited, stalled, fc.peers[last].rank if last >= 0 else None,
                   pending)


def _wake(peer: ShmPeer) -> None:
    """C saw this peer asleep after writing to it, or reading from it."""
    peer.engine.ring_doorbell(peer.doorbell)
