"""TCP transport between ranks on different hosts: one authenticated connection per pair,
non-blocking in both directions (full duplex: large simultaneous sends never deadlock).
Copy-DATA is received straight into the destination; reduce-DATA and EAGER payloads go
through a bounce buffer the size of a fragment."""
from __future__ import annotations

import socket

import numpy as np

from . import limits
from .protocol import (ABORT, DATA, EAGER, HEADER, HEADER_SIZE, KINDS, Peer,
                       ProtocolError, peer_failure)

# At most this many reads per _poll_in call: a peer that streams packets (PAD, BYE,
# unexpected EAGER…) faster than we parse them must not keep progress() from returning,
# or the waiter would never reach its deadline check.
POLL_BUDGET = 1024
IOV_MAX = 64          # parts of wpending handed to one sendmsg


EAGER_BYTES, FRAG_BYTES = limits.TCP_EAGER_BYTES, limits.TCP_FRAG_BYTES   # (see limits.py)


class TcpPeer(Peer):
    def __init__(self, engine, rank: int, sock: socket.socket,
                 eager: int = EAGER_BYTES, frag: int = FRAG_BYTES):
        super().__init__(engine, rank, eager, frag)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
            except OSError:
                pass
        self.sock = sock
        self.wpending: list = []                  # bytes not yet accepted by the kernel
        self.queued = self.flushed = 0            # bytes ever put in / taken from wpending
        self.unflushed: list = []                 # (queued mark, send) done once flushed past it
        self.hbuf = bytearray(HEADER_SIZE)
        self.hgot = 0
        self.lowat = 1                            # SO_RCVLOWAT now set (see _await)
        self.bounce = bytearray(max(eager, frag))
        self.pkt = None                           # header of the packet whose payload we read
        self.ptarget: memoryview | None = None
        self.pgot = 0

    # -- out -----------------------------------------------------------------------------
    def _flush(self) -> bool:
        while self.wpending:
            try:   # all that is queued in one call (usually a header and its payload)
                n = self.sock.sendmsg(self.wpending[:IOV_MAX])
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                self._lost(exc)
                return False
            self.flushed += n
            while n:
                head = self.wpending[0]
                if n < len(head):
                    self.wpending[0] = memoryview(head)[n:]   # (a view: no copy of the rest)
                    self._complete_flushed()
                    return False
                n -= len(head)
                self.wpending.pop(0)
        self._complete_flushed()
        return True

    def _eager_now(self, tag, data, fp) -> bool:
        return False    # a send completes only once flushed (below): it needs a request

    def _sent(self, req) -> None:
        """A send is complete only once its last byte is with the kernel: a rank whose send
        'completed' with bytes still queued here could stop driving progress (compute, or
        wait at destroy's barrier) while its peer waits for them forever."""
        if self.wpending:
            self.unflushed.append((self.queued, req))
        else:
            super()._sent(req)

    def _complete_flushed(self) -> None:
        while self.unflushed:
            until, req = self.unflushed[0]
            if until > self.flushed:
                return
            self.unflushed.pop(0)
            Peer._sent(self, req)

    def _write(self, kind, flags, tag, msgid, length, aux, payload, fp1=0, fp2=0, zc=0) -> bool:
        if self.wpending and not self._flush():
            return False
        head = HEADER.pack(kind, flags, tag, msgid, length, aux, fp1, fp2, zc)
        if payload is None or length == 0:
            parts = [head]
        elif length <= 16 << 10:
            parts = [head + bytes(payload)]      # one small copy beats a gather of two
        else:
            parts = [head, memoryview(payload).cast("B")]
        try:
            n = self.sock.sendmsg(parts) if len(parts) > 1 else self.sock.send(parts[0])
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
            self.wpending.extend(rest)
            self.queued += sum(len(r) for r in rest)
        return True

    def pump_out(self) -> bool:
        flushed_before = not self.wpending
        moved = super().pump_out()
        if not self.outq and self.wpending:
            moved = self._flush() or moved
        return moved or (not flushed_before and not self.wpending)

    def pending(self) -> bool:
        return bool(self.wpending) or super().pending()

    def fail(self, exc) -> None:
        for _, req in self.unflushed:
            req.fail(exc)
        self.unflushed.clear()
        super().fail(exc)

    # -- in ------------------------------------------------------------------------------
    def _recv_into(self, view: memoryview) -> int:
        try:
            n = self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return -1
        except OSError as exc:
            self._lost(exc)
            return -1
        if n == 0:
            self._lost(None)
            return -1
        return n

    def _await(self, nbytes: int) -> None:
        """Have a sleeper (select in the progress thread or a wait) woken for this socket only
        once ``nbytes`` more have arrived - the rest of the DATA fragment being read - not for
        every segment: on a link slower than the reader, one wakeup per fragment instead of
        dozens, each of which costs a Python turn of CPU the caller's compute could use.
        A closed or reset connection still wakes it at once."""
        if nbytes != self.lowat:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            except OSError:
                return
            self.lowat = nbytes

    def _poll_in(self) -> bool:
        moved = False
        budget = POLL_BUDGET
        while not self.dead:
            budget -= 1
            if budget < 0:  # more may be waiting: the next progress() reads on (see POLL_BUDGET)
                return True
            if self.pkt is None:
                n = self._recv_into(memoryview(self.hbuf)[self.hgot:])
                if n < 0:
                    if self.lowat != 1:
                        self._await(1)
                    return moved
                moved = True
                self.hgot += n
                if self.hgot < HEADER_SIZE:
                    continue
                self.hgot = 0
                kind, flags, tag, msgid, length, aux, fp1, fp2, _zc = HEADER.unpack_from(self.hbuf)
                if kind not in KINDS or length < 0 and kind != ABORT:
                    self.engine.protocol_violation(self, f"bad header kind={kind} length={length}")
                    return True
                if kind == EAGER and length > self.eager or kind == DATA and length > self.frag:
                    self.engine.protocol_violation(self, f"oversized packet ({length} bytes)")
                    return True
                self.pkt = (kind, flags, tag, msgid, length, aux, (fp1, fp2))
                self.pgot = 0
                if kind == DATA:
                    try:
                        req = self.data_target(msgid, length, aux)
                    except ProtocolError as exc:
                        self.engine.protocol_violation(self, str(exc))
                        return True
                    if req.ufunc is None:  # straight into the destination
                        dst = req.dst.reshape(-1).view(np.uint8)
                        self.ptarget = memoryview(dst)[req.offset:req.offset + length]
                    else:
                        # A reducing receive applies whole elements: a fragment that splits
                        # one breaks the protocol (the peer is dropped; progress() goes on).
                        if length % getattr(req, "itemsize", 1):   # _Discard: any length
                            self.engine.protocol_violation(
                                self, f"DATA fragment of {length} bytes splits a "
                                      f"{req.itemsize}-byte element")
                            return True
                        self.ptarget = memoryview(self.bounce)[:length]
                elif kind == EAGER:
                    self.ptarget = memoryview(self.bounce)[:length]
                else:
                    self.ptarget = None
            if self.ptarget is not None and self.pgot < len(self.ptarget):
                n = self._recv_into(self.ptarget[self.pgot:])
                if n < 0:
                    self._await(len(self.ptarget) - self.pgot)
                    return moved
                moved = True
                self.pgot += n
                if self.pgot < len(self.ptarget):
                    continue
            kind, flags, tag, msgid, length, aux, fp = self.pkt
            self.pkt = None
            try:
                if kind == DATA:
                    req = self.incoming[msgid]
                    if req.ufunc is None:
                        req.offset += length
                    else:
                        req.deliver(self.ptarget)
                    self.data_done(req)
                else:
                    self._on_packet(kind, flags, tag, msgid, length, aux, fp, self.ptarget)
            except ProtocolError as exc:
                self.engine.protocol_violation(self, str(exc))
                return True
            self.ptarget = None
        return moved

    def _lost(self, exc) -> None:
        if self.closing:
            self.fail(peer_failure(self.rank, "it has left the job (destroy was called)"))
        else:
            why = f"connection lost ({exc})" if exc else "connection closed"
            self.fail(peer_failure(self.rank, why))

    def send_bye(self) -> None:
        self.outq.append(("bye", None))
        self.pump_out()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
