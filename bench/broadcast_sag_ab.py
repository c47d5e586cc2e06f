"""Broadcast's scatter_allgather as it was (its ring all-gather also carried chunks back
to the root and to scatter parents, which held them) against now (only the chunks a rank
lacks), in alternating blocks inside one job, so both meet the same host state.

    ringlet run -n 2 bench/broadcast_sag_ab.py plain 1048576,8388608
    ringlet run -n 4 bench/broadcast_sag_ab.py empty 1048576,8388608

Prints per size the median block of each (the slowest rank's median call; the input
written again before every call) and before/now block pair by block pair (> 1: now is
faster). Checks the result of each block's last call. Not a unit test. (Registers the old
schedule under a name of its own through ringlet.algorithms' private tables.)
"""
import sys, time, inspect, numpy as np, ringlet as rl
from ringlet import algorithms as A
from ringlet.algorithms import broadcast as B
from ringlet.algorithms._common import chunks, binomial_rounds, subtree, ring_all_gather
from ringlet.bench import bind_like_mpirun
def sag_old(p, count, *, itemsize=4, root=0):
    s, real = B._new("sag_old", p, count, itemsize, root)
    off, size = chunks(count, p); edge = np.append(off, count)
    for _, child, parent in reversed(list(binomial_rounds(p))):
        end = child + subtree(p, child)
        s.round().copy(src=real(parent), dst=real(child), n=edge[end] - edge[child], buf="buf", off=edge[child])
    ring_all_gather(s, len(s.rounds), real(np.arange(p)), off, size)
    return s
A.CATALOG["broadcast"]["sag_old"] = sag_old
A._PARAMS[id(sag_old)] = frozenset(inspect.signature(sag_old).parameters)
rl.init(); r=rl.get_rank(); p=rl.get_world_size()
if p <= 2: bind_like_mpirun(r,p)
kind=sys.argv[1]
for size in [int(x) for x in sys.argv[2].split(',')]:
    n=size//4
    b=np.empty(n,np.float32) if kind=='plain' else rl.empty(n,np.float32)
    res={'sag_old':[], 'scatter_allgather':[]}
    for blk in range(8):
        for alg in (('sag_old','scatter_allgather') if blk%2 else ('scatter_allgather','sag_old')):
            b[...]=r+1; rl.broadcast(b,0,algorithm=alg)
            ts=[]
            for i in range(max(5, min(60, int(2e8/size)))):
                b[...]=r+1
                rl.barrier(); t0=time.perf_counter(); rl.broadcast(b,0,algorithm=alg); ts.append(time.perf_counter()-t0)
            assert (b == 1).all(), "wrong result"
            t=np.array([np.median(ts)]); rl.all_reduce(t,op=rl.ReduceOp.MAX); res[alg].append(t[0]*1e6)
    if r==0:
        o,nw=np.array(res['sag_old']),np.array(res['scatter_allgather'])
        print(f"{kind} p={p} {size>>10} KiB  before {np.median(o):.0f} us  now {np.median(nw):.0f} us  before/now per block pair {np.round(o/nw,2).tolist()}", flush=True)
rl.destroy()
