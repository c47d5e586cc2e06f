#!/usr/bin/env python3
"""How well does the cost model predict ringlet's collectives on this host? (issue 4,
"Accuracy on this host"; issue 27, "Prediction truth").

    python3 bench/accuracy.py [--calibrate] [--quick] [--json FILE] [--repeats 2]

1. Loads the calibrated profile (``ringlet calibrate --transports shm,tcp`` first, if there
   is none or ``--calibrate`` is given).
2. Measures EVERY algorithm of broadcast, reduce, all_reduce, all_gather, reduce_scatter,
   all_to_all, gather and scatter (``hierarchical`` needs several hosts: bench/hosts.py)
   with ringlet's real runtime on the cells of ``GRID``: transport (shared memory, or TCP
   between the same local ranks), buffers (plain NumPy arrays, or ``rl.empty`` ones, whose
   large messages are read in place), group size p and size (the size convention of
   ``ringlet.cost.model``: the per-rank buffer, or the gathered total for all_gather,
   reduce_scatter, gather and scatter). Float32, SUM where a collective reduces.
   One job (fresh local ranks) per (repeat, transport, p) runs all of its cells; inside a
   cell the algorithms run in ``--blocks`` interleaved blocks, each in its own shuffled
   order, so that a slow spell of the host hits all of them alike. A block gives each
   algorithm the median over its timed calls (barrier, time one call) of the SLOWEST rank
   (``ringlet bench``'s method); see ``cell_times`` for how blocks and repeats combine.
   Where the ranks fit the cores each is pinned to one, as ``ringlet bench`` and mpirun
   place them (``--no-pin``: not): unpinned, the two ranks of p = 2 on a busy host may
   share one core for a whole job. Same-run repeatability (two runs of QUICK_GRID's p = 2
   and p = 3 cells back to back, others holding 1.5-1.8 of the 2 cores, load average
   17-25): 42.5% apart per (algorithm, cell), median, unpinned with 2-50 calls per block
   and the old combination of blocks; 25.2% pinned, 3-100 calls, the fastest block
   (shm plain p = 2: 36% -> 16%, TCP p = 2: 45% -> 22%, rl.empty p = 2: 47% -> 35%;
   p = 3, unpinned in both: 40% -> 52%, noise). More ranks than cores (p = 3-6 on 2) are not pinned:
   their time is the scheduler's, which the model prices as processor sharing
   (``HostModel``: beta_share, beta_crowd, alpha_crowd, idle_share, imbalance).
   The same job also asks the runtime what ``algorithm="auto"`` runs in every cell.
3. Predicts each with the cost model (``ringlet.cost.predict_host``: the calibrated
   profile, the simulator on the very schedule the runtime runs) and prints, per
   collective: the median relative error |pred - meas| / meas, the fraction of cells
   where the predicted winner is within 10% of the best measured algorithm, and the
   fraction where auto's pick is, with the worst loss when it is not.
4. With ``--tune N``, each job runs with RINGLET_TUNE=N: after a cell's blocks, the tuner
   (ringlet/tuning.py) times auto's candidates on calls of its own (two blocks of 1 + N
   each, inputs written and a barrier before each call, as the blocks' calls) and keeps
   the fastest where it beat the model's pick by more than 10%;
   each job's pick is judged against the blocks' times as auto's is ("tuned ok": of the
   jobs' picks, not of cells).

``--quick`` measures a subset (QUICK_GRID: fewer sizes and group sizes, one repeat; with
``--calibrate``, ``ringlet calibrate --quick``) for a loaded host.
``--from-json FILE`` re-predicts the measurements of an earlier ``--json`` run with the
current model (no new measurements; for developing the model).
Targets (issue 27): per collective median error <= 10%, predicted winner and auto's pick
within 10% of the best in >= 95% of cells.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ringlet.cost import ALGORITHMS, format_size, load_profile, predict_host, profile_path  # noqa: E402
from ringlet.cost.model import HOST_AWARE, count_of, nbytes_of  # noqa: E402

COLLECTIVES = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter",
               "all_to_all", "gather", "scatter")
#: every algorithm that runs on one host
ALGOS = {c: tuple(a for a in ALGORITHMS[c] if (c, a) not in HOST_AWARE) for c in COLLECTIVES}
#: the buffer names of each collective's call (``rl.empty`` ones are "shared")
BUFFERS = {"broadcast": ("buf",), "reduce": ("buf",), "all_reduce": ("buf",),
           "all_gather": ("in", "out"), "reduce_scatter": ("in", "out"),
           "all_to_all": ("in", "out"), "gather": ("in", "out"), "scatter": ("in", "out")}
TARGET_ERR, TARGET_WIN, WIN_SLACK = 0.10, 0.95, 0.10
#: timed calls per algorithm and block (fewest, most): a block's median of 2 calls is
#: their mean, which one preempted call spoils
ITERS = (3, 100)

_K, _M = 1 << 10, 1 << 20
#: (transport, buffers, p, sizes): rl.empty only where a message can be read in place
#: (above ZERO_COPY_MIN); TCP has no rl.empty path; 64 MiB only where it stays short
GRID = (
    [("shm", "plain", p, (8, 64 * _K, _M, 8 * _M) + ((64 * _M,) if p == 2 else ()))
     for p in (2, 3, 4, 5, 6)]
    + [("shm", "empty", p, (_M, 8 * _M) + ((64 * _M,) if p == 2 else ())) for p in (2, 3, 4, 6)]
    + [("tcp", "plain", p, (8, 64 * _K, _M, 8 * _M)) for p in (2, 3, 4)])
QUICK_GRID = (
    [("shm", "plain", p, (8, 64 * _K, _M, 8 * _M)) for p in (2, 4, 6)]
    + [("shm", "empty", p, (_M, 8 * _M)) for p in (2, 4)]
    + [("tcp", "plain", p, (8, 64 * _K, _M)) for p in (2, 4)])


def cells_of(grid) -> list:
    """Every measured cell: (transport, kind, p, nbytes, collective), nbytes the
    collective's size-convention bytes for whole elements (at least one per block)."""
    out = []
    for tr, kind, p, sizes in grid:
        for nb in sizes:
            for c in COLLECTIVES:
                n = nbytes_of(c, p, max(1, count_of(c, p, nb)))
                out.append((tr, kind, p, n, c))
    return out


