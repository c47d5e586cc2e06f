"""Every collective algorithm, written once as a function returning a ``Schedule``.

One module per collective (``all_reduce.py``, ``broadcast.py``, …), one small function per
algorithm, its α-β-γ cost in its docstring. The runtime executes one rank's part of the
schedule, the cost model prices all of it, ``ringlet.reference.run`` executes all of it
in one process (the tests' oracle).

    CATALOG["all_reduce"]["ring"]                       # the builder function
    build("all_reduce", "ring", p=4, count=1000)        # a cached Schedule

Uneven all-to-all: ``build("all_to_all", alg, p, count, splits=...)`` (count is then
ignored); "all_to_all_single" is the same catalog under its torch name.
"""
from __future__ import annotations

import inspect
from functools import lru_cache

import numpy as np

from ..schedule import Round, Schedule
from . import (all_gather, all_reduce, all_to_all, barrier, broadcast, gather, reduce,
               reduce_scatter, scatter)
from .all_reduce import tree_segments
from .broadcast import pipeline_segments

__all__ = ["CATALOG", "ROOTED", "SELF_AGREEING", "build", "agree_alongside",
           "pipeline_segments", "tree_segments"]


def _table(module, *names):
    return {name: getattr(module, name) for name in names}


CATALOG: dict[str, dict] = {
    "all_reduce": _table(all_reduce, "naive_ring", "direct", "ring", "gloo_ring", "recursive_doubling",
                         "rabenseifner", "tree", "double_tree", "hierarchical"),
    "broadcast": _table(broadcast, "direct", "binomial", "dissemination", "pipeline",
                        "scatter_allgather", "hierarchical"),
    "reduce": _table(reduce, "direct", "binomial", "dissemination", "rabenseifner", "gloo_ring"),
    "all_gather": _table(all_gather, "ring", "recursive_doubling", "bruck", "direct",
                         "hierarchical"),
    "reduce_scatter": _table(reduce_scatter, "ring", "recursive_halving", "direct",
                             "hierarchical"),
    "all_to_all": _table(all_to_all, "pairwise", "bruck", "direct"),
    "gather": _table(gather, "direct", "binomial", "dissemination"),
    "scatter": _table(scatter, "direct", "binomial", "dissemination"),
    "barrier": _table(barrier, "dissemination"),
}
CATALOG["all_to_all_single"] = CATALOG["all_to_all"]

#: collectives with a root (the ``root`` argument of ``build`` matters only for these)
ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})

#: rooted algorithms whose data rides the agreement's own messages (``Schedule.agrees``,
#: as their builders say): no barrier rounds before them, none in their price
SELF_AGREEING = frozenset((c, a) for c in ROOTED for a, builder in CATALOG[c].items()
                          if builder(2, 1).agrees)


_PARAMS = {id(b): frozenset(inspect.signature(b).parameters) for t in CATALOG.values() for b in t.values()}


def _accepts(builder, name: str) -> bool:
    return name in _PARAMS[id(builder)]


def build(collective: str, algorithm: str, p: int, count: int, *, itemsize: int = 4,
          root: int = 0, hosts=None, splits=None) -> Schedule:
    """The schedule of ``algorithm`` for ``collective`` on ``p`` ranks and ``count``
    elements per rank (the collective's own count: see ``ringlet.schedule``), cached.

    ``root`` is used by rooted collectives (and range-checked for all); ``hosts`` (host id
    of each rank) by the ``hierarchical`` algorithms and ignored by the rest; ``splits`` (p×p) only by
    all_to_all / all_to_all_single, where it makes the exchange uneven.
    """
    table = CATALOG.get(collective)
    if table is None:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(CATALOG)}")
    builder = table.get(algorithm)
    if builder is None:
        raise ValueError(f"unknown {collective} algorithm {algorithm!r}; valid: {', '.join(table)}")
    if isinstance(p, bool) or int(p) != p or p < 1:
        raise ValueError(f"group size p must be an integer >= 1, got {p!r}")
    if isinstance(count, bool) or int(count) != count or count < 0:
        raise ValueError(f"count must be an integer >= 0, got {count!r}")
    if int(itemsize) != itemsize or itemsize < 1:
        raise ValueError(f"itemsize must be an integer >= 1, got {itemsize!r}")
    if isinstance(root, bool) or int(root) != root or not 0 <= root < p:
        raise ValueError(f"root {root!r} is out of range for a group of {p} ranks")
    p, count, itemsize, root = int(p), int(count), int(itemsize), int(root)
    if hosts is not None:
        hosts = tuple(hosts)
        if len(hosts) != p:
            raise ValueError(f"hosts must give the host of each of the {p} ranks, got {len(hosts)}")
    if splits is not None:
        if not _accepts(builder, "splits"):
            raise ValueError(f"splits only apply to all_to_all, not {collective}")
        splits = tuple(tuple(int(x) for x in row) for row in splits)
        if len(splits) != p or any(len(row) != p for row in splits):
            raise ValueError(f"splits must be {p}x{p} (elements from rank i to rank j)")
        if any(x < 0 for row in splits for x in row):
            raise ValueError("splits must be non-negative")
    # Normalise what a builder ignores, so the cache holds one schedule per distinct one.
    return _build(collective, algorithm, p, count, itemsize,
                  root if collective in ROOTED else None,
                  hosts if _accepts(builder, "hosts") else None, splits)


