"""Actor-learner on a 10-armed bandit, 4 ranks: rank 0 learns a softmax policy, ranks 1-3
act with it (a varying number of pulls each round) and send back (arm, reward) rows.

    OPENBLAS_NUM_THREADS=1 ringlet run -n 4 examples/train_actor_learner.py [staleness]

A transient straggler: in round c, actor 1 + c % 3 takes 20 ms longer to act (a preempted
process). With staleness 0 every round waits for it; with staleness s the other actors go
on with weights up to s versions old. Rank 0 prints the mean reward per round, the wall
time, how stale the experience it learned from was, how long actors sat blocked, and a
round's communication priced, replayed alone and measured, with gamma.
"""
import sys
import time

import numpy as np

import ringlet as rl
from ringlet import train

ARMS, ROUNDS, LR, SLOW = 10, 40, 3.0, 0.02
ROWS = 40            # experience rows per actor per round, about (20 + 10 rank + 0..9)
MEANS = np.linspace(0.1, 0.9, ARMS)


def policy(logits):
    z = np.exp(logits - logits.max())
    return z / z.sum()


def main():
    s = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    rl.init()
    rank, p = rl.get_rank(), rl.get_world_size()
    logits = np.zeros(ARMS)
    ps = train.ParameterServer(logits, width=2, staleness=s)
    rewards = []

    def update(w, exps):
        rows = np.concatenate(exps)
        arms, r = rows[:, 0].astype(int), rows[:, 1]
        pi = policy(w)
        grad = np.zeros(ARMS)
        np.add.at(grad, arms, r - r.mean())          # REINFORCE with a mean baseline
        grad -= (r - r.mean()).sum() * pi
        w += LR * grad / len(rows)
        rewards.append(r.mean())

    def act(w, c):
        rng = np.random.default_rng([rank, c])
        n = 20 + 10 * rank + int(rng.integers(0, 10))      # varying experience sizes
        if rank == 1 + c % (p - 1):
            time.sleep(SLOW)                             # the straggler of this round
        arms = rng.choice(ARMS, n, p=policy(w))
        return np.stack([arms, rng.random(n) < MEANS[arms]], 1).astype(np.float64)

    rl.barrier()
    t0 = time.perf_counter()
    with rl.profile() as prof:
        if rank == 0:
            ps.learn(ROUNDS, update)
        else:
            ps.act(ROUNDS, act)
    wall = time.perf_counter() - t0
    blocked = np.array([ps.blocked_seconds])
    rl.all_reduce(blocked)
    # rank 0's measured split, and the actors' (mean): the straggler's sleep is their compute
    split = np.array([prof.comm_seconds, prof.compute_seconds]) / ROUNDS
    actors = split * (rank != 0)
    rl.all_reduce(actors)
    actors /= p - 1
    priced = ps.price(ROWS)
    alone = train.pricing.replay([c.call for c in priced.calls])
    if rank == 0:
        print(f"== actor-learner, {p - 1} actors, staleness {s}, a {SLOW * 1e3:.0f} ms straggler "
              f"each round")
        for c in list(range(0, ROUNDS, 5)) + [ROUNDS - 1]:
            print(f"round {c:3d}  mean reward {rewards[c]:.3f}  (best arm {MEANS[-1]:.1f})")
        lag = [c - v for c, a, v in ps.used_versions]
        print(f"wall {wall * 1e3:.1f} ms for {ROUNDS} rounds; experience staleness mean "
              f"{np.mean(lag):.2f}, max {max(lag)} versions; actors blocked "
              f"{blocked[0] * 1e3 / (p - 1):.1f} ms each on average")
        print(f"-- priced before it ran (a round: weights broadcast, {ROWS} rows gathered from "
              f"each actor; the job's profile, named below):\n{priced.table()}")
        print(f"-- measured (rl.profile), rank 0 the learner:\n{prof.table()}")
        comp = max(actors[1], 1e-9)
        print(f"per round, communication: {priced.comm_seconds * 1e3:.3f} ms priced | "
              f"{alone * 1e3:.3f} ms the same calls measured back to back | learner "
              f"{split[0] * 1e3:.3f} ms, actors {actors[0] * 1e3:.3f} ms measured inside rounds "
              f"(waiting for the straggler, or for weights); actors' compute {comp * 1e3:.3f} ms "
              f"(incl. the straggler's {SLOW * 1e3 / (p - 1):.1f} ms average)")
        print(f"gamma (actors): predicted {priced.gamma(comp):.3g} (priced comm / measured "
              f"compute) | calls alone {alone / comp:.3g} | measured "
              f"{actors[0] / comp:.3g}")
    rl.destroy()


if __name__ == "__main__":
    main()
