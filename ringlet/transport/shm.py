"""Shared-memory transport between ranks of one host.

Every rank owns one *inbox* segment (``/dev/shm/ringlet-<job>-<rank>``, mode 0600) holding
one ring per local peer; a peer writes packets into its ring in the owner's inbox and the
owner reads them in place — copying or reducing straight out of the ring into the
destination. Once every local rank has mapped the segments they are unlinked, so nothing
of the job stays under /dev/shm even if a rank is SIGKILLed.

Layout: a 64-byte segment header (byte 0: "owner is asleep" flag) then, per peer slot,
128 bytes of control (head at +0, written by the sender; tail at +64, written by the
owner) and ``capacity`` bytes of ring. Head and tail are byte counters that only grow.
Packets are 64-byte aligned and never wrap (a PAD packet skips the ring's tail end).
Ordering relies on x86-64's total store order: payload stores are visible before the
head store that publishes them.
"""
from __future__ import annotations

import mmap
import os
import socket

import numpy as np

from .protocol import DATA, EAGER, HEADER, HEADER_SIZE, PAD, Peer, ProtocolError, peer_failure

SEG_HEADER = 64
SLOT_CTRL = 128
# Each direction of each local pair (RINGLET_SHM_RING overrides). Small enough that a
# fragment is read back while still in cache: a sender can run at most a ring ahead of its
# receiver. Measured side by side, p = 2, 8 MiB, busbw: all_gather 4.9 -> 8.4 GB/s,
# all_to_all 5.2 -> 6.6, broadcast 16.5 -> 24.4 with a 1 MiB ring instead of 4 MiB.
# (+ 128 B: two whole EAGER packets of 512 KiB fit, headers included.)
RING_BYTES = (1 << 20) + 128
FRAG_BYTES = 256 << 10  # largest DATA fragment (at most a quarter of the ring)
# A message of up to half the ring goes eagerly, as one packet: the RTS/CTS round trip only
# pays when the data needs several fragments anyway (at 16 KiB, 64-256 KiB all_reduce calls
# spent 30-45% of their time waiting for CTS), and a call of EAGER packets runs in C
# (fast.py). 512 KiB instead of 256, side by side, two turns, busbw at p = 2, 1 MiB:
# all_gather 7.6-9.9 -> 14.5-16.7 GB/s, all_to_all 6.8-7.7 -> 11.9-12.1.
EAGER_BYTES = 512 << 10
# Up to the ring's size, a larger message's DATA follows its RTS at once instead of after
# the CTS round trip (a receiver not ready parks it, as it keeps an eager one). p = 2,
# 512 KiB - 2 MiB, best of 4 side by side: 3-9% faster in 11 of 12 (collective, size)
# cells, e.g. all_to_all 1 MiB 71.3 -> 66.4 us, broadcast 1 MiB 56.7 -> 52.6 us.
STREAM_BYTES = RING_BYTES
# Except from an rl.empty buffer: above this, its RTS lets the receiver copy (or reduce)
# the message once, in place, instead of twice through the ring. Not below: a call of
# EAGER packets runs in C (fast.py), which beats one copy fewer plus the RTS round trip and
# Python - rl.empty, forced algorithms, 300 calls, 16 KiB vs 256 KiB here, two turns:
# all_reduce p=2 64 KiB 40-44 -> 10 us, all_to_all p=4 1 MiB 204-218 -> 110-155 us,
# all_gather p=4 1 MiB 249-271 -> 100-110 us, broadcast p=4 256 KiB 90-113 -> 43-46 us.
ZERO_COPY_MIN = EAGER_BYTES


def segment_size(slots: int, capacity: int) -> int:
    return SEG_HEADER + slots * (SLOT_CTRL + capacity)


