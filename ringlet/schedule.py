"""The Schedule: one description of a collective algorithm, used by the runtime (which
executes one rank's part), the cost model (which prices all of it) and the tracer.

A schedule is a list of rounds; a round is a set of transfers. A transfer moves ``n``
elements from a region of rank ``src``'s buffer ``sbuf`` to a region of rank ``dst``'s
buffer ``dbuf``, either copying or reducing:

    copy:    dst.dbuf[doff:doff+n] = src.sbuf[soff:soff+n]
    reduce:  dst.dbuf[doff:doff+n] = op(dst.abuf[aoff:aoff+n], src.sbuf[soff:soff+n])
             (the accumulator region (abuf, aoff) defaults to the destination itself)

A transfer with ``src == dst`` is a local step (no message). Within one round each rank
first runs its local steps in the order they were added, then posts all its sends and
receives of the round at once and waits for them; the round is over for that rank when
they are done. Messages between the same pair in one round are matched in the order
they were added. ``Schedule.validate`` checks that no two transfers of a round write
the same region of a rank and that no message writes a region another message of the
same round reads.

Rounds store their transfers as NumPy columns, and builders add a whole vector of
transfers in one call (``rnd.copy(src=r, dst=(r + 1) % p, ...)`` with ``r = arange(p)``),
so a 4096-rank ring builds and prices in seconds while reading like the textbook.

Buffer names are bound by the runtime per collective (counts in elements):

    broadcast, all_reduce, reduce   "buf" (count)          reduce leaves non-roots' "buf" unchanged
    all_gather                      "in" (count)       -> "out" (p*count)
    reduce_scatter                  "in" (p*count)     -> "out" (count); "in" unchanged
    all_to_all                      "in" (p*count)     -> "out" (p*count); block j of "in" goes to rank j
    all_to_all_single (uneven)      "in" (sum splits[r]) -> "out" (sum of column r); splits[i][j]
                                    elements go from rank i to rank j, blocks in rank order
    gather                          "in" (count)       -> root's "out" (p*count)
    scatter                         root's "in" (p*count) -> "out" (count)
    barrier                         zero-element messages only
    every collective                "tmp": scratch of buffers["tmp"] elements on every rank
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple

import numpy as np

COPY = "copy"
REDUCE = "reduce"
BUFFER_NAMES = ("buf", "in", "out", "tmp")
#: the buffers a collective binds to the caller's arrays (all but the runtime's "tmp")
USER_BUFFERS = {"broadcast": ("buf",), "reduce": ("buf",), "all_reduce": ("buf",),
                "barrier": (), **{c: ("in", "out") for c in (
                    "all_gather", "reduce_scatter", "all_to_all", "all_to_all_single",
                    "gather", "scatter")}}
_BUF_ID = {name: i for i, name in enumerate(BUFFER_NAMES)}
_NO_ACC = -1


class Transfer(NamedTuple):
    """One transfer, as the runtime and the printout see it."""
    src: int
    dst: int
    n: int
    sbuf: str
    soff: int
    dbuf: str
    doff: int
    op: str = COPY
    abuf: str | None = None
    aoff: int = 0

    @property
    def local(self) -> bool:
        return self.src == self.dst

    @property
    def acc(self) -> tuple[str, int]:
        """The accumulator region of a reduce (defaults to the destination)."""
        return (self.abuf, self.aoff) if self.abuf is not None else (self.dbuf, self.doff)

    def __str__(self) -> str:
        arrow = "+=" if self.op == REDUCE else "<-"
        acc = f" {self.abuf}[{self.aoff}:{self.aoff + self.n}] +" if self.abuf is not None else ""
        return (f"r{self.dst}.{self.dbuf}[{self.doff}:{self.doff + self.n}] {arrow}{acc} "
                f"r{self.src}.{self.sbuf}[{self.soff}:{self.soff + self.n}]")


_COLUMNS = ("src", "dst", "n", "sbuf", "soff", "dbuf", "doff", "reduce", "abuf", "aoff")


class Round:
    """The transfers of one round, one row per transfer, stored as NumPy columns."""

    def __init__(self):
        self._parts: list[tuple[np.ndarray, ...]] = []
        self._cols: dict[str, np.ndarray] | None = None

    # -- building ----------------------------------------------------------------------
    def copy(self, src, dst, n, sbuf=None, soff=0, dbuf=None, doff=0, *, buf=None,
             off=0) -> "Round":
        """Add transfers ``dst.dbuf[doff:+n] = src.sbuf[soff:+n]``; every argument may be
        a scalar or an array (broadcast together, one transfer per element). ``buf`` and
        ``off`` instead name a region that is the same on both ranks (a chunk passed on):
        ``copy(src=r, dst=r + 1, n=size, buf="buf", off=o)`` is rank r sending its chunk
        ``buf[o:o+size]`` to rank r + 1's same chunk."""
        sbuf, soff, dbuf, doff = _regions(sbuf, soff, dbuf, doff, buf, off)
        return self._add(src, dst, n, sbuf, soff, dbuf, doff, False, None, 0)

    def reduce(self, src, dst, n, sbuf=None, soff=0, dbuf=None, doff=0, abuf=None, aoff=0,
               *, buf=None, off=0) -> "Round":
        """Add transfers ``dst.dbuf[doff:+n] = op(dst.abuf[aoff:+n], src.sbuf[soff:+n])``
        (accumulator defaults to the destination); ``buf``/``off`` as in :meth:`copy`."""
        sbuf, soff, dbuf, doff = _regions(sbuf, soff, dbuf, doff, buf, off)
        return self._add(src, dst, n, sbuf, soff, dbuf, doff, True, abuf, aoff)

    def _add(self, src, dst, n, sbuf, soff, dbuf, doff, red, abuf, aoff) -> "Round":
        # Broadcast views keep scalar columns at zero bytes: a 4096-rank ring is 33M rows.
        cols = np.broadcast_arrays(
            *(np.atleast_1d(np.asarray(x, dtype=np.int64)) for x in
              (src, dst, n, _BUF_ID[sbuf], soff, _BUF_ID[dbuf], doff, int(red),
               _NO_ACC if abuf is None else _BUF_ID[abuf], aoff)))
        if cols[0].ndim != 1:
            raise ValueError("transfer arguments must be scalars or 1-D arrays")
        self._parts.append(tuple(cols))
        self._cols = None
        return self

    def extend(self, other: "Round", mask=None) -> "Round":
        """Add ``other``'s transfers (those where ``mask`` is true) after this round's."""
        c = other.cols
        self._parts.append(tuple(c[k] if mask is None else c[k][mask] for k in _COLUMNS))
        self._cols = None
        return self

    # -- reading ---------------------------------------------------------------------
    @property
    def cols(self) -> dict[str, np.ndarray]:
        if self._cols is None:
            if len(self._parts) == 1:
                stacked = list(self._parts[0])
            elif self._parts:
                stacked = [np.concatenate([p[i] for p in self._parts]) for i in range(len(_COLUMNS))]
            else:
                stacked = [np.zeros(0, np.int64) for _ in _COLUMNS]
            self._cols = dict(zip(_COLUMNS, stacked))
            self._parts = [tuple(stacked)]
        return self._cols

    def __len__(self) -> int:
        return len(self.cols["src"])

    def rows(self, mask=None) -> list[Transfer]:
        c = self.cols
        idx = np.arange(len(self)) if mask is None else np.flatnonzero(mask)
        out = []
        for i in idx:
            a = int(c["abuf"][i])
            out.append(Transfer(int(c["src"][i]), int(c["dst"][i]), int(c["n"][i]),
                                BUFFER_NAMES[c["sbuf"][i]], int(c["soff"][i]),
                                BUFFER_NAMES[c["dbuf"][i]], int(c["doff"][i]),
                                REDUCE if c["reduce"][i] else COPY,
                                None if a == _NO_ACC else BUFFER_NAMES[a], int(c["aoff"][i])))
        return out

    def __iter__(self):
        return iter(self.rows())


