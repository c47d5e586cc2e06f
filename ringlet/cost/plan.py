"""The planner: is a data-parallel step communication-bound?

    T_comp = fppe * P * b / R                  (fppe = 6 FLOPs per parameter per example)
    T_comm = 2(K-1)/K * g*P / B  [+ 2(K-1) alpha]   (ring all-reduce of the gradient)
    gamma  = T_comm / T_comp

P parameters, b local batch, R sustained FLOP/s, B bytes/s per worker, K workers, g bytes
per parameter, alpha seconds per message (an optional latency floor).

Break-even. Strong scaling holds the global batch G fixed, b = G/K, so

    gamma(K) = 2(K-1)/K * g R / (fppe (G/K) B) = 2 (K-1) g R / (fppe G B)

and gamma = 1 at  K* = 1 + fppe G B / (2 g R).  P cancels: both T_comm and T_comp are
proportional to it. With the textbook's worked example (G=2048, g=2, R=312e12, B=600e9) K* = 6.91,
between the K=4 and K=16 rows of its table (the printed table floors b = G // K and
goes comm-bound from K = 7 on). With a latency term the equation is the quadratic
alpha K^2 + (c - alpha) K - c - fppe P G / (2R) = 0 with c = gP/B (then P matters).
Weak scaling holds b fixed: gamma(K) = 2(K-1)/K * c1 (+ 2(K-1) c2) with c1 = gR/(fppe b B),
c2 = alpha R/(fppe P b); without latency it is comm-bound for large K only if c1 > 1/2,
at K* = 2 c1 / (2 c1 - 1).
"""
from __future__ import annotations

import math
from typing import NamedTuple

# the textbook's worked example: a 7B-parameter model on A100-class workers
SEED = dict(P=7e9, G=2048, R=312e12, B=600e9, g=2.0, fppe=6.0,
            workers=(1, 4, 16, 64, 256, 1024))
# the textbook's model-size table
SEED_MODELS = dict(params=(1e8, 7e8, 7e9, 7e10), K=64, b=32)


class StepRatio(NamedTuple):
    K: int
    b: float
    P: float
    t_comp: float
    t_comm: float       # bandwidth + latency
    t_latency: float    # the 2(K-1) alpha part of t_comm
    gamma: float

    @property
    def comm_bound(self) -> bool:
        return self.t_comm > self.t_comp


