"""``ringlet trace merge|summary|plot DIR``: one job's per-rank traces
(:mod:`ringlet.tracing`) as a Chrome/Perfetto timeline, as who-waited-for-whom text, or as
a picture.

merge writes the Trace Event Format (JSON; open it at ui.perfetto.dev or chrome://tracing):
a process per rank with three tracks — "calls" (each collective as measured, its
arguments: algorithm, bytes, group, sequence number, time waited and on whom, path),
"predicted" (the cost model's duration of the same call, from the same start, so a bar
longer above than below is a call slower than the model) and "messages" (each send and
receive, with its protocol path) — and a flow arrow from every send to its receive.
A send is matched to the receive of the same (sender, receiver, call tag) in order.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict

from .cost.model import format_size, format_time
from .plotting import output_path, picture_path

TRACKS = {"calls": 1, "predicted": 2, "messages": 3}


def load(directory: str) -> dict[int, dict]:
    """{rank: {"header": {...}, "calls": [...], "msgs": [...]}} with every time turned
    into microseconds since the earliest rank's start on the wall clock."""
    files = sorted(glob.glob(os.path.join(directory, "rank*.jsonl")))
    if not files:
        raise ValueError(f"no rank*.jsonl traces in {directory!r} (record them with "
                         f"RINGLET_TRACE={directory} or `ringlet run --trace {directory}`)")
    ranks = {}
    for path in files:
        with open(path) as f:
            lines = [line for line in f if line.strip()]
        events = []
        for i, line in enumerate(lines):
            try:
                events.append(json.loads(line))
            except ValueError as exc:
                if i == len(lines) - 1:   # (a rank killed while it wrote its trace)
                    break
                raise ValueError(f"{path} line {i + 1} is not a trace record ({exc})") from None
        if not events or events[0].get("ev") != "header":
            raise ValueError(f"{path} is not a ringlet trace (no header line)")
        head = events[0]
        ranks[head["rank"]] = {"header": head,
                               "calls": [e for e in events if e["ev"] == "call"],
                               "msgs": [e for e in events if e["ev"] in ("send", "recv")]}
    origin = min(r["header"]["wall0"] for r in ranks.values())
    for r in ranks.values():
        h = r["header"]
        shift = h["wall0"] - h["mono0"] - origin     # monotonic -> seconds since origin
        for c in r["calls"]:
            c["start_us"] = (c["start"] + shift) * 1e6
            c["end_us"] = (c["end"] + shift) * 1e6
        for m in r["msgs"]:
            m["ts_us"] = (m["ts"] + shift) * 1e6
    return ranks


def _pairs(ranks: dict) -> list[tuple[dict, dict, int, int]]:
    """(send, recv, sender, receiver): the k-th send from a to b of a call tag with the
    k-th receive at b from a of that tag."""
    recvs = defaultdict(list)
    for r, d in ranks.items():
        for m in d["msgs"]:
            if m["ev"] == "recv":
                recvs[(m["peer"], r, m["tag"])].append(m)
    seen = defaultdict(int)
    out = []
    for r, d in sorted(ranks.items()):
        for m in d["msgs"]:
            if m["ev"] != "send":
                continue
            key = (r, m["peer"], m["tag"])
            k = seen[key]
            seen[key] += 1
            if k < len(recvs[key]):
                out.append((m, recvs[key][k], r, m["peer"]))
    return out


