"""Automatic algorithm choice that explains itself: least predicted time wins.

``choose(collective, nbytes, p)`` ranks every candidate algorithm by predicted time on
this host's calibrated profile (or on a given link / topology) and returns the winner with
the rows that justify it. One host: closed forms. Several hosts: the simulator prices the
very schedules ``ringlet.algorithms`` builds on a two-tier topology (intra-host shm,
inter-host tcp, a NIC shared by a host's ranks); for very large groups, or when the
algorithms package is unavailable, the closed forms are used with the inter-host link
(the bottleneck, shared by the flows a host sends across at once) for flat algorithms and
the two-level formula for ``hierarchical``.

Results are cached per (collective, nbytes, p, hosts, candidates, topology), so the
runtime can call ``choose`` on every collective call.
"""
from __future__ import annotations

import json
import math
from typing import NamedTuple

import numpy as np

from .model import (ALGORITHMS, DEFAULT_ALGORITHM, HOST_AWARE, Link, Terms, _check_size,
                    check_hosts,
                    check_algorithm, check_collective, closed_form, count_of, nbytes_of, tier)
from .profile import Profile, host_link, load_profile
from .simulate import Topology, simulate

#: largest group the simulator prices inside choose(); larger ones use closed forms.
#: Every candidate at 64 hosts x 8 ranks simulates in under a second here; at 4096
#: ranks one candidate takes up to half a minute.
SIM_MAX_P = 1024


class Row(NamedTuple):
    """One candidate's prediction (seconds). ``total`` = latency + bandwidth + reduction
    + memory; ``memory`` (memory-hierarchy stalls) and ``sharing`` (how much of the total
    comes from ranks sharing cores, spread over the other terms) are non-zero only for a
    calibrated host model (:class:`ringlet.cost.host.HostModel`); ``parts`` then
    holds the seconds of every named term on the critical path. ``inter`` (several
    hosts, simulated) is how much of latency + bandwidth the critical path spends on
    inter-host messages; the rest is on the intra-host link (and local copies)."""
    algorithm: str
    total: float
    latency: float
    bandwidth: float
    reduction: float
    method: str = "closed form"
    memory: float = 0.0
    sharing: float = 0.0
    parts: tuple = ()
    inter: float = 0.0


