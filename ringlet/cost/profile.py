"""The calibrated profile of this host, and the least-squares fit that produces it.

File: ``$RINGLET_PROFILE`` if set, else ``$XDG_CACHE_HOME/ringlet/profile.json`` (or
``~/.cache/ringlet/profile.json``). Format (JSON)::

    {
      "version": 1,
      "host": "node17",                      # informational
      "created": "2025-01-01T12:00:00Z",     # informational
      "transports": {
        "shm": {"alpha": 1.9e-05,            # seconds per message
                "beta": 2.1e-10,             # seconds per byte moved
                "gamma": 9.0e-11,            # seconds per byte reduced
                "delta": 0.0,                # seconds per byte of a local copy (optional)
                "samples": 48,               # how many timings were fitted (optional)
                "residuals": {"rms": 3e-06, "median_rel": 0.04, "max_rel": 0.2}},
        "tcp": {...}
      }
    }

Extra keys are kept and ignored. Without a file, :data:`DEFAULT_PROFILE` is used: the host
model as fitted on another machine, on this machine's cores and caches (``source ==
"default"``); run ``ringlet calibrate`` to replace it with this host's own.

:func:`fit` turns timings of small experiments into ``alpha``, ``beta`` and ``gamma`` by
(non-negative, relative) least squares; ``ringlet calibrate`` measures the samples with
the runtime and saves ``Profile.from_fits(...)``.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import socket
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..transport import fast, limits
from .model import Link, parse_size

PROFILE_VERSION = 1

#: used when no calibrated profile exists. Shared memory is priced with the host model
#: (cost/host.py) at the terms ``ringlet calibrate`` fitted on a 2-core VM (Intel Xeon,
#: Sapphire Rapids class, 2026-12-06 02:12, quiet, 504 timings a transport, rounded):
#: what ringlet's own transport costs per message in C and in Python, per byte copied,
#: reduced and copied locally, past the caches and on shared cores; TCP likewise, between
#: local ranks over the loopback (between hosts the network sets its price: calibrate
#: there, or give the link's rate). The machine's cores and caches are this one's
#: (:func:`default_profile`), but for an L3 larger than the fit's: its memory terms hold
#: past the L3 they were fitted with (64 MiB of the 480 MiB sysfs reported there, where the
#: VM shares its L3 with other tenants). A plain alpha-beta entry here priced a local copy
#: at nothing and every message at 20 us: an uncalibrated scatter of 8 MiB at p = 4 then picked
#: dissemination (a tree that copies 14 MiB along its critical path) over direct (5), and
#: ran 2.5-3x slower. The fit before this one (an AMD EPYC VM, 2026-12-02) priced this VM's
#: calls 20-60% short: median error 26.2% on an accuracy grid here, against 14.4% for this
#: one and 14.2% for the calibration itself (docs/results.md, "The default profile, fitted
#: on the Intel VM").
DEFAULT_PROFILE: dict = {
    "version": PROFILE_VERSION,
    "host": "",
    "created": "",
    "transports": {
        "shm": {"model": "host",
                "alpha": 43e-6, "alpha_fast": 0.49e-6, "alpha_fast_call": 0.95e-6,
                "alpha_call": 0.0, "alpha_array": 0.43e-6, "alpha_large": 12e-6,
                "alpha_hop": 0.082e-6, "alpha_rdv": 20e-6, "alpha_crowd": 0.21e-6,
                "alpha_crowd_call": 0.0,
                "beta": 45e-12, "gamma": 0.66e-12, "delta": 34e-12,
                "mem_l2": 40e-12, "mem_l3": 35e-12, "beta_share": 9.9e-12,
                "beta_crowd": 0.0, "beta_lag": 7.2e-12, "beta_cma": 29e-12,
                "idle_share": 0.25, "imbalance": 1.0, "l3_bytes": 64 << 20},
        "tcp": {"model": "host",
                "alpha": 10e-6, "alpha_fast": 0.0, "alpha_fast_call": 0.0,
                "alpha_call": 8.9e-6, "alpha_array": 10e-6, "alpha_large": 15e-6,
                "alpha_hop": 0.0, "alpha_rdv": 7.7e-6, "alpha_crowd": 14e-6,
                "alpha_crowd_call": 53e-6,
                "beta": 128e-12, "gamma": 0.0, "delta": 31e-12,
                "mem_l2": 57e-12, "mem_l3": 24e-12, "beta_share": 49e-12,
                "beta_crowd": 70e-12, "beta_lag": 5.8e-12, "beta_cma": 0.0,
                "idle_share": 0.25, "imbalance": 1.0, "l3_bytes": 64 << 20},
    },
}


#: What reducing a 16-bit float costs over float32, in seconds per byte a rank reduces: C's
#: kernels add float16 (F16C) and bfloat16 (AVX-512, else AVX2) in float32 and round back,
#: bfloat16's with ~14 instructions for 16 elements where float32's add is one. Measured in
#: the calls (bench/half_gamma.py: ring all_reduce and reduce_scatter p = 2 of 1, 4 and 8 MiB,
#: each dtype in blocks taken in turn, fresh inputs; 2-core Intel Xeon VM, 2026-12-06, two
#: runs): float16 -6 to 49 ps/B (median 18), bfloat16 92 to 292 (median 155) - on warm
#: arrays in cache bfloat16's extra is ~43. A transport's entry may carry its own
#: ("gamma_float16", "gamma_bfloat16"); calibrate does not time them.
HALF_GAMMA = {"float16": 18e-12, "bfloat16": 155e-12}


def half_float(dtype) -> str | None:
    """"float16" or "bfloat16" for those dtypes (their reductions cost more), else None."""
    from ..ops import BFLOAT16, dtype_named
    try:
        d = dtype_named(dtype)
    except TypeError:
        return None
    return "bfloat16" if d == BFLOAT16 else "float16" if d == np.float16 else None


#: payload share of a TCP/IPv4 link's bytes at MTU 1500: 1448 of every 1514 bytes framed
#: (IP and TCP headers with timestamps, the Ethernet header) - what shapers and NICs count
TCP_GOODPUT = 1448 / 1514

_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8}


def parse_rate(text) -> float:
    """Bytes per second from a link rate as ``tc`` writes it: ``"1gbit"``, ``"10gbit"``,
    ``"500mbit"`` (a number alone is bytes per second)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        rate = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if unit not in _RATE_UNITS and unit != "":
            raise ValueError(f"cannot read link rate {text!r}; use e.g. 1gbit, 10gbit, 500mbit")
        rate = float(m.group(1)) * _RATE_UNITS.get(unit, 1)
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"link rate must be > 0, got {text!r}")
    return rate


