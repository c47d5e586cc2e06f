"""``ringlet trace merge|summary DIR``: one job's per-rank traces (:mod:`ringlet.tracing`)
as a Chrome/Perfetto timeline, or as who-waited-for-whom text.

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

from .cost.model import format_size

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
            events = [json.loads(line) for line in f if line.strip()]
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
                args = {"algorithm": c["algo"], "bytes": c["bytes"], "group": c["group"],
                        "seq": c["seq"], "ranks": c["p"]}
            args.update(path=c["path"], measured_us=round(dur, 2),
                        waited_us=round(c["waited"] * 1e6, 2), waited_on_rank=c["waited_on"])
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
    """Per collective call, who arrived last and who waited on whom; per pair of ranks,
    their point-to-point messages and the time waited; then the ranks everyone waited for
    most, summed over the job (a straggler leads that list)."""
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
    blamed_calls = defaultdict(int)
    lines = []
    order = sorted(calls.items(), key=lambda kv: min(c["start_us"] for c in kv[1].values()))
    for (group, seq), by_rank in order:
        any_c = next(iter(by_rank.values()))
        last = max(by_rank, key=lambda r: by_rank[r]["start_us"])
        first_in = min(c["start_us"] for c in by_rank.values())
        waits = []
        for r, c in sorted(by_rank.items()):
            w = c["waited"] * 1e6
            if c["waited_on"] is not None and w >= 1.0:
                blame[c["waited_on"]] += w
                blamed_calls[c["waited_on"]] += 1
                waits.append(f"rank {r} waited on rank {c['waited_on']} for {_us(w)}")
        pred = any_c.get("predicted")
        took = max(c["end_us"] for c in by_rank.values()) - first_in
        lines.append(f"{any_c['coll']} #{seq} of {group} ({any_c['algo']}, "
                     f"{format_size(any_c['bytes'])}): {_us(took)} from first entry to last "
                     f"exit" + (f", model {_us(pred * 1e6)}" if pred is not None else "")
                     + f"; last in: rank {last} "
                     f"(+{_us(by_rank[last]['start_us'] - first_in)})")
        lines.extend(f"    {w}" for w in waits)
    n = len(order)
    shown = lines if n <= top else _first_calls(lines, top)
    out = [f"{n} collective calls on {len(ranks)} ranks ("
           + (f"first {top} shown; " if n > top else "") + "times in us, ms or s)"] + shown
    if p2p:
        out.append("")
        out.append(f"point-to-point, per rank and peer ({sum(map(len, p2p.values()))} calls):")
    for (r, peer, kind), cs in sorted(p2p.items()):
        w = [c["waited"] * 1e6 for c in cs]
        total = sum(w)
        if total >= 1.0:
            blame[peer] += total
            blamed_calls[peer] += sum(x >= 1.0 for x in w)
        out.append(f"  rank {r} {'sent to' if kind == 'send' else 'received from'} rank {peer}: "
                   f"{len(cs)} messages, {format_size(sum(c['bytes'] for c in cs))}; "
                   f"waited on rank {peer} for {_us(total)} (longest {_us(max(w))})")
    if blame:
        out.append("")
        out.append("waited on, summed over the job (a straggler leads):")
        for r, t in sorted(blame.items(), key=lambda kv: -kv[1]):
            out.append(f"  rank {r}: {_us(t)} in {blamed_calls[r]} waits")
    return "\n".join(out)


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
    if t < 1000:
        return f"{t:.0f} us"
    if t < 1e6:
        return f"{t / 1e3:.3g} ms"
    return f"{t / 1e6:.3g} s"


def main(argv=None) -> int:
    """``ringlet trace merge DIR -o job.json`` / ``ringlet trace summary DIR``."""
    ap = argparse.ArgumentParser(
        prog="ringlet trace",
        description="Read the per-rank traces a job wrote (RINGLET_TRACE=DIR, ringlet run "
                    "--trace DIR, or `with rl.trace(DIR):`).")
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("merge", help="one Chrome/Perfetto trace-event JSON for the job")
    m.add_argument("dir")
    m.add_argument("-o", "--output", default="job.json", help="default job.json")
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
        else:
            print(summary(a.dir, a.calls))
    except BrokenPipeError:
        raise                       # the reader went away: ringlet.cli stops quietly
    except (ValueError, OSError) as exc:
        print(f"ringlet trace: error: {exc}", file=sys.stderr)
        return 2
    return 0


__all__ = ["load", "merge", "summary", "main"]
