"""TCP transport between ranks on different hosts: one or more authenticated connections
per pair (``lanes``), non-blocking in both directions (full duplex: large simultaneous
sends never deadlock). Control packets and small messages go on the first lane; a large
message's DATA is cut into pieces dealt round robin over all lanes (piece i on lane
i % lanes: both ends know where each piece goes, so each lane's pieces are checked in
order), and reassembled by offset. Copy-DATA is received straight into the destination;
reduce-DATA (TCP_REDUCE_CHUNK at a time: limits.py) and EAGER payloads go through a bounce
buffer.

Where both ranks of a pair ask for it (RINGLET_TCP_THREADS, limits.TCP_THREAD_MIN), the
pair opens one more connection whose DATA two threads of each peer move (Threads): a
message from that size up is asked for there by its receiver's CTS, written whole by the
sender's writer thread and read (and reduced) by the receiver's reader thread, while the
engine keeps control packets, small messages and matching. limits.py says where it wins."""
from __future__ import annotations

import array
import fcntl
import os
import socket
import struct
import termios
import threading
from collections import deque
from queue import SimpleQueue

import numpy as np

from . import limits
from .protocol import (ABORT, BYE, CTS, CTS_OK, DATA, EAGER, HEADER, HEADER_SIZE, KINDS, RTS,
                       Peer, ProtocolError, RecvRequest, peer_failure)

# At most this many reads per _poll_in call: a peer that streams packets (PAD, BYE,
# unexpected EAGER…) faster than we parse them must not keep progress() from returning,
# or the waiter would never reach its deadline check.
POLL_BUDGET = 1024
IOV_MAX = 64          # parts of wpending handed to one sendmsg


EAGER_BYTES, FRAG_BYTES = limits.TCP_EAGER_BYTES, limits.TCP_FRAG_BYTES   # (see limits.py)


def _env_bytes(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        size = int(value) if value else default
    except ValueError:
        size = -1
    if size < 0:
        raise ValueError(f"{name}={value!r}: give a socket buffer size in bytes (0: the "
                         f"kernel's autotuning)")
    return size


def tcp_buffers() -> tuple[int, int]:
    """Each connection's SO_SNDBUF and SO_RCVBUF (0: autotuned): RINGLET_TCP_SNDBUF,
    RINGLET_TCP_RCVBUF, else limits.py's."""
    return (_env_bytes("RINGLET_TCP_SNDBUF", limits.TCP_SNDBUF),
            _env_bytes("RINGLET_TCP_RCVBUF", limits.TCP_RCVBUF))


def tcp_thread_min() -> int:
    """Messages from this many bytes up are received (and, at the receiver's word, sent) by
    helper threads over a connection of their own (0: never): RINGLET_TCP_THREADS, else
    limits.TCP_THREAD_MIN (read at init)."""
    value = os.environ.get("RINGLET_TCP_THREADS", "")
    try:
        size = int(value) if value else limits.TCP_THREAD_MIN
    except ValueError:
        size = -1
    if size < 0:
        raise ValueError(f"RINGLET_TCP_THREADS={value!r}: give the smallest message in bytes "
                         f"that helper threads move (0: none)")
    return size


def tcp_lanes() -> int:
    """Connections this rank opens per remote peer (a pair uses the fewer of its two
    ranks'): RINGLET_TCP_LANES, else limits.TCP_LANES (read at init, not import, so
    forked ranks see their own environment)."""
    value = os.environ.get("RINGLET_TCP_LANES", "")
    try:
        lanes = int(value) if value else limits.TCP_LANES
    except ValueError:
        raise ValueError(f"RINGLET_TCP_LANES={value!r}: give a whole number of connections "
                         f"per peer, 1 to 16") from None
    if not 1 <= lanes <= 16:
        raise ValueError(f"RINGLET_TCP_LANES={value!r}: give 1 to 16 connections per peer")
    return lanes


def _configure(sock, blocking: bool, sndbuf: int, rcvbuf: int) -> None:
    """A connection's options: blocking or not, no Nagle delay, and the socket buffers
    (0: the kernel's autotuning)."""
    sock.setblocking(blocking)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt, size in ((socket.SO_SNDBUF, sndbuf), (socket.SO_RCVBUF, rcvbuf)):
        if size:
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, size)
            except OSError:
                pass


