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
  would decline a split (a reduction). A gather's root reading every block alone lost to
  the stream, where its senders copy in at once (gather p = 4 8 MiB direct, fresh jobs in
  turns, load 9-12: 10393 us read whole against 6781 streamed); its senders now write
  their blocks whole instead (below). RINGLET_CMA_CROWDED=0: those stream, as before.

A receiver that reduces declines (CTS_OK) and takes the stream: reading into scratch and
reducing from there lost to the ring, which overlaps the sender's copy with the
receiver's reduce. A receiver whose round also copies locally (a gather's root, its own
block) posts its receives before that copy (work.EARLY_ROOT) and asks for each offered
message written whole (CTS_PUT of all of it, protocol.WRITE_WHOLE), crowded or not: the
senders write while the root copies (an offer that comes after the copy is split as any
where each rank has a core, written whole where ranks outnumber cores). Copying first and then splitting had lost to the
stream (gather p = 2 8 MiB, in-job A/B: 0.37-0.78x): the senders idled through the
root's copy. The kernel allows the calls only where ptrace would be (same user,
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


# The kernel's copy is slow when the destination lies just past the source within a page.
# Here (AMD EPYC; the kernel copies with rep movsb, which glibc's memcpy avoids in this
# case) a read or write whose destination was 1-31 bytes past the source, modulo 4096, ran
# 4-5x slower (1.4-2.3 GB/s against 7.5-10 at 512 KiB, process_vm_readv and
# process_vm_writev alike; 0 and 32-4095 bytes all fast): each load meets a store just
# made to the same place in another page (the pattern of 4K aliasing). NumPy's large arrays
# all start 16 bytes into a page, so two of them meet at distance 0 - but arrays from the
# heap need not: Open MPI's all_gather p = 2 1 MiB took 400 us instead of 100 on two arrays
# 144 and 160 bytes into their pages. Which distances are slow is measured once per process, reading
# within it at each distance of less than 64 bytes either way (4-6 ms, at the first message
# that could be read); a message at a slow one takes the ring instead (two copies at
# memcpy's speed: bench/cma_offsets.py, p = 2 8 MiB, 16 bytes: all_gather 1.69x,
# all_to_all 1.46x, broadcast 1.73x faster than reading there). RINGLET_CMA_OFFSETS=0:
# read at any distance.
PROBED = 64
_slow = None


def _probe_distances(nbytes: int = 32 << 10, reps: int = 3) -> set:
    """The distances (destination - source) mod 4096, among those within PROBED bytes of 0
    either way, at which a read took more than twice as long as the median distance's (most
    are fast; a read that a preemption slowed at one distance is not taken for it)."""
    import statistics
    import time
    buf = np.ones(2 * nbytes + 3 * 4096, np.uint8)
    base = address(buf)
    src = base + (-base) % 4096
    dst = src + nbytes + 4096          # (same place in its page as src: distance 0)
    pid, took = os.getpid(), {}
    if _move(_readv, pid, dst, src, nbytes) != nbytes:    # (warm: pages and caches)
        return set()                   # (refused: nothing to learn; reads will say)
    for d in list(range(PROBED)) + list(range(4096 - PROBED, 4096)):
        at = dst + d if d < PROBED else dst - (4096 - d)
        t = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            _move(_readv, pid, at, src, nbytes)
            t = min(t, time.perf_counter() - t0)
        took[d] = t
    typical = statistics.median(took.values())
    return {d for d, t in took.items() if t > 2 * typical}


def fast_offset(dst: int, src: int) -> bool:
    """Whether the kernel copies quickly from address ``src`` to ``dst`` (above)."""
    global _slow
    if _slow is None:
        _slow = (set() if _readv is None or os.environ.get("RINGLET_CMA_OFFSETS") == "0"
                 else _probe_distances())
    return (dst - src) % 4096 not in _slow


_bits = (None, (0, 0))


def slow_bits() -> tuple[int, int]:
    """The slow distances (``fast_offset``'s, probed at the first call) as the C fast path
    takes them: two 64-bit masks, bit d for d < 64 and bit d - 4032 for d >= 4032."""
    global _bits
    fast_offset(0, 0)
    if _bits[0] is not _slow:
        _bits = (_slow, (sum(1 << d for d in _slow if d < PROBED),
                         sum(1 << (d - (4096 - PROBED)) for d in _slow if d >= 4096 - PROBED)))
    return _bits[1]


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
        self.slow_offsets = 0       # messages streamed instead: at a slow offset (fast_offset)

    def deliver(self, req, addr: int, nbytes: int) -> bool:
        """Read the ``nbytes`` message at ``addr`` into ``req`` (a RecvRequest at offset 0):
        True when done; False when it is not for CMA (a reduction: reading into scratch and
        reducing from there lost to the ring, which overlaps the sender's copy with the
        receiver's reduce) or CMA is refused; then ``req`` is untouched: stream it."""
        if not self.ok or req.ufunc is not None or not req.dst.flags.c_contiguous:
            return False
        dst = req.dst.view(np.uint8).reshape(-1)
        if not self.fast_at(address(dst), addr):
            return False
        got = read(self.pid, addr, dst)
        if got < 0:
            return self._refuse(-got)
        req.offset = nbytes
        self.reads += 1
        return True

    def fast_at(self, dst: int, src: int) -> bool:
        """Whether to move a message from ``src`` to ``dst`` by CMA, read or written: not
        at a distance where the kernel's copy is slow (fast_offset), counted."""
        if fast_offset(dst, src):
            return True
        self.slow_offsets += 1
        return False

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