def merge(directory: str) -> dict:
    """The job's timeline as a Trace Event Format object (see the module docstring)."""
    ranks = load(directory)
    # each collective call's last rank in, named on every rank's bar: the rank whose
    # message ended a wait is often only a neighbour of the straggler (a ring)
    entries = defaultdict(dict)
    for r, d in ranks.items():
        for c in d["calls"]:
            if c["seq"] is not None:
                entries[(c["group"], c["seq"])][r] = c["start_us"]
    ev = []
    for r, d in sorted(ranks.items()):
        h = d["header"]
        ev.append({"ph": "M", "name": "process_name", "pid": r,
                   "args": {"name": f"rank {r} ({h['host']}, pid {h['pid']})"}})
        ev.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
        for name, tid in TRACKS.items():
            ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid,
                       "args": {"name": name}})
        for c in d["calls"]:
            dur = c["end_us"] - c["start_us"]
            if c["seq"] is None:           # point-to-point
                title = (f"{c['coll']} {'->' if 'send' in c['coll'] else '<-'} r{c['peer']} "
                         f"({format_size(c['bytes'])}, tag {c['user_tag']})")
                args = {"peer": c["peer"], "tag": c["user_tag"], "bytes": c["bytes"],
                        "group": c["group"]}
            else:
                title = f"{c['coll']} #{c['seq']} ({c['algo']}, {format_size(c['bytes'])})"
                by_rank = entries[(c["group"], c["seq"])]
                last = max(by_rank, key=by_rank.get)
                args = {"algorithm": c["algo"], "bytes": c["bytes"], "group": c["group"],
                        "seq": c["seq"], "ranks": c["p"], "last_in_rank": last,
                        "last_in_after_first_us": round(by_rank[last] - min(by_rank.values()), 2)}
            args.update(path=c["path"], measured_us=round(dur, 2),
                        waited_us=round(c["waited"] * 1e6, 2),
                        wait_ended_by_rank=c["waited_on"])
            if c.get("predicted") is not None:
                args["predicted_us"] = round(c["predicted"] * 1e6, 2)
            if "error" in c:
                args["error"] = c["error"]
            ev.append({"ph": "X", "name": title, "cat": "call", "pid": r, "tid": 1,
                       "ts": c["start_us"], "dur": dur, "args": args})
            if c.get("predicted") is not None:
                ev.append({"ph": "X", "name": f"{title.split(' (')[0]} predicted",
                           "cat": "predicted", "pid": r, "tid": 2, "ts": c["start_us"],
                           "dur": c["predicted"] * 1e6, "args": {"measured_us": round(dur, 2)}})
    pairs = _pairs(ranks)
    path_of_recv = {id(rv): s["path"] for s, rv, _, _ in pairs}
    for r, d in sorted(ranks.items()):
        for m in d["msgs"]:
            path = m["path"] or path_of_recv.get(id(m), "?")
            arrow = "->" if m["ev"] == "send" else "<-"
            ev.append({"ph": "X", "name": f"{m['ev']} {arrow} r{m['peer']} "
                       f"{format_size(m['bytes'])} ({path})", "cat": "message", "pid": r,
                       "tid": 3, "ts": m["ts_us"], "dur": 1,
                       "args": {"peer": m["peer"], "bytes": m["bytes"], "path": path,
                                "call_seq": m["seq"]}})
    for i, (s, rv, a, b) in enumerate(pairs):
        ev.append({"ph": "s", "id": i, "name": "message", "cat": "flow", "pid": a, "tid": 3,
                   "ts": s["ts_us"]})
        ev.append({"ph": "f", "bp": "e", "id": i, "name": "message", "cat": "flow", "pid": b,
                   "tid": 3, "ts": max(rv["ts_us"], s["ts_us"])})
    return {"traceEvents": ev, "displayTimeUnit": "ns",
            "otherData": {"ranks": len(ranks), "source": os.path.abspath(directory)}}


# ------------------------------------------------------------------------------ summary

