"""broadcast: the root's "buf" (count elements) is copied into every rank's "buf".

Ranks are handled as virtual ranks v = (r − root) mod p, so the root is v = 0.
Costs: α per message, β per byte, n = count·itemsize bytes, lg = ceil(log2 p).
"""
from __future__ import annotations

import numpy as np

from ._common import (at, binomial_rounds, chunks, host_groups, lg, new, optimal_segments,
                      ring_all_gather, signal_others, subtree)

__all__ = ["direct", "binomial", "dissemination", "pipeline", "scatter_allgather",
           "hierarchical", "pipeline_segments"]


def _new(algorithm, p, count, itemsize, root):
    s = new("broadcast", algorithm, p, count, itemsize, root=root, buf=count)
    return s, (lambda v: (np.asarray(v) + root) % p)


def direct(p, count, *, itemsize=4, root=0):
    """The root sends the buffer to every other rank in one round.

    The root sends p−1 messages of n:  T = (p−1)(α + nβ) (one NIC).
    """
    s, real = _new("direct", p, count, itemsize, root)
    if p > 1:
        s.round().copy(src=root, dst=real(np.arange(1, p)), n=count, buf="buf")
    return s


def binomial(p, count, *, itemsize=4, root=0):
    """Binomial tree: in the round for mask = 2^k (largest first) every virtual rank
    v < mask that holds the data sends it to v + mask.

    p−1 messages of n in lg rounds; the root sends lg of them:  T = lg(α + nβ).
    """
    s, real = _new("binomial", p, count, itemsize, root)
    for _, child, parent in reversed(list(binomial_rounds(p))):
        s.round().copy(src=real(parent), dst=real(child), n=count, buf="buf")
    return s


def dissemination(p, count, *, itemsize=4, root=0):
    """A binomial tree laid on the dissemination barrier's messages: in round k every
    rank r signals r + 2^k, and virtual ranks v < 2^k, which hold the data, put it in
    that message (to v + 2^k); the others' signals stay empty. The barrier is the
    algorithm rather than a prefix to it (``Schedule.agrees``).

    Every rank sends lg messages, the root's all carry n:  T = lg(α + nβ): binomial's,
    less the lg·α of the barrier before it.
    """
    s, real = _new("dissemination", p, count, itemsize, root)
    for k in range(lg(p)):
        d = 1 << k
        rnd = s.round()
        v = np.arange(min(d, p - d))              # holders whose signal lands on a new rank
        rnd.copy(src=real(v), dst=real(v + d), n=count, buf="buf")
        signal_others(rnd, p, k, real(v))
    s.agrees = True
    return s


def pipeline_segments(p: int, count: int, itemsize: int = 4) -> int:
    """Segments of the pipelined chain broadcast: S minimising (p−2+S)(α + nβ/S) on the
    reference link of ``_common.optimal_segments``, i.e. about sqrt((p−2)·nβ/α), clamped
    to 1..min(count, 64); 1 when p <= 2 or count <= 1."""
    return optimal_segments(p - 2, count, itemsize)


def pipeline(p, count, *, itemsize=4, root=0):
    """Pipelined chain: the buffer is cut into S = ``pipeline_segments(p, count, itemsize)``
    segments (``chunks(count, S)``) that flow down the chain root → root+1 → … → root−1;
    in round t link v → v+1 carries segment t − v.

    (p−1)·S messages in p−2+S rounds; every non-root receives n once:
    T = (p−2+S)(α + nβ/S), → nβ for large n.
    """
    s, real = _new("pipeline", p, count, itemsize, root)
    s.notes["segments"] = _chain(s, 0, real(np.arange(p)), count, itemsize)[1]
    return s


def _chain(s, start, chain, count, itemsize):
    """The pipelined chain chain[0] → chain[1] → … from round ``start``: in round start + t
    link v → v+1 carries segment t − v. Returns (the next round, segments)."""
    chain = np.asarray(chain, np.int64)
    k = len(chain)
    segments = pipeline_segments(k, count, itemsize)
    off, size = chunks(count, segments)
    v = np.arange(k - 1)
    steps = k - 2 + segments if k > 1 else 0
    for t in range(steps):
        j = t - v
        ok = (j >= 0) & (j < segments)
        at(s, start + t).copy(src=chain[v[ok]], dst=chain[v[ok] + 1], n=size[j[ok]],
                              buf="buf", off=off[j[ok]])
    return start + steps, segments


def scatter_allgather(p, count, *, itemsize=4, root=0):
    """van de Geijn: a binomial scatter gives virtual rank v chunk v (``chunks(count, p)``),
    then a ring all-gather of the chunks, all in place in buf. The ring carries no chunk
    to a rank that holds it already (the root holds all, a scatter parent its subtree's),
    so every rank but the root receives n bytes in all, and the root none.

    T = (lg + p − 1)α + 2(p−1)/p·nβ.
    """
    s, real = _new("scatter_allgather", p, count, itemsize, root)
    off, size = chunks(count, p)
    edge = np.append(off, count)
    # Phase 1: binomial scatter; child v receives the chunks of its subtree v..v+size−1.
    for _, child, parent in reversed(list(binomial_rounds(p))):
        end = child + subtree(p, child)
        s.round().copy(src=real(parent), dst=real(child), n=edge[end] - edge[child],
                       buf="buf", off=edge[child])
    # Phase 2: ring all-gather among virtual ranks 0..p−1, of the chunks each lacks.
    v = np.arange(p)
    held = (v[None, :] >= v[:, None]) & (v[None, :] < v[:, None] + subtree(p, v)[:, None])
    ring_all_gather(s, len(s.rounds), real(v), off, size, held=held)
    return s


def hierarchical(p, count, *, itemsize=4, root=0, hosts=None):
    """Two levels over ``hosts`` (the host id of each rank; None = one host; hosts of any
    sizes): one copy crosses into each host, then each host spreads it inside.

    1. across hosts: a pipelined chain of one leader per host (the root on its host, the
       lowest rank on the others), from the root's host on in host order: every other host
       receives the buffer exactly once across hosts;
    2. inside each host: a pipelined chain from the leader through the host's other ranks,
       all hosts side by side.

    With h hosts of m ranks, intra/inter links (α₁, β₁), (α₂, β₂), S₂ and S₁ segments
    (``pipeline_segments`` of h and of m):
    T = (h−2+S₂)(α₂ + nβ₂/S₂) + (m−2+S₁)(α₁ + nβ₁/S₁), each term only with more than one
    host / rank per host.
    """
    s = new("broadcast", "hierarchical", p, count, itemsize, root=root, buf=count)
    s.hosts = tuple(hosts) if hosts is not None else None
    groups = host_groups(p, hosts)
    home = next(j for j, g in enumerate(groups) if root in g)
    order = [groups[(home + i) % len(groups)] for i in range(len(groups))]
    # each host's chain starts at its leader: the root on its host, else its lowest rank
    chains = [np.roll(g, -int(np.flatnonzero(g == root)[0])) if j == 0 else g
              for j, g in enumerate(order)]
    end, s.notes["segments_inter"] = _chain(s, 0, [c[0] for c in chains], count, itemsize)
    for c in chains:
        _chain(s, end, c, count, itemsize)
    return s