def _regions(sbuf, soff, dbuf, doff, buf, off) -> tuple:
    """(sbuf, soff, dbuf, doff) of a transfer given either both sides or ``buf``/``off``."""
    if buf is None:
        if sbuf is None or dbuf is None:
            raise TypeError("a transfer needs sbuf= and dbuf=, or buf= for the same region "
                            "on both ranks")
        return sbuf, soff, dbuf, doff
    if sbuf is not None or dbuf is not None:
        raise TypeError("buf= names the same region on both ranks: pass it or sbuf=/dbuf=, "
                        "not both")
    return buf, off, buf, off


def one_way(nbytes, src, dst) -> np.ndarray:
    """Which of a round's messages (``src`` -> ``dst``, ``nbytes`` or elements) come from a
    rank that receives no bytes in the round: an empty receive (an agreement's signal beside
    a "dissemination" algorithm's data) copies nothing (work._receives)."""
    return ~np.isin(src, dst[nbytes > 0])


class RankRound(NamedTuple):
    """One rank's part of one round: local steps, then messages out and in; ``early``: the
    round is posted with the rank's first (``Schedule.early``)."""
    local: tuple[Transfer, ...]
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    early: bool = False


# -- the executor's form of a rank's plan (``ringlet.work.compile_plan``): the same
# transfers with group ranks turned into world ranks and offsets into slice bounds, read
# by the Python executor and encoded for the C fast path. Rounds keep RankRound's order.
# Slotted classes rather than NamedTuples: the executor reads their fields on every small
# call, and a slot is the quickest field CPython reads (a NamedTuple's field, or unpacking
# one, goes through the generic path).
@dataclass(frozen=True, slots=True)
class LocalStep:
    """``dbuf[d0:d1] = sbuf[s0:s1]``, or ``= ufunc(abuf[a0:a1], sbuf[s0:s1])`` when
    ``reduce`` (``abuf`` None: the accumulator is the destination)."""
    reduce: bool
    sbuf: str
    s0: int
    s1: int
    dbuf: str
    d0: int
    d1: int
    abuf: str | None
    a0: int
    a1: int


