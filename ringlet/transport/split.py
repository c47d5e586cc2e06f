"""A one-way message read in place, copied (or reduced) by both of its ends at once.

An rl.empty message read in place costs its receiver the whole copy while its sender, with
nothing else to do in its round (a broadcast's root, a gather's leaf, point-to-point),
waits for it. When the receive's destination lies in an rl.empty buffer too, the sender can
write into it: the sender offers (RTS_ZC_HELP), the receiver answers CTS_SPLIT naming its
destination (allocation, fd, offset) and starts copying from the front in CHUNK pieces while
the sender, mapping that destination, copies from the back. Each claims a chunk with a
compare-and-swap on one word in the pair's ring control (``_fastpath.split_copy``), so no
chunk is copied twice and the faster side simply copies more: a sender still busy with
its own copy when the offer is taken helps with what is left, or not at all. The receiver
completes once every chunk is counted done (the sender's last one included: nothing writes
into its buffer after the receive returns) and answers CTS_DONE as for any message read in
place. A receive that reduces in place (dst = op(dst, message), a reduce's or an
all_reduce's one-way step) is split the same way when C has the kernel (fast.kernel), from
a larger size (limits.SPLIT_REDUCE_MIN): the sender reduces its chunks into the
receiver's buffer with the same elementwise kernel. Where ranks outnumber cores a sender
with other copies in its round offers help only from limits.SPLIT_BUSY_MIN (limits.py).
RINGLET_SPLIT=0 turns it off.
"""
from __future__ import annotations

import os
import time

import numpy as np

from ..buffers import locate
from ..errors import TimeoutError
from . import fast, limits
from .protocol import CTS_SPLIT

CHUNK = limits.SPLIT_CHUNK       # bytes a side claims at a time
MIN_BYTES = limits.SPLIT_MIN     # smaller messages: one side copies it all
REDUCE_MIN_BYTES = limits.SPLIT_REDUCE_MIN   # ... or reduces it all (limits.py)


def enabled() -> bool:
    """Read at engine start (forked ranks see their own environment)."""
    return fast._fastpath is not None and os.environ.get("RINGLET_SPLIT", "1") != "0"


def claim_word(msgid: int, chunks: int) -> int:
    return (msgid & 0xFFFF) << 48 | chunks


