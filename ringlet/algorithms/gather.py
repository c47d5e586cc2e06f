"""gather: rank i's "in" (count elements) lands in block i of the root's "out" (p·count
elements, blocks in rank order). Only the root's "out" is touched; relaying ranks
collect their subtree's blocks in "tmp".

Ranks are handled as virtual ranks v = (r − root) mod p, so the root is v = 0.
Costs: α per message, β per byte, n = count·itemsize bytes per rank, lg = ceil(log2 p).
"""
from __future__ import annotations

import numpy as np

from ._common import binomial_rounds, new, signal_others, subtree

__all__ = ["direct", "binomial", "dissemination"]


def direct(p, count, *, itemsize=4, root=0):
    """Every rank sends its block straight to the root in one round.

    The root receives p−1 messages of n:  T = (p−1)(α + nβ).
    """
    s = new("gather", "direct", p, count, itemsize, root=root, **{"in": count}, out=p * count)
    others = (np.arange(1, p) + root) % p
    rnd = s.round()
    rnd.copy(src=root, dst=root, n=count, sbuf="in", soff=0, dbuf="out", doff=root * count)
    rnd.copy(src=others, dst=root, n=count, sbuf="in", soff=0, dbuf="out", doff=others * count)
    return s


def binomial(p, count, *, itemsize=4, root=0):
    """Binomial tree, leaves first: virtual rank v sends the blocks of its subtree,
    v..v+subtree−1 (leaves: straight from "in"), to its parent, which keeps them in virtual
    order in tmp — the root in "out" when it is rank 0, else in tmp and rotated into rank
    order at the end.

    p−1 messages, lg at the root, (p−1)·n bytes into the root:  T = lg·α + (p−1)nβ.
    tmp = p·count at a root other than 0, else the largest relayed subtree.
    """
    v = np.arange(p)
    size = subtree(p, v)
    relay = (v > 0) & (size > 1)                  # non-roots that receive before sending
    tmp = p * count if root else int(size[relay].max(initial=0)) * count
    s = new("gather", "binomial", p, count, itemsize, root=root, **{"in": count}, out=p * count,
            tmp=tmp)
    real = lambda x: (np.asarray(x) + root) % p  # noqa: E731
    at_root = "out" if root == 0 else "tmp"      # where the root collects, in virtual order
    rnd = s.round()
    rnd.copy(src=root, dst=root, n=count, sbuf="in", soff=0, dbuf=at_root, doff=0)
    rnd.copy(src=real(v[relay]), dst=real(v[relay]), n=count, sbuf="in", soff=0, dbuf="tmp", doff=0)
    for i, (_, child, parent) in enumerate(binomial_rounds(p)):
        if i:
            rnd = s.round()
        for relays in (False, True):              # leaves send "in", relays their tmp
            for to_root in (False, True):
                m = (relay[child] == relays) & ((parent == 0) == to_root)
                c, q = child[m], parent[m]
                rnd.copy(src=real(c), dst=real(q), n=size[c] * count,
                         sbuf="tmp" if relays else "in", soff=0,
                         dbuf=at_root if to_root else "tmp", doff=(c - q) * count)
    if root:   # rotate: virtual block w is rank w + root's
        rnd = s.round()
        rnd.copy(src=root, dst=root, n=(p - root) * count, sbuf="tmp", soff=0, dbuf="out",
                 doff=root * count)
        rnd.copy(src=root, dst=root, n=root * count, sbuf="tmp", soff=(p - root) * count,
                 dbuf="out", doff=0)
    return s


def dissemination(p, count, *, itemsize=4, root=0):
    """The binomial tree, leaves first, laid on the dissemination barrier's messages (as
    ``reduce.dissemination``): on mirrored virtual ranks w = (root − r) mod p, child w
    sends the blocks of its subtree w..w+size−1 to w − 2^k, the rank it signals in barrier
    round k; the other signals stay empty. Block v = (r − root) mod p has slot v wherever
    it is kept, so a subtree is one run of slots (p−w−size+1 .. p−w): the root collects in
    "out" when it is rank 0, else in tmp and rotates it into rank order at the end, as
    ``binomial`` does. The barrier is the algorithm rather than a prefix to it.

    p−1 messages of n among p·lg, lg at the root:  T = lg·α + (p−1)nβ: binomial's, less a
    barrier.  tmp = p·count on relays (and a root other than 0).
    """
    w = np.arange(p)
    size = subtree(p, w)
    relay = (w > 0) & (size > 1)                  # non-roots that receive before sending
    s = new("gather", "dissemination", p, count, itemsize, root=root, **{"in": count},
            out=p * count, tmp=p * count if root or relay.any() else 0)
    real = lambda x: (root - np.asarray(x)) % p  # noqa: E731
    slot = lambda x: (p - np.asarray(x)) % p      # noqa: E731  (v of mirrored w)
    at_root = "out" if root == 0 else "tmp"
    rnd = s.round()
    rnd.copy(src=root, dst=root, n=count, sbuf="in", soff=0, dbuf=at_root, doff=0)
    rnd.copy(src=real(w[relay]), dst=real(w[relay]), n=count, sbuf="in", soff=0, dbuf="tmp",
             doff=slot(w[relay]) * count)
    for k, (_, child, parent) in enumerate(binomial_rounds(p)):
        if k:
            rnd = s.round()
        first = slot(child + size[child] - 1) * count     # the subtree's lowest slot
        for relays in (False, True):              # leaves send "in", relays their tmp
            for to_root in (False, True):
                m = (relay[child] == relays) & ((parent == 0) == to_root)
                c, f = child[m], first[m]
                rnd.copy(src=real(c), dst=real(c - (1 << k)), n=size[c] * count,
                         sbuf="tmp" if relays else "in", soff=f if relays else 0,
                         dbuf=at_root if to_root else "tmp", doff=f)
        signal_others(rnd, p, k, real(child))
    if root:   # rotate: slot v is rank v + root's block
        rnd = s.round()
        rnd.copy(src=root, dst=root, n=(p - root) * count, sbuf="tmp", soff=0, dbuf="out",
                 doff=root * count)
        rnd.copy(src=root, dst=root, n=root * count, sbuf="tmp", soff=(p - root) * count,
                 dbuf="out", doff=0)
    s.agrees = True
    return s
