"""Parameter server / actor-learner (broadcast and gather; stale-synchronous SGD against
stragglers).

The learner (group rank ``learner``) owns the weights; every other rank is an actor that
generates experience (rows of ``width`` numbers, any number of rows) with a copy of them.
Round c: actors act with weights of some version, the learner collects round c's
experience from every actor, updates, and the weights become version c + 1.

* ``staleness=0`` (synchronous): each round is a broadcast of the weights, then a gather
  of the experience (its sizes first, then an uneven all_to_all into the learner).
* ``staleness=s > 0`` (bounded staleness): the learner sends each new version to every
  actor by isend; an actor acts with the newest version it has received, and blocks only
  if that is older than c - s. A slow actor then holds the others back only once they
  are s rounds ahead of it, not every round. Experience goes by isend with the round and
  the version it was made with.

    ps = ParameterServer(weights, width=3, staleness=2)
    if rank == 0: ps.learn(rounds, update)            # update(weights, [exp per actor])
    else:         ps.act(rounds, generate)             # generate(weights, round) -> rows

Calls may repeat (learn(2) three times runs what learn(6) runs: rounds go on). With
staleness, every actor ends a call holding the learner's newest version; synchronous, it
holds the version its last round used (the learner's last update reaches it with the next
round's broadcast).
"""
from __future__ import annotations

import collections
import time

import numpy as np

from .. import buffers
from ..collectives import all_to_all_single, broadcast, gather
from ..runtime import get_rank, irecv, isend, recv, resolve
from .arrays import as_numbers
from .pricing import Call, digest, disagreement, hosts_of, price


USED_KEPT = 1 << 16


