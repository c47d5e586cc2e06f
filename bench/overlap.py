"""Overlap of communication with computation, where the wire and not the CPU is the limit.

    sudo .venv/bin/python bench/overlap.py [--rates 1gbit,10gbit] [--sizes 16,32,64]

Two emulated hosts (ringlet.hosts: network namespaces, own hostname and /dev/shm, one
tbf-shaped link), one rank on each, TCP between. For each size n (MiB), each rank:

    T_comm   an all_reduce of n bytes alone (ring, started async and waited at once)
    T_comp   a compute phase alone: GIL-releasing NumPy (float32 matmuls, one BLAS
             thread), as many as take T_comm (calibrated twice: from one matmul's time,
             then from the phase's own)
    serial   all_reduce, then compute: the step without overlap
    T_step   all_reduce started with async_op=True, the compute, then wait()

and prints overlap efficiency = (T_comm + T_comp - T_step) / min(T_comm, T_comp) - 0 is
no overlap, 1 perfect - beside the cost model's prediction of the all_reduce on a link of
the shaped rate (TCP's goodput, 1448 of every 1538 bytes on the wire) and of both steps
(serial: T_comm + T_comp; overlapped: max of the two). The four run in turns (--reps,
each turn's four back to back, in an order that rotates); times are medians over turns,
and the efficiency is the median of each turn's own (its range beside it), so a change of
the host's load between turns does not enter it. On a host shared with other jobs it still
moves; "hidden" (1 - the wait after the compute / T_comm: the part of the transfer done
while computing) and the breakdown of the compute's time (on CPU, preempted, waiting for
the GIL; the progress thread's CPU, turns and naps) depend on it less.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
import on_hosts  # noqa: E402  (bench/on_hosts.py)


# -- one rank (run by `ringlet run` on each emulated host) ---------------------------------
def rank_main(sizes: list[int], reps: int, rate_bytes: float) -> None:
    import numpy as np
    import ringlet as rl

    rl.init()
    r, p = rl.get_rank(), rl.get_world_size()
    a = np.random.default_rng(r).random((384, 384), dtype=np.float32)
    out = np.empty_like(a)

    def compute(k: int) -> None:
        for _ in range(k):
            np.matmul(a, a, out=out)      # BLAS: the GIL is released meanwhile

    def sched() -> tuple:
        """(seconds: wall, main thread on a CPU, main thread runnable but not running -
        another process or thread had the core, background thread on a CPU). Wall minus
        the two main-thread terms is time the main thread slept: waiting for the GIL."""
        def task(tid):
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, queued, _ = map(int, f.read().split())
            return run * 1e-9, queued * 1e-9
        run, queued = task(threading.main_thread().native_id)
        bg = [t for t in threading.enumerate() if t.name.startswith("ringlet-progress")]
        return time.perf_counter(), run, queued, task(bg[0].native_id)[0] if bg else 0.0

    def timed(f) -> float:
        rl.barrier()
        t = time.perf_counter()
        f()
        return time.perf_counter() - t

    compute(20)
    unit = sorted(timed(lambda: compute(20)) for _ in range(3))[1] / 20
    link = rl.cost.Link(alpha=50e-6, bandwidth=rate_bytes * 1448 / 1538, name="shaped")
    bg = rl.runtime.engine().background
    rows = []
    for mib in sizes:
        x = np.ones(mib << 18, np.float32)
        rl.all_reduce(x, algorithm="ring")       # (warm: connections, pages)

        def comm():
            rl.all_reduce(x, algorithm="ring", async_op=True).wait()

        # C calibrated to the measured comm time: a first guess from one matmul's time,
        # then once more from C's own measured time (the matmul's time alone misjudges it
        # when the host's load changes); rank 0's k for both ranks: the same compute.
        t_comm = sorted(timed(comm) for _ in range(3))[1]
        k = max(1, round(t_comm / unit))
        t_comp = sorted(timed(lambda: compute(k)) for _ in range(3))[1]
        k = np.array([max(1, round(k * t_comm / t_comp))])
        rl.broadcast(k, 0)
        k = int(k[0])

        def comp():
            compute(k)

        def serial():
            rl.all_reduce(x, algorithm="ring")
            compute(k)

        inside = []    # per overlapped step: compute, wait after it, where the compute's
                       # time went (see sched), the progress thread's turns and naps

        def step():
            t0 = time.perf_counter()
            turns, naps = bg.turns, bg.naps
            w = rl.all_reduce(x, algorithm="ring", async_op=True)
            s0 = sched()
            compute(k)
            s1 = sched()
            t1 = time.perf_counter()
            w.wait()
            inside.append((t1 - t0, time.perf_counter() - t1,
                           *(b - a for a, b in zip(s0, s1)), bg.turns - turns, bg.naps - naps))

        # In turns, each one's four steps one after the other (in an order that rotates),
        # so that a change of the host's load falls on all four of a turn alike; the
        # efficiency is each turn's own, and the median of those is reported.
        kinds = (comm, comp, serial, step)
        runs = {f.__name__: [] for f in kinds}
        for turn in range(reps):
            for f in kinds[turn % 4:] + kinds[:turn % 4]:
                runs[f.__name__].append(timed(f))
        effs = sorted((c + m - s) / min(c, m)
                      for c, m, s in zip(runs["comm"], runs["comp"], runs["step"]))
        med = {name: sorted(v)[len(v) // 2] for name, v in runs.items()}
        pred = rl.cost.predict("all_reduce", mib << 20, p, algorithm="ring", link=link)
        inside.sort()
        mid = inside[len(inside) // 2]      # the step of median compute time
        wall, run, queued, bg_cpu, turns, naps = mid[2:]
        rows.append({"MiB": mib, **med, "pred_comm": pred,
                     "step_comp": mid[0], "step_wait": sorted(x[1] for x in inside)[len(inside) // 2],
                     "cpu": run, "queued": queued, "gil": wall - run - queued, "bg_cpu": bg_cpu,
                     "turns": turns, "naps": naps, "eff": effs[len(effs) // 2],
                     "eff_lo": effs[0], "eff_hi": effs[-1],
                     "each": list(zip(*(runs[f.__name__] for f in kinds)))})
    if r == 0:
        on_hosts.report(rows)
    rl.destroy()


# -- the driver: build the hosts, run the job, print the table -----------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1gbit,10gbit")
    ap.add_argument("--sizes", default="16,32,64", help="MiB per all_reduce, comma-separated")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("-v", "--verbose", action="store_true", help="every turn's four times")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate-bytes", type=float, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.rank:
        rank_main(sizes, a.reps, a.rate_bytes)
        return 0
    print("2 emulated hosts x 1 rank, TCP over one tbf-shaped link; ring all_reduce; "
          f"medians of {a.reps} turns in ms; load average {_load()}")
    print(f"{'rate':>7} {'MiB':>4} {'T_comm':>8} {'T_comp':>8} {'serial':>8} {'T_step':>8} "
          f"{'eff':>5} {'(range)':>11} {'(comp':>7} {'wait)':>6} {'hidden':>6} | model: "
          f"{'comm':>7} {'serial':>8} {'overlap':>8}")
    steps = []
    for rate in a.rates.split(","):
        rows = on_hosts.run(HERE, ["--rank", "--sizes", a.sizes, "--reps", str(a.reps),
                                   "--rate-bytes", str(on_hosts.rate_bytes(rate))], rate)
        for row in rows:
            ms = {k: v * 1e3 for k, v in row.items()
                  if k not in ("MiB", "eff", "eff_lo", "eff_hi", "turns", "naps", "each")}
            steps.append(f"{rate:>7} {row['MiB']:>4}   compute {ms['step_comp']:7.1f} = "
                         f"on CPU {ms['cpu']:7.1f} + preempted {ms['queued']:6.1f} + "
                         f"waiting for the GIL {ms['gil']:6.1f}; progress thread on CPU "
                         f"{ms['bg_cpu']:6.1f} in {row['turns']} turns, {row['naps']} naps")
            print(f"{rate:>7} {row['MiB']:>4} {ms['comm']:8.1f} {ms['comp']:8.1f} "
                  f"{ms['serial']:8.1f} {ms['step']:8.1f} {row['eff']:5.2f} "
                  f"{'(' + format(row['eff_lo'], '.2f') + '-' + format(row['eff_hi'], '.2f') + ')':>11} "
                  f"{ms['step_comp']:7.1f} {ms['step_wait']:6.1f} "
                  f"{1 - ms['step_wait'] / ms['comm']:6.2f} | "
                  f"{ms['pred_comm']:>13.1f} {ms['pred_comm'] + ms['comp']:8.1f} "
                  f"{max(ms['pred_comm'], ms['comp']):8.1f}")
            if a.verbose:
                for c, m, ser, st in row["each"]:
                    print(f"{'':>12} turn: comm {c * 1e3:7.1f} comp {m * 1e3:7.1f} serial "
                          f"{ser * 1e3:7.1f} step {st * 1e3:7.1f} eff "
                          f"{(c + m - st) / min(c, m):5.2f}")
    print("\nInside the overlapped step of median compute time (ms), rank 0's main thread:")
    print("\n".join(steps))
    print(f"load average at the end: {_load()}")
    return 0


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
