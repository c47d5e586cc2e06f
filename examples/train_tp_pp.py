"""Tensor and pipeline parallelism in a 2-D job on 4 ranks ("hosts" of 2 ranks each):

    OPENBLAS_NUM_THREADS=1 ringlet run -n 4 examples/train_tp_pp.py tp-dp   # or gpipe / 1f1b

The model: two Megatron MLP blocks, x -> tanh(x W1 + b1) W2 + b2 -> tanh -> ... W4 + b4,
each block a ColumnParallelLinear (output left split) and a RowParallelLinear (one
all_reduce forward, one backward), fitted to a synthetic regression generated here.

* ``tp-dp``: both blocks split over the tensor-parallel group inside a host ({0,1},
  {2,3}); the hosts are data-parallel replicas ({0,2}, {1,3}), each taking half the batch,
  their gradient blocks averaged by GradBuckets.
* ``gpipe`` / ``1f1b``: tensor parallel inside a host as above, pipeline across: host 0
  runs block 1, host 1 block 2, over micro-batches with that Pipeline schedule.

Rank 0 prints the loss per step, the step's communication priced before it runs, the
measured gamma (rl.profile), and compares the final parameters with one process training
the whole model on the whole batch (float64; equal within rounding, as the tensor-parallel
split sums the hidden features in another order).
"""
import sys

import numpy as np

import ringlet as rl
from ringlet import train
from ringlet.train.pricing import hosts_of

D_IN, HID, MID, D_OUT = 16, 32, 16, 4
BATCH, MICRO, STEPS, LR = 64, 4, 30, 0.05


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, D_IN))
    A, B = rng.standard_normal((D_IN, 8)) / 4, rng.standard_normal((8, D_OUT))
    return x, np.tanh(x @ A) @ B + 0.01 * rng.standard_normal((512, D_OUT))


def init():
    rng = np.random.default_rng(1)
    dims = [(D_IN, HID), (HID, MID), (MID, HID), (HID, D_OUT)]
    return [[rng.standard_normal(s) / np.sqrt(s[0]), np.zeros(s[1])] for s in dims]


def batch(x, y, step):
    idx = np.random.default_rng([2, step]).choice(len(x), BATCH, replace=False)
    return x[idx], y[idx]


class Block:
    """One Megatron MLP block, tensor parallel over ``group``; ``act``: tanh on its output.
    A pipeline stage: forward(x) -> (y, ctx), backward(ctx, dy) -> dx, gradients summed
    over micro-batches in ``grads``."""

    def __init__(self, l1, l2, group, act):
        self.col = train.ColumnParallelLinear(*l1, group=group, gather_output=False)
        self.row = train.RowParallelLinear(*l2, group=group, input_is_parallel=True)
        self.act = act
        self.grads = None

    def params(self):
        return [self.col.w, self.col.b, self.row.w, self.row.b]

    def forward(self, x):
        h = np.tanh(self.col.forward(x))
        y = self.row.forward(h)
        if self.act:
            y = np.tanh(y)
        return y, (x, h, y)

    def backward(self, ctx, dy):
        x, h, y = ctx
        if self.act:
            dy = dy * (1 - y * y)
        dh = self.row.backward(dy, h) * (1 - h * h)
        dx = self.col.backward(dh, x)
        g = self.col.grads + self.row.grads
        self.grads = g if self.grads is None else [a + b for a, b in zip(self.grads, g)]
        return dx


def mse(y, t):
    """Half the mean squared error over the global batch, and its gradient."""
    return 0.5 * float(((y - t) ** 2).sum()) / BATCH, (y - t) / BATCH


