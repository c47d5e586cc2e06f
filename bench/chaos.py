"""Chaos: random sequences of collectives, point-to-point and async calls on 3-6 ranks
over shm, tcp or two emulated hosts; at a random call one rank is SIGKILLed, SIGSTOPped
(a stalled straggler), or passes another argument than the others. Every survivor must
raise the right error - PeerFailure naming the dead rank, TimeoutError naming the stopped
one, CollectiveMismatch - within 5 s of when it became detectable (the kill; the call's
timeout after the stop; the last rank entering the mismatched call); no process may hang
and no file may remain in /dev/shm or /tmp. Not a unit test (tests/test_chaos.py runs a
few trials of it in the suite):

    .venv/bin/python bench/chaos.py --trials 1000 [--seed 0] [--json out.json]
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time

import numpy as np

import ringlet as rl

FAULTS = ("kill", "stop", "mismatch")
TRANSPORTS = ("shm", "tcp", "mixed")
KINDS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all", "barrier",
         "ring_p2p", "async")
WITH_DATA = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all")
CALL_TIMEOUT = 2.0     # every call's timeout: when a stopped rank becomes detectable
DETECT_WITHIN = 5.0    # seconds after that by which every survivor must have raised
TRIAL_LIMIT = 45.0     # a trial still running after this is a hang


def make_trial(seed: int, fault=None, transport=None) -> dict:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 7))
    ops = []
    for _ in range(int(rng.integers(4, 16))):
        kind = str(rng.choice(KINDS))
        count = int(rng.choice([1, 7, 1000, 40000, 300000]))   # C path, EAGER, streamed
        ops.append({"kind": kind, "count": count, "root": int(rng.integers(n)),
                    "dtype": str(rng.choice(["float32", "float64", "int64"]))})
    ops.append({"kind": "barrier", "count": 0, "root": 0, "dtype": "float32"})
    fault = fault or str(rng.choice(FAULTS))
    data_ops = [i for i, o in enumerate(ops) if o["kind"] in WITH_DATA]
    if fault == "mismatch" and not data_ops:
        ops[0].update(kind="all_reduce")
        data_ops = [0]
    at = int(rng.choice(data_ops)) if fault == "mismatch" else int(rng.integers(len(ops)))
    reduces = ops[at]["kind"] in ("all_reduce", "reduce_scatter")
    return {"seed": seed, "n": n, "transport": transport or str(rng.choice(TRANSPORTS)),
            "fault": fault, "victim": int(rng.integers(n)), "at": at, "ops": ops,
            "change": str(rng.choice(["count", "dtype", "op"] if reduces else ["count", "dtype"]))}


def _do(op: dict, rank: int, n: int, wrong: str | None) -> None:
    """One call of the sequence; ``wrong``: how this rank disagrees with the others."""
    kind, count, dtype = op["kind"], op["count"], np.dtype(op["dtype"])
    if kind in ("reduce_scatter", "all_to_all"):
        count = max(count // n, 1)     # per rank
    if wrong == "count":
        count += 1
    elif wrong == "dtype":
        dtype = np.dtype(np.float64 if dtype != np.float64 else np.float32)
    t = CALL_TIMEOUT
    if kind == "all_reduce":
        x = np.full(count, rank + 1, dtype)
        rl.all_reduce(x, op=rl.ReduceOp.MAX if wrong == "op" else rl.ReduceOp.SUM, timeout=t)
        expect = n * (n + 1) // 2
        if not np.all(x == expect):
            raise AssertionError(f"all_reduce gave {x[:3]}, not {expect}")
    elif kind == "all_gather":
        out = np.empty((n, count), dtype)
        rl.all_gather(out, np.full(count, rank, dtype), timeout=t)
        if not np.all(out[:, 0] == np.arange(n)):
            raise AssertionError(f"all_gather gave {out[:, 0]}")
    elif kind == "broadcast":
        x = np.full(count, rank, dtype)
        rl.broadcast(x, op["root"], timeout=t)
        if not np.all(x == op["root"]):
            raise AssertionError(f"broadcast gave {x[:3]}")
    elif kind == "reduce_scatter":
        out = np.empty(count, dtype)
        rl.reduce_scatter(out, np.ones((n, out.size), dtype),
                          op=rl.ReduceOp.MAX if wrong == "op" else rl.ReduceOp.SUM, timeout=t)
    elif kind == "all_to_all":
        per = count
        out = np.empty((n, per), dtype)
        rl.all_to_all(out, np.full((n, per), rank, dtype), timeout=t)
        if not np.all(out[:, 0] == np.arange(n)):
            raise AssertionError(f"all_to_all gave {out[:, 0]}")
    elif kind == "barrier":
        rl.barrier(timeout=t)
    elif kind == "ring_p2p":
        got = np.empty(count, dtype)
        r = rl.irecv(got, (rank - 1) % n, tag=5)
        s = rl.isend(np.full(count, rank, dtype), (rank + 1) % n, tag=5)
        s.wait(t)
        r.wait(t)
    else:   # async: two calls in flight, waited in a rank-dependent order
        a, b = np.ones(count, dtype), np.ones(1, dtype)
        wa = rl.all_reduce(a, async_op=True)
        wb = rl.all_reduce(b, async_op=True)
        for w in ((wa, wb) if rank % 2 else (wb, wa)):
            w.wait(t)


def _rank(rank: int, trial: dict, out: str) -> None:
    n, victim, fault = trial["n"], trial["victim"], trial["fault"]
    entered, result = None, None
    try:
        for i, op in enumerate(trial["ops"]):
            if i == trial["at"] and rank == victim and fault in ("kill", "stop"):
                _write(f"{out}/fault.json", {"t": time.time(), "pid": os.getpid()})
                os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            entered = time.time()
            wrong = trial["change"] if fault == "mismatch" and i == trial["at"] and rank == victim else None
            _do(op, rank, n, wrong)
        result = {"error": None}
    except BaseException as exc:   # noqa: BLE001 - every outcome is recorded and judged
        result = {"error": type(exc).__name__, "msg": str(exc)[:2000],
                  "rank": getattr(exc, "rank", None), "op": i}
    result.update(t=time.time(), entered=entered)
    _write(f"{out}/{rank}.json", result)
    # Stay until every survivor has reported: our exit must not be what the others see.
    expect = n if fault == "mismatch" else n - 1
    deadline = time.monotonic() + TRIAL_LIMIT
    while len(glob.glob(f"{out}/[0-9]*.json")) < expect and time.monotonic() < deadline:
        time.sleep(0.02)
    os._exit(0)   # (leaving without destroy, as a crashed job would: nothing may remain)


def _write(path: str, obj: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _leftovers(job: str) -> set:
    """Files of this trial's job in /dev/shm or /tmp: any name with its token's hash (as
    ringlet's shared-memory segments and launcher directories once had)."""
    return {p for p in glob.glob("/dev/shm/*") + glob.glob("/tmp/*") if job in p}


def run_trial(trial: dict) -> dict:
    """Run one trial; returns its outcome ("ok" or what went wrong), the worst detection
    time, and whether something hung or leaked."""
    token = secrets.token_hex(32)
    job = hashlib.sha256(token.encode()).hexdigest()[:8]
    out = tempfile.mkdtemp(prefix="chaos-")
    n, fault, victim = trial["n"], trial["fault"], trial["victim"]
    env = {"RINGLET_TOKEN": token}
    if trial["transport"] == "mixed":
        env["RINGLET_HOST_ID_SPLIT"] = str(n // 2)
    backend = "tcp" if trial["transport"] == "tcp" else None
    survivors = list(range(n)) if fault == "mismatch" else [r for r in range(n) if r != victim]
    stop_done = threading.Event()

    def end_the_straggler():   # once the others have reported, kill the stopped rank
        deadline = time.monotonic() + TRIAL_LIMIT
        while not stop_done.is_set() and time.monotonic() < deadline:
            if all(os.path.exists(f"{out}/{r}.json") for r in survivors):
                break
            time.sleep(0.05)
        try:
            os.kill(json.load(open(f"{out}/fault.json"))["pid"], signal.SIGKILL)
        except (OSError, ValueError):
            pass

    watcher = None
    if fault == "stop":
        watcher = threading.Thread(target=end_the_straggler, daemon=True)
        watcher.start()
    hang = False
    t0 = time.monotonic()
    try:
        rl.spawn(_rank, n, args=(trial, out), backend=backend, env=env, keep_going=True,
                 timeout=TRIAL_LIMIT)
    except rl.ProcessFailed as exc:
        hang = "SIGALRM" in exc.detail
    finally:
        stop_done.set()
        if watcher is not None:
            watcher.join()
    took = time.monotonic() - t0
    res = {"seed": trial["seed"], "n": n, "transport": trial["transport"], "fault": fault,
           "seconds": took, "hang": hang}
    try:
        res.update(_judge(trial, out, survivors))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    res["leak"] = sorted(_leftovers(job))
    if hang:
        res["outcome"] = "hang"
    elif res["leak"]:
        res["outcome"] = "leak"
    return res


def _named(msg: str) -> set:
    """Ranks an error message names ("rank 3", "rank(s) [1, 3]")."""
    named = {int(x) for x in re.findall(r"rank (\d+)", msg)}
    for group in re.findall(r"rank\(s\) \[([\d, ]+)\]", msg):
        named |= {int(x) for x in group.split(",")}
    return named


def _judge(trial: dict, out: str, survivors: list) -> dict:
    """Each survivor's error must be the fault's own (PeerFailure naming the dead rank,
    TimeoutError naming the stopped one, CollectiveMismatch), raised within DETECT_WITHIN
    of its detectability. One exception, a cascade: in point-to-point a survivor waiting
    on a rank that had itself just raised - and so stopped moving messages (no background
    progress) - times out naming that rank."""
    fault, victim = trial["fault"], trial["victim"]
    fault_t = None
    if fault in ("kill", "stop"):
        try:
            fault_t = json.load(open(f"{out}/fault.json"))["t"]
        except OSError:   # the victim stopped before its fault: say how
            try:
                got = json.load(open(f"{out}/{victim}.json"))
                why = (f"{got['error']} at call {got['op']}: {got['msg'][:300]}"
                       if got.get("error") else "it finished every call")
            except (OSError, ValueError):
                why = "it reported nothing"
            return {"outcome": f"no fault (rank {victim} never reached it: {why})",
                    "detect_s": None}
    seen = {}
    for r in survivors:
        try:
            seen[r] = json.load(open(f"{out}/{r}.json"))
        except OSError:
            return {"outcome": f"rank {r} reported nothing", "detect_s": None}
    entered_last = max(s["entered"] or 0 for s in seen.values())
    worst, cascades = 0.0, 0
    judged: dict = {}
    while len(judged) < len(seen):          # (a cascade is judged after whom it names)
        progress = False
        for r, s in seen.items():
            if r in judged:
                continue
            err, msg = s["error"], s.get("msg", "")
            if fault == "kill":
                right, ready = err == "PeerFailure" and s["rank"] == victim, fault_t
            elif fault == "stop":
                right = err == "TimeoutError" and victim in _named(msg)
                ready = max(fault_t, s["entered"] or fault_t) + CALL_TIMEOUT
            else:
                right, ready = err == "CollectiveMismatch", entered_last
            if not right and err == "TimeoutError" and trial["ops"][s["op"]]["kind"] == "ring_p2p":
                gave_up = _named(msg) & {q for q in judged if judged[q]}
                if gave_up:
                    right, ready = True, s["entered"] + CALL_TIMEOUT
                    cascades += 1
                elif _named(msg) & (set(seen) - set(judged)):
                    continue                 # judge the rank it names first
            judged[r] = right
            progress = True
            if not right:
                return {"outcome": f"rank {r}: wrong error {err}: {msg[:300]}", "detect_s": None}
            worst = max(worst, s["t"] - ready)
        if not progress:
            return {"outcome": "ranks time out naming each other only", "detect_s": None}
    outcome = "ok" if worst <= DETECT_WITHIN else f"slow ({worst:.2f} s)"
    return {"outcome": outcome, "detect_s": worst, "cascades": cascades}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every trial's result here")
    a = ap.parse_args(argv)
    results, counts = [], {}
    t0 = time.monotonic()
    for i in range(a.trials):
        res = run_trial(make_trial(a.seed + i))
        results.append(res)
        key = (res["fault"], res["outcome"] if res["outcome"] == "ok" else "FAILED")
        counts[key] = counts.get(key, 0) + 1
        if res["outcome"] != "ok":
            print(f"trial {i} (seed {a.seed + i}, {res['fault']}, {res['transport']}, "
                  f"n={res['n']}): {res['outcome']} {res['leak'] or ''}", flush=True)
        if (i + 1) % 50 == 0:
            print(f"{i + 1} trials, {time.monotonic() - t0:.0f} s", flush=True)
    detect = [r["detect_s"] for r in results if r.get("detect_s") is not None]
    summary = {
        "trials": len(results),
        "outcomes": {f"{f} {o}": c for (f, o), c in sorted(counts.items())},
        "by_transport": {t: sum(r["transport"] == t for r in results) for t in TRANSPORTS},
        "failed": sum(r["outcome"] != "ok" for r in results),
        "cascades": sum(r.get("cascades", 0) for r in results),
        "hangs": sum(r["hang"] for r in results),
        "leaks": sum(bool(r["leak"]) for r in results),
        "worst_detection_s": max(detect) if detect else None,
        "median_detection_s": float(np.median(detect)) if detect else None,
        "seconds": time.monotonic() - t0,
    }
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "trials": results}, f)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