def shared_of(kind: str, collective: str) -> tuple:
    return BUFFERS[collective] if kind == "empty" else ()


def predict(cell, algorithm, prof=None) -> float:
    tr, kind, p, nb, c = cell
    return predict_host(c, nb, p, algorithm, tr, profile=prof, shared=shared_of(kind, c))


def iters_for(cell, budget: float, lo: int = ITERS[0], hi: int = ITERS[1]) -> int:
    """Timed calls per algorithm and block: about ``budget`` seconds by the model's
    estimate (geometric mean over the algorithms), between ``lo`` and ``hi``."""
    ts = [predict(cell, a) for a in ALGOS[cell[4]]]
    est = math.exp(statistics.fmean(math.log(max(t, 1e-7)) for t in ts))
    return int(max(lo, min(hi, round(budget / est))))


def _buffers(rl, np, kind, c, p, count, rank):
    """The call's arrays: plain NumPy or rl.empty, as the collective takes them."""
    new = (lambda *s: rl.empty(s, np.float32)) if kind == "empty" else \
        (lambda *s: np.empty(s, np.float32))
    if c in ("broadcast", "reduce", "all_reduce"):
        return {"buf": new(count)}
    if c in ("all_gather", "gather"):
        return {"in": new(count), "out": new(p, count)}
    if c in ("reduce_scatter", "scatter"):
        return {"in": new(p, count), "out": new(count)}
    return {"in": new(p, count), "out": new(p, count)}       # all_to_all


def _call(rl, c, b, alg):
    from ringlet.calibrate import run_collective
    run_collective(rl, c, b, alg)