def profile_path() -> Path:
    """Where the profile lives: $RINGLET_PROFILE, else the user cache directory."""
    env = os.environ.get("RINGLET_PROFILE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ringlet" / "profile.json"


@dataclass
class Profile:
    """Per-transport alpha/beta/gamma; ``source`` is the file it came from or "default"."""
    transports: dict = field(default_factory=dict)
    source: str = "default"
    host: str = ""
    created: str = ""
    extra: dict = field(default_factory=dict)
    _models: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __repr__(self) -> str:     # (the timings a profile keeps for refits run to 100s of KB)
        def kind(t: dict) -> str:
            timed = f", {len(t['timings'])} timings" if "timings" in t else ""
            if t.get("model") == "host":
                return f"host model{timed}"
            return f"alpha {float(t['alpha']) * 1e6:.3g} us, beta {float(t['beta']):.3g} s/B{timed}"
        transports = "; ".join(f"{name}: {kind(t)}" for name, t in self.transports.items())
        return (f"Profile(source={self.source!r}, host={self.host!r}, created={self.created!r}, "
                f"transports: {transports or 'none'})")

    @property
    def calibrated(self) -> bool:
        return not self.source.startswith("default")

    def params(self, transport: str = "shm") -> dict:
        if transport == "inter" and "inter" not in self.transports:
            transport = "tcp"      # no inter-host link known: TCP as calibrated here
        if transport not in self.transports:
            raise ValueError(f"profile has no transport {transport!r}; it has: "
                             f"{', '.join(self.transports) or 'none'}")
        return self.transports[transport]

    def link(self, transport: str = "shm") -> Link:
        """The transport as a plain alpha-beta link (closed forms, other hosts); "inter" is
        the link between hosts (:meth:`with_link_rate`; else "tcp"). For a host
        model that is the cost of one message between two otherwise idle ranks
        (:attr:`HostModel.link`): both sides' overhead, plus the rendezvous above the
        transport's limit; beta = 2*beta (the sender's copy and the receiver's)."""
        t = self.params(transport)
        if "rate" in t:
            return Link.from_beta(float(t["alpha"]), float(t["beta"]),
                                  f"inter-host link ({float(t['rate']) * 8 / 1e9:g} Gbit/s)",
                                  t.get("alpha_eager"), int(t.get("eager", -1)))
        if transport not in self.transports:   # "inter" with no link given: tcp's
            transport = "tcp"
        label = f"{transport} ({'calibrated' if self.calibrated else 'default'})"
        if t.get("model") == "host":
            return self.host_model(transport).link.with_name(label)
        return Link.from_beta(float(t["alpha"]), float(t["beta"]), name=label)

    def with_link_rate(self, rate, shared: float = 1.0, payload=None, machine=None) -> "Profile":
        """This profile with hosts joined by a link of ``rate`` (bytes/s, or tc's form:
        "1gbit"): TCP as calibrated here, but never faster per byte than the link's payload
        rate (``payload`` bytes/s as measured, else TCP_GOODPUT of its rate); ``shared``:
        the fraction of that rate several flows sharing the link reach together (see
        ``Topology.shared``). The per-message cost stays TCP's. ``machine``: (cores, CPU
        seconds per byte between hosts[, the cores the job gets of them]) when the hosts
        share one machine's cores (emulated hosts; see :meth:`machine`)."""
        rate = parse_rate(rate)
        if not 0 < shared <= 1:
            raise ValueError(f"shared must be in (0, 1], got {shared!r}")
        tcp = self.link("tcp")
        wire = payload if payload else rate * TCP_GOODPUT
        inter = {"alpha": tcp.alpha, "beta": max(tcp.beta, 1 / wire),
                 "gamma": self.gamma("tcp"), "rate": rate, "shared": float(shared)}
        if tcp.alpha_eager is not None:     # TCP's small messages go without a rendezvous
            inter.update(alpha_eager=tcp.alpha_eager, eager=tcp.eager)
        if machine is not None:
            inter.update(cores=int(machine[0]), cpu=float(machine[1]))
            if len(machine) > 2 and machine[2]:
                inter.update(available=float(machine[2]))
        return Profile({**copy.deepcopy(self.transports), "inter": inter},
                       f"{self.source} + link {rate * 8 / 1e9:g} Gbit/s", self.host,
                       self.created, dict(self.extra))

    def machine(self):
        """The :class:`ringlet.cost.host.Machine` whose cores every host shares, when the
        inter-host link was measured between hosts on one machine; else None."""
        t = self.params("inter") if "inter" in self.transports else {}
        if "cores" not in t:
            return None
        from .host import Machine
        return Machine.of(int(t["cores"]), float(t["cpu"]), self.host_model("shm"),
                          float(t.get("available", 0.0)), self.host_model("tcp"))

    def shared(self) -> float:
        """Of the inter-host link's rate, what several flows sharing it reach together."""
        return float(self.params("inter").get("shared", 1.0))

    def gamma(self, transport: str = "shm") -> float:
        return float(self.params(transport).get("gamma", 0.0))

    def delta(self, transport: str = "shm") -> float:
        return float(self.params(transport).get("delta", 0.0))

    def reduce_gamma(self, dtype, transport: str = "shm") -> float | None:
        """Seconds per byte a reduction of ``dtype`` costs on ``transport``: the profile's
        gamma plus, for float16 and bfloat16, what theirs costs over float32's (the entry's
        "gamma_float16" / "gamma_bfloat16", else :data:`HALF_GAMMA`); None for other dtypes,
        which the profile's gamma prices as it is."""
        kind = half_float(dtype)
        if kind is None:
            return None
        extra = self.params(transport).get(f"gamma_{kind}", HALF_GAMMA[kind])
        return self.gamma(transport) + float(extra)

    def point_to_point(self) -> "Profile":
        """This profile as a point-to-point message meets it: the limits a send keeps
        (``p2p_zero_copy_min``, ``p2p_cma_min`` of :func:`ringlet.transport.limits.facts`:
        up to them a blocking send completes without its receiver, so it streams where a
        collective's message would be read in place or by CMA) and whole messages (a
        collective's one-way message of several pieces goes as that many packets). Priced
        with the collectives' limits, a 256 KiB send came out 58% short (41% with these:
        bench/p2p_price.py, docs/results.md). Kept on the profile: asked once per call
        priced."""
        hit = self._models.get("point-to-point")
        if hit is None:
            transports = copy.deepcopy(self.transports)
            for name, t in transports.items():
                if t.get("model") != "host":
                    continue
                known = {**limits.facts(fast.enabled()).get(name, {}), **t}
                zc, cma = int(known.get("p2p_zero_copy_min", -1)), int(known.get("p2p_cma_min", -1))
                t.update(piece=0, zero_copy_min=zc, zero_copy_oneway_min=zc, cma_min=cma,
                         cma_put_min=cma)
            hit = self._models["point-to-point"] = Profile(
                transports, self.source, self.host, self.created, dict(self.extra))
        return hit

    def host_model(self, transport: str = "shm"):
        """The transport's :class:`ringlet.cost.host.HostModel` (how ranks of one host
        spend time: per-side work, rendezvous, wake-ups, memory hierarchy, shared cores),
        or None for a plain alpha-beta-gamma entry (``"model": "host"`` marks one)."""
        t = self.transports.get(transport)
        if t is None or t.get("model") != "host":
            return None
        hit = self._models.get(transport)
        if hit is None:
            from .host import HostModel
            # what the transport does and an older profile did not record: as it does now,
            # except the rendezvous limit: its alpha_rdv was fitted when every message
            # above the eager limit waited for CTS (stale_reasons says so)
            params = {**limits.facts(fast.enabled()).get(transport, {}), **t}
            if "rendezvous" not in t and "eager" in params:
                params["rendezvous"] = params["eager"]
            # ... and the fast path: as the profile was fitted (an older one: every call in
            # Python), not as this process runs - a rank with RINGLET_NO_FASTPATH must
            # still price (and pick algorithms) as the other ranks do
            params["fast_bytes"] = int(t.get("fast_bytes", 0))
            hit = self._models[transport] = HostModel.from_params(params)
        return hit

    # -- (de)serialisation ----------------------------------------------------------
    def to_dict(self) -> dict:
        d = dict(self.extra)
        d.update(version=PROFILE_VERSION, host=self.host, created=self.created,
                 transports=copy.deepcopy(self.transports))
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "dict") -> "Profile":
        if not isinstance(d, dict) or not isinstance(d.get("transports"), dict):
            raise ValueError(f"{source}: not a ringlet profile (no 'transports' object)")
        transports = {}
        for name, t in d["transports"].items():
            if not isinstance(t, dict):
                raise ValueError(f"{source}: transport {name!r} is not an object")
            for key in ("alpha", "beta"):
                v = t.get(key)
                if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"{source}: transport {name!r} needs a number {key} >= 0")
            if t["beta"] <= 0:
                raise ValueError(f"{source}: transport {name!r} needs beta > 0")
            for key in ("gamma", "delta", "alpha_fast", "alpha_fast_call", "alpha_hop",
                        "alpha_call", "alpha_array", "alpha_large", "alpha_crowd_call",
                        "alpha_rdv", "alpha_crowd", "mem_l2", "mem_l3", "beta_share",
                        "beta_crowd", "beta_lag", "beta_cma", "idle_share",
                        "gamma_float16", "gamma_bfloat16"):
                v = t.get(key, 0.0)
                if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"{source}: transport {name!r}: {key} must be a number >= 0")
            if t.get("model") == "host":
                from .host import HostModel
                try:
                    HostModel.from_params(t)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{source}: transport {name!r}: bad host model: {exc}") from None
            transports[name] = dict(t)
        extra = {k: v for k, v in d.items() if k not in ("version", "host", "created", "transports")}
        return cls(transports, source, str(d.get("host", "")), str(d.get("created", "")), extra)

    def save(self, path=None) -> Path:
        path = Path(path) if path is not None else profile_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
        _CACHE.clear()
        return path

    @classmethod
    def from_fits(cls, fits: dict, **extra) -> "Profile":
        """A profile from ``{transport: fit(samples)}``, stamped with host and time."""
        return cls({k: dict(v) for k, v in fits.items()}, source="fitted",
                   host=socket.gethostname(),
                   created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), extra=extra)


