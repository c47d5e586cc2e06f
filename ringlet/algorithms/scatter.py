"""scatter: block i of the root's "in" (p·count elements, blocks in rank order) lands in
rank i's "out" (count elements). Only the root's "in" is read; relaying ranks keep their
subtree's blocks in "tmp".

Ranks are handled as virtual ranks v = (r − root) mod p, so the root is v = 0.
Costs: α per message, β per byte, n = count·itemsize bytes per rank, lg = ceil(log2 p).
"""
from __future__ import annotations

import numpy as np

from ._common import binomial_rounds, new, subtree

__all__ = ["direct", "binomial"]


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
