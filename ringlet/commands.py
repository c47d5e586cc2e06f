"""``ringlet plan``, ``tiers``, ``explain`` and ``place``: ``*_main(argv) -> exit code``.

``ringlet.cli`` dispatches ``ringlet plan|tiers|explain ...`` here with the arguments after
the sub-command. ``--plot FILE.png`` needs matplotlib (``pip install ringlet[plot]``),
imported only then.
"""
from __future__ import annotations

import argparse
import math
import sys

from .plotting import picture_path
from .schedule import USER_BUFFERS
from .cost import plan as _plan
from .cost.model import (ALGORITHMS, COLLECTIVES, TIERS, TOTAL_SIZE, Link, format_size, format_time,
                    parse_size, tier)


class _Exit(Exception):
    pass


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> list[int]:
    vals = _floats(text)
    if any(v != int(v) or v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return [int(v) for v in vals]


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _link_arg(text: str) -> Link:
    """A tier name, ALPHA_US,GBPS (e.g. ``5,12.5``) for a custom link, or a link rate as
    tc writes it (``1gbit``): this host's TCP held to that rate."""
    if text.lower() in TIERS:
        return TIERS[text.lower()]
    if text.lower() in ("shm", "tcp"):
        from .cost.profile import host_link
        return host_link(text.lower())
    if text.lower().endswith("bit"):
        from .cost.profile import load_profile
        try:
            return load_profile().with_link_rate(text).link("inter")
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parts = text.split(",")
    if len(parts) == 2:
        try:
            alpha_us, gbps = float(parts[0]), float(parts[1])
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"a custom link is ALPHA_US,GBPS: microseconds a message, then GB/s (e.g. "
                f"5,12.5); got {text!r}") from None
        if not (alpha_us >= 0 and gbps > 0 and math.isfinite(alpha_us) and math.isfinite(gbps)):
            raise argparse.ArgumentTypeError(
                f"a custom link needs ALPHA_US >= 0 microseconds and GBPS > 0 GB/s; got "
                f"{text!r}")
        return Link(alpha_us * 1e-6, gbps * 1e9, f"custom ({text})")
    raise argparse.ArgumentTypeError(
        f"unknown tier {text!r}; valid tiers: {', '.join(TIERS)}, shm, tcp "
        f"(calibrated), ALPHA_US,GBPS for a custom link, or a rate such as 1gbit")


def _named_link(text: str) -> tuple[str, Link]:
    if "=" not in text:
        raise argparse.ArgumentTypeError("expected NAME=ALPHA_US,GBPS")
    name, spec = text.split("=", 1)
    if not name.strip():      # (a row with no name had been added)
        raise argparse.ArgumentTypeError(f"a custom tier needs a NAME before '=': got {text!r}")
    link = _link_arg(spec)
    return name, link.with_name(name)


def _run(fn, argv):
    try:
        return fn(list(sys.argv[1:] if argv is None else argv))
    except ValueError as exc:
        print(f"ringlet: error: {exc}", file=sys.stderr)
        return 2
    except _Exit as exc:
        print(f"ringlet: error: {exc}", file=sys.stderr)
        return 2


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise _Exit("--plot needs matplotlib: pip install 'ringlet[plot]' (or matplotlib)") from None
    return plt


# ------------------------------------------------------------------------------- plan

def plan_main(argv=None) -> int:
    """``ringlet plan``: T_comp, T_comm and gamma = T_comm/T_comp for data-parallel steps.
    With no arguments it prints a worked example (a 7B model, strong scaling)."""
    return _run(_plan_main, argv)