def default_profile(cpus=None) -> Profile:
    """:data:`DEFAULT_PROFILE` on this machine: the cores ``cpus`` (default: those this
    process may use; a job passes all its ranks' on this host, as mpirun binds each rank to
    one) and the cache sizes sysfs reports for them (:func:`machine`), and the transports'
    limits and fast path as this ringlet has them - what a calibration here would record
    beside its fit. An L3 larger than the one the terms were fitted with counts as that one
    (a VM's sysfs may report the whole socket's, shared with other tenants: priced with
    the 480 MiB one reported here, 64 MiB calls came out 30% short). The machine is read
    once a process per set of cores (sysfs: a file per cache and core, at every init)."""
    key = ("default dict", None if cpus is None else tuple(sorted(set(cpus))))
    d = _CACHE.get(key)
    if d is None:
        d = copy.deepcopy(DEFAULT_PROFILE)
        here, facts = machine(key[1]), limits.facts(fast.enabled())
        for name, t in d["transports"].items():
            fitted_l3 = t.get("l3_bytes")
            t.update(here, **facts[name])
            if fitted_l3:
                t["l3_bytes"] = min(t["l3_bytes"], fitted_l3)
        _CACHE[key] = d
    return Profile.from_dict(d, source="default")


_CACHE: dict = {}