def _positive(name, v, allow_zero=False):
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {v!r}") from None
    if not math.isfinite(f) or f < 0 or (f == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")
    return f


def step_ratio(P, b, R, B, K, g=2, alpha=0.0, fppe=6) -> StepRatio:
    """T_comp = fppe*P*b/R, T_comm = 2(K-1)/K*g*P/B + 2(K-1)*alpha, gamma = T_comm/T_comp."""
    P = _positive("P (parameters)", P)
    b = _positive("b (local batch)", b)
    R = _positive("R (FLOP/s)", R)
    B = _positive("B (bytes/s)", B)
    g = _positive("g (bytes per parameter)", g)
    alpha = _positive("alpha", alpha, allow_zero=True)
    fppe = _positive("fppe", fppe)
    if isinstance(K, bool) or int(K) != K or K < 1:
        raise ValueError(f"K (workers) must be an integer >= 1, got {K!r}")
    K = int(K)
    t_comp = fppe * P * b / R
    t_lat = 2.0 * (K - 1) * alpha
    t_comm = 2.0 * (K - 1) / K * (P * g) / B + t_lat
    return StepRatio(K, b, P, t_comp, t_comm, t_lat, t_comm / t_comp)


def strong_scaling(P, G, R, B, workers, g=2, alpha=0.0, fppe=6) -> list[StepRatio]:
    """Fixed global batch G split over K workers: b = max(G // K, 1) (as the textbook's example)."""
    G = int(G)
    if G < 1:
        raise ValueError(f"global batch must be >= 1, got {G}")
    return [step_ratio(P, max(G // int(K), 1), R, B, K, g, alpha, fppe) for K in workers]


def weak_scaling(P, b, R, B, workers, g=2, alpha=0.0, fppe=6) -> list[StepRatio]:
    """Fixed local batch b; the global batch grows as b*K."""
    return [step_ratio(P, b, R, B, K, g, alpha, fppe) for K in workers]


def break_even(R, B, *, G=None, b=None, g=2, alpha=0.0, P=None, fppe=6) -> float:
    """The (real) worker count K where gamma = 1; ``math.inf`` if never reached.

    Give ``G`` for strong scaling (b = G/K) or ``b`` for weak scaling. ``P`` is needed only
    with ``alpha`` > 0. Closed forms in the module docstring."""
    if (G is None) == (b is None):
        raise ValueError("give exactly one of G (strong scaling) or b (weak scaling)")
    R, B, g = _positive("R", R), _positive("B", B), _positive("g", g)
    fppe = _positive("fppe", fppe)
    alpha = _positive("alpha", alpha, allow_zero=True)
    if alpha > 0 and P is None:
        raise ValueError("the latency term needs the parameter count P")
    if G is not None:
        G = _positive("G", G)
        if alpha == 0:
            return 1.0 + fppe * G * B / (2.0 * g * R)
        P = _positive("P", P)
        c = g * P / B
        return _positive_root(alpha, c - alpha, c + fppe * P * G / (2.0 * R))
    b = _positive("b", b)
    c1 = g * R / (fppe * b * B)
    if alpha == 0:
        return 2 * c1 / (2 * c1 - 1) if c1 > 0.5 else math.inf
    P = _positive("P", P)
    c2 = alpha * R / (fppe * P * b)
    return _positive_root(2 * c2, 2 * c1 - 2 * c2 - 1, 2 * c1)


def _positive_root(a2, a1, c):
    """The positive root of a2 K^2 + a1 K - c = 0 (a2, c > 0), without cancellation."""
    disc = math.sqrt(a1 * a1 + 4 * a2 * c)
    return 2 * c / (a1 + disc) if a1 >= 0 else (-a1 + disc) / (2 * a2)


def first_comm_bound(rows) -> int | None:
    for r in rows:
        if r.comm_bound:
            return r.K
    return None


# ------------------------------------------------------------------------- printing

def sci(x: float) -> str:
    """7e9 -> '7e9', 1e8 -> '1e8', 2.5e10 -> '2.5e10', 2048 -> '2048'."""
    x = float(x)
    if x == int(x) and abs(x) < 1e5:
        return str(int(x))
    e = int(math.floor(math.log10(abs(x)))) if x else 0
    m = x / 10 ** e
    ms = f"{m:.6g}"
    return f"{ms}e{e}"


def format_strong(rows, P, G) -> str:
    """The strong-scaling table, character for character as the textbook prints it."""
    return _scaling_table(
        f"Strong scaling: P = {sci(P)} params, global batch = {int(G)} split across K workers",
        "local batch", rows, lambda r: r.b)


def format_weak(rows, P, b) -> str:
    return _scaling_table(
        f"Weak scaling: P = {sci(P)} params, local batch = {int(b)} per worker "
        f"(global batch grows with K)", "global batch", rows, lambda r: r.b * r.K)


def _scaling_table(title, batch_header, rows, batch) -> str:
    lines = [title,
             f"{'K':>6} {batch_header:>12} {'compute (ms)':>13} {'all-reduce (ms)':>16} {'gamma':>9}"]
    for r in rows:
        flag = "  <- comm-bound" if r.t_comm > r.t_comp else ""
        lines.append(f"{r.K:>6d} {int(batch(r)):>12d} {r.t_comp * 1e3:>13.2f} "
                     f"{r.t_comm * 1e3:>16.2f} {r.t_comm / r.t_comp:>9.3f}{flag}")
    return "\n".join(lines)


def format_models(rows, K, b) -> str:
    """The model-size table: growing the model at a fixed cluster shape."""
    lines = [f"Model size at a fixed cluster shape: K = {int(K)} workers, local batch = {int(b)}",
             f"{'parameters P':>12} {'compute (ms)':>13} {'all-reduce (ms)':>16} {'gamma':>9}"]
    for r in rows:
        lines.append(f"{sci(r.P):>12} {r.t_comp * 1e3:>13.2f} {r.t_comm * 1e3:>16.2f} "
                     f"{r.gamma:>9.2f}")
    return "\n".join(lines)


def seed_output() -> str:
    """The textbook's worked example exactly (header and table rows)."""
    s = SEED
    rows = strong_scaling(s["P"], s["G"], s["R"], s["B"], s["workers"], s["g"], 0.0, s["fppe"])
    return format_strong(rows, s["P"], s["G"])


def seed_models() -> list[StepRatio]:
    """The textbook's model-size table's rows."""
    s, t = SEED, SEED_MODELS
    return [step_ratio(P, t["b"], s["R"], s["B"], t["K"], s["g"], 0.0, s["fppe"])
            for P in t["params"]]


__all__ = ["StepRatio", "step_ratio", "strong_scaling", "weak_scaling", "break_even",
           "format_strong", "format_weak", "format_models", "seed_output", "seed_models", "SEED"]