@lru_cache(maxsize=1024)
def _build(collective, algorithm, p, count, itemsize, root, hosts, splits) -> Schedule:
    kwargs = {"itemsize": itemsize}
    if root is not None:
        kwargs["root"] = root
    if hosts is not None:
        kwargs["hosts"] = hosts
    if splits is not None:
        kwargs["splits"] = splits
    s = CATALOG[collective][algorithm](p, count, **kwargs)
    s.collective = collective
    if root is not None and p > 1 and not s.agrees:
        agree_alongside(s)
    return s


# A rooted algorithm's first round whose largest message is above this many bytes moves
# from the start of the call, beside the agreement (``Schedule.early``); a smaller one rides
# the agreement's last round. The bound is the shared-memory EAGER packet's
# (limits.SHM_EAGER_BYTES, tests/test_agreement.py holds them equal): a plan whose every
# message is one such packet runs in C (transport/fast.py), which takes rounds in turn.
EARLY_MIN_BYTES = 512 << 10


def agree_alongside(s: Schedule) -> None:
    """A rooted collective's ranks agree on the call in the dissemination barrier's lg p
    rounds (rank i signals rank i + 2^k with zero elements in round k). The algorithm's
    first round goes beside them, so its data does not wait for the whole barrier and no
    signal waits for data:

    * a large one (a message above ``EARLY_MIN_BYTES``) with lg p >= 2 is posted by every
      rank right after the barrier's first round and waited for after its last
      (``Schedule.early``): a root announces its blocks as it enters the call, and each
      receiver reads its own as soon as it enters, whoever else is late (p = 4 on two
      cores, 8 MiB scatter, in one job: without any agreement 530-630 us against 655-680
      with the data in the barrier's last round; Open MPI 520-545);
    * otherwise it rides the barrier's last round; where the algorithm sends from i to
      i + 2^k in that round, that message is the signal.

    Both ends post a pair's messages in the same order (the early round's after the first
    round's, before the later rounds'), and messages of one pair and call are matched in
    order, so a signal never meets a data receive.

    Every message carries the sender's fingerprint of the call (root included), and a
    receiver that sees another one aborts the call on every rank. A rooted algorithm alone
    cannot guarantee that: ranks that disagree on the root may share no message (two ranks
    that each think the other is the root of a gather both send and return). After the
    barrier's rounds every rank has heard, through a chain of messages each sent only
    after its sender's previous round, from every other rank; a rank that differs breaks
    the chain where it first meets the other view (whatever the algorithm and root, the
    pairs are the barrier's), so no rank can finish the call. Data that moves beside the
    signals may have moved in a call that then fails: its outputs are undefined, as
    with MPI (and as with the "dissemination" algorithms, whose data rides these very
    messages: ``Schedule.agrees``). Merged into the algorithm's rounds from the first on,
    the later signals waited for the data before them, and a crowded scatter at p = 4
    8 MiB ran 0.61-0.96x as fast as with the barrier first in six of seven in-job A/B rows
    (docs/results.md)."""
    agree = barrier.dissemination(s.p).rounds
    s.alone = list(s.rounds)
    s.agreement = len(agree)
    if len(agree) > 1 and s.rounds and _largest(s.rounds[0]) * s.itemsize > EARLY_MIN_BYTES:
        s.rounds[:0] = agree
        s.early = len(agree)
        return
    last = agree[-1]
    if s.rounds:
        c, sig = s.rounds[0].cols, last.cols
        moved = c["src"] != c["dst"]
        talking = set(zip(c["src"][moved].tolist(), c["dst"][moved].tolist()))
        keep = np.array([(a, b) not in talking
                         for a, b in zip(sig["src"].tolist(), sig["dst"].tolist())], bool)
        last = Round().extend(s.rounds[0]).extend(last, keep)
    s.rounds[:1] = [*agree[:-1], last]


def _largest(rnd: Round) -> int:
    """The most elements one message of ``rnd`` carries (0: none)."""
    c = rnd.cols
    return int(c["n"][c["src"] != c["dst"]].max(initial=0))