class Lane:
    """One connection of a pair: its socket, the bytes its kernel has not taken yet, and
    the packet being read from it."""
    __slots__ = ("index", "sock", "wpending", "queued", "flushed", "hbuf", "hgot", "lowat",
                 "bounce", "pkt", "ptarget", "pgot", "sub", "events", "expect")

    def __init__(self, index: int, sock: socket.socket, bounce: int, sndbuf: int = 0,
                 rcvbuf: int = 0):
        _configure(sock, False, sndbuf, rcvbuf)
        self.index, self.sock = index, sock
        self.wpending: list = []                  # bytes not yet accepted by the kernel
        self.queued = self.flushed = 0            # bytes ever put in / taken from wpending
        self.hbuf = bytearray(HEADER_SIZE)
        self.hgot = 0
        self.lowat = 1                            # SO_RCVLOWAT now set (see _await)
        self.bounce = bytearray(bounce)
        self.pkt = None                           # header of the packet whose payload we read
        self.ptarget: memoryview | None = None
        self.pgot = 0
        self.sub = 0                              # bytes of a reducing piece applied so far
        self.events = 0                           # what a selector watches it for
        self.expect: dict = {}                    # msgid -> offset of its next piece here


class TcpPeer(Peer):
    def __init__(self, engine, rank: int, sock, eager: int = EAGER_BYTES,
                 frag: int = FRAG_BYTES, data: bool = False):
        super().__init__(engine, rank, eager, frag)
        socks = list(sock) if isinstance(sock, (list, tuple)) else [sock]
        snd, rcv = tcp_buffers()
        # With ``data``, the last connection carries the DATA of messages from
        # thread_min bytes, moved by two threads of this peer's (Threads, below).
        self.threads = Threads(self, socks.pop(), snd, rcv) if data else None
        self.wake = self.threads.wake if data else None
        self.thread_min = tcp_thread_min() if data else 0
        self.lanes = [Lane(i, s, max(eager, frag) if i == 0 else frag, snd, rcv)
                      for i, s in enumerate(socks)]
        self.unflushed: list = []     # (each lane's queued mark, send) done once flushed past
        self.sending = None           # (send, next offset per lane) of the DATA being dealt
        # Lanes a large message is dealt over (the first ``deal``). Both ends must agree:
        # changed only while no DATA is in flight (bench/tcp_streams.py's A/B, both ranks
        # between turns); else all of them.
        self.deal = len(self.lanes)
        # A reducing piece is read and applied this many bytes at a time (limits.py says why)
        self.chunk = limits.TCP_REDUCE_CHUNK

    # The first lane's state under its old names (tests and tools look at them).
    @property
    def sock(self):
        return self.lanes[0].sock

    @sock.setter
    def sock(self, value):
        self.lanes[0].sock = value

    @property
    def wpending(self) -> list:
        return [b for lane in self.lanes for b in lane.wpending]

    @property
    def ptarget(self):
        return self.lanes[0].ptarget

    def piece(self, nbytes: int) -> int:
        """The DATA piece of a message of ``nbytes``: a fragment on one lane; with several,
        a 1/lanes share (whole 4 KiB pages: whole elements) of a message down to twice
        TCP_STRIPE_MIN, so a message of a few MiB crosses on all of them too."""
        k = self.deal
        if k == 1:
            return self.frag
        share = (-(-nbytes // k) + 4095) & ~4095
        return min(self.frag, max(limits.TCP_STRIPE_MIN, share))

    # -- out -----------------------------------------------------------------------------
    def _flush(self, lane: Lane) -> bool:
        while lane.wpending:
            try:   # all that is queued in one call (usually a header and its payload)
                n = lane.sock.sendmsg(lane.wpending[:IOV_MAX])
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                self._lost(exc)
                return False
            lane.flushed += n
            while n:
                head = lane.wpending[0]
                if n < len(head):
                    lane.wpending[0] = memoryview(head)[n:]   # (a view: no copy of the rest)
                    self._complete_flushed()
                    return False
                n -= len(head)
                lane.wpending.pop(0)
        self._complete_flushed()
        return True

    def _eager_now(self, tag, data, fp) -> bool:
        return False    # a send completes only once flushed (below): it needs a request

    def _sent(self, req) -> None:
        """A send is complete only once its last byte is with the kernel: a rank whose send
        'completed' with bytes still queued here could stop driving progress (compute, or
        wait at destroy's barrier) while its peer waits for them forever."""
        if self.threads is not None and self.threads.sending.get(req.msgid) is req:
            return      # the writer thread has it: done when it says so (Threads.events)
        if any(lane.wpending for lane in self.lanes):
            self.unflushed.append(([lane.queued for lane in self.lanes], req))
        else:
            super()._sent(req)

    def _complete_flushed(self) -> None:
        while self.unflushed:
            marks, req = self.unflushed[0]
            if any(mark > lane.flushed for mark, lane in zip(marks, self.lanes)):
                return
            self.unflushed.pop(0)
            Peer._sent(self, req)

    def _write(self, kind, flags, tag, msgid, length, aux, payload, fp1=0, fp2=0, zc=0) -> bool:
        if kind == BYE and len(self.lanes) > 1:
            # on every lane: each lane's end of file then follows a goodbye
            if not all([self._flush(lane) for lane in self.lanes]):
                return False
            for lane in self.lanes:
                self._write_on(lane, kind, flags, tag, msgid, length, aux, payload)
            return True
        return self._write_on(self.lanes[0], kind, flags, tag, msgid, length, aux, payload,
                              fp1, fp2, zc)

    def _write_on(self, lane, kind, flags, tag, msgid, length, aux, payload, fp1=0, fp2=0,
                  zc=0) -> bool:
        if self.dead or lane.wpending and not self._flush(lane):
            return False
        head = HEADER.pack(kind, flags, tag, msgid, length, aux, fp1, fp2, zc)
        if payload is None or length == 0:
            parts = [head]
        elif length <= 16 << 10:
            parts = [head + bytes(payload)]      # one small copy beats a gather of two
        else:
            parts = [head, memoryview(payload).cast("B")]
        try:
            n = lane.sock.sendmsg(parts) if len(parts) > 1 else lane.sock.send(parts[0])
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as exc:
            # _lost() fails the peer, which empties outq: False keeps Peer.pump_out
            # from popping the packet it no longer holds.
            self._lost(exc)
            return False
        if n < sum(len(part) for part in parts):
            # The rest waits here as views, not copies: every payload belongs to a send
            # request, which completes only once its last byte is with the kernel (_sent).
            rest = []
            for part in parts:
                if n >= len(part):
                    n -= len(part)
                    continue
                rest.append(memoryview(part)[n:] if n else part)
                n = 0
            lane.wpending.extend(rest)
            lane.queued += sum(len(r) for r in rest)
        return True

    def _send_data(self, req) -> bool:
        """Deal the message's pieces over the lanes, each lane its own in order, as far as
        their kernels take them; True once all are written (or handed to the writer
        thread, when the receiver asked for that in its CTS)."""
        if self.threads is not None and self.threads.take(req):
            return True
        k = self.deal
        if k == 1:
            return super()._send_data(req)
        f, n = self.piece(req.nbytes), req.nbytes
        if self.sending is None or self.sending[0] is not req:
            self.sending = (req, [j * f for j in range(k)])
        at = self.sending[1]
        while req.offset < n:
            wrote = False
            for j, lane in enumerate(self.lanes[:k]):
                lo = at[j]
                if lo >= n:
                    continue
                m = min(f, n - lo)
                if not self._write_on(lane, DATA, 0, 0, req.msgid, m, lo, req.data[lo:lo + m]):
                    continue
                at[j] = lo + k * f
                req.offset += m
                wrote = True
            if not wrote:
                return False
        self.sending = None
        return True

    def pump_out(self) -> bool:
        flushed_before = not any(lane.wpending for lane in self.lanes)
        moved = super().pump_out()
        if not self.outq:
            for lane in self.lanes:
                if lane.wpending:
                    moved = self._flush(lane) or moved
        return moved or (not flushed_before and not any(lane.wpending for lane in self.lanes))

    def detach(self, which) -> None:
        """... and what the kernel has not taken yet of any payload (views, queued after a
        partial write: whose they are is not kept, and a copy of another call's is only
        the bytes it was given), and the sends waiting for the writer thread (Threads);
        not the one it is writing already, from the caller's buffer until it is done."""
        super().detach(which)
        if self.threads is not None:
            for req in list(self.threads.sending.values()):
                if which(req):
                    req.data = req.data.copy()
        for lane in self.lanes:
            lane.wpending = [bytes(part) if isinstance(part, memoryview) else part
                             for part in lane.wpending]

    def pending(self) -> bool:
        return (any(lane.wpending for lane in self.lanes) or super().pending()
                or self.threads is not None and bool(self.threads.sending))

    def fail(self, exc) -> None:
        if self.threads is not None:
            self.threads.fail(exc)
        for _, req in self.unflushed:
            req.fail(exc)
        self.unflushed.clear()
        self.sending = None
        for lane in self.lanes:
            lane.expect.clear()
        super().fail(exc)

    # -- in ------------------------------------------------------------------------------
    def _recv_into(self, lane: Lane, view: memoryview) -> int:
        try:
            n = lane.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return -1
        except OSError as exc:
            self._lost(exc)
            return -1
        if n == 0:
            self._lost(None)
            return -1
        return n

    def _await(self, lane: Lane, nbytes: int) -> None:
        """Have a sleeper (select in the progress thread or a wait) woken for this socket only
        once ``nbytes`` more have arrived - the rest of the DATA fragment being read - not for
        every segment: on a link slower than the reader, one wakeup per fragment instead of
        dozens, each of which costs a Python turn of CPU the caller's compute could use.
        A closed or reset connection still wakes it at once."""
        if nbytes != lane.lowat:
            try:
                lane.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            except OSError:
                return
            lane.lowat = nbytes

    def _queue_cts(self, msgid, flags, aux, zc=0, length=0, kind="cts") -> None:
        """A large enough receive asks for its DATA on the threads' connection (CTS_OK with
        aux THREADED): the reader thread takes it from there."""
        if kind == "cts" and flags == CTS_OK and self.threads is not None:
            req = self.incoming.get(msgid)
            if type(req) is RecvRequest and req.nbytes >= self.thread_min and not req.offset:
                self.threads.expect(req)
                aux = THREADED
        super()._queue_cts(msgid, flags, aux, zc, length, kind)

    def _on_cts(self, flags, msgid, aux, zc=0, length=0) -> None:
        if flags == CTS_OK and aux == THREADED:
            req = self.awaiting_cts.get(msgid)
            if self.threads is None or req is None:
                raise ProtocolError(f"CTS for message {msgid} asks for the DATA threads' "
                                    f"connection, which this pair has not")
            self.threads.asked.add(msgid)
        super()._on_cts(flags, msgid, aux, zc, length)

    def _poll_in(self) -> bool:
        moved = self.threads is not None and self.threads.events()
        for lane in self.lanes:
            if self.dead:
                break
            moved = self._poll_lane(lane) or moved
        return moved

    def _piece_target(self, lane: Lane, msgid: int, length: int, aux: int):
        """Validate a DATA header read on ``lane`` and return the receive it belongs to."""
        k = self.deal
        if lane.index >= k:
            raise ProtocolError(f"DATA on connection {lane.index}, which carries none")
        if k == 1:
            return self.data_target(msgid, length, aux)
        req = self.incoming.get(msgid)
        if req is None:
            raise ProtocolError(f"DATA piece ({msgid}, {aux}+{length}) matches no posted receive")
        f = self.piece(req.nbytes)
        if aux != lane.expect.get(msgid, lane.index * f) or aux >= req.nbytes \
                or length != min(f, req.nbytes - aux):
            raise ProtocolError(f"DATA piece ({msgid}, {aux}+{length}) out of order on "
                                f"connection {lane.index} of {k}")
        lane.expect[msgid] = aux + k * f       # (past the end: this lane's last piece)
        return req

    def _poll_lane(self, lane: Lane) -> bool:
        moved = False
        budget = POLL_BUDGET
        while not self.dead:
            budget -= 1
            if budget < 0:  # more may be waiting: the next progress() reads on (see POLL_BUDGET)
                return True
            if lane.pkt is None:
                n = self._recv_into(lane, memoryview(lane.hbuf)[lane.hgot:])
                if n < 0:
                    if lane.lowat != 1:
                        self._await(lane, 1)
                    return moved
                moved = True
                lane.hgot += n
                if lane.hgot < HEADER_SIZE:
                    continue
                lane.hgot = 0
                kind, flags, tag, msgid, length, aux, fp1, fp2, _zc = HEADER.unpack_from(lane.hbuf)
                if kind not in KINDS or length < 0 and kind != ABORT:
                    self.engine.protocol_violation(self, f"bad header kind={kind} length={length}")
                    return True
                if lane.index and kind != DATA and kind != BYE:
                    self.engine.protocol_violation(
                        self, f"packet kind {kind} on connection {lane.index} (only DATA there)")
                    return True
                if kind == EAGER and length > self.eager or kind == DATA and length > self.frag:
                    self.engine.protocol_violation(self, f"oversized packet ({length} bytes)")
                    return True
                lane.pkt = (kind, flags, tag, msgid, length, aux, (fp1, fp2))
                lane.pgot = lane.sub = 0
                if kind == DATA:
                    try:
                        req = self._piece_target(lane, msgid, length, aux)
                    except ProtocolError as exc:
                        self.engine.protocol_violation(self, str(exc))
                        return True
                    if req.ufunc is None:  # straight into the destination
                        dst = req.dst.reshape(-1).view(np.uint8)
                        lane.ptarget = memoryview(dst)[aux:aux + length]
                    else:
                        # A reducing receive applies whole elements: a fragment that splits
                        # one breaks the protocol (the peer is dropped; progress() goes on).
                        if length % getattr(req, "itemsize", 1):   # _Discard: any length
                            self.engine.protocol_violation(
                                self, f"DATA fragment of {length} bytes splits a "
                                      f"{req.itemsize}-byte element")
                            return True
                        lane.ptarget = memoryview(lane.bounce)[:min(length, self.chunk)]
                elif kind == EAGER:
                    lane.ptarget = memoryview(lane.bounce)[:length]
                else:
                    lane.ptarget = None
            if lane.ptarget is not None and lane.pgot < len(lane.ptarget):
                n = self._recv_into(lane, lane.ptarget[lane.pgot:])
                if n < 0:   # (a DATA piece: the rest of all of it)
                    rest = (lane.pkt[4] - lane.sub if lane.pkt[0] == DATA
                            else len(lane.ptarget)) - lane.pgot
                    self._await(lane, rest)
                    return moved
                moved = True
                lane.pgot += n
                if lane.pgot < len(lane.ptarget):
                    continue
            kind, flags, tag, msgid, length, aux, fp = lane.pkt
            try:
                if kind == DATA:
                    req = self.incoming[msgid]
                    if req.ufunc is None:
                        req.offset += length
                    else:
                        if type(req) is RecvRequest:
                            _reduce_at(req, aux + lane.sub, lane.ptarget)
                        else:
                            req.deliver(lane.ptarget)   # a sink: counts it
                        lane.sub += len(lane.ptarget)
                        if lane.sub < length:       # read the next part into the bounce
                            lane.ptarget = memoryview(lane.bounce)[:min(length - lane.sub,
                                                                        self.chunk)]
                            lane.pgot = 0
                            continue
                    lane.pkt = None
                    self.data_done(req)
                    if self.deal > 1 and msgid not in self.incoming:
                        for other in self.lanes:    # all of it is in
                            other.expect.pop(msgid, None)
                else:
                    lane.pkt = None
                    self._on_packet(kind, flags, tag, msgid, length, aux, fp, lane.ptarget)
            except ProtocolError as exc:
                self.engine.protocol_violation(self, str(exc))
                return True
            lane.ptarget = None
        return moved

    def state(self) -> str:
        """What this pair waits on, for a timeout's message: per lane the bytes queued
        here and in the kernel each way, and the packet being read; the messages coming in
        (bytes still to come) and those announced and not yet answered."""
        parts = []
        for lane in self.lanes:
            inq, outq = _queued(lane.sock)
            pkt = lane.pkt
            reading = ("a header" if pkt is None else
                       f"{_KIND_NAMES.get(pkt[0], pkt[0])} of {pkt[4]} B "
                       f"(msg {pkt[3]}, {lane.sub + lane.pgot} B in)")
            parts.append(f"conn {lane.index}: reading {reading}, socket has {inq} B unread, "
                         f"{outq} B unacknowledged; {sum(len(b) for b in lane.wpending)} B "
                         f"queued here; wake at {lane.lowat} B{_tcp_info(lane.sock)[0]}")
        for req in self.incoming.values():
            parts.append(f"msg {req.msgid} tag {getattr(req, 'tag', '?')}: "
                         f"{req.nbytes - req.offset - getattr(req, 'tail', 0)} of "
                         f"{req.nbytes} B still to come")
        for req in self.awaiting_cts.values():
            parts.append(f"msg {req.msgid} tag {req.tag} ({req.nbytes} B) sent its RTS, "
                         f"no CTS yet")
        if self.outq:
            parts.append(f"{len(self.outq)} packets to send ({self.outq[0][0]} first)")
        return "; ".join(parts)

    def arriving(self, within_ms: int) -> bool:
        """Whether data is still coming in on any of its connections: some in the kernel
        not read yet, or data in the last ``within_ms``. (The last alone missed a peer's
        flood a loaded host had not read for a second: its receive failed with the message
        it waited for still in the socket.) A packet read in part counts only where the
        kernel cannot say when data last came: a link that went down mid-packet had left
        one, and a call timed out on it 20 s later was told data was still arriving."""
        for lane in self.lanes:
            last = _tcp_info(lane.sock)[1]
            if _queued(lane.sock)[0] > 0 or 0 <= last < within_ms or \
                    (last < 0 and (lane.pkt is not None or lane.hgot)):
                return True
        return False

    def _lost(self, exc) -> None:
        if self.closing:
            self.fail(peer_failure(self.rank, "it has left the job (destroy was called)",
                                   left=True))
        else:
            why = f"connection lost ({exc})" if exc else "connection closed"
            self.fail(peer_failure(self.rank, why))

    def send_bye(self) -> None:
        self.outq.append(("bye", None))
        self.pump_out()

    def close(self) -> None:
        if self.threads is not None:
            self.threads.stop()
        for lane in self.lanes:
            try:
                lane.sock.close()
            except OSError:
                pass


_KIND_NAMES = {DATA: "DATA", EAGER: "EAGER", ABORT: "ABORT", BYE: "BYE", RTS: "RTS", CTS: "CTS"}


def _queued(sock) -> tuple:
    """Bytes in the kernel's receive queue not read yet, and in its send queue not yet
    acknowledged (-1: unknown)."""
    out = []
    for req in (termios.FIONREAD, termios.TIOCOUTQ):
        buf = array.array("i", [0])
        try:
            fcntl.ioctl(sock.fileno(), req, buf)
            out.append(buf[0])
        except (OSError, ValueError):
            out.append(-1)
    return tuple(out)


def _tcp_info(sock) -> tuple:
    """The kernel's view of a connection (TCP_INFO): retransmission timer and backoff,
    segments in flight and lost, and how long since data last went out and came in (text,
    and the milliseconds since data came in: -1 unknown)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        (_state, _ca, _retransmits, _probes, backoff, _opt, _ws, _app, rto, _ato, _smss,
         _rmss, unacked, _sacked, lost, retrans, _fack, last_sent, _last_ack_sent, last_recv,
         _last_ack_recv, _pmtu, _rssth, rtt, _rttvar, _ssth, cwnd, _advmss, _reord, _rcv_rtt,
         rcv_space, total_retrans) = struct.unpack("8B24I", raw[:104])
    except (OSError, struct.error):
        return "", -1
    return (f" (kernel: rto {rto // 1000} ms, backoff {backoff}, cwnd {cwnd}, rtt "
            f"{rtt / 1000:.1f} ms, {unacked} segments in flight, {lost} lost, {retrans} "
            f"retransmitting, {total_retrans} retransmitted; last data out {last_sent} ms ago, "
            f"in {last_recv} ms ago; receive window {rcv_space} B)", last_recv)

THREADED = 1                        # CTS_OK's aux: send the DATA on the threads' connection
THEAD = struct.Struct("<qq")        # (msgid, bytes) before a message's DATA there
JOIN_TIMEOUT = 5.0


class Threads:
    """A pair's DATA of large messages, moved by two threads over a connection of its own:
    a writer (blocking sendall) and a reader (blocking recv_into, straight into the
    destination, or a chunk at a time into a bounce buffer that it reduces in). Socket calls
    and NumPy's ufuncs release the GIL, so the kernel's copies of both directions (and the
    reduction) run while the engine thread keeps control packets, small messages and
    matching on the first connection - in a rank that sleeps in recv, the peer's send
    can use the core. The receiver chooses (TcpPeer._queue_cts), so both ends agree.

    The threads touch only: the sockets, the requests handed to them, and two queues
    (``wq``: sends for the writer; ``done``: what finished or failed, for the engine,
    which drains it in TcpPeer._poll_in, woken through a pipe: ``wake``). Everything
    else (completing requests, failing the peer) is the engine's, under its lock."""

    def __init__(self, peer: TcpPeer, sock, sndbuf: int, rcvbuf: int):
        _configure(sock, True, sndbuf, rcvbuf)
        self.peer, self.sock = peer, sock
        self.rank = peer.engine.rank
        self.wake, self._ring = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.rang = False
        self.done: deque = deque()        # ("sent", req) / ("recv", req) / ("lost", why)
        self.wq: SimpleQueue = SimpleQueue()   # sends for the writer (None: stop)
        self.sending: dict = {}           # msgid -> send the writer has (engine's)
        self.asked: set = set()           # msgids whose CTS asked for this connection
        self.receiving: dict = {}         # msgid -> receive the reader will fill
        self.bounce = bytearray(limits.TCP_REDUCE_CHUNK)
        self.failed = False
        self.writer = self.reader = None
        self.moved = [0, 0]               # messages sent, received this way

    def _start(self) -> None:
        """The threads start with the first message they move (a job of small messages
        has none)."""
        name = f"ringlet-tcp-{self.rank}-{self.peer.rank}"
        self.writer = threading.Thread(target=self._write, name=name + "-w", daemon=True)
        self.reader = threading.Thread(target=self._read, name=name + "-r", daemon=True)
        self.writer.start()
        self.reader.start()

    # -- the engine's side -----------------------------------------------------------------
    def take(self, req) -> bool:
        """Hand a send whose CTS asked for this connection to the writer."""
        if req.msgid not in self.asked:
            return False
        self.asked.discard(req.msgid)
        if self.writer is None:
            self._start()
        self.sending[req.msgid] = req
        req.offset = req.nbytes
        self.wq.put(req)
        return True

    def expect(self, req) -> None:
        if self.reader is None:
            self._start()
        self.receiving[req.msgid] = req

    def events(self) -> bool:
        """Complete what the threads finished (engine, under its lock)."""
        if not self.rang:
            return False
        self.rang = False
        try:
            while os.read(self.wake, 4096):
                pass
        except OSError:
            pass
        peer = self.peer
        while self.done:
            what, item = self.done.popleft()
            if what == "sent":
                if self.sending.pop(item.msgid, None) is item and not peer.dead:
                    self.moved[0] += 1
                    Peer._sent(peer, item)
            elif what == "recv":
                req = peer.incoming.get(item.msgid)
                if req is not None and not peer.dead:
                    self.moved[1] += 1
                    req.offset = req.nbytes - getattr(req, "tail", 0)
                    peer.data_done(req)
            elif not peer.dead:
                if isinstance(item, ProtocolError):
                    peer.engine.protocol_violation(peer, str(item))
                else:
                    peer._lost(item)
        return True

    def fail(self, exc) -> None:
        """The peer failed: fail the sends the writer has, and stop both threads from
        touching any buffer (shutdown wakes them from their blocking calls)."""
        self.failed = True
        try:    # (the engine would wake for it, and drains it only while the peer lives)
            self.peer.engine.sel.unregister(self.wake)
        except (KeyError, ValueError, OSError):
            pass
        for req in self.sending.values():
            req.fail(exc)
        self.sending.clear()
        self.receiving.clear()
        self.asked.clear()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def stop(self) -> None:
        """At destroy: end both threads and wait for them."""
        self.failed = True
        self.wq.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for t in (self.writer, self.reader):
            if t is not None and t is not threading.current_thread():
                t.join(JOIN_TIMEOUT)
        self.sock.close()
        for fd in (self.wake, self._ring):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- the threads -----------------------------------------------------------------------
    def _post(self, what, item) -> None:
        self.done.append((what, item))
        try:
            os.write(self._ring, b"!")
        except OSError:
            pass          # full: a wake-up is pending already
        self.rang = True  # (after the write: the engine drains once it sees this)
        self.peer.engine.background.poke()   # (the progress thread sleeps elsewhere)

    def _write(self) -> None:
        while True:
            req = self.wq.get()
            if req is None or self.failed:
                return
            try:
                self.sock.sendall(THEAD.pack(req.msgid, req.nbytes))
                self.sock.sendall(memoryview(req.data).cast("B"))
            except OSError as exc:
                if not self.failed:
                    self._post("lost", exc)
                return
            self._post("sent", req)

    def _fill(self, view) -> bool:
        """Read exactly ``len(view)`` bytes (False: the connection ended first). The thread
        returns from the kernel once they are all in (MSG_WAITALL), not per segment: one
        turn of Python and of the GIL per chunk. (Not SO_RCVLOWAT: a blocking read that
        took part of the chunk then sleeps until that many more are in, which may never
        come.)"""
        got, n = 0, len(view)
        while got < n:
            k = self.sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            if k == 0:
                return False
            got += k
        return True

    def _read(self) -> None:
        np.seterr(all="ignore")     # this thread's reductions (why: Engine.wait)
        head = bytearray(THEAD.size)
        try:
            while True:
                if not self._fill(memoryview(head)):
                    return     # the end, between messages: the first connection says why
                msgid, nbytes = THEAD.unpack(head)
                req = self.receiving.pop(msgid, None)
                if req is None or req.nbytes != nbytes:
                    if not self.failed:
                        self._post("lost", ProtocolError(
                            f"threaded DATA ({msgid}, {nbytes} bytes) matches no receive"))
                    return
                if not self._message(req):
                    if not self.failed:
                        self._post("lost", ConnectionError(
                            f"closed in the middle of message {msgid}"))
                    return
                self._post("recv", req)
        except OSError as exc:
            if not self.failed:
                self._post("lost", exc)

    def _message(self, req) -> bool:
        """Read one message's DATA: straight into its destination, or reduced into it a
        chunk at a time (limits.TCP_REDUCE_CHUNK: NumPy reads the bounce from L2). A
        receive the engine gave up meanwhile (its collective aborted: fail_tag, retire)
        gets no more of it from the next chunk on: the rest goes to the bounce."""
        incoming, msgid = self.peer.incoming, req.msgid
        copy = req.ufunc is None
        size, n = req.itemsize, req.nbytes
        step = FRAG_BYTES if copy else max(size, len(self.bounce) // size * size)
        out = req.dst.reshape(-1).view(np.uint8) if copy else None
        at = 0
        while at < n:
            m = min(step, n - at)
            wanted = incoming.get(msgid) is req and not self.failed
            if copy and wanted:
                view = memoryview(out[at:at + m])
            else:
                view = memoryview(self.bounce)[:min(m, len(self.bounce))]
                m = len(view)
            if not self._fill(view):
                return False
            if not copy and wanted:
                e0, e1 = at // size, (at + m) // size
                dst = req.dst[e0:e1]
                acc = dst if req.acc is req.dst else req.acc[e0:e1]
                req.ufunc(acc, np.frombuffer(view, req.dtype), out=dst)
            at += m
        return True


def _reduce_at(req: RecvRequest, at: int, payload) -> None:
    """Apply the piece of whole elements that starts ``at`` bytes into the message (pieces
    of several lanes arrive in any order: each lands by its offset)."""
    n = len(payload)
    if n == req.nbytes:      # the whole message at once: no slicing
        req.ufunc(req.acc, np.frombuffer(payload, req.dtype), out=req.dst)
    else:
        e0, e1 = at // req.itemsize, (at + n) // req.itemsize
        dst = req.dst[e0:e1]
        # One view when the accumulator is the destination keeps NumPy off its overlap check.
        acc = dst if req.acc is req.dst else req.acc[e0:e1]
        req.ufunc(acc, np.frombuffer(payload, req.dtype), out=dst)
    req.offset += n