def load_profile(path=None, *, strict: bool = False) -> Profile:
    """The calibrated profile (cached; re-read when the file changes), or
    :func:`default_profile` when there is none. A file that cannot be read falls back to
    the default too, unless ``strict``, where it raises ValueError."""
    path = Path(path) if path is not None else profile_path()
    try:
        stat = path.stat()
    except OSError:
        if strict:
            raise ValueError(f"no ringlet profile at {path}; run `ringlet calibrate`") from None
        return _default_cached()
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    hit = _CACHE.get("file")
    if hit is not None and hit[0] == key:
        return hit[1]
    try:
        prof = Profile.from_dict(json.loads(path.read_text()), source=str(path))
    except (OSError, ValueError) as exc:
        if strict:
            raise ValueError(f"cannot read ringlet profile {path}: {exc}") from None
        if _CACHE.get("unreadable") != key:   # (said once per state of the file)
            _CACHE["unreadable"] = key
            warnings.warn(f"cannot read ringlet profile {path} ({exc}): pricing with the "
                          f"default profile; rerun `ringlet calibrate`", stacklevel=2)
        return _default_cached()
    _CACHE["file"] = (key, prof)
    for why in stale_reasons(prof):
        warnings.warn(f"ringlet profile {path}: {why}; rerun `ringlet calibrate`", stacklevel=2)
    return prof


