"""Run a benchmark's rank code on emulated hosts and read back rank 0's result.

The benchmarks that need a real, rate-limited wire (overlap.py, train_overlap.py,
ddp_overlap.py) run themselves again under ``ringlet run`` inside each host of
:class:`ringlet.hosts.Hosts`; rank 0 prints one line ``RESULT <json>``, which this reads
(after the launcher's ``[0]`` tag).
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def report(value) -> None:
    """Rank 0's side: hand ``value`` (JSON-able) to the driver."""
    print("RESULT " + json.dumps(value), flush=True)


def run(script: str, args: list[str], rate: str, hosts: int = 2, nproc: int = 1,
        timeout: float = 900):
    """``script args`` on ``hosts`` emulated hosts joined by ``rate`` links, ``nproc``
    ranks each, one BLAS thread per rank; rank 0's :func:`report`. Exits with the reason
    when hosts cannot be built here or the job fails."""
    sys.path.insert(0, ROOT)
    from ringlet.hosts import Hosts, HostsUnavailable

    try:
        with Hosts(hosts, rate) as h:
            procs = h.ringlet_run(script, nproc, args, env=ONE_THREAD, stdout=-1, stderr=-1,
                                  text=True)
            results = h.wait(procs, timeout)
    except HostsUnavailable as exc:
        sys.exit(f"skipped: {exc}")
    lines = [x.split("RESULT ", 1)[1] for _, o, _ in results for x in o.splitlines()
             if "RESULT " in x]
    if not lines:
        sys.exit(f"{rate}: the job failed:\n" +
                 "\n".join(f"exit {c}: {o}{e}" for c, o, e in results))
    return json.loads(lines[0])


def rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate such as "1gbit" or "100mbit"."""
    import re
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if m is None:
        raise ValueError(f"a rate such as 1gbit or 100mbit, not {rate!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8
