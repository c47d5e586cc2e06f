"""all_reduce: every rank's "buf" (count elements) becomes op over all ranks' "buf".

Every algorithm leaves bit-identical results on every rank: each element's final value is
either computed once and copied, or computed by every rank in the same order (``direct``,
``recursive_doubling``) — IEEE + and * are commutative but not associative, and NumPy's
minimum/maximum are not even bitwise commutative on ±0.

Costs (Thakur–Rabenseifner–Gropp 2005; Patarasuk–Yuan 2009): α per message, β per byte,
γ per byte reduced, n = count·itemsize bytes, p ranks, lg = ceil(log2 p).
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np

from ._common import (at, binomial_rounds, chain_reduce, chunks, fold, host_groups, new,
                      optimal_segments, pairs, ring_all_gather, ring_reduce_scatter)

__all__ = ["naive_ring", "direct", "ring", "gloo_ring", "recursive_doubling", "rabenseifner",
           "tree", "double_tree", "hierarchical", "tree_segments", "btree_parents",
           "dtree_parents", "gloo_blocks"]


def naive_ring(p, count, *, itemsize=4):
    """The textbook's first all-reduce: a running sum walks the ring 0 → 1 → … → p−1
    (each rank adds its own), then the total keeps walking around (p−1 → 0 → … → p−2).

    2(p−1) full-size messages in 2(p−1) rounds:  T = 2(p−1)α + 2(p−1)nβ + (p−1)nγ.
    """
    s = new("all_reduce", "naive_ring", p, count, itemsize, buf=count)
    # Phase 1: rank i+1 folds the running sum of ranks 0..i into its own buffer.
    for i in range(p - 1):
        s.round().reduce(src=i, dst=i + 1, n=count, buf="buf")
    # Phase 2: the total walks on around the ring until every rank holds it.
    for i in range(p - 1):
        src = (p - 1 + i) % p
        s.round().copy(src=src, dst=(src + 1) % p, n=count, buf="buf")
    return s


def direct(p, count, *, itemsize=4):
    """Everyone sends everything to everyone; each rank then folds the p vectors in rank
    order 0..p−1, so all ranks compute the same bits.

    One round of p−1 sends per rank:  T = (p−1)α + (p−1)nβ + (p−1)nγ.  tmp = p·count.
    """
    s = new("all_reduce", "direct", p, count, itemsize, buf=count, tmp=p * count if p > 1 else 0)
    if p == 1:
        return s
    r = np.arange(p)
    # Round 0: rank i's buf lands in slot i of every rank's tmp (its own by a local copy).
    rnd = s.round()
    rnd.copy(src=r, dst=r, n=count, sbuf="buf", soff=0, dbuf="tmp", doff=r * count)
    i, j = pairs(p)
    rnd.copy(src=i, dst=j, n=count, sbuf="buf", soff=0, dbuf="tmp", doff=i * count)
    # Round 1: fold the slots in canonical rank order into buf.
    chain_reduce(s.round(), r, p, count, "buf", 0)
    return s


def ring(p, count, *, itemsize=4):
    """Ring all-reduce: reduce-scatter then all-gather around the ring, the
    buffer cut into p chunks with ``chunks(count, p)``. In reduce-scatter step k rank i
    sends chunk (i−k) mod p to rank i+1, which adds it to its own; after p−1 steps rank i
    owns the reduced chunk (i+1) mod p, and the all-gather circulates the owned chunks.

    2(p−1) messages per rank, 2(p−1)/p·n bytes per rank (exactly, when p divides count):
    T = 2(p−1)α + 2(p−1)/p·nβ + (p−1)/p·nγ.
    """
    s = new("all_reduce", "ring", p, count, itemsize, buf=count)
    off, size = chunks(count, p)
    r = np.arange(p)
    # Phase 1: reduce-scatter.
    for k in range(p - 1):
        c = (r - k) % p
        s.round().reduce(src=r, dst=(r + 1) % p, n=size[c], buf="buf", off=off[c])
    # Phase 2: all-gather; rank i starts by passing on the chunk it owns, (i+1) mod p.
    for k in range(p - 1):
        c = (r + 1 - k) % p
        s.round().copy(src=r, dst=(r + 1) % p, n=size[c], buf="buf", off=off[c])
    return s


#: Gloo's largest pipeline segment (its ring's default), in bytes
GLOO_SEGMENT = 1 << 20


def gloo_blocks(p: int, count: int, itemsize: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, sizes) of the p blocks Gloo's ring all-reduce gives ranks 0..p−1: the
    buffer is cut into S segments of ceil(count / S) elements, S the least multiple of p
    that is at least 2p and keeps segments within 1 MiB, and rank b gets segments
    b·S/p … (b+1)·S/p − 1 (so the last blocks may be short or empty)."""
    per = max(1, GLOO_SEGMENT // itemsize)
    segments = max(-(-count // per), 2 * p)
    segments = -(-segments // p) * p
    block = segments // p * -(-count // segments)
    edge = np.minimum(np.arange(p + 1, dtype=np.int64) * block, count)
    return edge[:-1], np.diff(edge)


def gloo_ring(p, count, *, itemsize=4):
    """The ring all-reduce with Gloo's per-element order of operations, so a float sum has
    the bits torch's Gloo backend gives it: blocks as ``gloo_blocks``, the ring running
    toward lower ranks, and block b's partial sum starting at rank b−1 and ending at b:
    x_b + (x_{b+1} + (… + (x_{b−2} + x_{b−1}))). Gloo's own segment pipelining does not
    change that order, so it is left to the transport.

    As ``ring`` (blocks a little less even):
    T = 2(p−1)α + 2(p−1)/p·nβ + (p−1)/p·nγ.
    """
    s = new("all_reduce", "gloo_ring", p, count, itemsize, buf=count)
    off, size = gloo_blocks(p, count, itemsize)
    down = np.arange(p - 1, -1, -1)     # position l of the ring is rank p−1−l
    end = ring_reduce_scatter(s, 0, down, off[down], size[down])
    ring_all_gather(s, end, down, off[down], size[down])
    return s


def _combine(rnd, ranks, lower, count):
    """Local steps: buf = op(lower half's partial, upper half's partial) on both partners,
    in that operand order on both, from their own buf and the partner's copy in tmp."""
    lo, hi = ranks[lower], ranks[~lower]
    rnd.reduce(src=lo, dst=lo, n=count, sbuf="tmp", soff=0, dbuf="buf", doff=0)
    rnd.reduce(src=hi, dst=hi, n=count, buf="buf", abuf="tmp", aoff=0)


def recursive_doubling(p, count, *, itemsize=4):
    """Recursive doubling: in step d = 1, 2, 4, … rank u swaps its whole partial with
    u XOR d and both combine them, op(lower, upper), at the start of the next round.
    Non-powers of two: odd ranks v < 2·rem (rem = p − p2) first fold into v−1, sit out, and
    get the result back at the end.

    p a power of two: lg p messages of n per rank:  T = lg(α + nβ + nγ).
    Otherwise the fold adds two steps:  T = (⌊log2 p⌋ + 2)(α + nβ) + (⌊log2 p⌋ + 1)nγ.
    tmp = count.
    """
    s = new("all_reduce", "recursive_doubling", p, count, itemsize, buf=count,
            tmp=count if p > 1 else 0)
    if p == 1:
        return s
    p2, core, extra = fold(p)
    u = np.arange(p2)
    # Fold in: the extra ranks add their vector into their partner's.
    if len(extra):
        s.round().reduce(src=extra, dst=extra - 1, n=count, buf="buf")
    # Recursive doubling among the p2 core ranks; what arrives in round t is combined by
    # local steps at the start of round t+1, before that round's sends read buf.
    d, rnd = 1, None
    while d < p2:
        nxt = s.round()
        if rnd is not None:
            _combine(nxt, core, (u & (d // 2)) == 0, count)
        nxt.copy(src=core, dst=core[u ^ d], n=count, sbuf="buf", soff=0, dbuf="tmp", doff=0)
        rnd, d = nxt, d * 2
    last = s.round()
    _combine(last, core, (u & (p2 // 2)) == 0, count)
    # Fold out: partners hand the result back to the extra ranks.
    if len(extra):
        last.copy(src=extra - 1, dst=extra, n=count, buf="buf")
    return s


def rabenseifner(p, count, *, itemsize=4):
    """Rabenseifner: recursive-halving reduce-scatter, then recursive-doubling all-gather,
    over the p2 core ranks (odd ranks v < 2·rem fold into v−1 first and get the result
    back at the end). The buffer is cut into p2 chunks; core rank u ends phase 1 owning
    the reduced chunk u.

    p a power of two: 2·lg p messages, 2(p−1)/p·n bytes per rank:
    T = 2·lg·α + 2(p−1)/p·nβ + (p−1)/p·nγ; the fold adds 2α + 2nβ + nγ.
    """
    s = new("all_reduce", "rabenseifner", p, count, itemsize, buf=count)
    if p == 1:
        return s
    p2, core, extra = fold(p)
    off, _ = chunks(count, p2)
    edge = np.append(off, count)          # chunk c is buf[edge[c]:edge[c+1]]
    u = np.arange(p2)
    if len(extra):                        # fold in
        s.round().reduce(src=extra, dst=extra - 1, n=count, buf="buf")
    # Phase 1: recursive halving. At distance d, u's chunks are lo..lo+2d−1; it keeps the
    # half holding chunk u and hands the other half to u XOR d, which adds it to its own.
    d = p2 // 2
    while d >= 1:
        lo = u & ~(2 * d - 1)
        give = np.where(u & d, lo, lo + d)
        s.round().reduce(src=core, dst=core[u ^ d], n=edge[give + d] - edge[give],
                         buf="buf", off=edge[give])
        d //= 2
    # Phase 2: recursive doubling. At distance d, u holds chunks first..first+d−1 and
    # swaps them with u XOR d.
    d = 1
    while d < p2:
        first = u & ~(d - 1)
        s.round().copy(src=core, dst=core[u ^ d], n=edge[first + d] - edge[first],
                       buf="buf", off=edge[first])
        d *= 2
    if len(extra):                        # fold out
        s.round().copy(src=extra - 1, dst=extra, n=count, buf="buf")
    return s


def tree(p, count, *, itemsize=4):
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast from it.

    Rank 0 receives and sends lg messages of n; 2(p−1) messages in all:
    T = 2·lg(α + nβ) + lg·nγ.
    """
    s = new("all_reduce", "tree", p, count, itemsize, buf=count)
    for _, child, parent in binomial_rounds(p):            # reduce, leaves first
        s.round().reduce(src=child, dst=parent, n=count, buf="buf")
    for _, child, parent in reversed(list(binomial_rounds(p))):   # broadcast, root first
        s.round().copy(src=parent, dst=child, n=count, buf="buf")
    return s


# -- double binary tree --------------------------------------------------------------------
def btree_parents(p: int) -> np.ndarray:
    """NCCL's binary tree on ranks 0..p−1 (parent −1 at the root, rank 0): rank r with
    lowest set bit b hangs under (r XOR b) | 2b, or r XOR b when that is out of range.
    Odd ranks are the leaves; rank 0 has a single child."""
    parent = np.full(p, -1, np.int64)
    for r in range(1, p):
        b = r & -r
        up = (r ^ b) | (b << 1)
        parent[r] = up if up < p else r ^ b
    return parent


def dtree_parents(p: int) -> tuple[np.ndarray, np.ndarray]:
    """NCCL's two complementary trees: the second is the first mirrored (r → p−1−r) when p is
    even, shifted by one (r → r−1) when p is odd, so a rank interior in one is a leaf in
    the other (for odd p rank 0 is interior in both)."""
    t1 = btree_parents(p)
    if p % 2 == 0:
        m = p - 1 - np.arange(p)              # mirror
        t2 = np.where(t1[m] < 0, -1, p - 1 - t1[m])
    else:
        v = (np.arange(p) - 1) % p            # rank r plays r−1 in the first tree
        t2 = np.where(t1[v] < 0, -1, (t1[v] + 1) % p)
    return t1, t2


def _tree_timing(parent: np.ndarray):
    """Rounds of a pipelined reduce-then-broadcast on one tree, for segment 0 (segment j
    is j rounds later): ``up[x]`` when x sends its partial to its parent — after all its
    children's, which arrive in distinct rounds so no two write the same segment at once;
    ``down[x]`` when x receives the result. Returns (up, down, last round for segment 0)."""
    p = len(parent)
    children = [[] for _ in range(p)]
    for x, q in enumerate(parent):
        if q >= 0:
            children[q].append(x)
    order, root = [], int(np.flatnonzero(parent < 0)[0])
    stack = [root]
    while stack:                              # parents before children
        x = stack.pop()
        order.append(x)
        stack.extend(children[x])
    ready = np.zeros(p, np.int64)             # round from which x's partial is complete
    up = np.full(p, -1, np.int64)
    for x in reversed(order):
        t = -1
        for c in sorted(children[x], key=lambda c: ready[c]):
            t = up[c] = max(ready[c], t + 1)
        ready[x] = t + 1
    down = np.full(p, -1, np.int64)
    for x in order:
        for c in children[x]:
            down[c] = ready[root] if x == root else down[x] + 1
    return up, down, max(int(down.max()), int(ready[root]) - 1, 0)


def _pipelined_tree(s, parent, base, n, segments):
    """Reduce ``buf[base:base+n]`` up ``parent`` and broadcast it back down, pipelined in
    ``segments`` chunks: segment j moves j rounds after segment 0."""
    up, down, _ = _tree_timing(parent)
    off, size = chunks(n, segments)
    x = np.flatnonzero(parent >= 0)
    j = np.arange(segments)
    for kind, when in (("up", up), ("down", down)):
        t = (when[x][:, None] + j).ravel()
        node = np.repeat(x, segments)
        seg = np.tile(j, len(x))
        for r in np.unique(t):
            m = t == r
            c, q, g = node[m], parent[node[m]], seg[m]
            if kind == "up":
                at(s, r).reduce(src=c, dst=q, n=size[g], buf="buf", off=base + off[g])
            else:
                at(s, r).copy(src=q, dst=c, n=size[g], buf="buf", off=base + off[g])


def tree_segments(p: int, count: int, itemsize: int = 4) -> int:
    """Segments per tree of ``double_tree``: the pipeline optimum (see
    ``_common.optimal_segments``) for half the buffer over the trees' fill rounds."""
    if p <= 1:
        return 1
    fill = max(_tree_timing(t)[2] for t in dtree_parents(p))
    return optimal_segments(fill, (count + 1) // 2, itemsize)


def double_tree(p, count, *, itemsize=4):
    """NCCL's double binary tree: two complementary binary trees (``dtree_parents``), each
    reducing half of the buffer up to its root and broadcasting it back down, pipelined in
    S = ``tree_segments(p, count, itemsize)`` segments; both trees run at once.

    Each half crosses each tree edge twice: 2(p−1)·n bytes in all. With F fill rounds
    (about 3·log2 p): T ≈ (F + S)(α + nβ/(2S)) + nγ/2 per interior rank.
    """
    s = new("all_reduce", "double_tree", p, count, itemsize, buf=count)
    if p == 1:
        return s
    segments = tree_segments(p, count, itemsize)
    s.notes["segments"] = segments
    (off0, off1), (n0, n1) = chunks(count, 2)
    t1, t2 = dtree_parents(p)
    _pipelined_tree(s, t1, off0, n0, segments)
    _pipelined_tree(s, t2, off1, n1, segments)
    return s


# -- hierarchical -------------------------------------------------------------------------
def _edge(frac: Fraction, count: int) -> int:
    """Where fraction ``frac`` of the buffer starts: ⌊frac·count⌋. Hosts with m ranks cut
    the buffer at ⌊l·count/m⌋ (not ``chunks``), so hosts of different sizes agree on the
    position of every shared cut."""
    return frac.numerator * count // frac.denominator


def _shards(count, m):
    """Host-level shards: local rank l of a host with m ranks owns buf[⌊l·count/m⌋ : ⌊(l+1)·count/m⌋]."""
    edge = np.array([_edge(Fraction(l, m), count) for l in range(m + 1)], np.int64)
    return edge[:-1], np.diff(edge)


def hierarchical(p, count, *, itemsize=4, hosts=None):
    """Two-level all-reduce over ``hosts`` (the host id of each rank; None = one host):

    1. reduce-scatter inside each host (ring): local rank l of a host with m ranks ends
       owning shard l, the host's sum of buf[⌊l·count/m⌋ : ⌊(l+1)·count/m⌋];
    2. all-reduce across hosts (ring): all hosts' shard cuts together split the buffer
       into segments with exactly one owner per host; the owners of each segment ring-
       all-reduce it (with equal hosts: the ranks with the same local index, one shard);
    3. all-gather inside each host (ring).

    Hosts may have unequal numbers of ranks (a rank may then own parts of several
    segments). One host degenerates to ``ring``; one rank per host to a ring across hosts.
    With h hosts of m ranks and intra/inter links (α₁, β₁), (α₂, β₂):
    T = 2(m−1)α₁ + 2(m−1)/m·nβ₁ + 2(h−1)α₂ + 2(h−1)/h·(n/m)β₂ + γ terms;
    each rank sends 2(m−1) + 2(h−1) messages.
    """
    groups = host_groups(p, hosts)
    s = new("all_reduce", "hierarchical", p, count, itemsize, buf=count)
    s.hosts = tuple(hosts) if hosts is not None else None
    h = len(groups)
    pieces = hierarchical_pieces(count * itemsize, h, max(len(g) for g in groups))
    # Pieces start one inter-host phase apart, so while one crosses hosts the next is
    # reduced and the previous gathered inside them: the host links stay busy.
    stagger = 2 * (h - 1)
    edges = [k * count // pieces for k in range(pieces + 1)]
    for k in range(pieces):
        _hierarchical_piece(s, k * stagger, groups, edges[k], edges[k + 1] - edges[k])
    return s


#: below this many bytes hierarchical all-reduce runs in one piece; above, in up to
#: PIECES_MAX pieces of at least this size
PIECE_BYTES = 4 << 20
PIECES_MAX = 4


def hierarchical_pieces(nbytes: int, h: int, m: int) -> int:
    """How many pieces a hierarchical all-reduce pipelines: one unless both levels have
    work (h, m > 1) and the buffer is large enough that hiding the intra-host phases
    behind the inter-host one beats the extra rounds."""
    if h < 2 or m < 2:
        return 1
    return int(max(1, min(PIECES_MAX, nbytes // PIECE_BYTES)))


def _hierarchical_piece(s, start, groups, base, count) -> int:
    """The three phases of hierarchical on ``buf[base:base + count]`` from round
    ``start``; returns the round after them."""
    h = len(groups)
    # Phase 1: reduce-scatter inside each host, all hosts side by side.
    start = max(ring_reduce_scatter(s, start, g, *_piece(_shards(count, len(g)), base))
                for g in groups)
    # Phase 2: one ring all-reduce across hosts per segment, all segments side by side.
    cuts = sorted({Fraction(l, len(g)) for g in groups for l in range(len(g))} | {Fraction(1)})
    end = start
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        owners = np.array([g[lo.numerator * len(g) // lo.denominator] for g in groups])
        a, b = _edge(lo, count), _edge(hi, count)
        off, size = chunks(b - a, h)
        mid = ring_reduce_scatter(s, start, owners, base + a + off, size)
        end = ring_all_gather(s, mid, owners, base + a + off, size)
    # Phase 3: all-gather inside each host.
    return max(ring_all_gather(s, end, g, *_piece(_shards(count, len(g)), base))
               for g in groups)


def _piece(shards, base):
    off, size = shards
    return off + base, size
