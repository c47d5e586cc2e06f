"""reduce_scatter: rank i's "out" (count elements) becomes op over all ranks' block i of
"in" (p·count elements, blocks in rank order); "in" is left unchanged.

Costs: α per message, β per byte, γ per byte reduced, n = count·itemsize bytes per rank
(N = p·n reduced), lg = ceil(log2 p). Every algorithm sends (p−1)·n bytes per rank.
"""
from __future__ import annotations

import numpy as np

from ._common import Columns, chain_reduce, fold, new, pairs, ring_reduce_scatter

__all__ = ["ring", "recursive_halving", "direct", "hierarchical"]


def _new(algorithm, p, count, itemsize, tmp=0):
    return new("reduce_scatter", algorithm, p, count, itemsize, **{"in": p * count}, out=count,
               tmp=tmp)


def _alone(s, count):
    """p = 1: out = in."""
    s.round().copy(src=0, dst=0, n=count, sbuf="in", soff=0, dbuf="out", doff=0)
    return s


def ring(p, count, *, itemsize=4):
    """Ring: in step k rank i sends its partial of block (i−k−1) mod p to rank i+1, which
    adds its own "in" block; the last step lands block i+1 in rank i+1's out. Partials
    alternate between two tmp slots so no round overwrites what it sends.

    p−1 messages of n per rank:  T = (p−1)(α + nβ + nγ).  tmp = min(p−2, 2)·count.
    """
    s = _new("ring", p, count, itemsize, tmp=min(max(p - 2, 0), 2) * count)
    if p == 1:
        return _alone(s, count)
    r = np.arange(p)
    for k in range(p - 1):
        c = (r - k - 1) % p                      # the block rank r passes on in step k
        sbuf, soff = ("in", c * count) if k == 0 else ("tmp", (k - 1) % 2 * count)
        dbuf, doff = ("out", 0) if k == p - 2 else ("tmp", k % 2 * count)
        s.round().reduce(src=r, dst=(r + 1) % p, n=count, sbuf=sbuf, soff=soff,
                         dbuf=dbuf, doff=doff, abuf="in", aoff=c * count)
    return s


def recursive_halving(p, count, *, itemsize=4):
    """Recursive halving over the p2 core ranks: at distance d = p2/2, …, 1 core rank u
    keeps the half of its current range of blocks that holds its own, and hands the other
    half to u XOR d, which adds it to its partial (in tmp). Non-powers of two: odd ranks
    v < 2·rem first fold their whole "in" into v−1, which then also owns block v and sends
    it back at the end.

    p a power of two: lg p messages per rank:  T = lg·α + (p−1)(nβ + nγ).
    Otherwise the fold adds α + p·n(β + γ) and α + nβ.  tmp = p·count.
    """
    s = _new("recursive_halving", p, count, itemsize, tmp=p * count if p > 1 else 0)
    if p == 1:
        return _alone(s, count)
    p2, core, extra = fold(p)
    rem = len(extra)
    u = np.arange(p2)
    edge = np.append(core, p) * count            # core rank u's blocks: edge[u]:edge[u+1]
    if rem:   # fold in: every core rank's partial goes to tmp
        rnd = s.round()
        rnd.reduce(src=extra, dst=extra - 1, n=p * count, sbuf="in", soff=0, dbuf="tmp", doff=0,
                   abuf="in", aoff=0)
        rnd.copy(src=core[rem:], dst=core[rem:], n=p * count, sbuf="in", soff=0, dbuf="tmp", doff=0)
    part, d = ("tmp" if rem else "in"), p2 // 2
    while d >= 1:
        lo = u & ~(2 * d - 1)
        give = np.where(u & d, lo, lo + d)
        s.round().reduce(src=core, dst=core[u ^ d], n=edge[give + d] - edge[give],
                         sbuf=part, soff=edge[give], dbuf="tmp", doff=edge[give],
                         abuf=part, aoff=edge[give])
        part, d = "tmp", d // 2
    # Each core rank holds its own block (and its extra's) reduced in tmp.
    rnd = s.round()
    rnd.copy(src=core, dst=core, n=count, sbuf="tmp", soff=core * count, dbuf="out", doff=0)
    if rem:
        rnd.copy(src=extra - 1, dst=extra, n=count, sbuf="tmp", soff=extra * count, dbuf="out", doff=0)
    return s


def direct(p, count, *, itemsize=4):
    """Rank i sends block j of "in" to rank j (slot i of its tmp); each rank folds its p
    slots in rank order 0..p−1 into out.

    p−1 messages of n per rank:  T = (p−1)(α + nβ + nγ).  tmp = p·count.
    """
    s = _new("direct", p, count, itemsize, tmp=p * count if p > 1 else 0)
    if p == 1:
        return _alone(s, count)
    r = np.arange(p)
    rnd = s.round()
    rnd.copy(src=r, dst=r, n=count, sbuf="in", soff=r * count, dbuf="tmp", doff=r * count)
    i, j = pairs(p)
    rnd.copy(src=i, dst=j, n=count, sbuf="in", soff=j * count, dbuf="tmp", doff=i * count)
    chain_reduce(s.round(), r, p, count, "out", 0)
    return s


def hierarchical(p, count, *, itemsize=4, hosts=None):
    """Two levels over ``hosts`` (the host id of each rank; None = one host): the mirror of
    the hierarchical all_gather. The blocks of "in" are first copied into tmp column by
    column (``_common.Columns``: column l = the blocks meant for local rank l of every
    host), then

    1. inside each host: ring reduce-scatter of the columns, so the host's local rank l
       holds column l summed over its host;
    2. across hosts: each column ring-reduce-scatters (all columns side by side): a rank
       sends (h−1)·n bytes across hosts, where a flat ring's boundary rank sends (p−1)·n;
    3. a local copy of the rank's own block from tmp to "out".

    Hosts may differ in size (proxies, as in all_gather). With h hosts of m ranks,
    intra/inter links (α₁, β₁), (α₂, β₂), N = p·n reduced, k = m ranks sharing a NIC:
    T = (m−1)α₁ + (m−1)·h·(N/p)(β₁ + γ) + (h−1)α₂ + (h−1)(N/p)(k·β₂ + γ).  tmp = p·count.
    """
    cols = Columns(p, hosts)
    s = _new("hierarchical", p, count, itemsize, tmp=p * count)
    s.hosts = tuple(hosts) if hosts is not None else None
    r = np.arange(p)
    me, q = np.repeat(r, p), np.tile(r, p)
    # a round of its own: a round's messages may not write what its local steps write
    s.round().copy(src=me, dst=me, n=count, sbuf="in", soff=q * count, dbuf="tmp",
                   doff=cols.slot[q] * count)
    for g in cols.groups:                    # phase 1: rings of columns inside each host
        for off, size in cols.within(g, count):
            ring_reduce_scatter(s, 1, g, off, size, buf="tmp")
    start = max(len(g) for g in cols.groups)
    for l in range(cols.M):                  # phase 2: one ring across hosts per column
        ring_reduce_scatter(s, start, *cols.across(l, count), buf="tmp")
    s.round().copy(src=r, dst=r, n=count, sbuf="tmp", soff=cols.slot * count, dbuf="out", doff=0)
    return s
