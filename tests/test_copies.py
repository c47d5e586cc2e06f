"""Byte copies at every distance (transport/copies.py, _fastpath.c "copies"): the same bytes
as NumPy's copy, overlapping or not, and collectives right and no slower on views that start
a few bytes past their peers' pages."""
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ringlet as rl
from ringlet.transport import copies

from conftest import run

needs_c = pytest.mark.skipif(copies._fastpath is None, reason="the C extension is not built")


def _at(raw: np.ndarray, offset: int, n: int) -> np.ndarray:
    """n bytes of raw starting ``offset`` bytes past a page boundary inside it."""
    a = (-raw.ctypes.data) % 4096 + offset
    return raw[a:a + n]


@needs_c
@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 300_000), src_off=st.integers(0, 4095),
       distance=st.one_of(st.integers(1, 63), st.integers(-64, 64), st.integers(0, 4095)),
       overlap=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_copy_matches_numpy(n, src_off, distance, overlap, seed):
    """Every size (the vector loop's 128- and 64-byte steps and their tails), every distance
    (the loop's 1-63 and memcpy's rest), apart or overlapping (then memmove's result)."""
    rng = np.random.default_rng(seed)
    if overlap:    # one buffer: dst = src + distance
        raw = rng.integers(0, 256, n + 3 * 4096 + 8192, dtype=np.uint8)
        whole = _at(raw, src_off, n + 2 * 4096)
        s0, d0 = 4096, 4096 + distance
        want = whole.copy()
        want[d0:d0 + n] = whole[s0:s0 + n].copy()
        copies.copy(whole[d0:d0 + n], whole[s0:s0 + n])
        assert np.array_equal(whole, want)
    else:
        src = _at(rng.integers(0, 256, n + 8192, dtype=np.uint8), src_off, n)
        draw = rng.integers(0, 256, n + 8192, dtype=np.uint8)
        dst = _at(draw, (src_off + distance) % 4096, n)
        before = draw.copy()
        copies.copy(dst, src)
        assert np.array_equal(dst, src)
        # nothing outside dst was touched
        lo = dst.ctypes.data - draw.ctypes.data
        assert np.array_equal(draw[:lo], before[:lo])
        assert np.array_equal(draw[lo + n:], before[lo + n:])


@needs_c
def test_copy_takes_typed_arrays_memoryviews_and_bytes():
    x = np.arange(5000, dtype=np.float32)
    y = np.empty_like(x)
    copies.copy(y, x)
    assert np.array_equal(x, y)
    ring = memoryview(bytearray(30000))
    copies.copy(ring[100:100 + x.nbytes], x)
    assert bytes(ring[100:100 + x.nbytes]) == x.tobytes()
    copies.copy(y, bytes(x[::-1]))
    assert np.array_equal(y, x[::-1])


@needs_c
def test_copy_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="8 bytes into 4"):
        copies.copy(np.empty(4, np.uint8), np.empty(8, np.uint8))
    with pytest.raises((BufferError, ValueError)):   # strided: not one range of bytes
        copies.copy(np.empty(16, np.uint8)[::2], np.empty(8, np.uint8))
    with pytest.raises((BufferError, TypeError)):
        copies.copy(b"12345678", np.empty(8, np.uint8))   # read-only destination
    with pytest.raises(TypeError, match="object"):   # pointers, not bytes: no refcounts kept
        copies.assign(np.empty(1000, object), np.array([object()] * 1000, dtype=object))


def _best(fn, reps: int = 15) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@needs_c
def test_no_slow_distance():
    """512 KiB 4 bytes past its source in a page costs about what it does at distance 0
    (glibc's rep movsb: 15-20x on the AMD EPYC VM; the loop: ~1x). Best of 15 each, so a
    busy host delays both alike; 3x leaves room for noise and none for the cliff."""
    n = 512 << 10
    src = _at(np.ones(n + 8192, np.uint8), 0, n)
    draw = np.zeros(n + 8192, np.uint8)
    near, even = _at(draw, 4, n), _at(draw, 0, n)
    copies.copy(near, src)
    copies.copy(even, src)
    t_near = _best(lambda: copies.copy(near, src))
    t_even = _best(lambda: copies.copy(even, src))
    assert t_near < 3 * t_even + 20e-6, (t_near, t_even)


def _views_job(rank, p, nbytes, offset):
    """Collectives whose buffers are views starting ``offset`` bytes into a page (a shard of
    a flat buffer), checked against NumPy."""
    def view(nfloats, off):
        raw = np.empty(nfloats * 4 + 8192, np.uint8)
        a = (-raw.ctypes.data) % 4096 + off
        return raw[a:a + nfloats * 4].view(np.float32)

    n = max(nbytes // 4 // p, 1)
    x = view(n, 0)
    x[:] = np.arange(n, dtype=np.float32) + rank * n
    out = view(n * p, offset)
    rl.all_gather(out, x)
    assert np.array_equal(out, np.arange(n * p, dtype=np.float32))
    b = view(n * p, offset)
    b[:] = np.arange(n * p, dtype=np.float32) if rank == 0 else -1
    rl.broadcast(b, 0)
    assert np.array_equal(b, np.arange(n * p, dtype=np.float32))
    blocks = view(n * p, offset)
    blocks[:] = np.repeat(np.arange(p, dtype=np.float32) + 10 * rank, n)
    got = view(n * p, (offset + 8) % 4096)
    rl.all_to_all(got, blocks)
    assert np.array_equal(got, np.repeat(np.arange(p, dtype=np.float32) * 10 + rank, n))
    s = view(n * p, offset)
    s[:] = rank + 1
    rl.all_reduce(s)
    assert np.all(s == p * (p + 1) / 2)


@pytest.mark.parametrize("p,nbytes", [(2, 64 << 10), (2, 1 << 20), (3, 3 << 20), (4, 6 << 20)])
@pytest.mark.parametrize("offset", [4, 12, 60])
def test_collectives_on_views_a_few_bytes_into_a_page(p, nbytes, offset):
    """C's EAGER packets (64 KiB, 1 MiB at p = 2) and the Python engine's streamed and
    read-in-place messages (3 and 6 MiB), at distances the vector loop copies."""
    run(_views_job, p, p, nbytes, offset)
