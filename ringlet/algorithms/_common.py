"""Pieces the algorithm modules share: a new schedule, trees, the non-power-of-two fold,
ring phases over any group of ranks, and the pipeline segment rule.

Conventions used by every builder (see ``ringlet.schedule`` for the round semantics):

* ranks are vectorised: ``r = np.arange(p)``; rooted collectives work on *virtual*
  ranks ``v = (r - root) % p`` and map back with ``real(v) = (v + root) % p``;
* a message's size may be zero (count 0, count < p, empty all-to-all blocks): such
  messages are KEPT, so which messages an algorithm sends depends only on
  (p, root, hosts, segments), never on the data size, and message counts always equal
  the textbook formulas;
* within one round no two transfers write the same region, so a rank folding several
  contributions into one place uses several rounds or partial results in "tmp".
"""
from __future__ import annotations

from math import sqrt

import numpy as np

from ..schedule import Round, Schedule, chunks

__all__ = ["Schedule", "chunks", "new", "at", "lg", "fold", "binomial_rounds", "subtree",
           "ring_reduce_scatter", "ring_all_gather", "chain_reduce", "pairs",
           "optimal_segments", "SEGMENT_ALPHA", "SEGMENT_BANDWIDTH", "MAX_SEGMENTS",
           "host_groups", "Columns", "signal_others"]


def new(collective: str, algorithm: str, p: int, count: int, itemsize: int, *, root=None,
        **buffers) -> Schedule:
    """An empty schedule declaring ``buffers`` (element counts); "tmp" defaults to 0."""
    buffers.setdefault("tmp", 0)
    return Schedule(collective, algorithm, p, count, buffers={k: int(v) for k, v in buffers.items()},
                    itemsize=itemsize, root=root)


def at(s: Schedule, i: int) -> Round:
    """Round ``i`` of ``s``, appending empty rounds as needed (for phases that run side by
    side, e.g. one ring per host)."""
    while len(s.rounds) <= i:
        s.round()
    return s.rounds[i]


def lg(p: int) -> int:
    """ceil(log2 p): rounds of a binomial tree, recursive doubling or dissemination."""
    return (p - 1).bit_length()


