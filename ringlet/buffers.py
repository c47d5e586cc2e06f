"""Zero-copy buffers: ``rl.empty`` / ``rl.zeros`` return NumPy arrays in shared memory.

Each allocation is an anonymous memfd (no name under /dev/shm, freed with its last
mapping). A large send from such an array does not go through the ring: the RTS carries
(allocation id, fd, offset), the receiving rank on the same host maps the sender's memfd
through /proc/<pid>/fd and copies or reduces straight from it — one copy instead of two.
"""
from __future__ import annotations

import bisect
import itertools
import mmap
import os
import threading
import weakref

import numpy as np

_ids = itertools.count(1)
_starts: list[int] = []           # sorted start addresses of live allocations
_regions: dict[int, tuple] = {}   # start -> (end, alloc id, fd)


def empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialized array in shared memory that collectives send without staging."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = max(count * dtype.itemsize, 1)
    size = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    huge = size >= HUGE_MIN and huge_pages()
    if huge:
        size = -(-size // HUGE) * HUGE
    fd = os.memfd_create("ringlet-buffer", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        whole = _map(fd, size, mmap.PROT_READ | mmap.PROT_WRITE, huge)
    except BaseException:
        os.close(fd)
        raise
    if huge:
        _collapse(whole)
    mm = _owner(whole)
    arr = whole[:count * dtype.itemsize].view(dtype).reshape(shape)
    start = arr.__array_interface__["data"][0]
    alloc = next(_ids)
    _regions[start] = (start + size, alloc, fd)   # (before locate, maybe in another thread, can find start)
    bisect.insort(_starts, start)
    weakref.finalize(mm, _release, start, fd)
    return arr


# Huge pages: NumPy backs its own arrays from 4 MiB with transparent huge pages (madvise),
# but shared memory gets them only where the host's shmem_enabled allows - "never" here -
# or by MADV_COLLAPSE, which works whatever that says, on pages present and mapped 2 MiB-
# aligned. A large exchange from 4 KiB pages walks a page table per 4 KiB - in a VM two
# of them - and copied slower here: an all_gather's two 4 MiB copies into an 8 MiB buffer,
# 4 KiB against huge pages in alternating blocks in one process (two at once, one per
# core, as a p = 2 exchange runs; load 2.9): 1.18x, 1.31x, 2.38x as long on the median
# block (spread 0.3-4.4x). In the collectives (bench/huge_pages.py, 8 MiB, alternating
# blocks in one job), 4 KiB / huge pages on the median block: p = 2 all_gather 1.37 (load
# 2.5), 1.11 (load 10.7), 1.24 (load 1.4); all_to_all 1.05, 1.08, 1.22; p = 4 all_gather
# 1.10 (load 11), 1.00 (load 1.6: its 2 MiB blocks stay on 4 KiB pages), all_to_all 1.11,
# 1.06. So an rl.empty allocation from HUGE_MIN is rounded up to whole
# huge pages, mapped aligned, populated and collapsed at once (8 MiB: ~24 ms at load 3, in
# place of the faults its first writes took on 4 KiB pages; 64 MiB: 0.15-0.6 s against
# 0.1-0.6 s, load 7-10), and a
# peer maps it aligned too (RemoteMaps), to read it through huge pages as well.
# RINGLET_HUGE=0 turns it off.
HUGE = 2 << 20
HUGE_MIN = 4 << 20
_MADV_POPULATE_WRITE = 23
_MADV_COLLAPSE = 25


def huge_pages() -> bool:
    return os.environ.get("RINGLET_HUGE", "1") != "0"


_libc_mmap = None


def _fixed_map(addr: int, size: int, prot: int, fd: int) -> bool:
    global _libc_mmap
    if _libc_mmap is None:
        import ctypes
        import ctypes.util
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.mmap
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
        _libc_mmap = fn
    return _libc_mmap(addr, size, prot, mmap.MAP_SHARED | 0x10, fd, 0) == addr  # MAP_FIXED


def _map(fd: int, size: int, prot: int, huge: bool) -> np.ndarray:
    """``fd``'s first ``size`` bytes mapped shared, as a uint8 array whose base (an mmap
    object) owns the mapping; ``huge``: at a 2 MiB-aligned address (inside a larger
    anonymous reservation the file is mapped over), so huge pages of the file can be mapped
    whole."""
    if not huge or not hasattr(mmap, "MAP_SHARED"):
        return np.frombuffer(mmap.mmap(fd, size, prot=prot), np.uint8)
    res = mmap.mmap(-1, size + HUGE)       # (freed whole, the file's part too, with it)
    base = address(np.frombuffer(res, np.uint8, 1))
    skip = -base % HUGE
    if not _fixed_map(base + skip, size, prot, fd):
        res.close()
        return np.frombuffer(mmap.mmap(fd, size, prot=prot), np.uint8)
    whole = np.frombuffer(res, np.uint8, size, offset=skip)
    if not prot & mmap.PROT_WRITE:
        whole.flags.writeable = False
    return whole


def _owner(whole: np.ndarray) -> mmap.mmap:
    base = whole.base
    return base.obj if isinstance(base, memoryview) else base


def _collapse(whole: np.ndarray) -> None:
    """Back ``whole`` (a fresh aligned mapping from _map) by huge pages where the kernel
    lets us (Linux >= 6.1 has MADV_COLLAPSE); 4 KiB pages where it does not."""
    mm = _owner(whole)
    start = address(whole) - address(np.frombuffer(mm, np.uint8, 1))
    try:
        mm.madvise(_MADV_POPULATE_WRITE, start, whole.size)
        mm.madvise(_MADV_COLLAPSE, start, whole.size)
    except (OSError, ValueError):
        pass


# The library's own temporaries - a staged tensor, MoE's packed rows, a parameter server's
# snapshot - are filled by ringlet and then sent, so they live in shared memory too and
# local peers read them in place. They are lent out and given back rather than allocated
# per call: a fresh memfd would cost its mapping and a page fault per 4 KiB every time.
SPARE_KEEP = 8                      # spare buffers kept for reuse, at most
_spare: list[np.ndarray] = []       # uint8 rl.empty arrays not lent out
_spare_lock = threading.Lock()      # (the progress thread gives back too)


def lend(nbytes: int) -> np.ndarray:
    """A uint8 rl.empty array of at least ``nbytes`` - the smallest spare that fits (and is
    not over twice that: memory lent is memory held), else a new one. ``give_back`` it once
    no call reads or writes it any more."""
    with _spare_lock:
        fits = [i for i, b in enumerate(_spare) if nbytes <= b.size <= max(2 * nbytes, 8192)]
        if fits:     # (by position: == on arrays compares their elements)
            return _spare.pop(min(fits, key=lambda i: _spare[i].size))
    return empty(max(int(nbytes), 1), np.uint8)


def give_back(buf: np.ndarray | None) -> None:
    """Return a ``lend`` array for reuse (the smallest spare goes when too many are kept);
    None: nothing was lent."""
    if buf is None:
        return
    with _spare_lock:
        _spare.append(buf)
        if len(_spare) > SPARE_KEEP:
            _spare.pop(min(range(len(_spare)), key=lambda i: _spare[i].size))


def spare_bytes() -> int:
    """Bytes of the spare buffers kept for reuse (not lent out)."""
    with _spare_lock:
        return sum(b.size for b in _spare)


def drop_spares() -> None:
    """Free the spare buffers (their memory goes once nothing else maps it)."""
    with _spare_lock:
        _spare.clear()


def lent_view(buf: np.ndarray, shape, dtype) -> np.ndarray:
    """``buf``'s first bytes as an array of ``shape`` and ``dtype``."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    return buf[:count * dtype.itemsize].view(dtype).reshape(shape)


def zeros(shape, dtype=np.float32) -> np.ndarray:
    """A zero-filled array in shared memory (fresh memfd pages read as zero)."""
    return empty(shape, dtype)


def adopt(start: int, nbytes: int, fd: int, owner) -> None:
    """Count ``nbytes`` someone else mapped from ``fd`` (at offset 0) at ``start`` - a torch
    storage moved to shared memory - as an allocation: a large send from it is read in place
    too. It is one until ``owner``, whose end frees that memory, is collected; the fd stays
    the owner's."""
    _regions[start] = (start + nbytes, next(_ids), fd)   # (before locate can find start)
    bisect.insort(_starts, start)
    weakref.finalize(owner, _forget, start)


def _forget(start: int) -> None:
    i = bisect.bisect_left(_starts, start)
    if i < len(_starts) and _starts[i] == start:
        del _starts[i]
    _regions.pop(start, None)


def _release(start: int, fd: int) -> None:
    _forget(start)
    os.close(fd)


try:    # (the C fast path's; without a compiler, NumPy's: 2-3 us a call)
    from .transport._fastpath import address
except ImportError:
    def address(arr: np.ndarray) -> int:
        """The address of ``arr``'s first byte."""
        return arr.__array_interface__["data"][0]


def locate(arr: np.ndarray):
    """(alloc id, fd, byte offset) if ``arr`` lies inside an rl.empty allocation."""
    if not _starts:
        return None
    addr = address(arr)
    i = bisect.bisect_right(_starts, addr) - 1
    if i < 0:
        return None
    start = _starts[i]
    end, alloc, fd = _regions[start]
    if addr + arr.nbytes > end:
        return None
    return alloc, fd, addr - start


class RemoteMaps:
    """A rank's mappings of local peers' allocations, by (pid, alloc id): read-only ones
    (messages read in place), and writable ones (a receiver's buffer a sender copies part
    of a message into: transport/split.py).

    A mapping keeps its memfd's pages alive after their owner frees the array, and the
    owner does not say when it does: each new mapping first drops those whose owner's fd
    no longer names the same file (``_sweep``). Kept until the cache held 256, one fresh
    16 MiB buffer sent a step pinned 32 MiB of the host's memory a step, until destroy."""

    LIMIT = 256

    def __init__(self):
        self.maps: dict[tuple, tuple] = {}     # key -> (whole mapping, fd path, inode)

    def view(self, pid: int, alloc: int, fd: int, offset: int, nbytes: int,
             writable: bool = False) -> np.ndarray | None:
        key = (pid, alloc, True) if writable else (pid, alloc)
        hit = self.maps.get(key)
        if hit is not None:
            whole = hit[0]
        else:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                rfd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
            except OSError:
                return None            # not allowed here: the sender streams instead
            try:
                st = os.fstat(rfd)
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                whole = _map(rfd, st.st_size, prot, st.st_size >= HUGE_MIN
                             and st.st_size % HUGE == 0 and huge_pages())
            except (OSError, ValueError):
                return None            # not a mappable buffer (corrupt header): stream instead
            finally:
                os.close(rfd)
            self._sweep()
            if len(self.maps) >= self.LIMIT:
                self.maps.clear()
            self.maps[key] = (whole, path, st.st_ino)
        if offset < 0 or offset + nbytes > whole.size:
            return None
        return whole[offset:offset + nbytes]

    def _sweep(self) -> None:
        """Drop the mappings of allocations their owner has freed (its fd closed, or
        reused for another file) or whose owner has gone."""
        for key, (_, path, ino) in list(self.maps.items()):
            try:
                alive = os.stat(path).st_ino == ino
            except OSError:
                alive = False
            if not alive:
                del self.maps[key]

    def clear(self) -> None:
        self.maps.clear()
