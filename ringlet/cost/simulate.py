"""Price the very Schedule the runtime executes, on a topology of hosts x ranks per host.

How time is modelled (the alpha-beta-gamma model, applied round by round):

* Every rank walks the schedule's rounds in order; its round ``k`` starts when its round
  ``k-1`` is over (a rank with nothing to do in a round passes through it at no cost).
* It first runs its local steps (``src == dst``): a local reduce costs ``n*gamma``, a local
  copy ``n*delta`` (``delta`` is 0 unless a calibrated profile measured memory copies).
* Then it posts its sends and receives of the round at once. A message of ``n`` bytes from
  ``s`` to ``d`` costs ``alpha + n*beta`` of its link (``intra`` inside a host, ``inter``
  across hosts) and cannot start before both ends have started the round (max-plus, as a
  rendezvous protocol behaves). A rank's port is full duplex and single: its sends queue
  behind each other, its receives queue behind each other, and sends overlap receives.
  So a rank's sending is done at ``max(start + sum of its send costs, latest arrival of
  its sends)``, its receiving likewise, and received reduces add ``n*gamma`` afterwards.
* The ranks of a host share its NIC for inter-host traffic: in each round, an inter-host
  message's bandwidth is the inter link's divided by the number of distinct ranks of its
  host sending (or, at the destination host, receiving) across hosts in that round,
  whichever is larger; and when several share it, together they reach only
  ``Topology.shared`` of the link's rate (1 for an ideal NIC; less where competing TCP
  flows lose some of it, as ``ringlet.hosts``' shaped links measure).
* Hosts that share one machine's cores (``Topology.machine``: emulated hosts) also bound
  each round by its CPU work spread over the cores; where the ranks outnumber the cores,
  that work includes each waiting rank's polling (``Machine.poll``, at its share of the
  cores), once per round it waits in - so a schedule of many rounds costs more CPU than
  one of the same messages in few.

The simulator also follows the critical path: for every rank it keeps how much of its
finish time is latency (alpha), bandwidth (beta, including NIC sharing and local copies)
and reduction (gamma), so ``SimResult.terms`` is directly comparable with the closed forms
of :mod:`ringlet.cost.model`.

Rounds are priced with NumPy over the schedule's transfer columns, so a 4096-rank ring
all-reduce (8190 rounds x 4096 transfers) prices in about two seconds.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from ..algorithms import build
from ..schedule import BUFFER_NAMES, USER_BUFFERS, one_way
from ..transport import limits, shm
from .host import _BANDWIDTH_TERMS, _LATENCY_TERMS, _MEMORY_TERMS, HOST_TERMS, HostModel, Machine
from . import model
from .model import Link, Terms, _form, agreement_bound, count_of, tier


def host_layout(spec, p: int) -> tuple[int, ...] | None:
    """The host of each of ``p`` ranks from a command's ``--hosts``: "H" (H hosts of p / H
    ranks each, in rank order) or "S1,S2,..." (hosts of those sizes, in rank order: hosts
    may differ in size); None for one host. ValueError names what is wrong."""
    text = str(spec).strip()
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--hosts {text}: give a number of hosts (e.g. 2) or their sizes "
                         f"(e.g. 3,3,2)") from None
    if len(sizes) == 1:
        h = sizes[0]
        if h < 1:
            raise ValueError(f"--hosts must be >= 1, got {h}")
        if p % h:
            raise ValueError(f"--hosts {h} must divide the {p} ranks; hosts of other sizes "
                             f"are given by size, e.g. --hosts {_sizes_hint(p, h)}")
        sizes = [p // h] * h
    if any(n < 1 for n in sizes) or sum(sizes) != p:
        raise ValueError(f"--hosts {text}: the hosts' sizes must be >= 1 and add up to the "
                         f"{p} ranks")
    return None if len(sizes) == 1 else tuple(h for h, n in enumerate(sizes) for _ in range(n))


def _sizes_hint(p: int, h: int) -> str:
    """p ranks over h hosts as evenly as they go, as --hosts sizes ("3,3,2")."""
    h = min(h, p)
    return ",".join(str(p // h + (i < p % h)) for i in range(h))


@dataclass(frozen=True)
class Topology:
    """``hosts`` x ``ranks_per_host`` ranks; rank r lives on host ``r // ranks_per_host``.

    ``intra`` prices messages inside a host, ``inter`` messages between hosts (default:
    ``intra``); ``gamma`` is seconds per byte reduced, ``delta`` seconds per byte of a
    local copy. With ``nic_sharing`` the ranks of a host share one NIC across hosts, and
    ``shared`` is the fraction of its rate several flows reach together."""
    hosts: int
    ranks_per_host: int
    intra: Link
    inter: Link | None = None
    gamma: float = 0.0
    delta: float = 0.0
    nic_sharing: bool = True
    host_ids: tuple | None = None    # explicit host of each rank (see from_host_ids)
    host: HostModel | None = None    # one host priced by its calibrated HostModel
    shared: float = 1.0              # of the inter link's rate, when flows share it
    machine: Machine | None = None   # the cores every host's ranks share (emulated hosts)

    def __post_init__(self):
        for name in ("hosts", "ranks_per_host"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Topology {name} must be an integer >= 1, got {v!r}")
        object.__setattr__(self, "intra", tier(self.intra))
        object.__setattr__(self, "inter", tier(self.inter) if self.inter is not None else self.intra)
        if self.gamma < 0 or self.delta < 0:
            raise ValueError("Topology gamma and delta must be >= 0 seconds per byte")
        if not 0 < self.shared <= 1:
            raise ValueError(f"Topology shared must be in (0, 1], got {self.shared!r}")
        if self.host is not None and self.hosts != 1:
            raise ValueError("a HostModel prices the ranks of one host (hosts=1)")
        if self.host_ids is not None:
            ids = tuple(int(h) for h in self.host_ids)
            if sorted(set(ids)) != list(range(self.hosts)):
                raise ValueError("host_ids must number the hosts 0..hosts-1")
            object.__setattr__(self, "host_ids", ids)

    @classmethod
    def from_host_ids(cls, host_ids, intra, inter=None, gamma: float = 0.0,
                      delta: float = 0.0, nic_sharing: bool = True,
                      shared: float = 1.0, machine: Machine | None = None) -> "Topology":
        """Rank r on host ``host_ids[r]`` (any hashable labels; hosts need not be
        contiguous or equal in size). ``ranks_per_host`` becomes the largest host's."""
        ids = list(host_ids)
        if not ids:
            raise ValueError("host_ids is empty")
        labels = {}
        norm = tuple(labels.setdefault(h, len(labels)) for h in ids)
        counts = np.bincount(norm)
        if len(labels) > 1 and all(norm[r] == r // counts[0] for r in range(len(norm))) \
                and (counts == counts[0]).all():
            return cls(len(labels), int(counts[0]), intra, inter, gamma, delta, nic_sharing,
                       shared=shared, machine=machine)
        if len(labels) == 1:
            return cls(1, len(ids), intra, inter, gamma, delta, nic_sharing, shared=shared,
                       machine=machine)
        return cls(len(labels), int(counts.max()), intra, inter, gamma, delta, nic_sharing, norm,
                   shared=shared, machine=machine)

    @classmethod
    def uniform(cls, p: int, link: Link | str, gamma: float = 0.0, delta: float = 0.0) -> "Topology":
        """``p`` ranks all joined by the same ``link`` (one host, no shared NIC)."""
        return cls(1, p, tier(link), tier(link), gamma, delta, nic_sharing=False)

    @classmethod
    def on_host(cls, p: int, model: HostModel) -> "Topology":
        """``p`` ranks of one host priced by ``model`` (see :class:`HostModel`)."""
        return cls(1, p, model.link, model.link, model.gamma, model.delta, nic_sharing=False,
                   host=model)

    @classmethod
    def from_profile(cls, hosts: int, ranks_per_host: int, prof,
                     transport: str | None = None) -> "Topology":
        """A calibrated profile's links (``ringlet.cost.load_profile()``: this machine's):
        shm inside a host, tcp between hosts (or ``transport`` for every message)."""
        intra = transport or "shm"
        model = prof.host_model(intra) if hosts == 1 else None
        if model is not None:
            return cls.on_host(ranks_per_host, model)
        return cls(hosts, ranks_per_host, prof.link(intra), prof.link(transport or "inter"),
                   prof.gamma(intra), prof.delta(intra))

    @property
    def p(self) -> int:
        return len(self.host_ids) if self.host_ids is not None else self.hosts * self.ranks_per_host

    @property
    def uniform_link(self) -> bool:
        return self.hosts == 1 or (self.intra == self.inter and not self.nic_sharing)

    def host_of(self, rank):
        if self.host_ids is not None:
            return np.asarray(self.host_ids)[np.asarray(rank)]
        return np.asarray(rank) // self.ranks_per_host

    @property
    def host_array(self) -> np.ndarray:
        return self.host_of(np.arange(self.p))

    def __str__(self) -> str:
        if self.host is not None:
            return f"{self.p} ranks on one host ({self.host})"
        if self.hosts == 1:
            return f"{self.p} ranks on one host ({self.intra})"
        sizes = np.bincount(self.host_array, minlength=self.hosts)
        shape = f"{self.hosts} hosts x {self.ranks_per_host} ranks" if (sizes == sizes[0]).all() \
            else f"{self.hosts} hosts of {','.join(map(str, sizes))} ranks"
        return (f"{shape}; intra {self.intra}; "
                f"inter {self.inter}" + ("; shared NIC" if self.nic_sharing else "")
                + (f"; all on one machine of {self.machine.cores} cores"
                   + (f" ({self.machine.available:.2g} free)" if self.machine.available else "")
                   + ", "
                   f"{self.machine.inter * 1e9:.2g} ns of CPU per byte between hosts"
                   if self.machine is not None else ""))


@dataclass
class SimResult:
    """What :func:`simulate` returns. Times in seconds, bytes in bytes."""
    time: float                      # when the last rank finishes
    finish: np.ndarray               # per-rank finish time
    terms: Terms                     # critical-path split of ``time``
    rank_terms: np.ndarray           # (p, 3): per-rank latency, bandwidth, reduction
    bytes: dict = field(default_factory=dict)      # {"intra": b, "inter": b}
    messages: dict = field(default_factory=dict)   # {"intra": m, "inter": m}
    nic_out: np.ndarray | None = None  # per host: bytes sent across hosts
    nic_in: np.ndarray | None = None   # per host: bytes received across hosts
    rounds: int = 0
    parts: dict | None = None        # HostModel: seconds per named term on the critical path
    features: dict | None = None     # HostModel: counts per term on the critical path
    sharing: float = 0.0             # HostModel: seconds added by ranks sharing cores
    inter: float = 0.0               # seconds of the critical path on inter-host messages

    @property
    def memory(self) -> float:
        """HostModel: seconds of memory-hierarchy stalls on the critical path."""
        return sum(self.parts[k] for k in _MEMORY_TERMS) if self.parts else 0.0

    def __str__(self) -> str:
        t = self.terms
        return (f"{self.time * 1e3:.6g} ms (latency {t.latency * 1e3:.4g} ms, bandwidth "
                f"{t.bandwidth * 1e3:.4g} ms, reduction {t.reduction * 1e3:.4g} ms); "
                f"{self.rounds} rounds; bytes intra {self.bytes.get('intra', 0):,}, "
                f"inter {self.bytes.get('inter', 0):,}")


def simulate(schedule, topology: Topology | None = None, *, link: Link | str | None = None,
             gamma: float | None = None, shared=()) -> SimResult:
    """Price ``schedule`` (a :class:`ringlet.schedule.Schedule`) on ``topology``.

    ``simulate(s, link="infiniband")`` (or ``simulate(s, TIERS["infiniband"])``) is
    shorthand for a uniform topology; ``gamma``
    overrides the topology's. ``shared`` names the schedule's buffers that lie in shared
    memory (``rl.empty``): on a :class:`HostModel` their sends above its
    ``zero_copy_min`` are read in place by the receiver (and any buffer's above its
    ``cma_min``, where the transport reads private memory by cross-memory attach). See
    the module docstring for the model."""
    p = int(schedule.p)
    if isinstance(topology, (Link, str)):      # simulate(s, TIERS["nvlink"]): a link given
        topology, link = None, topology        # where the topology goes is meant as link=
    if topology is None:
        if link is None:
            raise ValueError("simulate needs a topology (or link=)")
        topology = Topology.uniform(p, link)
    if topology.p != p:
        raise ValueError(f"schedule has {p} ranks but the topology has {topology.p} "
                         f"({topology.hosts} hosts x {topology.ranks_per_host})")
    g = topology.gamma if gamma is None else float(gamma)
    if g < 0:
        raise ValueError("gamma must be >= 0")
    if getattr(schedule, "algorithm", None) == "hierarchical" and topology.hosts > 1 and \
            len(set(schedule.hosts or ())) < 2:
        # (priced silently as the flat ring it is: 2.61 ms where the two-level one takes 1.81)
        warnings.warn("simulate: this hierarchical schedule was built for one host (no "
                      "hosts=), where it is the flat ring; build it with the topology's hosts "
                      "(rl.schedule(..., hosts=topology.host_array)) to price the two-level "
                      "schedule", stacklevel=2)
    if topology.host is not None:
        model = topology.host
        if gamma is not None:
            from dataclasses import replace
            model = replace(model, gamma=g)
        return _HostSim(schedule, model, shared).run()
    return _Sim(schedule, topology, g).run()


class _Sim:
    def __init__(self, schedule, topo: Topology, gamma: float):
        self.s = schedule
        self.topo = topo
        self.g = gamma
        self.p = int(schedule.p)
        self.isz = float(schedule.itemsize)
        self.uniform = topo.uniform_link
        self.L = topo.ranks_per_host
        self.H = topo.hosts

    def run(self) -> SimResult:
        p = self.p
        # per rank: when its next round starts, and that time's critical path split into
        # latency, bandwidth, reduction, and (of lat + bw) seconds on inter-host messages
        self.start, self.lat, self.bw, self.red, self.xt = (np.zeros(p) for _ in range(5))
        self.bytes_intra = self.bytes_inter = 0.0
        self.msgs_intra = self.msgs_inter = 0
        self.nic_out = np.zeros(self.H)
        self.nic_in = np.zeros(self.H)
        mach = self.topo.machine
        # ranks that outnumber the machine's cores wait for a wake-up at each message
        self.lat_crowd = (mach.lat_intra, mach.lat_inter) if mach is not None and \
            p > mach.cores else None
        if self.lat_crowd is not None and self.s.rounds:
            # ... and once per call, each rank beyond the cores waits to be scheduled in
            self.start = self.start + (p - mach.cores) * mach.lat_call
            self.lat = self.lat + (p - mach.cores) * mach.lat_call
        nrounds = 0
        first = None        # each rank's state as its first round starts (Schedule.early)
        state = ("start", "lat", "bw", "red", "xt")
        for i, rnd in enumerate(self.s.rounds):
            c = rnd.cols
            src = c["src"]
            if not len(src):
                continue
            nrounds += 1
            if first is None:
                first = [getattr(self, k) for k in state]
            if i == self.s.early:   # posted with the first round: it runs beside the rest
                # (the links' alpha is latency here, no CPU that the signals would hold)
                after = [getattr(self, k) for k in state]
                for k, v in zip(state, first):
                    setattr(self, k, v)
                self._round(c)
                later = after[0] > self.start
                for k, v in zip(state, after):
                    setattr(self, k, np.where(later, v, getattr(self, k)))
            else:
                self._round(c)
        start, lat, bw, red, xt = self.start, self.lat, self.bw, self.red, self.xt
        rank_terms = np.stack([lat, bw, red], axis=1)
        last = int(np.argmax(start)) if p else 0
        total = float(start[last]) if p else 0.0
        terms = Terms(float(lat[last]), float(bw[last]), float(red[last])) if p else Terms()
        return SimResult(total, start, terms, rank_terms,
                         {"intra": int(round(self.bytes_intra)), "inter": int(round(self.bytes_inter))},
                         {"intra": int(self.msgs_intra), "inter": int(self.msgs_inter)},
                         self.nic_out if self.H > 1 else None, self.nic_in if self.H > 1 else None,
                         nrounds, inter=float(xt[last]) if p else 0.0)

    def _round(self, c) -> None:
        src, dst, n, rflag = c["src"], c["dst"], c["n"], c["reduce"]
        before = self.start
        loc = src == dst
        if loc.any():
            self._local_steps(src[loc], n[loc] * self.isz, rflag[loc].astype(bool))
            if not loc.all():
                self._messages(src[~loc], dst[~loc], n[~loc] * self.isz, rflag[~loc])
        else:
            self._messages(src, dst, n * self.isz, rflag)
        if self.topo.machine is not None:
            self._machine_bound(before, src, dst, n * self.isz, rflag.astype(bool))

    def _local_steps(self, src, nbytes, reduce) -> None:
        """Local steps: a reduce costs n*gamma, a copy n*delta, on their own rank."""
        p, g, delta = self.p, self.g, self.topo.delta
        if g and reduce.any():
            gr = np.bincount(src[reduce], nbytes[reduce], p) * g
            self.start = self.start + gr
            self.red = self.red + gr
        if delta and (~reduce).any():
            cp = np.bincount(src[~reduce], nbytes[~reduce], p) * delta
            self.start = self.start + cp
            self.bw = self.bw + cp

    def _machine_bound(self, before, src, dst, nb, reduce) -> None:
        """Emulated hosts share one machine's cores: the round's work (every rank's CPU
        per byte, :class:`Machine`) spread over them bounds when its ranks can be done,
        counted from when its first step can begin."""
        mach = self.topo.machine
        loc = src == dst
        host = self.topo.host_array
        cross = ~loc & (host[src] != host[dst])
        work = float(nb[cross].sum()) * mach.inter + float(nb[~loc & ~cross].sum()) * mach.intra
        work += float(nb[reduce].sum()) * mach.reduce + float(nb[loc & ~reduce].sum()) * mach.copy
        nmsg = int(np.count_nonzero(~loc))
        work += nmsg * (mach.message + (mach.crowd if self.p > mach.cores else 0.0))
        work += int(np.count_nonzero(~loc & (nb > mach.large_min))) * mach.large
        ranks = np.unique(np.concatenate([src, dst]))
        # a message begins once both its ends have begun the round
        first = float(np.maximum(before[src], before[dst]).min())
        span = work / mach.capacity
        if self.p > mach.cores and nmsg:
            # Ranks that outnumber the cores poll while they wait for the round's messages
            # (engine.YIELD_CROWDED: yield, poll again, then sleep): runnable, each takes
            # its share of the cores (capacity / p) from the ranks that work, for as long
            # as it waits (its round, at most the poll). So every round a rank waits in
            # costs CPU: pairwise all_to_all (p - 1 rounds) pays it p - 1 times, direct
            # once. 2 x 4 ranks, 1 MiB, 10 Gbit/s: pairwise 30.0 against direct 18.0 ms of
            # CPU per call (all ranks; 17.2 against 11.6 ms), +250 us per extra wait and
            # rank - 1 ms at 1.95 / 8 of a core.
            waiting = np.unique(np.concatenate([src[~loc], dst[~loc]]))
            wait = np.minimum(mach.poll, self.start[waiting] - before[waiting])
            span += float(wait.sum()) / self.p
        bound = first + span
        late = np.maximum(bound - self.start[ranks], 0.0)
        if late.any():
            self.start = self.start.copy()
            self.bw = self.bw.copy()
            self.start[ranks] += late
            self.bw[ranks] += late

    def _link_costs(self, src, dst, nb):
        """(alpha, bandwidth seconds, which messages cross hosts or None, bandwidth seconds
        on the sender's port, on the receiver's port) of each message on its link, with a
        host's NIC shared by its ranks sending (receiving) across hosts; counts the round's
        bytes and messages. A message takes the slower of its two NICs' shares; each port
        queues its own messages at its own NIC's share only - a rank's messages to two
        ranks of one host are queued on its port, not also competing at that host's NIC."""
        topo, m = self.topo, len(src)
        ai, bi = topo.intra.alphas(nb), topo.intra.beta    # (by size: eager or rendezvous)
        if not self.uniform:
            host = topo.host_array
            hs, hd = host[src], host[dst]
            x = hs != hd
            nx = int(np.count_nonzero(x))
            if nx:
                ae, be = topo.inter.alphas(nb), topo.inter.beta
                if topo.nic_sharing:
                    p = self.p
                    # (ranks whose messages across carry bytes: an agreement's empty
                    # signal shares no bandwidth)
                    carrying = x & (nb > 0)
                    kout = np.bincount(host, np.bincount(src[carrying], minlength=p) > 0, self.H)
                    kin = np.bincount(host, np.bincount(dst[carrying], minlength=p) > 0, self.H)
                    def cost(share):
                        share = np.where(share > 1, share / topo.shared, share)
                        return np.where(x, nb * be * share, nb * bi)
                    ports = cost(kout[hs]), cost(kin[hd])
                    bcost = np.maximum(*ports)
                else:
                    bcost = np.where(x, nb * be, nb * bi)
                    ports = bcost, bcost
                xb = nb[x]
                self.bytes_inter += float(xb.sum())
                self.bytes_intra += float(nb.sum()) - float(xb.sum())
                self.msgs_inter += nx
                self.msgs_intra += m - nx
                self.nic_out += np.bincount(hs[x], xb, self.H)
                self.nic_in += np.bincount(hd[x], xb, self.H)
                a = np.where(x, ae, ai)
                if self.lat_crowd is not None:
                    a = a + np.where(x, self.lat_crowd[1], self.lat_crowd[0])
                return a, bcost, x, ports
        self.bytes_intra += float(nb.sum())
        self.msgs_intra += m
        if self.lat_crowd is not None:
            ai = ai + self.lat_crowd[0]
        return ai, nb * bi, None, None

    def _messages(self, src, dst, nb, rflag) -> None:
        """A round's messages: each starts when both ends have started the round."""
        p, g = self.p, self.g
        start, lat, bw, red, xt = self.start, self.lat, self.bw, self.red, self.xt
        m = len(src)
        a, bcost, x, ports = self._link_costs(src, dst, nb)
        if np.ndim(bcost) == 0:
            bcost = np.full(m, float(bcost))
        if ports is None:
            ports = bcost, bcost
        cost = a + bcost
        s_src, s_dst = start[src], start[dst]
        from_src = s_src >= s_dst
        t0 = np.where(from_src, s_src, s_dst)
        arr = t0 + cost
        e = np.where(from_src, src, dst)  # the endpoint whose path the message extends
        m_lat = lat[e] + a
        m_bw = bw[e] + bcost
        m_red = red[e]
        xcost = np.where(x, cost, 0.0) if x is not None else np.zeros(m)
        m_x = xt[e] + xcost
        # reductions at the receiver
        G = np.bincount(dst, nb * rflag, p) * g if g and rflag.any() else None
        nsend = np.bincount(src, minlength=p)
        nrecv = np.bincount(dst, minlength=p)
        neg = np.full(p, -np.inf)
        if nsend.max() <= 1 and nrecv.max() <= 1:
            new = self._one_each(src, dst, arr, m_lat, m_bw, m_red, m_x, G, nsend, nrecv, neg)
        else:
            new = self._general(p, src, dst, a, ports, cost, arr, m_lat, m_bw, m_red, G,
                                start, lat, bw, red, nsend, nrecv, neg, xt, xcost, m_x)
        self.start, self.lat, self.bw, self.red, self.xt = new

    def _one_each(self, src, dst, arr, m_lat, m_bw, m_red, m_x, G, nsend, nrecv, neg):
        """Every rank sends at most one and receives at most one message: a message's
        arrival is both its sender's and its receiver's finish (t0 >= own start)."""
        p, m = self.p, len(src)
        fin_out = neg.copy()
        fin_out[src] = arr
        fin_in = neg.copy()
        fin_in[dst] = arr
        if G is not None:
            fin_in = fin_in + G
        use_in = fin_in >= fin_out
        finish = np.maximum(np.maximum(fin_in, fin_out), self.start)
        active = (nsend + nrecv) > 0
        # which message determines each active rank's finish
        mi = np.zeros(p, np.int64)
        mi[src] = np.arange(m)
        mi_in = np.zeros(p, np.int64)
        mi_in[dst] = np.arange(m)
        mi = np.where(use_in, mi_in, mi)
        new_lat = np.where(active, m_lat[mi], self.lat)
        new_bw = np.where(active, m_bw[mi], self.bw)
        new_red = np.where(active, m_red[mi], self.red)
        new_x = np.where(active, m_x[mi], self.xt)
        if G is not None:
            new_red = new_red + np.where(active & use_in, G, 0.0)
        return finish, new_lat, new_bw, new_red, new_x

    @staticmethod
    def _general(p, src, dst, a, ports, cost, arr, m_lat, m_bw, m_red, G,
                 start, lat, bw, red, nsend, nrecv, neg, xt, xcost, m_x):
        """Ranks with several messages in one round: queue them on the port."""
        m = len(src)
        a_vec = np.broadcast_to(a, (m,)).astype(float)
        S_lat = np.bincount(src, a_vec, p)
        S_bw = np.bincount(src, ports[0], p)
        R_lat = np.bincount(dst, a_vec, p)
        R_bw = np.bincount(dst, ports[1], p)
        max_out = neg.copy()
        np.maximum.at(max_out, src, arr)
        max_in = neg.copy()
        np.maximum.at(max_in, dst, arr)
        idx = np.arange(m)
        out_msg = np.zeros(p, np.int64)
        hit = arr >= max_out[src]
        out_msg[src[hit]] = idx[hit]
        in_msg = np.zeros(p, np.int64)
        hit = arr >= max_in[dst]
        in_msg[dst[hit]] = idx[hit]
        Gv = G if G is not None else 0.0
        # candidates: idle, own send queue, latest send, own receive queue, latest receive
        cand = np.stack([
            start,
            np.where(nsend > 0, start + S_lat + S_bw, -np.inf),
            max_out,
            np.where(nrecv > 0, start + R_lat + R_bw + Gv, -np.inf),
            max_in + Gv,
        ])
        which = np.argmax(cand, axis=0)
        finish = cand[which, np.arange(p)]
        Gr = np.broadcast_to(Gv, (p,))
        lat_c = np.stack([lat, lat + S_lat, m_lat[out_msg], lat + R_lat, m_lat[in_msg]])
        bw_c = np.stack([bw, bw + S_bw, m_bw[out_msg], bw + R_bw, m_bw[in_msg]])
        red_c = np.stack([red, red, m_red[out_msg], red + Gr, m_red[in_msg] + Gr])
        # the inter-host part of each port's queue, at that port's share
        x_send, x_recv = ((np.where(xcost > 0, a_vec + port, 0.0)) for port in ports)
        x_c = np.stack([xt, xt + np.bincount(src, x_send, p), m_x[out_msg],
                        xt + np.bincount(dst, x_recv, p), m_x[in_msg]])
        cols = np.arange(p)
        return (finish, lat_c[which, cols], bw_c[which, cols], red_c[which, cols],
                x_c[which, cols])


def working_set(schedule, ring_bytes: int = shm.RING_BYTES, shared=(),
                zero_copy_min: int = -1, cma_min: int = -1,
                zero_copy_oneway_min: int | None = None, crowded: bool = False,
                eager: int = -1) -> float:
    """Bytes a job touches: the buffers each rank reads or writes (a rooted collective's
    other ranks never touch the root's gathered array), plus the part of each shared ring
    that its pair's messages cycle through (up to the ring's size). A message its
    receiver reads in place (see ``_read_in_place``) uses no ring."""
    isz = float(schedule.itemsize)
    touched = np.zeros((schedule.p, len(BUFFER_NAMES)), bool)
    biggest: dict = {}
    for rnd in schedule.rounds:
        c = rnd.cols
        touched[c["src"], c["sbuf"]] = True
        touched[c["dst"], c["dbuf"]] = True
        acc = c["abuf"] >= 0
        touched[c["dst"][acc], c["abuf"][acc]] = True
        msg = (c["src"] != c["dst"]) & ~_read_in_place(
            c["n"] * isz, c["sbuf"], shared, zero_copy_min, cma_min, c["src"], c["dst"],
            c["reduce"].astype(bool), zero_copy_oneway_min, crowded,
            c["src"][c["src"] == c["dst"]], eager)[0]
        if not msg.any():
            continue
        pair = c["src"][msg] * schedule.p + c["dst"][msg]
        nb = c["n"][msg]
        for k, v in zip(pair.tolist(), nb.tolist()):
            if v > biggest.get(k, 0):
                biggest[k] = v
    sizes = np.array([int(schedule.buffers.get(b, 0)) for b in BUFFER_NAMES], float)
    total = float((touched @ sizes).sum()) * isz
    return total + sum(min(v * isz, ring_bytes) for v in biggest.values())


def _read_in_place(nbytes, sbuf, shared, zero_copy_min: int, cma_min: int = -1, src=None,
                   dst=None, reduce=None, zero_copy_oneway_min: int | None = None,
                   crowded: bool = False, local=None, eager: int = -1) -> tuple:
    """(which messages their receiver reads in place, which of them by cross-memory
    attach). In place: sent from one of the ``shared`` buffers (indices into
    ``BUFFER_NAMES``) and larger than ``zero_copy_min`` - or, by a sender that does not
    receive bytes in the round, than ``zero_copy_oneway_min`` (None: the same; limits.py says
    why); by CMA (transport/cma.py): from a private buffer, larger than ``cma_min``, by a
    sender that receives too in the round (``src``, ``dst``: the round's messages), or by
    any sender where ranks outnumber cores (``crowded``: cma.Reader.reads_whole; not to a
    rank with a local step in the round, ``local``: it declines, as a gather's root does),
    into a receive that copies (``reduce`` false). -1: none. Where ranks outnumber cores, a
    sender that receives too sends by CMA what is larger than ``eager`` already (one EAGER
    packet: protocol.CROWDED_EXCHANGE_CMA). (A one-way message split where each rank has a
    core is ``_put_split``'s.)"""
    alone = None if dst is None else one_way(nbytes, src, dst)
    zc = np.zeros(len(nbytes), bool)
    if zero_copy_min >= 0 and len(shared):
        zc = nbytes > zero_copy_min
        if zc.any():
            zc &= np.isin(sbuf, shared)
            if zero_copy_oneway_min is not None and src is not None \
                    and zero_copy_oneway_min > zero_copy_min:
                zc &= ~alone | (nbytes > zero_copy_oneway_min)
    cma = np.zeros(len(nbytes), bool)
    if cma_min >= 0 and src is not None:
        cma = (nbytes > cma_min) & ~zc
        if crowded and eager >= 0 and alone is not None:
            cma |= (nbytes > min(eager, cma_min)) & ~alone & ~zc
        if cma.any():
            if not crowded:
                cma &= ~alone
            elif local is not None and len(local):
                cma &= ~(alone & np.isin(dst, local))
        if reduce is not None:
            cma &= ~reduce
    return zc | cma, cma


def _split(nbytes, dst, dbuf, operands, shared, split_min: int, src, crowded: bool,
           split_reduce_min: int = -1) -> np.ndarray:
    """Which messages (read in place) both ends copy (transport/split.py): at least
    ``split_min`` bytes (-1: never) copied, or ``split_reduce_min`` reduced into its own
    accumulator (``operands`` 1; 2, apart from it: never), into a destination in one of
    the ``shared`` buffers, from a sender that receives no bytes in the round, where each
    rank has a core (not ``crowded``)."""
    if split_min < 0 or crowded or not len(shared):
        return np.zeros(len(nbytes), bool)
    least = np.where(operands > 0, split_reduce_min if split_reduce_min >= 0 else 1 << 62,
                     split_min)
    return ((nbytes >= least) & np.isin(dbuf, shared) & (operands < 2)
            & one_way(nbytes, src, dst))


def _put_split(nbytes, src, dst, operands, inplace, put_min: int, local, p: int,
               crowded: bool):
    """(which messages from plain buffers CMA splits between their two ends, the share of
    each that its sender writes, which of them are written whole into a receiver that
    posted before its local steps): above ``put_min`` bytes (-1: never), not read in place
    already, into a receive that copies, from a sender that receives no bytes in the round.
    Into a rank with a local step in the round (a gather's root: work.EARLY_ROOT) the
    sender writes all of it while the receiver copies its own, crowded or not. Else, where
    each rank has a core (not ``crowded``), the sender writes r/(s + r) of it: s the copies
    its round makes (these messages, and its local steps, as a scatter's root's), r the
    messages its receiver's round receives (cma.Reader.head_bytes)."""
    none = np.zeros(len(nbytes), bool), np.zeros(len(nbytes)), np.zeros(len(nbytes), bool)
    if put_min < 0 or not len(nbytes):
        return none
    local = np.asarray(local, np.int64)
    put = (nbytes > put_min) & ~inplace & (operands == 0) & one_way(nbytes, src, dst)
    whole = put & np.isin(dst, local)
    put &= whole | (not crowded)
    if not put.any():
        return none
    s = np.bincount(src[put], minlength=p) + np.bincount(local, minlength=p)
    r = np.bincount(dst[nbytes > 0], minlength=p)
    head = np.where(whole, 1.0, np.where(put, r[dst] / np.maximum(s[src] + r[dst], 1), 0.0))
    return put, head, whole


def _overlap(prev, rank, buf, off, n) -> np.ndarray:
    """Fraction of each range ``rank``'s ``buf[off:off+n]`` that lies in the ranges of
    ``prev`` (ranks, buffers, starts, ends) of the same rank and buffer."""
    out = np.zeros(len(rank))
    pr, pb, lo, hi = prev
    if not len(rank) or len(rank) * len(pr) > 1 << 20:   # (large jobs: not worth it)
        return out
    same = (rank[:, None] == pr[None, :]) & (buf[:, None] == pb[None, :])
    ov = np.minimum((off + n)[:, None], hi[None, :]) - np.maximum(off[:, None], lo[None, :])
    got = np.where(same, np.maximum(ov, 0), 0).sum(axis=1)
    np.divide(np.minimum(got, n), n, out=out, where=n > 0)
    return out


def _cache_hits(prev, c, p: int, m: HostModel, isz: float):
    """Cache reuse between consecutive rounds: the fraction of each transfer's source
    (read by its sender) and destination (written by its receiver) that the same rank
    touched in the previous round and that is still cached - all of it if that round
    touched no more bytes than the cache holds, else cache / touched. Returns (hits, what
    this round touched, for the next); hits is (4, transfers): sender past L2, sender past
    L3, receiver past L2, receiver past L3. This is why a pipelined schedule (double_tree's
    segments), which passes a segment on right after it received it, streams less from
    memory than a ring whose halves are too big to stay cached."""
    src, dst, n = c["src"], c["dst"], c["n"]
    ranks = np.concatenate([src, dst])
    touched = (ranks, np.concatenate([c["sbuf"], c["dbuf"]]),
               np.concatenate([c["soff"], c["doff"]]), np.concatenate([c["soff"] + n, c["doff"] + n]))
    hits = np.zeros((4, len(src)))
    if prev is not None:
        ranges, nbytes = prev
        for side, (who, buf, off) in enumerate(((src, c["sbuf"], c["soff"]),
                                                (dst, c["dbuf"], c["doff"]))):
            share = _overlap(ranges, who, buf, off, n)
            for level, cache in enumerate((m.l2_bytes, m.l3_bytes)):
                hits[2 * side + level] = share * np.minimum(1.0, cache / np.maximum(nbytes[who], 1.0))
    return hits, (touched, np.bincount(ranks, np.concatenate([n, n]) * isz, p))


def _cumsum_by(keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Running sums of ``rows`` (one per item, in order) within each key: row j gets the
    sum of the rows i <= j with keys[i] == keys[j]."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    first = np.ones(len(k), bool)
    first[1:] = k[1:] != k[:-1]
    cs = _restart_cumsum(first, rows[order])
    out = np.empty_like(cs)
    out[order] = cs
    return out


def _spill(ws: float, cache: float) -> float:
    """Fraction of streamed bytes that miss a cache of ``cache`` bytes: 1 - C/W."""
    return 0.0 if ws <= cache else 1.0 - cache / ws


_TERM = {k: i for i, k in enumerate(HOST_TERMS)}   # a term's column in count vectors
_N_TERMS = len(HOST_TERMS)


class _HostSim:
    """The :class:`HostModel` applied round by round (docs/design.md, "The host model").

    In a round, a rank first runs its local steps, then works through its messages: a
    rendezvous message can start once both ends have started the round plus its latency
    (rendezvous, wake-up) and is done when the slower of its two sides could be; an eager
    one is copied in by its sender as soon as the sender starts the round (its eager
    messages one after the other, in posting order) and copied out by its receiver once
    it has arrived (plus its latency). A rank's own work on its messages adds up (one
    thread), in order of when each can start. Busy ranks beyond the cores stretch all CPU
    work of the round. Along the critical path the simulator keeps the count of every
    term (messages, bytes, ...), stretched and not, so that the fit is linear in the
    parameters and ``explain`` can name every term.

    Per rank it carries ``start`` (when its next round starts) and, in count vectors of
    HOST_TERMS, the terms on its critical path so far: ``path`` (stretched by shared
    cores) and ``alone`` (as if each round had the cores to itself)."""

    def __init__(self, schedule, model: HostModel, shared=(), memo: dict | None = None):
        self.s = schedule
        self.m = model
        # what depends on the schedule and the model's sizes, not on its terms: a fit
        # prices the same schedules again and again with new terms (ringlet.cost.fit_host)
        self.memo = memo
        self.p = int(schedule.p)
        bad = set(shared) - set(BUFFER_NAMES)
        if bad:
            raise ValueError(f"shared names unknown buffers {sorted(bad)}; valid: {BUFFER_NAMES}")
        self.shared = np.array([BUFFER_NAMES.index(b) for b in shared], np.int64)

    def run(self) -> SimResult:
        s, m, p = self.s, self.m, self.p
        self.theta = m.theta
        self.isz = float(s.itemsize)
        self.crowded = 1.0 if p > m.cores else 0.0
        # a call whose messages are all EAGER packets runs in C: its per-message CPU is
        # alpha_fast (rl.empty buffers' messages are read in place only above fast_bytes);
        # so does one whose larger messages are all an exchange's read by CMA, and there an
        # rl.empty buffer's go by CMA too (transport/fast.py: run, EMPTY_CMA_IN_C)
        largest = max((float(r.cols["n"][r.cols["src"] != r.cols["dst"]].max(initial=0))
                       for r in s.rounds), default=0.0) * self.isz
        fast_call = 0 < m.fast_bytes and largest <= m.fast_bytes
        if not fast_call and 0 < m.fast_bytes and self._exchange_by_cma():
            fast_call, self.shared = True, self.shared[:0]
        key = (m.ring_bytes, m.zero_copy_min, m.cma_min, m.zero_copy_oneway_min, m.cores,
               m.l2_bytes, m.l3_bytes, m.eager, len(self.shared) > 0)
        known = self.memo.get(key) if self.memo is not None else None
        if known is None:
            ws = working_set(s, m.ring_bytes, self.shared, m.zero_copy_min, m.cma_min,
                             m.zero_copy_oneway_min, bool(self.crowded), m.eager)
            known = (ws, [])
            if self.memo is not None:
                self.memo[key] = known
        ws, hits = known
        self.spill = _spill(ws, m.l2_bytes), _spill(ws, m.l3_bytes)
        self.per_message = _TERM["alpha_fast"] if fast_call else _TERM["alpha"]
        self.start = np.zeros(p)
        self.path = np.zeros((p, _N_TERMS))
        self.alone = np.zeros((p, _N_TERMS))
        if s.rounds:
            # every rank enters the call at once: more ranks than cores take turns. Its
            # fixed CPU: the entry into C, or the Python engine's work object and wait; and
            # a second user array to bind and check against the first (all_gather's,
            # scatter's: 3-4 us in Python, the gap to an 8 B all_reduce measured)
            turns = max(1.0, p / m.cores)
            entry = np.zeros(_N_TERMS)
            entry[_TERM["alpha_fast_call" if fast_call else "alpha_call"]] = 1.0
            entry[_TERM["alpha_array"]] = max(0, len(USER_BUFFERS.get(s.collective, ())) - 1)
            self.path = self.path + turns * entry
            self.alone = self.alone + entry
            # ranks beyond the cores wait to be scheduled in, once per call, whatever its
            # rounds (p = 6 on 2 cores: 8 B calls of 1 to 10 rounds all took 100-170 us)
            crowd = np.zeros(_N_TERMS)
            crowd[_TERM["alpha_crowd_call"]] = max(0, p - m.cores)
            self.path = self.path + crowd
            self.alone = self.alone + crowd
            self.start = self.start + turns * float(entry @ self.theta) + float(crowd @ self.theta)
        self.bytes_total = 0.0
        self.msgs_total = 0
        nrounds = 0
        prev = None                 # what each rank touched in the previous round
        fresh = not hits
        first = None        # each rank's state as its first round starts (Schedule.early)
        for i, rnd in enumerate(s.rounds):
            c = rnd.cols
            if not len(c["src"]):
                continue
            if fresh:
                hot, prev = _cache_hits(prev, c, p, m, self.isz)
                hits.append(hot)
            if first is None:
                first = self.start, self.path, self.alone
            if i == s.early:    # posted with the first round: it runs beside the rest
                after = self.start, self.path, self.alone
                # ... on the same thread as the rounds before it, whose messages' CPU
                # (their signals': alpha each, sent or received) it waits for, not their
                # waits
                sig = np.zeros((p, _N_TERMS))
                for r in s.rounds[:i]:
                    moved = r.cols["src"] != r.cols["dst"]
                    sig[:, self.per_message] += np.bincount(r.cols["src"][moved], minlength=p)
                    sig[:, self.per_message] += np.bincount(r.cols["dst"][moved], minlength=p)
                self.start = first[0] + sig @ self.theta
                self.path, self.alone = first[1] + sig, first[2] + sig
                self._round(c, hits[nrounds])
                later = after[0] > self.start
                self.start = np.where(later, after[0], self.start)
                self.path = np.where(later[:, None], after[1], self.path)
                self.alone = np.where(later[:, None], after[2], self.alone)
            else:
                self._round(c, hits[nrounds])
            nrounds += 1
        return self._result(nrounds)

    def _stretch(self, work) -> np.ndarray:
        """How much sharing the cores stretches each rank's CPU work in a round (>= 1),
        from the round's CPU seconds per rank ``work`` (as if alone): the ranks share the
        cores equally while they work (processor sharing), so while rank r does its W_r,
        a rank j with less does all of its W_j and then, waiting, takes ``idle_share`` of
        a core, as a rank with nothing to do in the round does; r's work stretches by
        those ranks' total over ``cores`` x W_r. With ``imbalance``, ranks that do not
        divide evenly over the cores (3 on 2) run at the most crowded core's pace. A root
        that copies from every rank is slowed by senders only as long as they copy."""
        m, p = self.m, self.p
        busy = work > 0
        if not busy.any():
            return np.ones(p)
        w = np.where(busy, work, 0.0)
        less = np.minimum(w[None, :], w[:, None])
        n_work = less.sum(axis=1) / np.where(busy, w, 1.0)
        n_idle = (w[:, None] - less).sum(axis=1) / np.where(busy, w, 1.0)
        load = (n_work + m.idle_share * n_idle) / m.cores
        n = np.round(n_work)
        # uneven only where the working ranks outnumber the cores: one busy rank of two on
        # two cores has a core to itself (this stretched a p = 2 gather's root 1.2-1.3x:
        # gather, scatter p = 2 1 MiB priced 60-140% long)
        k = load + m.imbalance * np.where(n > m.cores, np.ceil(n / m.cores) - n / m.cores, 0.0)
        return np.where(busy, np.maximum(1.0, k), 1.0)

    def _round(self, c, hot) -> None:
        src, dst = c["src"], c["dst"]
        nb = c["n"] * self.isz
        # operands a transfer streams beyond a copy's: a reduce into its accumulator 1, a
        # reduce from an accumulator apart from its destination 2 (acc, message, a third
        # array written: reduce_scatter's ring into tmp or out from "in" was priced 18-39%
        # short at every p, all_reduce's in-place ring within 10%)
        red = c["reduce"].astype(float)
        red += (red > 0) & (c["abuf"] >= 0) & ((c["abuf"] != c["dbuf"]) | (c["aoff"] != c["doff"]))
        sbuf, dbuf = c["sbuf"], c["dbuf"]
        loc = src == dst
        lsrc, lnb, lred = src[loc], nb[loc], red[loc]
        msg = ~loc
        src, dst, nb, red, hot, sbuf, dbuf = (src[msg], dst[msg], nb[msg], red[msg],
                                              hot[:, msg], sbuf[msg], dbuf[msg])
        self.msgs_total += len(src)            # (the schedule's messages, not packets)
        src, dst, nb, red, hot, sbuf, dbuf = self._pieces(c["n"][msg], src, dst, nb, red, hot,
                                                          sbuf, dbuf)
        # each rank's CPU work in the round as if alone, for how much sharing stretches it
        one = np.ones(self.p)
        work = np.zeros(self.p)
        if len(lsrc):
            work += np.bincount(lsrc, self._local_counts(lsrc, lnb, lred, one) @ self.theta,
                                self.p)
        if len(src):
            sides = self._side_counts(src, dst, nb, red, hot, sbuf, dbuf, lsrc)
            work += np.bincount(src, sides[0] @ self.theta, self.p)
            work += np.bincount(dst, sides[1] @ self.theta, self.p)
        stretch = self._stretch(work)
        before = self.start, self.path, self.alone     # (where a receive posted first starts)
        if len(lsrc):
            self._local_steps(lsrc, lnb, lred, stretch)
        if len(src):
            self._messages(src, dst, nb, sides, stretch, before)

    def _pieces(self, n, src, dst, nb, red, hot, sbuf, dbuf):
        """The round's messages as the transport sends them: one of ``n`` elements from a
        sender that receives nothing in the round, which ``limits.pieces`` splits, becomes
        its packets, in order (an EAGER one each, so its receiver copies one out while the
        sender copies the next in)."""
        m = self.m
        if not limits.pieces(m.eager // int(self.isz), int(self.isz), self.p, m.piece, m.eager) \
                or not ((nb > 2 * m.piece) & (nb <= m.eager)).any():
            return src, dst, nb, red, hot, sbuf, dbuf      # (none can be: the usual case)
        sizes, at = np.unique(n, return_inverse=True)
        per = np.array([limits.pieces(int(k), int(self.isz), self.p, m.piece, m.eager)
                        for k in sizes], np.int64)[at]
        per *= one_way(n, src, dst)          # (an exchange's stay whole: work.compile_plan)
        if not per.any():
            return src, dst, nb, red, hot, sbuf, dbuf
        k = np.where(per > 0, -(-n // np.maximum(per, 1)), 1)
        rows = np.repeat(np.arange(len(n)), k)
        first = np.repeat(np.cumsum(k) - k, k)
        j = np.arange(len(rows)) - first                         # packet j of its message
        size = np.where(per[rows] > 0, np.minimum(per[rows], n[rows] - j * per[rows]), n[rows])
        return (src[rows], dst[rows], size * self.isz, red[rows], hot[:, rows], sbuf[rows],
                dbuf[rows])

    def _local_counts(self, src, nb, red, stretch) -> np.ndarray:
        """Term counts of a round's local steps (copies and reduces on their own rank)."""
        f2, f3 = self.spill
        k = stretch[src]
        counts = np.zeros((len(src), _N_TERMS))
        counts[:, _TERM["delta"]] = nb
        counts[:, _TERM["gamma"]] = nb * (red > 0)
        # A local reduce into its accumulator streams what a copy does (two arrays read, one
        # written, against one read and one written that the CPU reads before it writes):
        # 8 MiB of fresh float32 here, np.add in place 572-607 us, a copy 577-589. One into
        # a third array streams a third more (bare, 967-987 us: 1.65x a copy; charged 5/3,
        # three accuracy grids' median error came out the same and one cell a grid fewer
        # had the right winner). (Charged one operand more, like a receive that reduces
        # from the ring, recursive doubling's and direct's all_reduce, whose last round is
        # such a reduce, were priced 22-59% long from 8 MiB.)
        streams = np.where(red >= 2, 4.0 / 3.0, 1.0)
        counts[:, _TERM["mem_l2"]] = nb * f2 * streams
        counts[:, _TERM["mem_l3"]] = nb * f3 * streams
        counts[:, _TERM["beta_share"]] = nb * (k - 1) / k
        return counts

    def _local_steps(self, src, nb, red, stretch) -> None:
        """A round's local steps, before its messages (``stretch``: per rank)."""
        per = np.zeros((self.p, _N_TERMS))
        np.add.at(per, src, self._local_counts(src, nb, red, stretch))
        k = stretch[:, None]
        self.start = self.start + stretch * (per @ self.theta)
        self.path = self.path + k * per
        self.alone = self.alone + per

    def _exchange_by_cma(self) -> bool:
        """Whether C runs this call with CMA messages (transport/fast.py: prepare): every
        message above one EAGER packet is one a plain buffer sends by CMA in an exchange
        round, into a receive that copies."""
        m, any_cma = self.m, False
        for rnd in self.s.rounds:
            c = rnd.cols
            sent = c["src"] != c["dst"]
            nb = c["n"][sent] * self.isz
            big = nb > m.fast_bytes
            if not big.any():
                continue
            _, cma = _read_in_place(nb, c["sbuf"][sent], (), -1, m.cma_min, c["src"][sent],
                                    c["dst"][sent], c["reduce"][sent].astype(bool),
                                    crowded=bool(self.crowded), eager=m.eager)
            cma &= ~one_way(nb, c["src"][sent], c["dst"][sent])
            if not cma[big].all():
                return False
            any_cma = True
        return any_cma

    def _side_counts(self, src, dst, nb, red, hot, sbuf, dbuf, local=None):
        """Term counts of each message's work on its sending and its receiving side (those
        of sharing the cores left to ``_shared_counts``), and of its latency; and which
        messages the receiver reads in place."""
        m = self.m
        f2, f3 = self.spill
        n = len(nb)
        send = np.zeros((n, _N_TERMS))
        send[:, self.per_message] = 1.0
        # a message larger than one EAGER packet costs more than its bytes: fragments through
        # the ring, or a whole read by CMA. (Without it, alpha took it for every message, an
        # agreement's empty ones too: 58 us each, reduce direct 1 MiB priced 60-120% long.)
        send[:, _TERM["alpha_large"]] = nb > m.eager
        send[:, _TERM["beta"]] = nb
        # memory stalls of each side's copy (what a rank touched in the previous round may
        # still be cached)
        send[:, _TERM["mem_l2"]] = nb * f2 * (1.0 - hot[0])
        send[:, _TERM["mem_l3"]] = nb * f3 * (1.0 - hot[1])
        recv = send.copy()
        # a receive that reduces streams one operand more than a copy: the ring, the
        # accumulator, the destination (reduce_scatter ring p=2 16 MiB was priced 43% short,
        # and beta_cma took the rest of all_reduce's first round)
        recv[:, _TERM["mem_l2"]] = nb * f2 * (1.0 - hot[2]) * (1.0 + red)
        recv[:, _TERM["mem_l3"]] = nb * f3 * (1.0 - hot[3]) * (1.0 + red)
        recv[:, _TERM["gamma"]] = nb * (red > 0)
        # read in place: the sender only announces it (RTS), the receiver's copy is the
        # one copy; no ring, so no lag of a one-way stream either. (Charging that copy the
        # source's memory stalls too, as the reader streams it, priced a 64 MiB broadcast
        # read in place 61% long and an 8 MiB all_gather's direct reads 30% long here.)
        local = np.asarray(() if local is None else local, np.int64)
        inplace, cma = _read_in_place(nb, sbuf, self.shared, m.zero_copy_min, m.cma_min,
                                      src, dst, red > 0, m.zero_copy_oneway_min,
                                      bool(self.crowded), local, m.eager)
        whole = np.zeros(n, bool)     # read in place, copied by its sender into a root
        if inplace.any():
            for term in ("beta", "mem_l2", "mem_l3"):
                send[inplace, _TERM[term]] = 0.0
            # ... and read from a mapped rl.empty buffer, no alpha_large either: no fragments,
            # no kernel call (charged it, a 1 MiB reduce at p = 2 from rl.empty read alone
            # was priced 97 us against 62 measured, and auto took rabenseifner, 18% slower;
            # refitted without it, three accuracy grids' shm rl.empty cells: 24.6% -> 19.7%,
            # 27.2% -> 23.8%, 23.3% -> 19.0% median error)
            mapped = inplace & ~cma
            send[mapped, _TERM["alpha_large"]] = 0.0
            recv[mapped, _TERM["alpha_large"]] = 0.0
            recv[:, _TERM["beta_cma"]] = nb * cma      # the kernel's copy, over memcpy's
            # copied by both ends (transport/split.py): a one-way message read in place into
            # an rl.empty destination, each end on its own core, is half the receiver's and
            # half the sender's, at once (priced as the receiver's alone, an 8 MiB broadcast
            # at p = 2 from rl.empty was 605 us predicted against 341-357 measured)
            both = inplace & ~cma & _split(nb, dst, dbuf, red, self.shared, m.split_min,
                                           src, False, m.split_reduce_min)
            # into a rank that copies locally in the round (a gather's root), its sender
            # copies all of it while the root copies its own (split.Receiver.offer), crowded
            # or not; elsewhere only where each rank has a core
            whole = both & np.isin(dst, local)
            both &= ~whole & (not self.crowded)
            if both.any():
                for term in ("beta", "mem_l2", "mem_l3", "gamma"):
                    recv[both, _TERM[term]] *= 0.5
                    send[both, _TERM[term]] = recv[both, _TERM[term]]
            if whole.any():
                for term in ("beta", "mem_l2", "mem_l3", "gamma"):
                    send[whole, _TERM[term]] = recv[whole, _TERM[term]]
                    recv[whole, _TERM[term]] = 0.0
        # a one-way message from a plain buffer split by CMA (transport/cma.py): the sender
        # writes its head into the receive buffer while the receiver reads the rest, each
        # at the kernel's pace (priced as streamed, an 8 MiB broadcast at p = 2 was 632 us
        # predicted against 419-431 measured)
        put, head, early = _put_split(nb, src, dst, red, inplace, m.cma_put_min, local,
                                      self.p, bool(self.crowded))
        early = early | whole
        if put.any():
            tail = 1.0 - head
            for term in ("mem_l2", "mem_l3"):
                send[put, _TERM[term]] = recv[put, _TERM[term]] * head[put]
                recv[put, _TERM[term]] *= tail[put]
            for side, share in ((send, head), (recv, tail)):
                side[put, _TERM["beta"]] = nb[put] * share[put]
                side[put, _TERM["beta_cma"]] = nb[put] * share[put]
            inplace = inplace | put                    # no ring: no fragments, no lag
        for side in (send, recv):
            side[:, _TERM["beta_crowd"]] = side[:, _TERM["beta"]] * self.crowded
        lat = np.zeros((n, _N_TERMS))
        lat[:, _TERM["alpha_hop"]] = 1.0
        lat[:, _TERM["alpha_rdv"]] = (nb > max(m.eager, m.rendezvous)) | inplace
        lat[:, _TERM["alpha_crowd"]] = self.crowded
        return send, recv, lat, inplace, early

    def _shared_counts(self, side, k) -> None:
        """A side's counts of sharing the cores, stretched ``k`` (per message): each byte
        it copies pays beta_share for every rank beyond the cores (k - 1, once the whole
        side is stretched k) and beta_crowd once when the job is crowded."""
        moved = side[:, _TERM["beta"]]
        side[:, _TERM["beta_share"]] = moved * (k - 1) / k
        side[:, _TERM["beta_crowd"]] = moved * self.crowded / k

    def _messages(self, src, dst, nb, sides, stretch, before) -> None:
        """A round's messages: when each side's work can start, each rank's own work in
        order, and the round's end on every rank. ``before``: (start, path, alone) before
        the round's local steps, where a receive posted before them (``early``) starts."""
        m, th = self.m, self.theta
        start, path, alone = self.start, self.path, self.alone
        self.bytes_total += float(nb.sum())
        send, recv, lat, inplace, early = sides
        k_s, k_d = stretch[src], stretch[dst]
        self._shared_counts(send, k_s)
        self._shared_counts(recv, k_d)
        w_send = k_s * (send @ th)
        w_recv = k_d * (recv @ th)
        s_src, s_dst = start[src], np.where(early, before[0][dst], start[dst])
        # A rendezvous message starts when both ends have started the round (plus its
        # latency) and streams through the ring, both sides copying at once. An eager
        # one (a single fragment) is store-and-forward: the sender copies it in as soon
        # as it starts, the receiver copies it out once it has arrived; the sender does
        # not wait for the receiver.
        eager = (nb <= m.eager) & ~inplace
        by_src = s_src >= s_dst
        later = np.where(by_src, src, dst)     # the end whose path it extends
        t0 = np.maximum(s_src, s_dst) + lat @ th
        pre = (early & ~by_src)[:, None]
        base_path = np.where(pre, before[1][dst], path[later]) + lat
        base_alone = np.where(pre, before[2][dst], alone[later]) + lat
        # a sender copies its eager messages in the order it posts them
        queued = _cumsum_by(src, send * eager[:, None])
        arrive = s_src + k_s * (queued @ th) + lat @ th
        late = eager & (arrive > s_dst)          # the receiver waits for the data
        release_send = np.where(eager, s_src, t0)
        release_recv = np.where(eager, np.maximum(arrive, s_dst), t0)
        e = eager[:, None]
        before_send = np.where(e, path[src], base_path), np.where(e, alone[src], base_alone)
        before_recv = (np.where(late[:, None], path[src] + k_s[:, None] * queued + lat,
                                np.where(e, path[dst], base_path)),
                       np.where(late[:, None], alone[src] + queued + lat,
                                np.where(e, alone[dst], base_alone)))
        own = _own_work(np.concatenate([src, dst]),
                        np.concatenate([release_send, release_recv]),
                        np.concatenate([w_send, w_recv]),
                        np.concatenate([k_s[:, None] * send, k_d[:, None] * recv]),
                        np.concatenate([send, recv]),
                        np.concatenate([before_send[0], before_recv[0]]),
                        np.concatenate([before_send[1], before_recv[1]]))
        # a rendezvous message is done when the slower side could have finished it,
        # plus the lag; it holds both ends
        by_send = (w_send >= w_recv)[:, None]
        slower = np.where(by_send, send, recv)
        k_slow = np.where(by_send[:, 0], k_s, k_d)[:, None]
        lag = np.zeros((len(src), _N_TERMS))
        lag[:, _TERM["beta_lag"]] = nb * ~inplace
        done = t0 + np.maximum(w_send, w_recv) + lag @ th
        rdv = ~eager
        held = (np.concatenate([src[rdv], dst[rdv]]), np.tile(done[rdv], 2),
                np.tile((base_path + k_slow * slower + lag)[rdv], (2, 1)),
                np.tile((base_alone + slower + lag)[rdv], (2, 1)))
        self._end_round(own, held)

    def _end_round(self, own, held) -> None:
        """Every rank ends the round at the latest of: its start, its own work, and the
        completion of every rendezvous message it takes part in (an eager message ends
        with its receiver's copy, part of the receiver's own work)."""
        ranks = np.arange(self.p)
        cand_r = np.concatenate([ranks, own[0], held[0]])
        cand_v = np.concatenate([self.start, own[1], held[1]])
        cand_path = np.concatenate([self.path, own[2], held[2]])
        cand_alone = np.concatenate([self.alone, own[3], held[3]])
        pick = np.lexsort((cand_v, cand_r))
        last = np.ones(len(pick), bool)
        last[:-1] = cand_r[pick][1:] != cand_r[pick][:-1]
        sel = pick[last]                      # one per rank, in rank order
        self.start, self.path, self.alone = cand_v[sel], cand_path[sel], cand_alone[sel]

    def _result(self, nrounds: int) -> SimResult:
        p, th, start, path = self.p, self.theta, self.start, self.path
        last_rank = int(np.argmax(start)) if p else 0
        total = float(start[last_rank]) if p else 0.0
        feats = path[last_rank] if p else np.zeros(_N_TERMS)
        parts = {k: float(v) for k, v in zip(HOST_TERMS, feats * th)}
        sharing = max(0.0, float(feats @ th - self.alone[last_rank] @ th)) if p else 0.0
        lat_t = sum(parts[k] for k in _LATENCY_TERMS)
        bw_t = sum(parts[k] for k in _BANDWIDTH_TERMS + _MEMORY_TERMS)
        terms = Terms(lat_t, bw_t, parts["gamma"])
        lat_cols = [_TERM[k] for k in _LATENCY_TERMS]
        bw_cols = [_TERM[k] for k in _BANDWIDTH_TERMS + _MEMORY_TERMS]
        rank_terms = np.stack([path[:, lat_cols] @ th[lat_cols], path[:, bw_cols] @ th[bw_cols],
                               path[:, _TERM["gamma"]] * self.m.gamma], axis=1)
        return SimResult(total, start, terms, rank_terms,
                         {"intra": int(round(self.bytes_total)), "inter": 0},
                         {"intra": int(self.msgs_total), "inter": 0}, None, None, nrounds,
                         parts, {k: float(v) for k, v in zip(HOST_TERMS, feats)}, sharing)


def _own_work(rank, release, work, path, alone, before_path, before_alone):
    """Each rank's own work on its messages, one thread, in order of release: item j is
    done at release_j + the work of every item of its rank released at or after it
    (a single machine with release dates, scheduled latest first). Returns (rank, done,
    path, alone) of every item, in (rank, release descending) order."""
    order = np.lexsort((-release, rank))
    r_o = rank[order]
    first = np.ones(len(r_o), bool)
    first[1:] = r_o[1:] != r_o[:-1]
    return (r_o, release[order] + _restart_cumsum(first, work[order]),
            before_path[order] + _restart_cumsum(first, path[order]),
            before_alone[order] + _restart_cumsum(first, alone[order]))


def _restart_cumsum(first: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Running sums of ``rows`` that start again at every row where ``first`` is set."""
    seg = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    cs = np.cumsum(rows, axis=0)
    return cs - (cs[starts] - rows[starts])[seg]


__all__ = ["Topology", "SimResult", "simulate", "working_set"]


@_form("all_reduce", "double_tree")
def _double_tree(p, n, a, b, g, *, itemsize=4, segments=None, **kw):
    """NCCL's double binary tree has no simple exact closed form (its pipeline's fill
    depends on the two trees' shapes): its price is its own schedule, simulated on a
    uniform link with these alpha, beta and gamma."""
    if segments is not None:
        raise ValueError("double_tree cuts its segments by its own rule "
                         "(ringlet.algorithms.tree_segments); segments= does not apply")
    s = build("all_reduce", "double_tree", p, int(n) // itemsize, itemsize=itemsize)
    link = Link.from_beta(a, b) if b > 0 else Link(a, 1e300)
    return simulate(s, Topology.uniform(p, link, g)).terms


#: up to this group size a rooted call's agreement is priced off its schedule (as the
#: simulator's SIM_MAX_P); above it by the bound (lg p - 1) * alpha
AGREEMENT_EXACT_MAX_P = 1024


def agreement_terms(collective, alg, p, n, intra, inter, g, itemsize, hosts) -> Terms:
    """What a rooted call's agreement adds (``ringlet.algorithms.agree_alongside``): the
    dissemination barrier's lg p signal rounds, the last of which carries the algorithm's
    first round (which then waits for every signal its ranks receive in it), or - a
    first-round message above ``EARLY_MIN_BYTES`` - which run beside that round. How
    much of them the data does not hide depends on who signals whom in which round, so
    it is read off the schedule: the simulated call with them less without them. Above
    ``AGREEMENT_EXACT_MAX_P`` ranks, (lg p - 1) * alpha: the barrier but its last round."""
    if p > AGREEMENT_EXACT_MAX_P:
        return agreement_bound(collective, alg, p, n, intra, inter, hosts)
    ids = tuple(r // (p // (hosts or 1)) for r in range(p)) if alg == "hierarchical" else None
    s = build(collective, alg, p, count_of(collective, p, n, itemsize), itemsize=itemsize,
              **({"hosts": ids} if ids else {}))
    topo = Topology.from_host_ids(ids or (0,) * p, intra, inter, g)
    both, alone = simulate(s, topo).terms, simulate(s.without_agreement(), topo).terms
    return Terms(*(x - y for x, y in zip(both, alone)))


model.AGREEMENT = agreement_terms
