"""Byte copies at full speed whatever the distance between source and destination.

glibc's ``memcpy`` (and so NumPy's copies) moves 2 KiB to ~1 MiB with ``rep movsb``, which on
some x86 cores crawls when the destination lies a few bytes past the source within a page:
on this project's AMD EPYC VM 512 KiB took 150-210 us at distances 1-15 against 13 at distance
0 (``bench/copy_distance.py``), and an all_gather at p = 2 of 1 MiB into an output starting 4
bytes into a page took 5x its time. Such distances are common (views of a flat buffer start
at any element: a shard, a bucket, ``x[1:]``), so the engine's large copies go through
``_fastpath.copy``, which takes a vector loop at those distances and ``memcpy`` elsewhere;
the C fast path does the same inside (``_fastpath.c``, "copies")."""
from __future__ import annotations

try:
    from . import _fastpath
except ImportError:   # built without a C compiler: NumPy's copy, slow distances and all
    _fastpath = None

LOOP_MIN = 2048   # below this glibc does not use rep movsb: the caller's own copy is cheaper


def assign(dst, src) -> None:
    """``dst[:] = src`` for 1-D C-contiguous buffers of one size and type (NumPy arrays of
    one dtype, byte memoryviews, bytes): ``copy`` from ``LOOP_MIN`` bytes, the caller's own
    slice assignment below."""
    if _fastpath is not None and len(src) * getattr(src, "itemsize", 1) >= LOOP_MIN:
        _fastpath.copy(dst, src)
    else:
        dst[:] = src


def copy(dst, src) -> None:
    """``dst[:] = src`` for two C-contiguous buffers of one size in bytes (NumPy arrays,
    memoryviews, bytes), which may overlap."""
    if _fastpath is not None:
        _fastpath.copy(dst, src)
    else:
        memoryview(dst).cast("B")[:] = memoryview(src).cast("B")
