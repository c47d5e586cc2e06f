"""all_to_all (and all_to_all_single): block j of rank i's "in" lands in block i of rank j's
"out", blocks in rank order on both sides.

Even exchange (``splits=None``): every block has ``count`` elements; "in" and "out" hold
p·count. Uneven exchange (``splits``, p×p, splits[i][j] elements from rank i to rank j):
rank i's "in" holds sum(splits[i]) elements and rank j's "out" sum of column j; the
schedule declares the largest of each, and ``count`` is ignored. All three algorithms take
either form, under the collective name "all_to_all" or "all_to_all_single".

Costs: α per message, β per byte, n = count·itemsize bytes per block, lg = ceil(log2 p).
"""
from __future__ import annotations

import numpy as np

from ._common import lg, new, pairs

__all__ = ["pairwise", "bruck", "direct", "layout"]


def layout(p, count, splits=None):
    """(sizes, in_off, out_off), p×p each: block i→j has sizes[i, j] elements, at in_off[i, j]
    in rank i's "in" and at out_off[i, j] in rank j's "out"."""
    sizes = np.full((p, p), count, np.int64) if splits is None else np.array(splits, np.int64).reshape(p, p)
    in_off = np.cumsum(sizes, axis=1) - sizes
    out_off = np.cumsum(sizes, axis=0) - sizes
    return sizes, in_off, out_off


def _new(algorithm, p, count, itemsize, splits, sizes):
    s = new("all_to_all", algorithm, p, count, itemsize,
            **{"in": sizes.sum(axis=1).max(initial=0)}, out=sizes.sum(axis=0).max(initial=0))
    s.splits = None if splits is None else tuple(tuple(int(x) for x in row) for row in sizes)
    return s


def direct(p, count, *, itemsize=4, splits=None):
    """Every rank sends every block straight to its destination in one round.

    p−1 messages of n per rank:  T = (p−1)(α + nβ).
    """
    sizes, in_off, out_off = layout(p, count, splits)
    s = _new("direct", p, count, itemsize, splits, sizes)
    r = np.arange(p)
    rnd = s.round()
    rnd.copy(src=r, dst=r, n=sizes[r, r], sbuf="in", soff=in_off[r, r], dbuf="out", doff=out_off[r, r])
    i, j = pairs(p)
    rnd.copy(src=i, dst=j, n=sizes[i, j], sbuf="in", soff=in_off[i, j], dbuf="out", doff=out_off[i, j])
    return s


def pairwise(p, count, *, itemsize=4, splits=None):
    """Pairwise exchange: in step k = 1..p−1 rank i sends its block for rank i+k and
    receives the block of rank i−k (its own block is a local copy in step 1).

    p−1 messages of n per rank in p−1 rounds:  T = (p−1)(α + nβ).
    """
    sizes, in_off, out_off = layout(p, count, splits)
    s = _new("pairwise", p, count, itemsize, splits, sizes)
    r = np.arange(p)
    rnd = s.round()
    rnd.copy(src=r, dst=r, n=sizes[r, r], sbuf="in", soff=in_off[r, r], dbuf="out", doff=out_off[r, r])
    for k in range(1, p):
        if k > 1:
            rnd = s.round()
        t = (r + k) % p
        rnd.copy(src=r, dst=t, n=sizes[r, t], sbuf="in", soff=in_off[r, t], dbuf="out", doff=out_off[r, t])
    return s


def bruck(p, count, *, itemsize=4, splits=None):
    """Bruck: rank i first rotates its blocks into tmp slots (slot j = its block for rank
    i+j). At distance d = 1, 2, 4, … it packs the slots j with bit d set into one message
    to rank i+d, which unpacks them into the same slots. After lg steps slot j of rank t
    holds the block from rank t−j, and a local copy puts the blocks in rank order.

    Slots have room for the largest block, so uneven splits work too (packing makes each
    step one message). lg messages per rank; the block for rank i+j travels popcount(j)
    hops:  T = lg·α + Σ_k #{j < p : bit k of j set}·nβ (≈ lg·p/2·nβ).
    tmp = p·B + 2·P (B = largest block, P = largest packed message).
    """
    sizes, in_off, out_off = layout(p, count, splits)
    s = _new("bruck", p, count, itemsize, splits, sizes)
    B = int(sizes.max(initial=0))
    R, J = np.meshgrid(np.arange(p), np.arange(p), indexing="ij")   # rank, slot
    steps = [1 << k for k in range(lg(p))]
    P = max((int(np.count_nonzero(np.arange(p) & d)) * B for d in steps), default=0)
    pack, recv = p * B, p * B + P                  # offsets of the two staging areas in tmp
    s.buffers["tmp"] = p * B + 2 * P

    def block_size(done):
        """Size of the block in slot j of rank r once the distance bits in ``done`` are done:
        it came from rank r − (j & done), bound for that rank + j."""
        src = (R - (J & done)) % p
        return sizes[src, (src + J) % p]

    # Phase 1: rotate: slot j of rank r <- r's block for rank r + j.
    rnd = s.round()
    to = (R + J) % p
    rnd.copy(src=R.ravel(), dst=R.ravel(), n=sizes[R, to].ravel(), sbuf="in",
             soff=in_off[R, to].ravel(), dbuf="tmp", doff=(J * B).ravel())
    # Phase 2: at distance d, pack slots with bit d, send to r + d, unpack next round.
    unpack = None
    for d in steps:
        if unpack is not None:
            rnd = s.round()
            rnd.copy(**unpack)
        size = block_size(d - 1)
        sel = (J & d) != 0
        packed = np.where(sel, size, 0)
        poff = np.cumsum(packed, axis=1) - packed   # where slot j goes in the packed message
        rr, jj = R[sel], J[sel]
        rnd.copy(src=rr, dst=rr, n=size[sel], sbuf="tmp", soff=jj * B, dbuf="tmp", doff=pack + poff[sel])
        r = np.arange(p)
        rnd.copy(src=r, dst=(r + d) % p, n=packed.sum(axis=1), sbuf="tmp", soff=pack,
                 dbuf="tmp", doff=recv)
        unpack = dict(src=(rr + d) % p, dst=(rr + d) % p, n=size[sel], sbuf="tmp",
                      soff=recv + poff[sel], dbuf="tmp", doff=jj * B)
    if unpack is not None:
        rnd = s.round()
        rnd.copy(**unpack)
    # Phase 3: slot j of rank t holds the block from rank t − j: put it in rank order.
    frm = (R - J) % p
    rnd.copy(src=R.ravel(), dst=R.ravel(), n=sizes[frm, R].ravel(), sbuf="tmp",
             soff=(J * B).ravel(), dbuf="out", doff=out_off[frm, R].ravel())
    return s
