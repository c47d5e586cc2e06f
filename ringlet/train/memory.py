"""Memory a rank holds, measured: what is allocated inside a ``with`` block and still alive
at its end, and the most alive at once - NumPy's heap as ``tracemalloc`` traces it, plus
the ``rl.empty`` shared-memory arrays (``mmap``, which it does not see).

    with measure_memory() as m:
        opt = ZeroOptimizer(init(), stage=3)
        for _ in range(steps): train_step(opt)
    m.held, m.peak            # bytes

The peak adds the heap's peak to the shared arrays' (sampled as each one is made or lent
by :mod:`ringlet.train.pricing`): at most the true peak of the sum, never below it.
Spare buffers ringlet keeps to lend again (``ringlet.buffers.lend``) are not held by the
program: ``m.reserved`` counts them at the end (``ringlet.buffers.drop_spares()`` frees
them), as a caching allocator tells memory allocated from memory reserved.
"""
from __future__ import annotations

import tracemalloc

from .. import buffers

_open: list = []


def shared_bytes() -> int:
    """Bytes of ``rl.empty`` arrays alive in this process, but the spares kept to lend."""
    return sum(end - start for start, (end, *_) in list(buffers._regions.items())) \
        - buffers.spare_bytes()


def note_shared() -> None:
    """A shared array was just made: open meters update their peak."""
    if _open:
        now = shared_bytes()
        for m in _open:
            m._shm_peak = max(m._shm_peak, now)


class MemoryMeter:
    def __init__(self):
        self.held = self.peak = self.reserved = 0
        self._started = False

    def __enter__(self) -> "MemoryMeter":
        self._started = not tracemalloc.is_tracing()
        if self._started:
            tracemalloc.start()
        tracemalloc.reset_peak()
        self._heap0 = tracemalloc.get_traced_memory()[0]
        self._shm0 = self._shm_peak = shared_bytes()
        _open.append(self)
        return self

    def __exit__(self, *exc) -> None:
        heap, heap_peak = tracemalloc.get_traced_memory()
        _open.remove(self)
        shm = shared_bytes()
        self.held = heap - self._heap0 + shm - self._shm0
        self.peak = heap_peak - self._heap0 + max(self._shm_peak, shm) - self._shm0
        self.reserved = buffers.spare_bytes()
        if self._started:
            tracemalloc.stop()


def measure_memory() -> MemoryMeter:
    """A context manager measuring the bytes allocated inside it (see the module)."""
    return MemoryMeter()