@dataclass(frozen=True, slots=True)
class SendStep:
    """Send ``sbuf[s0:s1]`` to world rank ``dst``; ``reduce``: its receive reduces it
    (then no offer to read it by CMA, which that receive declines: transport/cma.py)."""
    dst: int
    sbuf: str
    s0: int
    s1: int
    reduce: bool = False


@dataclass(frozen=True, slots=True)
class RecvStep:
    """Receive from world rank ``src`` into ``dbuf[d0:d1]``, reducing with the
    accumulator ``abuf[a0:a1]`` when ``reduce`` (``abuf`` None: the destination)."""
    src: int
    reduce: bool
    dbuf: str
    d0: int
    d1: int
    abuf: str | None
    a0: int
    a1: int


@dataclass(frozen=True, slots=True)
class PlanRound:
    """One round of a compiled plan: local steps, then messages out and in. ``then``: the
    index of a later round posted right after this one (-1: none); ``early``: this round
    was posted so, and is only waited for in its turn (``Schedule.early``)."""
    local: tuple[LocalStep, ...]
    sends: tuple[SendStep, ...]
    recvs: tuple[RecvStep, ...]
    then: int = -1
    early: bool = False
    #: receives that bring bytes (an agreement's empty signal brings none), counted once
    copies_in: int = field(init=False)
    #: sends that carry bytes (what the sender's copies are shared by: cma.py)
    copies_out: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "copies_in", sum(t.d1 > t.d0 for t in self.recvs))
        object.__setattr__(self, "copies_out", sum(t.s1 > t.s0 for t in self.sends))


