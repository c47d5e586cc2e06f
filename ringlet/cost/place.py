"""Placement: which host each rank of a job should run on, so that a training step
communicates least.

A job is a list of :class:`Comm`: one kind of communication (say, the tensor-parallel
all-reduces) over a set of disjoint groups of *logical* ranks 0..P-1, with the bytes and
number of calls per step. A mapping puts logical rank r on host ``hosts[r]``, each host
taking ``ranks_per_host`` ranks. A mapping is priced the way the runtime would run it:
each group's algorithm is the one ``choose`` picks for that group's host layout (what
``algorithm="auto"`` does), and all the groups of one kind — which run at the same time
and share the hosts' NICs — are simulated together as one schedule on the whole
topology. The kinds of one step are priced one after another (no overlap between them).

The search (:func:`place`): the naive mapping (logical rank r on host r // ranks_per_host,
the launcher's order), one mapping per kind that keeps each of its groups contiguous
(for tensor x data parallel: TP inside hosts, or DP inside hosts), then a local search
that swaps two ranks of different hosts while that lowers the predicted time.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from .model import check_collective, format_size, tier
from .simulate import Topology, simulate
from .tune import build_schedule, choose

__all__ = ["Comm", "Placement", "place", "price", "tensor_data_parallel", "expert_parallel"]


@dataclass(frozen=True)
class Comm:
    """One kind of communication of a step: ``collective`` of ``nbytes`` (the size
    convention of :mod:`ringlet.cost.model`) on each of ``groups`` (disjoint tuples of
    logical ranks, all at once), ``calls`` times per step. ``algorithm`` forces one
    (default: what auto picks for each group's host layout)."""
    name: str
    groups: tuple
    collective: str
    nbytes: int
    calls: int = 1
    algorithm: str | None = None

    def __post_init__(self):
        check_collective(self.collective)
        groups = tuple(tuple(int(r) for r in g) for g in self.groups)
        object.__setattr__(self, "groups", groups)
        seen = [r for g in groups for r in g]
        if len(seen) != len(set(seen)):
            raise ValueError(f"{self.name}: a rank is in two of its groups; the groups of one "
                             f"kind run at the same time and must be disjoint")
        if self.nbytes < 0 or self.calls < 0:
            raise ValueError(f"{self.name}: nbytes and calls must be >= 0")


def tensor_data_parallel(tp: int, dp: int, tp_bytes: int, dp_bytes: int, *,
                         tp_collective: str = "all_reduce", dp_collective: str = "all_reduce",
                         tp_calls: int = 1, dp_calls: int = 1) -> list[Comm]:
    """Tensor-parallel groups of ``tp`` inside ``dp`` data-parallel replicas: logical rank
    ``i * tp + j`` is shard j of replica i (TP groups contiguous, Megatron's order). TP
    group i = {i·tp .. i·tp + tp − 1}; DP group j = {j, tp + j, 2·tp + j, …}."""
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be >= 1, got tp={tp}, dp={dp}")
    r = np.arange(tp * dp).reshape(dp, tp)
    return [Comm("tp", tuple(map(tuple, r)), tp_collective, tp_bytes, tp_calls),
            Comm("dp", tuple(map(tuple, r.T)), dp_collective, dp_bytes, dp_calls)]


def expert_parallel(p: int, ep: int, nbytes: int, calls: int = 1) -> Comm:
    """Expert-parallel groups of ``ep`` consecutive logical ranks exchanging tokens with an
    all_to_all of ``nbytes`` per rank (MoE dispatch; combine is another call)."""
    if ep < 1 or p % ep:
        raise ValueError(f"the expert-parallel size {ep} must divide the {p} ranks")
    return Comm("ep", tuple(tuple(range(i, i + ep)) for i in range(0, p, ep)), "all_to_all",
                nbytes, calls)


class _Round:
    __slots__ = ("cols",)

    def __init__(self, cols):
        self.cols = cols


@dataclass
class _Merged:
    """The schedules of all groups of one kind as one schedule over the P ranks (what the
    simulator needs of a Schedule: p, itemsize, rounds with src/dst/n/reduce columns)."""
    p: int
    itemsize: int
    rounds: list = field(default_factory=list)
    early: int = -1     # Schedule.early, where every group's schedule has it alike


class _Pricer:
    def __init__(self, comms, hosts, ranks_per_host, intra, inter, gamma, nic_sharing,
                 shared=1.0):
        self.comms = list(comms)
        self.H, self.R = int(hosts), int(ranks_per_host)
        self.P = self.H * self.R
        self.intra, self.inter = tier(intra), tier(inter)
        self.gamma, self.nic_sharing, self.shared = float(gamma), bool(nic_sharing), float(shared)
        for c in self.comms:
            bad = [r for g in c.groups for r in g if not 0 <= r < self.P]
            if bad:
                raise ValueError(f"{c.name}: rank {bad[0]} is outside the job's {self.P} ranks "
                                 f"({self.H} hosts x {self.R})")
        self.evaluations = 0

    def topology(self, host_ids):
        return Topology.from_host_ids(host_ids, self.intra, self.inter, self.gamma,
                                      nic_sharing=self.nic_sharing, shared=self.shared)

    def comm_time(self, c: Comm, host_of) -> tuple[float, list[str]]:
        merged = _Merged(self.P, 4)
        algs, early = [], set()
        for g in c.groups:
            if len(g) < 2:
                continue
            ids = tuple(int(host_of[r]) for r in g)
            alg = c.algorithm or choose(c.collective, c.nbytes, len(g),
                                        topology=self.topology(ids))[0]
            algs.append(alg)
            sched = build_schedule(c.collective, alg, len(g), c.nbytes,
                                   hosts=ids if len(set(ids)) > 1 else None)
            merged.itemsize = sched.itemsize
            early.add(sched.early)
            ranks = np.asarray(g, np.int64)
            for i, rnd in enumerate(sched.rounds):
                if len(merged.rounds) <= i:
                    merged.rounds.append([])
                cols = rnd.cols
                merged.rounds[i].append((ranks[cols["src"]], ranks[cols["dst"]], cols["n"],
                                         cols["reduce"]))
        if not algs:
            return 0.0, algs
        # (groups whose early rounds differ: each round in its turn, an upper bound)
        merged.early = early.pop() if len(early) == 1 else -1
        merged.rounds = [_Round(dict(zip(("src", "dst", "n", "reduce"),
                                         (np.concatenate(col) for col in zip(*parts)))))
                         for parts in merged.rounds]
        return simulate(merged, self.topology(tuple(int(h) for h in host_of))).time * c.calls, algs

    def __call__(self, host_of) -> tuple[float, dict, dict]:
        self.evaluations += 1
        per, algs = {}, {}
        for c in self.comms:
            per[c.name], a = self.comm_time(c, host_of)
            algs[c.name] = sorted(set(a))
        return sum(per.values()), per, algs


@dataclass
class Placement:
    """What :func:`place` proposes: ``hosts[r]`` is the host of logical rank r; ``time``
    the predicted communication seconds per step (``per_comm`` by kind, ``algorithms``
    what auto runs for each), beside the same for the naive mapping."""
    hosts: list
    time: float
    per_comm: dict
    algorithms: dict
    naive_hosts: list
    naive_time: float
    naive_per_comm: dict
    naive_algorithms: dict
    found_by: str
    topology: str
    evaluations: int

    @property
    def speedup(self) -> float:
        return self.naive_time / self.time if self.time > 0 else 1.0

    def host_table(self, hosts=None) -> list[list[int]]:
        hosts = self.hosts if hosts is None else hosts
        table = [[] for _ in range(max(hosts) + 1)]
        for r, h in enumerate(hosts):
            table[h].append(r)
        return table

    def __str__(self) -> str:
        def ms(t):
            return f"{t * 1e3:10.3f}"
        lines = [f"placement on {self.topology}",
                 f"{'communication per step':<28}{'naive (ms)':>10}{'proposed':>10}   algorithms "
                 f"(naive -> proposed)"]
        for name in self.per_comm:
            lines.append(f"  {name:<26}{ms(self.naive_per_comm[name])}{ms(self.per_comm[name])}"
                         f"   {','.join(self.naive_algorithms[name]) or '-'} -> "
                         f"{','.join(self.algorithms[name]) or '-'}")
        lines.append(f"  {'total':<26}{ms(self.naive_time)}{ms(self.time)}"
                     f"   ({self.speedup:.2f}x; found by {self.found_by}, "
                     f"{self.evaluations} mappings priced)")
        table = self.host_table()
        shown = "  ".join(f"h{h}: {','.join(map(str, rs))}" for h, rs in enumerate(table[:4]))
        more = f"  ... ({len(table) - 4} more hosts)" if len(table) > 4 else ""
        lines.append(f"proposed ranks per host: {shown}{more}")
        return "\n".join(lines)


def _contiguous(groups, P):
    """Slot order that keeps each group contiguous (groups in order, then the rest)."""
    order = [r for g in groups for r in g]
    rest = [r for r in range(P) if r not in set(order)]
    return order + rest


def _hosts_from_order(order, R):
    hosts = [0] * len(order)
    for slot, r in enumerate(order):
        hosts[r] = slot // R
    return hosts


def price(comms, hosts: int, ranks_per_host: int, mapping=None, *, intra="nvlink",
          inter="ethernet", gamma: float = 0.0, nic_sharing: bool = True,
          shared: float = 1.0) -> tuple[float, dict]:
    """Predicted communication seconds per step of ``comms`` with logical rank r on host
    ``mapping[r]`` (default: the naive r // ranks_per_host), and the seconds per kind."""
    pricer = _Pricer(comms, hosts, ranks_per_host, intra, inter, gamma, nic_sharing, shared)
    if mapping is None:
        mapping = [r // pricer.R for r in range(pricer.P)]
    _check_mapping(mapping, pricer)
    total, per, _ = pricer(list(mapping))
    return total, per


def _check_mapping(mapping, pricer):
    counts = np.bincount(np.asarray(mapping, np.int64), minlength=pricer.H)
    if len(mapping) != pricer.P or len(counts) != pricer.H or (counts != pricer.R).any():
        raise ValueError(f"a mapping gives each of the {pricer.P} ranks one of {pricer.H} hosts, "
                         f"{pricer.R} ranks per host")


def place(comms, hosts: int, ranks_per_host: int, *, intra="nvlink", inter="ethernet",
          gamma: float = 0.0, nic_sharing: bool = True, max_evaluations: int = 400,
          seed: int = 0, shared: float = 1.0) -> Placement:
    """The rank -> host mapping with the least predicted communication per step found by
    the search in this module's docstring (at most ``max_evaluations`` mappings priced),
    with the naive mapping's prediction beside it. ``intra``/``inter``: links or tier
    names (``ringlet.cost.TIERS``; a calibrated profile's via ``Profile.link``);
    ``shared``: see ``Topology.shared``."""
    pricer = _Pricer(comms, hosts, ranks_per_host, intra, inter, gamma, nic_sharing, shared)
    P, R = pricer.P, pricer.R
    naive = [r // R for r in range(P)]
    n_time, n_per, n_algs = pricer(naive)
    best = (n_time, naive, n_per, n_algs, "the naive order")
    for c in pricer.comms:
        cand = _hosts_from_order(_contiguous(c.groups, P), R)
        if cand == naive:
            continue
        t, per, algs = pricer(cand)
        if t < best[0] * (1 - 1e-9):
            best = (t, cand, per, algs, f"{c.name} groups contiguous")
    # local search: swap two ranks of different hosts while it helps
    rng = random.Random(seed)
    t, cur, per, algs, how = best
    improved, swaps = True, 0
    while improved and pricer.evaluations < max_evaluations and pricer.H > 1:
        improved = False
        pairs = [(a, b) for a in range(P) for b in range(a + 1, P) if cur[a] != cur[b]]
        rng.shuffle(pairs)
        for a, b in pairs:
            if pricer.evaluations >= max_evaluations:
                break
            if cur[a] == cur[b]:
                continue
            trial = list(cur)
            trial[a], trial[b] = trial[b], trial[a]
            tt, tper, talgs = pricer(trial)
            if tt < t * (1 - 1e-6):
                t, cur, per, algs, swaps, improved = tt, trial, tper, talgs, swaps + 1, True
    if swaps:
        how += f" + {swaps} swap{'s' if swaps > 1 else ''}"
    topo = pricer.topology(tuple(cur))
    return Placement(cur, t, per, algs, naive, n_time, n_per, n_algs, how,
                     f"{pricer.H} hosts x {R} ranks; intra {pricer.intra}; inter {pricer.inter}"
                     + ("; shared NIC" if topo.nic_sharing else ""), pricer.evaluations)


def describe(comms) -> str:
    """One line per kind: what it moves per step."""
    return "\n".join(f"  {c.name}: {len(c.groups)} groups of {len(c.groups[0])}, "
                     f"{c.collective} of {format_size(c.nbytes)} x {c.calls} per step"
                     for c in comms)
