"""rl.empty buffers from buffers.HUGE_MIN on huge pages (buffers.py): mapped 2 MiB-aligned,
by their owner and by a peer reading them in place, and collapsed where the kernel allows
MADV_COLLAPSE. Every collective against NumPy on such buffers with real ranks, mixed with
plain and small ones; and RINGLET_HUGE=0 leaves 4 KiB pages."""
import os
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ringlet as rl
from ringlet import buffers
from ringlet.runtime import engine
from conftest import run
from test_cma import OPS, _call
from test_collectives import in_rank_settings

HUGE = buffers.HUGE


def _pmd_kib(addr: int) -> int:
    """KiB of the mapping at ``addr`` mapped by huge pages (smaps' ShmemPmdMapped)."""
    text = open("/proc/self/smaps").read()
    for m in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) .*?\n(.*?)(?=^[0-9a-f]+-|\Z)", text,
                         re.S | re.M):
        if int(m.group(1), 16) <= addr < int(m.group(2), 16):
            got = re.search(r"ShmemPmdMapped:\s+(\d+)", m.group(3))
            return int(got.group(1)) if got else 0
    raise AssertionError(f"no mapping at {addr:#x}")


def _collapse_works() -> bool:
    """Whether this kernel gives shared memory huge pages by MADV_COLLAPSE at all."""
    import mmap
    fd = os.memfd_create("probe", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, HUGE)
        whole = buffers._map(fd, HUGE, mmap.PROT_READ | mmap.PROT_WRITE, True)
        buffers._collapse(whole)
        return _pmd_kib(buffers.address(whole)) > 0
    finally:
        os.close(fd)


def test_large_buffers_are_aligned_and_on_huge_pages_where_the_kernel_allows():
    a = rl.empty((3, (5 << 20) // 4 + 7), np.float32)      # 15 MiB and a bit: not whole pages
    addr = buffers.address(a)
    assert addr % HUGE == 0
    a[...] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    alloc, fd, offset = buffers.locate(a[1])
    assert offset == a[1].nbytes and buffers.locate(a) == (alloc, fd, 0)
    # a peer's view of it (here our own pid): aligned too, the same bytes, read-only
    view = buffers.RemoteMaps().view(os.getpid(), alloc, fd, a[1].nbytes, a[1].nbytes)
    assert buffers.address(view) % HUGE == a[1].nbytes % HUGE and not view.flags.writeable
    np.testing.assert_array_equal(view.view(np.float32), a[1])
    if _collapse_works():
        assert _pmd_kib(addr) >= 14 * 1024
        assert _pmd_kib(buffers.address(view)) >= 4 * 1024     # (the pages it read)
    small = rl.empty(1000, np.uint8)        # below HUGE_MIN: as before, a page's worth
    assert buffers.locate(small)[2] == 0 and _pmd_kib(buffers.address(small)) == 0


def test_off_leaves_small_pages(monkeypatch):
    monkeypatch.setenv("RINGLET_HUGE", "0")
    a = rl.empty(8 << 20, np.uint8)
    a[...] = 7
    assert _pmd_kib(buffers.address(a)) == 0
    assert int(a.sum()) == 7 * (8 << 20)


def _against_numpy(rank, p):
    @in_rank_settings(6)
    @given(op=st.sampled_from(OPS), dtype=st.sampled_from([np.uint8, np.float32, np.float64]),
           nbytes=st.integers(4 << 20, 9 << 20), seed=st.integers(0, 2 ** 31),
           shared=st.booleans())
    def check(op, dtype, nbytes, seed, shared):
        count = max(nbytes // np.dtype(dtype).itemsize // p, 1) | 1   # odd: not whole pages
        _call(rank, p, op, count, np.dtype(dtype), seed, rl.empty if shared else np.empty)

    check()
    for op in ("all_gather", "all_to_all", "broadcast"):   # rl.empty on huge pages each
        _call(rank, p, op, (9 << 20) // 4 + 1, np.dtype(np.float32), 5, rl.empty)
    # each rank read a peer's large rl.empty buffer in place (an exchange), mapped aligned
    maps = engine().remote_maps.maps.values()
    assert any(w.size >= buffers.HUGE_MIN and buffers.address(w) % HUGE == 0 for w, *_ in maps)


@pytest.mark.parametrize("p", [2, 3])
def test_every_collective_on_huge_page_buffers_against_numpy(p):
    run(_against_numpy, p, p)