def stale_reasons(prof: Profile) -> list:
    """What differs between the transports a profile was calibrated with and the ones this
    ringlet runs (a fitted rendezvous latency means little once the eager limit moved)."""
    out = []
    for name, facts in limits.facts(fast.enabled()).items():
        t = prof.transports.get(name, {})
        if t.get("model") != "host":
            continue
        for key, now in facts.items():
            # (fast_bytes differs where the fast path is off or not built: the profile's
            # alpha still prices the calls that run in Python)
            if key in t and key != "fast_bytes" and int(t[key]) != int(now):
                out.append(f"{name} was calibrated with {key} = {int(t[key])} bytes, "
                           f"this ringlet uses {int(now)}")
        eager = int(t.get("eager", facts["eager"]))
        if "rendezvous" not in t and int(facts["rendezvous"]) > eager:
            out.append(f"{name} was calibrated when every message over {eager} bytes waited "
                       f"for CTS; this ringlet streams up to {int(facts['rendezvous'])} bytes "
                       f"at once")
        if "alpha_call" not in t:
            out.append(f"{name} was fitted before the host model priced a call's fixed "
                       f"costs (alpha_call, alpha_array, alpha_large, alpha_crowd_call; "
                       f"`ringlet calibrate --refit` fits its saved timings again)")
        if int(t.get("fast_bytes", 0)) < int(facts["fast_bytes"]):
            out.append(f"{name} was calibrated before (or without) calls of messages up to "
                       f"{int(facts['fast_bytes'])} bytes running in C")
    return out


def _default_cached() -> Profile:
    prof = _CACHE.get("default")
    if prof is None:
        prof = _CACHE["default"] = default_profile()
    return prof


def host_link(transport: str = "shm", profile: Profile | None = None) -> Link:
    """This host's calibrated link for ``transport`` ("shm" inside a host, "tcp" across)."""
    return (profile or load_profile()).link(transport)


# ---------------------------------------------------------------------------- fitting

_PARAMS = ("alpha", "beta", "gamma", "delta")


