"""Lose a rank, shrink, and finish the run.

4 ranks train a linear model data-parallel (each takes its share of every global batch,
the gradients are summed with all_reduce). One rank is SIGKILLed at a random step. The
other 3 catch the PeerFailure, call rl.shrink() to agree on their new world, agree on
the last step all of them finished, roll back to it, re-split each batch three ways and
finish. Then a fresh 3-rank run resumes from that step's checkpoint: it must end at the
same loss. Prints the time from the kill to the first successful collective of the
shrunk world.

    python examples/shrink.py [--steps 40] [--seed 0] [--json out.json]
"""
import argparse
import json
import os
import signal
import sys
import tempfile
import time

import numpy as np

import ringlet as rl

DIM, BATCH, LR = 64, 96, 0.01   # (far from converged at 40 steps: a step lost or taken twice shows)
TRUE_W = np.random.default_rng(12345).standard_normal(DIM)


def batch(step: int):
    """The global batch of a step (the same on every rank); step -1 is the eval batch."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, DIM))
    return x, x @ TRUE_W + 0.1 * rng.standard_normal(BATCH)


def step_once(w: np.ndarray, step: int) -> float:
    """One data-parallel SGD step on this rank's share of the batch; returns the loss."""
    p, r = rl.get_world_size(), rl.get_rank()
    x, y = batch(step)
    x, y = x[r::p], y[r::p]                    # this rank's rows: the split follows the world
    err = x @ w - y
    buf = np.append(x.T @ err, 0.5 * err @ err)   # gradient and loss sums, one all_reduce
    rl.all_reduce(buf)
    w -= LR * buf[:-1] / BATCH
    return buf[-1] / BATCH


def eval_loss(w: np.ndarray) -> float:
    p, r = rl.get_world_size(), rl.get_rank()
    x, y = batch(-1)
    err = x[r::p] @ w - y[r::p]
    s = np.array([0.5 * err @ err])
    rl.all_reduce(s)
    return float(s[0] / BATCH)


def train(rank: int, steps: int, victim: int, kill_step: int, out: str) -> None:
    w = np.zeros(DIM)
    done = {0: w.copy()}                       # checkpoints of the last steps finished
    step = 0
    while step < steps:
        if rank == victim and step == kill_step:
            with open(os.path.join(out, "killed"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            step_once(w, step)
            step += 1
            done[step] = w.copy()
            done.pop(step - 3, None)
        except rl.PeerFailure as exc:
            world = rl.shrink()
            # The survivors agree on the last step all of them finished, and resume there.
            agreed = np.array([step])
            rl.all_reduce(agreed, op=rl.ReduceOp.MIN)
            recovered = time.time()
            step = int(agreed[0])
            w = done[step].copy()
            if world.rank == 0:
                np.savez(os.path.join(out, "checkpoint.npz"), w=w, step=step)
                with open(os.path.join(out, "recovery.json"), "w") as f:
                    json.dump({"lost": list(world.lost), "failure": str(exc),
                               "resumed_at": step, "recovered": recovered}, f)
    loss = eval_loss(w)
    if rl.get_rank() == 0:
        with open(os.path.join(out, "final.json"), "w") as f:
            json.dump({"loss": loss, "world": rl.get_world_size()}, f)


def resume(rank: int, steps: int, out: str) -> None:
    """The reference: a 3-rank run from the checkpoint the survivors resumed from."""
    ck = np.load(os.path.join(out, "checkpoint.npz"))
    w, step = ck["w"].copy(), int(ck["step"])
    while step < steps:
        step_once(w, step)
        step += 1
    loss = eval_loss(w)
    if rank == 0:
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump({"loss": loss}, f)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=None, help="picks the victim and the step")
    ap.add_argument("--json", default=None, help="write the result here too")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    victim, kill_step = int(rng.integers(4)), int(rng.integers(1, a.steps - 1))
    with tempfile.TemporaryDirectory(prefix="shrink-example-") as out:
        try:
            rl.spawn(train, 4, args=(a.steps, victim, kill_step, out), keep_going=True,
                     timeout=120)
            raise SystemExit("the victim did not die")
        except rl.ProcessFailed as exc:
            if exc.rank != victim:
                raise
        rl.spawn(resume, 3, args=(a.steps, out), timeout=120)
        killed = float(open(os.path.join(out, "killed")).read())
        rec = json.load(open(os.path.join(out, "recovery.json")))
        final = json.load(open(os.path.join(out, "final.json")))
        ref = json.load(open(os.path.join(out, "reference.json")))
    result = {"victim": victim, "kill_step": kill_step, "resumed_at": rec["resumed_at"],
              "lost": rec["lost"], "failure": rec["failure"],
              "recovery_s": rec["recovered"] - killed, "final_loss": final["loss"],
              "final_world": final["world"], "reference_loss": ref["loss"],
              "match": bool(np.isclose(final["loss"], ref["loss"], rtol=1e-9, atol=0))}
    print(f"rank {victim} SIGKILLed at step {kill_step} of {a.steps}; survivors saw: "
          f"{rec['failure']}")
    print(f"shrunk to 3 ranks (lost {rec['lost']}), resumed at step {rec['resumed_at']}; "
          f"kill -> first collective on the shrunk world: {result['recovery_s'] * 1e3:.0f} ms")
    print(f"final loss {final['loss']:.12g} (3 survivors) vs {ref['loss']:.12g} (3-rank run "
          f"from the checkpoint): {'same' if result['match'] else 'DIFFERENT'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["match"] else 1)
