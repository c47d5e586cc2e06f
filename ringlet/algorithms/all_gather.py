"""all_gather: rank i's "in" (count elements) lands in block i of every rank's "out"
(p·count elements, blocks in rank order).

Costs: α per message, β per byte, n = count·itemsize bytes per rank (N = p·n gathered),
lg = ceil(log2 p). Every algorithm sends (p−1)·n bytes per rank = (p−1)/p·N.
"""
from __future__ import annotations

import numpy as np

from ._common import Columns, fold, new, pairs, ring_all_gather

__all__ = ["ring", "recursive_doubling", "bruck", "direct", "hierarchical"]


def _new(algorithm, p, count, itemsize, tmp=0):
    return new("all_gather", algorithm, p, count, itemsize, **{"in": count}, out=p * count, tmp=tmp)


def ring(p, count, *, itemsize=4):
    """Ring: each rank copies its block into place, then in step k passes block (i−k) mod p
    to rank i+1 (step 0 sends it from "in", so the message need not wait for the copy).

    p−1 messages of n per rank:  T = (p−1)α + (p−1)nβ.
    """
    s = _new("ring", p, count, itemsize)
    r = np.arange(p)
    rnd = s.round()
    rnd.copy(src=r, dst=r, n=count, sbuf="in", soff=0, dbuf="out", doff=r * count)
    for k in range(p - 1):
        if k:
            rnd = s.round()
            c = (r - k) % p
            rnd.copy(src=r, dst=(r + 1) % p, n=count, buf="out", off=c * count)
        else:
            rnd.copy(src=r, dst=(r + 1) % p, n=count, sbuf="in", soff=0, dbuf="out",
                     doff=r * count)
    return s


def recursive_doubling(p, count, *, itemsize=4):
    """Recursive doubling: at distance d = 1, 2, 4, … core rank u swaps everything it has
    (an aligned run of d core ranks' blocks) with u XOR d. Non-powers of two: odd ranks
    v < 2·rem hand their block to v−1 first and receive the whole result at the end.

    p a power of two: lg p messages per rank:  T = lg·α + (p−1)nβ.
    Otherwise + 2 steps (the fold-out message carries p·n).
    """
    s = _new("recursive_doubling", p, count, itemsize)
    p2, core, extra = fold(p)
    rem = len(extra)
    u = np.arange(p2)
    edge = np.append(core, p) * count           # core rank u's blocks: out[edge[u]:edge[u+1]]
    rnd = s.round()
    rnd.copy(src=core, dst=core, n=count, sbuf="in", soff=0, dbuf="out", doff=core * count)
    if rem:                                     # fold in
        rnd.copy(src=extra, dst=extra - 1, n=count, sbuf="in", soff=0, dbuf="out", doff=extra * count)
    d = 1
    while d < p2:
        if d > 1 or rem:                        # without a fold, step 1 shares round 0
            rnd = s.round()
        first = u & ~(d - 1)
        rnd.copy(src=core, dst=core[u ^ d], n=edge[first + d] - edge[first],
                 buf="out", off=edge[first])
        d *= 2
    if rem:                                     # fold out
        s.round().copy(src=extra - 1, dst=extra, n=p * count, buf="out")
    return s


def bruck(p, count, *, itemsize=4):
    """Bruck: rank i keeps blocks in rotated order in tmp (slot j = block of rank i+j). At
    distance d = 1, 2, 4, … it sends its first min(d, p−d) slots to rank i−d, which appends
    them at slot d; a final local rotation puts the blocks in rank order.

    lg messages per rank for any p:  T = lg·α + (p−1)nβ.  tmp = p·count.
    """
    s = _new("bruck", p, count, itemsize, tmp=p * count)
    r = np.arange(p)
    rnd = s.round()
    rnd.copy(src=r, dst=r, n=count, sbuf="in", soff=0, dbuf="tmp", doff=0)
    d = 1
    while d < p:
        if d > 1:
            rnd = s.round()
        rnd.copy(src=r, dst=(r - d) % p, n=min(d, p - d) * count, sbuf="tmp", soff=0,
                 dbuf="tmp", doff=d * count)
        d *= 2
    # Undo the rotation: slots 0..p−i−1 are blocks i..p−1, the rest blocks 0..i−1.
    rnd = s.round()
    rnd.copy(src=r, dst=r, n=(p - r) * count, sbuf="tmp", soff=0, dbuf="out", doff=r * count)
    rnd.copy(src=r, dst=r, n=r * count, sbuf="tmp", soff=(p - r) * count, dbuf="out", doff=0)
    return s


def direct(p, count, *, itemsize=4):
    """Every rank sends its block to every other rank in one round.

    p−1 messages of n per rank:  T = (p−1)(α + nβ).
    """
    s = _new("direct", p, count, itemsize)
    r = np.arange(p)
    rnd = s.round()
    rnd.copy(src=r, dst=r, n=count, sbuf="in", soff=0, dbuf="out", doff=r * count)
    i, j = pairs(p)
    rnd.copy(src=i, dst=j, n=count, sbuf="in", soff=0, dbuf="out", doff=i * count)
    return s


def hierarchical(p, count, *, itemsize=4, hosts=None):
    """Two levels over ``hosts`` (the host id of each rank; None = one host). Local rank l
    of every host forms column l; blocks are staged in tmp column by column
    (``_common.Columns``), so every phase moves contiguous pieces:

    1. across hosts: each column ring-all-gathers its blocks (all columns side by side,
       one message of n per rank per step): a rank sends only its own block across,
       (h−1)·n bytes, where a flat ring's boundary rank sends (p−1)·n;
    2. inside each host: ring all-gather of the columns (h blocks each);
    3. local copies from tmp to the blocks of "out".

    Hosts may differ in size (a host lacking column l lends it a proxy with an empty
    block). With h hosts of m ranks, intra/inter links (α₁, β₁), (α₂, β₂), N = p·n
    gathered, k = m ranks sharing a host's NIC (k = 1 with a NIC per rank):
    T = (h−1)α₂ + (h−1)·k·(N/p)β₂ + (m−1)α₁ + (m−1)·h·(N/p)β₁.  tmp = p·count.
    """
    cols = Columns(p, hosts)
    h = len(cols.groups)
    s = _new("hierarchical", p, count, itemsize, tmp=p * count)
    s.hosts = tuple(hosts) if hosts is not None else None
    r = np.arange(p)
    s.round().copy(src=r, dst=r, n=count, sbuf="in", soff=0, dbuf="tmp", doff=cols.slot * count)
    for l in range(cols.M):                  # phase 1: one ring across hosts per column
        ring_all_gather(s, 0, *cols.across(l, count), buf="tmp")
    for g in cols.groups:                    # phase 2: rings of columns inside each host
        for off, size in cols.within(g, count):
            ring_all_gather(s, h - 1, g, off, size, buf="tmp")
    # phase 3: every rank copies block q from slot[q] of tmp to block q of out
    me, q = np.repeat(r, p), np.tile(r, p)
    s.round().copy(src=me, dst=me, n=count, sbuf="tmp", soff=cols.slot[q] * count, dbuf="out",
                   doff=q * count)
    return s