@dataclass(eq=False)
class Schedule:
    collective: str
    algorithm: str
    p: int
    count: int
    rounds: list[Round] = field(default_factory=list)
    buffers: dict[str, int] = field(default_factory=dict)
    itemsize: int = 4
    root: int | None = None
    splits: tuple[tuple[int, ...], ...] | None = None
    hosts: tuple[int, ...] | None = None
    notes: dict = field(default_factory=dict)
    #: leading rounds that carry the messages in which the ranks agree on the call, beside
    #: the algorithm's own (rooted collectives: ``ringlet.algorithms.agree_alongside``)
    agreement: int = 0
    #: the algorithm's own rounds, before the agreement's messages joined them
    alone: list[Round] | None = None
    #: its data rides the dissemination barrier's messages (the "dissemination" rooted
    #: algorithms), so the ranks agree on the call as they move it: no agreement rounds
    agrees: bool = False
    #: the index of a round whose messages every rank posts right after its first round's
    #: and waits for in its turn (-1: none): a rooted algorithm's first round, moving while
    #: the agreement's rounds go on (``ringlet.algorithms.agree_alongside``)
    early: int = -1

    def round(self) -> Round:
        """Append a new, empty round and return it for the builder to fill."""
        rnd = Round()
        self.rounds.append(rnd)
        return rnd

    def without_agreement(self) -> "Schedule":
        """The algorithm alone, without its agreement's messages: what the textbook counts."""
        if self.alone is None:
            return self
        return replace(self, rounds=list(self.alone), agreement=0, alone=None, early=-1)

    # -- per-rank views, computed once (schedules are cached, so are these) -------------
    def rank_plan(self, rank: int) -> tuple[RankRound, ...]:
        plan = self._plans.get(rank)
        if plan is None:
            plan = self._plans[rank] = self._make_plan(rank)
        return plan

    @cached_property
    def _plans(self) -> dict:
        return {}

    def _make_plan(self, rank: int) -> tuple[RankRound, ...]:
        plan = []
        for i, rnd in enumerate(self.rounds):
            c = rnd.cols
            mine_src, mine_dst = c["src"] == rank, c["dst"] == rank
            local = mine_src & mine_dst
            sends = rnd.rows(mine_src & ~local)
            recvs = rnd.rows(mine_dst & ~local)
            loc = rnd.rows(local)
            if loc or sends or recvs:
                plan.append(RankRound(tuple(loc), tuple(sends), tuple(recvs), i == self.early))
        return tuple(plan)

    # -- counting: what the tracer and the textbook formulas compare ---------------------
    def traffic(self) -> dict[str, np.ndarray]:
        """Per-rank arrays: messages and bytes sent and received (local steps excluded)."""
        out = {k: np.zeros(self.p, np.int64)
               for k in ("sent_messages", "sent_bytes", "recv_messages", "recv_bytes")}
        for rnd in self.rounds:
            c = rnd.cols
            msg = c["src"] != c["dst"]
            s, d, n = c["src"][msg], c["dst"][msg], c["n"][msg] * self.itemsize
            np.add.at(out["sent_messages"], s, 1)
            np.add.at(out["sent_bytes"], s, n)
            np.add.at(out["recv_messages"], d, 1)
            np.add.at(out["recv_bytes"], d, n)
        return out

    @property
    def messages(self) -> int:
        return int(sum(np.count_nonzero(r.cols["src"] != r.cols["dst"]) for r in self.rounds))

    def sent_alone(self) -> frozenset:
        """(src, dst, soff, doff, n) of every message whose sender receives no bytes in its
        round (:func:`one_way`): what every rank can tell of any message from the schedule,
        though its own plan holds only its own rounds."""
        out = set()
        for rnd in self.rounds:
            c = rnd.cols
            msg = c["src"] != c["dst"]
            src, dst, n = c["src"][msg], c["dst"][msg], c["n"][msg]
            alone = one_way(n, src, dst)
            out.update(zip(src[alone].tolist(), dst[alone].tolist(), c["soff"][msg][alone].tolist(),
                           c["doff"][msg][alone].tolist(), n[alone].tolist()))
        return frozenset(out)

    def validate(self) -> None:
        """Raise ValueError if a transfer names a rank or region outside the schedule, or a
        round breaks the write rules in the module docstring."""
        for i, rnd in enumerate(self.rounds):
            c = rnd.cols
            for who in ("src", "dst"):
                if len(c[who]) and (c[who].min() < 0 or c[who].max() >= self.p):
                    raise ValueError(f"round {i}: a transfer names a rank outside 0..{self.p - 1}")
            if len(c["n"]) and c["n"].min() < 0:
                raise ValueError(f"round {i}: a transfer has a negative size")
            for t in rnd:
                regions = [(t.sbuf, t.soff), (t.dbuf, t.doff)]
                if t.op == REDUCE:
                    regions.append(t.acc)
                for buf, off in regions:
                    size = self.buffers.get(buf)
                    if size is None:
                        raise ValueError(f"round {i}: {t} uses undeclared buffer {buf!r}")
                    if t.n and (off < 0 or off + t.n > size):
                        raise ValueError(f"round {i}: {t} overruns {buf!r} of {size} elements")
            rows = [t for t in rnd if t.n]
            for a_i, a in enumerate(rows):
                wa = (a.dst, a.dbuf, a.doff, a.doff + a.n)
                for b in rows[a_i + 1:]:
                    if _overlap(wa, (b.dst, b.dbuf, b.doff, b.doff + b.n)):
                        raise ValueError(f"round {i}: {a} and {b} write the same region")
                    if not a.local and not b.local:
                        if _overlap(wa, (b.src, b.sbuf, b.soff, b.soff + b.n)) or _overlap(
                                (b.dst, b.dbuf, b.doff, b.doff + b.n),
                                (a.src, a.sbuf, a.soff, a.soff + a.n)):
                            raise ValueError(f"round {i}: {a} and {b}: a message writes what "
                                             f"another message of the round reads")

    def __str__(self) -> str:
        head = (f"Schedule {self.collective}/{self.algorithm}: p={self.p}, count={self.count}, "
                f"{len(self.rounds)} rounds, {self.messages} messages, buffers {self.buffers}"
                + (f", root {self.root}" if self.root is not None else ""))
        lines = [head]
        for i, rnd in enumerate(self.rounds):
            lines.append(f"  round {i}:" + (" (agreeing on the call)" if i < self.agreement else "")
                         + (" (posted with round 0)" if i == self.early else ""))
            lines.extend(f"    {t}" for t in rnd)
        return "\n".join(lines)

    __repr__ = __str__


def _overlap(a, b) -> bool:
    """Do regions (rank, buf, start, stop) a and b share an element?"""
    return a[0] == b[0] and a[1] == b[1] and a[2] < b[3] and b[2] < a[3]


def chunks(count: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``count`` elements into ``parts`` contiguous pieces whose sizes differ by at
    most one (the first ``count % parts`` get the extra element): (offsets, sizes)."""
    base, extra = divmod(count, parts)
    sizes = np.full(parts, base, np.int64)
    sizes[:extra] += 1
    offsets = np.zeros(parts, np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    return offsets, sizes
