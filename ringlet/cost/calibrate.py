"""``ringlet calibrate``: measure this host's alpha, beta, gamma per transport and save them.

For each transport (``shm``: shared memory between local ranks; ``tcp``: sockets, what
ranks on different hosts use) a small job of ``p`` local ranks times a few collectives
whose critical path is known exactly from the closed forms (barrier: one empty message;
broadcast/binomial: messages of n bytes; all_reduce ring, direct and recursive_doubling:
messages plus reductions and local copies). Each timing becomes a sample ``(messages,
bytes, reduce_bytes, seconds, copy_bytes)`` - critical-path counts of the very schedule,
priced by the simulator with one unit cost at a time - and :func:`ringlet.cost.fit`
solves for alpha, beta, gamma, delta by non-negative least squares on relative error. The profile (JSON, see :mod:`ringlet.cost.profile`) is saved to the user
cache directory, where predictions, ``ringlet explain`` and ``algorithm="auto"`` find it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from .model import Link, format_size, parse_size
from .profile import Profile, fit, profile_path

#: (collective, algorithm) timed per size; barrier only once (it moves no bytes)
EXPERIMENTS = (("broadcast", "binomial"), ("all_reduce", "ring"), ("all_reduce", "direct"),
               ("all_reduce", "recursive_doubling"))
DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
BACKEND = {"shm": None, "tcp": "tcp"}
_UNIT_LAT = Link(1.0, 1e300)   # counts messages
_UNIT_BW = Link(0.0, 1.0)      # counts bytes
_UNIT_ZERO = Link(0.0, 1e300)  # free messages


def critical_counts(collective: str, algorithm: str, nbytes: int, p: int,
                    itemsize: int = 4) -> tuple[float, float, float, float]:
    """(messages, bytes, reduce bytes, local copy bytes) on the critical path of one call:
    the schedule priced with one unit cost at a time (on a uniform link the simulator
    equals the closed forms, and it also sees the local copies)."""
    from ringlet.algorithms import build
    from .model import count_of
    from .simulate import Topology, simulate
    s = build(collective, algorithm, p, count_of(collective, p, nbytes, itemsize), itemsize=itemsize)
    msgs = simulate(s, Topology.uniform(p, _UNIT_LAT)).time
    byts = simulate(s, Topology.uniform(p, _UNIT_BW)).time
    red = simulate(s, Topology.uniform(p, _UNIT_ZERO, gamma=1.0)).time
    cp = simulate(s, Topology.uniform(p, _UNIT_ZERO, delta=1.0)).time
    return round(msgs), byts, red, cp


def _child(rank, out_path, sizes, budget, max_reps):
    """Runs in every rank of the calibration job; rank 0 writes the timings."""
    import numpy as np

    import ringlet as rl
    p = rl.get_world_size()
    rows = []

    def timed(call):
        for _ in range(2):                       # warm up: schedules, segments, caches
            call()
        # every rank must run the same number of repetitions: agree on the slowest estimate
        t0 = time.perf_counter()
        call()
        est = np.array([time.perf_counter() - t0])
        rl.all_reduce(est, op=rl.ReduceOp.MAX, algorithm="direct")
        reps = int(min(max_reps, max(3, budget // max(float(est[0]), 1e-9))))
        ts = []
        for _ in range(reps):
            rl.barrier()
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts), reps

    t, reps = timed(rl.barrier)
    rows.append(("barrier", "dissemination", 0, t, reps))
    for nb in sizes:
        buf = np.zeros(max(nb // 4, 1), np.float32)
        for coll, alg in EXPERIMENTS:
            if coll == "broadcast":
                t, reps = timed(lambda: rl.broadcast(buf, 0, algorithm=alg))
            else:
                t, reps = timed(lambda: rl.all_reduce(buf, algorithm=alg))
            rows.append((coll, alg, buf.nbytes, t, reps))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"p": p, "rows": rows}, f)


def measure(transport: str, p: int = 2, sizes=DEFAULT_SIZES, budget: float = 0.3,
            max_reps: int = 50, timeout: float = 600.0) -> list[dict]:
    """Time the calibration experiments on ``transport`` with ``p`` local ranks; returns
    samples (dicts with collective, algorithm, p, nbytes, seconds, reps, n_messages,
    bytes, reduce_bytes) ready for :func:`fit`."""
    if transport not in BACKEND:
        raise ValueError(f"unknown transport {transport!r}; valid: {', '.join(BACKEND)}")
    from ..launch import spawn
    fd, path = tempfile.mkstemp(prefix="ringlet-calibrate-", suffix=".json")
    os.close(fd)
    try:
        spawn(_child, p, args=(path, tuple(int(s) for s in sizes), float(budget), int(max_reps)),
              backend=BACKEND[transport], timeout=timeout)
        with open(path) as f:
            data = json.load(f)
    finally:
        os.unlink(path)
    samples = []
    for coll, alg, nb, t, reps in data["rows"]:
        m, b, r, c = critical_counts(coll, alg, nb, data["p"])
        samples.append({"collective": coll, "algorithm": alg, "p": data["p"], "nbytes": nb,
                        "seconds": t, "reps": reps, "n_messages": m, "bytes": b,
                        "reduce_bytes": r, "copy_bytes": c})
    return samples


def calibrate(transports=("shm", "tcp"), p: int = 2, sizes=DEFAULT_SIZES, budget: float = 0.3,
              verbose: bool = True) -> tuple[Profile, dict]:
    """Measure and fit every transport; returns (profile, samples by transport)."""
    fits, all_samples = {}, {}
    for tr in transports:
        if verbose:
            print(f"measuring {tr} with {p} ranks ...", flush=True)
        samples = measure(tr, p, sizes, budget)
        f = fit(samples)
        f["p"] = p
        fits[tr] = f
        all_samples[tr] = samples
    return Profile.from_fits(fits, sizes=list(sizes)), all_samples


def report(profile: Profile, samples: dict) -> str:
    lines = []
    for tr, t in profile.transports.items():
        res = t.get("residuals", {})
        lines.append(f"{tr}: alpha {t['alpha'] * 1e6:.2f} us, bandwidth {1 / t['beta'] / 1e9:.3g} GB/s"
                     f" (beta {t['beta']:.3g} s/B), gamma {t['gamma']:.3g} s/B reduced,"
                     f" delta {t.get('delta', 0):.3g} s/B copied;"
                     f" residuals: median {res.get('median_rel', 0) * 100:.1f}%,"
                     f" max {res.get('max_rel', 0) * 100:.1f}%, rms {res.get('rms', 0) * 1e6:.1f} us"
                     f" over {t.get('samples', 0)} timings")
        link = profile.link(tr)
        out = set(t.get("outliers", []))
        for i, s in enumerate(samples.get(tr, [])):
            pred = (s["n_messages"] * link.alpha + s["bytes"] * link.beta
                    + s["reduce_bytes"] * t["gamma"] + s.get("copy_bytes", 0) * t.get("delta", 0))
            lines.append(f"    {s['collective'] + '/' + s['algorithm']:<32}{format_size(s['nbytes']):>10}"
                         f"  measured {s['seconds'] * 1e6:>10.1f} us  model {pred * 1e6:>10.1f} us"
                         f"  ({(pred / s['seconds'] - 1) * 100:+.0f}%)"
                         + ("  outlier, not fitted" if i in out else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="ringlet calibrate",
        description="Measure alpha (s/message), beta (s/byte) and gamma (s/byte reduced) of "
                    "this host's transports by timing small collectives with local ranks, fit "
                    "them by least squares, and save the profile predictions use by default.")
    ap.add_argument("-n", "--nranks", type=int, default=2, help="ranks per experiment (default 2)")
    ap.add_argument("--transports", default="shm,tcp", help="comma-separated: shm, tcp")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated sizes (default 4K,64K,1M,4M,16M)")
    ap.add_argument("--budget", type=float, default=0.3,
                    help="seconds of repetitions per experiment (default 0.3)")
    ap.add_argument("--output", default=None, help=f"profile path (default {profile_path()})")
    ap.add_argument("--dry-run", action="store_true", help="measure and print, do not save")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        sizes = [parse_size(s) for s in a.sizes.split(",")] if a.sizes else list(DEFAULT_SIZES)
        transports = [t for t in a.transports.split(",") if t]
        for t in transports:
            if t not in BACKEND:
                raise ValueError(f"unknown transport {t!r}; valid: {', '.join(BACKEND)}")
        if a.nranks < 2:
            raise ValueError("calibration needs at least 2 ranks")
    except ValueError as exc:
        print(f"ringlet calibrate: error: {exc}", file=sys.stderr)
        return 2
    prof, samples = calibrate(transports, a.nranks, sizes, a.budget)
    print(report(prof, samples))
    if not a.dry_run:
        if a.output is None:
            from .profile import load_profile
            old = load_profile()
            if old.calibrated:  # keep transports this run did not measure
                for name, t in old.transports.items():
                    prof.transports.setdefault(name, t)
        path = prof.save(a.output)
        print(f"saved {path}")
    return 0


__all__ = ["calibrate", "measure", "critical_counts", "report", "main"]
