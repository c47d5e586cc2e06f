"""Mixture-of-experts routing by all-to-all ("tokens assigned to expert E on rank
R must be physically shipped to rank R before the expert forward pass. One all-to-all
sends them there; a second brings results back").

    expert_tokens, routing = dispatch(x, expert_index, num_experts, capacity_factor=1.25)
    outs = [expert[e](t) for e, t in enumerate(expert_tokens)]   # this rank's experts
    y = combine(outs, routing)                                   # x's order; dropped: zeros

Experts are spread evenly: with E experts on p ranks, rank r holds experts
[r E/p, (r+1) E/p). ``expert_index`` is (T,) for top-1 gating or (T, k) for top-k.
Each expert takes at most ``capacity = ceil(capacity_factor * T * k / E)`` of a rank's
tokens (GShard's capacity, per sending rank); later ones are dropped and counted, first
choices before second ones. Messages are uneven (``all_to_all_single`` with splits); a
small all_to_all of per-expert counts goes first so every rank knows what it receives.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np

from .. import buffers
from ..collectives import all_to_all, all_to_all_single
from ..errors import CollectiveMismatch
from ..runtime import get_rank, resolve
from .arrays import as_numbers
from .pricing import Call, price


@dataclass
class Routing:
    """Where a rank's tokens went, for :func:`combine`. ``dropped``: this rank's (token,
    choice) pairs beyond their expert's capacity; ``send_splits`` / ``recv_splits``: rows
    to and from each rank; ``sent_bytes``: token bytes this rank sent to other ranks."""
    group: object
    shape: tuple               # (T, k, *row shape)
    order: np.ndarray          # kept (token * k + choice), in sending order
    send_splits: list
    recv_splits: list
    recv_counts: np.ndarray    # (p, experts per rank): rows from each rank for each local expert
    by_expert: np.ndarray      # received rows (sender-major) -> expert-major order
    dropped: int
    sent_bytes: int
    tokens: np.ndarray | None  # the input, for drop="pass"


def _indices(a) -> np.ndarray:
    """An index array (NumPy, or torch: any layout, it is only read)."""
    if not isinstance(a, np.ndarray) and type(a).__module__.startswith("torch"):
        a = a.detach().cpu().numpy()
    return np.asarray(a)


def capacity(tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    return math.ceil(capacity_factor * tokens * k / num_experts)


def dispatch(tokens, expert_index, num_experts: int, capacity_factor: float = 1.25,
             group=None, drop: str = "zero"):
    """Send each token (row of ``tokens``) to the rank holding its expert(s). Returns
    (a list with this rank's tokens for each of its experts, the :class:`Routing` that
    :func:`combine` needs). ``drop``: "zero" (a token dropped for capacity comes back as
    zeros) or "pass" (as itself)."""
    g = resolve(group)
    x = as_numbers(tokens, "tokens")
    idx = _indices(expert_index)
    if drop not in ("zero", "pass"):
        raise ValueError(f"drop must be 'zero' or 'pass', got {drop!r}")
    if x.ndim < 1:
        raise ValueError("tokens must have one row per token")
    T = x.shape[0]
    idx2 = None
    if idx.ndim in (1, 2) and idx.shape[:1] == (T,):
        idx2 = idx[:, None] if idx.ndim == 1 else idx
    if idx2 is None or idx.dtype.kind not in "iu":
        raise ValueError(f"rank {get_rank()}: dispatch: expert_index must be integers of shape "
                         f"({T},) or ({T}, k), got {idx.dtype} {idx.shape}")
    p = g.size
    if num_experts < 1 or num_experts % p:
        raise ValueError(f"dispatch: num_experts ({num_experts}) must be a positive multiple "
                         f"of the group size ({p})")
    if idx2.size and (idx2.min() < 0 or idx2.max() >= num_experts):
        raise ValueError(f"rank {get_rank()}: dispatch: expert_index outside 0..{num_experts - 1}")
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    idx2 = idx2.astype(np.int64, copy=False)    # (queue places in an int8's would wrap)
    k = idx2.shape[1]
    per = num_experts // p
    cap = capacity(T, k, num_experts, capacity_factor)
    # Choice-major priority (all first choices, then second ones), then token order.
    flat_e = idx2.T.reshape(-1)                         # position j: choice j // T, token j % T
    slot = np.empty_like(flat_e)
    order_e = np.argsort(flat_e, kind="stable")
    starts = np.searchsorted(flat_e[order_e], np.arange(num_experts))
    slot[order_e] = np.arange(flat_e.size) - starts[flat_e[order_e]]   # place in its expert's queue
    keep = slot < cap
    pairs = (np.arange(flat_e.size) % T) * k + np.arange(flat_e.size) // T   # token * k + choice
    kept = order_e[keep[order_e]]                         # kept positions, by expert then priority
    order = pairs[kept]
    counts = np.bincount(flat_e[kept], minlength=num_experts).astype(np.int64)
    recv_counts = np.empty((p, per), np.int64)
    with _same_on_every_rank("dispatch", "num_experts"):
        all_to_all(recv_counts, counts.reshape(p, per), group=g)
    send_splits = counts.reshape(p, per).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    rows = x.reshape(T, int(np.prod(x.shape[1:], dtype=np.int64)))
    # The packed rows go out of shared memory, so local peers read them in place.
    lent = buffers.lend(len(order) * rows.shape[1] * rows.dtype.itemsize)
    send = np.take(rows, order // k, axis=0,
                   out=buffers.lent_view(lent, (len(order), rows.shape[1]), rows.dtype))
    recv = np.empty((sum(recv_splits), rows.shape[1]), x.dtype)
    try:
        with _same_on_every_rank("dispatch", "the tokens' row shape and dtype"):
            all_to_all_single(recv, send, recv_splits, send_splits, group=g)
    finally:
        buffers.give_back(lent)
    # Received rows come by sender, then expert; each expert wants its rows together.
    sender_major = np.repeat(np.arange(p * per), recv_counts.reshape(-1))
    by_expert = np.argsort(sender_major % per, kind="stable")
    grouped = recv[by_expert]
    per_expert = recv_counts.sum(0)
    bounds = np.concatenate([[0], np.cumsum(per_expert)])
    row_shape = x.shape[1:]
    expert_tokens = [grouped[bounds[e]:bounds[e + 1]].reshape((-1,) + row_shape) for e in range(per)]
    sent = (len(order) - send_splits[g.rank]) * rows.shape[1] * x.dtype.itemsize
    routing = Routing(g, (T, k) + row_shape, order, send_splits, recv_splits, recv_counts,
                      by_expert, int(flat_e.size - kept.size), sent,
                      x if drop == "pass" else None)
    return expert_tokens, routing


@contextlib.contextmanager
def _same_on_every_rank(call: str, what: str):
    """A mismatch of the collectives inside ``call`` names what the user passed that
    differs (their own error speaks of counts and splits the user never saw)."""
    try:
        yield
    except CollectiveMismatch as exc:
        raise CollectiveMismatch(f"{call}: the ranks disagree on {what}: pass the same on "
                                 f"every rank ({exc})") from exc


def combine(expert_outputs, routing: Routing, weights=None):
    """Bring the experts' outputs back to the ranks and order their tokens came from.
    Returns (T, *row) for top-1, (T, k, *row) for top-k, or with ``weights`` (T, k) the
    weighted sum over the k choices, (T, *row). Dropped choices are zeros (or the token
    itself with ``drop="pass"``)."""
    g, (T, k), row_shape = routing.group, routing.shape[:2], routing.shape[2:]
    outs = [as_numbers(o, f"expert_outputs[{e}]") for e, o in enumerate(expert_outputs)]
    per = routing.recv_counts.shape[1]
    if len(outs) != per:
        raise ValueError(f"combine: {len(outs)} expert outputs for this rank's {per} experts")
    for e, o in enumerate(outs):
        want = int(routing.recv_counts[:, e].sum())
        if o.shape[:1] != (want,) or o.shape[1:] != row_shape:
            raise ValueError(f"rank {get_rank()}: combine: expert {e}'s output has shape {o.shape}, "
                             f"expected {(want,) + row_shape} (one row per token it received)")
    row = int(np.prod(row_shape, dtype=np.int64))
    dtype = outs[0].dtype if outs else np.dtype(np.float32)
    grouped = np.concatenate([o.reshape(-1, row) for o in outs]) if outs else np.empty((0, row), dtype)
    lent = buffers.lend(grouped.nbytes)                  # (local peers read it in place)
    back = buffers.lent_view(lent, grouped.shape, dtype)
    back[routing.by_expert] = grouped                    # sender-major again
    got = np.empty((len(routing.order), row), dtype)
    try:
        with _same_on_every_rank("combine", "the outputs' row shape and dtype"):
            all_to_all_single(got, back, routing.send_splits, routing.recv_splits, group=g)
    finally:
        buffers.give_back(lent)
    y = np.zeros((T * k, row), dtype)
    if routing.tokens is not None:
        y[:] = np.repeat(routing.tokens.reshape(T, row), k, axis=0)
    y[routing.order] = got
    y = y.reshape((T, k) + row_shape)
    if weights is not None:
        w = np.asarray(as_numbers(weights, "weights")).reshape(T, k, *([1] * len(row_shape)))
        return (w * y).sum(1)
    return y[:, 0] if k == 1 else y


def price_moe(tokens: int, row_elements: int, k: int, num_experts: int, p: int,
              capacity_factor: float = 1.25, itemsize: int = 4, topology=None, hosts=None):
    """One MoE layer's routing per forward step on ``topology``: the all_to_all of per-expert
    counts, then the tokens out (dispatch) and back (combine), priced at the capacity's
    worst case (out: every row a rank may send goes to another rank's experts, up to its
    tokens x k; back: its experts' queues full of the other ranks' rows; each spread evenly
    over the other ranks, both at the larger); each exchange
    first all_gathers its table of splits. The tokens a rank sends are about constant in
    p (the job's all-to-all volume, p times them, is the textbook's "O(batch * P)"); the
    tables grow as p^2 (2p^2 counts of 8 bytes, gathered twice a step), and they are most
    of a rank's bytes when its tokens are few (examples/train_moe.py: 41 KB at p = 4,
    280 KB at p = 64)."""
    return price(calls_moe(tokens, row_elements, k, num_experts, p, capacity_factor, itemsize),
                 topology, hosts)


def calls_moe(tokens: int, row_elements: int, k: int, num_experts: int, p: int,
              capacity_factor: float = 1.25, itemsize: int = 4) -> list:
    """The calls of :func:`price_moe`: the counts' all_to_all, each uneven exchange's table
    of splits (an all_gather, so every rank checks them before data moves) and its tokens."""
    # The most rows a rank sends away in either exchange: out, all its choices where the
    # other ranks' experts have room for them; back (combine), its experts' queues full of
    # the other ranks' rows - each sender's capacity per expert. Both priced at the larger,
    # as an even all_to_all_single, whose 1/p stays home, of p/(p-1) times those bytes
    # (the worst case had been priced at the rank's own rows spread over every rank:
    # 12,288 B sent against 15,360 measured, examples' p = 4).
    cap = capacity(tokens, k, num_experts, capacity_factor)
    mine = num_experts // p if num_experts % p == 0 else 0
    out = min(tokens * k, (num_experts - mine) * cap)
    back = (p - 1) * mine * cap
    rows = max(out, back)
    nb = rows * row_elements * itemsize * p // (p - 1) if p > 1 else 0
    return [Call("all_to_all", num_experts * 8, p, 8, 1, "expert counts"),
            Call("all_gather", p * 2 * p * 8, p, 8, 2, "split tables"),
            Call("all_to_all_single", nb, p, itemsize, 2, "tokens out and back")]