def _addr(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def ctrl_of(ring) -> np.ndarray:
    """Words [2] (claim) and [3] (done) of ``ring``'s control (shm.Ring.ctrl; [0] is its
    head, [8] its tail), as uint64."""
    return np.frombuffer(ring.ctrl, np.uint64)[2:4]


class Receiver:
    """The receiving end of one link (one ShmPeer): splits the messages it may."""

    def __init__(self, peer):
        self.peer = peer
        self.ctrl = ctrl_of(peer.inbox)
        self.splits = 0          # messages copied by both ends
        self.pending = None      # (req, src, msgid, nbytes, kernel, chunks) the sender copies

    def read(self, req, src: np.ndarray, msgid: int, nbytes: int) -> bool:
        """Copy the message at ``src`` (the sender's buffer, mapped) into ``req`` with the
        sender's help: False (nothing done) when it cannot - a reduction, or a destination
        not in an rl.empty buffer - or while the words are another's (``offer``'s)."""
        started = self._start(req, src, msgid, nbytes) if self.pending is None else None
        if started is None:
            return False
        self._finish(*started)
        return True

    def offer(self, req, src: np.ndarray, msgid: int, nbytes: int) -> bool:
        """Let the sender copy the message into ``req`` alone while this rank copies its own
        block (a receive posted before its round's local copies: protocol.WRITE_WHOLE);
        ``join`` then takes what is left. False (nothing done) where ``read`` could not, or
        where this link has such a message already (one split at a time on its words)."""
        if self.pending is not None:
            return False
        self.pending = self._start(req, src, msgid, nbytes)
        return self.pending is not None

    def join(self, req) -> bool:
        """``req``, if ``offer`` left it to the sender, once this rank is free: copy the
        chunks still unclaimed and wait for the sender's (True), else False. A receive
        that failed meanwhile (its call aborted) is only let go."""
        started = self.pending
        if started is None or started[0] is not req:
            return False
        self.pending = None
        if not req.done:
            self._finish(*started)
        return True

    def _start(self, req, src, msgid, nbytes):
        """Name our destination to the sender (CTS_SPLIT), which then claims chunks from
        the back: the arguments of ``_finish``, or None where the split cannot be."""
        dst = req.dst
        if nbytes < (MIN_BYTES if req.ufunc is None else REDUCE_MIN_BYTES) \
                or not dst.flags.c_contiguous:
            return None
        kernel = -1
        if req.ufunc is not None:   # dst = op(dst, message), in C's kernel
            kernel = fast.kernel(req.ufunc, req.dtype)
            if kernel is None or req.acc is not dst or _addr(dst) % req.itemsize \
                    or _addr(src) % req.itemsize:
                return None
        where = locate(dst)
        if where is None:
            return None
        chunks = -(-nbytes // CHUNK)
        ctrl = self.ctrl
        ctrl[1] = 0
        ctrl[0] = claim_word(msgid, chunks)      # (before the CTS that lets the sender in)
        alloc, fd, offset = where
        peer = self.peer
        peer._queue_cts(msgid, CTS_SPLIT, offset, alloc << 32 | fd, kernel + 1)
        peer.pump_out()
        return req, src, msgid, nbytes, kernel, chunks

    def _finish(self, req, src, msgid, nbytes, kernel, chunks) -> None:
        """Copy chunks from the front while any are unclaimed, then wait for the sender's."""
        dst, ctrl, peer = req.dst, self.ctrl, self.peer
        fast._fastpath.split_copy(_addr(dst), _addr(src), nbytes, CHUNK, _addr(ctrl), True,
                                  msgid, kernel)
        # the sender's last chunk may still be on its way: it writes into dst, so wait
        spins = 0
        deadline = time.monotonic() + peer.engine.timeout
        while int(ctrl[1]) < chunks:
            spins += 1
            if spins & 1023 == 0:
                os.sched_yield()
                if spins & 0xFFFF == 0:
                    if not peer.check_alive():
                        req.fail(peer.dead)      # (its process exited mid-copy)
                        return
                    if time.monotonic() > deadline:
                        req.fail(TimeoutError(
                            f"recv from rank {peer.rank}: its copy of a shared message "
                            f"({nbytes} B) stalled for {peer.engine.timeout:g} s"))
                        return
        req.offset = nbytes
        self.splits += 1


class Sender:
    """The sending end of one link: helps copy its messages the receiver split."""

    def __init__(self, peer):
        self.peer = peer
        self.ctrl = ctrl_of(peer.outbox)
        self.helped = 0          # chunks this end copied

    def help(self, req, offset: int, zc: int, kernel: int) -> None:
        """Copy (``kernel`` -1) or reduce (C's kernel ``kernel``) chunks of ``req``
        (awaiting CTS_DONE) into the receiver's destination at ``offset`` in its allocation
        ``zc`` (alloc << 32 | fd), while any are left."""
        peer = self.peer
        if kernel >= fast.N_KERNELS or (kernel >= 0 and _addr(req.data) % fast.itemsize_of(kernel)):
            return                 # not one we can do: the receiver does it all
        dst = peer.engine.remote_maps.view(peer.pid, zc >> 32, zc & 0xFFFFFFFF, offset,
                                           req.nbytes, writable=True)
        if dst is None:
            return                 # cannot map it: the receiver does it all
        self.helped += fast._fastpath.split_copy(_addr(dst), _addr(req.data), req.nbytes, CHUNK,
                                                 _addr(self.ctrl), False, req.msgid, kernel)