def _auto_pick(c, count, tuned=False):
    """What the runtime ran for the last ``algorithm="auto"`` call of ``c`` with
    ``count`` elements (its cache of prepared calls says): the model's pick, or with
    ``tuned`` the tuner's (None while the shape is still on trial)."""
    from ringlet import collectives, tuning
    got = None
    for key, prep in collectives._CALLS.items():
        if key[0] == c and key[1] == "auto" and key[3] == count:
            if type(prep) is tuning.Trials:     # on trial: the model's pick comes first
                got = None if tuned else prep.first.algorithm
            else:   # the model's pick, the tuner's choice, or the only candidate
                got = prep.algorithm
    return got


def _job(rank, work, out_path, pin=True):
    """One job's rank (pinned to a core as ``ringlet bench`` pins, where the ranks fit the
    cores, with ``pin``): for every cell of ``work`` (kind, nbytes, collective, iters,
    order) one untimed ``auto`` call and ``warmup`` untimed calls of each algorithm, then
    the blocks of ``order``: ``iters`` timed calls each (buffer filled, barrier, time
    the call). Rank 0 writes every (algorithm, block) median of the slowest rank and
    auto's picks. First it sends 8 MiB through every shared-memory ring (a fresh job's
    first lap around a ring page-faults)."""
    import numpy as np

    import ringlet as rl
    from ringlet import tuning
    from ringlet.calibrate import prefault_rings
    from ringlet.bench import bind_like_mpirun
    p = rl.get_world_size()
    if pin:
        bind_like_mpirun(rank, p)
    prefault_rings(rl)
    meds, picks, tuned = [], [], []
    for kind, nb, c, iters, order in work:
        count = max(1, count_of(c, p, nb))
        b = _buffers(rl, np, kind, c, p, count, rank)
        fill = b.get("buf", b.get("in"))
        fill[...] = rank + 1
        _call(rl, c, b, "auto")
        picks.append(_auto_pick(c, count))
        for alg in dict.fromkeys(order):
            _call(rl, c, b, alg)
        for alg in order:
            ts = np.empty(iters)
            for i in range(iters):
                fill[...] = rank + 1
                rl.barrier()
                t0 = time.perf_counter()
                _call(rl, c, b, alg)
                ts[i] = time.perf_counter() - t0
            meds.append(float(np.median(ts)))
        if rl.runtime._S.tune:
            # the tuner's own trials, after the blocks: inputs written and a barrier before
            # each call, as the blocks' calls
            for _ in range(tuning.BLOCKS * (rl.runtime._S.tune + 1) * tuning.MOST):
                if _auto_pick(c, count, tuned=True) is not None:
                    break
                fill[...] = rank + 1
                rl.barrier()
                _call(rl, c, b, "auto")
            tuned.append(_auto_pick(c, count, tuned=True))
        del b, fill
    t = np.array(meds)
    rl.all_reduce(t, op=rl.ReduceOp.MAX, algorithm="direct")
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"medians": t.tolist(), "auto": picks, "tuned": tuned,
                       "decisions": tuning.decisions()}, f)


def block_order(algos, key, block) -> list:
    """The algorithms of one block in a seeded random order: what a call leaves behind
    (caches, page state) must not bias the same successor in every block."""
    order = list(algos)
    random.Random(f"{key}/{block}").shuffle(order)
    return order


def run_job(transport, p, work, timeout=900, pin=True, tune=0):
    import tempfile

    from ringlet.launch import spawn
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "job.json")
        spawn(_job, p, args=(work, path, pin), backend="tcp" if transport == "tcp" else None,
              timeout=timeout, env={"RINGLET_TUNE": str(tune)})
        with open(path) as f:
            return json.load(f)