def _host_ids(hosts, p):
    """Normalise ``hosts``: None, a host count (ranks split evenly, contiguous), or one
    host label per rank. Returns a tuple of per-rank ids, or None for one host."""
    if hosts is None:
        return None
    if isinstance(hosts, (int,)) and not isinstance(hosts, bool):
        H = int(hosts)
        if H < 1 or p % H:
            raise ValueError(f"hosts={H} must divide the group size p={p}")
        if H == 1:
            return None
        L = p // H
        return tuple(r // L for r in range(p))
    ids = tuple(hosts)
    if len(ids) != p:
        raise ValueError(f"hosts has {len(ids)} entries for a group of {p} ranks")
    labels: dict = {}
    norm = tuple(labels.setdefault(h, len(labels)) for h in ids)
    return None if len(labels) == 1 else norm


def _profile_key(prof: Profile):
    key = getattr(prof, "_ringlet_key", None)
    if key is None:
        key = (prof.source, json.dumps(prof.transports, sort_keys=True, default=str))
        try:
            prof._ringlet_key = key
        except AttributeError:  # pragma: no cover
            pass
    return key


class _Env(NamedTuple):
    """Where predictions are made: a uniform link, or a multi-host topology."""
    link: Link | None
    gamma: float
    topology: Topology | None
    key: tuple
    delta: float = 0.0   # local copies (s/byte): priced by simulating the schedule
    host: object = None  # HostModel of one host: priced by simulating the schedule


def _host_env(model, gamma=None) -> _Env:
    """One host priced by its host model (``gamma``, if given, overrides the model's)."""
    if gamma is not None:
        from dataclasses import replace
        model = replace(model, gamma=float(gamma))
    return _Env(model.link, model.gamma, None, ("host", model), model.delta, model)


def environment(p, topology=None, hosts=None, gamma=None, transport: str = "shm") -> _Env:
    """Where to predict (see :func:`choose`); ``transport``: what the ranks of one host
    use to talk, with a profile ("shm", or "tcp" in a job of backend="tcp")."""
    ids = _host_ids(hosts, p)
    if isinstance(topology, Topology):
        if topology.p != p:
            raise ValueError(f"topology has {topology.p} ranks, the group {p}")
        g = topology.gamma if gamma is None else float(gamma)
        if topology.host is not None:
            return _host_env(topology.host, gamma)
        if topology.hosts == 1:
            return _Env(topology.intra, g, None, ("link", topology.intra, g, topology.delta),
                        topology.delta)
        return _Env(None, g, topology, ("topo", topology, g))
    if topology is None or isinstance(topology, Profile):
        prof = topology if topology is not None else load_profile()
        if transport not in prof.transports:
            transport = "shm"
        g = prof.gamma(transport) if gamma is None else float(gamma)
        if ids is None:
            model = prof.host_model(transport)
            if model is not None:
                return _host_env(model, gamma)
            link, d = prof.link(transport), prof.delta(transport)
            return _Env(link, g, None, ("link", link, g, d), d)
        topo = Topology.from_host_ids(ids, prof.link(transport), prof.link("inter"), g,
                                      prof.delta(transport), shared=prof.shared(),
                                      machine=prof.machine() if transport == "shm" else None)
        return _Env(None, g, topo, ("topo", topo, g))
    link = tier(topology)
    g = 0.0 if gamma is None else float(gamma)
    if ids is None:
        return _Env(link, g, None, ("link", link, g))
    topo = Topology.from_host_ids(ids, link, link, g)
    return _Env(None, g, topo, ("topo", topo, g))


def candidates_for(collective: str, multi_host: bool, candidates=None) -> tuple[str, ...]:
    check_collective(collective)
    if candidates is None:
        return tuple(a for a in ALGORITHMS[collective]
                     if multi_host or (collective, a) not in HOST_AWARE)
    out = tuple(candidates)
    if not out:
        raise ValueError("candidates is empty")
    for a in out:
        check_algorithm(collective, a)
    return out


def _algorithms_module():
    try:
        import ringlet.algorithms as algs  # noqa: WPS433
    except Exception:
        return None
    return algs if hasattr(algs, "build") else None


def build_schedule(collective, algorithm, p, nbytes, itemsize=4, hosts=None, root=0):
    """The schedule ``ringlet.algorithms.build`` makes for a call of ``nbytes`` (size
    convention of :mod:`ringlet.cost.model`)."""
    algs = _algorithms_module()
    if algs is None:
        raise RuntimeError("ringlet.algorithms is not available to build schedules")
    count = count_of(collective, p, nbytes, itemsize)
    kw = {}
    if collective == "all_to_all_single":
        kw["splits"] = tuple(tuple(count for _ in range(p)) for _ in range(p))
    if hosts is not None:
        kw["hosts"] = tuple(hosts)
    return algs.build(collective, algorithm, p, count, itemsize=itemsize, root=root, **kw)


def predict_terms(collective, nbytes, p, algorithm, env: _Env, itemsize=4, shared=()) -> Row:
    """One candidate's prediction in ``env`` (see :func:`environment`); ``shared``: see
    :func:`choose`."""
    if env.topology is None:
        if env.host is not None and p <= SIM_MAX_P and _algorithms_module() is not None:
            sched = build_schedule(collective, algorithm, p, nbytes, itemsize)
            res = simulate(sched, Topology.on_host(p, env.host), shared=shared)
            return host_row(algorithm, res)
        if env.delta > 0 and p <= SIM_MAX_P and _algorithms_module() is not None:
            # local copies are not in the closed forms: price the schedule itself
            sched = build_schedule(collective, algorithm, p, nbytes, itemsize)
            res = simulate(sched, Topology.uniform(p, env.link, env.gamma, env.delta))
            return Row(algorithm, res.time, *res.terms, "simulated")
        t = closed_form(collective, nbytes, p, algorithm, env.link, env.gamma, itemsize=itemsize)
        return Row(algorithm, t.total, *t, "closed form")
    topo = env.topology
    if p <= SIM_MAX_P and _algorithms_module() is not None:
        sched = build_schedule(collective, algorithm, p, nbytes, itemsize,
                               hosts=tuple(int(h) for h in topo.host_array))
        res = simulate(sched, topo, gamma=env.gamma)
        return Row(algorithm, res.time, *res.terms, "simulated", inter=res.inter)
    t = two_tier_breakdown(collective, nbytes, p, algorithm, topo, env.gamma, itemsize)
    return Row(algorithm, t.total, *t, "closed form (two-tier)")


def host_row(algorithm: str, res) -> Row:
    """A Row from a host-model simulation: bandwidth without the memory stalls, which
    get their own column."""
    lat, bw, red = res.terms
    mem = res.memory
    return Row(algorithm, res.time, lat, bw - mem, red, "simulated (host model)", mem,
               res.sharing, tuple(res.parts.items()))


def two_tier_breakdown(collective, nbytes, p, algorithm, topo: Topology, gamma, itemsize=4) -> Terms:
    """Closed-form estimate on two tiers: ``hierarchical`` by its two-level formula,
    every flat algorithm as if all its messages crossed the inter-host link - at the rate
    left to each of the flows that cross a shared NIC together (:func:`crossing`)."""
    if algorithm == "hierarchical":
        return closed_form(collective, nbytes, p, algorithm, topo.intra, gamma, hosts=topo.hosts,
                           intra=topo.intra, inter=topo.inter,
                           share=topo.ranks_per_host if topo.nic_sharing else 1, itemsize=itemsize)
    link = topo.inter
    if topo.nic_sharing and topo.ranks_per_host > 1:
        k = crossing(collective, algorithm, topo.ranks_per_host)
        from dataclasses import replace
        link = replace(link, bandwidth=link.bandwidth * (topo.shared if k > 1 else 1.0) / k)
    return closed_form(collective, nbytes, p, algorithm, link, gamma, itemsize=itemsize)


_CROSSING: dict = {}
#: algorithms whose closed form queues a rank's messages of a round on its port, one after
#: another (direct: p - 1 of them): their flows across a NIC are its ranks, not messages.
#: Counted as messages, direct's 64 MiB all_gather at 32 hosts x 8 was priced 23x the
#: simulator's time (its 8 ranks' 192 messages each took 1/192 of the NIC, then queued).
QUEUED = frozenset({"direct"})


def crossing(collective: str, algorithm: str, ranks_per_host: int, hosts: int = 4) -> int:
    """The most messages one host sends to other hosts in the same round of the schedule
    ``algorithm`` builds on ``hosts`` hosts of ``ranks_per_host`` (contiguous) ranks: the
    flows that share the host's NIC at once. 1 for a ring (only the boundary rank
    crosses), 2 for a double tree (a rank may send in both trees), all of a host's ranks
    for recursive doubling's, Bruck's, pairwise's far steps or direct's one round (whose
    ranks each queue their messages: ``QUEUED``). Read off the schedule
    itself, on a few hosts: the pattern repeats with more."""
    key = (collective, algorithm, ranks_per_host)
    if key not in _CROSSING:
        p = hosts * ranks_per_host
        host = np.arange(p) // ranks_per_host
        sched = build_schedule(collective, algorithm, p, 64 * p * 4, hosts=tuple(host))
        most = 1
        for rnd in sched.rounds:
            c = rnd.cols
            out = (host[c["src"]] != host[c["dst"]]) & (c["n"] > 0)   # not agreement rounds
            if out.any():
                src = c["src"][out]
                if algorithm in QUEUED:   # a rank's messages go one after another
                    src = np.unique(src)
                most = max(most, int(np.bincount(host[src]).max()))
        _CROSSING[key] = most
    return _CROSSING[key]


def breakdown(collective: str, nbytes: float, p: int, algorithm: str | None = None,
              link: Link | str | None = None, gamma: float | None = None, *,
              hosts: int | None = None, intra: Link | str | None = None,
              inter: Link | str | None = None, share: int | None = None,
              segments: int | None = None, itemsize: int = 4, topology=None) -> Terms:
    """The time of one collective call, split into latency, bandwidth and reduction terms
    (a :class:`Terms`; ``.total`` is seconds).

    ``nbytes`` follows the size convention of ``ringlet.cost.model``. ``link`` is a
    :class:`Link`, a tier name, or None for this host's calibrated shared-memory link
    (``ringlet.cost.profile``); ``gamma`` (seconds per byte reduced) defaults to the
    profile's when ``link`` is None, else 0. ``algorithm=None`` is the collective's usual
    default (ring, binomial, pairwise, ...). For ``hierarchical`` give ``hosts`` (ranks
    split evenly, rank r on host r // (p // hosts)) and the ``intra``/``inter`` links
    (default ``link``); ``share`` is how many concurrent messages share a host's NIC in
    the cross-host phase (default: the ranks per host). A flat algorithm given ``hosts``
    is priced on the same two links: its schedule, by the simulator.

    With a link, the closed form (:func:`ringlet.cost.model.closed_form`). ``topology``
    (a :class:`ringlet.cost.Topology` of several hosts) prices the algorithm's schedule
    with the simulator instead (``nbytes`` rounded down to whole elements); on one host it
    is the same as ``link=topology.intra``. With ``link=None`` and a calibrated profile
    that has a host model (``ringlet calibrate``), the schedule is priced by that model
    (:class:`ringlet.cost.host.HostModel`); its memory stalls count as bandwidth here
    (``choose``'s rows show them apart).
    """
    check_collective(collective)
    alg = DEFAULT_ALGORITHM[collective] if algorithm is None else algorithm
    check_algorithm(collective, alg)
    n, p = _check_size(nbytes, p)
    if topology is None and link is None and hosts is None and segments is None:
        model = load_profile().host_model("shm")
        if model is not None and p > 1:
            topology = Topology.on_host(p, model)   # this host: its calibrated host model
    if topology is None and hosts is not None and hosts != 1 and alg != "hierarchical":
        # a flat algorithm on several hosts crosses both links: price its schedule there
        hosts = check_hosts(hosts, p)
        if link is None and (intra is None or inter is None):
            raise ValueError("pricing on several hosts needs their links: give intra= and "
                             "inter= (or link= for both)")
        topology = Topology(int(hosts), p // int(hosts), tier(intra or link), tier(inter or link),
                            0.0 if gamma is None else float(gamma))
    if topology is not None:
        env = environment(p, topology, None, gamma)
        row = predict_terms(collective, int(n), p, alg, env, itemsize)
        return Terms(row.latency, row.bandwidth + row.memory, row.reduction)
    if link is None:
        link = host_link("shm")
        if gamma is None:
            gamma = load_profile().gamma("shm")
    return closed_form(collective, n, p, alg, link, gamma, hosts=hosts, intra=intra,
                       inter=inter, share=share, segments=segments, itemsize=itemsize)


def predict(collective: str, nbytes: float, p: int, algorithm: str | None = "ring",
            link: Link | str | None = None, gamma: float | None = None, **kw) -> float:
    """Predicted seconds for one call: ``breakdown(...).total``.

    ``algorithm="ring"`` is the default where the collective has a ring; for a collective
    without one (broadcast, ...) the default silently becomes its usual algorithm, and
    ``algorithm="auto"`` returns the least time over the candidates. See
    :func:`breakdown` for the arguments and the size convention."""
    check_collective(collective)
    if algorithm == "ring" and "ring" not in ALGORITHMS[collective]:
        algorithm = None
    if algorithm == "auto":
        topo = kw.get("topology")
        hosts = topo.hosts if isinstance(topo, Topology) else kw.get("hosts") or 1
        return min(breakdown(collective, nbytes, p, alg, link, gamma, **kw).total
                   for alg in candidates_for(collective, hosts > 1))
    return breakdown(collective, nbytes, p, algorithm, link, gamma, **kw).total


_CACHE: dict = {}
_CACHE_MAX = 4096


def reduce_gamma(dtype, topology=None, transport: str = "shm") -> float | None:
    """The reduce cost per byte of ``dtype`` where it differs from float32's (float16,
    bfloat16: :meth:`Profile.reduce_gamma`) on ``topology`` - a profile, or None for this
    host's; None for other dtypes and other topologies (their own gamma prices them)."""
    if topology is not None and not isinstance(topology, Profile):
        return None
    prof = topology if topology is not None else load_profile()
    return prof.reduce_gamma(dtype, transport if transport in prof.transports else "shm")


def choose(collective: str, nbytes: int, p: int, topology=None, hosts=None, candidates=None,
           *, itemsize: int = 4, gamma: float | None = None, shared=(),
           transport: str = "shm", dtype=None) -> tuple[str, list[Row]]:
    """The algorithm with the least predicted time, and every candidate's prediction.

    ``topology``: None (this host's calibrated profile, see :mod:`ringlet.cost.profile`),
    a :class:`Profile`, a :class:`Link` or tier name (uniform link), or a
    :class:`Topology`. ``hosts``: None (one host), a host count, or one host label per
    rank (e.g. the group's host identities); with several hosts the profile's "tcp"
    link joins them. ``candidates`` restricts the choice (default: all of the collective's
    algorithms; ``hierarchical`` only with several hosts). Rows are sorted fastest first;
    ties go to the earlier algorithm in the catalog. ``nbytes`` follows the size
    convention of :mod:`ringlet.cost.model`. ``shared`` names the caller's buffers that
    are ``rl.empty`` arrays ("buf", "in", "out"): a calibrated host prices their large
    sends as read in place by the receiver (one copy, not two through the ring).
    ``transport``: with a profile, what the ranks of one host use to talk - "shm", or
    "tcp" in a job of backend="tcp" (the profile's tcp host model prices it). ``dtype``
    (a NumPy dtype, or "bfloat16"): sets ``itemsize``, and prices a float16 or bfloat16
    reduction at its own cost per byte (:func:`reduce_gamma`) unless ``gamma`` is given."""
    check_collective(collective)
    if dtype is not None:
        from ..ops import dtype_named
        dtype = dtype_named(dtype)
        itemsize = dtype.itemsize
        if gamma is None:
            gamma = reduce_gamma(dtype, topology, transport)
    if isinstance(p, bool) or int(p) != p or p < 1:
        raise ValueError(f"p (group size) must be an integer >= 1, got {p!r}")
    p = int(p)
    _check_size(nbytes, p)
    hk = hosts if hosts is None or isinstance(hosts, int) else tuple(hosts)
    ck = None if candidates is None else tuple(candidates)
    tk = topology if topology is None or isinstance(topology, (Topology, Link, str)) \
        else ("profile", _profile_key(topology))
    if topology is None:
        tk = ("profile", _profile_key(load_profile()))
    shared = tuple(sorted(shared))
    key = (collective, int(nbytes), p, hk, ck, tk, itemsize, gamma, shared, transport)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit[0], list(hit[1])
    env = environment(p, topology, hosts, gamma, transport)
    cands = candidates_for(collective, env.topology is not None, ck)
    order = {a: i for i, a in enumerate(ALGORITHMS[collective])}
    rows = [predict_terms(collective, nbytes, p, a, env, itemsize, shared) for a in cands]
    rows.sort(key=lambda r: (r.total, order[r.algorithm]))
    result = (rows[0].algorithm, tuple(rows))
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[key] = result
    return result[0], list(result[1])


def priced_size(nbytes: int) -> int:
    """The size auto prices a call of ``nbytes`` at: rounded up to 6 leading binary digits
    (at most 3.2% more; exact below 64 B). A new size costs ``choose`` a simulation of
    every algorithm (5-30 ms), which calls of ever new sizes - objects, uneven exchanges -
    paid on every call; rounded, they share a few. Up, so a size past one of the
    transport's limits (powers of two, mostly) stays past it. The pick can differ from the
    exact size's only where two algorithms are predicted within a few % of each other."""
    nbytes = int(nbytes)
    step = 1 << max(0, nbytes.bit_length() - 6)
    return -(-nbytes // step) * step


def explain_line(collective, nbytes, p, algorithm, rows) -> str:
    """One log line for RINGLET_DEBUG=algo: what ran and why."""
    parts = ", ".join(f"{r.algorithm} {r.total * 1e6:.4g}us" for r in rows[:4])
    return f"{collective} {nbytes}B p={p}: {algorithm} (predicted: {parts})"


# -------------------------------------------------------------------------- crossovers

def crossovers(collective: str, p: int, topology=None, hosts=None, candidates=None, *,
               lo: int | None = None, hi: int = 1 << 32, points_per_octave: int = 2,
               itemsize: int = 4, gamma: float | None = None, rtol: float = 1e-3, shared=(),
               tie: float = 0.0):
    """Sizes where the winner changes: a log sweep from ``lo`` to ``hi`` bytes, then
    bisection between sweep points with different winners (to ``rtol`` relative
    precision, on whole elements). Returns ``[(nbytes, old_winner, new_winner), ...]``
    plus, as a second value, the sweep ``[(nbytes, {algorithm: seconds})]``. ``shared``:
    see :func:`choose`. ``tie`` > 0: a winner keeps its range while it is within this
    fraction of the fastest (the change comes where another beats it by more), so two
    algorithms priced alike (ring and gloo_ring) do not trade places every few KiB."""
    env = environment(p, topology, hosts, gamma)
    cands = candidates_for(collective, env.topology is not None, candidates)
    order = {a: i for i, a in enumerate(ALGORITHMS[collective])}
    unit = nbytes_of(collective, p, 1, itemsize) or 1  # bytes per element of every block
    if lo is None:
        lo = unit
    lo = max(int(lo), unit)

    def times(nb, among=cands):
        return {a: predict_terms(collective, nb, p, a, env, itemsize, shared).total for a in among}

    def winner(ts):
        return min(ts, key=lambda a: (ts[a], order[a]))

    def keeps(ts, w):       # w still wins at these times
        return ts[w] <= min(ts.values()) * (1 + tie) if tie > 0 else winner(ts) == w

    if int(hi) <= lo:
        raise ValueError(f"the sweep's range is empty: from {lo} B to {int(hi)} B "
                         f"(give LO < HI; the smallest call here is {unit} B)")
    top = max(unit, (int(hi) // unit) * unit)      # (the sweep ends at hi, not past it)
    n_oct = max(1, math.ceil(math.log2(top / lo)))
    sizes = sorted({min(top, (int(round(lo * 2 ** (i / points_per_octave))) // unit) * unit
                        or unit) for i in range(n_oct * points_per_octave + 1)})
    sweep = [(nb, times(nb)) for nb in sizes]
    out = []
    w = winner(sweep[0][1])
    for (n0, _), (n1, t1) in zip(sweep, sweep[1:]):
        a, end = n0 // unit, n1 // unit          # in elements per block
        while not keeps(t1, w) and a < end:
            b = end
            # Bisect among w and those that beat it at n1: one that loses to w at both ends
            # of a step where both are linear in the size loses inside it too (each
            # simulation of a large group is slow: p = 512 took 100 s).
            near = [x for x in cands if x == w or t1[x] <= t1[w] * (1 + tie)]
            while b - a > 1 and (b - a) > rtol * a:
                mid = (a + b) // 2
                if keeps(times(mid * unit, near), w):
                    a = mid
                else:
                    b = mid
            new = winner(times(b * unit, near))
            out.append((b * unit, w, new))
            a, w = b, new
    return out, sweep


# ------------------------------------------------------------------------ this host

def predict_host(collective: str, nbytes: int, p: int, algorithm: str | None = "auto",
                 backend: str = "shm", *, itemsize: int = 4, profile: Profile | None = None,
                 shared=(), dtype=None) -> float:
    """Predicted seconds of one call run by ``p`` local ranks of this host (what
    ``ringlet bench`` measures), from the calibrated profile (:func:`load_profile`).

    ``backend`` is the transport the ranks use: "shm" (the default inside a host) or
    "tcp" (every message over the profile's tcp link). ``algorithm="auto"`` (or None) is
    resolved as the runtime resolves it: ``choose`` on the profile of one host, for the
    transport the ranks use. ``nbytes`` follows the size convention of :mod:`ringlet.cost.model`;
    ``shared``: the buffers that are ``rl.empty`` arrays; ``dtype``: see :func:`choose`."""
    check_collective(collective)
    if backend not in ("shm", "tcp"):
        raise ValueError(f"unknown backend {backend!r}; valid: shm, tcp")
    prof = profile if profile is not None else load_profile()
    gamma = None
    if dtype is not None:
        from ..ops import dtype_named
        dtype = dtype_named(dtype)
        itemsize, gamma = dtype.itemsize, reduce_gamma(dtype, prof, backend)
    if algorithm in (None, "auto"):
        algorithm = choose(collective, nbytes, p, topology=prof, itemsize=itemsize,
                           shared=shared, transport=backend, gamma=gamma)[0]
    check_algorithm(collective, algorithm)
    if backend == "shm":
        topology = prof
    else:
        topology = Topology.from_profile(1, p, prof, transport="tcp")
    rows = choose(collective, nbytes, p, topology=topology, candidates=(algorithm,),
                  itemsize=itemsize, shared=shared, gamma=gamma)[1]
    return rows[0].total


def predict_p2p(nbytes: int, backend: str = "shm", *, profile: Profile | None = None,
                shared: bool = False) -> float:
    """Predicted seconds of one point-to-point message of ``nbytes`` between two local
    ranks (a blocking send and its receive, the later of the two to finish): a two-rank
    direct broadcast priced as a send meets the transport (:meth:`Profile.point_to_point`);
    ``shared``: the send's buffer is an ``rl.empty`` array."""
    prof = profile if profile is not None else load_profile()
    return predict_host("broadcast", max(int(nbytes), 1), 2, "direct", backend, itemsize=1,
                        profile=prof.point_to_point(), shared=("buf",) if shared else ())


__all__ = ["choose", "Row", "crossovers", "environment", "predict_terms", "build_schedule",
           "two_tier_breakdown", "breakdown", "predict", "explain_line", "predict_host",
           "predict_p2p", "SIM_MAX_P", "crossing"]
