"""Under mpirun --bind-to core, p = 2: the engine as it was when each rank counted only
its own core (crowded: yield at once, the C fast path's budget a millisecond of yields, one-way
messages read whole) against now (the job's two cores), in alternating blocks of one job.

    mpirun --allow-run-as-root -np 2 --bind-to core .venv/bin/python bench/bound_ranks_ab.py \
        all_reduce:8,all_reduce:1048576,broadcast:8388608 [BLOCKS]

OP:BYTES with OP one of all_reduce, all_gather, broadcast, all_to_all, send (a ping-pong).
Prints the median block of each and before/now per block pair (> 1: now is faster).
Not a unit test."""
import sys, time, numpy as np, ringlet as rl
from ringlet.runtime import engine
from ringlet.transport import engine as E
rl.init(); r=rl.get_rank(); p=rl.get_world_size(); en=engine()
def arm(a):
    en.crowded = (a=='A'); en.spin = E.SPIN_CROWDED if en.crowded else E.SPIN_FREE
    en.fast_budget = E.YIELD_CROWDED if en.crowded else en.spin
cases=[tuple((c.split(':')[0], int(c.split(':')[1]))) for c in sys.argv[1].split(',')]
for op,size in cases:
    n=max(1,size//4); x=np.ones(n,np.float32); out=np.empty(n*p,np.float32)
    def call():
        if op=='all_reduce': rl.all_reduce(x)
        elif op=='all_gather': rl.all_gather(out,x)
        elif op=='broadcast': rl.broadcast(x,0)
        elif op=='all_to_all': rl.all_to_all(out,np.ones(n*p,np.float32))
        elif op=='send':
            if r==0: rl.send(x,1); rl.recv(x,1)
            else: rl.recv(x,0); rl.send(x,0)
    res={'A':[],'B':[]}
    iters=max(10,min(2000,int(0.02/(1e-6+size*2e-10))))
    for blk in range(int(sys.argv[2]) if len(sys.argv)>2 else 8):
        for a in ('AB' if blk%2 else 'BA'):
            arm(a); call(); ts=[]
            for i in range(iters):
                x[...]=1
                rl.barrier(); t0=time.perf_counter(); call(); ts.append(time.perf_counter()-t0)
            t=np.array([np.median(ts)]); rl.all_reduce(t,op=rl.ReduceOp.MAX); res[a].append(t[0]*1e6)
    if r==0:
        A,B=np.array(res['A']),np.array(res['B'])
        print(f"{op:10s} {size:>8d} B  crowded(before) {np.median(A):8.1f} us  now {np.median(B):8.1f} us  before/now pairs {np.round(A/B,2).tolist()}", flush=True)
rl.destroy()