def reference(x, y, steps):
    """The whole model in one process on the whole batch."""
    P = [[q.copy() for q in layer] for layer in init()]
    for t in range(1, steps + 1):
        xb, yb = batch(x, y, t)
        acts = [xb]
        for k, (W, b) in enumerate(P):
            z = acts[-1] @ W + b
            acts.append(z if k == 3 else np.tanh(z))
        _, d = mse(acts[-1], yb)
        for k in reversed(range(4)):
            W, b = P[k]
            if k < 3:
                d = d * (1 - acts[k + 1] ** 2)
            gW, gb, d = acts[k].T @ d, d.sum(0), d @ W.T
            W -= LR * gW
            b -= LR * gb
    return P


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "tp-dp"
    if mode not in ("tp-dp", "gpipe", "1f1b"):
        raise SystemExit(f"mode must be tp-dp, gpipe or 1f1b, got {mode!r}")
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else STEPS
    rl.init()
    rank = rl.get_rank()
    if rl.get_world_size() != 4:
        raise SystemExit("run on 4 ranks: ringlet run -n 4 examples/train_tp_pp.py")
    host, local = rank // 2, rank % 2
    tp = [rl.new_group([0, 1]), rl.new_group([2, 3])][host]       # inside a host
    across = [rl.new_group([0, 2]), rl.new_group([1, 3])][local]  # dp replicas / pipeline
    x, y = data()
    P = init()
    if mode == "tp-dp":
        blocks = [Block(P[0], P[1], tp, True), Block(P[2], P[3], tp, False)]
        params = [q for b in blocks for q in b.params()]
        gb = train.GradBuckets(params, bucket_cap_mb=0.005, group=across)
        rows = BATCH // 2
        calls = [c for b in blocks for c in b.col.calls(rows) + b.row.calls(rows)]
        priced = train.price(calls, None, hosts_of(tp))
        priced = train.StepPrice(priced.calls + gb.price().calls, priced.on)
        across_calls = gb.calls()

        def step(t):
            xb, yb = batch(x, y, t)
            xb, yb = xb[host * rows:(host + 1) * rows], yb[host * rows:(host + 1) * rows]
            h, c1 = blocks[0].forward(xb)
            out, c2 = blocks[1].forward(h)
            loss, d = mse(out, yb)
            for k, c in ((1, c2), (0, c1)):      # each block's gradients handed over
                blocks[k].grads = None              # as its backward finishes
                d = blocks[k].backward(c, d)
                for j in reversed(range(4)):
                    gb.ready(4 * k + j, blocks[k].grads[j])
            for q, g in zip(params, gb.wait()):
                q -= LR * 2 * g          # the mean of two half-batch gradients, x2: whole batch
            return loss
    else:
        blocks = [Block(P[2 * host], P[2 * host + 1], tp, host == 0)]
        pipe = train.Pipeline(blocks[0], MICRO, schedule=mode, group=across,
                              loss=mse if host == 1 else None)
        rows = BATCH // MICRO
        b = blocks[0]
        calls = [c._replace(times=MICRO) for c in b.col.calls(rows) + b.row.calls(rows)]
        priced = train.price(calls, None, hosts_of(tp))
        priced = train.StepPrice(priced.calls + pipe.price(rows * MID).calls, priced.on)
        across_calls = pipe.calls(rows * MID)

        def step(t):
            xb, yb = batch(x, y, t)
            b.grads = None
            losses = pipe.step(np.split(xb, MICRO) if host == 0 else None,
                               np.split(yb, MICRO) if host == 1 else None)
            for q, g in zip(b.params(), b.grads):
                q -= LR * g
            return sum(losses) if losses else 0.0
    losses = [step(1)]                 # builds plans, picks algorithms: not profiled
    with rl.profile() as prof:
        for t in range(2, steps + 1):
            losses.append(step(t))
    losses = np.array(losses)
    rl.all_reduce(losses, group=across)   # replicas' half losses, or the last stage's
    # the step's calls back to back, each group's on it (a pipeline's messages as 2-rank
    # broadcasts, as priced)
    alone = train.pricing.replay(calls, tp) + train.pricing.replay(across_calls, across)
    n_params = sum(q.size for layer in P for q in layer)
    comp = prof.compute_seconds / max(steps - 1, 1)
    if rank == 0:
        print(f"== {mode}: 2 Megatron MLP blocks ({n_params} parameters), 4 ranks, "
              f"batch {BATCH}" + (f", {MICRO} micro-batches" if mode != "tp-dp" else ""))
        print("-- priced before it runs (rank 0's calls; the job's profile, named below):")
        print(priced.table())
        # The 2-D job's groups, handed to the placement planner (rl.cost.place) for a
        # cluster of the interconnect tiers: which host each rank should run on.
        from ringlet.cost.place import Comm, place
        tp_groups, across_groups = ((0, 1), (2, 3)), ((0, 2), (1, 3))
        comms = [Comm(f"tp {k} {c.label}", tp_groups, c.collective, c.nbytes, c.times)
                 for k, c in enumerate(calls)] + \
                [Comm(f"{'dp' if mode == 'tp-dp' else 'pp'} {k} {c.label}", across_groups,
                      c.collective, c.nbytes, c.times) for k, c in enumerate(across_calls)]
        print(place(comms, hosts=2, ranks_per_host=2, intra="nvlink", inter="ethernet"))
        for t in range(1, steps + 1):
            print(f"step {t:3d}  loss {losses[t - 1]:.5f}")
        print("-- measured over steps 2.. (rl.profile, rank 0):")
        print(prof.table())
        print(f"per step, communication: {priced.comm_seconds * 1e3:.3f} ms priced | "
              f"{alone * 1e3:.3f} ms the same calls measured back to back | "
              f"{prof.comm_seconds / max(steps - 1, 1) * 1e3:.3f} ms measured inside the step; "
              f"compute {comp * 1e3:.3f} ms measured")
        print(f"gamma: predicted {priced.gamma(comp):.3g} (priced comm / measured compute) | "
              f"calls alone {alone / comp:.3g} | measured {prof.gamma:.3g}")
    # every rank compares its blocks with the same blocks of a one-process run
    first = 0 if mode == "tp-dp" else 2 * host
    ref = reference(x, y, steps)
    diff = np.zeros(1)
    for k, b in enumerate(blocks):
        (W1, b1), (W2, b2) = ref[first + 2 * k], ref[first + 2 * k + 1]
        want = [W1[:, b.col.cols], b1[b.col.cols], W2[b.row.rows], b2]
        for q, w in zip(b.params(), want):
            diff[0] = max(diff[0], float(np.abs(q - w).max()))
    rl.all_reduce(diff, rl.ReduceOp.MAX)
    if rank == 0:
        print(f"final parameters vs one process on the whole batch (float64): max |diff| "
              f"{diff[0]:.3g} (within rounding: the split sums in another order)")
    if diff[0] > 1e-9:
        raise SystemExit(f"rank {rank}: parameters differ from the one-process run by {diff[0]:.3g}")
    rl.destroy()


if __name__ == "__main__":
    main()