def measure(grid, repeats=2, blocks=3, budget=0.01, max_load=0.5, retries=1,
            quiet_wait=10.0, verbose=True, pin=True, iters=ITERS, tune=0):
    """({cell: {algorithm: [seconds per block]}}, {cell: [auto's pick per repeat]}, log,
    {cell: [the tuner's pick per repeat]}: with ``tune``, RINGLET_TUNE's timed calls per
    candidate and block, after the blocks).

    One job per (repeat, transport, kind, p) runs all its cells. Before a job we wait
    (up to ``quiet_wait`` s) for other processes to use less than ``max_load`` / 2
    cores; a job during which they used more than ``max_load`` runs again, up to
    ``retries`` times (the machine may be shared)."""
    from ringlet.calibrate import _cpu_seconds, others_load
    samples, autos, log, tuned = {}, {}, [], {}
    jobs = [(rep, tr, kind, p, sizes) for rep in range(repeats)
            for tr, kind, p, sizes in grid]
    t_start = time.time()
    for j, (rep, tr, kind, p, sizes) in enumerate(jobs):
        cells = cells_of([(tr, kind, p, sizes)])
        work = []
        for cell in cells:
            order = []
            for blk in range(blocks):
                order += block_order(ALGOS[cell[4]], (cell, rep), blk)
            work.append((kind, cell[3], cell[4], iters_for(cell, budget, *iters), order))
        for attempt in range(retries + 1):
            deadline = time.time() + quiet_wait
            while others_load(0.2) > max_load / 2 and time.time() < deadline:
                time.sleep(0.5)
            b0, o0 = _cpu_seconds()
            t0 = time.perf_counter()
            try:
                got = run_job(tr, p, work, pin=pin, tune=tune)
            except Exception as exc:      # one failed job must not lose the others' cells
                print(f"\n  job {tr} {kind} p={p} failed: {exc}", file=sys.stderr)
                got = None
                break
            b1, o1 = _cpu_seconds()
            load = max(0.0, (b1 - b0) - (o1 - o0)) / (time.perf_counter() - t0)
            if load <= max_load:
                break
        if got is None:
            log.append({"transport": tr, "kind": kind, "p": p, "repeat": rep, "failed": True,
                        "attempts": attempt + 1, "others_load": 0.0,
                        "seconds": time.perf_counter() - t0})
            continue
        log.append({"transport": tr, "kind": kind, "p": p, "repeat": rep,
                    "attempts": attempt + 1, "others_load": load,
                    "seconds": time.perf_counter() - t0,
                    "tuner": got.get("decisions", [])})
        it = iter(got["medians"])
        for cell, (_, _, c, _, order), pick in zip(cells, work, got["auto"]):
            per = samples.setdefault(cell, {})
            for alg in order:
                per.setdefault(alg, []).append(next(it))
            autos.setdefault(cell, []).append(pick)
        for cell, pick in zip(cells, got.get("tuned", [])):
            tuned.setdefault(cell, []).append(pick)
        if verbose:
            print(f"\r  measured {j + 1}/{len(jobs)} jobs ({time.time() - t_start:.0f} s, "
                  f"others' load {load:.1f})", end="", file=sys.stderr, flush=True)
    if verbose:
        print(file=sys.stderr)
    return samples, autos, log, tuned


def cell_times(per: dict) -> dict:
    """One time per algorithm of a cell from its per-block samples (each the median of
    the block's calls, slowest rank): the least. Other processes only ever add time, and
    on a shared host they spoil whole blocks (and whole jobs); the fastest block is the
    one that saw least of them - what a user of a quiet host sees. Two runs of
    QUICK_GRID's p = 2 cells back to back, others holding 1.5-1.8 of the 2 cores: 25%
    apart per (algorithm, cell), median, against 34% for the median of block-normalised
    ratios used before and 31% for each algorithm's median block."""
    return {a: min(v) for a, v in per.items()}


_TWINS: dict = {}


