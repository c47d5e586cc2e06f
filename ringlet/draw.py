"""Draw a Schedule: ranks as lanes, rounds left to right, one arrow per message.

The picture is made from the very :class:`ringlet.schedule.Schedule` the runtime executes
and the cost model prices (``rl.schedule(...)``), so what you see is what runs:

    ringlet draw all_reduce -n 8 --algo ring              # text, for the terminal
    ringlet draw all_reduce -n 8 --algo ring -o ring.svg  # a picture (needs matplotlib)

Each message is labelled with the chunk it carries and whether the receiver copies it
("c2") or reduces it into what it holds ("c2+"). Chunks are the pieces between the
offsets where some message of the schedule starts or ends, numbered from the start of
the buffer, so a ring over p ranks shows chunks c0..c(p-1) and a message of two of them
"c2-3"; a message of no bytes (a rooted call's ranks agreeing on the call) is "sync".
Under each round ("round time"): the cost model's time of that round alone (the
slowest rank's part, every rank starting it together); rounds of a real call overlap, so
the whole call's prediction is printed too and is usually less than their sum.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
import numpy as np

from .cost.model import Link, count_of, format_size, format_time, nbytes_of
from .cost.simulate import Topology, host_layout, simulate
from .cost.profile import load_profile
from .plotting import picture_path
from .schedule import BUFFER_NAMES, REDUCE, Schedule, Transfer


#: collectives whose schedule counts one rank's block (the others: one rank's buffer)
_BLOCKS = ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all",
           "all_to_all_single")
#: the label under each round
ROUND_TIME = "round time"


@dataclass
class Drawing:
    """What both forms draw: the schedule, who each lane is, and the prices."""
    schedule: Schedule
    lanes: tuple[int, ...]          # the world rank of each group rank (a subgroup's names)
    hosts: tuple[int, ...] | None   # host of each group rank (bands), None for one host
    round_times: list[float]        # seconds, each round priced alone
    total: float                    # seconds, the whole schedule as the runtime overlaps it
    where: str                      # what it was priced on
    bounds: dict[str, np.ndarray]   # per source buffer: sorted offsets where chunks start

    @property
    def title(self) -> str:
        s = self.schedule
        what = "blocks" if s.collective in _BLOCKS else "buffer"
        moved = "" if s.collective == "barrier" else (      # (a barrier moves no bytes)
            f"{format_size(s.count * s.itemsize)} {what}, ")
        root = "" if s.root is None or s.collective not in ROOTED_DRAWN else (
            f"root rank {self.lanes[s.root]}, ")   # (--root is a place in the group)
        return (f"{s.collective} / {s.algorithm}: {s.p} ranks, {root}{moved}"
                f"{_count(len(s.rounds), 'round')}, {_count(s.messages, 'message')}; predicted "
                f"{format_time(self.total)} on {self.where}")

    def sync(self, t: Transfer) -> bool:
        """A message of no bytes that only agrees: a barrier's, or a rooted call's agreement
        on the call. (Not an empty chunk of a call of 0 bytes: 24 arrows of an all_reduce
        --size 0 had been drawn as syncs.)"""
        return t.n == 0 and (self.schedule.collective in ROOTED_DRAWN
                             or self.schedule.collective == "barrier")

    def label(self, t: Transfer) -> str:
        """``c3`` (copied) or ``c3+`` (reduced); ``c2-3`` when a message carries a run;
        ``tmp:c1`` when messages leave from more than one buffer."""
        if t.n == 0:
            return "sync" if self.sync(t) else "0 B"
        b = self.bounds[t.sbuf]
        first = int(np.searchsorted(b, t.soff, "right")) - 1
        last = int(np.searchsorted(b, t.soff + t.n, "left")) - 1
        name = f"c{first}" if last <= first else f"c{first}-{last}"
        if len(self.bounds) > 1:
            name = f"{t.sbuf}:{name}"
        return name + ("+" if t.op == REDUCE else "")


def prepare(schedule: Schedule, topology: Topology | Link | None = None,
            ranks=None) -> Drawing:
    """Price ``schedule`` round by round on ``topology`` (a Topology, a Link, or None for
    this host's calibrated profile, over hosts if the schedule has them) and name its
    lanes ``ranks`` (the world ranks of a subgroup; default 0..p-1)."""
    p = schedule.p
    lanes = tuple(int(r) for r in ranks) if ranks is not None else tuple(range(p))
    if len(lanes) != p:
        raise ValueError(f"ranks names {len(lanes)} ranks but the schedule has {p}")
    hosts = schedule.hosts
    model = "model"
    if topology is None:
        if hosts is not None and len(set(hosts)) > 1:
            topology = Topology.from_host_ids(hosts, *_profile_links())
        else:
            prof = load_profile()
            model = "calibrated model" if prof.calibrated else "default model (uncalibrated)"
            topology = Topology.from_profile(1, p, prof)
    elif isinstance(topology, Link):
        topology = (Topology.from_host_ids(hosts, topology) if hosts is not None
                    else Topology.uniform(p, topology))
    if hosts is None and topology.hosts > 1:
        hosts = tuple(int(h) for h in topology.host_array)
    where = str(topology.intra) if topology.hosts == 1 else (
        f"{topology.hosts} hosts (intra {topology.intra}, inter {topology.inter})")
    if topology.host is not None:   # (its per-message alpha: both ends' CPU, explain's alpha x 2)
        link, h = topology.intra, topology.host
        fast = (f"; {2 * h.alpha_fast * 1e6:.3g} us in a call of messages <= "
                f"{format_size(h.fast_bytes)}, which C runs whole" if h.fast_bytes else "")
        where = (f"this host's {model} (a message: {link.alpha * 1e6:.3g} us of both ends' "
                 f"CPU in the Python engine{fast}; {link.bandwidth / 1e9:.4g} GB/s)")
    times = [simulate(_alone(schedule, rnd), topology).time for rnd in schedule.rounds]
    total = simulate(schedule, topology).time if schedule.rounds else 0.0
    return Drawing(schedule, lanes, hosts if hosts and len(set(hosts)) > 1 else None,
                   times, total, where, _bounds(schedule))


def _profile_links():
    from .cost.profile import load_profile
    prof = load_profile()
    return prof.link("shm"), prof.link("inter"), prof.gamma("shm"), prof.delta("shm")


def round_name(s: Schedule, i: int) -> str:
    """A round's heading: its number, and whether it is posted with round 0."""
    return f"round {i}" + (" (with 0)" if i == s.early else "")


def _alone(s: Schedule, rnd) -> Schedule:
    return Schedule(s.collective, s.algorithm, s.p, s.count, [rnd], dict(s.buffers),
                    s.itemsize, s.root, s.splits, s.hosts)


def _bounds(s: Schedule) -> dict[str, np.ndarray]:
    cuts: dict[int, list] = {}
    for rnd in s.rounds:
        c = rnd.cols
        msg = (c["src"] != c["dst"]) & (c["n"] > 0)   # (zero-element ones carry no chunk)
        for b in np.unique(c["sbuf"][msg]):
            mine = msg & (c["sbuf"] == b)
            cuts.setdefault(int(b), [np.zeros(1, np.int64)]).extend(
                [c["soff"][mine], (c["soff"] + c["n"])[mine]])
    return {BUFFER_NAMES[b]: np.unique(np.concatenate(v)) for b, v in cuts.items()}


# ------------------------------------------------------------------------- text form

def text(d: Drawing, width: int | None = None) -> str:
    """The terminal form: a grid of lanes (ranks) by rounds; a cell lists the rank's
    messages of that round as ``->DST CHUNK`` (``+``: the receiver reduces). Rounds wrap
    into bands that fit ``width`` columns (default: the terminal's)."""
    s = d.schedule
    width = width or shutil.get_terminal_size((100, 24)).columns
    cells = []
    for rnd in s.rounds:
        sent = [[] for _ in range(s.p)]
        for t in rnd:
            if not t.local:
                sent[t.src].append(f"->{d.lanes[t.dst]} {d.label(t)}")
            elif t.n:   # (a round of local reduces had read '.', as if it did nothing)
                what = d.label(t) if t.sbuf in d.bounds else \
                    f"{t.sbuf}{'+' if t.op == REDUCE else ''}"
                sent[t.src].append(f"local {what}")
        cells.append([", ".join(x) or "." for x in sent])
    heads = [round_name(s, i) for i in range(len(s.rounds))]
    foot = [format_time(t) for t in d.round_times]
    colw = [max(len(h), len(f), *(len(c) for c in col)) for h, f, col in zip(heads, foot, cells)]
    lane = [f"rank {r}" + (f" (host {d.hosts[i]})" if d.hosts else "")
            for i, r in enumerate(d.lanes)]
    lw = max(len(x) for x in lane + [ROUND_TIME])
    import textwrap
    out = textwrap.wrap(d.title, width) + textwrap.wrap(
        f"a cell: ->DST CHUNK, the messages a rank sends in that round; CHUNK+ = the "
        f"receiver reduces it, else copies; chunks are numbered by offset in the "
        f"buffer they leave from; local CHUNK (or BUFFER) = a copy or reduce inside the rank, no message; sync = a message of no bytes (a rooted call agreeing on "
        f"the call, before or beside its data); '.' = no message; {ROUND_TIME}: the "
        f"model's time of that round on its own (rounds overlap in the whole call, so their "
        f"sum may exceed its prediction)"
        + ("; (with 0): posted with round 0, its data moving beside the rounds between"
           if s.early >= 0 else ""), width)
    i = 0
    while i < len(s.rounds):
        j, used = i, lw
        while j < len(s.rounds) and (j == i or used + 2 + colw[j] <= width):
            used += 2 + colw[j]
            j += 1
        def row(name, vals):
            return (f"{name:<{lw}}" + "".join(f"  {v:<{colw[k]}}" for k, v in
                                              zip(range(i, j), vals))).rstrip()
        out.append("")
        out.append(row("", heads[i:j]))
        for r in range(s.p):
            if d.hosts and r and d.hosts[r] != d.hosts[r - 1]:
                out.append("-" * min(used, width))
            out.append(row(lane[r], [cells[k][r] for k in range(i, j)]))
        out.append(row(ROUND_TIME, foot[i:j]))
        i = j
    return "\n".join(out)


# ---------------------------------------------------------------------------- picture

ROOTED_DRAWN = ("broadcast", "reduce", "gather", "scatter")

_COLOURS = {REDUCE: "tab:orange", "copy": "tab:blue", "sync": "0.6"}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def picture(d: Drawing, path: str) -> None:
    """Save the drawing as an image; the extension picks the format (.svg, .png, .pdf).
    Needs matplotlib (``pip install 'ringlet[plot]'``)."""
    from .plotting import pyplot
    plt = pyplot()
    s = d.schedule
    R, p = max(len(s.rounds), 1), s.p
    # (at least 7 inches: the title and legend of a one-round drawing; less per round when
    # there are more than 6, or a ring of 8 ranks came out 2800 pixels wide)
    wide = 3 + 1.6 * min(R, 6) + 1.1 * max(R - 6, 0)
    fig, ax = plt.subplots(figsize=(min(max(7.0, wide), 40), min(1.5 + 0.55 * p, 40)))
    y = {r: p - 1 - r for r in range(p)}                 # rank 0 on top
    if d.hosts:
        for h in sorted(set(d.hosts)):
            mine = [y[r] for r in range(p) if d.hosts[r] == h]
            ax.axhspan(min(mine) - 0.5, max(mine) + 0.5, color="0.93" if h % 2 else "0.85",
                       zorder=0)
            ax.text(R - 0.02, max(mine) + 0.4, f"host {h}", ha="right", va="top", fontsize=8,
                    color="0.3")
    for r in range(p):
        ax.plot([0, R], [y[r], y[r]], color="0.75", lw=0.8, zorder=1)
    for k in range(1, R):
        ax.axvline(k, color="0.85", lw=0.6, ls=":", zorder=1)
    syncs = False
    for k, rnd in enumerate(s.rounds):
        syncs = _draw_round(ax, d, k, list(rnd), y) or syncs
    ax.text(-0.05, -0.9, ROUND_TIME, ha="right", va="top", fontsize=8, color="0.25")
    _dress(ax, d, R, p, y, syncs)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_round(ax, d: Drawing, k: int, rows: list, y: dict) -> bool:
    """Round ``k``: its local steps as squares, its messages as arrows (labelled when
    few), its modelled time below. True if some message carries no bytes (a sync)."""
    p = d.schedule.p

    def colour(t):
        return _COLOURS["sync"] if d.sync(t) else _COLOURS[t.op]
    msgs = [t for t in rows if not t.local]
    for r in sorted({t.src for t in rows if t.local and t.n}):
        ops = {t.op for t in rows if t.local and t.src == r}
        ax.plot([k + 0.04], [y[r]], marker="s", ms=4, zorder=4, ls="none",
                color=_COLOURS[REDUCE if REDUCE in ops else "copy"])
    x0, x1 = k + 0.12, k + 0.88
    if msgs:        # one artist per round: thousands of arrows draw in a second
        ax.quiver([x0] * len(msgs), [y[t.src] for t in msgs], [x1 - x0] * len(msgs),
                  [y[t.dst] - y[t.src] for t in msgs], angles="xy", scale_units="xy",
                  scale=1, color=[colour(t) for t in msgs],
                  # (a fraction of the axes' width: as thin on a 40-inch drawing as on a 9)
                  width=0.0018 * 9 / ax.figure.get_figwidth(),
                  headwidth=5, headlength=7, headaxislength=6, zorder=3)
    # a round's syncs are labelled only where they leave room: a rooted call's last round
    # carries its data and its agreement, and had labelled neither
    named = msgs if len(msgs) <= p else [t for t in msgs if not d.sync(t)]
    # (every rank to every other, as a direct all_to_all's round: labelled up to 3 ranks)
    most = p * (p - 1) if p <= 3 else p
    fan = {t.src: sum(u.src == t.src for u in named) for t in named}
    for t in named:
        if p <= 16 and len(named) <= most:
            # label near the sender: a lane sends few messages a round, so labels
            # of different senders do not sit on each other where arrows cross;
            # near the receiver when one rank sends several (a direct broadcast's
            # labels all sat on the root)
            dy = y[t.dst] - y[t.src]
            f = min(0.2, 0.3 / abs(dy)) if dy else 0.2
            if fan[t.src] > 1:
                f = 1 - f
            lx, ly = x0 + (x1 - x0) * f, y[t.src] + dy * f
            ax.text(lx, ly, d.label(t), fontsize=7, ha="center", va="center", zorder=4,
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
    ax.text(k + 0.5, -0.9, format_time(d.round_times[k]) if d.round_times else "",
            ha="center", va="top", fontsize=7, color="0.25")
    return any(d.sync(t) for t in msgs)


def _dress(ax, d: Drawing, R: int, p: int, y: dict, syncs: bool) -> None:
    """Lanes and rounds as ticks, the legend (sync only if some message is one), the title."""
    ax.set_xlim(0, R)
    ax.set_ylim(-1.3, p - 0.4)
    ax.set_yticks([y[r] for r in range(p)])
    ax.set_yticklabels([f"rank {d.lanes[r]}" for r in range(p)], fontsize=8)
    ax.set_xticks([k + 0.5 for k in range(R)])
    ax.set_xticklabels([round_name(d.schedule, k) for k in range(R)], fontsize=8,
                       rotation=0 if R <= 12 else 90)
    ax.xaxis.tick_top()
    for side in ("right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    from matplotlib.lines import Line2D
    ts = [t for rnd in d.schedule.rounds for t in rnd]   # (the legend names what is drawn)
    sent = {t.op == REDUCE for t in ts if not t.local and t.n}
    handles = []
    if False in sent:
        handles.append(Line2D([], [], color=_COLOURS["copy"], label="copy (cN)"))
    if True in sent:
        handles.append(Line2D([], [], color=_COLOURS[REDUCE], label="reduce (cN+)"))
    if syncs:
        handles.append(Line2D([], [], color=_COLOURS["sync"],
                              label="sync: no bytes\n(ranks agree on the call)"))
    if any(t.local and t.n for t in ts):
        handles.append(Line2D([], [], color="0.4", marker="s", ms=4, ls="none",
                              label="local copy/reduce\n(round start, no message)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              frameon=False)
    import textwrap
    # wrap to the figure's width (about 14 characters an inch at this size): a drawing of
    # one round is narrow, and a 110-character line ran off both sides of it
    cols = max(40, min(110, int(ax.figure.get_figwidth() * 14)))
    ax.set_title(textwrap.fill(d.title, cols) + "\n" + textwrap.fill(
        f"{ROUND_TIME} (below each round): the model's time of that round on its own (rounds "
        f"overlap in the whole call: their sum may exceed its prediction)"
        + ("; chunks numbered by offset" if d.schedule.count else "")
        + ("; (with 0): posted with round 0, its data moving beside the rounds between"
           if d.schedule.early >= 0 else ""), cols), fontsize=8, pad=18)


__all__ = ["Drawing", "prepare", "text", "picture"]


# ------------------------------------------------------------------------ the command

def _parser():
    import argparse

    from . import algorithms
    from .commands import _link_arg, _size

    ap = argparse.ArgumentParser(
        prog="ringlet draw",
        description="Draw the schedule an algorithm runs: ranks as lanes, rounds left to "
                    "right, one arrow per message labelled with its chunk (cN: copied, "
                    "cN+: reduced), and the cost model's time of each round. Text on the "
                    "terminal; -o FILE.svg or .png for a picture (needs matplotlib).")
    ap.add_argument("collective", help=f"one of: {', '.join(algorithms.CATALOG)}")
    ap.add_argument("-n", "--nranks", type=int, default=4, help="group size (default 4)")
    ap.add_argument("--algo", "--algorithm", default=None,
                    help="algorithm from the catalogue (default: the one algorithm=\"auto\" "
                         "would run, the least predicted time on the same link)")
    ap.add_argument("--size", "-s", type=_size, default=1 << 20,
                    help="bytes priced, as in `ringlet explain` (per-rank buffer for "
                         "all_reduce, broadcast, reduce, all_to_all; total for all_gather, "
                         "reduce_scatter, gather, scatter); default 1M")
    ap.add_argument("--ranks", default=None,
                    help="a subgroup: the world ranks of its members, e.g. 1,3,5,7 (-n is "
                         "then their number)")
    ap.add_argument("--hosts", default=None,
                    help="spread the ranks over this many hosts (contiguous blocks; drawn "
                         "as bands, priced intra shm / inter tcp or --tier), or over hosts "
                         "of these sizes: 3,3,2")
    ap.add_argument("--tier", type=_link_arg, default=None,
                    help="price on a tier (nvlink, pcie, infiniband, ethernet, or "
                         "ALPHA_US,GBPS) instead of this host's profile; with --hosts it is "
                         "the link between hosts, NVLink inside them")
    ap.add_argument("--root", type=int, default=0,
                    help="root of a rooted collective: its place in the group (with --ranks "
                         "1,3,5,7, --root 3 is world rank 7)")
    ap.add_argument("--itemsize", type=int, default=4, help="bytes per element (default 4)")
    ap.add_argument("-o", "--output", default=None, metavar="FILE", type=picture_path,
                    help="write a picture (.svg, .png or .pdf) instead of printing text")
    ap.add_argument("--width", type=int, default=None,
                    help="text width (default: the terminal's)")
    return ap


def main(argv=None) -> int:
    """``ringlet draw COLLECTIVE -n P --algo A [-o FILE.svg|png]``."""
    import sys

    from . import algorithms

    a = _parser().parse_args(argv)
    try:
        try:
            ranks = [int(x) for x in a.ranks.split(",")] if a.ranks else None
        except ValueError:
            raise ValueError(f"--ranks takes comma-separated world ranks, e.g. 1,3,5,7; got "
                             f"{a.ranks!r}") from None
        p = len(ranks) if ranks else a.nranks
        if p < 2:     # (as explain and bench: it drew a header of 0 rounds)
            raise ValueError(f"-n (group size) must be >= 2, got {p}: on one rank a call "
                             f"moves nothing, whatever the algorithm")
        if a.itemsize < 1:
            raise ValueError(f"--itemsize must be >= 1, got {a.itemsize}")
        if ranks and len(set(ranks)) != len(ranks):
            raise ValueError(f"--ranks names a rank twice: {a.ranks}")
        coll = a.collective
        if coll not in algorithms.CATALOG:
            raise ValueError(f"unknown collective {coll!r}; valid: {', '.join(algorithms.CATALOG)}")
        hosts = host_layout(a.hosts, p) if a.hosts is not None else None
        nbytes = max(a.size, 0)
        topology = a.tier
        if a.tier is not None and hosts is not None:    # as `ringlet explain` prices it
            from .cost.model import TIERS
            topology = Topology.from_host_ids(hosts, TIERS["nvlink"], a.tier)
        if a.algo is None:      # what algorithm="auto" would run: the least predicted time
            from .cost import choose
            algo = choose(coll, nbytes, p, topology=topology,
                          hosts=hosts if topology is None else None, itemsize=a.itemsize)[0]
        else:
            algo = a.algo
        if algo == "hierarchical" and hosts is None:   # (it drew the flat ring, unsaid)
            raise ValueError("hierarchical spans several hosts: say how many with --hosts "
                             "(on one host it is the flat ring)")
        count = count_of(coll, p, nbytes, a.itemsize)
        drawn, unit = nbytes_of(coll, p, count, a.itemsize), nbytes_of(coll, p, 1, a.itemsize)
        if unit and drawn != nbytes:     # (whole elements per block: said, not rounded unsaid)
            print(f"ringlet draw: note: {coll} at p = {p} moves whole multiples of {unit} B "
                  f"({a.itemsize} B elements{' per block' if unit > a.itemsize else ''}); "
                  f"--size {nbytes} is drawn as {drawn} B", file=sys.stderr)
        splits = ((count,) * p,) * p if coll == "all_to_all_single" else None
        s = algorithms.build(coll, algo, p, count, itemsize=a.itemsize, root=a.root,
                             hosts=hosts, splits=splits)
        d = prepare(s, topology, ranks)
        if a.output:
            picture(d, a.output)
            print(f"wrote {a.output}: {d.title}")
        else:
            print(text(d, a.width))
    except ValueError as exc:
        print(f"ringlet draw: error: {exc}", file=sys.stderr)
        return 2
    return 0
