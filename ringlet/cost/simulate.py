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

The simulator also follows the critical path: for every rank it keeps how much of its
finish time is latency (alpha), bandwidth (beta, including NIC sharing and local copies)
and reduction (gamma), so ``SimResult.terms`` is directly comparable with the closed forms
of :mod:`ringlet.cost.model`.

Rounds are priced with NumPy over the schedule's transfer columns, so a 4096-rank ring
all-reduce (8190 rounds x 4096 transfers) prices in about two seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..algorithms import build
from ..schedule import BUFFER_NAMES
from ..transport import shm
from .host import _BANDWIDTH_TERMS, _LATENCY_TERMS, _MEMORY_TERMS, HOST_TERMS, HostModel
from .model import Link, Terms, _form, tier


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
                      shared: float = 1.0) -> "Topology":
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
                       shared=shared)
        if len(labels) == 1:
            return cls(1, len(ids), intra, inter, gamma, delta, nic_sharing, shared=shared)
        return cls(len(labels), int(counts.max()), intra, inter, gamma, delta, nic_sharing, norm,
                   shared=shared)

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
        return (f"{self.hosts} hosts x {self.ranks_per_host} ranks; intra {self.intra}; "
                f"inter {self.inter}" + ("; shared NIC" if self.nic_sharing else ""))


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

    ``simulate(s, link="infiniband")`` is shorthand for a uniform topology; ``gamma``
    overrides the topology's. ``shared`` names the schedule's buffers that lie in shared
    memory (``rl.empty``): on a :class:`HostModel` their sends above its
    ``zero_copy_min`` are read in place by the receiver. See the module docstring for
    the model."""
    p = int(schedule.p)
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
        p, g, isz, topo = self.p, self.g, self.isz, self.topo
        start = np.zeros(p)
        lat = np.zeros(p)
        bw = np.zeros(p)
        red = np.zeros(p)
        xt = np.zeros(p)     # of lat + bw: seconds spent on inter-host messages
        neg = np.full(p, -np.inf)
        ai, bi = topo.intra.alpha, topo.intra.beta
        ae, be = topo.inter.alpha, topo.inter.beta
        host = topo.host_array
        bytes_intra = bytes_inter = 0.0
        msgs_intra = msgs_inter = 0
        nic_out = np.zeros(self.H)
        nic_in = np.zeros(self.H)
        delta = topo.delta
        nrounds = 0

        for rnd in self.s.rounds:
            c = rnd.cols
            src = c["src"]
            if not len(src):
                continue
            nrounds += 1
            dst, n, rflag = c["dst"], c["n"], c["reduce"]
            loc = src == dst
            nloc = np.count_nonzero(loc)
            if nloc:
                lsrc = src[loc]
                lbytes = n[loc] * isz
                lred = rflag[loc].astype(bool)
                if g and lred.any():
                    gr = np.bincount(lsrc[lred], lbytes[lred], p) * g
                    start = start + gr
                    red = red + gr
                if delta and (~lred).any():
                    cp = np.bincount(lsrc[~lred], lbytes[~lred], p) * delta
                    start = start + cp
                    bw = bw + cp
                if nloc == len(src):
                    continue
                msg = ~loc
                src, dst, n, rflag = src[msg], dst[msg], n[msg], rflag[msg]
            m = len(src)
            nb = n * isz
            x = None
            # ---- cost of each message on its link
            if self.uniform:
                a = ai
                bcost = nb * bi
                nbt = float(nb.sum())
                bytes_intra += nbt
                msgs_intra += m
                a_arr = None
            else:
                hs, hd = host[src], host[dst]
                x = hs != hd
                nx = int(np.count_nonzero(x))
                if nx == 0:
                    a, a_arr = ai, None
                    bcost = nb * bi
                    bytes_intra += float(nb.sum())
                    msgs_intra += m
                else:
                    a_arr = np.where(x, ae, ai)
                    a = a_arr
                    if topo.nic_sharing:
                        sx, dx = src[x], dst[x]
                        kout = np.bincount(sx, minlength=p) > 0
                        kin = np.bincount(dx, minlength=p) > 0
                        kout = np.bincount(host, kout, self.H)
                        kin = np.bincount(host, kin, self.H)
                        share = np.maximum(kout[hs], kin[hd])
                        share = np.where(share > 1, share / topo.shared, share)
                        bcost = np.where(x, nb * be * share, nb * bi)
                    else:
                        bcost = np.where(x, nb * be, nb * bi)
                    xb = nb[x]
                    bytes_inter += float(xb.sum())
                    bytes_intra += float(nb.sum()) - float(xb.sum())
                    msgs_inter += nx
                    msgs_intra += m - nx
                    nic_out += np.bincount(hs[x], xb, self.H)
                    nic_in += np.bincount(hd[x], xb, self.H)
            if np.ndim(bcost) == 0:
                bcost = np.full(m, float(bcost))
            cost = a + bcost
            # ---- when each message can start: both ends have started the round
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
            # ---- reductions at the receiver
            if g and rflag.any():
                G = np.bincount(dst, nb * rflag, p) * g
            else:
                G = None

            nsend = np.bincount(src, minlength=p)
            nrecv = np.bincount(dst, minlength=p)
            if nsend.max() <= 1 and nrecv.max() <= 1:
                # every rank sends at most one and receives at most one message: a message's
                # arrival is both its sender's and its receiver's finish (t0 >= own start)
                fin_out = neg.copy()
                fin_out[src] = arr
                fin_in = neg.copy()
                fin_in[dst] = arr
                if G is not None:
                    fin_in = fin_in + G
                use_in = fin_in >= fin_out
                finish = np.maximum(np.maximum(fin_in, fin_out), start)
                active = (nsend + nrecv) > 0
                # which message determines each active rank's finish
                mi = np.zeros(p, np.int64)
                mi[src] = np.arange(m)
                mi_in = np.zeros(p, np.int64)
                mi_in[dst] = np.arange(m)
                mi = np.where(use_in, mi_in, mi)
                new_lat = np.where(active, m_lat[mi], lat)
                new_bw = np.where(active, m_bw[mi], bw)
                new_red = np.where(active, m_red[mi], red)
                new_x = np.where(active, m_x[mi], xt)
                if G is not None:
                    new_red = new_red + np.where(active & use_in, G, 0.0)
            else:
                finish, new_lat, new_bw, new_red, new_x = self._general(
                    p, src, dst, a, bcost, cost, arr, m_lat, m_bw, m_red, G,
                    start, lat, bw, red, nsend, nrecv, neg, xt, xcost, m_x)
            start, lat, bw, red, xt = finish, new_lat, new_bw, new_red, new_x

        rank_terms = np.stack([lat, bw, red], axis=1)
        last = int(np.argmax(start)) if p else 0
        total = float(start[last]) if p else 0.0
        terms = Terms(float(lat[last]), float(bw[last]), float(red[last])) if p else Terms()
        return SimResult(total, start, terms, rank_terms,
                         {"intra": int(round(bytes_intra)), "inter": int(round(bytes_inter))},
                         {"intra": int(msgs_intra), "inter": int(msgs_inter)},
                         nic_out if self.H > 1 else None, nic_in if self.H > 1 else None,
                         nrounds, inter=float(xt[last]) if p else 0.0)

    @staticmethod
    def _general(p, src, dst, a, bcost, cost, arr, m_lat, m_bw, m_red, G,
                 start, lat, bw, red, nsend, nrecv, neg, xt, xcost, m_x):
        """Ranks with several messages in one round: queue them on the port."""
        m = len(src)
        a_vec = np.broadcast_to(a, (m,)).astype(float)
        S_lat = np.bincount(src, a_vec, p)
        S_bw = np.bincount(src, bcost, p)
        R_lat = np.bincount(dst, a_vec, p)
        R_bw = np.bincount(dst, bcost, p)
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
        x_c = np.stack([xt, xt + np.bincount(src, xcost, p), m_x[out_msg],
                        xt + np.bincount(dst, xcost, p), m_x[in_msg]])
        cols = np.arange(p)
        return (finish, lat_c[which, cols], bw_c[which, cols], red_c[which, cols],
                x_c[which, cols])


def working_set(schedule, ring_bytes: int = shm.RING_BYTES, shared=(),
                zero_copy_min: int = -1) -> float:
    """Bytes a job touches: every rank's buffers, plus the part of each shared ring that
    its pair's messages cycle through (up to the ring's size). A message its receiver
    reads in place (from one of the ``shared`` buffers, indices into ``BUFFER_NAMES``, and
    larger than ``zero_copy_min``; -1: none is) uses no ring."""
    isz = float(schedule.itemsize)
    total = float(sum(int(v) for v in schedule.buffers.values())) * schedule.p * isz
    biggest: dict = {}
    for rnd in schedule.rounds:
        c = rnd.cols
        msg = (c["src"] != c["dst"]) & ~_read_in_place(c["n"] * isz, c["sbuf"], shared,
                                                        zero_copy_min)
        if not msg.any():
            continue
        pair = c["src"][msg] * schedule.p + c["dst"][msg]
        nb = c["n"][msg]
        for k, v in zip(pair.tolist(), nb.tolist()):
            if v > biggest.get(k, 0):
                biggest[k] = v
    return total + sum(min(v * isz, ring_bytes) for v in biggest.values())


def _read_in_place(nbytes, sbuf, shared, zero_copy_min: int) -> np.ndarray:
    """Which messages their receiver reads in place: sent from one of the ``shared``
    buffers (indices into ``BUFFER_NAMES``) and larger than ``zero_copy_min`` (-1: none)."""
    if zero_copy_min < 0 or not len(shared):
        return np.zeros(len(nbytes), bool)
    return (nbytes > zero_copy_min) & np.isin(sbuf, shared)


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
    cs = np.cumsum(rows[order], axis=0)
    k = keys[order]
    first = np.ones(len(k), bool)
    first[1:] = k[1:] != k[:-1]
    starts = np.flatnonzero(first)
    cs -= (cs[starts] - rows[order][starts])[np.cumsum(first) - 1]
    out = np.empty_like(cs)
    out[order] = cs
    return out


def _spill(ws: float, cache: float) -> float:
    """Fraction of streamed bytes that miss a cache of ``cache`` bytes: 1 - C/W."""
    return 0.0 if ws <= cache else 1.0 - cache / ws


class _HostSim:
    """The :class:`HostModel` applied round by round (see its docstring).

    In a round, a rank first runs its local steps, then works through its messages: a
    rendezvous message can start once both ends have started the round plus its latency
    (rendezvous, wake-up) and is done when the slower of its two sides could be; an eager
    one is copied in by its sender as soon as the sender starts the round (its eager
    messages one after the other, in posting order) and copied out by its receiver once
    it has arrived (plus its latency). A rank's own work on its
    messages adds up (one thread), in order of when each can start. Busy ranks beyond
    the cores stretch all CPU work of the round. Along the critical path the simulator
    keeps the count of every term (messages, bytes, ...), stretched and not, so that the
    fit is linear in the parameters and ``explain`` can name every term."""

    K = len(HOST_TERMS)

    def __init__(self, schedule, model: HostModel, shared=()):
        self.s = schedule
        self.m = model
        self.p = int(schedule.p)
        bad = set(shared) - set(BUFFER_NAMES)
        if bad:
            raise ValueError(f"shared names unknown buffers {sorted(bad)}; valid: {BUFFER_NAMES}")
        self.shared = np.array([BUFFER_NAMES.index(b) for b in shared], np.int64)

    def run(self) -> SimResult:
        s, m, p, K = self.s, self.m, self.p, self.K
        th = m.theta
        isz = float(s.itemsize)
        ws = working_set(s, m.ring_bytes, self.shared, m.zero_copy_min)
        f2, f3 = _spill(ws, m.l2_bytes), _spill(ws, m.l3_bytes)
        crowded = 1.0 if p > m.cores else 0.0
        I = {k: i for i, k in enumerate(HOST_TERMS)}
        # a call whose messages are all EAGER packets runs in C: its per-message CPU is
        # alpha_fast (rl.empty buffers' messages are read in place only above fast_bytes)
        largest = max((float(r.cols["n"][r.cols["src"] != r.cols["dst"]].max(initial=0))
                       for r in s.rounds), default=0.0) * isz
        fast_call = 0 < m.fast_bytes and largest <= m.fast_bytes
        per_message = I["alpha_fast"] if fast_call else I["alpha"]
        start = np.zeros(p)
        F = np.zeros((p, K))        # term counts on each rank's critical path (stretched)
        U = np.zeros((p, K))        # the same, unstretched
        if fast_call and s.rounds:
            # every rank enters the call at once: more ranks than cores take turns
            k0 = max(1.0, p / m.cores)
            F[:, I["alpha_fast_call"]] = k0
            U[:, I["alpha_fast_call"]] = 1.0
            start = start + k0 * m.alpha_fast_call
        bytes_total = 0.0
        msgs_total = 0
        nrounds = 0
        ranks = np.arange(p)
        prev = None                 # what each rank touched in the previous round
        for rnd in s.rounds:
            c = rnd.cols
            src = c["src"]
            if not len(src):
                continue
            nrounds += 1
            dst = c["dst"]
            nb = c["n"] * isz
            red = c["reduce"].astype(bool)
            sbuf = c["sbuf"]
            hot, prev = _cache_hits(prev, c, p, m, isz)
            busy = np.zeros(p, bool)
            busy[src] = True
            busy[dst] = True
            A = np.count_nonzero(busy)
            k = max(1.0, (A + m.idle_share * (p - A)) / m.cores
                    + m.imbalance * (-(-A // m.cores) - A / m.cores))
            loc = src == dst
            if loc.any():
                lf = np.zeros((int(loc.sum()), K))
                ln = nb[loc]
                lf[:, I["delta"]] = ln
                lf[:, I["gamma"]] = ln * red[loc]
                lf[:, I["mem_l2"]] = ln * f2
                lf[:, I["mem_l3"]] = ln * f3
                lf[:, I["beta_share"]] = ln * (k - 1) / k
                per = np.zeros((p, K))
                np.add.at(per, src[loc], lf)
                start = start + k * (per @ th)
                F = F + k * per
                U = U + per
                msg = ~loc
                src, dst, nb, red, hot, sbuf = (src[msg], dst[msg], nb[msg], red[msg],
                                                hot[:, msg], sbuf[msg])
            M = len(src)
            if M == 0:
                continue
            bytes_total += float(nb.sum())
            msgs_total += M
            fs = np.zeros((M, K))
            fs[:, per_message] = 1.0
            fs[:, I["beta"]] = nb
            fs[:, I["mem_l2"]] = nb * f2
            fs[:, I["mem_l3"]] = nb * f3
            fs[:, I["beta_share"]] = nb * (k - 1) / k
            fs[:, I["beta_crowd"]] = nb * crowded / k
            fd = fs.copy()
            fd[:, I["gamma"]] = nb * red
            # read in place: the sender only announces it (RTS), the receiver's copy is the
            # one copy; no ring, so no lag of a one-way stream either
            inplace = _read_in_place(nb, sbuf, self.shared, m.zero_copy_min)
            if inplace.any():
                for term in ("beta", "mem_l2", "mem_l3", "beta_share", "beta_crowd"):
                    fs[inplace, I[term]] = 0.0
            # what a rank touched in the previous round may still be in its caches
            fs[:, I["mem_l2"]] *= 1.0 - hot[0]
            fs[:, I["mem_l3"]] *= 1.0 - hot[1]
            fd[:, I["mem_l2"]] *= 1.0 - hot[2]
            fd[:, I["mem_l3"]] *= 1.0 - hot[3]
            lat = np.zeros((M, K))
            lat[:, I["alpha_hop"]] = 1.0
            lat[:, I["alpha_rdv"]] = (nb > max(m.eager, m.rendezvous)) | inplace
            lat[:, I["alpha_crowd"]] = crowded
            w_s = k * (fs @ th)
            w_d = k * (fd @ th)
            s_src, s_dst = start[src], start[dst]
            # A rendezvous message starts when both ends have started the round (plus its
            # latency) and streams through the ring, both sides copying at once. An eager
            # one (a single fragment) is store-and-forward: the sender copies it in as soon
            # as it starts, the receiver copies it out once it has arrived; the sender does
            # not wait for the receiver.
            eager = (nb <= m.eager) & ~inplace
            e = np.where(s_src >= s_dst, src, dst)
            t0 = np.maximum(s_src, s_dst) + lat @ th
            baseF = F[e] + lat
            baseU = U[e] + lat
            # a sender copies its eager messages in the order it posts them
            queued = _cumsum_by(src, fs * eager[:, None])
            arrive = s_src + k * (queued @ th) + lat @ th
            late = eager & (arrive > s_dst)          # the receiver waits for the data
            rel_s = np.where(eager, s_src, t0)
            rel_d = np.where(eager, np.maximum(arrive, s_dst), t0)
            bF_s = np.where(eager[:, None], F[src], baseF)
            bU_s = np.where(eager[:, None], U[src], baseU)
            bF_d = np.where(late[:, None], F[src] + k * queued + lat,
                            np.where(eager[:, None], F[dst], baseF))
            bU_d = np.where(late[:, None], U[src] + queued + lat,
                            np.where(eager[:, None], U[dst], baseU))
            # each rank's own work, in order of release (single machine, release dates):
            # done at max_j (release_j + work of everything released at or after it)
            r_i = np.concatenate([src, dst])
            rel = np.concatenate([rel_s, rel_d])
            w_i = np.concatenate([w_s, w_d])
            fF = np.concatenate([k * fs, k * fd])
            fU = np.concatenate([fs, fd])
            bF = np.concatenate([bF_s, bF_d])
            bU = np.concatenate([bU_s, bU_d])
            order = np.lexsort((-rel, r_i))
            r_o, rel_o, w_o = r_i[order], rel[order], w_i[order]
            first = np.ones(len(r_o), bool)
            first[1:] = r_o[1:] != r_o[:-1]
            seg = np.cumsum(first) - 1
            starts = np.flatnonzero(first)
            cw = np.cumsum(w_o)
            cw = cw - (cw[starts] - w_o[starts])[seg]
            cF = np.cumsum(fF[order], axis=0)
            cF = cF - (cF[starts] - fF[order][starts])[seg]
            cU = np.cumsum(fU[order], axis=0)
            cU = cU - (cU[starts] - fU[order][starts])[seg]
            own_val = rel_o + cw
            own_F = bF[order] + cF
            own_U = bU[order] + cU
            # a rendezvous message is done when the slower side could have finished it,
            # plus the lag; it holds both ends
            send_slower = w_s >= w_d
            lag = np.zeros((M, K))
            lag[:, I["beta_lag"]] = nb * ~inplace
            done = t0 + np.maximum(w_s, w_d) + lag @ th
            dF = baseF + k * np.where(send_slower[:, None], fs, fd) + lag
            dU = baseU + np.where(send_slower[:, None], fs, fd) + lag
            # every rank ends the round at the latest of: its start, its own work, and the
            # completion of every rendezvous message it takes part in (an eager message
            # ends with its receiver's copy, part of the receiver's own work)
            rdv = ~eager
            cand_r = np.concatenate([ranks, r_o, src[rdv], dst[rdv]])
            cand_v = np.concatenate([start, own_val, done[rdv], done[rdv]])
            cand_F = np.concatenate([F, own_F, dF[rdv], dF[rdv]])
            cand_U = np.concatenate([U, own_U, dU[rdv], dU[rdv]])
            pick = np.lexsort((cand_v, cand_r))
            last = np.ones(len(pick), bool)
            last[:-1] = cand_r[pick][1:] != cand_r[pick][:-1]
            sel = pick[last]                      # one per rank, in rank order
            start = cand_v[sel]
            F = cand_F[sel]
            U = cand_U[sel]
        last_rank = int(np.argmax(start)) if p else 0
        total = float(start[last_rank]) if p else 0.0
        feats = F[last_rank] if p else np.zeros(K)
        parts = {k: float(v) for k, v in zip(HOST_TERMS, feats * th)}
        sharing = max(0.0, float(feats @ th - U[last_rank] @ th)) if p else 0.0
        lat_t = sum(parts[k] for k in _LATENCY_TERMS)
        bw_t = sum(parts[k] for k in _BANDWIDTH_TERMS + _MEMORY_TERMS)
        terms = Terms(lat_t, bw_t, parts["gamma"])
        rank_terms = np.stack([F[:, [HOST_TERMS.index(k) for k in _LATENCY_TERMS]] @
                               th[[HOST_TERMS.index(k) for k in _LATENCY_TERMS]],
                               F[:, [HOST_TERMS.index(k) for k in _BANDWIDTH_TERMS + _MEMORY_TERMS]] @
                               th[[HOST_TERMS.index(k) for k in _BANDWIDTH_TERMS + _MEMORY_TERMS]],
                               F[:, HOST_TERMS.index("gamma")] * m.gamma], axis=1)
        return SimResult(total, start, terms, rank_terms,
                         {"intra": int(round(bytes_total)), "inter": 0},
                         {"intra": int(msgs_total), "inter": 0}, None, None, nrounds,
                         parts, {k: float(v) for k, v in zip(HOST_TERMS, feats)}, sharing)


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