def summary(directory: str, top: int = 20) -> str:
    """Per collective call, who arrived last and who waited on whom: a rank's wait is on
    the last rank in as far as that rank came in after it (its entry explains the wait,
    even when the message that ended it came through another rank), else on the rank it
    heard from last; per pair of ranks, their point-to-point messages and the time waited;
    then the ranks waited on most, summed over the job (a straggler leads that list)."""
    ranks = load(directory)
    calls = defaultdict(dict)          # (group, seq) -> {rank: call}
    p2p = defaultdict(list)            # (rank, peer, send or recv) -> its point-to-point calls
    for r, d in ranks.items():
        for c in d["calls"]:
            if c["seq"] is None:
                p2p[(r, c["peer"], "send" if "send" in c["coll"] else "recv")].append(c)
            else:
                calls[(c["group"], c["seq"])][r] = c
    blame = defaultdict(float)         # rank waited on -> microseconds others waited
    blamed_calls = defaultdict(int)    # ... and in how many waits
    lines = []
    order = sorted(calls.items(), key=lambda kv: min(c["start_us"] for c in kv[1].values()))
    for (group, seq), by_rank in order:
        lines += _call_lines(group, seq, by_rank, blame, blamed_calls)
    n = len(order)
    shown = lines if n <= top else _first_calls(lines, top)
    out = [f"{n} collective calls on {len(ranks)} ranks ("
           + (f"first {top} shown; " if n > top else "") + "times in us, ms or s)"]
    size = max(d["header"].get("world_size", 0) for d in ranks.values())
    absent = sorted(set(range(size)) - set(ranks))
    if absent:    # (a trace is written as its rank exits: one killed leaves none)
        out.append(f"rank(s) {absent} of the job's {size} left no trace: killed before they "
                   f"could write one, or not traced; their calls are missing below")
    failed = [f"{next(iter(by_rank.values()))['coll']} #{seq} of {group} on rank(s) "
              f"{[r for r, c in sorted(by_rank.items()) if c.get('error')]}"
              for (group, seq), by_rank in order if any(c.get("error") for c in by_rank.values())]
    if failed:
        out.append(f"failed: {'; '.join(failed[:5])}" + (" ..." if len(failed) > 5 else ""))
    out += shown
    out += _p2p_lines(p2p, blame, blamed_calls)
    if blame:
        out.append("")
        out.append("waited on, summed over the job (late entries and point-to-point peers; "
                   "a straggler leads):")
        for r, t in sorted(blame.items(), key=lambda kv: -kv[1]):
            out.append(f"  rank {r}: {_us(t)} in {_n(blamed_calls[r], 'wait')}")
    return "\n".join(out)


def _call_lines(group, seq, by_rank: dict, blame, blamed_calls) -> list:
    """One collective call's line and its waits (adding them to ``blame``)."""
    any_c = next(iter(by_rank.values()))
    last = max(by_rank, key=lambda r: by_rank[r]["start_us"])
    first_in = min(c["start_us"] for c in by_rank.values())
    waits = []
    for r, c in sorted(by_rank.items()):
        # The part of r's wait the last rank's late entry explains is on the last rank,
        # whoever r heard from last: in a ring, rank 1 waits for rank 0, which waits for
        # the straggler, and the straggler is the one to name.
        w = c["waited"] * 1e6
        late = by_rank[last]["start_us"] - c["start_us"] if r != last else 0.0
        on_last = min(w, max(late, 0.0))
        via = c["waited_on"]
        if on_last >= 1.0:
            blame[last] += on_last
            blamed_calls[last] += 1
            waits.append(f"rank {r} waited on rank {last} for {_us(on_last)}"
                         + (f" (its last message from rank {via})"
                            if via is not None and via != last else ""))
        elif via is not None and w >= 1.0:
            waits.append(f"rank {r} waited on rank {via} for {_us(w)}")
    pred = any_c.get("predicted")
    took = max(c["end_us"] for c in by_rank.values()) - first_in
    entered = len(by_rank)
    p = any_c.get("p") or entered
    head = (f"{any_c['coll']} #{seq} of {group} ({any_c['algo']}, "
            f"{format_size(any_c['bytes'])}): {_us(took)} from first entry to last "
            f"exit" + (f", model {_us(pred * 1e6)}" if pred is not None else "")
            + (f"; last in: rank {last} (+{_us(by_rank[last]['start_us'] - first_in)})"
               if entered == p else
               f"; entered by {entered} of its {p} ranks only (the others never came, or "
               f"left no trace)"))
    errors = [f"    rank {r} failed: {c['error']}" for r, c in sorted(by_rank.items())
              if c.get("error")]
    return [head] + errors + [f"    {w}" for w in waits]


