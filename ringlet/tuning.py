"""``algorithm="auto"`` measured on the job's own calls: the cost model names the
candidates, the job times them, the slowest rank decides (``RINGLET_TUNE=n``).

Why: the model prices this host to about its own repeatability (docs/results.md,
"Cost-model accuracy"), and where it misses it can miss by 1.5-2.5x - where ranks
outnumber the cores, a small all_gather by recursive doubling against direct, a
broadcast's pipeline at 8 MiB. A training job makes the same calls step after step, so it
can afford to time a few: with ``RINGLET_TUNE=n`` (rank 0's value counts, for the whole
job) the first calls of each call shape - collective, group, count, dtype, root, op and
buffer kinds - run the model's candidates (``shortlist``: every algorithm predicted
within ``SPREAD`` of the model's winner, at most ``MOST``, the model's winner first), each
in ``BLOCKS`` blocks of one untimed call and ``n`` timed ones, the blocks of the
candidates in turn. Blocks, not one call each in turn: ranks that outnumber the cores
fall into a rhythm over repeated calls of one algorithm, and a call that follows another
algorithm's took 2-3x as long (8 B broadcast, p = 4 on 2 cores: 60-115 us called in
turn, 23-44 us in blocks). Then one small all_reduce (MAX) gives every rank the slowest
rank's median time of each candidate in each block, and from the next call on that
shape runs the fastest (the least mean of its blocks) of those that beat the model's
winner by more than ``KEEP`` in every block (``pick``): a smaller lead is within this
host's noise. Every rank decides alike: they make the same calls in the same
order (as every collective needs) and take the same agreed times.

Only blocking calls are timed and counted; an async call of a shape still on trial runs
the model's winner. Uneven all_to_all_single is not tuned: its ranks key their calls by
their own splits, which may group calls differently on different ranks.
"""
from __future__ import annotations

import os

import numpy as np

#: candidates: every algorithm predicted within SPREAD x the model's winner, at most MOST
SPREAD = 2.0
MOST = 4
#: each candidate runs in BLOCKS blocks (of one untimed call and n timed ones)
BLOCKS = 2
#: another candidate replaces the model's winner only if it measured this much faster, in
#: every block: two measurements of this host's cells disagree on the winner by more than
#: 10% in one cell of six to eleven (bench/accuracy.py's repeatability, 82-91% agreement
#: on 2026-12-02), so a smaller lead is as likely noise
KEEP = 0.10
#: call shapes decided per process, after which new shapes keep the model's pick
LIMIT = 4096


def shortlist(predicted) -> int:
    """How many of the candidates predicted to take ``predicted`` seconds (fastest first)
    go on trial: those within SPREAD of the model's winner, at most MOST."""
    return min(MOST, sum(1 for t in predicted if t <= SPREAD * predicted[0]))


def trials_from_env() -> int:
    """RINGLET_TUNE: timed calls per candidate and block (0 or unset: the model decides
    alone)."""
    raw = os.environ.get("RINGLET_TUNE", "0").strip() or "0"
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"RINGLET_TUNE must be a whole number of calls per candidate "
                         f"(0: off), got {raw!r}") from None
    if n < 0:
        raise ValueError(f"RINGLET_TUNE must be >= 0, got {n}")
    return n


class Trials:
    """One call shape on trial: its candidates' prepared calls (the model's winner
    first), each run in BLOCKS blocks of 1 + ``per`` calls, the blocks in turn, and this
    rank's time of each timed call."""
    __slots__ = ("calls", "per", "n", "order", "times", "predicted", "lanes")

    def __init__(self, calls: list, per: int, predicted: list):
        self.calls = calls            # collectives.Prepared, one per candidate
        self.per = per
        self.n = 0                    # runs so far
        # (candidate, block, timed) of every run: a block's first call only sets its rhythm
        self.order = [(i, b, k > 0) for b in range(BLOCKS) for i in range(len(calls))
                      for k in range(per + 1)]
        self.times = [[[] for _ in range(BLOCKS)] for _ in calls]
        self.predicted = predicted    # the model's seconds for each candidate
        self.lanes = {}               # candidate -> its lane (collectives._lane), once C ran it whole

    @property
    def first(self):
        """The model's winner (what an async call of this shape runs meanwhile)."""
        return self.calls[0]

    def current(self):
        """The candidate this call runs: blocks in turn, so that a slow spell of the host
        falls on all of them alike."""
        return self.calls[self.order[self.n][0]]

    def record(self, seconds: float) -> bool:
        """This rank's time of the call ``current`` named; True once every block has
        run."""
        i, b, timed = self.order[self.n]
        if timed:
            self.times[i][b].append(seconds)
        self.n += 1
        return self.n >= len(self.order)

    def medians(self) -> np.ndarray:
        """This rank's median time of each candidate in each block (candidates x blocks)."""
        return np.array([[float(np.median(b)) for b in t] for t in self.times])


_DECISIONS: list = []


def pick(agreed: np.ndarray) -> int:
    """Which candidate wins, from the agreed times (candidates x blocks, the model's
    winner first): of those that beat the model's winner by more than KEEP in every block,
    the least mean over its blocks (ties to the model's order); else the model's winner.
    In every block, not on the mean: of 658 decisions on one accuracy grid, judged against
    its own measurements (bench/accuracy.py --tune 4), that left 9 losses over 30% against
    17 on the mean (the model's own pick: 12), and 592 picks within 10% of the best
    against 588 (the model: 566)."""
    mean = agreed.mean(axis=1)
    beat = np.all(agreed * (1 + KEEP) < agreed[0], axis=1)
    return int(np.argmin(np.where(beat, mean, np.inf))) if beat.any() else 0


def decide(trials: Trials, agreed: np.ndarray, what: str) -> int:
    """The candidate every later call runs (:func:`pick`), from the agreed times
    (candidates x blocks: the slowest rank's median in each block). Records the decision
    for :func:`decisions`."""
    best = pick(agreed)
    _DECISIONS.append({
        "call": what,
        "chosen": trials.calls[best].algorithm,
        "model": trials.first.algorithm,
        "candidates": [{"algorithm": c.algorithm, "read_in_place": c.in_place,
                        "predicted_s": float(pred), "measured_s": float(t.mean()),
                        "blocks_s": [float(x) for x in t]}
                       for c, pred, t in zip(trials.calls, trials.predicted, agreed)],
        "calls_each": trials.per})
    return best


def decisions() -> list:
    """What the tuner decided in this process, oldest first: for each call shape, the
    candidates with their predicted and agreed measured seconds (``blocks_s``: the slowest
    rank's median in each block; ``measured_s``: their mean), the model's winner and the
    one chosen."""
    return [dict(d, candidates=[dict(c, blocks_s=list(c["blocks_s"])) for c in d["candidates"]])
            for d in _DECISIONS]


def describe(decision: dict) -> str:
    """One line for RINGLET_DEBUG=algo: what the tuner chose, and from what."""
    parts = ", ".join(f"{c['algorithm']}{'' if c['read_in_place'] else ' (plain path)'} "
                      f"{c['measured_s'] * 1e6:.4g}us (predicted {c['predicted_s'] * 1e6:.4g})"
                      for c in decision["candidates"])
    how = ("the model's pick, kept" if decision["chosen"] == decision["model"] else
           f"measured fastest (the model picked {decision['model']})")
    return (f"{decision['call']}: {decision['chosen']}, {how} ({BLOCKS} blocks of 1 + "
            f"{decision['calls_each']} calls each, slowest rank's median: {parts})")
