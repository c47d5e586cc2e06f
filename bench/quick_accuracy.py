"""How much less accurate ``ringlet calibrate --quick`` is than the full calibration.

Runs the full calibration (or reads one saved with --save) and ``--runs`` quick ones,
times each, and prices the full run's timings - every experiment, size and group size
it measured - with each profile: the median and 90th percentile of
|predicted / measured - 1|. The full profile was fitted to those very timings, the quick
ones were not: the comparison favours the full profile. The load average is printed
beside each run: on a shared host a quick run's timings measure the other processes too
(the full run waits for quiet spells, up to 30 s a pass, and runs disturbed passes
again). So it also fits --quick's cells with --quick's fit to each pass of the full
run's own timings (and to consecutive pairs, as its two passes): the accuracy its choice
of cells and shorter fit cost, the noise held the same.

    .venv/bin/python bench/quick_accuracy.py [--transports shm] [--quiet 30] [--runs 3]
        [--save full.json | --full full.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def errors(profile, samples, transport):
    from ringlet.cost import predict_host
    out = []
    for s in samples:
        if s["collective"] == "barrier":
            continue
        t = predict_host(s["collective"], s["nbytes"], s["p"], s["algorithm"], transport,
                         profile=profile, shared=tuple(s.get("shared", ())))
        out.append(abs(t / s["seconds"] - 1))
    return sorted(out)


def _line(what, e) -> str:
    return (f"{what}: median error {statistics.median(e) * 100:.1f}%, 90th percentile "
            f"{e[int(0.9 * (len(e) - 1))] * 100:.1f}% ({len(e)} timings)")


def same_timings(samples, transport):
    """Fit --quick's cells with its fit to passes of the full run's own timings (each pass
    alone, and consecutive pairs as --quick's two passes combine them) and price all of
    them: what the quick run's choice of cells and shorter fit lose, with the timings'
    noise held the same. Yields (passes used, sorted errors)."""
    from ringlet import calibrate as cal
    from ringlet.cost.host import HostModel
    from ringlet.cost.profile import FIT_START, Profile, fit_host, machine
    from ringlet.transport import fast, limits
    q = cal.QUICK
    plan = {p: (szs, only) for p, szs, only in cal.jobs(None, None, q["cells"])}

    def wanted(s):
        if s["p"] not in plan:
            return False
        if s["collective"] == "barrier":
            return True
        szs, only = plan[s["p"]]
        nb = min(szs, key=lambda k: abs(k - s["nbytes"]))   # all_gather's: p * (nb // p)
        return (abs(nb - s["nbytes"]) <= nb // 100 + 64
                and (nb not in only or (s["collective"], s["algorithm"]) in only[nb]))
    mc = machine()
    base = HostModel.from_params({**FIT_START, "l2_bytes": mc["l2_bytes"],
                                    "l3_bytes": mc["l3_bytes"], "cores": mc["cores"],
                                    **limits.facts(fast.enabled())[transport]})
    n = min(len(s["passes"]) for s in samples)
    for use in [(k,) for k in range(n)] + [(k, k + 1) for k in range(n - 1)]:
        sub = []
        for s in filter(wanted, samples):
            got = [s["passes"][k] for k in use]
            sub.append(dict(s, seconds=statistics.median(
                t for t in got if t <= 1.5 * min(got))))
        f = fit_host(sub, base, **q["fit"])
        f.pop("predicted")
        yield use, errors(Profile.from_fits({transport: f}), samples, transport)


def _load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--quiet", type=float, default=30.0,
                    help="seconds each pass of the full calibration waits for a quiet host "
                         "(as `ringlet calibrate`: 30)")
    ap.add_argument("--runs", type=int, default=1, help="quick calibrations to run (1)")
    ap.add_argument("--save", default=None, metavar="FILE.json",
                    help="write the full profile and its timings here")
    ap.add_argument("--full", default=None, metavar="FILE.json",
                    help="read the full profile and timings saved by --save instead of "
                         "calibrating again")
    a = ap.parse_args(argv)
    from ringlet import calibrate as cal
    from ringlet.cost.profile import Profile
    trs = [t for t in a.transports.split(",") if t]
    if a.full:
        with open(a.full) as f:
            saved = json.load(f)
        full, samples = Profile.from_dict(saved["full"]), saved["samples"]
        print(f"full calibration read from {a.full} (it took {saved['seconds']:.0f} s, "
              f"{saved.get('load', 'load not recorded')})")
    else:
        load0 = _load()
        t0 = time.monotonic()
        full, samples = cal.calibrate(trs, cal.DEFAULT_RANKS, cal.DEFAULT_SIZES, 0.1,
                                      passes=3, quiet=a.quiet)
        took = time.monotonic() - t0
        print(f"full calibration: {took:.0f} s ({load0} before, {_load()} after)")
        if a.save:
            with open(a.save, "w") as f:
                json.dump({"full": full.to_dict(), "samples": samples, "seconds": took,
                           "load": f"{load0} before, {_load()} after"}, f)
    for tr in trs:
        print(_line(f"{tr}, full profile", errors(full, samples[tr], tr)))
        for use, e in same_timings(samples[tr], tr):
            print("  " + _line(f"--quick's cells and fit on pass(es) {'+'.join(str(k + 1) for k in use)} "
                               f"of these timings", e))
    q = cal.QUICK
    for i in range(a.runs):
        load0 = _load()
        t0 = time.monotonic()
        quick, _ = cal.calibrate(trs, budget=q["budget"], passes=q["passes"], quiet=q["quiet"],
                                 retries=q["retries"], fit=q["fit"], cells=q["cells"],
                                 verbose=False)
        took = time.monotonic() - t0
        print(f"quick calibration {i + 1}: {took:.0f} s ({load0} before, {_load()} after)")
        for tr in trs:
            print("  " + _line(f"{tr}, quick profile", errors(quick, samples[tr], tr)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