def create_segment(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def open_segment(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"shared-memory segment {path} has the wrong size")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _round64(n: int) -> int:
    return (n + 63) & ~63


class Ring:
    """One direction of one pair: a ring inside some rank's inbox segment."""

    def __init__(self, seg: mmap.mmap, slot: int, capacity: int):
        base = SEG_HEADER + slot * (SLOT_CTRL + capacity)
        whole = memoryview(seg)
        self.seg = seg
        # memoryview indexing costs a third of NumPy scalar access: these are the hot words.
        self.ctrl = whole[base:base + SLOT_CTRL].cast("Q")     # [0] head, [8] tail
        self.asleep = whole[0:8].cast("Q")                     # [0] the owner's sleep flag
        self.base = base + SLOT_CTRL
        self.bytes = whole[self.base:self.base + capacity]
        self.data = np.frombuffer(seg, np.uint8, capacity, self.base)
        self.capacity = capacity


class ShmPeer(Peer):
    def __init__(self, engine, rank: int, inbox: Ring, outbox: Ring, doorbell: bytes, pid: int,
                 eager: int = EAGER_BYTES, frag: int = FRAG_BYTES):
        frag = min(frag, outbox.capacity // 4)
        # an EAGER packet must fit wherever the head is (PAD skips the ring's tail end)
        super().__init__(engine, rank, min(eager, outbox.capacity // 2 - HEADER_SIZE), frag)
        self.zc_min = min(ZERO_COPY_MIN, self.eager)   # a tiny ring: RTS sooner, still in place
        self.stream_max = min(STREAM_BYTES, outbox.capacity)
        self.inbox, self.outbox = inbox, outbox
        self.doorbell, self.pid = doorbell, pid
        self.tail = inbox.ctrl[8]
        self.head = outbox.ctrl[0]

    # -- out -----------------------------------------------------------------------------
    zero_copy = True

    def remote_view(self, where, nbytes):
        alloc, fd, offset = where
        return self.engine.remote_maps.view(self.pid, alloc, fd, offset, nbytes)

    def _write(self, kind, flags, tag, msgid, length, aux, payload, fp1=0, fp2=0, zc=0) -> bool:
        ring = self.outbox
        cap = ring.capacity
        need = HEADER_SIZE + (_round64(length) if payload is not None else 0)
        free = cap - (self.head - ring.ctrl[8])
        pos = self.head % cap
        if cap - pos < need:  # skip the ring's tail end
            if free < (cap - pos) + need:
                return False
            HEADER.pack_into(ring.seg, ring.base + pos, PAD, 0, 0, 0, 0, 0, 0, 0, 0)
            self.head += cap - pos
            free -= cap - pos
            pos = 0
        if free < need:
            return False
        if payload is not None and length:
            ring.bytes[pos + HEADER_SIZE:pos + HEADER_SIZE + length] = payload
        HEADER.pack_into(ring.seg, ring.base + pos, kind, flags, tag, msgid, length, aux, fp1, fp2,
                         zc)
        self.head += need
        ring.ctrl[0] = self.head          # publish (stores are ordered on x86-64)
        if ring.asleep[0]:
            self.engine.ring_doorbell(self.doorbell)
        return True

    # -- in ------------------------------------------------------------------------------
    def _poll_in(self) -> bool:
        ring = self.inbox
        head = ring.ctrl[0]
        if head == self.tail:
            return False
        cap, seg, base, data = ring.capacity, ring.seg, ring.base, ring.data
        while self.tail < head:
            pos = self.tail % cap
            kind, flags, tag, msgid, length, aux, fp1, fp2, zc = HEADER.unpack_from(seg, base + pos)
            if kind == PAD:
                self.tail += cap - pos
            else:
                carries = kind in (DATA, EAGER)
                if carries and (length < 0 or pos + HEADER_SIZE + length > cap):
                    self.engine.protocol_violation(self, f"packet length {length} out of range")
                    return True
                payload = data[pos + HEADER_SIZE:pos + HEADER_SIZE + length]
                try:
                    if kind == DATA:
                        req = self.data_target(msgid, length, aux)
                        req.deliver(payload)
                        self.data_done(req)
                    elif kind == EAGER and length > self.eager:
                        raise ProtocolError("oversized eager packet")
                    else:
                        self._on_packet(kind, flags, tag, msgid, length, aux, (fp1, fp2),
                                        payload, zc)
                except (ProtocolError, ValueError) as exc:
                    self.engine.protocol_violation(self, str(exc))
                    return True
                self.tail += HEADER_SIZE + (_round64(length) if carries else 0)
            ring.ctrl[8] = self.tail      # hand the space back to the sender
        if self.outbox.asleep[0]:         # a sender asleep on a full ring needs the news too
            self.engine.ring_doorbell(self.doorbell)
        return True

    def close(self) -> None:
        self.inbox = self.outbox = None    # (their views pin the segments' mappings)

    # -- liveness ------------------------------------------------------------------------
    def check_alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            if state in (b"Z", b"X"):
                raise FileNotFoundError
            return True
        except (FileNotFoundError, IndexError, ProcessLookupError):
            self._poll_in()   # its last words first: an ABORT naming who failed before it
            self.fail(peer_failure(self.rank, f"process {self.pid} exited"))
            return False


def make_doorbell(name: bytes) -> socket.socket:
    """A datagram socket in the abstract namespace (no file, gone with the process) that
    local senders poke to wake this rank when it sleeps."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(b"\0" + name)
    s.setblocking(False)
    return s
