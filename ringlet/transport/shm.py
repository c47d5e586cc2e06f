"""Shared-memory transport between ranks of one host.

Every rank owns one *inbox* segment (an anonymous memfd that local peers of the same user
open through ``/proc/<pid>/fd``) holding one ring per local peer; a peer writes packets
into its ring in the owner's inbox and the owner reads them in place — copying or
reducing straight out of the ring into the destination. The segment has no name, so
nothing of the job stays under /dev/shm however it ends (a failed init, a SIGKILL).

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

from ..group import TAG_GROUP_SHIFT, call_number, group_of
from . import cma, copies, limits, split
from .protocol import (ABORT, CTS_DONE, DATA, EAGER, HEADER, HEADER_SIZE, PAD, WRITE_WHOLE,
                       Peer, ProtocolError, peer_failure)

SEG_HEADER = 64
SLOT_CTRL = 128
# a ring's control words ([0] head, [2]-[3] split.py's, [8] tail): [4]-[7], the calls its
# sender gave up (ShmPeer.gave_up)
GAVE_UP_AT, GAVE_UP_WORDS = 4, 4
_SEQ_BITS = 40       # a word: group id (bits 48-62), 8 calls before the latest (40-47), latest
_SEQ = (1 << _SEQ_BITS) - 1

# sizes: see limits.py
RING_BYTES, FRAG_BYTES, EAGER_BYTES = limits.RING_BYTES, limits.SHM_FRAG_BYTES, limits.SHM_EAGER_BYTES
STREAM_BYTES, ZERO_COPY_MIN = limits.SHM_STREAM_BYTES, limits.ZERO_COPY_MIN
ZERO_COPY_ONEWAY_MIN = limits.ZERO_COPY_ONEWAY_MIN
CMA_MIN = limits.CMA_MIN


def _gave_up_word(word: int, tag: int) -> int:
    """A group's gave-up word (0: none yet) after its call ``tag`` was given up too."""
    seq = call_number(tag) & _SEQ
    if not word:
        return (group_of(tag) << TAG_GROUP_SHIFT) | seq
    latest, mask = word & _SEQ, (word >> _SEQ_BITS) & 0xFF
    if seq > latest:         # the latest moves up: the old one and its mask go behind it
        k = seq - latest
        mask = ((mask << k) | (1 << (k - 1))) & 0xFF if k <= 8 else 0
        latest = seq
    elif 0 < latest - seq <= 8:
        mask |= 1 << (latest - seq - 1)
    return (group_of(tag) << TAG_GROUP_SHIFT) | (mask << _SEQ_BITS) | latest


def segment_size(slots: int, capacity: int) -> int:
    return SEG_HEADER + slots * (SLOT_CTRL + capacity)


def create_segment(size: int) -> tuple[mmap.mmap, int]:
    """A rank's rings: an anonymous memfd (no name under /dev/shm, so nothing can outlive
    the job however it ends). Returns the mapping and the fd local peers open through
    /proc/<pid>/fd until they have mapped it."""
    fd = os.memfd_create("ringlet-rings", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size), fd
    except BaseException:
        os.close(fd)
        raise