def twins(cell, algorithms) -> dict:
    """{algorithm: the algorithms of ``algorithms`` whose schedule in ``cell`` is the very
    same one (every round's transfers, in order, and the buffers)}: at p = 2 all_to_all's
    direct and pairwise, or all_gather's ring and direct, move the same bytes in the same
    steps. Measured apart, they differ only by the host's noise (all_to_all p = 2 8 MiB:
    direct 1067 us, pairwise 1755, then 855-5222 us for either from run to run), so a pick
    of one when the other measured best is no miss of the model's."""
    from ringlet import algorithms as algs
    _, _, p, nb, c = cell
    key = (c, p, nb, tuple(algorithms))
    if key not in _TWINS:
        def steps(a):
            sch = algs.build(c, a, p, count_of(c, p, nb), itemsize=4)
            return (tuple(sorted(sch.buffers.items())), sch.agreement,
                    tuple(tuple(rnd.rows()) for rnd in sch.rounds))
        got = {a: steps(a) for a in algorithms}
        _TWINS[key] = {a: [b for b in algorithms if got[b] == got[a]] for a in algorithms}
    return _TWINS[key]


def evaluate(meas: dict, autos: dict, prof=None, other: dict | None = None,
             tuned: dict | None = None) -> dict:
    """Rows (cell, algorithm, measured, predicted, error) and cells (predicted winner,
    measured best, auto's pick, the tuner's pick, their losses) for measured times
    ``meas[cell][alg]``. ``other``: times of another measurement of the same cells taken
    as the prediction, in place of the model's (repeatability)."""
    rows, cells = [], []
    for cell, m in meas.items():
        c = cell[4]
        if other is not None:
            if cell not in other:
                continue
            m = {a: t for a, t in m.items() if a in other[cell]}
        pr = {a: (other[cell][a] if other is not None else predict(cell, a, prof)) for a in m}
        for a in m:
            rows.append({"cell": list(cell), "algorithm": a, "measured_s": m[a],
                         "predicted_s": pr[a], "rel_err": (pr[a] - m[a]) / m[a]})
        order = {a: i for i, a in enumerate(ALGORITHMS[c])}
        pw = min(pr, key=lambda a: (pr[a], order[a]))
        mw = min(m, key=m.get)
        # a pick is judged by the best time its schedule measured under any of its names
        same = twins(cell, list(m))
        m = {a: min(m[b] for b in same[a]) for a in m}
        picks = sorted(a for a in autos.get(cell, []) if a in m)
        auto = max(picks, key=picks.count) if picks else None
        # the tuner decides in each job anew: every job's pick counts
        tuned_picks = [a for a in (tuned or {}).get(cell, []) if a in m]
        tuned_loss = [m[a] / m[mw] - 1 for a in tuned_picks]
        cells.append({"cell": list(cell), "predicted_winner": pw, "measured_winner": mw,
                      "loss": m[pw] / m[mw] - 1, "match": m[pw] <= (1 + WIN_SLACK) * m[mw],
                      "auto": auto, "auto_loss": (m[auto] / m[mw] - 1) if auto else None,
                      "auto_ok": (m[auto] <= (1 + WIN_SLACK) * m[mw]) if auto else None,
                      "tuned": tuned_picks, "tuned_loss": tuned_loss,
                      "tuned_ok": [m[a] <= (1 + WIN_SLACK) * m[mw] for a in tuned_picks]})
    return {"rows": rows, "cells": cells, "summary": summarize(rows, cells)}


def repeatability(samples: dict, blocks: int) -> dict | None:
    """The host's own floor: the first half of the jobs' times of a cell taken as the
    "prediction" of the other half's (cell_times of each half's blocks; both ways round),
    summarized as the model is. With 2 jobs a cell, one job against the other; with 4, a
    2-job measurement against another. Two jobs that each stray from a cell's typical time by e apart differ by
    about e * sqrt(2): a model that knew the typical time exactly would still be off by
    this median over sqrt(2) (the full grid, quiet: one job against another 16.0% apart, so
    ~11% for any model; two jobs against two more 11.7%, so ~8%), and its winner can be no
    surer than a second measurement's.
    None with fewer than two jobs per cell."""
    jobs = [{}, {}]
    for cell, per in samples.items():
        for a, v in per.items():
            half = len(v) // blocks // 2 * blocks
            if half:
                for j in (0, 1):
                    jobs[j].setdefault(cell, {})[a] = min(v[j * half:(j + 1) * half])
    if not jobs[0]:
        return None
    one, two = evaluate(jobs[1], {}, other=jobs[0]), evaluate(jobs[0], {}, other=jobs[1])
    return summarize(one["rows"] + two["rows"], one["cells"] + two["cells"])


