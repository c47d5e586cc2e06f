"""Cross-memory attach: a receiver on the same host reads a large message straight out of
the sender's private memory with ``process_vm_readv`` — one copy instead of two through
the ring (the sender's copy in, the receiver's copy out), for plain NumPy buffers that no
peer can map (``rl.empty`` ones are mapped instead: buffers.RemoteMaps).

The sender names its buffer's address in the RTS (protocol.RTS_CMA) and keeps the buffer
until the receiver answers CTS_DONE. The kernel allows the read only where ptrace would
be (same user, ``kernel.yama.ptrace_scope`` <= 1 for a non-ancestor, no seccomp filter
refusing the call, as in some containers): the first read a peer refuses turns CMA off
for that peer, and the receiver answers CTS_OK instead, so the message streams through
the ring as it would have without CMA — nothing is written into the receive buffer by a
refused read. RINGLET_CMA=0 turns it off.

Only where it wins, measured (bench/single_copy.py): the kernel's copy (pinning the
sender's pages 16 at a time) runs at about a third of memcpy's speed on cached data here,
while the ring's two copies run on two cores at once. So a sender offers its address only
in a round where it receives too (all_to_all, all_gather, a chain's middle), where every
rank copies anyway and one copy fewer each is a gain; a one-way message (a broadcast's
root, point-to-point) streams, so that the sender's core shares the work, and a receiver
that reduces declines the offer (CTS_OK) and takes the stream.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

import numpy as np


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load():
    """libc's process_vm_readv, or None (not Linux, or a libc without it)."""
    if not hasattr(os, "sched_getaffinity"):      # (Linux only)
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv = _load()


def enabled() -> bool:
    """Whether to offer CMA at all (read at engine start: forked ranks see their own
    environment)."""
    return _readv is not None and os.environ.get("RINGLET_CMA", "1") != "0"


def read(pid: int, addr: int, dst: np.ndarray) -> int:
    """Copy ``dst.nbytes`` bytes at ``addr`` in process ``pid`` into the contiguous array
    ``dst``: the bytes read (all of them), or -errno (nothing usable was read)."""
    n = dst.nbytes
    local = _IoVec(dst.ctypes.data, n)
    remote = _IoVec(addr, n)
    got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got < 0:
        return -ctypes.get_errno()
    return got if got == n else -5    # a short read (EIO): part of the range is not mapped


class Reader:
    """One local peer's messages read in place: ``deliver`` them into receives while the
    kernel allows it (``ok``)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.ok = enabled()
        self.refused = 0            # errno of the read that turned CMA off (0: none)
        self.reads = 0              # messages read in place

    def deliver(self, req, addr: int, nbytes: int) -> bool:
        """Read the ``nbytes`` message at ``addr`` into ``req`` (a RecvRequest at offset 0):
        True when done; False when it is not for CMA (a reduction: reading into scratch and
        reducing from there lost to the ring, which overlaps the sender's copy with the
        receiver's reduce) or CMA is refused; then ``req`` is untouched: stream it."""
        if not self.ok or req.ufunc is not None or not req.dst.flags.c_contiguous:
            return False
        got = read(self.pid, addr, req.dst.view(np.uint8).reshape(-1))
        if got < 0:
            return self._refuse(-got)
        req.offset = nbytes
        self.reads += 1
        return True

    def _refuse(self, errno: int) -> bool:
        self.ok = False
        self.refused = errno
        return False
