"""Train an MLP on scikit-learn's handwritten digits, data parallel on 4 ranks:

    pip install -e ".[examples]"                   # scikit-learn, for the data set only
    OPENBLAS_NUM_THREADS=1 ringlet run -n 4 examples/train_mlp.py dp [steps]   # or zero1/2/3

(One BLAS thread per rank: four ranks on a small machine, each with a thread per core,
spend their time descheduling each other. The launcher has NumPy loaded before this file
runs, so the variable must be set outside it.)

Every rank takes a quarter of each global batch; the gradients are averaged by
GradBuckets (dp) or by ZeroOptimizer (zero1/2/3, which also shards the optimizer state,
the gradients, the parameters). Rank 0 prints the loss per step, the step's price before
training (communication time, bytes, gamma from a compute estimate), the measured gamma
(rl.profile), and at the end replays the training in one process, averaging the same
per-rank gradients, to compare the final parameters.
"""
import sys
import time

import numpy as np

import ringlet as rl
from ringlet import train

SIZES = (64, 128, 64, 10)
BATCH, STEPS, LR, MOMENTUM = 256, 40, 0.1, 0.9


def load():
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    return x, d.target.astype(np.int64)


def init_units():
    rng = np.random.default_rng(0)
    return [[(rng.standard_normal((a, b)) * np.sqrt(2 / a)).astype(np.float32),
             np.zeros(b, np.float32)] for a, b in zip(SIZES[:-1], SIZES[1:])]


def forward(W, b, x, last):
    z = x @ W + b
    return z if last else np.maximum(z, 0)


