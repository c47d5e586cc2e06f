"""How much less accurate ``ringlet calibrate --quick`` is than the full calibration.

Runs both (full first, then quick), times each, and prices the full run's timings - every
experiment, size and group size it measured - with each profile: the median and 90th
percentile of |predicted / measured - 1|, over all of them and over those inside the quick
run's range (its group sizes and sizes). Run on a quiet machine; takes the two
calibrations' time (minutes).

    .venv/bin/python bench/quick_accuracy.py [--transports shm] [--quiet 30]
"""
from __future__ import annotations

import argparse
import json
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
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--quiet", type=float, default=30.0,
                    help="seconds each pass of the full calibration waits for a quiet host "
                         "(as `ringlet calibrate`: 30)")
    ap.add_argument("--save", default=None, metavar="FILE.json",
                    help="also write both profiles and the full run's timings here")
    a = ap.parse_args(argv)
    from ringlet import calibrate as cal
    trs = [t for t in a.transports.split(",") if t]
    t0 = time.monotonic()
    full, samples = cal.calibrate(trs, cal.DEFAULT_RANKS, cal.DEFAULT_SIZES, 0.1, passes=3,
                                  quiet=a.quiet)
    t_full = time.monotonic() - t0
    q = cal.QUICK
    t0 = time.monotonic()
    quick, _ = cal.calibrate(trs, q["ranks"], q["sizes"], q["budget"], passes=q["passes"],
                             quiet=q["quiet"], retries=q["retries"], fit=q["fit"])
    t_quick = time.monotonic() - t0
    print(f"full calibration {t_full:.0f} s, quick {t_quick:.0f} s")
    if a.save:
        with open(a.save, "w") as f:
            json.dump({"full": full.to_dict(), "quick": quick.to_dict(), "samples": samples,
                       "seconds": {"full": t_full, "quick": t_quick}}, f)
    inside = {tr: [s for s in samples[tr] if s["p"] in q["ranks"]
                   and s["nbytes"] <= max(q["sizes"])] for tr in trs}
    for tr in trs:
        for what, smp in (("the full run's", samples[tr]),
                          ("the quick run's range of the full run's", inside[tr])):
            for name, prof in (("full", full), ("quick", quick)):
                e = sorted(errors(prof, smp, tr))
                if e:
                    print(f"{tr} {name:>5} profile on {what} {len(e)} timings: median error "
                          f"{statistics.median(e) * 100:.1f}%, 90th percentile "
                          f"{e[int(0.9 * (len(e) - 1))] * 100:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