def fit(samples, relative: bool = True, robust: bool = True) -> dict:
    """Fit ``seconds ~ alpha*messages + beta*bytes + gamma*reduce_bytes [+ delta*copy_bytes]``.

    ``samples``: iterable of ``(n_messages, bytes, reduce_bytes, seconds)`` tuples (or
    dicts with those keys, and optionally ``copy_bytes``: bytes of local copies) - one
    timed experiment each, counted on its critical path. delta is fitted only when some
    sample has copy bytes (it is 0 otherwise).
    Non-negative least squares (exact, by trying every subset of the parameters),
    weighted by 1/seconds when ``relative`` so small and large experiments count alike.
    With ``robust``, samples the first fit misses by more than max(50%, 3x the median
    relative error) - at most a quarter of them - are set aside as outliers (a noisy host
    stalls now and then) and the fit is redone without them.
    Returns ``{"alpha", "beta", "gamma", "delta", "samples", "outliers": [indices], "residuals":
    {"rms", "median_rel", "max_rel"}}`` (residuals over the samples kept), ready to be a
    profile's transport entry. A parameter the samples do not exercise comes out 0.
    Samples timed with rl.empty buffers (``shared``) are left out: the plain model has no
    message read in place."""
    rows = []
    for s in samples:
        if isinstance(s, dict):
            if s.get("shared"):    # read in place: the plain model has no such message
                continue
            s = (s["n_messages"], s["bytes"], s.get("reduce_bytes", 0), s["seconds"],
                 s.get("copy_bytes", 0))
        if len(s) == 4:
            s = (*s, 0)
        m, b, r, t, c = (float(x) for x in s)
        if min(m, b, r, c) < 0 or not t > 0:
            raise ValueError(f"bad calibration sample {s!r}: counts must be >= 0 and seconds > 0")
        rows.append((m, b, r, c, t))
    if len(rows) < 2:
        raise ValueError("fit needs at least two samples")
    X = np.array([r[:4] for r in rows])
    y = np.array([r[4] for r in rows])
    keep = np.ones(len(y), bool)
    coef = _nnls(X, y, relative)
    outliers: list[int] = []
    if robust and len(y) >= 6:
        rel = np.abs(X @ coef - y) / y
        limit = max(0.5, 3 * float(np.median(rel)))
        worst = np.argsort(-rel)[: len(y) // 4]
        drop = [int(i) for i in worst if rel[i] > limit]
        if drop:
            keep[drop] = False
            outliers = sorted(drop)
            coef = _nnls(X[keep], y[keep], relative)
    pred = X[keep] @ coef
    yk = y[keep]
    rel = np.abs(pred - yk) / yk
    out = {name: float(v) for name, v in zip(_PARAMS, coef)}
    if out["beta"] <= 0:
        out["beta"] = 1e-15  # no bandwidth signal in the samples; keep the link valid
    out["samples"] = len(rows)
    out["outliers"] = outliers
    out["residuals"] = {"rms": float(np.sqrt(np.mean((pred - yk) ** 2))),
                        "median_rel": float(np.median(rel)), "max_rel": float(np.max(rel))}
    return out


#: where fit_host starts the host model's terms (seconds per message, per byte)
FIT_START = dict(alpha=5e-6, alpha_fast=1e-6, alpha_fast_call=2e-6, alpha_call=1e-5,
                 alpha_array=2e-6, alpha_large=2e-5, alpha_crowd_call=1e-5, alpha_hop=2e-6,
                 alpha_rdv=1e-5, alpha_crowd=1e-5, beta=5e-11, gamma=3e-11, delta=3e-11,
                 mem_l2=3e-11, mem_l3=3e-11, beta_share=1e-11, beta_crowd=1e-11, beta_lag=1e-11,
                 beta_cma=1e-11)


def fit_host(samples, base=None, relative: bool = True, robust: bool = True,
             iterations: int = 12, terms=None, idle_shares=(0.0, 0.25, 0.5, 0.75, 1.0),
             imbalances=(0.0, 0.5, 1.0), fixed: dict | None = None,
             l3_fractions=(1.0,), starts=(1.0, 0.3, 3.0), grid_iterations=None,
             l3_floor: int = 0) -> dict:
    """Fit a :class:`ringlet.cost.host.HostModel` to timed schedules.

    ``samples``: dicts with ``collective``, ``algorithm``, ``p``, ``nbytes`` and
    ``seconds`` (one timed call each; ``itemsize`` optional, default 4; ``shared``
    optional: the buffers that were rl.empty arrays, see ``simulate``). ``base``: a
    HostModel (or dict of its fields) giving the machine's ``cores``, cache sizes,
    ``eager`` and ``ring_bytes``, and the starting parameters. ``terms``: the names of
    the terms to fit (default all of ``HOST_TERMS``; the others are 0) - for ablations.
    ``fixed``: ``{term: value}`` measured some other way; held at that value, not fitted.

    The model is piecewise linear in its parameters: once the critical path of every
    schedule is fixed, a call's time is sum(theta_k * count_k) over the named terms
    (messages, rendezvous messages, bytes, ...), counts the simulator reports. So the
    fit alternates: simulate every sample with the current parameters to get its counts,
    solve the non-negative least squares (relative error) for the parameters, repeat
    until they settle; the best iterate (by the re-simulated log error) wins, over the
    starting points ``starts`` (the base terms scaled by each). The two non-linear parameters, ``idle_share`` (how much of a core a
    rank waiting for its turn still takes) and ``imbalance``, are chosen from
    ``idle_shares`` x ``imbalances`` by the same error (each pair tried from the best
    model so far, and from ``base`` too when there are several starts), and so is the L3 the job really
    has: ``l3_fractions`` of ``base.l3_bytes`` (on a virtual machine the L3 that sysfs
    reports is shared with other tenants), and with ``l3_floor`` also every power of two
    from it up to the smallest of those (a VM here reported 480 MiB, where no timing reaches
    past the L3 and its term fits to 0). ``grid_iterations``: fewer iterations for each
    of those tries (the best is then iterated ``iterations`` times again). With ``robust``, samples the
    first fit misses by more than max(50%, 3x the median) - at most a quarter - are set
    aside as outliers, as in :func:`fit`. Returns the profile entry: every
    parameter, ``"model": "host"``, ``samples``, ``outliers``, ``residuals``, and
    ``predicted`` (seconds, per sample)."""
    from dataclasses import replace

    base, names, held = _fit_start(base, terms, fixed)
    fit = _HostFit(samples, held, names, relative, iterations)
    y = fit.y
    keep = np.ones(len(y), bool)
    outliers: list[int] = []
    # several starts (the critical paths, hence the fixed point, depend on where we start)
    mid = replace(base, idle_share=float(np.median(idle_shares)),
                  imbalance=float(np.median(imbalances)))
    best = min((fit.alternate(mid.with_theta(mid.theta * f), keep) for f in starts),
               key=lambda b: b[0])
    if robust and len(y) >= 8:
        pred = best[2]
        rel = np.abs(pred - y) / y
        limit = max(0.5, 3 * float(np.median(rel)))
        worst = np.argsort(-rel)[: len(y) // 4]
        outliers = sorted(int(i) for i in worst if rel[i] > limit)
        keep[outliers] = False
        best = fit.alternate(best[1], keep)
    quick = _HostFit.__new__(_HostFit)
    quick.__dict__.update(fit.__dict__, iterations=grid_iterations or iterations)
    tried = best
    for share in idle_shares:
        for imb in imbalances:
            for start in (best[1], base) if len(starts) > 1 else (best[1],):
                got = quick.alternate(replace(start, idle_share=float(share),
                                              imbalance=float(imb)), keep)
                if got[0] < tried[0]:
                    tried = got
    for l3 in l3_candidates(base.l3_bytes, l3_fractions, l3_floor):
        if l3 != base.l3_bytes:
            got = quick.alternate(replace(tried[1], l3_bytes=l3), keep)
            if got[0] < tried[0]:
                tried = got
    if tried is not best:
        got = fit.alternate(tried[1], keep) if grid_iterations else tried
        best = got if got[0] < best[0] else best
    _, model, pred = best
    return _host_entry(model, pred, y, keep, outliers)


def l3_candidates(reported: int, fractions=(1.0,), floor: int = 0) -> list[int]:
    """The L3 sizes a host fit tries, largest first: ``fractions`` of the ``reported`` one,
    and each power of two from ``floor`` (0: none) below the smallest of those."""
    sizes = {max(1, int(reported * f)) for f in fractions}
    smallest, size = min(sizes), floor
    while 0 < size < smallest:
        sizes.add(size)
        size *= 2
    return sorted(sizes, reverse=True)


def _fit_start(base, terms, fixed):
    """(the starting HostModel, the names of the terms to fit, the held term values)."""
    from .host import HOST_TERMS, HostModel
    if base is None:
        base = HostModel(**FIT_START)
    elif isinstance(base, dict):
        base = HostModel.from_params(base)
    fixed = {k: float(v) for k, v in (fixed or {}).items()}
    if any(not math.isfinite(v) or v < 0 for v in fixed.values()):
        raise ValueError(f"fixed terms must be finite numbers >= 0, got {fixed}")
    names = tuple(HOST_TERMS) if terms is None else tuple(terms)
    for t in (*names, *fixed):
        if t not in HOST_TERMS:
            raise ValueError(f"unknown term {t!r}; valid: {', '.join(HOST_TERMS)}")
    names = tuple(t for t in names if t not in fixed)
    held = np.array([float(fixed.get(k, 0.0)) for k in HOST_TERMS])
    base = base.with_theta([fixed[k] if k in fixed else getattr(base, k) if k in names else 0.0
                            for k in HOST_TERMS])
    return base, names, held


_LOG2_SQ = float(np.log(2.0) ** 2)


class _HostFit:
    """The timed schedules of a host fit, and the alternating fit over them: simulate
    every sample for its term counts, solve for the parameters, repeat."""

    def __init__(self, samples, held, names, relative: bool, iterations: int):
        from ringlet.algorithms import build

        from .host import HOST_TERMS
        from .model import count_of
        self.held, self.relative, self.iterations = held, relative, iterations
        self.cols = [HOST_TERMS.index(t) for t in names]
        self.rows = []
        for smp in samples:
            t = float(smp["seconds"])
            if not t > 0:
                raise ValueError(f"bad calibration sample {smp!r}: seconds must be > 0")
            isz = int(smp.get("itemsize", 4))
            sched = build(smp["collective"], smp["algorithm"], int(smp["p"]),
                          count_of(smp["collective"], int(smp["p"]), int(smp["nbytes"]), isz),
                          itemsize=isz)
            self.rows.append((sched, t, tuple(smp.get("shared", ())), {}))
        if len(self.rows) < 2:
            raise ValueError("fit_host needs at least two samples")
        self.y = np.array([t for _, t, _, _ in self.rows])

    def counts(self, model):
        """(term counts on each sample's critical path, predicted seconds) under ``model``."""
        from .host import HOST_TERMS
        from .simulate import _HostSim
        X = np.zeros((len(self.rows), len(HOST_TERMS)))
        pred = np.zeros(len(self.rows))
        for i, (sched, _, shared, memo) in enumerate(self.rows):
            # (simulate() with Topology.on_host, keeping what the terms do not change)
            res = _HostSim(sched, model, shared, memo).run()
            X[i] = [res.features[k] for k in HOST_TERMS]
            pred[i] = res.time
        return X, pred

    def alternate(self, model, keep):
        """The best (log error, model, predictions) of the alternating fit from ``model``
        on the samples ``keep`` selects."""
        y, held, cols = self.y, self.held, self.cols
        best = None
        stale = 0
        for _ in range(self.iterations):
            X, pred = self.counts(model)
            # a miss of more than 2x counts as 2x: a timing taken while other processes
            # held the cores (on a busy 2-core host, 50x the rest) must not outweigh the
            # many the model fits - it made the starting guess win over every fit
            err = float(np.sum(np.minimum(np.log(pred[keep] / y[keep]) ** 2, _LOG2_SQ)))
            if best is None or err < best[0] * (1 - 1e-3):
                best, stale = (err, model, pred), 0
            else:
                # The parameters wander on while the error stays flat (theta rarely meets
                # the tolerance below), each iteration a simulation of every timing: on
                # 262 timings of a calibration (p = 2 and 4, FULL_FIT) no iterate gained
                # 0.1% after two that did not; stopping there took 82 passes, not 93,
                # to the same fit. (Most of the rest is the grid: 18 tries x 3.)
                if err < best[0]:
                    best = (err, model, pred)
                stale += 1
                if stale >= 2:
                    break
            theta = held.copy()
            rest = y[keep] - X[keep] @ held          # what the fitted terms must explain
            theta[cols] = _nnls(X[keep][:, cols], rest, self.relative, y[keep])
            new = model.with_theta(theta)
            if np.allclose(new.theta, model.theta, rtol=1e-4, atol=1e-15):
                break
            model = new
        return best


def _host_entry(model, pred, y, keep, outliers) -> dict:
    """The profile entry of a fitted host model, with its residuals."""
    from .host import HOST_TERMS
    rel = np.abs(pred[keep] - y[keep]) / y[keep]
    out = {"model": "host"}
    out.update({k: float(getattr(model, k)) for k in HOST_TERMS})
    out.update(l2_bytes=int(model.l2_bytes), l3_bytes=int(model.l3_bytes), cores=int(model.cores),
               eager=int(model.eager), rendezvous=int(model.rendezvous),
               ring_bytes=int(model.ring_bytes),
               zero_copy_min=int(model.zero_copy_min),
               zero_copy_oneway_min=int(model.zero_copy_oneway_min), cma_min=int(model.cma_min),
               fast_bytes=int(model.fast_bytes), piece=int(model.piece),
               idle_share=float(model.idle_share),
               imbalance=float(model.imbalance))
    if out["beta"] <= 0:
        out["beta"] = 1e-15
    out["samples"] = len(y)
    out["outliers"] = outliers
    out["residuals"] = {"rms": float(np.sqrt(np.mean((pred[keep] - y[keep]) ** 2))),
                        "median_rel": float(np.median(rel)), "max_rel": float(np.max(rel))}
    out["predicted"] = [float(x) for x in pred]
    return out


def machine(cpus=None) -> dict:
    """This machine's cores ``cpus`` (default: those this process may use) and their cache
    sizes from sysfs: ``{"cores", "l2_bytes" (sum over the cores' L2s), "l3_bytes"}``."""
    cpus = limits.affinity() if cpus is None else sorted(cpus)
    total = {2: 0, 3: 0}
    seen = set()
    for cpu in cpus:
        base = Path(f"/sys/devices/system/cpu/cpu{cpu}/cache")
        for idx in sorted(base.glob("index*")) if base.exists() else ():
            try:
                level = int((idx / "level").read_text())
                kind = (idx / "type").read_text().strip()
                size = parse_size((idx / "size").read_text().strip())
                shared = (idx / "shared_cpu_list").read_text().strip()
            except (OSError, ValueError):
                continue
            if level in total and kind in ("Unified", "Data") and (level, shared) not in seen:
                seen.add((level, shared))
                total[level] += size
    return {"cores": len(cpus), "l2_bytes": total[2] or (1 << 20) * len(cpus),
            "l3_bytes": total[3] or (32 << 20)}


def _nnls(X, y, relative, scale=None):
    """Non-negative least squares (Lawson and Hanson's active set method), weighted by
    1/``scale`` (default ``y``) when ``relative``. Columns are scaled to unit norm first:
    counts of messages and of bytes differ by eight orders of magnitude."""
    w = 1.0 / (y if scale is None else scale) if relative else np.ones_like(y)
    A = X * w[:, None]
    b = y * w
    norms = np.linalg.norm(A, axis=0)
    if not norms.any():
        raise ValueError("fit: no non-negative solution (are the samples all zero?)")
    live = norms > 0
    A = A[:, live] / norms[live]
    n = A.shape[1]
    tol = 10 * np.finfo(float).eps * max(A.shape) * max(1.0, float(np.abs(A).sum(axis=0).max())) \
        * max(float(np.linalg.norm(b)), np.finfo(float).tiny)
    x = np.zeros(n)
    P = np.zeros(n, bool)                 # the passive set: coefficients free to be > 0
    for _ in range(3 * n + 3):
        grad = A.T @ (b - A @ x)
        if P.all() or grad[~P].max() <= tol:
            break
        P[np.flatnonzero(~P)[np.argmax(grad[~P])]] = True
        while True:
            z = np.zeros(n)
            z[P] = np.linalg.lstsq(A[:, P], b, rcond=None)[0]
            if (z[P] > tol).all():
                x = z
                break
            # step back to the boundary and drop the coefficients that reach zero
            neg = P & (z <= tol)
            gap = x[neg] - z[neg]
            step = np.min(np.where(gap > 0, x[neg] / np.where(gap > 0, gap, 1.0), 0.0))
            x = x + step * (z - x)
            P &= x > tol
            x[~P] = 0.0
    full = np.zeros(X.shape[1])
    full[live] = x / norms[live]
    return full


__all__ = ["Profile", "DEFAULT_PROFILE", "profile_path", "load_profile", "default_profile",
           "host_link", "fit", "fit_host", "machine"]
