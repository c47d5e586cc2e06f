"""Cross-memory attach: a large message from a plain NumPy buffer moves between ranks on
the same host by ``process_vm_readv``/``process_vm_writev`` — one copy instead of two
through the ring (the sender's copy in, the receiver's copy out), for plain buffers that no
peer can map (``rl.empty`` ones are mapped instead: buffers.RemoteMaps).

Two ways, by what the sender does meanwhile (bench/single_copy.py):

* A round where the sender receives too (all_to_all, all_gather, a chain's middle): every
  rank copies anyway, so the sender names its buffer's address in the RTS (RTS_CMA) and
  the receiver reads the whole message in one call; CTS_DONE lets the sender go. The
  receiver takes the RTS between pieces of its own local copy (work._local_polling), so
  the sender has its CTS_DONE before its own copy ends: Open MPI's order (the exchange,
  then the local copy), with no wait for the answer at the end of the round.
* A one-way message (a broadcast's root, scatter, gather, point-to-point): the sender is
  otherwise idle. It offers its address (RTS_OFFER); a receiver that copies names its own
  buffer in the CTS (CTS_PUT) and reads the message's second half while the sender writes
  the first half there - both cores copy at once, half each. The sender says what it
  wrote (PUT); the receiver answers CTS_DONE.
  Measured here (two processes, 8 MiB, warm, load ~1): memcpy 130 us, one read of the
  whole 8 MiB 270 us (the kernel pins and copies page by page: about half memcpy's speed),
  the split 130-175 us. Open MPI reads the whole message, as the first way does.
  Only where every rank has a core: where ranks outnumber cores (p = 3-4 on 2) the
  receiver reads a one-way message whole instead, as Open MPI's scatter, gather and
  broadcast do there (strace: each receiver of a scatter p = 4 reads its 2 MiB block in
  one process_vm_readv): the sender copies nothing, and the receivers read at once on the
  cores there are; streamed, the sender (a scatter's root) copied every message into the
  ring alone (in-job A/B, bench/one_way.py --whole: auto's algorithms, plain 8 MiB, 20
  alternating blocks of 10 calls, load 12-16; stream/whole on the median call: scatter
  p = 4 1.13-1.35, p = 3 1.43-1.57; gather p = 4 1.03-1.17, p = 3 0.88-1.00; broadcast,
  a pipeline, p = 4 0.96-0.97, p = 3 0.95-1.06). The sender offers it (RTS_OFFER) and the receiver answers as for a split
  with no head: it reads the message whole (CTS_DONE), or declines (CTS_OK) where it
  would decline a split - a reduction, or a round that copied locally first: a gather's
  root reading every block alone lost to the stream, where its senders copy in at once
  (gather p = 4 8 MiB direct, fresh jobs in turns, load 9-12: 10393 us read whole against
  6781 streamed). RINGLET_CMA_CROWDED=0: those stream, as before.

A receiver that reduces declines (CTS_OK) and takes the stream: reading into scratch and
reducing from there lost to the ring, which overlaps the sender's copy with the
receiver's reduce. So does one whose round copied locally first (a gather's root, its
own block): there the split lost to the stream (gather p = 2 8 MiB, ranks pinned, load
4.5, in-job A/B: 0.37-0.78x), declining it ties (0.98-1.00x). The kernel allows the calls only where ptrace would be (same user,
``kernel.yama.ptrace_scope`` <= 1 for a non-ancestor, no seccomp filter refusing them, as
in some containers): a refused read turns reads from that peer off, a refused write writes
to it; whatever part was refused streams through the ring from the first byte missing (a
receiver that cannot read asks for the whole message to be written). RINGLET_CMA=0 turns
CMA off; RINGLET_CMA_PUT=0 only the one-way split (those messages stream, as before it),
which by default runs only where ranks do not outnumber cores (RINGLET_CMA_PUT=1: also
there).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

import numpy as np

from ..buffers import address

try:    # one range moved in C (ctypes' call costs 3-5 us of a message's fixed cost)
    from ._fastpath import cma as _c_move
except ImportError:
    _c_move = None


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load(name: str):
    """libc's process_vm_readv or process_vm_writev, or None (not Linux, or a libc without
    it)."""
    if not hasattr(os, "sched_getaffinity"):      # (Linux only)
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv = _load("process_vm_readv")
_writev = _load("process_vm_writev")


def enabled() -> bool:
    """Whether to offer CMA at all (read at engine start: forked ranks see their own
    environment)."""
    return _readv is not None and os.environ.get("RINGLET_CMA", "1") != "0"


def read(pid: int, addr: int, dst: np.ndarray) -> int:
    """Copy ``dst.nbytes`` bytes at ``addr`` in process ``pid`` into the contiguous array
    ``dst``: the bytes read (all of them), or -errno (nothing usable was read)."""
    return _move(_readv, pid, address(dst), addr, dst.nbytes)


def write(pid: int, addr: int, src: np.ndarray) -> int:
    """Copy the contiguous array ``src`` to ``addr`` in process ``pid``: the bytes written
    (all of them), or -errno (then what was written there is not to be used)."""
    return _move(_writev, pid, address(src), addr, src.nbytes)


def _move(fn, pid: int, here: int, there: int, n: int) -> int:
    if fn is None:
        return -38        # ENOSYS
    if _c_move is not None:
        got = _c_move(fn is _writev, pid, here, there, n)
        return got if got < 0 or got == n else -5
    local = _IoVec(here, n)
    remote = _IoVec(there, n)
    got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got < 0:
        return -ctypes.get_errno()
    return got if got == n else -5    # a short copy (EIO): part of the range is not mapped


class Reader:
    """One local peer's messages moved by CMA, while the kernel allows it: ``deliver`` reads
    a message whole into a receive, ``read_tail`` reads a one-way message's tail, ``put``
    writes the head of a message of ours into the peer's receive buffer (``ok``: reads
    work; ``put_ok``: writes do)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.ok = enabled()
        mode = os.environ.get("RINGLET_CMA_PUT", "auto")
        self.put_ok = self.ok and _writev is not None and mode != "0"
        self.put_crowded = mode == "1"      # split even when ranks outnumber cores
        # crowded, a one-way message is read whole by its receiver instead of streaming
        self.whole_crowded = self.ok and os.environ.get("RINGLET_CMA_CROWDED", "1") != "0"
        self.refused = 0            # errno of the read that turned reads off (0: none)
        self.put_refused = 0        # errno of the write that turned writes off (0: none)
        self.reads = 0              # messages (or tails) read in place
        self.puts = 0               # heads written into the peer's receive buffer

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

    def splits(self, crowded: bool) -> bool:
        """Whether a one-way message of ours is offered to be split: where the kernel lets
        us write, and only while every rank has a core (``crowded``: not), since the split
        wins by using the idle sender's core. With more ranks than cores it lost to the
        stream (in-job A/B under load 15: 0.67-1.01x at p = 3-4) - and a core taken by the
        sender is one a receiver lacks."""
        return self.put_ok and (self.put_crowded or not crowded)

    def reads_whole(self, crowded: bool) -> bool:
        """Whether a one-way message offered (RTS_OFFER) is read whole by its receiver
        instead of split: where ranks outnumber cores and the split is not forced. There the sender copies nothing and each receiver reads its own message, as
        Open MPI's do, several at once on the cores there are; streamed, the sender copied
        every message into the ring alone."""
        return crowded and self.whole_crowded and not self.put_crowded

    def head_bytes(self, n: int, senders: int, receivers: int) -> int:
        """How many leading bytes of an ``n``-byte one-way message its sender is to write
        into our buffer while we read the rest: the copy shared by how busy each side is
        (``senders``: the copies the sender makes in its round - large messages, and its
        local copies when they wait for the messages (work._local_last) - ``receivers``:
        the messages our round receives). So a point-to-point send or a broadcast at p = 2
        is halved, and a scatter's root at p = 2, copying its own block meanwhile, writes a
        third; page-aligned. All of it where the kernel refuses our reads."""
        if not self.ok:
            return n
        head = n * receivers // (senders + receivers)
        return head - head % 4096 if 4096 <= head < n else head

    def read_tail(self, req, addr: int, head: int) -> bool:
        """Read bytes ``head`` to the end of the message at ``addr`` into the same bytes of
        ``req.dst`` (a copy receive, contiguous): True when done, False when refused (then
        the tail is to be streamed)."""
        if not self.ok:
            return False
        got = read(self.pid, addr + head, req.dst.view(np.uint8).reshape(-1)[head:])
        if got < 0:
            return self._refuse(-got)
        self.reads += 1
        return True

    def put(self, data: np.ndarray, addr: int) -> bool:
        """Write ``data`` (contiguous bytes: a message's head) at ``addr`` in the peer (the
        receive buffer it named): True when done, False when refused (then the head is to be
        streamed; nothing the peer may use was written)."""
        if not self.put_ok:
            return False
        got = write(self.pid, addr, data)
        if got < 0:
            self.put_ok = False
            self.put_refused = -got
            return False
        self.puts += 1
        return True

    def _refuse(self, errno: int) -> bool:
        self.ok = False
        self.refused = errno
        return False