def summarize(rows, cells, key=lambda cell: cell[4]) -> dict:
    """Per group (default: collective) and "all": median |error|, winner and auto rates."""
    groups = sorted({key(tuple(r["cell"])) for r in rows}, key=str) + ["all"]
    out = {}
    for gname in groups:
        sel = (lambda cell: True) if gname == "all" else (lambda cell: key(tuple(cell)) == gname)
        errs = [abs(r["rel_err"]) for r in rows if sel(r["cell"])]
        cs = [c for c in cells if sel(c["cell"])]
        au = [c for c in cs if c["auto"] is not None]
        misses = [c["auto_loss"] for c in au if not c["auto_ok"]]
        tu = [(ok, x) for c in cs for ok, x in zip(c.get("tuned_ok", []),
                                                    c.get("tuned_loss", []))]
        tmiss = [x for ok, x in tu if not ok]
        out[str(gname)] = {
            "pairs": len(errs), "median_rel_err": statistics.median(errs) if errs else None,
            "cells": len(cs), "winner_ok": sum(c["match"] for c in cs),
            "auto_cells": len(au), "auto_ok": sum(c["auto_ok"] for c in au),
            "auto_worst_loss": max(misses) if misses else 0.0,
            "tuned_cells": len(tu), "tuned_ok": sum(ok for ok, _ in tu),
            "tuned_worst_loss": max(tmiss) if tmiss else 0.0,
            "winner_worst_loss": max((c["loss"] for c in cs), default=0.0)}
    return out


def _us(t: float) -> str:
    return f"{t * 1e6:.0f}" if t < 10e-3 else f"{t * 1e3:.1f}m"


def _cell_name(cell) -> str:
    tr, kind, p, nb, c = cell
    return f"{tr:<3} {'rl.empty' if kind == 'empty' else 'plain':<8} p={p} {format_size(nb):>7}"