def _plan_main(argv) -> int:
    s = _plan.SEED
    ap = argparse.ArgumentParser(
        prog="ringlet plan",
        description="Is a data-parallel training step communication-bound? "
                    "T_comp = fppe*P*b/R, T_comm = 2(K-1)/K*g*P/B (+ 2(K-1)*alpha), "
                    "gamma = T_comm/T_comp (the communication-to-computation ratio). With no "
                    "arguments: a worked example, strong scaling of a "
                    "7B-parameter model on A100-class workers (312 TFLOP/s, 600 GB/s) with a "
                    "global batch of 2048.")
    ap.add_argument("--params", "-P", type=_floats, default=None,
                    help="parameter count(s), e.g. 7e9 or 1e8,7e8,7e9 (default 7e9)")
    ap.add_argument("--global-batch", "-G", type=int, default=None,
                    help="strong scaling: fixed global batch split as b = G // K (default 2048)")
    ap.add_argument("--local-batch", "-b", type=int, default=None,
                    help="weak scaling: fixed local batch per worker")
    ap.add_argument("--workers", "-K", type=_ints, default=None,
                    help="worker counts (default 1,4,16,64,256,1024)")
    ap.add_argument("--flops", "-R", type=float, default=s["R"], help="FLOP/s per worker (312e12)")
    ap.add_argument("--bandwidth", "-B", type=float, default=None,
                    help="bytes/s per worker (600e9)")
    ap.add_argument("--tier", type=_link_arg, default=None,
                    help="take B and alpha from a tier (nvlink, pcie, infiniband, ethernet)")
    ap.add_argument("--bytes-per-param", "-g", type=float, default=s["g"], help="gradient bytes "
                    "per parameter (2 = bf16)")
    ap.add_argument("--alpha", type=float, default=None,
                    help="per-message latency in seconds: adds 2(K-1)*alpha to the all-reduce")
    ap.add_argument("--fppe", type=float, default=s["fppe"],
                    help="FLOPs per parameter per example (6 = forward + backward)")
    ap.add_argument("--models", action="store_true",
                    help="grow the model at a fixed cluster shape (default K=64 workers, b=32 examples "
                         "each: a model-size table)")
    ap.add_argument("--plot", metavar="FILE.png", default=None, type=picture_path,
                    help="plot gamma vs K, strong and weak scaling from the same step")
    a = ap.parse_args(argv)

    B = a.bandwidth if a.bandwidth is not None else (a.tier.bandwidth if a.tier else s["B"])
    alpha = a.alpha if a.alpha is not None else (a.tier.alpha if a.tier else 0.0)
    R, g, fppe = a.flops, a.bytes_per_param, a.fppe
    if a.global_batch is not None and a.local_batch is not None:
        raise _Exit("give --global-batch (strong scaling) or --local-batch (weak), not both")
    if a.global_batch is not None and a.workers and max(a.workers) > a.global_batch:
        # (b = G // K would be 0: each worker needs a sample, or the global batch grows)
        raise _Exit(f"a global batch of {a.global_batch} cannot be split over "
                    f"{max(a.workers)} workers: give K <= G, or --local-batch for weak scaling")
    out = []
    plot_series = []
    multi = a.params is not None and len(a.params) > 1
    if a.plot and (a.models or multi):
        raise _Exit("--plot draws gamma against K for one model: give one -P without "
                    "--models (a table of several models has no plot)")
    if a.models or multi:
        params = a.params if a.params else _plan.SEED_MODELS["params"]
        workers = a.workers or [_plan.SEED_MODELS["K"]]
        for K in workers:
            b = (a.local_batch if a.local_batch is not None else
                 max(a.global_batch // K, 1) if a.global_batch is not None else _plan.SEED_MODELS["b"])
            rows = [_plan.step_ratio(P, b, R, B, K, g, alpha, fppe) for P in params]
            out.append(_plan.format_models(rows, K, b))
        out.append("gamma does not depend on P: both phases scale with the model." if not alpha
                   else f"with a latency term (alpha = {alpha * 1e6:g} us) gamma falls as P "
                        "grows: the latency does not scale with the model.")
        out.append(_link_used(a, B, alpha))
        print("\n\n".join(x for x in out if x))
        return 0

    P = a.params[0] if a.params else s["P"]
    workers = a.workers or list(s["workers"])
    if a.local_batch is not None:
        b = a.local_batch
        rows = _plan.weak_scaling(P, b, R, B, workers, g, alpha, fppe)
        out.append(_plan.format_weak(rows, P, b))
        K_star = _plan.break_even(R, B, b=b, g=g, alpha=alpha, P=P, fppe=fppe)
        limit = 2 * g * R / (fppe * b * B)
        lines = [f"as K grows gamma -> 2*g*R/(fppe*b*B) = {limit:.3f}"
                 + (" (plus the latency term, which grows with K)" if alpha else "")]
        if K_star == float("inf"):
            lines.append("break-even (gamma = 1): never - weak scaling stays compute-bound")
        else:
            lines.append(f"break-even (gamma = 1): K* = {K_star:.2f} workers{_bound_from(K_star)}")
        if alpha:
            lines.append(_latency_note(rows, alpha, B, g))
        out.append("\n".join(lines))
        plot_series = ("weak", P, b, K_star)
    else:
        G = a.global_batch if a.global_batch is not None else s["G"]
        rows = _plan.strong_scaling(P, G, R, B, workers, g, alpha, fppe)
        out.append(_plan.format_strong(rows, P, G))
        K_star = _plan.break_even(R, B, G=G, g=g, alpha=alpha, P=P, fppe=fppe)
        below = [r.K for r in rows if not r.comm_bound]
        above = [r.K for r in rows if r.comm_bound]
        where = ""
        if below and above:
            where = f", between the K = {max(below)} and K = {min(above)} rows"
        if alpha:
            formula = "K* solves alpha K^2 + (gP/B - alpha) K - gP/B - fppe*P*G/(2R) = 0"
        else:
            formula = "1 + fppe*G*B/(2*g*R)"
        lines = [f"break-even (gamma = 1): K* = {K_star:.2f} workers{where} "
                 f"({formula}){_bound_from(K_star)}" if alpha else
                 f"break-even (gamma = 1): K* = {formula} = {K_star:.2f} workers{where}"
                 f"{_bound_from(K_star)}"]
        if not alpha:
            lines.append("P cancels: T_comm and T_comp both grow with the model, so only "
                         "the batch per worker and the cluster shape move gamma.")
        else:
            lines.append(_latency_note(rows, alpha, B, g))
        out.append("\n".join(lines))
        plot_series = ("strong", P, G, K_star)
    out.append(_link_used(a, B, alpha))
    print("\n\n".join(x for x in out if x))
    if a.plot:
        _plot_plan(a.plot, plot_series, rows, R, B, g, alpha, fppe)
        print(f"\nwrote {a.plot}")
    return 0


def _link_used(a, B: float, alpha: float) -> str:
    """Which link the all-reduce was priced on, when the user chose it (the seed's default
    prints nothing, as its output does)."""
    if a.bandwidth is None and a.alpha is None and a.tier is None:
        return ""
    tier = a.tier.name if a.tier else ""
    src_b = "-B" if a.bandwidth is not None else tier or "the default"
    src_a = "--alpha" if a.alpha is not None else tier or "none given"
    return (f"all-reduce priced at B = {B / 1e9:g} GB/s ({src_b}) and "
            f"alpha = {alpha * 1e6:g} us ({src_a})")


def _bound_from(K_star: float) -> str:
    """K* in whole workers: gamma grows with K, so the step is communication-bound from the
    first whole K past K* (K* = 1.01 reads "from K = 2": every added worker waits)."""
    if not math.isfinite(K_star):
        return ""
    return f": communication-bound from K = {max(2, math.floor(K_star) + 1)} on"


def _latency_note(rows, alpha, B, g) -> str:
    """How much of T_comm the 2(K-1)alpha floor is at the largest K, and
    below which model size it is at least 1% there (alpha/(gP/(KB) + alpha) >= 1%)."""
    r = max(rows, key=lambda r: r.K)
    share = r.t_latency / r.t_comm if r.t_comm else 0.0
    p_max = 99 * alpha * r.K * B / g
    return (f"latency term 2(K-1)*alpha at K = {r.K}: {share * 100:.3g}% of the all-reduce; "
            f"it is >= 1% for models below P = 99*alpha*K*B/g = {_plan.sci(float(f'{p_max:.3g}'))} "
            f"parameters (latency dominates small gradients, bandwidth large ones)")


def _plot_plan(path, series, rows, R, B, g, alpha, fppe):
    """gamma vs K for the asked scaling (the table's rows marked) and the other one from the
    same step at the table's smallest K > 1: strong scaling (G fixed) against weak (b
    fixed), each with its break-even K*."""
    plt = _pyplot()
    kind, P, batch, K_star = series
    Kmax = max(max(r.K for r in rows), 2)
    K0 = min((r.K for r in rows if r.K > 1), default=2)
    Ks = sorted({int(round(2 ** (i / 8))) for i in range(0, int(8 * (Kmax.bit_length() + 1)))})
    Ks = [k for k in Ks if 2 <= k <= Kmax * 2]
    if kind == "strong":
        G, b = batch, max(batch // K0, 1)
    else:
        G, b = batch * K0, batch
    # (strong scaling ends at K = G: every worker needs an example)
    curves = {"strong": (_plan.strong_scaling(P, G, R, B, [k for k in Ks if k <= G], g, alpha,
                                              fppe),
                         f"strong scaling: global batch G = {G} split as b = G // K",
                         _plan.break_even(R, B, G=G, g=g, alpha=alpha, P=P, fppe=fppe),
                         "tab:blue"),
              "weak": (_plan.weak_scaling(P, b, R, B, Ks, g, alpha, fppe),
                       f"weak scaling: b = {b} examples per worker, G = b*K",
                       _plan.break_even(R, B, b=b, g=g, alpha=alpha, P=P, fppe=fppe),
                       "tab:purple")}
    other = "weak" if kind == "strong" else "strong"
    fig, ax = plt.subplots(figsize=(8, 6))
    ys_all = []
    for name in (kind, other):
        pts, how, k_star, colour = curves[name]
        ys = [r.gamma for r in pts]
        ys_all += ys
        mine = name == kind
        ax.plot([r.K for r in pts], ys, color=colour, ls="-" if mine else "--",
                label=how + ("" if mine else f" (the same step at K = {K0})"))
        if mine:
            ax.plot([r.K for r in rows if r.K > 1], [r.gamma for r in rows if r.K > 1], "o",
                    color=colour, label="the table's rows")
        if k_star != float("inf"):
            ax.axvline(k_star, color=colour, ls=":", lw=1,
                       label=f"{name} scaling's break-even K* = {k_star:.2f}")
        else:
            ax.plot([], [], " ", label=f"{name} scaling: no break-even (γ stays below 1)")
    _gamma_axes(plt, ax, ys_all)
    lat = f", α = {alpha * 1e6:g} us" if alpha else ""
    ax.set_title(f"Is a data-parallel step communication-bound? P = {_plan.sci(P)} parameters, "
                 f"{g:g} B each\nR = {R:.3g} FLOP/s, B = {B:.3g} B/s per worker{lat}; "
                 f"strong scaling steps where b = G // K is a whole number", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _gamma_axes(plt, ax, ys) -> None:
    """Log axes of γ against K, the break-even line, and the two regions named."""
    ax.axhline(1.0, color="0.3", ls="--", lw=1, label="break-even γ = 1")
    lo, hi = min(ys + [0.5]) / 2, max(ys + [2]) * 4
    ax.set_ylim(lo, hi)
    ax.axhspan(1.0, hi, color="tab:red", alpha=0.06)
    ax.axhspan(lo, 1.0, color="tab:green", alpha=0.06)
    ax.text(0.99, 0.97, "communication-bound (γ > 1)", transform=ax.transAxes, va="top",
            ha="right", fontsize=8, color="tab:red")
    ax.text(0.99, 0.03, "compute-bound (γ < 1)", transform=ax.transAxes, ha="right",
            fontsize=8, color="tab:green")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_yscale("log")
    ax.set_xlabel("workers K")
    ax.set_ylabel("γ = T_comm / T_comp")


# ------------------------------------------------------------------------------ tiers

def tiers_main(argv=None) -> int:
    """``ringlet tiers``: one transfer priced on every tier , and each tier's
    latency/bandwidth crossover n = alpha/beta."""
    return _run(_tiers_main, argv)


def tiers_table(nbytes: int, links: list[Link]) -> str:
    """The tiers table for ``nbytes`` over ``links`` (the first is the reference)."""
    ref_name = links[0].name.split()[0] if links[0].name else "first"
    lines = [f"alpha-beta transfer time of a {format_size(nbytes)} buffer across tiers:",
             ""]
    times = [link.alpha + nbytes * (1.0 / link.bandwidth) for link in links]
    unit, scale = ("ms", 1e3) if min(times) >= 1e-4 else ("us", 1e6)   # (0.00 ms says nothing)
    lines[-1] = (f"{'tier':<24}{'alpha(us)':>10}{'BW(GB/s)':>10}{f'time({unit})':>10}"
                 f" {'vs ' + ref_name:>10}")
    for link, t in zip(links, times):
        lines.append(f"{link.name:<24}{link.alpha * 1e6:>10.1f}{link.bandwidth / 1e9:>10.1f}"
                     f"{t * scale:>10.2f}{t / times[0]:>10.1f}x")
    return "\n".join(lines)


def crossover_table(nbytes: int, links: list[Link]) -> str:
    lines = ["crossover n = alpha/beta (where the latency and the bandwidth term are equal): "
             "latency-bound below it, bandwidth-bound above",
             f"{'tier':<24}{'crossover':>14}   at {format_size(nbytes)}"]
    for link in links:
        n = link.crossover
        ratio = nbytes / n if n else float("inf")
        regime = "bandwidth-bound" if ratio > 1 else "latency-bound"
        lines.append(f"{link.name:<24}{_kb(n):>14}   {regime} (n*beta = {ratio:.3g} x alpha)")
    return "\n".join(lines)


def _kb(n: float) -> str:
    return f"{n / 1e3:.1f} KB" if n < 1e6 else f"{n / 1e6:.2f} MB"


def sweep_table(links: list[Link], lo: int, hi: int) -> str:
    sizes = []
    n = lo
    while n <= hi:
        sizes.append(n)
        n *= 4
    head = f"{'size':>10}" + "".join(f"{(l.name.split()[0] if l.name else '?'):>16}" for l in links)
    lines = ["time of one transfer (L = latency-bound, B = bandwidth-bound):", head]
    for n in sizes:
        cells = []
        for link in links:
            t = link.time(n)
            cells.append(f"{format_time(t):>14} {'B' if n > link.crossover else 'L'}")
        lines.append(f"{format_size(n):>10}" + "".join(cells))
    return "\n".join(lines)


def _tiers_main(argv) -> int:
    ap = argparse.ArgumentParser(
        prog="ringlet tiers",
        description="Price one transfer T(n) = alpha + n*beta on each interconnect tier "
                    "(NVLink, PCIe, InfiniBand, Ethernet: representative orders of magnitude) and show "
                    "each tier's crossover n = alpha/beta.")
    ap.add_argument("--bytes", type=_size, default=256 * 1024 ** 2,
                    help="transfer size, e.g. 256MiB, 4K, 1e6 (default 256MiB)")
    ap.add_argument("--link", type=_named_link, action="append", default=[],
                    help="add a custom tier NAME=ALPHA_US,GBPS (repeatable)")
    ap.add_argument("--only", type=lambda t: [x for x in t.split(",") if x], default=None,
                    help=f"comma-separated subset of: {', '.join(TIERS)} and the --link names")
    ap.add_argument("--sweep", action="store_true",
                    help="also sweep sizes 4 KiB .. 1 GiB")
    ap.add_argument("--plot", metavar="FILE.png", default=None, type=picture_path,
                    help="plot time vs size per tier, crossovers marked")
    a = ap.parse_args(argv)
    custom = dict(a.link)
    names = a.only if a.only is not None else list(TIERS) + list(custom)
    links = [custom[n] if n in custom else tier(n) for n in names]
    if not links:
        raise _Exit("no tiers selected")
    print(tiers_table(a.bytes, links))
    print()
    print(crossover_table(a.bytes, links))
    if a.sweep:
        print()
        print(sweep_table(links, 4 * 1024, 1024 ** 3))
    if a.plot:
        plt = _pyplot()
        import numpy as np
        from .plotting import size_axis
        sizes = np.logspace(0, 31 * np.log10(2), 200)
        fig, ax = plt.subplots(figsize=(8, 4.8))
        for link in links:
            line, = ax.loglog(sizes, [link.time(n) for n in sizes], label=" ".join(link.name.split()))
            ax.plot([link.crossover], [link.time(link.crossover)], "o", color=line.get_color())
        ax.axvline(a.bytes, color="gray", ls=":", lw=1, label=f"{format_size(a.bytes)} (--bytes)")
        size_axis(ax)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("seconds for one message")
        ax.grid(True, which="major", color="0.92")
        ax.set_title("One message on each tier: T(n) = α + n/bandwidth\n"
                     "dot: the crossover n = α·bandwidth (latency-bound left of it, "
                     "bandwidth-bound right)", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        plt.close(fig)
        print(f"\nwrote {a.plot}")
    return 0


# ---------------------------------------------------------------------------- explain

def explain_main(argv=None) -> int:
    """``ringlet explain COLLECTIVE --size 64M -n 8 [--tier T | --hosts H]``: every
    candidate's predicted time split into latency, bandwidth and reduction, the winner, and
    the sizes where the winner changes."""
    return _run(_explain_main, argv)


def _explain_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ringlet explain",
        description="Which algorithm would run, and why: predicted time of every candidate "
                    "split into latency (alpha), bandwidth (beta) and reduction (the "
                    "reduce cost per byte) terms, the winner, and the sizes where the "
                    "winner changes.")
    ap.add_argument("collective", help=f"one of: {', '.join(COLLECTIVES)}")
    ap.add_argument("--size", "-s", type=_size, default=64 * 1024 ** 2,
                    help="bytes (nccl-tests convention: per-rank buffer for all_reduce, "
                         "broadcast, reduce, all_to_all; total for all_gather, "
                         "reduce_scatter, gather, scatter), e.g. 64M (default)")
    ap.add_argument("-n", "--nranks", "-p", type=int, default=8, help="group size (default 8)")
    ap.add_argument("--tier", type=_link_arg, default=None,
                    help=f"price on a tier ({', '.join(TIERS)}, or ALPHA_US,GBPS) instead of "
                         "this host's calibrated profile; with --hosts it is the inter-host link")
    ap.add_argument("--hosts", default=None,
                    help="split the ranks over this many hosts (two-tier topology), or over "
                         "hosts of these sizes: 3,3,2")
    ap.add_argument("--intra", type=_link_arg, default=None,
                    help="intra-host link with --hosts (default: nvlink with --tier, "
                         "else this host's shm)")
    ap.add_argument("--reduce-cost", dest="gamma", type=float, default=None,
                    help="seconds per byte reduced (default: the profile's; 0 with --tier)")
    ap.add_argument("--itemsize", type=int, default=None, help="bytes per element (default 4, "
                    "or --dtype's)")
    ap.add_argument("--dtype", default=None, help="element type (float32, float16, bfloat16, "
                    "...): its size, and for float16 and bfloat16 the cost of reducing it")
    ap.add_argument("--algorithms", type=lambda t: [x for x in t.split(",") if x], default=None,
                    help="comma-separated candidates (default: all)")
    ap.add_argument("--range", default=None, metavar="LO:HI",
                    help="size range for the crossover sweep (default 8:4G)")
    ap.add_argument("--plot", metavar="FILE.png", default=None, type=picture_path,
                    help="plot time vs size per algorithm, crossovers marked")
    ap.add_argument("--zero-copy", action="store_true",
                    help="the buffers are rl.empty arrays, whose large sends local receivers "
                         "read in place (as auto prices them)")
    return ap


def _explain_main(argv) -> int:
    from .cost.tune import choose, environment

    a = _explain_parser().parse_args(argv)
    coll = a.collective
    if coll not in ALGORITHMS:
        raise ValueError(f"unknown collective {coll!r}; valid collectives: {', '.join(COLLECTIVES)}")
    p = a.nranks
    if p < 2:
        raise ValueError(f"-n (group size) must be >= 2, got {p}: on one rank a call moves "
                         "nothing, whatever the algorithm")
    dtype = None
    if a.dtype is not None:
        from .ops import dtype_named
        try:
            dtype = dtype_named(a.dtype)
        except TypeError:
            raise ValueError(f"--dtype {a.dtype}: not a NumPy dtype name, nor bfloat16") from None
        if a.itemsize not in (None, dtype.itemsize):
            raise ValueError(f"--itemsize {a.itemsize} but --dtype {a.dtype} has "
                             f"{dtype.itemsize}-byte elements: give one of them")
        a.itemsize = dtype.itemsize
    elif a.itemsize is None:
        a.itemsize = 4
    if a.itemsize < 1:
        raise ValueError("--itemsize must be >= 1")
    from .cost.simulate import host_layout
    a.host_ids = host_layout(a.hosts, p) if a.hosts is not None else None
    if a.intra is not None and a.host_ids is None:
        raise ValueError("--intra is the link inside each of several hosts: give --hosts N "
                         "too (with one host, --tier names the link)")
    _sweep_range(a)     # (a bad --range is refused before the table, not after it)

    topology, gamma, where, prof = _explain_where(a, p)
    if dtype is not None and a.gamma is None and prof is not None:
        # (float16, bfloat16: C reduces them in float32 and rounds back, at a cost of their own)
        own = prof.reduce_gamma(dtype, "shm")
        gamma = gamma if own is None else own

    conv = "total" if coll in TOTAL_SIZE else "per rank"
    nb = a.size
    unit_bytes = (p if (coll in TOTAL_SIZE or coll.startswith("all_to_all")) else 1) * a.itemsize
    if coll != "barrier" and nb % unit_bytes:
        nb = max(nb // unit_bytes, 1) * unit_bytes
        print(f"(size rounded to {nb} B: whole {a.itemsize}-byte elements in each of "
              f"{unit_bytes // a.itemsize} block(s))")
    shared = USER_BUFFERS[coll] if a.zero_copy else ()
    winner, rows = choose(coll, nb, p, topology=topology, candidates=a.algorithms,
                          itemsize=a.itemsize, gamma=gamma, shared=shared)
    env = environment(p, topology, None, gamma)
    kind = ", rl.empty buffers" if a.zero_copy else ""
    print("\n".join(_fit(x) for x in
                    (f"{coll}, p = {p}: {where}" if coll == "barrier" else   # (moves no data)
                     f"{coll} of {format_size(nb)} {conv} ({nb:,} B){kind}, p = {p}: {where}")
                    .split("\n")))
    if a.zero_copy and env.host is None:
        print(_fit("(--zero-copy changes nothing here: only the host model (shm on this host) "
                   "prices in-place reads)"))
    host = env.host
    if host is not None and prof is not None:
        from .calibrate import describe
        print(_fit("host model (each term once; its time is part of the column named):"))
        print("\n".join(_fit(line) for line in describe(prof.params("shm")).splitlines()))
        print(_fit("columns: latency = the alpha terms; bandwidth = beta, delta, beta_share, "
                   "beta_crowd, beta_lag; reduction = reduce; memory = mem_l2 + mem_l3; "
                   "cores = how much of the total comes from ranks sharing cores (part of the "
                   "others)"))
    _explain_table(rows, winner, env, host, gamma)
    if shared:   # auto runs an rl.empty call on the plain path where that is predicted faster
        plain, prows = choose(coll, nb, p, topology=topology, candidates=a.algorithms,
                              itemsize=a.itemsize, gamma=gamma)
        if prows[0].total < rows[0].total:
            print(_fit(f"auto runs {plain} on the plain path here (nothing read in place): "
                       f"{prows[0].total * 1e6:.1f} us predicted, against {winner}'s "
                       f"{rows[0].total * 1e6:.1f} us read in place"))
    elif coll != "barrier" and not a.algorithms and not a.tier:   # (what a job here would do)
        from .tuning import shortlist
        n = shortlist([r.total for r in rows])
        if n > 1:
            print(_fit(f"with RINGLET_TUNE set, a job times {', '.join(r.algorithm for r in rows[:n])} "
                       f"on its first blocking calls of this shape and keeps the fastest "
                       f"(where it beats {winner} by more than 10%)"))
    cross, sweep = _explain_crossovers(a, coll, p, topology, gamma, shared, env, rows, winner,
                                       nb)
    if a.plot:
        _plot_explain(a.plot, coll, p, nb, sweep, cross, winner, where.split("\n")[0])
        print(f"wrote {a.plot}")
    return 0


def _explain_where(a, p: int):
    """(topology, gamma, description, profile or None) of where explain predicts."""
    from .cost.profile import load_profile, profile_path
    from .cost.simulate import Topology
    prof = None
    if a.host_ids is not None:
        if a.tier is not None:
            intra = a.intra or TIERS["nvlink"]
            topology = Topology.from_host_ids(a.host_ids, intra, a.tier, a.gamma or 0.0)
        else:
            prof = load_profile()
            topology = Topology.from_host_ids(
                a.host_ids, a.intra or prof.link("shm"), prof.link("inter"),
                prof.gamma("shm") if a.gamma is None else a.gamma, prof.delta("shm"),
                shared=prof.shared(), machine=prof.machine())
        where = str(topology)
        gamma = topology.gamma
    elif a.tier is not None:
        topology = a.tier
        gamma = a.gamma or 0.0
        where = f"{p} ranks on {a.tier}"
    else:
        prof = load_profile()
        topology = prof
        gamma = prof.gamma("shm") if a.gamma is None else a.gamma
        where = (f"{p} ranks on this host (shm, the "
                 f"{'calibrated' if prof.calibrated else 'default'} host model below)"
                 if prof.host_model("shm") is not None else
                 f"{p} ranks on this host ({prof.link('shm')})")
    if prof is not None:
        src = (f"calibrated profile {prof.source}" if prof.calibrated else
               f"default profile ({'an unreadable' if profile_path().exists() else 'no'} "
               f"calibration at {profile_path()}; run `ringlet calibrate`)")
        where += f"\nlinks from the {src}"
    return topology, gamma, where, prof


def _explain_table(rows, winner: str, env, host, gamma: float) -> None:
    """Every candidate's predicted time by term, the winner marked."""
    print(_fit(f"reduce cost = {gamma:.3g} s per byte reduced"
               + (f" ({1 / gamma / 1e9:.3g} GB/s)" if gamma else "")
               + f"; method: {rows[0].method}"))
    scale, unit = (1e6, "us") if rows[0].total < 1e-3 else (1e3, "ms")
    hosts = env.topology is not None and rows[0].method == "simulated"
    if hosts:
        print(_fit("intra-host / inter-host: the critical path's latency + bandwidth split by "
                   "the link it crossed"))
    heads = ["total", "latency", "bandwidth", "reduction"] + (
        ["memory", "cores"] if host is not None else
        ["intra-host", "inter-host"] if hosts else [])
    cells = [[r.total, r.latency, r.bandwidth, r.reduction] + (
        [r.memory, r.sharing] if host is not None else
        [r.latency + r.bandwidth - r.inter, r.inter] if hosts else []) for r in rows]
    text = [[f"{v * scale + 0.0:.2f}".replace("-0.00", "0.00") for v in c] for c in cells]
    print(_table(f"algorithm ({unit})", [r.algorithm for r in rows], heads, text,
                 [r.algorithm == winner for r in rows]))
    if host is not None and rows[0].parts:
        parts = ", ".join(f"{'reduce' if k == 'gamma' else k} {v * scale:.4g}"
                          for k, v in rows[0].parts if v > 0)
        print(_fit(f"{winner}'s critical path by term ({unit}): {parts}"))
    ratio = rows[1].total / max(rows[0].total, 1e-300) if len(rows) > 1 else 0
    if ratio >= 1.005:
        print(_fit(f"winner: {winner} ({ratio:.2f}x faster than the runner-up, "
                   f"{rows[1].algorithm})"))
    elif ratio > 0:
        print(_fit(f"winner: {winner} (a tie with {rows[1].algorithm}, within 0.5%: the "
                   f"model cannot tell them apart; auto takes {winner})"))
    else:
        print(f"winner: {winner}")


# Algorithms priced within this of each other trade places every few KiB (ring and
# gloo_ring: 393-403 KiB gloo_ring, 403-451 ring, 451-451 gloo_ring, ...) where the model
# cannot tell them apart: the crossovers list keeps a winner until another is this much
# faster. (auto still takes the cheaper of two near-equal prices.)
EXPLAIN_TIE = 0.02


def _sweep_range(a) -> tuple[int, int]:
    """--range as (lo, hi) bytes, default 8 B .. 4 GiB."""
    if not a.range:
        return 8, 4 * 1024 ** 3
    try:
        lo_s, hi_s = a.range.split(":")
        lo, hi = parse_size(lo_s), parse_size(hi_s)
    except ValueError:
        raise ValueError(f"--range wants LO:HI sizes, e.g. 8:4G, got {a.range!r}") from None
    if not 0 < lo < hi:
        raise ValueError(f"--range wants 0 < LO < HI, got {a.range!r} ({lo} B to {hi} B)")
    return lo, hi


def _explain_crossovers(a, coll: str, p: int, topology, gamma: float, shared, env, rows,
                        winner: str, nb: int = -1):
    """Print the sizes where the winner changes; returns (crossovers, sweep) for the plot.
    Where the list names another algorithm than ``winner`` for the size asked (``nb``),
    within the tie, it says which one auto runs there."""
    from .cost.tune import crossovers
    if coll == "barrier" or len(rows) == 1:
        cross, sweep = [], []
    else:
        lo, hi = _sweep_range(a)
        ppo = 2 if env.topology is not None else 4
        cross, sweep = crossovers(coll, p, topology=topology, candidates=a.algorithms,
                                  lo=lo, hi=hi, itemsize=a.itemsize, gamma=gamma,
                                  points_per_octave=ppo, shared=shared, tie=EXPLAIN_TIE)
        lo_eff = sweep[0][0] if sweep else lo
        hi_eff = sweep[-1][0] if sweep else hi
        print(_fit(f"crossovers ({format_size(lo_eff)} .. {format_size(hi_eff)}; the winner "
                   f"changes where another is over {EXPLAIN_TIE:.0%} faster):"))
        if not cross:
            first = min(sweep[0][1], key=sweep[0][1].get) if sweep else winner
            print(_fit(f"  none: {first} wins over the whole range"))
        else:
            segs = []
            start_w = cross[0][1]
            bounds = [None] + [c[0] for c in cross] + [None]
            winners = [start_w] + [c[2] for c in cross]
            for i, w in enumerate(winners):
                lo_b, hi_b = bounds[i], bounds[i + 1]
                if lo_b is None:
                    label = f"below {format_size(hi_b)}"
                elif hi_b is None:
                    label = f"from {format_size(lo_b)}"
                else:
                    label = f"{format_size(lo_b)} .. {format_size(hi_b)}"
                segs.append(f"  {label:<26}{w}")
                # (not at a bound, which bisection placed to within a fraction of a %)
                inside = (lo_b is None or nb > lo_b * 1.01) and (hi_b is None or nb < hi_b / 1.01)
                if inside and w != winner and nb >= 0:
                    # (the gap, priced here: the sweep's points lie a quarter octave apart,
                    # and between them it may pass the tie - 5.6% at 513 KiB, a runtime
                    # threshold the range's pick does not cross)
                    tw = next((r.total for r in rows if r.algorithm == w), None)
                    gap = tw / max(rows[0].total, 1e-300) - 1 if tw is not None else 0.0
                    said = f"priced within {EXPLAIN_TIE:.0%} of {w}" if gap <= EXPLAIN_TIE \
                        else f"{w} priced {gap:.1%} slower there"
                    segs.append(f"  {'':<26}(at {format_size(nb)} auto runs {winner}, {said})")
            print("\n".join(segs))
    return cross, sweep


# ------------------------------------------------------------------------------ place

def place_main(argv=None) -> int:
    """``ringlet place --hosts 2 --ranks-per-host 4 --tp 4 --tp-bytes 64M --dp-bytes 16M``:
    the rank -> host mapping with the least predicted communication per step, beside the
    naive order's; ``--what-if 64x8`` prices the same job at that scale too."""
    return _run(_place_main, argv)


def _scale(text: str) -> tuple[int, int]:
    try:
        h, r = (int(x) for x in text.lower().split("x"))
        if h >= 1 and r >= 1:
            return h, r
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected HOSTSxRANKS, e.g. 64x8, got {text!r}")


def _place_main(argv) -> int:
    from .cost.place import describe, expert_parallel, place, tensor_data_parallel

    ap = argparse.ArgumentParser(
        prog="ringlet place",
        description="Propose which host each rank of a job runs on so that a step "
                    "communicates least (predicted by simulating the schedules auto would "
                    "run, all groups of a kind at once, sharing the hosts' NICs), and show "
                    "the naive order's prediction beside it. Logical rank i*tp + j is "
                    "tensor-parallel shard j of data-parallel replica i.")
    ap.add_argument("--hosts", type=int, required=True, help="number of hosts")
    ap.add_argument("--ranks-per-host", type=int, required=True, help="ranks on each host")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel group size (default 1)")
    ap.add_argument("--tp-bytes", type=_size, default=0, help="bytes per TP call, e.g. 64M")
    ap.add_argument("--tp-collective", default="all_reduce", help="default all_reduce")
    ap.add_argument("--tp-calls", type=int, default=1, help="TP calls per step (default 1)")
    ap.add_argument("--dp-bytes", type=_size, default=0,
                    help="bytes per data-parallel call (gradients), e.g. 1G")
    ap.add_argument("--dp-collective", default="all_reduce", help="default all_reduce")
    ap.add_argument("--dp-calls", type=int, default=1, help="DP calls per step (default 1)")
    ap.add_argument("--ep", type=int, default=0,
                    help="expert-parallel group size (consecutive logical ranks; all_to_all)")
    ap.add_argument("--ep-bytes", type=_size, default=0, help="bytes per rank per EP all_to_all")
    ap.add_argument("--ep-calls", type=int, default=2,
                    help="EP all_to_all calls per step (default 2: dispatch and combine)")
    ap.add_argument("--intra", type=_link_arg, default=TIERS["nvlink"],
                    help="intra-host link: a tier, shm (calibrated) or ALPHA_US,GBPS "
                         "(default nvlink)")
    ap.add_argument("--inter", type=_link_arg, default=TIERS["ethernet"],
                    help="inter-host link: a tier, tcp (calibrated) or ALPHA_US,GBPS "
                         "(default ethernet)")
    ap.add_argument("--no-nic-sharing", action="store_true",
                    help="every rank has its own NIC (default: a host's ranks share one)")
    ap.add_argument("--evaluations", type=int, default=400,
                    help="most mappings the local search prices (default 400)")
    ap.add_argument("--what-if", type=_scale, default=None, metavar="HxR",
                    help="also price the same job (same TP/EP sizes and bytes, DP filling "
                         "the ranks) on H hosts x R ranks, e.g. 64x8")
    a = ap.parse_args(argv)
    if a.hosts < 1 or a.ranks_per_host < 1:
        raise _Exit(f"--hosts and --ranks-per-host must be >= 1, got {a.hosts} and "
                    f"{a.ranks_per_host}")

    def job(H, R):
        P = H * R
        if a.tp < 1 or P % a.tp:
            raise ValueError(f"--tp {a.tp} must divide the {P} ranks ({H} hosts x {R})")
        comms = tensor_data_parallel(a.tp, P // a.tp, a.tp_bytes, a.dp_bytes,
                                     tp_collective=a.tp_collective,
                                     dp_collective=a.dp_collective,
                                     tp_calls=a.tp_calls, dp_calls=a.dp_calls)
        comms = [c for c in comms if c.nbytes and len(c.groups[0]) > 1]
        if a.ep:
            comms.append(expert_parallel(P, a.ep, a.ep_bytes, a.ep_calls))
        if not comms:
            raise ValueError("nothing to place: give --tp-bytes, --dp-bytes or --ep-bytes")
        return comms

    def show(H, R, evaluations):
        comms = job(H, R)
        print(f"job on {H} hosts x {R} ranks:\n{describe(comms)}")
        print(place(comms, H, R, intra=a.intra, inter=a.inter,
                    nic_sharing=not a.no_nic_sharing, max_evaluations=evaluations))

    show(a.hosts, a.ranks_per_host, a.evaluations)
    if a.what_if:
        H, R = a.what_if
        print(f"\nwhat if: the same job on {H} hosts x {R} ranks (the structured mappings "
              f"only, no swap search)")
        show(H, R, len(job(H, R)) + 1)
    return 0


def _table(first: str, names, heads, text, marked, mark: str = "  <- winner") -> str:
    """Rows named ``names`` with columns ``heads`` (cells ``text``), ``mark`` after the
    ``marked`` rows; columns that would run past the terminal go to a second table below
    (each repeats the names), so no line is longer than the terminal."""
    import shutil
    width = shutil.get_terminal_size((100, 24)).columns
    widths = [max(len(h), *(len(t[i]) for t in text)) + 2 for i, h in enumerate(heads)]
    aw = max(len(first), *(len(n) for n in names))
    parts, cur, used = [], [], aw + len(mark)
    for i, w in enumerate(widths):
        if cur and used + w > width:
            parts.append(cur)
            cur, used = [], aw
        cur.append(i)
        used += w
    parts.append(cur)
    out = []
    for k, cols in enumerate(parts):
        if k:
            out.append("")
        out.append(f"{first:<{aw}}" + "".join(f"{heads[i]:>{widths[i]}}" for i in cols))
        for n, t, m in zip(names, text, marked):
            out.append(f"{n:<{aw}}" + "".join(f"{t[i]:>{widths[i]}}" for i in cols)
                       + (mark if m and k == 0 else ""))
    return "\n".join(out)


def _fit(line: str, indent: str = "      ") -> str:
    """``line`` wrapped to the terminal (continuations indented)."""
    import shutil
    import textwrap
    width = shutil.get_terminal_size((100, 24)).columns
    lead = " " * (len(line) - len(line.lstrip()))
    return "\n".join(textwrap.wrap(line, width, subsequent_indent=lead + indent,
                                   break_on_hyphens=False)) or line


def _plot_explain(path, coll, p, nb, sweep, cross, winner, where):
    plt = _pyplot()
    if not sweep:
        raise _Exit("nothing to plot: a single candidate (or barrier) has no size sweep")
    from .plotting import size_axis
    fig, ax = plt.subplots(figsize=(9, 5.2))
    algs = list(sweep[0][1])
    xs = [n for n, _ in sweep]
    colour = {}
    for i, alg in enumerate(algs):
        ys = [t[alg] for _, t in sweep]
        # dashed over an earlier line it would hide (algorithms priced alike: ring, gloo_ring)
        alike = any(all(abs(t[b] - t[alg]) <= 0.01 * t[alg] for _, t in sweep) for b in algs[:i])
        line, = ax.loglog(xs, ys, lw=1.3, label=alg + (" (dashed: priced as another)"
                                                       if alike else ""),
                          ls=(0, (4, 3)) if alike else "-")
        colour[alg] = line.get_color()
    # the winner at each size, drawn over the candidates: the envelope auto follows
    best = [min(t.values()) for _, t in sweep]
    ax.loglog(xs, best, color="black", lw=3, alpha=0.18, label="fastest (what auto picks)")
    from matplotlib.transforms import offset_copy
    first, k = None, 0
    for n, old, new in cross:
        t = min(t for m, ts in sweep for a_, t in ts.items() if m >= n and a_ == new) \
            if any(m >= n for m, _ in sweep) else None
        if t is None:
            continue
        # crossovers within a factor of 4 of the first of a stack: their labels stacked
        # under its label, each tied to its circle (2, 3.34 and 6.9 MiB had been written
        # over each other)
        if first is not None and n < 4 * first[0]:
            k += 1
        else:
            first, k = (n, t), 0
        ax.plot([n], [t], "o", ms=6, mfc="white", mec=colour.get(new, "k"), zorder=5)
        ax.annotate(f"{format_size(n)}: {old} -> {new}", (n, t), xytext=first,
                    textcoords=offset_copy(ax.transData, fig=fig, x=10, y=-14 - 11 * k,
                                           units="points"),
                    fontsize=7, color=colour.get(new, "k"), va="center",
                    bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.85),
                    arrowprops=dict(arrowstyle="-", lw=0.5, color=colour.get(new, "k"),
                                    shrinkA=0, shrinkB=3) if k else None, zorder=6)
    ax.axvline(nb, color="0.4", ls="--", lw=1, label=f"{format_size(nb)} (--size): {winner}")
    if cross:     # room below the lowest curve for a crossover's label, written under it
        ax.set_ylim(bottom=min(best) / 4)
    size_axis(ax)
    ax.set_xlabel("size in bytes (nccl-tests convention)")
    ax.set_ylabel("predicted seconds")
    ax.grid(True, which="major", color="0.92")
    import textwrap
    ax.set_title(textwrap.fill(f"{coll}, p = {p}: predicted time of every algorithm "
                               f"(circles: where another becomes over {EXPLAIN_TIE:.0%} "
                               f"faster) - {where}", 110),
                 fontsize=8)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["plan_main", "tiers_main", "explain_main", "place_main", "tiers_table",
           "crossover_table"]
