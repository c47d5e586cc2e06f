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

Extra keys are kept and ignored. Without a file, :data:`DEFAULT_PROFILE` is used: rough,
uncalibrated numbers for a Python process moving NumPy buffers (``source == "default"``);
run ``ringlet calibrate`` to replace them with measured ones.

:func:`fit` turns timings of small experiments into ``alpha``, ``beta`` and ``gamma`` by
(non-negative, relative) least squares; ``ringlet calibrate`` measures the samples with
the runtime and saves ``Profile.from_fits(...)``.
"""
from __future__ import annotations

import copy
import itertools
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .model import Link

PROFILE_VERSION = 1

#: used when no calibrated profile exists (documented, deliberately round numbers)
DEFAULT_PROFILE: dict = {
    "version": PROFILE_VERSION,
    "host": "",
    "created": "",
    "transports": {
        # shared memory between processes of one host: Python-level per-message overhead,
        # one memcpy-class copy per byte, NumPy reduction
        "shm": {"alpha": 20e-6, "beta": 1 / 5e9, "gamma": 1 / 10e9, "delta": 0.0},
        # TCP over the loopback or a LAN: kernel round trips per message, socket copies
        "tcp": {"alpha": 50e-6, "beta": 1 / 1.5e9, "gamma": 1 / 10e9, "delta": 0.0},
    },
}


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

    @property
    def calibrated(self) -> bool:
        return self.source != "default"

    def params(self, transport: str = "shm") -> dict:
        if transport not in self.transports:
            raise ValueError(f"profile has no transport {transport!r}; it has: "
                             f"{', '.join(self.transports) or 'none'}")
        return self.transports[transport]

    def link(self, transport: str = "shm") -> Link:
        t = self.params(transport)
        return Link.from_beta(float(t["alpha"]), float(t["beta"]),
                              name=f"{transport} ({'calibrated' if self.calibrated else 'default'})")

    def gamma(self, transport: str = "shm") -> float:
        return float(self.params(transport).get("gamma", 0.0))

    def delta(self, transport: str = "shm") -> float:
        return float(self.params(transport).get("delta", 0.0))

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
            for key in ("gamma", "delta"):
                v = t.get(key, 0.0)
                if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"{source}: transport {name!r}: {key} must be a number >= 0")
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


def default_profile() -> Profile:
    return Profile.from_dict(DEFAULT_PROFILE, source="default")


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
        return _default_cached()
    _CACHE["file"] = (key, prof)
    return prof


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
    profile's transport entry. A parameter the samples do not exercise comes out 0."""
    rows = []
    for s in samples:
        if isinstance(s, dict):
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
    coef = _nnls3(X, y, relative)
    outliers: list[int] = []
    if robust and len(y) >= 6:
        rel = np.abs(X @ coef - y) / y
        limit = max(0.5, 3 * float(np.median(rel)))
        worst = np.argsort(-rel)[: len(y) // 4]
        drop = [int(i) for i in worst if rel[i] > limit]
        if drop:
            keep[drop] = False
            outliers = sorted(drop)
            coef = _nnls3(X[keep], y[keep], relative)
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


def _nnls3(X, y, relative):
    """Exact non-negative least squares for a few columns: the best of every subset."""
    w = 1.0 / y if relative else np.ones_like(y)
    best = None
    ncol = X.shape[1]
    for k in range(ncol, 0, -1):
        for cols in itertools.combinations(range(ncol), k):
            if not X[:, cols].any():
                continue
            A = X[:, cols] * w[:, None]
            coef, *_ = np.linalg.lstsq(A, y * w, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(ncol)
            full[list(cols)] = coef
            err = float(np.sum(((X @ full - y) * w) ** 2))
            if best is None or err < best[0] - 1e-30:
                best = (err, full)
    if best is None:
        raise ValueError("fit: no non-negative solution (are the samples all zero?)")
    return best[1]


__all__ = ["Profile", "DEFAULT_PROFILE", "profile_path", "load_profile", "default_profile",
           "host_link", "fit"]
