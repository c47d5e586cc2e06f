"""scatter: block i of the root's "in" (p·count elements, blocks in rank order) lands in
rank i's "out" (count elements). Only the root's "in" is read; relaying ranks keep their
subtree's blocks in "tmp".

Ranks are handled as virtual ranks v = (r − root) mod p, so the root is v = 0.
Costs: α per message, β per byte, n = count·itemsize bytes per rank, lg = ceil(log2 p).
"""
from __future__ import annotations

import numpy as np

from ._common import binomial_rounds, lg, new, signal_others, subtree

__all__ = ["direct", "binomial", "dissemination"]


def direct(p, count, *, itemsize=4, root=0):
    """The root sends every rank its block in one round.

    The root sends p−1 messages of n:  T = (p−1)(α + nβ).
    """
    s = new("scatter", "direct", p, count, itemsize, root=root, **{"in": p * count}, out=count)
    others = (np.arange(1, p) + root) % p
    rnd = s.round()
    rnd.copy(src=root, dst=root, n=count, sbuf="in", soff=root * count, dbuf="out", doff=0)
    rnd.copy(src=root, dst=others, n=count, sbuf="in", soff=others * count, dbuf="out", doff=0)
    return s


def binomial(p, count, *, itemsize=4, root=0):
    """Binomial tree, root first: virtual rank v receives the blocks of its subtree,
    v..v+subtree−1, in virtual order (leaves: just its own, straight into "out") and
    passes the sub-subtrees on. A root other than rank 0 first rotates its "in" into
    virtual order in tmp; relays copy their own block from tmp to "out" at the end.

    p−1 messages, lg from the root, (p−1)·n bytes out of it:  T = lg·α + (p−1)nβ.
    tmp = p·count at a root other than 0, else the largest relayed subtree.
    """
    v = np.arange(p)
    size = subtree(p, v)
    relay = (v > 0) & (size > 1)                  # non-roots that receive more than their block
    tmp = p * count if root else int(size[relay].max(initial=0)) * count
    s = new("scatter", "binomial", p, count, itemsize, root=root, **{"in": p * count}, out=count,
            tmp=tmp)
    real = lambda x: (np.asarray(x) + root) % p  # noqa: E731
    at_root = "in" if root == 0 else "tmp"       # the root's blocks in virtual order
    rounds = list(reversed(list(binomial_rounds(p))))
    rnd = s.round()
    rnd.copy(src=root, dst=root, n=count, sbuf="in", soff=root * count, dbuf="out", doff=0)
    if root:   # rotate: virtual block w is rank w + root's
        rnd.copy(src=root, dst=root, n=(p - root) * count, sbuf="in", soff=root * count,
                 dbuf="tmp", doff=0)
        rnd.copy(src=root, dst=root, n=root * count, sbuf="in", soff=0, dbuf="tmp",
                 doff=(p - root) * count)
    for i, (_, child, parent) in enumerate(rounds):
        if i:
            rnd = s.round()
        for from_root in (False, True):
            for relays in (False, True):          # leaves receive into "out", relays into tmp
                m = ((parent == 0) == from_root) & (relay[child] == relays)
                c, q = child[m], parent[m]
                rnd.copy(src=real(q), dst=real(c), n=size[c] * count,
                         sbuf=at_root if from_root else "tmp", soff=(c - q) * count,
                         dbuf="tmp" if relays else "out", doff=0)
    if relay.any():
        s.round().copy(src=real(v[relay]), dst=real(v[relay]), n=count, sbuf="tmp", soff=0,
                       dbuf="out", doff=0)
    return s


def dissemination(p, count, *, itemsize=4, root=0):
    """A binomial tree, root first, laid on the dissemination barrier's messages (as
    ``broadcast.dissemination``): in round k virtual ranks v < 2^k pass w = v + 2^k the
    blocks of its subtree, {w + m·2^(k+1)}, in the message of the barrier's round k; the
    other signals stay empty. A relay keeps its subtree in tmp, block v at slot
    ``bit_reversed_slots(p)[v]``, where a subtree is one run of slots, and takes its own
    block out at the end; a leaf receives its block straight into "out". The root sends a
    leaf its block straight from "in" and first lays out by slot the subtrees of the relays
    it sends to (none at p = 2). The barrier is the algorithm rather than a prefix to it.

    p−1 messages of n among p·lg, lg from the root:  T = lg·α + (p−1)nβ, and the root's
    local copy of its relays' blocks: binomial's, less a barrier.  tmp = p·count.
    """
    v = np.arange(p)
    slot = bit_reversed_slots(p)
    high = np.array([1 << (x.bit_length() - 1) if x else 0 for x in range(p)], np.int64)
    # v > 0 receives in the round for 2^k = high[v]; its subtree is {v + m·2^(k+1)} below p
    blocks = np.where(v > 0, (p - 1 - v) // np.maximum(2 * high, 1) + 1, p)
    relay = (v > 0) & (blocks > 1)
    s = new("scatter", "dissemination", p, count, itemsize, root=root, **{"in": p * count},
            out=count, tmp=p * count if relay.any() else 0)
    real = lambda x: (np.asarray(x) + root) % p  # noqa: E731
    targets = np.array([1 << k for k in range(lg(p))], np.int64)   # the root's: v = 2^k
    laid = np.concatenate([np.zeros(0, np.int64)] +
                          [np.arange(w, p, 2 * w) for w in targets[relay[targets]]])
    rnd = s.round()
    rnd.copy(src=root, dst=root, n=count, sbuf="in", soff=root * count, dbuf="out", doff=0)
    rnd.copy(src=root, dst=root, n=count, sbuf="in", soff=real(laid) * count, dbuf="tmp",
             doff=slot[laid] * count)
    for k in range(lg(p)):
        d = 1 << k
        if k:
            rnd = s.round()
        w = v[d:min(2 * d, p)]                    # they receive now, from w − d
        leaf = ~relay[w]
        straight = leaf & (w == d)                # the root's leaf: from "in" to "out"
        for m, sbuf, dbuf in ((straight, "in", "out"), (leaf & ~straight, "tmp", "out"),
                              (~leaf, "tmp", "tmp")):
            c = w[m]
            rnd.copy(src=real(c - d), dst=real(c), n=blocks[c] * count, sbuf=sbuf,
                     soff=(real(c) if sbuf == "in" else slot[c]) * count, dbuf=dbuf,
                     doff=slot[c] * count if dbuf == "tmp" else 0)
        signal_others(rnd, p, k, real(w - d))
    if relay.any():
        s.round().copy(src=real(v[relay]), dst=real(v[relay]), n=count, sbuf="tmp",
                       soff=slot[relay] * count, dbuf="out", doff=0)
    s.agrees = True
    return s


def bit_reversed_slots(p: int) -> np.ndarray:
    """Slot of virtual rank v: its place when 0..p−1 are sorted by their lg(p) bits read
    backwards. The ranks that agree in their low bits - a subtree of the root-first
    dissemination tree - then fill one run of slots, starting with its lowest rank."""
    bits = lg(p)
    rev = np.array([int(format(v, f"0{bits}b")[::-1], 2) if bits else 0 for v in range(p)])
    slot = np.empty(p, np.int64)
    slot[np.argsort(rev, kind="stable")] = np.arange(p)
    return slot
