"""Instructions of one small blocking call that never waits: its whole cost to the caller,
split into the Python around the C fast path and the C call itself, this tree against
another checkout. Counted by valgrind's callgrind, so the host's load does not move them.

    .venv/bin/python bench/small_instructions.py --base OTHER_CHECKOUT [--calls 400]

Rank 0 runs under callgrind with collection off; before each call it waits (uncounted)
until its peer's packet for that call is already in its ring, then counts just the call
(client requests toggle collection, from a helper compiled here with ``cc``). So C never
spins (``stall`` calls: 0) and the count is the work of a call, not its waiting - unlike
bench/blocking_callgrind.py, whose C count includes spinning while the peer is descheduled.
Cases: 8 B all_reduce p = 2; blocking 8 B recv and send (a ping-pong, rank 0's side).
Needs valgrind (with its headers) and a C compiler. Takes ~1 min.
"""
from __future__ import annotations

import argparse
import glob
import os
import secrets
import subprocess
import sys
import tempfile

HELPER = r"""
#include <valgrind/callgrind.h>
void toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""

JOB = r"""
import ctypes, gc, sys
import numpy as np, ringlet as rl
from ringlet.runtime import _S
rl.init()
gc.disable()
eng = _S.engine
eng.spin = eng.fast_budget = 60.0      # no rank sleeps or leaves C to wait
rank, kind, n = rl.get_rank(), sys.argv[1], int(sys.argv[2])
x = np.ones(2, np.float32)
if rank == 0:
    toggle = ctypes.CDLL(sys.argv[3]).toggle
    peer = eng.peers[1]
    def ready():      # the peer's next packet is in our ring
        while peer.inbox.ctrl[0] <= peer.tail:
            pass
if kind == "nothing":     # what counting costs (a ctypes call on, one off): subtracted
    if rank == 0:
        for _ in range(n):
            toggle(); toggle()
elif kind == "all_reduce":
    for _ in range(50):
        rl.all_reduce(x)
    for _ in range(n):
        if rank == 0:
            ready()
            toggle(); rl.all_reduce(x); toggle()
        else:
            rl.all_reduce(x)
else:
    for _ in range(50):
        if rank == 0:
            rl.recv(x, 1); rl.send(x, 1)
        else:
            rl.send(x, 0); rl.recv(x, 0)
    for _ in range(n):
        if rank == 0:
            ready()
            toggle(); rl.recv(x, 1); toggle()
            toggle(); rl.send(x, 1); toggle()
        else:
            rl.send(x, 0); rl.recv(x, 0)
rl.destroy()
"""


def count(python: str, tree: str, helper: str, kind: str, calls: int, out: str):
    """(instructions per call, in C run per call, C waits per call) of rank 0."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]
    from blocking_callgrind import fastpath_run, totals
    from ringlet.launch import free_port
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RINGLET_TOKEN=secrets.token_hex(16), PYTHONHASHSEED="0", RINGLET_TIMEOUT="900",
               PYTHONPATH=tree, OPENBLAS_NUM_THREADS="1")
    procs = [subprocess.Popen(["valgrind", "--tool=callgrind", "--collect-atstart=no",
                               "--separate-threads=yes", f"--callgrind-out-file={out}.%p",
                               python, "-c", JOB, kind, str(calls), helper],
                              env=dict(env, RANK="0"), cwd="/", stdout=subprocess.DEVNULL,
                              stderr=open(f"{out}.stderr", "w")),
             subprocess.Popen([python, "-c", JOB, kind, str(calls)], env=dict(env, RANK="1"),
                              cwd="/", stderr=subprocess.DEVNULL)]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"a rank failed: see {out}.stderr")
    path = sorted(glob.glob(f"{out}.{procs[0].pid}-*"))[0]
    runs, inside, stalls = fastpath_run(path)
    per = calls * (2 if kind == "p2p" else 1)   # (p2p: a recv and a send per turn)
    return totals(path) / per, inside / per, stalls / per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="the other checkout (none: this tree only)")
    ap.add_argument("--calls", type=int, default=400)
    a = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp(prefix="small_instructions.")
    helper = os.path.join(tmp, "toggle.so")
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", helper, "-x", "c", "-"],
                   input=HELPER.encode(), check=True)
    sides = ((("base", a.base),) if a.base else ()) + (("this", here),)
    print(f"rank 0's instructions per call that does not wait ({a.calls} calls; p2p: the mean "
          f"of a recv and a send)")
    print(f"{'case':18}{'side':6}{'total':>10}{'in C run':>10}{'outside':>10}{'C waits':>9}")
    empty = count(sys.executable, here, helper, "nothing", a.calls, f"{tmp}/nothing")[0]
    print(f"(counting itself, subtracted below: {empty:,.0f})")
    for kind in ("all_reduce", "p2p"):
        got = {}
        for side, tree in sides:
            total, inside, stalls = count(sys.executable, tree, helper, kind, a.calls,
                                          f"{tmp}/{side}.{kind}")
            total -= empty
            got[side] = (total, inside)
            print(f"{kind:18}{side:6}{total:>10,.0f}{inside:>10,.0f}{total - inside:>10,.0f}"
                  f"{stalls:>9.2f}", flush=True)
        if a.base:
            (bt, bi), (tt, ti) = got["base"], got["this"]
            print(f"{kind:18}{'ratio':6}{tt / bt:>10.3f}{ti / bi:>10.3f}"
                  f"{(tt - ti) / (bt - bi):>10.3f}")
    print(f"(callgrind files in {tmp})")


if __name__ == "__main__":
    main()
