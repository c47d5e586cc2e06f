"""reduce: the root's "buf" becomes op over all ranks' "buf" (count elements); every other
rank's "buf" is left unchanged (partial results live in "tmp").

Ranks are handled as virtual ranks v = (r − root) mod p, so the root is v = 0.
Costs: α per message, β per byte, γ per byte reduced, n = count·itemsize, lg = ceil(log2 p).
"""
from __future__ import annotations

import numpy as np

from ._common import binomial_rounds, chunks, fold, new, signal_others
from .all_reduce import GLOO_SEGMENT

__all__ = ["direct", "binomial", "dissemination", "rabenseifner", "gloo_ring",
           "gloo_reduce_blocks"]


def _new(algorithm, p, count, itemsize, root, tmp):
    s = new("reduce", algorithm, p, count, itemsize, root=root, buf=count, tmp=tmp)
    return s, (lambda v: (np.asarray(v) + root) % p)


def direct(p, count, *, itemsize=4, root=0):
    """Every rank sends its buffer to the root, which folds each into its partial as it
    reads it, in rank order: op(...op(op(x0, x1), x2)..., x_{p-1}), one message a round.

    Folding on arrival reads each message once, into the partial (a receive that reduces
    streams, its sender's copy overlapping the root's reduce; from rl.empty the sender
    reduces half). Copying all of them into p·count of tmp first and folding after went
    through memory twice: in one job against it (bench/algorithms_vs_mpi.py, 10
    alternating blocks, 8 MiB, plain / rl.empty, us) p = 2 845 / 384 against 2939 / 2237,
    p = 4 5221 / 3078 against 7453 / 6687 (Open MPI 5737 / 5969).
    The root receives p−1 messages of n:  T = (p−1)(α + nβ + nγ).  Root's tmp = count
    (none when the root is rank 0, whose buf holds the partial from the start, or p = 2).
    """
    s, _ = _new("direct", p, count, itemsize, root, count if root and p > 2 else 0)
    if p == 1:
        return s
    acc = "buf" if root == 0 else "tmp"       # where the root's partial lives
    if root > 1:                              # x0 comes first: it starts the partial
        s.round().copy(src=0, dst=root, n=count, sbuf="buf", soff=0, dbuf="tmp", doff=0)
    for j in range(1, p):
        into = "buf" if j == p - 1 else acc
        if root == 1 and j == 1:              # op(x0, x1) with x1 the root's own buf
            s.round().reduce(src=0, dst=root, n=count, sbuf="buf", soff=0, dbuf=into,
                             doff=0, abuf="buf", aoff=0)
        elif j == root:                       # its own buf joins the partial, no message
            s.round().reduce(src=root, dst=root, n=count, sbuf="buf", soff=0, dbuf=into,
                             doff=0, abuf=acc, aoff=0)
        else:
            s.round().reduce(src=j, dst=root, n=count, sbuf="buf", soff=0, dbuf=into,
                             doff=0, abuf=None if into == acc else acc, aoff=0)
    return s


def binomial(p, count, *, itemsize=4, root=0):
    """Binomial tree, leaves first: in the round for mask = 2^k, virtual rank v with
    v mod 2^(k+1) = 2^k sends its partial to v − mask. The root accumulates in buf; other
    ranks with children accumulate in tmp, starting from their own buf.

    p−1 messages of n, lg at the root:  T = lg(α + nβ + nγ).
    """
    return _tree("binomial", p, count, itemsize, root, lambda v: (np.asarray(v) + root) % p)


def dissemination(p, count, *, itemsize=4, root=0):
    """The binomial tree, leaves first, laid on the dissemination barrier's messages: on
    mirrored virtual ranks w = (root − r) mod p a child w sends to w − 2^k, which is rank
    r + 2^k, the rank r signals in barrier round k; the other signals stay empty. The
    root accumulates in buf, the other parents in tmp (as ``binomial``). The barrier is
    the algorithm rather than a prefix to it (``Schedule.agrees``).

    p−1 messages of n among p·lg:  T = lg(α + nβ + nγ): binomial's, less a barrier.
    """
    s = _tree("dissemination", p, count, itemsize, root, lambda w: (root - np.asarray(w)) % p,
              signal=True)
    s.agrees = True
    return s


def _tree(algorithm, p, count, itemsize, root, real, signal=False):
    """The binomial reduce, leaves first, on virtual ranks mapped to ranks by ``real``;
    with ``signal``, every other message of each round's dissemination barrier beside it."""
    v = np.arange(p)
    has_children = (v % 2 == 0) & (v + 1 < p)     # they receive in the first round
    s, _ = _new(algorithm, p, count, itemsize, root, count if has_children[1:].any() else 0)
    for k, (_, child, parent) in enumerate(binomial_rounds(p)):
        rnd = s.round()
        for part in ("buf", "tmp"):               # where each child's partial is
            sel = has_children[child] == (part == "tmp")
            c, q = child[sel], parent[sel]
            to_root = q == 0
            rnd.reduce(src=real(c[to_root]), dst=root, n=count, sbuf=part, soff=0,
                       dbuf="buf", doff=0)
            rnd.reduce(src=real(c[~to_root]), dst=real(q[~to_root]), n=count, sbuf=part,
                       soff=0, dbuf="tmp", doff=0, abuf="buf" if k == 0 else "tmp", aoff=0)
        if signal:
            signal_others(rnd, p, k, real(child))
    return s