def loss_grad(out, y):
    z = out - out.max(1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(1, keepdims=True)
    loss = -np.log(p[np.arange(len(y)), y] + 1e-12).mean()
    p[np.arange(len(y)), y] -= 1
    return float(loss), p / len(y)


def backward(W, x, out, dout, last):
    dz = dout if last else dout * (out > 0)
    return [x.T @ dz, dz.sum(0)], dz @ W.T


def grads_on(get, release, x, y, on_grad):
    """One forward and backward pass, layer by layer; ``get(u)`` gives layer u's (W, b)."""
    L = len(SIZES) - 1
    acts = [x]
    for u in range(L):
        W, b = get(u, u + 1)
        acts.append(forward(W, b, acts[-1], u == L - 1))
        release(u)
    loss, d = loss_grad(acts[-1], y)
    for u in reversed(range(L)):
        W, _ = get(u, u - 1)
        g, d = backward(W, acts[u], acts[u + 1], d, u == L - 1)
        release(u)
        on_grad(u, g)
    return loss


def batch_of(x, y, step, rank, p):
    idx = np.random.default_rng(step).choice(len(x), BATCH, replace=False)
    mine = idx[rank * BATCH // p:(rank + 1) * BATCH // p]
    return x[mine], y[mine]


def reference(x, y, p):
    """One process: per step, every rank's gradients, summed in rank order, / p; SGD."""
    units = init_units()
    opt = train.SGD(LR, MOMENTUM)
    flat = [q for unit in units for q in unit]
    states = [opt.state(q.size, q.dtype) for q in flat]
    for t in range(1, STEPS + 1):
        per = []
        for r in range(p):
            gs = [None] * len(flat)

            def put(u, g, gs=gs):
                gs[2 * u], gs[2 * u + 1] = g
            grads_on(lambda u, nxt: units[u], lambda u: None, *batch_of(x, y, t, r, p), put)
            per.append(gs)
        for i, (q, st) in enumerate(zip(flat, states)):
            g = per[0][i].copy()
            for r in range(1, p):
                g += per[r][i]
            opt.update(q.reshape(-1), (g / p).reshape(-1), st, t)
    return flat


def setup(pattern):
    """The pattern's pieces: get(u, next) -> layer u's (W, b), release(u), on_grad(u, grads),
    finish(step), the step's calls, final() -> the parameters, and the ZeroOptimizer."""
    units = init_units()
    if pattern == "dp":
        flat = [q for unit in units for q in unit]
        gb = train.GradBuckets(flat, bucket_cap_mb=0.05)     # small model: several buckets
        opt = train.SGD(LR, MOMENTUM)
        states = [opt.state(q.size, q.dtype) for q in flat]
        on_grad = lambda u, g: (gb.ready(2 * u + 1, g[1]), gb.ready(2 * u, g[0]))  # noqa: E731

        def finish(t):
            for q, g, st in zip(flat, gb.wait(), states):
                opt.update(q.reshape(-1), g.reshape(-1), st, t)
        return (lambda u, nxt: units[u]), (lambda u: None), on_grad, finish, gb.calls(), \
            (lambda: flat), None
    z = train.ZeroOptimizer(units, stage=int(pattern[-1]), optimizer="sgd", lr=LR,
                            momentum=MOMENTUM)

    def final():
        out = []
        for u in range(len(SIZES) - 1):
            out += [q.copy() for q in z.gather(u)]
            z.free(u)
        return out
    return z.gather, z.free, z.reduce_grad, (lambda t: z.step()), z.calls(), final, z


def held(pattern, x, y, rank, p):
    """Bytes this rank holds for the pattern after two training steps, and at the peak,
    measured (tracemalloc + rl.empty) from the model's creation on (a second run: the
    runtime's plans and scratch for these calls, and imports, exist by then)."""
    def two_steps():
        pieces = get, release, on_grad, finish, *_ = setup(pattern)
        for t in (1, 2):
            grads_on(get, release, *batch_of(x, y, t, rank, p), on_grad)
            finish(t)
        return pieces
    two_steps()
    with train.measure_memory() as m:
        pieces = two_steps()     # held until the meter closes
    del pieces
    return m.held, m.peak


def main():
    global STEPS
    pattern = sys.argv[1] if len(sys.argv) > 1 else "dp"
    STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else STEPS
    rl.init()
    rank, p = rl.get_rank(), rl.get_world_size()
    x, y = load()
    n_params = sum(q.size for unit in init_units() for q in unit)
    get, release, on_grad, finish, priced_calls, final, z = setup(pattern)
    priced = train.price(priced_calls)
    rate = train.measure_flop_rate()
    comp = train.compute_seconds(6 * n_params * BATCH // p, rate)
    # A second estimate: this rank's forward and backward timed alone, no communication.
    timed, spare = [], init_units()
    for t in range(5):
        t0 = time.perf_counter()
        grads_on(lambda u, nxt: spare[u], lambda u: None, *batch_of(x, y, t, rank, p),
                 lambda u, g: None)
        timed.append(time.perf_counter() - t0)
    comp_timed = sorted(timed)[2]
    if rank == 0:
        print(f"== {pattern}: MLP {SIZES} ({n_params} parameters) on digits, {p} ranks, "
              f"global batch {BATCH}\n-- priced before it runs (the job's profile, named below):")
        print(priced.table())
        print(f"compute estimate 6*P*b/R = {comp * 1e3:.3f} ms (R = {rate / 1e9:.1f} GFLOP/s "
              f"measured on a matrix product): predicted gamma {priced.gamma(comp):.3g}; "
              f"a step's compute timed alone {comp_timed * 1e3:.3f} ms: predicted gamma "
              f"{priced.gamma(comp_timed):.3g}")
    def one(t):
        return grads_on(get, release, *batch_of(x, y, t, rank, p), on_grad), finish(t)

    losses = [one(1)[0]]      # the first step builds plans and picks algorithms: not timed
    with rl.profile() as prof:
        for t in range(2, STEPS + 1):
            losses.append(one(t)[0])
    losses = np.array(losses)
    rl.all_reduce(losses, rl.ReduceOp.AVG)     # the global batch's loss, per step
    steps = STEPS - 1
    alone = train.pricing.replay(priced_calls)   # the step's calls back to back, no compute
    if rank == 0:
        for t in range(1, STEPS + 1):
            print(f"step {t:3d}  loss {losses[t - 1]:.4f}")
        print(f"-- measured over steps 2..{STEPS} (rl.profile):")
        print(prof.table())
        comp_meas = prof.compute_seconds / steps
        print(f"per step, communication: {priced.comm_seconds * 1e3:.3f} ms priced | "
              f"{alone * 1e3:.3f} ms the same calls measured back to back | "
              f"{prof.comm_seconds / steps * 1e3:.3f} ms measured inside the step (also waiting "
              f"for peers still computing); compute {comp_meas * 1e3:.3f} ms measured vs "
              f"{comp * 1e3:.3f} (6Pb/R) / {comp_timed * 1e3:.3f} (timed alone) ms estimated")
        print(f"gamma: predicted {priced.gamma(comp):.3g} (6Pb/R) / {priced.gamma(comp_timed):.3g} "
              f"(timed) | calls alone over measured compute {alone / comp_meas:.3g} | measured "
              f"{prof.gamma:.3g}")
    got = final()
    mem_dp = held("dp", x, y, rank, p)
    mem_pat = mem_dp if pattern == "dp" else held(pattern, x, y, rank, p)
    if rank == 0:
        print(f"memory per rank, measured after two steps: data parallel holds {mem_dp[0]:,} B "
              f"(peak {mem_dp[1]:,}); {pattern} {mem_pat[0]:,} B = {mem_pat[0] / mem_dp[0]:.3f}"
              f" of it (peak {mem_pat[1]:,}); the largest layer {4 * 65 * 128:,} B")
    if pattern != "dp":
        mem = z.memory()
        if rank == 0:
            print(f"memory per rank, counted on the arrays: params {mem['params']:,}, grads "
                  f"{mem['grads']:,}, optimizer {mem['optimizer']:,}, total {mem['total']:,} "
                  f"= {mem['total'] / z.ddp_memory():.3f} of DDP's {z.ddp_memory():,}; "
                  f"in flight at peak: gathered units {mem['gathered_peak']:,}, full gradients "
                  f"being reduce-scattered {mem['grad_in_peak']:,}")
    if rank == 0:
        ref = reference(x, y, p)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(got, ref))
        same = all(np.array_equal(a, b) for a, b in zip(got, ref))
        print(f"final parameters vs one process averaging the same gradients: "
              f"{'bit-identical' if same else f'max |diff| {diff:.3g}'} (float32; a sum over 4 "
              f"ranks in another order than the reference's can differ in the last bits)")
        if diff > 1e-5:
            raise SystemExit(f"parameters differ from the one-process run by {diff:.3g}")
    rl.destroy()


if __name__ == "__main__":
    main()
