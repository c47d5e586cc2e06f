"""Links, tiers and the closed-form alpha-beta-gamma cost of every collective algorithm.

The model (the textbook's alpha-beta model, Thakur-Rabenseifner-Gropp 2005, Patarasuk-Yuan 2009):
one message of ``n`` bytes over a link costs ``alpha + n*beta`` (``beta = 1/bandwidth``),
reducing ``n`` bytes costs ``n*gamma`` at the receiver. A rank sends one message and
receives one message at a time (full duplex, single port): messages a rank posts together
queue behind each other. Every closed form below is the critical-path time of the
schedule ``ringlet.algorithms`` builds for that algorithm, split into three terms::

    latency    (number of messages on the critical path) * alpha
    bandwidth  (bytes on the critical path) * beta
    reduction  (bytes reduced on the critical path) * gamma

Size convention (nccl-tests'): ``nbytes`` is

* the per-rank buffer for ``all_reduce``, ``broadcast``, ``reduce``, ``all_to_all``
  and ``all_to_all_single`` (for all_to_all: the whole send buffer of one rank, p blocks);
* the total (gathered) array for ``all_gather``, ``reduce_scatter``, ``gather`` and
  ``scatter``: p times what one rank contributes or keeps;
* ignored for ``barrier``.

So ``nbytes = count*itemsize`` for the first group and ``p*count*itemsize`` for the
second, where ``count`` is the count the runtime and ``ringlet.algorithms.build`` take.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Callable, NamedTuple

from ..algorithms import CATALOG, ROOTED, SELF_AGREEING
from ..algorithms._common import lg
from ..algorithms.broadcast import pipeline_segments as _pipeline_segments
from ..algorithms.reduce import gloo_reduce_blocks

# --------------------------------------------------------------------------- links


@dataclass(frozen=True)
class Link:
    """A point-to-point link: ``alpha`` seconds per message, ``bandwidth`` bytes/s.

    ``Link(alpha=3e-6, bandwidth=50e9)``; ``.beta`` is seconds per byte. ``name`` is only
    a label for printouts. A transport that sends small messages eagerly and larger ones
    only after a rendezvous round trip (ringlet's TCP and shared memory) charges
    ``alpha_eager`` instead of ``alpha`` for a message of at most ``eager`` bytes
    (``eager`` -1: every message costs ``alpha``). The simulator prices each message by
    its size; the closed forms, which count messages, not their sizes, use ``alpha``."""
    alpha: float
    bandwidth: float
    name: str = ""
    alpha_eager: float | None = None
    eager: int = -1

    def __post_init__(self):
        if not (isinstance(self.alpha, (int, float)) and self.alpha >= 0 and math.isfinite(self.alpha)):
            raise ValueError(f"Link alpha must be a finite number >= 0 seconds, got {self.alpha!r}")
        if not (isinstance(self.bandwidth, (int, float)) and self.bandwidth > 0):
            raise ValueError(f"Link bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if self.alpha_eager is not None and not (self.alpha_eager >= 0 and math.isfinite(self.alpha_eager)):
            raise ValueError(f"Link alpha_eager must be a finite number >= 0 seconds, "
                             f"got {self.alpha_eager!r}")

    @classmethod
    def from_beta(cls, alpha: float, beta: float, name: str = "", alpha_eager=None,
                  eager: int = -1) -> "Link":
        if beta <= 0:
            raise ValueError(f"beta must be > 0 seconds per byte, got {beta!r}")
        return cls(alpha, 1.0 / beta, name, alpha_eager, int(eager))

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth

    def with_name(self, name: str) -> "Link":
        from dataclasses import replace
        return replace(self, name=name)

    def alphas(self, nbytes):
        """Seconds per message of each size in ``nbytes`` (a number or an array)."""
        if self.alpha_eager is None or self.eager < 0:
            return self.alpha + 0.0 * nbytes
        import numpy as np
        return np.where(np.asarray(nbytes) <= self.eager, self.alpha_eager, self.alpha)

    def time(self, nbytes: float) -> float:
        """alpha + n*beta: one message of ``nbytes`` bytes."""
        return float(self.alphas(nbytes)) + nbytes / self.bandwidth

    @property
    def crossover(self) -> float:
        """n = alpha/beta: below it a message is latency-bound, above bandwidth-bound."""
        return self.alpha * self.bandwidth

    def __str__(self) -> str:
        label = f"{self.name}: " if self.name else ""
        eager = (f" ({self.alpha_eager * 1e6:.3g} us up to {self.eager} B)"
                 if self.alpha_eager is not None and self.eager >= 0 else "")
        return f"{label}alpha {self.alpha * 1e6:.3g} us{eager}, {self.bandwidth / 1e9:.4g} GB/s"


# The textbook's interconnect tiers (representative orders of magnitude).
TIERS: dict[str, Link] = {
    "nvlink": Link(1.0e-6, 300e9, "NVLink (intra-node)"),
    "pcie": Link(2.0e-6, 25e9, "PCIe   (intra-node)"),
    "infiniband": Link(3.0e-6, 50e9, "InfiniBand NDR (inter)"),
    "ethernet": Link(30.0e-6, 3.1e9, "Ethernet 25G (inter)"),
}


def tier(name) -> Link:
    """A tier by name (case-insensitive), or a Link passed through."""
    if isinstance(name, Link):
        return name
    key = str(name).lower()
    if key not in TIERS:
        raise ValueError(f"unknown tier {name!r}; valid tiers: {', '.join(TIERS)}")
    return TIERS[key]


# --------------------------------------------------------------------------- catalog

#: every collective's algorithms, in the catalogue's order (ringlet.algorithms.CATALOG)
ALGORITHMS: dict[str, tuple[str, ...]] = {c: tuple(t) for c, t in CATALOG.items()}
COLLECTIVES = tuple(ALGORITHMS)

#: what ``algorithm=None`` means in predict()
DEFAULT_ALGORITHM = {
    "all_reduce": "ring", "broadcast": "binomial", "reduce": "binomial", "all_gather": "ring",
    "reduce_scatter": "ring", "all_to_all": "pairwise", "all_to_all_single": "pairwise",
    "gather": "binomial", "scatter": "binomial", "barrier": "dissemination",
}

#: collectives whose ``nbytes`` is the total (p blocks) array; the rest: per-rank buffer
TOTAL_SIZE = frozenset({"all_gather", "reduce_scatter", "gather", "scatter"})
#: algorithms that need host identity (a two-level topology)
HOST_AWARE = frozenset((c, "hierarchical") for c in
                       ("all_reduce", "broadcast", "all_gather", "reduce_scatter"))


def check_collective(collective: str) -> str:
    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}; valid collectives: "
                         f"{', '.join(COLLECTIVES)}")
    return collective


def check_algorithm(collective: str, algorithm: str) -> str:
    check_collective(collective)
    if algorithm not in ALGORITHMS[collective]:
        raise ValueError(f"unknown algorithm {algorithm!r} for {collective}; valid algorithms: "
                         f"{', '.join(ALGORITHMS[collective])}")
    return algorithm


def nbytes_of(collective: str, p: int, count: int, itemsize: int = 4) -> int:
    """The size-convention ``nbytes`` of a call with ``count`` elements per block."""
    check_collective(collective)
    if collective == "barrier":
        return 0
    blocks = p if collective in TOTAL_SIZE or collective.startswith("all_to_all") else 1
    return blocks * count * itemsize


def count_of(collective: str, p: int, nbytes: int, itemsize: int = 4) -> int:
    """Inverse of :func:`nbytes_of`, rounding down to whole elements per block."""
    check_collective(collective)
    if collective == "barrier":
        return 0
    blocks = p if collective in TOTAL_SIZE or collective.startswith("all_to_all") else 1
    return int(nbytes) // (blocks * itemsize)


# --------------------------------------------------------------------------- terms


class Terms(NamedTuple):
    """Predicted seconds, split into the alpha, beta and gamma terms."""
    latency: float = 0.0
    bandwidth: float = 0.0
    reduction: float = 0.0

    @property
    def total(self) -> float:
        return self.latency + self.bandwidth + self.reduction

    def __add__(self, other):  # type: ignore[override]
        return Terms(self.latency + other[0], self.bandwidth + other[1], self.reduction + other[2])

    def scale(self, k: float) -> "Terms":
        return Terms(self.latency * k, self.bandwidth * k, self.reduction * k)


def _t(messages: float, bytes_: float, reduced: float, a: float, b: float, g: float) -> Terms:
    """Terms from critical-path counts: messages, bytes moved, bytes reduced."""
    return Terms(messages * a, bytes_ * b, reduced * g)


def log2_floor(p: int) -> int:
    return p.bit_length() - 1


def is_pow2(p: int) -> bool:
    return p & (p - 1) == 0


# ---------------------------------------------------------------- pipeline segments

def pipeline_segments(p: int, nbytes: float, a: float = 0.0, b: float = 0.0,
                      itemsize: int = 4) -> int:
    """How many segments the pipelined (chained) broadcast cuts ``nbytes`` into: the
    algorithm's own rule, so the closed form prices the schedule the runtime runs."""
    return max(int(_pipeline_segments(p, int(nbytes) // itemsize, itemsize)), 1)


# ------------------------------------------------------------------- closed forms
# Each: f(p, n, a, b, g, **kw) -> Terms; n in bytes per the size convention above.

_FORMS: dict[tuple[str, str], Callable[..., Terms]] = {}


def _form(collective: str, *algorithms: str):
    def deco(fn):
        for alg in algorithms:
            _FORMS[(collective, alg)] = fn
        return fn
    return deco


# all_reduce -----------------------------------------------------------------------

@_form("all_reduce", "naive_ring")
def _ar_naive_ring(p, n, a, b, g, **kw):
    """Running sum walks the ring (p-1 hops of n, each reduced), total walks back (p-1)."""
    return _t(2 * (p - 1), 2 * (p - 1) * n, (p - 1) * n, a, b, g)


@_form("all_reduce", "direct")
def _ar_direct(p, n, a, b, g, **kw):
    """Everyone sends its whole vector to everyone: p-1 messages queue on each port."""
    return _t(p - 1, (p - 1) * n, (p - 1) * n, a, b, g)


@_form("all_reduce", "ring", "gloo_ring")
def _ar_ring(p, n, a, b, g, **kw):
    """Patarasuk-Yuan: reduce-scatter + all-gather on a ring, 2(p-1) steps of n/p."""
    return _t(2 * (p - 1), 2 * (p - 1) / p * n, (p - 1) / p * n, a, b, g)


@_form("all_reduce", "recursive_doubling")
def _ar_recursive_doubling(p, n, a, b, g, **kw):
    """Thakur et al.: lg p exchanges of the full vector; p not a power of two adds a
    pre-step (extra ranks fold into partners) and a post-step (result sent back)."""
    if p == 1:
        return Terms()
    q = log2_floor(p)
    if is_pow2(p):
        return _t(q, q * n, q * n, a, b, g)
    return _t(q + 2, (q + 2) * n, (q + 1) * n, a, b, g)


def _halving_core(p, n, a, b, g):
    """Recursive halving then doubling among the largest power of two p' <= p:
    (2 lg p' alpha + 2(p'-1)/p' n beta + (p'-1)/p' n gamma, whether p' < p needs fold-ins)."""
    q = log2_floor(p)
    pp = 1 << q
    return _t(2 * q, 2 * (pp - 1) / pp * n, (pp - 1) / pp * n, a, b, g), pp != p


@_form("all_reduce", "rabenseifner")
def _ar_rabenseifner(p, n, a, b, g, **kw):
    """Recursive-halving reduce-scatter + recursive-doubling all-gather:
    2 lg p alpha + 2(p-1)/p n beta + (p-1)/p n gamma; non-powers of two fold the
    p - p' extra ranks in first (alpha + n beta + n gamma) and out last (alpha + n beta)."""
    if p == 1:
        return Terms()
    core, folded = _halving_core(p, n, a, b, g)
    return core + _t(2, 2 * n, n, a, b, g) if folded else core


@_form("all_reduce", "tree")
def _ar_tree(p, n, a, b, g, **kw):
    """Binomial-tree reduce then binomial-tree broadcast of the full vector."""
    L = lg(p)
    return _t(2 * L, 2 * L * n, L * n, a, b, g)


@_form("all_reduce", "hierarchical")
def _ar_hierarchical(p, n, a, b, g, *, hosts=1, intra=None, inter=None, share=None, **kw):
    """Two levels: ring reduce-scatter inside each host (L ranks), all-reduce of each
    n/L shard across the H hosts (all L ranks of a host share its NIC), ring all-gather
    inside each host. ``intra``/``inter`` are (alpha, beta) pairs, default (a, b).
    A large buffer runs in c pieces started 2(H-1) rounds apart (see
    ``algorithms.all_reduce.hierarchical_pieces``); a rank's messages of one round queue
    behind each other (one port, as the simulator has it), so a round costs the sum of
    the steps its pieces take in it: the same bytes, and the extra rounds' latency. (On a
    link slower than the ranks the runtime overlaps the pieces; this model does not.)"""
    from ..algorithms.all_reduce import hierarchical_pieces
    H = int(hosts)
    if not 1 <= H <= p:
        raise ValueError(f"hierarchical needs 1 <= hosts <= p, got hosts={hosts} for p={p}")
    L = -(-p // H)  # hosts of unequal size are priced as if all had the largest's ranks
    ai, bi = intra if intra is not None else (a, b)
    ae, be = inter if inter is not None else (a, b)
    k = L if share is None else share
    c = hierarchical_pieces(int(n), H, L)
    if c == 1:
        local = _t(2 * (L - 1), 2 * (L - 1) / L * n, (L - 1) / L * n, ai, bi, g)
        shard = n / L
        cross = _ar_ring(H, shard, ae, be * k, g) if H > 1 else Terms()
        return local + cross
    piece = n / c
    # one piece's steps in order: L-1 reduce steps inside, 2(H-1) across, L-1 copy steps inside
    steps = ([_t(1, piece / L, piece / L, ai, bi, g)] * (L - 1)
             + [_t(1, piece / L / H, piece / L / H, ae, be * k, g)] * (H - 1)
             + [_t(1, piece / L / H, 0, ae, be * k, g)] * (H - 1)
             + [_t(1, piece / L, 0, ai, bi, g)] * (L - 1))
    stagger = 2 * (H - 1)
    total = Terms()
    for r in range((c - 1) * stagger + len(steps)):
        active = [steps[r - j * stagger] for j in range(c) if 0 <= r - j * stagger < len(steps)]
        total = total + sum(active, Terms())
    return total


def _two_levels(p, hosts, intra, inter, share, a, b):
    """(H hosts, L ranks per host, intra (alpha, beta), inter (alpha, beta), k ranks
    sharing a host's NIC) for the hierarchical forms; hosts of unequal size are priced as
    if all had the largest's ranks."""
    H = int(hosts)
    if not 1 <= H <= p:
        raise ValueError(f"hierarchical needs 1 <= hosts <= p, got hosts={hosts} for p={p}")
    L = -(-p // H)
    return (H, L, intra if intra is not None else (a, b), inter if inter is not None else (a, b),
            L if share is None else share)


# broadcast --------------------------------------------------------------------------

@_form("broadcast", "direct")
def _bc_direct(p, n, a, b, g, **kw):
    return _t(p - 1, (p - 1) * n, 0, a, b, g)


@_form("broadcast", "binomial", "dissemination")   # dissemination: the same tree, barrier-borne
def _bc_binomial(p, n, a, b, g, **kw):
    L = lg(p)
    return _t(L, L * n, 0, a, b, g)


@_form("broadcast", "pipeline")
def _bc_pipeline(p, n, a, b, g, *, segments=None, itemsize=4, **kw):
    """A chain cut into s segments: (p + s - 2)(alpha + n/s beta)."""
    if p == 1:
        return Terms()
    s = segments or pipeline_segments(p, n, a, b, itemsize)
    steps = p + s - 2
    return _t(steps, steps * n / s, 0, a, b, g)


@_form("broadcast", "scatter_allgather")
def _bc_scatter_allgather(p, n, a, b, g, **kw):
    """van de Geijn: binomial scatter (lg p alpha + (p-1)/p n beta) then ring all-gather
    ((p-1) alpha + (p-1)/p n beta)."""
    if p == 1:
        return Terms()
    L = lg(p)
    return _t(L + p - 1, 2 * (p - 1) / p * n, 0, a, b, g)


@_form("broadcast", "hierarchical")
def _bc_hierarchical(p, n, a, b, g, *, hosts=1, intra=None, inter=None, share=None, itemsize=4,
                     **kw):
    """A pipelined chain of one leader per host across the H hosts (one rank per host
    sends across: no NIC sharing), then a pipelined chain inside each host of L ranks."""
    H, L, (ai, bi), (ae, be), _ = _two_levels(p, hosts, intra, inter, share, a, b)
    return (_bc_pipeline(H, n, ae, be, g, itemsize=itemsize)
            + _bc_pipeline(L, n, ai, bi, g, itemsize=itemsize))


# reduce -------------------------------------------------------------------------------

@_form("reduce", "direct")
def _rd_direct(p, n, a, b, g, **kw):
    return _t(p - 1, (p - 1) * n, (p - 1) * n, a, b, g)


@_form("reduce", "binomial", "dissemination")
def _rd_binomial(p, n, a, b, g, **kw):
    L = lg(p)
    return _t(L, L * n, L * n, a, b, g)


@_form("reduce", "rabenseifner")
def _rd_rabenseifner(p, n, a, b, g, **kw):
    """Recursive-halving reduce-scatter then binomial gather to the root:
    2 lg p alpha + 2(p-1)/p n beta + (p-1)/p n gamma (+ fold-in step for p != 2^k)."""
    if p == 1:
        return Terms()
    core, folded = _halving_core(p, n, a, b, g)
    return core + _t(1, n, n, a, b, g) if folded else core


@_form("reduce", "gloo_ring")
def _rd_gloo_ring(p, n, a, b, g, itemsize=4, **kw):
    """Ring reduce-scatter on Gloo's blocks (p-1 steps of the largest, B: n/p when they
    are even), then the other blocks into the root (n - B: the root, rank 0, ends the
    largest)."""
    _, size = gloo_reduce_blocks(p, int(round(n / itemsize)), itemsize)
    B = float(size.max()) * itemsize
    return _t(2 * (p - 1), (p - 1) * B + n - float(size[0]) * itemsize, (p - 1) * B, a, b, g)


# all_gather (n = total gathered bytes) ------------------------------------------------

@_form("all_gather", "hierarchical")
def _ag_hierarchical(p, n, a, b, g, *, hosts=1, intra=None, inter=None, share=None, **kw):
    """Column rings across the H hosts ((H-1) steps of one block n/p per rank, the k ranks
    of a host that send across at once sharing its NIC), then rings of columns (H blocks)
    inside each host of L ranks."""
    H, L, (ai, bi), (ae, be), k = _two_levels(p, hosts, intra, inter, share, a, b)
    blk = n / p
    return _t(H - 1, (H - 1) * blk * k, 0, ae, be, g) + _t(L - 1, (L - 1) * H * blk, 0, ai, bi, g)

@_form("all_gather", "ring")
def _ag_ring(p, n, a, b, g, **kw):
    return _t(p - 1, (p - 1) / p * n, 0, a, b, g)


def _fold_blocks(p: int) -> tuple[int, int, int]:
    """For the non-power-of-two fold with p2 = 2^floor(lg p) core ranks and rem = p - p2
    extras folded into the lowest ones: (q, rem, blocks on the critical path of the
    butterfly among the core ranks), the latter sum over d = 1, 2, .., p2/2 of the largest
    exchange, d + min(d, rem) blocks (the lowest core ranks carry their extras' blocks)."""
    q = log2_floor(p)
    pp = 1 << q
    rem = p - pp
    blocks, d = 0, 1
    while d < pp:
        blocks += d + min(d, rem)
        d *= 2
    return q, rem, blocks


@_form("all_gather", "recursive_doubling")
def _ag_recursive_doubling(p, n, a, b, g, **kw):
    """Recursive doubling: lg p steps doubling the block each time, lg p alpha +
    (p-1)/p n beta. Otherwise the extra ranks hand their block to a partner first
    (alpha + n/p beta), the core exchanges carry the extras' blocks too, and the partners
    send the whole result back (alpha + n beta)."""
    if p == 1:
        return Terms()
    q, rem, blocks = _fold_blocks(p)
    blk = n / p
    if rem == 0:
        return _t(q, blocks * blk, 0, a, b, g)
    return _t(q + 2, (1 + blocks) * blk + n, 0, a, b, g)


@_form("all_gather", "bruck")
def _ag_bruck(p, n, a, b, g, **kw):
    """Bruck: ceil(lg p) steps, step k sends min(2^k, p - 2^k) blocks."""
    return _t(lg(p), (p - 1) / p * n, 0, a, b, g)


@_form("all_gather", "direct")
def _ag_direct(p, n, a, b, g, **kw):
    return _t(p - 1, (p - 1) / p * n, 0, a, b, g)


# reduce_scatter (n = total input bytes per rank) ------------------------------------------

@_form("reduce_scatter", "ring")
def _rs_ring(p, n, a, b, g, **kw):
    return _t(p - 1, (p - 1) / p * n, (p - 1) / p * n, a, b, g)


@_form("reduce_scatter", "hierarchical")
def _rs_hierarchical(p, n, a, b, g, *, hosts=1, intra=None, inter=None, share=None, **kw):
    """The mirror of the hierarchical all_gather: rings of columns (H blocks) inside each
    host of L ranks, then column rings across the H hosts, every step reduced."""
    H, L, (ai, bi), (ae, be), k = _two_levels(p, hosts, intra, inter, share, a, b)
    blk = n / p
    return (_t(L - 1, (L - 1) * H * blk, (L - 1) * H * blk, ai, bi, g)
            + _t(H - 1, (H - 1) * blk * k, (H - 1) * blk, ae, be, g))


@_form("reduce_scatter", "recursive_halving")
def _rs_recursive_halving(p, n, a, b, g, **kw):
    """lg p steps halving the vector: lg p alpha + (p-1)/p n (beta + gamma). Otherwise the
    extra ranks fold their whole input into a partner first (alpha + n (beta + gamma)),
    the halving steps carry the extras' blocks too, and the partners hand each extra its
    block at the end (alpha + n/p beta)."""
    if p == 1:
        return Terms()
    q, rem, blocks = _fold_blocks(p)
    blk = n / p
    if rem == 0:
        return _t(q, blocks * blk, blocks * blk, a, b, g)
    return _t(q + 2, n + (blocks + 1) * blk, n + blocks * blk, a, b, g)


@_form("reduce_scatter", "direct")
def _rs_direct(p, n, a, b, g, **kw):
    return _t(p - 1, (p - 1) / p * n, (p - 1) / p * n, a, b, g)


# all_to_all (n = one rank's send buffer, p blocks) ------------------------------------------

@_form("all_to_all", "pairwise")
@_form("all_to_all_single", "pairwise")
@_form("all_to_all", "direct")
@_form("all_to_all_single", "direct")
def _a2a_pairwise_or_direct(p, n, a, b, g, **kw):
    """Both send p-1 blocks of n/p: they differ in order (pairwise avoids hot spots), not cost."""
    return _t(p - 1, (p - 1) / p * n, 0, a, b, g)


def bruck_blocks(p: int) -> int:
    """Blocks an all-to-all Bruck moves per rank: step k sends the blocks whose index has
    bit k set (sum over k of #{0 <= i < p: i & 2^k})."""
    total = 0
    for k in range(lg(p)):
        bit = 1 << k
        total += sum(1 for i in range(p) if i & bit)
    return total


@_form("all_to_all", "bruck")
@_form("all_to_all_single", "bruck")
def _a2a_bruck(p, n, a, b, g, **kw):
    """Bruck: ceil(lg p) alpha + (n/p) beta * sum_k #{i: bit k of i set} (~ n/2 lg p)."""
    return _t(lg(p), bruck_blocks(p) * n / p, 0, a, b, g)


# gather / scatter (n = total bytes at the root) ---------------------------------------------

@_form("gather", "direct")
@_form("scatter", "direct")
def _gs_direct(p, n, a, b, g, **kw):
    return _t(p - 1, (p - 1) / p * n, 0, a, b, g)


@_form("gather", "binomial", "dissemination")
@_form("scatter", "binomial", "dissemination")
def _gs_binomial(p, n, a, b, g, **kw):
    return _t(lg(p), (p - 1) / p * n, 0, a, b, g)


# barrier ------------------------------------------------------------------------------------

@_form("barrier", "dissemination")
def _barrier(p, n, a, b, g, **kw):
    return _t(lg(p), 0, 0, a, b, g)


# ----------------------------------------------------------------------------- predict


def _check_size(nbytes, p):
    if isinstance(p, bool):
        raise TypeError(f"p must be an integer, got {p!r}")
    try:
        p = operator.index(p)
    except TypeError:
        raise TypeError(f"p must be an integer, got {p!r}") from None
    if p < 1:
        raise ValueError(f"p (group size) must be >= 1, got {p}")
    try:
        n = float(nbytes)
    except (TypeError, ValueError):
        raise TypeError(f"nbytes must be a number of bytes, got {nbytes!r}") from None
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"nbytes must be a finite size >= 0, got {nbytes!r}")
    return n, p


def _check_gamma(gamma):
    g = float(gamma)
    if not math.isfinite(g) or g < 0:
        raise ValueError(f"gamma (seconds per reduced byte) must be >= 0, got {gamma!r}")
    return g


def closed_form(collective: str, nbytes: float, p: int, algorithm: str | None, link: Link | str,
                gamma: float | None = 0.0, *, hosts: int | None = None,
                intra: Link | str | None = None, inter: Link | str | None = None,
                share: int | None = None, segments: int | None = None,
                itemsize: int = 4) -> Terms:
    """The closed-form time of one collective call on ``link`` (a :class:`Link` or a tier
    name), split into latency, bandwidth and reduction terms. ``ringlet.cost.breakdown``
    is the public entry (it also prices on a topology or this host's calibrated profile);
    see it for the arguments. A rooted call's ranks first agree on it in a barrier's
    rounds (``algorithms.agree_alongside``), priced off the schedule itself
    (``simulate.agreement_terms``, registered here as the simulator loads, as it registers
    the double tree's form) - without the simulator, by their bound: the barrier but the
    round that carries the data, (lg p - 1) * alpha."""
    check_collective(collective)
    alg = DEFAULT_ALGORITHM[collective] if algorithm is None else algorithm
    check_algorithm(collective, alg)
    n, p = _check_size(nbytes, p)
    link = tier(link)
    g = _check_gamma(0.0 if gamma is None else gamma)
    kw = {"itemsize": itemsize}
    if segments is not None:
        kw["segments"] = int(segments)
    if alg == "hierarchical":
        H = check_hosts(hosts, p)
        li = tier(intra) if intra is not None else link
        le = tier(inter) if inter is not None else link
        kw.update(hosts=H, intra=(li.alpha, li.beta), inter=(le.alpha, le.beta), share=share)
    if p == 1 and alg != "hierarchical":
        return Terms()
    terms = _FORMS[(collective, alg)](p, n, link.alpha, link.beta, g, **kw)
    if collective in ROOTED and (collective, alg) not in SELF_AGREEING and p > 1:
        li = le = link
        if alg == "hierarchical":
            li, le = tier(intra or link), tier(inter or link)
        if AGREEMENT is not None:
            terms += AGREEMENT(collective, alg, p, n, li, le, g, itemsize, hosts)
        else:
            terms += agreement_bound(collective, alg, p, n, li, le, hosts)
    return terms


def check_hosts(hosts, p: int) -> int:
    """The number of hosts ``p`` ranks are split evenly over (None: one)."""
    H = 1 if hosts is None else hosts
    if isinstance(H, bool) or int(H) != H or H < 1 or p % int(H):
        raise ValueError(f"hosts must be a whole number of hosts >= 1 that divides the "
                         f"group's {p} ranks (they are split evenly), got {hosts!r}")
    return int(H)


def agreement_bound(collective, alg, p, n, intra, inter, hosts) -> Terms:
    """A rooted call's agreement at most: the barrier but the round carrying the data,
    (lg p - 1) * alpha (between hosts, where the algorithm spans several)."""
    a = inter.alpha if alg == "hierarchical" and (hosts or 1) > 1 else intra.alpha
    return Terms((lg(p) - 1) * a, 0, 0)


#: what prices a rooted call's agreement (set by ringlet.cost.simulate: agreement_terms)
AGREEMENT = None


# ------------------------------------------------------------------------------ sizes

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_UNITS = {"": 1, "b": 1,
          "k": 1024, "kib": 1024, "ki": 1024, "m": 1024 ** 2, "mib": 1024 ** 2, "mi": 1024 ** 2,
          "g": 1024 ** 3, "gib": 1024 ** 3, "gi": 1024 ** 3, "t": 1024 ** 4, "tib": 1024 ** 4,
          "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4}


def parse_size(text) -> int:
    """Bytes from ``"64M"``, ``"256MiB"``, ``"4k"``, ``"1.5G"``, ``"1e6"`` or an int.
    K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024 (as in nccl-tests' -b/-e);
    KB/MB/GB/TB are powers of 1000."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
        unit = ""
    else:
        m = _SIZE_RE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read size {text!r}; use e.g. 4096, 64K, 64M, 256MiB, 1GB")
        value, unit = float(m.group(1)), m.group(2).lower()
    n = value * _UNITS[unit]
    if n < 0 or not math.isfinite(n):
        raise ValueError(f"size must be >= 0, got {text!r}")
    return int(round(n))


def format_size(n: float) -> str:
    """``67108864`` -> ``"64 MiB"``, ``1536`` -> ``"1.5 KiB"``."""
    n = float(n)
    for unit, k in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= k:
            v = n / k
            return f"{v:.0f} {unit}" if v == int(v) else f"{_digits(v)} {unit}"
    return f"{n:.0f} B"


def format_time(t: float) -> str:
    """Seconds for people: ``1.5e-05`` -> ``"15 us"``, ``0.0123`` -> ``"12.3 ms"``."""
    for unit, k in (("us", 1e6), ("ms", 1e3)):
        if float(f"{t * k:.3g}") < 1000:     # (999.7 us reads "1 ms", not "1e+03 us")
            return f"{_digits(t * k)} {unit}"
    return f"{_digits(t)} s"


def _digits(v: float) -> str:
    """Three significant digits, without an exponent (1020, not 1.02e+03)."""
    return f"{v:.3g}" if v < 1000 else f"{v:.0f}"


__all__ = ["Link", "TIERS", "tier", "Terms", "ALGORITHMS", "COLLECTIVES", "DEFAULT_ALGORITHM",
           "TOTAL_SIZE", "closed_form", "nbytes_of", "count_of", "parse_size",
           "format_size", "format_time", "pipeline_segments", "bruck_blocks"]