def rabenseifner(p, count, *, itemsize=4, root=0):
    """Rabenseifner: recursive-halving reduce-scatter over the p2 core ranks (odd virtual
    ranks v < 2·rem first fold into v−1), then a binomial gather of the p2 reduced chunks
    to the root (core rank 0). Partials live in tmp; the root's chunks land in its buf.

    p a power of two: T = 2·lg·α + 2(p−1)/p·nβ + (p−1)/p·nγ; the fold adds α + nβ + nγ.
    """
    s, real = _new("rabenseifner", p, count, itemsize, root, count if p > 1 else 0)
    if p == 1:
        return s
    p2, core, extra = fold(p)
    rem = len(extra)
    off, _ = chunks(count, p2)
    edge = np.append(off, count)                  # chunk c is edge[c]:edge[c+1]
    u = np.arange(p2)
    if rem:   # fold in: every core rank's partial goes to tmp
        rnd = s.round()
        rnd.reduce(src=real(extra), dst=real(extra - 1), n=count, sbuf="buf", soff=0,
                   dbuf="tmp", doff=0, abuf="buf", aoff=0)
        rnd.copy(src=real(core[rem:]), dst=real(core[rem:]), n=count, sbuf="buf", soff=0,
                 dbuf="tmp", doff=0)
    # Phase 1: recursive halving (see all_reduce.rabenseifner); the first step reads buf
    # when there was no fold.
    part, d = ("tmp" if rem else "buf"), p2 // 2
    while d >= 1:
        lo = u & ~(2 * d - 1)
        give = np.where(u & d, lo, lo + d)
        s.round().reduce(src=real(core), dst=real(core[u ^ d]), n=edge[give + d] - edge[give],
                         sbuf=part, soff=edge[give], dbuf="tmp", doff=edge[give],
                         abuf=part, aoff=edge[give])
        part, d = "tmp", d // 2
    # Phase 2: binomial gather of chunk ranges to core rank 0, the root (into its buf).
    rnd = s.round()
    rnd.copy(src=root, dst=root, n=edge[1], sbuf="tmp", soff=0, dbuf="buf", doff=0)
    for i, (mask, child, parent) in enumerate(binomial_rounds(p2)):
        if i:
            rnd = s.round()
        end = np.minimum(child + mask, p2)
        dbuf = np.where(parent == 0, "buf", "tmp")
        for name in ("buf", "tmp"):
            m = dbuf == name
            rnd.copy(src=real(core[child[m]]), dst=real(core[parent[m]]),
                     n=edge[end[m]] - edge[child[m]], sbuf="tmp", soff=edge[child[m]],
                     dbuf=name, doff=edge[child[m]])
    return s


def gloo_reduce_blocks(p: int, count: int, itemsize: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, sizes) of the p blocks Gloo's reduce gives ranks 0..p−1. Its segments are
    cut before their number, unlike its all-reduce's (``all_reduce.gloo_blocks``):
    ceil(count / 2p) elements, at most 1 MiB; S segments, the least multiple of p that is
    at least 2p and covers count; rank b gets segments b·S/p … (b+1)·S/p − 1."""
    seg = max(1, min(-(-count // (2 * p)), GLOO_SEGMENT // itemsize))
    segments = -(-max(-(-count // seg), 2 * p) // p) * p
    edge = np.minimum(np.arange(p + 1, dtype=np.int64) * (segments // p * seg), count)
    return edge[:-1], np.diff(edge)


def gloo_ring(p, count, *, itemsize=4, root=0):
    """Gloo's reduce, so a float sum has the bits torch's Gloo backend gives it: a ring
    reduce-scatter toward lower ranks, in tmp, on ``gloo_reduce_blocks`` (block b's partial
    starts at rank b−1 and ends at b: x_b + (x_{b+1} + (… + (x_{b−2} + x_{b−1})))), then
    every rank sends its block to the root; the root's own block ends in its buf.

    p−1 ring steps of n/p, then p−1 blocks into the root:
    T = 2(p−1)α + 2(p−1)/p·nβ + (p−1)/p·nγ.  tmp = count.
    """
    s, _ = _new("gloo_ring", p, count, itemsize, root, count if p > 1 else 0)
    if p == 1:
        return s
    off, size = gloo_reduce_blocks(p, count, itemsize)
    down = np.arange(p - 1, -1, -1)          # position l of the ring is rank p−1−l
    l = np.arange(p)
    for k in range(p - 1):                   # as _common.ring_reduce_scatter, buf kept
        c = down[(l - k - 1) % p]            # the block position l passes on
        dst = down[(l + 1) % p]
        last = k == p - 2                    # each receiver ends its own block
        into = np.where(last & (dst == root), "buf", "tmp")
        rnd = s.round()
        for name in ("buf", "tmp"):
            m = into == name
            rnd.reduce(src=down[m], dst=dst[m], n=size[c[m]], sbuf="buf" if k == 0 else "tmp",
                       soff=off[c[m]], dbuf=name, doff=off[c[m]], abuf="buf", aoff=off[c[m]])
    others = np.delete(l, root)
    s.round().copy(src=others, dst=root, n=size[others], sbuf="tmp", soff=off[others],
                   dbuf="buf", doff=off[others])
    return s
