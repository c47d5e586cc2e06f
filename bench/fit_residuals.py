"""Where the host model misses the timings it was fitted to: a profile's saved timings
priced again by its fitted model, the signed error broken down by group.

    python bench/fit_residuals.py [PROFILE] [--transport shm] [--by collective,size]

PROFILE defaults to this machine's (``ringlet calibrate`` saves the timings it fitted;
``ringlet calibrate --refit`` fits them again after a change of the model). Groups:
collective, algorithm (collective/algorithm), p, size (<= 64 KiB, 256 KiB, 1 MiB,
>= 4 MiB), buffers (plain or rl.empty), and any comma-joined combination. A group whose
median signed error is far from 0 is one the model prices systematically wrong (sign:
+ predicted too long); the median of |error| alone hides that. Measures nothing.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ringlet.algorithms import build  # noqa: E402
from ringlet.cost import load_profile  # noqa: E402
from ringlet.cost.model import count_of  # noqa: E402
from ringlet.cost.simulate import Topology, simulate  # noqa: E402


def band(nbytes: int) -> str:
    return ("<=64K" if nbytes <= 64 << 10 else "256K" if nbytes <= 256 << 10
            else "1M" if nbytes <= 1 << 20 else ">=4M")


KEYS = {"collective": lambda t: t["collective"],
        "algorithm": lambda t: f"{t['collective']}/{t['algorithm']}",
        "p": lambda t: t["p"], "size": lambda t: band(t["nbytes"]),
        "buffers": lambda t: "rl.empty" if t["shared"] else "plain"}


def errors(prof, transport: str) -> list:
    """Every saved timing of ``transport`` with the fitted model's (predicted - measured)
    / measured."""
    t = prof.transports.get(transport, {})
    model = prof.host_model(transport)
    if model is None or not t.get("timings"):
        raise SystemExit(f"{prof.source}: no host model with saved timings for {transport}")
    out = []
    for s in t["timings"]:
        p = int(s["p"])
        sched = build(s["collective"], s["algorithm"], p,
                      count_of(s["collective"], p, int(s["nbytes"])), itemsize=4)
        pred = simulate(sched, Topology.on_host(p, model), shared=tuple(s["shared"])).time
        out.append(dict(s, err=(pred - s["seconds"]) / s["seconds"]))
    return out


def table(rows, by: str) -> str:
    keys = by.split(",")
    for k in keys:
        if k not in KEYS:
            raise SystemExit(f"unknown group {k!r}; valid: {', '.join(KEYS)}")
    groups = collections.defaultdict(list)
    for r in rows:
        groups[tuple(KEYS[k](r) for k in keys)].append(r["err"])
    lines = [f"{'/'.join(keys):<44} {'n':>4} {'median |err|':>13} {'median err':>11}"]
    for g in sorted(groups, key=str):
        e = groups[g]
        lines.append(f"{' '.join(map(str, g)):<44} {len(e):>4} "
                     f"{statistics.median(map(abs, e)) * 100:>12.1f}% "
                     f"{statistics.median(e) * 100:>+10.1f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", nargs="?", default=None)
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--by", action="append", default=None,
                    help="a group (or comma-joined groups); repeat for several tables "
                         "(default: collective, algorithm, p, size, buffers)")
    a = ap.parse_args(argv)
    prof = load_profile(a.profile, strict=True)
    rows = errors(prof, a.transport)
    print(f"{prof.source}, {a.transport}: {len(rows)} timings, median |err| "
          f"{statistics.median(abs(r['err']) for r in rows) * 100:.1f}% (+: predicted long)")
    for by in a.by or list(KEYS):
        print()
        print(table(rows, by))
    return 0


if __name__ == "__main__":
    sys.exit(main())