def report(res: dict, detail: bool = True) -> str:
    out = []
    if detail:
        rows = {}
        for r in res["rows"]:
            rows.setdefault(tuple(r["cell"]), []).append(r)
        out.append("measured / predicted us ('m': ms), error (pred - meas) / meas; "
                   "* best measured, ^ predicted winner, A auto's pick, T the tuner's")
        for c in res["cells"]:
            cell = tuple(c["cell"])
            parts = []
            for r in sorted(rows[cell], key=lambda r: r["measured_s"]):
                a = r["algorithm"]
                mark = ("*" if a == c["measured_winner"] else "") + \
                       ("^" if a == c["predicted_winner"] else "") + \
                       ("A" if a == c["auto"] else "") + ("T" * c.get("tuned", []).count(a))
                parts.append(f"{a}{mark} {_us(r['measured_s'])}/{_us(r['predicted_s'])} "
                             f"{r['rel_err'] * 100:+.0f}%")
            flag = "" if c["match"] else f"  WINNER +{c['loss'] * 100:.0f}%"
            if c["auto_ok"] is False:
                flag += f"  AUTO +{c['auto_loss'] * 100:.0f}%"
            for ok, x in zip(c.get("tuned_ok", []), c.get("tuned_loss", [])):
                flag += "" if ok else f"  TUNED +{x * 100:.0f}%"
            out.append(f"{cell[4]:<15}{_cell_name(cell)}: " + ", ".join(parts) + flag)
        out.append("")
    s = res["summary"]
    tuned = any(v.get("tuned_cells") for v in s.values())
    out.append(f"{'collective':<16}{'pairs':>6}{'median err':>11}{'winner ok':>14}"
               f"{'auto ok':>14}{'auto worst':>11}"
               + (f"{'tuned ok':>14}{'tuned worst':>12}" if tuned else ""))
    for g, v in s.items():
        med = v["median_rel_err"]
        out.append(f"{g:<16}{v['pairs']:>6}{(med or 0) * 100:>10.1f}%"
                   f"{v['winner_ok']:>6}/{v['cells']:<3}{v['winner_ok'] / max(v['cells'], 1) * 100:>4.0f}%"
                   f"{v['auto_ok']:>6}/{v['auto_cells']:<3}{v['auto_ok'] / max(v['auto_cells'], 1) * 100:>4.0f}%"
                   f"{v['auto_worst_loss'] * 100:>10.0f}%"
                   + (f"{v['tuned_ok']:>6}/{v['tuned_cells']:<3}"
                      f"{v['tuned_ok'] / max(v['tuned_cells'], 1) * 100:>4.0f}%"
                      f"{v['tuned_worst_loss'] * 100:>11.0f}%" if tuned else ""))
    for name, key in (("transport/buffers", lambda cell: f"{cell[0]}/{cell[1]}"),
                      ("p", lambda cell: f"p={cell[2]}")):
        sub = summarize(res["rows"], res["cells"], key)
        out.append(f"by {name}: " + "; ".join(
            f"{g} {v['median_rel_err'] * 100:.1f}% err, winner {v['winner_ok']}/{v['cells']}, "
            f"auto {v['auto_ok']}/{v['auto_cells']}" for g, v in sub.items() if g != "all"))
    ok = all(v["median_rel_err"] is not None and v["median_rel_err"] <= TARGET_ERR
             and v["winner_ok"] >= TARGET_WIN * v["cells"]
             and v["auto_ok"] >= TARGET_WIN * v["auto_cells"] for v in s.values())
    out.append(f"targets (each collective: median error <= {TARGET_ERR * 100:.0f}%, winner and "
               f"auto within {WIN_SLACK * 100:.0f}% of the best in >= {TARGET_WIN * 100:.0f}% "
               f"of cells): " + ("met" if ok else "NOT met"))
    return "\n".join(out)


