"""Where the microseconds of a blocking 8 B all_reduce go, step by step, by the clock.

    .venv/bin/python bench/small_budget.py [--p 2] [--tree DIR]

Rank 0 times each Python step of the call on its own (best of 7 runs of 20,000 calls,
nanoseconds per call; its peers wait in a barrier meanwhile), then the whole call in a
loop with its peers (best of 12 blocks of 500 calls). "C and the wait" is the whole call
less the Python steps: the call into C, its checks, writing the packet, spinning for the
peer's and reducing it. At p = 2 the calls are timed once more, each alone once the
peer's packet is already in rank 0's ring (best block of 500): a call that does not wait;
the whole call less that is the wait (the fence, the spin, the peer's own late start).
A repeated call takes the lane (collectives._lane), which skips most of the steps: where
the tree has one, its Python is timed alone too (the whole call with C answered by a stub:
since the lane is one C call, ``_fastpath.Lane.run``, the stub stands for all of it), and
"C and the wait" is the whole call less that. Instruction counts of the same split,
which load does not move: bench/blocking_callgrind.py. Takes ~20 s.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

JOB = r"""
import json, sys, time, timeit
import numpy as np, ringlet as rl
from ringlet import collectives as C, runtime, tracing
from ringlet.transport import fast
from ringlet.ops import ReduceOp

def best(stmt, n=20000):
    t = timeit.Timer(stmt, globals=dict(globals(), **LOCALS))
    return min(t.repeat(7, n)) / n * 1e9

def job(rank, path):
    x = np.ones(2, np.float32)
    for _ in range(500):
        rl.all_reduce(x)
    rows = []
    if rank == 0:
        import inspect    # (each step as this tree's code does it: the budget reads either tree)
        g = runtime.resolve(None)
        eng = runtime.engine()
        op = ReduceOp.SUM
        flat = C._flat(x)
        keyed = "key" in inspect.signature(C._prepare).parameters
        call = C._prepare(("all_reduce", "auto", g, x.size, x.dtype, None, None, op._value_, ())) \
            if keyed else C._prepare("all_reduce", "auto", g, x.size, x.dtype, op, None, None, ())
        bufs = {"buf": flat, "tmp": call.pool[-1] if call.pool else np.empty(call.tmp, x.dtype)}
        class G:    # a stand-in: the group's own counter must not move
            id, seq = g.id, 0
            _tag_base = getattr(g, "_tag_base", 0)
        LOCALS.update(locals())
        # Each step as this tree's code does it (the budget reads this tree or the start's:
        # ``keyed``, a _prepare that takes the cache key, tells them apart). None: a step
        # this tree does not take per call.
        steps = [
            ("profile hook (rl.profile closed)", None),
            ("resolve(group)", "runtime.resolve(None)"),
            ("algorithm check", "type('auto') is not str" if keyed else "C._check_algorithm('auto')"),
            ("as_op(op)", "type(op) is not ReduceOp" if keyed else "C.as_op(op)"),
            ("buffer check (as_array)", "C.as_array(x, 'all_reduce buffer', True)" if keyed
             else "C._writable(x, 'all_reduce buffer')"),
            ("op/dtype check (cached)", None if keyed else "C.check_op_dtype(op, x.dtype)"),
            ("flat view", "x if x.ndim == 1 else x.reshape(-1)" if keyed else "C._flat(x)"),
            ("averager", "C._averager(op, flat, g) if op is C._AVG else None" if keyed
             else "C._averager(op, flat, g.size)"),
            ("plan cache lookup", "C._CALLS.get(('all_reduce', 'auto', g, 2, x.dtype, None, None, "
             "op and op._value_, ())) or 0" if keyed else
             "C._prepare('all_reduce', 'auto', g, 2, x.dtype, op, None, None, ())"),
            ("scratch pool pop/append", "call.pool.append(call.pool.pop() if call.pool else None)"),
            ("sequence number and tag", "type(g).next_collective_tag(G)"),
            ("state checks (trace, progress, works)",
             "tracing.ON; eng.background.idle; "
             "call.fast is not None and not eng.works and not eng.calls.aborts"),
            ("C call arguments (fast.run's tuple)", "call.fast.arrays(bufs)" if keyed
             else "tuple(bufs[n] for n in call.fast.names)"),
            ("stats (record_call)", "C.record_call(eng, 'all_reduce', call.algorithm, 0.0, 1, True)"),
        ]
        from ringlet.profiling import profiled
        def bare(a, b=1): return a
        hooked = profiled("x")(bare)
        LOCALS.update(bare=bare, hooked=hooked)
        for i, (name, stmt) in enumerate(steps):
            if stmt is None:
                rows.append((name, best("hooked(x)") - best("bare(x)") if i == 0 else 0.0))
            else:
                rows.append((name, best(stmt)))
    lane = None
    if rank == 0 and hasattr(C, "_lane"):
        # A repeated call takes the lane (collectives._lane), not the steps above: its
        # Python alone, C answered by a stub (which takes no call number: the C lane would)
        key = ("all_reduce", x.dtype, x.size, op._value_, "auto")
        hit = runtime._S.lane.get(key)
        if hit is not None:      # a C lane (_fastpath.Lane): a stub's run
            class Stub:       # (a Python method: ~50 ns more than the C one it stands for)
                def run(self, budget, crowded, a, b):
                    return True
            runtime._S.lane[key] = (*hit[:2], Stub(), *hit[3:])
            try:
                lane = best("rl.all_reduce(x)")
            finally:
                runtime._S.lane[key] = hit
    rl.barrier()
    blocks = []
    for _ in range(12):
        rl.barrier()
        t = time.perf_counter()
        for _ in range(500):
            rl.all_reduce(x)
        blocks.append((time.perf_counter() - t) / 500 * 1e9)
    # The same calls, each timed alone once the peer's packet is in rank 0's ring (p = 2):
    # the call without its wait. The wait is the rest.
    ready_blocks = []
    if rl.get_world_size() == 2:
        clock = time.perf_counter
        if rank == 0:
            peer = runtime.engine().peers[1]
            empty = min(-clock() + clock() for _ in range(20000))
        for _ in range(12):
            rl.barrier()
            rl.all_reduce(x)    # (not timed: its packet may have come in during the barrier)
            spent = 0.0
            for _ in range(500):
                if rank == 0:    # (not timed; a packet already taken in: C leaves the call)
                    while peer.inbox.ctrl[0] <= peer.tail and not peer.unexpected:
                        pass
                    t = clock()
                    rl.all_reduce(x)
                    spent += clock() - t - empty
                else:
                    rl.all_reduce(x)
            ready_blocks.append(spent / 500 * 1e9)
    if rank == 0:
        open(path, "w").write(json.dumps({"rows": rows, "total": min(blocks), "lane": lane,
                                          "ready": min(ready_blocks) if ready_blocks else None}))