def fold(p: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The standard non-power-of-two fix-up (MPICH): with p2 the largest power of two <= p
    and rem = p - p2, each odd (virtual) rank v < 2*rem folds into v - 1 and sits out.
    Returns (p2, core, extra): ``core[u]`` is the rank playing "new rank" u = 0..p2-1
    (core[0] == 0, so a root stays in) and ``extra`` the odd ranks that fold into extra - 1."""
    p2 = 1 << (p.bit_length() - 1)
    rem = p - p2
    u = np.arange(p2)
    core = np.where(u < rem, 2 * u, u + rem)
    return p2, core, 2 * np.arange(rem) + 1


def binomial_rounds(p: int):
    """The binomial tree on virtual ranks 0..p-1 rooted at 0, one level per round, leaves
    first: yields (mask, child, parent) with child = {v : v mod 2·mask == mask}, parent =
    child - mask, for mask = 1, 2, 4, ... Reduce/gather walk it as is; broadcast/scatter
    walk it reversed. Child v's subtree is v .. v + subtree(p, v) - 1."""
    mask = 1
    while mask < p:
        child = np.arange(mask, p, 2 * mask)
        yield mask, child, child - mask
        mask *= 2


def subtree(p: int, v) -> np.ndarray:
    """Size of virtual rank v's binomial subtree (v itself included); p for the root."""
    v = np.asarray(v, np.int64)
    return np.where(v == 0, p, np.minimum(v & -v, p - v))


def ring_reduce_scatter(s: Schedule, start: int, ranks, off, size, buf: str = "buf") -> int:
    """Ring reduce-scatter of ``buf`` among ``ranks`` (any order, any subset of the group),
    in place, starting at round ``start``: chunk c is ``buf[off[c]:off[c] + size[c]]``.
    In step k ranks[l] sends chunk (l - k - 1) mod m to ranks[l + 1], which adds its own;
    afterwards ranks[l] holds chunk l reduced over the group. Returns the next round."""
    ranks, off, size = (np.asarray(x, np.int64) for x in (ranks, off, size))
    m = len(ranks)
    l = np.arange(m)
    for k in range(m - 1):
        c = (l - k - 1) % m
        at(s, start + k).reduce(src=ranks, dst=ranks[(l + 1) % m], n=size[c],
                                buf=buf, off=off[c])
    return start + max(m - 1, 0)


def ring_all_gather(s: Schedule, start: int, ranks, off, size, buf: str = "buf",
                    held=None) -> int:
    """Ring all-gather: ranks[l] starts holding chunk l and, after m - 1 steps in which
    ranks[l] passes chunk (l - k) mod m to ranks[l + 1], every rank holds all of them.
    ``held[l, c]``: ranks[l] holds chunk c already (from a scatter before the ring), so
    nothing carries c to it; it still passes c on, from its own buffer."""
    ranks, off, size = (np.asarray(x, np.int64) for x in (ranks, off, size))
    m = len(ranks)
    l = np.arange(m)
    for k in range(m - 1):
        c = (l - k) % m
        go = slice(None) if held is None else ~held[(l + 1) % m, c]
        at(s, start + k).copy(src=ranks[go], dst=ranks[(l[go] + 1) % m], n=size[c[go]],
                              buf=buf, off=off[c[go]])
    return start + max(m - 1, 0)


def chain_reduce(rnd: Round, ranks, p: int, count: int, dbuf: str, doff) -> None:
    """Local steps on ``ranks``: fold "tmp" slots 0..p-1 (slot j holds rank j's data) in
    rank order, op(...op(op(x0, x1), x2)..., x_{p-1}), into ``dbuf[doff:]``; the partial
    results overwrite slots 1..p-2. Every rank that runs it gets the same bits. p >= 2."""
    for j in range(1, p):
        last = j == p - 1
        rnd.reduce(src=ranks, dst=ranks, n=count, sbuf="tmp", soff=j * count,
                   dbuf=dbuf if last else "tmp", doff=doff if last else j * count,
                   abuf="tmp", aoff=(j - 1) * count)


def signal_others(rnd: Round, p: int, k: int, carriers) -> None:
    """The rest of dissemination round ``k`` (rank r signals r + 2^k: ``barrier``) beside
    the messages an algorithm laid on it: a zero-element message from every rank not in
    ``carriers``, the ranks whose message of this round already carries data. An
    algorithm whose data rides the barrier's own messages agrees on the call as it moves
    it, so it needs no barrier rounds of its own (``algorithms.agree_alongside``)."""
    r = np.arange(p)
    rest = r[~np.isin(r, np.asarray(carriers, np.int64))]
    rnd.copy(src=rest, dst=(rest + (1 << k)) % p, n=0, buf="tmp")


def pairs(p: int) -> tuple[np.ndarray, np.ndarray]:
    """All ordered pairs (i, j), i != j: the messages of a "direct" algorithm."""
    i, j = np.nonzero(~np.eye(p, dtype=bool))
    return i, j


# -- hosts ---------------------------------------------------------------------------------
def host_groups(p, hosts) -> list[np.ndarray]:
    """Group ranks by host id (None = one host), hosts in order of their first rank, ranks
    ascending within a host: ``groups[j][l]`` is local rank l of host j."""
    if hosts is None:
        return [np.arange(p)]
    groups: dict = {}
    for r, h in enumerate(hosts):
        groups.setdefault(h, []).append(r)
    return [np.array(g, np.int64) for g in groups.values()]


class Columns:
    """The layout the two-level all-gather and reduce-scatter stage blocks in: local rank l
    of every host forms column l, and tmp holds the p blocks column by column (slot
    ``slot[r]`` is rank r's block), so a column — and a run of columns — is contiguous.

    A host with fewer ranks than the largest (m_j < M) has a *proxy* in each column it
    lacks, its local rank l mod m_j, whose own piece of that column is empty."""

    def __init__(self, p, hosts):
        self.groups = host_groups(p, hosts)
        self.M = max(len(g) for g in self.groups)
        self.slot = np.empty(p, np.int64)
        self.start = np.zeros(self.M + 1, np.int64)   # column l is slots start[l]:start[l+1]
        i = 0
        for l in range(self.M):
            self.start[l] = i
            for g in self.groups:
                if len(g) > l:
                    self.slot[g[l]], i = i, i + 1
        self.start[self.M] = i

    def across(self, l, count):
        """Column l's ring across hosts: (ranks, offsets, sizes) in elements, one per host."""
        ranks = np.array([g[l % len(g)] for g in self.groups], np.int64)
        mine = np.array([len(g) > l for g in self.groups])
        off = np.where(mine, self.slot[np.where(mine, ranks, 0)], self.start[l])
        return ranks, off * count, mine * count

    def within(self, g, count):
        """Host ``g``'s rings of columns: local rank i holds columns i, i + m, i + 2m, …; one
        ring per such layer, all in the same rounds. Yields (offsets, sizes) in elements."""
        m = len(g)
        for first in range(0, self.M, m):
            cols = np.minimum(first + np.arange(m), self.M)
            yield self.start[cols] * count, (self.start[np.minimum(cols + 1, self.M)]
                                             - self.start[cols]) * count


# -- pipelining ---------------------------------------------------------------------------
#: The reference link used to size pipeline segments (a later cost model may pick per link).
SEGMENT_ALPHA = 5e-6        # seconds per message
SEGMENT_BANDWIDTH = 10e9    # bytes per second
MAX_SEGMENTS = 64


def optimal_segments(fill: int, count: int, itemsize: int) -> int:
    """Segments S minimising a pipeline's (fill + S)(α + nβ/S), n = count·itemsize bytes:
    S* = sqrt(fill·nβ/α) on the reference link, rounded and clamped to 1..min(count, 64)
    (so no segment is empty unless count is 0). ``fill`` is the number of rounds before
    the first segment reaches the last rank, minus one (p - 2 for a chain of p ranks)."""
    if fill <= 0 or count <= 1:
        return 1
    s = round(sqrt(fill * count * itemsize / (SEGMENT_ALPHA * SEGMENT_BANDWIDTH)))
    return int(max(1, min(s, count, MAX_SEGMENTS)))
