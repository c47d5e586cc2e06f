"""Run a whole Schedule in one process: the tests' oracle and the tracer's engine.

Round semantics (``ringlet.schedule``): in each round every rank first runs its local
steps in order; then all messages of the round move, their sources read as they stand
after the local steps (snapshotted before any message writes).
"""
from __future__ import annotations

import numpy as np

from .schedule import REDUCE, Schedule


def run(schedule: Schedule, bufs: list[dict], op=np.add) -> list[dict]:
    """Execute every rank's part of ``schedule`` on ``bufs[r]`` (rank r's flat 1-D arrays
    by buffer name: "buf", "in", "out", "tmp" as the collective needs), in place, and
    return ``bufs``. A missing "tmp" is allocated (uninitialised, of the buffers' dtype).
    ``op`` is a binary ufunc, applied as ``op(acc, incoming, out=dst)``."""
    if len(bufs) != schedule.p:
        raise ValueError(f"need buffers for {schedule.p} ranks, got {len(bufs)}")
    for b in bufs:
        if "tmp" not in b:
            dtype = next(iter(b.values())).dtype if b else np.uint8
            b["tmp"] = np.empty(schedule.buffers.get("tmp", 0), dtype)

    def region(rank, name, off, n):
        return bufs[rank][name][off:off + n]

    def apply(t, data):
        dst = region(t.dst, t.dbuf, t.doff, t.n)
        if t.op == REDUCE:
            op(region(t.dst, *t.acc, t.n), data, out=dst)
        else:
            dst[...] = data

    for rnd in schedule.rounds:
        rows = rnd.rows()
        for t in rows:
            if t.local:
                apply(t, region(t.src, t.sbuf, t.soff, t.n))
        arriving = [(t, region(t.src, t.sbuf, t.soff, t.n).copy()) for t in rows if not t.local]
        for t, data in arriving:
            apply(t, data)
    return bufs