def open_segment(pid: int, fd: int, size: int) -> mmap.mmap:
    """Map a local peer's rings (its memfd, while it keeps it open)."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        mine = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise OSError(f"cannot open the shared-memory rings of process {pid} ({path}: "
                      f"{exc.strerror}); ranks on one host must run as the same user") from exc
    try:
        if os.fstat(mine).st_size != size:
            raise OSError(f"shared-memory rings of process {pid} have the wrong size")
        return mmap.mmap(mine, size)
    finally:
        os.close(mine)


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
    def __init__(self, engine, rank: int, inbox: Ring, outbox: Ring, doorbell: Bell, pid: int,
                 eager: int = EAGER_BYTES, frag: int = FRAG_BYTES):
        frag = min(frag, outbox.capacity // 4)
        # an EAGER packet must fit wherever the head is (PAD skips the ring's tail end)
        super().__init__(engine, rank, min(eager, outbox.capacity // 2 - HEADER_SIZE), frag)
        # ... and what the peer's eager limit is towards us: the same rule on its ring here
        # (both ends of a direction see one ring, so both know its limit: collectives' pieces)
        self.eager_in = min(eager, inbox.capacity // 2 - HEADER_SIZE)
        self.zc_min = min(ZERO_COPY_MIN, self.eager)   # a tiny ring: RTS sooner, still in place
        self.stream_max = min(STREAM_BYTES, outbox.capacity)
        # (a smaller ring takes less at once: a one-way message goes in place sooner)
        self.zc_oneway_min = max(self.zc_min, min(ZERO_COPY_ONEWAY_MIN, self.stream_max * 7 // 8))
        self.inbox, self.outbox = inbox, outbox
        self.doorbell, self.pid = doorbell, pid
        self._gave_up = 0                    # calls this rank said it gave up (gave_up)
        self.cma = cma.Reader(pid)           # reads this peer's private buffers in place
        # (above what streams: a ring smaller than CMA_MIN, RINGLET_SHM_RING, lowers it)
        self.cma_min = min(CMA_MIN, self.stream_max) if self.cma.ok else -1
        # a point-to-point send keeps the ring's: up to it a blocking send completes without
        # its receiver (limits.py, ZERO_COPY_P2P_MIN)
        self.p2p_zc_min = max(self.zc_min, min(limits.ZERO_COPY_P2P_MIN, self.stream_max * 7 // 8))
        self.p2p_cma_min = self.stream_max if self.cma.ok else -1
        # one-way messages read in place, copied by both ends (split.py)
        on = split.enabled()
        self.split_sender = split.Sender(self) if on else None
        self.split_receiver = split.Receiver(self) if on else None

    # Where this rank writes next (its ring in the peer's inbox) and reads next (the peer's
    # in its own): the control words it publishes them in, and nowhere else, so the C fast
    # path and this engine share them without handing them over (fast.py).
    @property
    def head(self) -> int:
        return self.outbox.ctrl[0]

    @property
    def tail(self) -> int:
        return self.inbox.ctrl[8]

    # -- out -----------------------------------------------------------------------------
    zero_copy = True

    def read_remote(self, req, where, nbytes, msgid):
        if isinstance(where, int):          # a private buffer's address: cma.py
            return self.cma.deliver(req, where, nbytes)
        alloc, fd, offset, helper = where
        src = self.engine.remote_maps.view(self.pid, alloc, fd, offset, nbytes)
        if src is None:
            return False
        if helper and self.split_receiver is not None:
            if req.ways == WRITE_WHOLE:     # the sender copies it while we copy ours
                if self.split_receiver.offer(req, src, msgid, nbytes):
                    return None             # (join_split completes it)
            elif self.split_receiver.read(req, src, msgid, nbytes):
                return True
        req.deliver(src)
        return True

    def join_split(self, req) -> None:
        """Once this rank's local copies are done: complete ``req`` if its sender has been
        copying it meanwhile (split.Receiver.offer), helping with what is left."""
        if self.split_receiver is not None and self.split_receiver.join(req) \
                and not req.done:
            self._received(req)
            self._queue_cts(req.msgid, CTS_DONE, 0)
            self.pump_out()

    def _write(self, kind, flags, tag, msgid, length, aux, payload, fp1=0, fp2=0, zc=0) -> bool:
        ring = self.outbox
        ctrl, cap = ring.ctrl, ring.capacity
        head = ctrl[0]
        need = HEADER_SIZE + (_round64(length) if payload is not None else 0)
        free = cap - (head - ctrl[8])
        pos = head % cap
        if cap - pos < need:  # skip the ring's tail end
            if free < (cap - pos) + need:
                return False
            HEADER.pack_into(ring.seg, ring.base + pos, PAD, 0, 0, 0, 0, 0, 0, 0, 0)
            head += cap - pos
            free -= cap - pos
            pos = 0
        if free < need:
            return False
        if payload is not None and length:
            copies.assign(ring.bytes[pos + HEADER_SIZE:pos + HEADER_SIZE + length], payload)
        HEADER.pack_into(ring.seg, ring.base + pos, kind, flags, tag, msgid, length, aux, fp1, fp2,
                         zc)
        ctrl[0] = head + need             # publish (stores are ordered on x86-64)
        if ring.asleep[0]:
            self.engine.ring_doorbell(self.doorbell)
        return True

    # -- in ------------------------------------------------------------------------------
    def _poll_in(self) -> bool:
        ring = self.inbox
        ctrl = ring.ctrl
        head, tail = ctrl[0], ctrl[8]
        if head == tail:
            return False
        cap, seg, base, data = ring.capacity, ring.seg, ring.base, ring.data
        while tail < head:
            pos = tail % cap
            kind, flags, tag, msgid, length, aux, fp1, fp2, zc = HEADER.unpack_from(seg, base + pos)
            if kind == PAD:
                tail += cap - pos
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
                tail += HEADER_SIZE + (_round64(length) if carries else 0)
            ctrl[8] = tail                # hand the space back to the sender
        if self.outbox.asleep[0]:         # a sender asleep on a full ring needs the news too
            self.engine.ring_doorbell(self.doorbell)
        return True

    def gave_up(self, tag: int) -> None:
        """Say in this direction's control words (from GAVE_UP_AT, in the head's cache
        line; only this rank writes them) that this rank gave up collective ``tag``, before
        it returns to its caller: the peer may be reading one of the call's messages in
        place from the caller's buffer, and the ABORT can wait behind other traffic for
        longer than the caller waits for it (Engine.flush_aborts). A word per group (the last
        GAVE_UP_WORDS groups): its latest call given up and which of the 8 before it were
        (``_gave_up_word``)."""
        ctrl, group = self.outbox.ctrl, group_of(tag)
        words = ctrl[GAVE_UP_AT:GAVE_UP_AT + GAVE_UP_WORDS].tolist()
        at = next((i for i, w in enumerate(words) if w and group_of(w) == group), None)
        if at is None:
            at, words[at] = self._gave_up % GAVE_UP_WORDS, 0
            self._gave_up += 1
        ctrl[GAVE_UP_AT + at] = _gave_up_word(words[at], tag)

    def gave_up_on(self, tag: int) -> bool:
        """Whether the peer said it gave up collective ``tag`` (``gave_up``, its side).
        Also for a call older than its word's window of 9: a peer whose message of it is
        still being read in place cannot have completed it (its send waits for the
        reader's answer), and it went on to give up 9 later ones meanwhile."""
        group, seq = group_of(tag), call_number(tag) & _SEQ
        for w in self.inbox.ctrl[GAVE_UP_AT:GAVE_UP_AT + GAVE_UP_WORDS].tolist():
            if w and group_of(w) == group:
                behind = (w & _SEQ) - seq
                return behind == 0 or behind > 8 or \
                    (behind > 0 and bool(w >> (_SEQ_BITS + behind - 1) & 1))
        return False

    def abort_waiting(self, tag: int) -> bool:
        """Whether an ABORT of call ``tag`` waits in the ring from this peer, unread (a
        look only: nothing is taken)."""
        ring = self.inbox
        ctrl = ring.ctrl
        head, tail = ctrl[0], ctrl[8]
        cap, seg, base = ring.capacity, ring.seg, ring.base
        while tail < head:
            pos = tail % cap
            kind, _, t, _, length = HEADER.unpack_from(seg, base + pos)[:5]
            if kind == PAD:
                tail += cap - pos
                continue
            if kind == ABORT and t == tag:
                return True
            tail += HEADER_SIZE + (_round64(length) if kind in (DATA, EAGER) else 0)
        return False

    def close(self) -> None:
        self.inbox = self.outbox = None    # (their views pin the segments' mappings)
        self.split_sender = self.split_receiver = None     # (theirs too)
        self.doorbell.close()

    # -- liveness ------------------------------------------------------------------------
    def check_alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            if state in (b"Z", b"X"):
                raise FileNotFoundError
            return True
        except (FileNotFoundError, IndexError, ProcessLookupError):
            # its last words first (an ABORT naming who failed before it, or the message a
            # call of ours waits for): while they still come, the wait takes them, and the
            # next look, its ring empty, fails it
            if self._poll_in():
                return True
            self.fail(peer_failure(self.rank, f"process {self.pid} exited"))
            return False


class Doorbell:
    """A pipe local senders write a byte into to wake this rank while it sleeps. Peers open
    its read end through ``/proc/<pid>/fd`` for writing, which works across network
    namespaces (an abstract socket's name would not), and it is gone with the process.
    This rank keeps a write end open too, so the pipe never reads as hung up before every
    peer has opened it."""

    def __init__(self):
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def fileno(self) -> int:
        return self.r

    def ring(self) -> None:
        """Wake this rank's own sleeper (another thread of it wants the engine)."""
        try:
            os.write(self.w, b"!")
        except OSError:
            pass  # full: a wake-up is pending already

    def drain(self) -> None:
        try:
            while os.read(self.r, 64):   # (a byte per ring: a small read allocates little)
                pass
        except (BlockingIOError, InterruptedError, OSError):
            pass

    def close(self) -> None:
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.r = self.w = -1


class Bell:
    """A local peer's doorbell, seen from its senders: the write end of its pipe."""

    def __init__(self, pid: int, fd: int):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise OSError(f"cannot open the doorbell of process {pid} ({path}: "
                          f"{exc.strerror})") from exc

    def ring(self) -> None:
        try:
            os.write(self.fd, b"!")
        except OSError:
            pass  # full: the peer has a wake-up pending already; gone: liveness will tell

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


def _ns_inode(kind: str) -> str:
    try:
        return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
    except OSError:
        return "?"


def detect_host_id() -> str:
    """This process's host as shared memory sees it: ranks share a host when they run on
    one boot of one kernel (boot id), in one network namespace and one PID namespace (so
    ``/proc/<pid>`` names the same process for both and the rings and doorbells open);
    whether they really can open each other's rings is then tried at init. The hostname
    leads, for people reading it; it decides nothing."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}/net{_ns_inode('net')}/pid{_ns_inode('pid')}"