class ParameterServer:
    """``weights``: the initial weights (the same on every rank; updated in place on the
    learner, replaced by received versions on actors). ``experience_dtype``: what the
    experience travels and arrives as (default: the weights' dtype); rows an actor
    generates in another dtype are cast to it, and refused where that would change their
    kind or overflow (float16 weights had delivered 123456789 as inf, with only NumPy's
    warning on the actor)."""

    def __init__(self, weights, width: int, staleness: int = 0, learner: int = 0, group=None,
                 experience_dtype=None):
        self.group = g = resolve(group)
        if g.size < 2:
            raise ValueError("a parameter server needs a learner and at least one actor")
        if not 0 <= learner < g.size:
            raise ValueError(f"learner must be a rank of the group (0..{g.size - 1}), got {learner}")
        if staleness < 0 or width < 1:
            raise ValueError(f"staleness must be >= 0 and width >= 1, got {staleness}, {width}")
        self.weights = as_numbers(weights, "weights", writable=True)
        self.width, self.s, self.learner = int(width), int(staleness), learner
        self.exp_dtype = self.weights.dtype if experience_dtype is None else \
            np.dtype(experience_dtype)
        if self.exp_dtype.kind not in "biuf":
            raise TypeError(f"experience_dtype must be a NumPy number dtype, got "
                            f"{self.exp_dtype}")
        self._agree()
        self.actors = [r for r in range(g.size) if r != learner]
        self.version = 0
        self.rounds = 0                # rounds run so far: calls of learn / act go on from there
        self.blocked_seconds = 0.0     # actor: waiting for weights (or the round's collectives)
        # learner: (round, actor, version its experience used), the last USED_KEPT of them
        # (a list had grown by one entry per actor and round for the whole run)
        self.used_versions: collections.deque = collections.deque(maxlen=USED_KEPT)
        self._pending: list = []       # learner: (snapshot, its sends) not yet known to be done

    def _agree(self) -> None:
        """Every rank must pass the same settings and weights' layout: else the learner and
        an actor wait for messages of another round, size or kind than the other sends, until
        their timeout. Checked once, here, on every rank."""
        w = self.weights
        every = disagreement([self.width, self.s, self.learner, w.size,
                              digest((w.shape, w.dtype.str, self.exp_dtype.str))], self.group)
        if every is not None:
            said = "; ".join(f"rank {r}: width={a}, staleness={s}, learner={l}, "
                             f"{n}-element weights" for r, (a, s, l, n, _) in enumerate(every))
            raise ValueError(f"rank {get_rank()}: ParameterServer: the ranks disagree ({said}; "
                             f"here weights {w.shape} {w.dtype}, experience "
                             f"{self.exp_dtype}): pass the same width, staleness, learner, "
                             f"weights' shape and dtype and experience_dtype on every rank")

    # -- learner ---------------------------------------------------------------------------
    def learn(self, rounds: int, update) -> None:
        """Run ``rounds`` rounds: collect every actor's experience, ``update(weights, exps)``
        (exps: one (n, width) array per actor, in actor order), publish the new version."""
        self._check_role(True)
        first = self.rounds
        for c in range(first, first + rounds):
            if self.s == 0:
                broadcast(self.weights, self.learner, self.group)
                exps = self._gather(np.empty((0, self.width), self.exp_dtype))
                self.used_versions += [(c, a, c) for a in self.actors]
            else:
                exps = [self._recv_experience(a, c) for a in self.actors]
            update(self.weights, exps)
            self.version = c + 1
            if self.s:      # (the last too: the actors end with it, and go on from it)
                self._publish()
        self.rounds = first + rounds
        if self.s:
            for lent, sends in self._pending:
                for w in sends:
                    w.wait()
                buffers.give_back(lent)
            self._pending = []

    def _publish(self) -> None:
        for done in [x for x in self._pending if all(w.is_completed() for w in x[1])]:
            self._pending.remove(done)
            buffers.give_back(done[0])
        # The actors read this version while we go on (from shared memory, in place).
        lent = buffers.lend(self.weights.nbytes)
        snapshot = buffers.lent_view(lent, self.weights.shape, self.weights.dtype)
        snapshot[...] = self.weights
        self._pending.append((lent, [isend(snapshot, a, self.group, tag=2 * self.version)
                                     for a in self.actors]))

    def _recv_experience(self, actor: int, c: int) -> np.ndarray:
        head = np.empty(3, np.int64)
        recv(head, actor, self.group, tag=2 * c + 1)
        rnd, version, n = head
        if rnd != c:
            raise RuntimeError(f"learner: actor {actor} sent round {rnd} where round {c} was due")
        exp = np.empty((n, self.width), self.exp_dtype)
        irecv(exp, actor, self.group, tag=(1 << 39) + c).wait()
        self.used_versions.append((c, actor, int(version)))
        return exp

    def _gather(self, rows: np.ndarray) -> list:
        g, p = self.group, self.group.size
        n = np.array([len(rows)], np.int64)
        sizes = np.empty((p, 1), np.int64) if g.rank == self.learner else None
        gather(n, sizes, dst=self.learner, group=g)
        splits = [len(rows) if r == self.learner else 0 for r in range(p)]
        if g.rank == self.learner:
            counts = sizes[:, 0].tolist()
            out = np.empty((sum(counts), self.width), rows.dtype)
        else:
            counts, out = [0] * p, np.empty((0, self.width), rows.dtype)
        all_to_all_single(out, rows, counts, splits, group=g)
        if g.rank != self.learner:
            return []
        bounds = np.cumsum([0] + counts)
        return [out[bounds[a]:bounds[a + 1]] for a in self.actors]

    # -- actors ------------------------------------------------------------------------------
    def act(self, rounds: int, generate) -> None:
        """Run ``rounds`` rounds of ``generate(weights, round) -> (n, width) rows``."""
        self._check_role(False)
        sends, nxt = [], None
        first, end = self.rounds, self.rounds + rounds
        for c in range(first, end):
            if self.s == 0:
                t = time.perf_counter()
                broadcast(self.weights, self.learner, self.group)
                self.blocked_seconds += time.perf_counter() - t
                self.version = c
            else:
                nxt = self._newest(nxt, need=c - self.s, last=end)
            rows = as_numbers(generate(self.weights, c), "experience")
            if rows.ndim != 2 or rows.shape[1] != self.width:
                raise ValueError(f"rank {get_rank()}: experience must have shape (n, {self.width}), "
                                 f"got {rows.shape}")
            # (sent while generate goes on: a copy, in case it fills the same array again)
            rows = self._as_experience(rows, copy=bool(self.s))
            if self.s == 0:
                t = time.perf_counter()
                self._gather(rows)
                self.blocked_seconds += time.perf_counter() - t
            else:
                head = np.array([c, self.version, len(rows)], np.int64)
                sends += [isend(head, self.learner, self.group, tag=2 * c + 1),
                          isend(rows, self.learner, self.group, tag=(1 << 39) + c)]
        if self.s:
            self._newest(nxt, need=end, last=end)   # every version sent to us: the newest
        self.rounds = end
        for w in sends:
            w.wait()

    def _as_experience(self, rows: np.ndarray, copy: bool) -> np.ndarray:
        """``rows`` in the experience dtype, or ValueError where the cast would change what
        they hold past rounding: another kind (floats into integers) or an overflow."""
        want = self.exp_dtype
        if rows.dtype != want and not np.can_cast(rows.dtype, want, "same_kind"):
            raise ValueError(f"rank {get_rank()}: experience of dtype {rows.dtype} cannot travel "
                             f"as {want} (the weights' dtype, unless experience_dtype= says "
                             f"otherwise): pass ParameterServer(..., experience_dtype="
                             f"'{rows.dtype}') on every rank, or generate {want} rows")
        if want.kind in "iu" and rows.dtype != want and rows.size:
            info = np.iinfo(want)          # (an integer cast wraps: 70000 as int16 is 4464)
            if rows.min() < info.min or rows.max() > info.max:
                raise ValueError(f"rank {get_rank()}: experience values overflow {want} "
                                 f"({rows.min()} .. {rows.max()}): pass ParameterServer(..., "
                                 f"experience_dtype='{rows.dtype}') on every rank")
        with np.errstate(over="ignore", invalid="ignore"):
            out = np.array(rows, want, order="C", copy=True if copy else None)
        if want.kind == "f" and rows.dtype != want and \
                not np.isfinite(out[np.isfinite(rows)]).all():
            raise ValueError(f"rank {get_rank()}: experience values overflow {want} (largest "
                             f"magnitude {np.abs(rows[np.isfinite(rows)]).max():g}): pass "
                             f"ParameterServer(..., experience_dtype='{rows.dtype}') on every "
                             f"rank")
        return out

    def _newest(self, nxt, need: int, last: int):
        """Adopt every version that has arrived; block while ours is older than ``need``.
        ``nxt``: (buffer, work) of the receive of the next version, posted ahead."""
        while True:
            if nxt is None and self.version < last:
                buf = np.empty_like(self.weights)
                nxt = (buf, irecv(buf, self.learner, self.group, tag=2 * (self.version + 1)))
            if nxt is None:
                return None
            if self.version >= need and not nxt[1].is_completed():
                return nxt
            t = time.perf_counter()
            nxt[1].wait()
            self.blocked_seconds += time.perf_counter() - t
            self.weights[...] = nxt[0]
            self.version += 1
            nxt = None

    def _check_role(self, learner: bool) -> None:
        if (self.group.rank == self.learner) != learner:
            raise RuntimeError(f"rank {get_rank()}: {'learn' if learner else 'act'} is for the "
                               f"{'learner' if learner else 'actors'} (learner is rank {self.learner})")

    # -- price ------------------------------------------------------------------------------
    def calls(self, rows_per_actor: int) -> list[Call]:
        """One round. Synchronous: the weights broadcast, then the experience gathered - its
        sizes (a gather), the uneven exchange's table of splits (an all_gather), the rows
        (priced as a gather: only the learner receives). With staleness: the learner's
        isend of the weights to each actor (priced as a scatter of one copy per rank: the
        same messages from the root), then each actor's header and rows (gathers). (It had
        priced the synchronous round's calls: 8 MiB of weights where 24 MiB went, p = 4.)"""
        p, item, e = self.group.size, self.weights.dtype.itemsize, self.exp_dtype.itemsize
        rows = Call("gather", p * rows_per_actor * self.width * e, p, e, label="experience")
        if self.s:     # (all of it isends, the weights from a lent rl.empty snapshot)
            return [Call("scatter", p * self.weights.nbytes, p, item,
                         label="weights, an isend to each actor", shared=("in",), p2p=True),
                    Call("gather", p * 3 * 8, p, 8, label="experience headers", p2p=True),
                    rows._replace(p2p=True)]
        return [Call("broadcast", self.weights.nbytes, p, item, label="weights"),
                Call("gather", p * 8, p, 8, label="experience sizes"),
                Call("all_gather", p * 2 * p * 8, p, 8, label="split table"), rows]

    def price(self, rows_per_actor: int, topology=None):
        return price(self.calls(rows_per_actor), topology, hosts_of(self.group))
