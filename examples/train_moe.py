"""A tiny mixture-of-experts layer trained on synthetic tokens, expert parallel (any number of ranks):

    OPENBLAS_NUM_THREADS=1 ringlet run -n 4 examples/train_moe.py [top_k] [capacity_factor]

Each rank holds 2 of the 2p experts (a d x d linear map each) and a replica of the gate.
Tokens belong to 8 hidden clusters, each with its own target map, so experts can
specialise. Per step: the gate picks top-k experts, dispatch sends every token to its
experts' ranks (all_to_all), the experts run, combine brings the outputs back weighted by
the gate; backward routes the output gradient the same way (a second dispatch), and the
gate's gradient is averaged over the ranks (GradBuckets). Rank 0 prints the loss, the
tokens dropped for capacity, the all-to-all bytes against their price, and gamma.
"""
import sys

import numpy as np

import ringlet as rl
from ringlet import train
from ringlet.train.moe import price_moe

D, CLUSTERS, T, STEPS, LR = 16, 8, 256, 60, 0.05


def data(step, rank, maps, centers):
    rng = np.random.default_rng([step, rank])
    c = rng.integers(0, CLUSTERS, T)
    x = (centers[c] + 0.3 * rng.standard_normal((T, D))).astype(np.float32)
    y = np.einsum("tij,tj->ti", maps[c], x).astype(np.float32)
    return x, y


def main():
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    cf = float(sys.argv[2]) if len(sys.argv) > 2 else 1.25
    rl.init()
    rank, p = rl.get_rank(), rl.get_world_size()
    per = 2
    E = per * p      # experts: 2 per rank
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((CLUSTERS, D)) * 2
    maps = rng.standard_normal((CLUSTERS, D, D)) / np.sqrt(D)
    gate = (rng.standard_normal((D, E)) * 0.1).astype(np.float32)
    experts = [(np.eye(D) + 0.1 * rng.standard_normal((D, D))).astype(np.float32)
               for _ in range(E)][rank * per:(rank + 1) * per]
    gb = train.GradBuckets([gate])
    priced = price_moe(T, D, k, E, p, cf)
    # The whole step: dispatch, combine, the backward's dispatch, the gate's all_reduce.
    counts, tables, tokens = (c.call for c in priced.calls)
    step_calls = [counts._replace(times=2), tables._replace(times=3),
                  tokens._replace(times=3)] + gb.calls()
    step_price = train.price(step_calls)
    # FLOPs per token: gate (D x E) and k experts (D x D), forward and backward (x 3)
    comp = train.compute_seconds(3 * 2 * T * (D * E + k * D * D))
    if rank == 0:
        print(f"== MoE: {E} experts on {p} ranks, top-{k}, capacity factor {cf}, {T} tokens "
              f"of {D} floats per rank\n-- priced before it runs (forward dispatch + combine, "
              f"the job's profile, named below):\n{priced.table()}")
        print(f"the whole step (+ backward dispatch, gate all_reduce): "
              f"{step_price.comm_seconds * 1e3:.3f} ms; compute estimate {comp * 1e3:.3f} ms; "
              f"predicted gamma {step_price.gamma(comp):.3g}")
        for P in (4, 8, 16, 64):   # the job's all-to-all volume grows with P
            per_rank = price_moe(T, D, k, 2 * P, P, cf, topology="infiniband").bytes_per_rank
            print(f"  P = {P:3d} (2 experts each): {per_rank:,} B per rank, "
                  f"{P * per_rank:,} B for the job per step")
    prof_steps, dropped_total, sent_total = 0, 0, 0
    with rl.profile() as prof:
        for step in range(1, STEPS + 1):
            x, y = data(step, rank, maps, centers)
            logits = x @ gate
            z = np.exp(logits - logits.max(1, keepdims=True))
            probs = z / z.sum(1, keepdims=True)
            idx = np.argsort(-probs, 1)[:, :k]
            w = np.take_along_axis(probs, idx, 1).astype(np.float32)
            toks, routing = train.dispatch(x, idx, E, cf)
            outs = [t @ W for t, W in zip(toks, experts)]
            per_choice = train.combine(outs, routing).reshape(T, k, D)
            pred = (w[..., None] * per_choice).sum(1)
            err = pred - y
            loss = float((err ** 2).mean())
            dpred = 2 * err / err.size
            # backward: each (token, choice)'s output gradient goes to the expert that made
            # it, as a top-1 token of its own, choice-major: the same kept set and order
            dchoice = w[..., None] * dpred[:, None, :]
            dtoks, _ = train.dispatch(np.ascontiguousarray(dchoice.transpose(1, 0, 2)).reshape(k * T, D),
                                      idx.T.reshape(-1), E, cf)
            for t, dt, W in zip(toks, dtoks, experts):
                W -= LR * (t.T @ dt)     # (the sum over every rank's tokens, as LR * p * ggate)
            dw = np.einsum("tkd,td->tk", per_choice, dpred)
            dprob = np.zeros_like(probs)
            np.put_along_axis(dprob, idx, dw, 1)
            dlogits = probs * (dprob - (dprob * probs).sum(1, keepdims=True))
            gb.ready(0, x.T @ dlogits)
            (ggate,) = gb.wait()
            gate -= LR * p * ggate
            stats = np.array([loss, routing.dropped, routing.sent_bytes], np.float64)
            rl.all_reduce(stats)
            dropped_total += stats[1]
            sent_total += stats[2]
            prof_steps += 1
            if rank == 0 and (step % 10 == 0 or step == 1):
                print(f"step {step:3d}  loss {stats[0] / p:.4f}  tokens dropped {int(stats[1])} "
                      f"of {p * T * k}  token bytes sent (all ranks, dispatch) {int(stats[2]):,}")
    alone = train.pricing.replay(step_calls)    # the step's calls back to back (even splits)
    if rank == 0:
        print(f"-- measured over {STEPS} steps (rl.profile; includes the loss all_reduce):\n"
              f"{prof.table()}")
        print(f"per step, communication: {step_price.comm_seconds * 1e3:.3f} ms priced | "
              f"{alone * 1e3:.3f} ms the same calls measured back to back | "
              f"{prof.comm_seconds / STEPS * 1e3:.3f} ms measured inside the step")
        print(f"gamma: predicted {step_price.gamma(comp):.3g} (compute estimate "
              f"{comp * 1e3:.3f} ms) | calls alone over measured compute "
              f"{alone / (prof.compute_seconds / STEPS):.3g} | measured {prof.gamma:.3g}")
        print(f"tokens dropped per step {dropped_total / STEPS:.1f} of {p * T * k}; per rank "
              f"the forward's all-to-all sends {sent_total / STEPS / p * 2:,.0f} B of tokens "
              f"(dispatch + combine; priced worst case {priced.bytes_per_rank:,} B incl. counts); "
              f"the job's all-to-all volume, p times that, grows with P: O(batch * P)")


if __name__ == "__main__":
    main()
