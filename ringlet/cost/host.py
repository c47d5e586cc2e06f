"""The calibrated model of one host (:class:`HostModel`): the named terms ``ringlet
calibrate`` fits and ``simulate`` prices with. docs/design.md ("The host model") is its
specification."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..transport import limits, shm
from .model import Link


#: the named terms of :class:`HostModel`, in the order of its feature vectors
HOST_TERMS = ("alpha", "alpha_fast", "alpha_fast_call", "alpha_hop", "alpha_rdv", "alpha_crowd",
              "alpha_call", "alpha_array", "alpha_large", "alpha_crowd_call", "beta", "gamma", "delta", "mem_l2", "mem_l3",
              "beta_share", "beta_crowd", "beta_lag", "beta_cma")
_LATENCY_TERMS = ("alpha", "alpha_fast", "alpha_fast_call", "alpha_hop", "alpha_rdv",
                  "alpha_crowd", "alpha_call", "alpha_array", "alpha_large", "alpha_crowd_call")
_BANDWIDTH_TERMS = ("beta", "delta", "beta_share", "beta_crowd", "beta_lag", "beta_cma")
_MEMORY_TERMS = ("mem_l2", "mem_l3")


@dataclass(frozen=True)
class HostModel:
    """How the ranks of ONE host spend time on a schedule, as named terms (seconds per
    message, or per byte) that ``ringlet calibrate`` fits to timings: every rank is a
    single thread doing all the work of its own messages (copying IS the transfer), and
    the ranks share the host's cores. docs/design.md ("The host model") defines each
    term and how sharing cores stretches a round; ``simulate`` prices with it."""
    alpha: float                  # CPU per message, each side (Python engine)
    beta: float                   # CPU per byte, each side (copy into / out of the ring)
    gamma: float = 0.0            # extra CPU per byte reduced (over a copy)
    delta: float = 0.0            # CPU per byte of a local copy
    alpha_fast: float = 0.0       # alpha for a call the C fast path runs
    alpha_fast_call: float = 0.0  # CPU per such call on each rank, before its first message
    alpha_hop: float = 0.0        # latency per message that takes no CPU
    alpha_rdv: float = 0.0        # latency of the RTS/CTS round trip (above ``rendezvous``)
    alpha_crowd: float = 0.0      # latency per message when ranks outnumber cores
    alpha_call: float = 0.0       # CPU per call the Python engine runs, each rank (the
                                  # work object, the plan walk, the wait), whatever its messages
    alpha_array: float = 0.0      # CPU per call for each user array beyond the first, each
                                  # rank (binding, checks, the overlap test of in and out)
    alpha_large: float = 0.0      # CPU per message above ``eager`` bytes, each side, over
                                  # alpha (its fragments' headers and waits, or CMA's pinning)
    alpha_crowd_call: float = 0.0  # latency per call for each rank beyond the cores: every
                                   # rank must be scheduled in before the call can end
    mem_l2: float = 0.0           # CPU per byte streamed past the L2 caches
    mem_l3: float = 0.0           # ... past the L3
    beta_share: float = 0.0       # CPU per byte per busy rank beyond the cores
    beta_crowd: float = 0.0       # CPU per byte moved when ranks outnumber cores
    beta_lag: float = 0.0         # delay per byte a one-way stream trails its slower side
    beta_cma: float = 0.0         # extra CPU per byte the receiver reads by cross-memory
                                  # attach (the kernel's copy), over a copy (beta)
    idle_share: float = 0.5       # share of a core an idle rank still takes
    imbalance: float = 0.0        # 1: a round runs at the pace of its most crowded core
    l2_bytes: int = 1 << 20
    l3_bytes: int = 32 << 20
    cores: int = 1
    eager: int = shm.EAGER_BYTES
    rendezvous: int = shm.STREAM_BYTES
    ring_bytes: int = shm.RING_BYTES
    # a larger message from a buffer in shared memory (rl.empty) is read in place by its
    # receiver; -1: this transport never does that
    zero_copy_min: int = shm.ZERO_COPY_MIN
    # ... where its sender does not receive in the round, only above this (limits.py)
    zero_copy_oneway_min: int = shm.ZERO_COPY_ONEWAY_MIN
    # a larger message from a plain buffer is read by its receiver with cross-memory
    # attach (transport/cma.py) - in a round where the sender receives too, into a receive
    # that copies (not one that reduces); -1: never (limits.facts says where it is on)
    cma_min: int = -1
    # a larger one-way message from a plain buffer is split by CMA where ranks do not
    # outnumber cores: the sender writes its first half into the receive buffer while the
    # receiver reads the rest (limits.facts, cma.py; simulate._put_split); -1: never
    cma_put_min: int = -1
    # a larger one-way message read in place into an rl.empty destination is copied by
    # both its ends at once, where ranks do not outnumber cores (transport/split.py); -1:
    # never
    split_min: int = -1
    # ... and one its receiver reduces, from this many bytes (limits.SPLIT_REDUCE_MIN)
    split_reduce_min: int = -1
    # a call whose messages have at most this many bytes (EAGER packets) runs in C
    # (alpha_fast, not alpha); 0: none does (no fast path, or a profile fitted before
    # there was one)
    fast_bytes: int = 0
    # a message of more bytes (up to ``eager``) goes as EAGER packets of this many, one
    # copied out while the next is copied in (limits.pieces); 0: whole
    piece: int = limits.SHM_PIECE_BYTES

    def __post_init__(self):
        for name in HOST_TERMS:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise ValueError(f"HostModel {name} must be a finite number >= 0, got {v!r}")
        for name in ("l2_bytes", "l3_bytes", "cores", "ring_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"HostModel {name} must be >= 1")
        if not 0.0 <= self.idle_share <= 1.0:
            raise ValueError("HostModel idle_share must be between 0 and 1")
        if not 0.0 <= self.imbalance <= 1.0:
            raise ValueError("HostModel imbalance must be between 0 and 1")
        if self.eager < 0 or self.rendezvous < 0 or self.fast_bytes < 0:
            raise ValueError("HostModel eager, rendezvous and fast_bytes must be >= 0 bytes")

    @property
    def theta(self) -> np.ndarray:
        return np.array([float(getattr(self, k)) for k in HOST_TERMS])

    @property
    def link(self) -> Link:
        """The plain alpha-beta link closest to this model (closed forms, other hosts): one
        message between two otherwise idle ranks costs 2 alpha + alpha_hop (both sides'
        work, the hop) up to the rendezvous limit, alpha_rdv more above it (the round trip
        before the data may go), and 2 beta per byte."""
        eager = 2 * self.alpha + self.alpha_hop
        limit = max(self.eager, self.rendezvous)
        return Link(eager + self.alpha_rdv, 1 / (2 * self.beta) if self.beta > 0 else 1e300,
                    "host", eager, limit)

    @classmethod
    def from_params(cls, params: dict) -> "HostModel":
        keys = set(HOST_TERMS) | {"l2_bytes", "l3_bytes", "cores", "eager", "rendezvous",
                                  "ring_bytes", "zero_copy_min", "zero_copy_oneway_min",
                                  "cma_min", "cma_put_min", "split_min", "split_reduce_min",
                                  "fast_bytes", "piece", "idle_share", "imbalance"}
        kw = {k: params[k] for k in keys if k in params}
        for k in ("l2_bytes", "l3_bytes", "cores", "eager", "rendezvous", "ring_bytes",
                  "zero_copy_min", "zero_copy_oneway_min", "cma_min", "cma_put_min",
                  "split_min", "split_reduce_min", "fast_bytes", "piece"):
            if k in kw:
                kw[k] = int(kw[k])
        return cls(**kw)

    def with_theta(self, theta) -> "HostModel":
        return replace(self, **{k: float(max(v, 0.0)) for k, v in zip(HOST_TERMS, theta)})

    def __str__(self) -> str:
        fast = (f" ({self.alpha_fast * 1e6:.3g} us, and {self.alpha_fast_call * 1e6:.3g} us per "
                f"call, in calls of messages <= {self.fast_bytes} B)" if self.fast_bytes else "")
        return (f"host model: alpha {self.alpha * 1e6:.3g} us per side{fast} + "
                f"{self.alpha_hop * 1e6:.3g} us per hop + rendezvous "
                f"{self.alpha_rdv * 1e6:.3g} us (+{self.alpha_crowd * 1e6:.3g} us when crowded); "
                f"beta {self.beta:.3g} s/B per side, gamma {self.gamma:.3g}, delta {self.delta:.3g}; "
                f"memory +{self.mem_l2:.3g} (past L2) +{self.mem_l3:.3g} (past L3) s/B; "
                f"{self.cores} cores, +{self.beta_share:.3g} s/B per extra rank per core, "
                f"+{self.beta_crowd:.3g} s/B when crowded; one-way streams trail "
                f"{self.beta_lag:.3g} s/B; "
                f"idle ranks take {self.idle_share:g} core")


@dataclass(frozen=True)
class Machine:
    """The cores that the ranks of several hosts share: emulated hosts (network
    namespaces) or containers on one machine. Each round of a schedule must then also fit
    in the machine's CPU: its work (seconds of CPU per byte of each kind, summed over every
    rank) spread over ``cores``. On a cluster each host has its own cores and no Machine
    applies. ``bench/hosts.py`` measures ``inter`` on the emulated link through ringlet's
    own TCP transport (both ends' CPU, the kernel's TCP and the veth between, as the ranks'
    processes are charged: :func:`link_cpu`); the others come from the host model."""
    cores: int
    inter: float          # CPU s per byte of a message between hosts (both ends, the kernel)
    intra: float = 0.0    # ... of a message inside a host (both ends' copies)
    reduce: float = 0.0   # ... per byte reduced (over the copy)
    copy: float = 0.0     # ... per byte of a local copy
    message: float = 0.0  # CPU s per message (both ends' engines)
    # ... more per message above one EAGER packet of ``large_min`` bytes (fragments through
    # the ring or a whole read: HostModel's alpha_large, both ends)
    large: float = 0.0
    large_min: int = 1 << 62
    crowd: float = 0.0    # ... more per message when ranks outnumber the cores (wake-ups)
    # the cores the job's ranks get: fewer than ``cores`` while other processes load the
    # machine (measured beside the link: bench/hosts.py); 0: all of them
    available: float = 0.0
    # latency per message when the ranks outnumber the cores (the receiver or the sender is
    # not running when its peer is ready: a wake-up, as HostModel's alpha_crowd), inside a
    # host (shm's) and between hosts (tcp's, calibrated with more ranks than cores)
    lat_intra: float = 0.0
    lat_inter: float = 0.0
    # latency per call for each rank beyond the cores (HostModel's alpha_crowd_call: it
    # waits to be scheduled in, once per call whatever its rounds)
    lat_call: float = 0.0
    # seconds a waiting rank polls (yields) before it sleeps when the ranks outnumber the
    # cores: the engine's (RINGLET_YIELD_US); runnable meanwhile, it takes its share of
    # the cores from the ranks that work (simulate._Sim._machine_bound)
    poll: float = field(default_factory=lambda: _yield_crowded())

    def __post_init__(self):
        if int(self.cores) < 1:
            raise ValueError(f"Machine cores must be >= 1, got {self.cores!r}")
        if not 0 <= self.available <= self.cores:
            raise ValueError(f"Machine available must be between 0 and its {self.cores} "
                             f"cores, got {self.available!r}")
        for name in ("inter", "intra", "reduce", "copy", "message", "large", "crowd",
                     "lat_intra", "lat_inter", "lat_call", "poll"):
            v = getattr(self, name)
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"Machine {name} must be a finite number >= 0, got {v!r}")

    @property
    def capacity(self) -> float:
        """Cores' worth of CPU a round's work is spread over."""
        return self.available or float(self.cores)

    @classmethod
    def of(cls, cores: int, inter: float, model: "HostModel | None",
           available: float = 0.0, link: "HostModel | None" = None) -> "Machine":
        """The machine whose hosts' ranks ``model`` prices (its per-byte work past the
        caches: the large messages where the cores, not the latency, bind) and whose
        messages between hosts ``link`` prices (the tcp host model: its wake-up latency
        when the ranks outnumber the cores)."""
        lat_inter = link.alpha_crowd if link is not None else 0.0
        # the per-call wait of crowded ranks: the link's where given (a call across hosts
        # runs in the Python engine, as tcp's calibration does), else the host's
        lat_call = (link or model).alpha_crowd_call if (link or model) is not None else 0.0
        if model is None:
            return cls(cores, inter, available=available, lat_inter=lat_inter,
                       lat_call=lat_call)
        side = model.beta + model.mem_l2 + model.mem_l3
        return cls(cores, inter, 2 * side, model.gamma + model.mem_l2 + model.mem_l3,
                   model.delta + model.mem_l2 + model.mem_l3, 2 * model.alpha,
                   2 * model.alpha_large, int(model.eager), 2 * model.alpha_crowd,
                   available, model.alpha_crowd, lat_inter, lat_call)


def _yield_crowded() -> float:
    from ..transport.engine import YIELD_CROWDED
    return YIELD_CROWDED


def link_cpu(samples) -> tuple[float, float]:
    """(CPU seconds per byte, CPU seconds per call) of moving bytes between hosts, from
    ``samples`` of (bytes carried, CPU seconds of every process taking part): a line
    through each size's least CPU, so a call's fixed work (waking up, the protocol's
    packets) is not read as work per byte. The least, not the median: on a busy machine
    other processes' kernel work (their packets' softirqs) is charged to whoever runs, and
    that only ever adds. With one size, or a line that falls with size (noise), the
    largest size's least CPU per byte. :attr:`Machine.inter` is the first."""
    by: dict = {}
    for nbytes, cpu in samples:
        if not (nbytes > 0 and np.isfinite(cpu) and cpu >= 0):
            raise ValueError(f"link_cpu: a sample needs bytes > 0 and CPU >= 0 seconds, got "
                             f"{(nbytes, cpu)!r}")
        by.setdefault(float(nbytes), []).append(float(cpu))
    if not by:
        raise ValueError("link_cpu: no samples")
    x = np.array(sorted(by))
    y = np.array([min(by[n]) for n in x])
    if len(x) > 1:
        slope, fixed = np.polyfit(x, y, 1)
        if slope > 0:
            return float(slope), float(max(fixed, 0.0))
    return float(y[-1] / x[-1]), 0.0


__all__ = ["HostModel", "HOST_TERMS", "Machine", "link_cpu"]