LOCALS = {}
rl.spawn(job, int(sys.argv[1]), args=(sys.argv[2],), timeout=300)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=int, default=2)
    ap.add_argument("--tree", help="the ringlet tree to measure (default: this one)")
    a = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tempfile.mktemp(prefix="small_budget.", suffix=".json")
    env = dict(os.environ, PYTHONPATH=a.tree or here)
    load = os.getloadavg()[0]
    subprocess.run([sys.executable, "-c", JOB, str(a.p), path], check=True, timeout=600,
                   cwd="/", env=env)
    got = json.load(open(path))
    os.unlink(path)
    total = got["total"]
    print(f"8 B all_reduce p={a.p}, {a.tree or here}; load average {load:.2f} -> "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'step':42}{'ns':>8}{'share':>8}")
    python = 0.0
    for name, ns in got["rows"]:
        python += ns
        print(f"{name:42}{ns:>8.0f}{ns / total:>8.0%}")
    print(f"{'Python steps, summed':42}{python:>8.0f}{python / total:>8.0%}")
    if got.get("lane") is not None:   # a repeated call runs the lane, not those steps
        python = got["lane"]
        print(f"{'the lane (a repeated call), Python':42}{python:>8.0f}"
              f"{python / total:>8.0%}")
    print(f"{'C and the wait (the rest)':42}{total - python:>8.0f}{(total - python) / total:>8.0%}")
    ready = got["ready"]
    if ready is not None:
        print(f"{'  the wait (whole call less a ready one)':42}{total - ready:>8.0f}"
              f"{(total - ready) / total:>8.0%}")
        print(f"{'  C and the glue (a ready call less steps)':42}{ready - python:>8.0f}"
              f"{(ready - python) / total:>8.0%}")
        print(f"{'a call whose peer packet is already in':42}{ready:>8.0f}")
    print(f"{'whole call (best block of 500)':42}{total:>8.0f}")


if __name__ == "__main__":
    main()