def profile_summary(prof) -> str:
    out = []
    for tr in ("shm", "tcp"):
        t = prof.transports.get(tr)
        if not t:
            continue
        res = t.get("residuals", {})
        out.append(f"{tr}: fit residuals median {res.get('median_rel', 0) * 100:.1f}%, "
                   f"max {res.get('max_rel', 0) * 100:.0f}%, other processes' load "
                   f"{t.get('others_load', '?')}")
    return f"profile {prof.source} ({prof.created or 'uncalibrated'}): " + "; ".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibrate", action="store_true",
                    help="run `ringlet calibrate --transports shm,tcp` first")
    ap.add_argument("--quick", action="store_true",
                    help="QUICK_GRID (fewer sizes and group sizes), one repeat, and with "
                         "--calibrate `ringlet calibrate --quick`: for a busy host")
    ap.add_argument("--repeats", type=int, default=None,
                    help="jobs per cell, spread over the run (default 2; --quick 1)")
    ap.add_argument("--blocks", type=int, default=3,
                    help="interleaved blocks of all algorithms per cell and job (3)")
    ap.add_argument("--budget", type=float, default=0.01,
                    help="seconds of timed calls per algorithm and block, by the model (0.01)")
    ap.add_argument("--collectives", default=None, help="comma-separated subset")
    ap.add_argument("--max-load", type=float, default=0.5,
                    help="run a job again if other processes kept this many cores busy")
    ap.add_argument("--no-pin", action="store_true",
                    help="leave the ranks where the scheduler puts them (default: one core "
                         "each where they fit, as ringlet bench and mpirun place them)")
    ap.add_argument("--tune", type=int, default=0,
                    help="also run the tuner (RINGLET_TUNE=N timed calls per candidate and "
                         "block) after each cell's blocks, and judge its pick as auto's is "
                         "(column 'tuned ok')")
    ap.add_argument("--brief", action="store_true", help="only the summary tables")
    ap.add_argument("--json", default=None, help="write measurements, predictions, summary")
    ap.add_argument("--from-json", default=None,
                    help="re-predict the measurements of an earlier --json (no measuring)")
    a = ap.parse_args(argv)
    global COLLECTIVES
    if a.collectives:
        COLLECTIVES = tuple(x for x in a.collectives.split(",") if x)
    t0 = time.time()
    if a.from_json:
        with open(a.from_json) as f:
            old = json.load(f)
        samples = {tuple(m["cell"]): m["samples_s"] for m in old["measurements"]
                   if m["cell"][4] in COLLECTIVES}
        autos = {tuple(m["cell"]): m["auto"] for m in old["measurements"]}
        tuned = {tuple(m["cell"]): m.get("tuned", []) for m in old["measurements"]}
        joblog = old.get("jobs", [])
    else:
        prof = load_profile()
        if a.calibrate or not prof.calibrated:
            from ringlet.calibrate import main as calibrate_main
            why = "--calibrate" if a.calibrate else f"no profile at {profile_path()}"
            print(f"calibrating ({why}) ...", flush=True)
            if calibrate_main(["--transports", "shm,tcp"] + (["--quick"] if a.quick else [])) != 0:
                return 1
        grid = QUICK_GRID if a.quick else GRID
        repeats = a.repeats if a.repeats is not None else (1 if a.quick else 2)
        n = len(cells_of(grid))
        print(f"measuring {len(COLLECTIVES)} collectives, every algorithm, {n} cells, "
              f"{repeats} job(s) x {a.blocks} blocks each ...", flush=True)
        samples, autos, joblog, tuned = measure(grid, repeats, a.blocks, a.budget, a.max_load,
                                                pin=not a.no_pin, tune=a.tune)
        redo = sum(j["attempts"] - 1 for j in joblog)
        loads = [j["others_load"] for j in joblog]
        failed = sum(j.get("failed", False) for j in joblog)
        print(f"{len(joblog)} jobs ({failed} failed) in {time.time() - t0:.0f} s; {redo} run "
              f"again because other "
              f"processes were busy; others' load median {statistics.median(loads):.2f}, max "
              f"{max(loads):.2f} cores; load average {os.getloadavg()[0]:.1f}")
        if statistics.median(loads) > a.max_load:
            print(f"WARNING: other processes kept {statistics.median(loads):.1f} cores busy "
                  f"(median over the jobs) of this machine's {os.cpu_count()}: the timings "
                  f"measure them too; rerun on a quiet machine")
    meas = {cell: cell_times(per) for cell, per in samples.items()}
    prof = load_profile()
    print(profile_summary(prof))
    res = evaluate(meas, autos, prof, tuned=tuned)
    print(report(res, detail=not a.brief))
    floor = repeatability(samples, a.blocks if not a.from_json else old.get("blocks", a.blocks))
    if floor is not None:
        res["repeatability"] = floor
        print("\nthe host's repeatability: half the jobs' times taken as the prediction of the "
              "other half's (both ways round)\n" + "\n".join(
                  f"{g:<16}{v['pairs']:>6}{v['median_rel_err'] * 100:>10.1f}%"
                  f"{v['winner_ok']:>6}/{v['cells']:<3}"
                  f"{v['winner_ok'] / max(v['cells'], 1) * 100:>4.0f}%" for g, v in floor.items()))
    print(f"({time.time() - t0:.0f} s)")
    if a.json:
        doc = {"profile": prof.to_dict(), "profile_source": prof.source,
               "measurements": [{"cell": list(k), "samples_s": v, "auto": autos.get(k, []),
                                 "tuned": tuned.get(k, [])} for k, v in samples.items()],
               "jobs": joblog, "blocks": a.blocks, "pin": not a.no_pin, **res}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {a.json}")
    s = res["summary"]
    ok = all(v["median_rel_err"] <= TARGET_ERR and v["winner_ok"] >= TARGET_WIN * v["cells"]
             for v in s.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
