"""broadcast: the root's "buf" (count elements) is copied into every rank's "buf".

Ranks are handled as virtual ranks v = (r − root) mod p, so the root is v = 0.
Costs: α per message, β per byte, n = count·itemsize bytes, lg = ceil(log2 p).
"""
from __future__ import annotations

import numpy as np

from ._common import binomial_rounds, chunks, new, optimal_segments, ring_all_gather, subtree

__all__ = ["direct", "binomial", "pipeline", "scatter_allgather", "pipeline_segments"]


def _new(algorithm, p, count, itemsize, root):
    s = new("broadcast", algorithm, p, count, itemsize, root=root, buf=count)
    return s, (lambda v: (np.asarray(v) + root) % p)


def direct(p, count, *, itemsize=4, root=0):
    """The root sends the buffer to every other rank in one round.

    The root sends p−1 messages of n:  T = (p−1)(α + nβ) (one NIC).
    """
    s, real = _new("direct", p, count, itemsize, root)
    if p > 1:
        s.round().copy(src=root, dst=real(np.arange(1, p)), n=count,
                       sbuf="buf", soff=0, dbuf="buf", doff=0)
    return s


def binomial(p, count, *, itemsize=4, root=0):
    """Binomial tree: in the round for mask = 2^k (largest first) every virtual rank
    v < mask that holds the data sends it to v + mask.

    p−1 messages of n in lg rounds; the root sends lg of them:  T = lg(α + nβ).
    """
    s, real = _new("binomial", p, count, itemsize, root)
    for _, child, parent in reversed(list(binomial_rounds(p))):
        s.round().copy(src=real(parent), dst=real(child), n=count,
                       sbuf="buf", soff=0, dbuf="buf", doff=0)
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
    segments = pipeline_segments(p, count, itemsize)
    s.notes["segments"] = segments
    off, size = chunks(count, segments)
    v = np.arange(p - 1)
    for t in range(p - 2 + segments if p > 1 else 0):
        j = t - v
        ok = (j >= 0) & (j < segments)
        s.round().copy(src=real(v[ok]), dst=real(v[ok] + 1), n=size[j[ok]],
                       sbuf="buf", soff=off[j[ok]], dbuf="buf", doff=off[j[ok]])
    return s


def scatter_allgather(p, count, *, itemsize=4, root=0):
    """van de Geijn: a binomial scatter gives virtual rank v chunk v (``chunks(count, p)``),
    then a ring all-gather of the chunks, all in place in buf.

    T = (lg + p − 1)α + 2(p−1)/p·nβ.
    """
    s, real = _new("scatter_allgather", p, count, itemsize, root)
    off, size = chunks(count, p)
    edge = np.append(off, count)
    # Phase 1: binomial scatter; child v receives the chunks of its subtree v..v+size−1.
    for _, child, parent in reversed(list(binomial_rounds(p))):
        end = child + subtree(p, child)
        s.round().copy(src=real(parent), dst=real(child), n=edge[end] - edge[child],
                       sbuf="buf", soff=edge[child], dbuf="buf", doff=edge[child])
    # Phase 2: ring all-gather among virtual ranks 0..p−1.
    ring_all_gather(s, len(s.rounds), real(np.arange(p)), off, size)
    return s