def _p2p_lines(p2p: dict, blame, blamed_calls) -> list:
    """Per rank and peer, its point-to-point messages and the time waited on the peer
    (added to ``blame``)."""
    if not p2p:
        return []
    out = ["", f"point-to-point, per rank and peer ({sum(map(len, p2p.values()))} calls):"]
    for (r, peer, kind), cs in sorted(p2p.items()):
        w = [c["waited"] * 1e6 for c in cs]
        total = sum(w)
        if total >= 1.0:
            blame[peer] += total
            blamed_calls[peer] += sum(x >= 1.0 for x in w)
        out.append(f"  rank {r} {'sent to' if kind == 'send' else 'received from'} rank {peer}: "
                   f"{_n(len(cs), 'message')}, {format_size(sum(c['bytes'] for c in cs))}; "
                   f"waited on rank {peer} for {_us(total)} (longest {_us(max(w))})")
    return out


# --------------------------------------------------------------------------------- plot

def _label(groups: dict) -> str:
    """A timeline label: each group's calls' numbers ("#1-3 group1[0, 1] #1")."""
    return " ".join(("" if g == "world" else f"{g} ") + f"#{a}" + (f"-{b}" if b != a else "")
                    for g, (a, b) in groups.items())


def plot(directory: str, path: str, max_arrows: int = 3000) -> str:
    """The job's timeline as a picture (for a glance without Perfetto): a lane per rank,
    each call a bar as measured (collectives coloured by kind, point-to-point grey) with
    the model's predicted duration as an outline from the same start, and a line from
    each send to its receive. Returns what it drew, in words."""
    from .plotting import pyplot
    plt = pyplot()
    ranks = load(directory)
    pairs = _pairs(ranks)
    order = sorted(ranks)
    y = {r: len(order) - 1 - i for i, r in enumerate(order)}       # rank 0 on top
    kinds = sorted({c["coll"] for d in ranks.values() for c in d["calls"] if c["seq"] is not None})
    cmap = plt.get_cmap("tab10")
    colour = {k: cmap(i % 10) for i, k in enumerate(kinds)}
    n_calls = sum(len(d["calls"]) for d in ranks.values())
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.7 * len(order)))
    spans = [(c["start_us"] / 1e3, c["end_us"] / 1e3) for d in ranks.values() for c in d["calls"]]
    gap = (max(e for _, e in spans) - min(t for t, _ in spans)) / 60 if spans else 0.0
    char = gap * 60 / 170      # (about 170 characters of a label span the axis)
    for r, d in ranks.items():
        labels: list = []     # [x, {group: [first seq, last seq]}]: calls close together share one
        for c in d["calls"]:
            t0, dur = c["start_us"] / 1e3, (c["end_us"] - c["start_us"]) / 1e3
            col = "0.55" if c["seq"] is None else colour[c["coll"]]
            ax.broken_barh([(t0, max(dur, 1e-4))], (y[r] - 0.3, 0.6), facecolor=col,
                           edgecolor="white", lw=0.8, alpha=0.85, zorder=2)   # calls apart
            if c.get("predicted"):
                ax.broken_barh([(t0, c["predicted"] * 1e3)], (y[r] - 0.38, 0.76),
                               facecolor="none", edgecolor="black", lw=0.6, zorder=3)
            if n_calls <= 60 and c["seq"] is not None:
                # calls whose label would overlap the last one's join it, each group's by
                # its own numbers ("#1-5" had merged a subgroup's #1 into the world's #5)
                if labels and t0 < labels[-1][0] + char * len(_label(labels[-1][1])) + gap:
                    labels[-1][1].setdefault(c["group"], [c["seq"], c["seq"]])[1] = c["seq"]
                else:
                    labels.append([t0, {c["group"]: [c["seq"], c["seq"]]}])
        for x, groups in labels:
            ax.text(x, y[r] + 0.34, _label(groups), fontsize=6, va="bottom", zorder=4)
    for s, rv, a, b in pairs[:max_arrows]:
        ax.annotate("", xy=(max(rv["ts_us"], s["ts_us"]) / 1e3, y[b]),
                    xytext=(s["ts_us"] / 1e3, y[a]), zorder=1,
                    arrowprops=dict(arrowstyle="-|>", lw=0.5, color="0.35", alpha=0.6,
                                    shrinkA=0, shrinkB=0, mutation_scale=6))
    ax.set_yticks([y[r] for r in order])
    ax.set_yticklabels([f"rank {r}" for r in order], fontsize=8)
    ax.set_ylim(-0.7, len(order) - 0.3)
    ax.set_xlabel("ms since the first rank started tracing")
    from matplotlib.patches import Patch
    handles = [Patch(color=colour[k], label=k) for k in kinds]
    if any(c["seq"] is None for d in ranks.values() for c in d["calls"]):
        handles.append(Patch(color="0.55", label="point-to-point"))
    handles.append(Patch(facecolor="none", edgecolor="black", label="predicted by the model"))
    from matplotlib.lines import Line2D
    handles.append(Line2D([], [], color="0.35", lw=0.8,
                          label="message, send -> receive" + (
                              f" (first {max_arrows})" if len(pairs) > max_arrows else "")))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              frameon=False)
    what = (f"{len(order)} ranks, {n_calls} calls, {len(pairs)} messages: each call a bar as "
            f"measured, its predicted time outlined from the same start, a line per message")
    ax.set_title(what, fontsize=9)
    ax.grid(axis="x", color="0.9", zorder=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return what


def _first_calls(lines, top):
    out, calls = [], 0
    for line in lines:
        if not line.startswith("    "):
            calls += 1
            if calls > top:
                break
        out.append(line)
    return out


def _us(t: float) -> str:
    """Microseconds (the trace's unit) for people."""
    return format_time(t * 1e-6)


def main(argv=None) -> int:
    """``ringlet trace merge DIR -o job.json`` / ``ringlet trace summary DIR``."""
    ap = argparse.ArgumentParser(
        prog="ringlet trace",
        description="Read the per-rank traces a job wrote (RINGLET_TRACE=DIR, ringlet run "
                    "--trace DIR, or `with rl.trace(DIR):`).")
    sub = ap.add_subparsers(dest="what", required=True, metavar="merge|summary|plot")
    m = sub.add_parser("merge", help="one Chrome/Perfetto trace-event JSON for the job")
    m.add_argument("dir")
    m.add_argument("-o", "--output", default="job.json", type=output_path,
                   help="default job.json")
    pl = sub.add_parser("plot", help="the timeline as a picture (PNG, SVG or PDF; needs "
                                     "matplotlib)")
    pl.add_argument("dir")
    pl.add_argument("-o", "--output", default="timeline.png", type=picture_path,
                    help="default timeline.png")
    s = sub.add_parser("summary", help="per call: who arrived last, who waited on whom")
    s.add_argument("dir")
    s.add_argument("--calls", type=int, default=20, help="calls listed (default 20)")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if a.what == "merge":
            doc = merge(a.dir)
            with open(a.output, "w") as f:
                json.dump(doc, f)
            n = doc["otherData"]["ranks"]
            print(f"wrote {a.output}: {n} ranks, {len(doc['traceEvents'])} events; open it at "
                  f"https://ui.perfetto.dev or chrome://tracing")
        elif a.what == "plot":
            print(f"wrote {a.output}: {plot(a.dir, a.output)}")
        else:
            print(summary(a.dir, a.calls))
    except BrokenPipeError:
        raise                       # the reader went away: ringlet.cli stops quietly
    except (ValueError, OSError) as exc:
        print(f"ringlet trace: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}" + ("" if k == 1 else "s")


__all__ = ["load", "merge", "summary", "plot", "main"]
