"""The wire protocol every transport speaks, and the matching logic shared by all.

A transport moves *packets* between two ranks, in order, in each direction. Each packet
has a 64-byte header (kind, tag, message id, length, …) and, for EAGER and DATA, a payload.

* A message of at most ``eager`` bytes travels at once as one EAGER packet. If no receive
  is posted for its tag yet, the receiver keeps a copy (bounded by the eager limit).
  (Not one of more than ``zc_min`` bytes in an rl.empty buffer, where shared memory lets
  the receiver read it in place: that one goes by RTS. From a sender that does not
  receive in its round, only above ``zc_oneway_min``; a point-to-point send's, above
  ``p2p_zc_min``: limits.py says why.)
* A message of more than ``cma_min`` bytes in a plain buffer (or in an rl.empty one its
  call does not read in place; a point-to-point send's: ``p2p_cma_min``), whose receive
  copies it (the plan says: SendStep.reduce), sent in a collective's round
  that also receives, on a link that can read a local sender's memory
  (shm: process_vm_readv), names its address in the RTS (RTS_CMA); the receiver reads it
  from there and answers CTS_DONE, or - when it reduces, the kernel refuses the read, or
  its buffer lies where the kernel copies slowly from the sender's (cma.fast_offset) -
  answers CTS_OK and the DATA flows as for any large message.
* Such a message sent one-way (its round receives nothing: a broadcast's root, a scatter, a
  point-to-point send) offers its address as RTS_OFFER: a receiver that copies answers
  CTS_PUT naming its own buffer and how many leading bytes (the head) the sender is to
  write there (process_vm_writev), and reads the tail itself meanwhile - both cores copy
  at once. The sender answers PUT (the head's bytes written, 0 if the kernel refused);
  the receiver then answers CTS_DONE, or CTS_OK when a part was refused: the rest
  streams as DATA from where the message is complete up to (transport/cma.py).
* A larger message is announced by RTS (ready to send). The receiver answers CTS (clear
  to send) only once a receive for that tag is posted — or rejects it if the sizes differ —
  and only then do DATA fragments flow. So an unmatched large message never blocks the
  stream, and nothing is ever allocated on the strength of a peer's claimed size.
* Except a message of at most ``stream_max`` bytes (transports that set it: shm, up to
  what its ring holds), whose DATA follows its RTS (flagged RTS_STREAM) at once, without
  the round trip. A receiver with no receive posted for it parks the fragments as they
  arrive (bounded, like unasked-for eager messages) and hands them over when one is posted.

Messages of one (pair, tag) are matched in the order they were sent.
"""
from __future__ import annotations

import struct
from collections import deque

import numpy as np

from ..buffers import address, locate
from ..errors import PeerFailure, RingletError
from ..group import group_of
from . import copies
from .limits import SPLIT_BUSY_MIN

HEADER = struct.Struct("<IIqqqqqqq")  # kind, flags, tag, msgid, length, aux, fp1, fp2, zc
HEADER_SIZE = 64
EAGER, RTS, CTS, DATA, PAD, BYE, ABORT = 1, 2, 3, 4, 5, 6, 7
PUT = 8      # (shm only: not in KINDS, which TCP accepts) the sender wrote a head: cma.py
CTS_OK, CTS_REJECT, CTS_DONE = 0, 1, 2
# RecvRequest.ways of a receive whose offered message its sender writes all of: posted
# before its round's local copies (work.EARLY_ROOT), and once they are done
WRITE_WHOLE, WRITE_WHOLE_IDLE = -1, -2
CTS_SPLIT = 3    # CTS flag: copy your RTS_ZC_HELP message's back chunks into my buffer (split.py)
CTS_PUT = 4      # CTS flag: write the message's first ``length`` bytes at address aux (cma.py)
RTS_ZC = 1   # RTS flag: the data sits in the sender's shared buffer at (zc, aux); read it there
RTS_ZC_HELP = 4  # RTS flag: as RTS_ZC, and the sender can write into the receiver's buffer
RTS_STREAM = 2   # RTS flag: its DATA follows at once, without waiting for CTS
RTS_CMA = 3      # RTS flag: the data sits at address aux in the sender's private memory
RTS_OFFER = 5    # RTS flag: ... and the sender, idle, can write its head into the receiver's
KINDS = {EAGER, RTS, CTS, DATA, PAD, BYE, ABORT}
CHECK_FINGERPRINTS = True  # set at engine start (engine._read_check_switch)
# Where ranks outnumber cores, a sender with other copies in its round (a scatter's root,
# a direct broadcast's) offers no help with a message read in place below
# limits.SPLIT_BUSY_MIN (split.py says why). True: it helps with all, as before.
CROWDED_BUSY_HELP = False
# Where ranks outnumber cores, an exchange's plain message larger than one EAGER packet is
# read whole by CMA, not from CMA_MIN on (limits.py says why). False: from CMA_MIN, as before.
CROWDED_EXCHANGE_CMA = True
MAX_UNEXPECTED = 1 << 30   # bytes of unasked-for small messages one peer may park here
NO_FP = (0, 0)
STALE = 0xFFFFFFFF       # ABORT "culprit" meaning: refused, an earlier call was mismatched
DEAD = 0xFFFFFFFE        # ABORT "culprit" meaning: a member died; msgid names it
LEFT = 1                 # ... and a DEAD ABORT's second fingerprint word 1: it left the job
GAVE_UP = 0xFFFFFFFD     # ABORT "culprit" meaning: the sender's timeout for the call ran out
REFUSED = 0xFFFFFFFC     # ABORT "culprit" meaning: the call's arguments failed checks there
ABANDONED = 0xFFFFFFFB   # ABORT "culprit" meaning: a part of one call whose earlier part
                         # failed there (an uneven all_to_all's exchange after its table)


class Request:
    """One posted send or receive. ``done`` turns true on completion or failure. ``fp`` is
    the fingerprint of the collective it belongs to (NO_FP for point-to-point)."""
    __slots__ = ("peer", "tag", "nbytes", "done", "error", "msgid", "offset", "what", "fp")

    def __init__(self, peer: int, tag: int, nbytes: int, what: str, fp=NO_FP):
        self.peer, self.tag, self.nbytes, self.what, self.fp = peer, tag, nbytes, what, fp
        self.done = False
        self.error: BaseException | None = None
        self.msgid = -1
        self.offset = 0

    def fail(self, exc: BaseException):
        if not self.done:
            self.error = exc
            self.done = True


class SendRequest(Request):
    __slots__ = ("data", "zc", "stream", "cma", "receiving", "in_place", "ways", "p2p",
                 "reduced")

    def __init__(self, peer, tag, data: np.ndarray, fp=NO_FP):
        # (Request.__init__ inlined: a small collective creates several requests per call.)
        self.peer, self.tag, self.nbytes, self.what, self.fp = peer, tag, data.nbytes, "send", fp
        self.done, self.error, self.msgid, self.offset = False, None, -1, 0
        self.data = data  # flat uint8 view of the caller's buffer
        self.zc = None    # (alloc id, fd, offset) when data lies in an rl.empty buffer
        self.stream = False   # its DATA follows its RTS at once (RTS_STREAM)
        self.cma = 0          # its RTS offers its address: RTS_CMA, RTS_OFFER (0: no)
        self.receiving = False  # its round receives too (cma.py: then offer it)
        self.in_place = True    # False: an rl.empty buffer's message takes the plain path
        self.ways = 1           # large messages its round sends (cma.py shares the copy by it)
        self.p2p = False        # a point-to-point send's (its own limits: Peer.p2p_zc_min)
        self.reduced = False    # its receive reduces it: not offered by CMA (cma.py declines)


class RecvRequest(Request):
    __slots__ = ("dst", "acc", "ufunc", "dtype", "itemsize", "tail", "ways")

    def __init__(self, peer, tag, dst: np.ndarray, ufunc=None, acc: np.ndarray | None = None,
                 fp=NO_FP):
        self.peer, self.tag, self.nbytes, self.what, self.fp = peer, tag, dst.nbytes, "recv", fp
        self.done, self.error, self.msgid, self.offset = False, None, -1, 0
        self.dst = dst            # typed flat array receiving the data
        self.ufunc = ufunc        # None: copy; else dst = ufunc(acc, incoming)
        self.acc = dst if acc is None else acc
        self.dtype = dst.dtype
        self.itemsize = dst.dtype.itemsize
        self.tail = 0             # bytes at its end already in place (read by CMA)
        # messages its round receives (cma.py shares the copy by it); WRITE_WHOLE: posted
        # before its round's local copies, which it makes while the sender writes it all
        # (WRITE_WHOLE_IDLE once they are done: a message from rl.empty is split at once)
        self.ways = 1

    def deliver(self, payload) -> None:
        """Apply one in-order piece of the message (a bytes-like of whole elements)."""
        if not isinstance(payload, np.ndarray):
            payload = np.frombuffer(payload, np.uint8)
        n = payload.nbytes
        if n == 0:
            return
        if self.ufunc is None:
            copies.assign(self.dst.view(np.uint8)[self.offset:self.offset + n], payload)
        elif n == self.nbytes:   # the whole message at once (small ones): no slicing
            self.ufunc(self.acc, payload.view(self.dtype), out=self.dst)
        else:
            e0, e1 = self.offset // self.itemsize, (self.offset + n) // self.itemsize
            dst = self.dst[e0:e1]
            # One view when the accumulator is the destination keeps NumPy off its overlap check.
            acc = dst if self.acc is self.dst else self.acc[e0:e1]
            self.ufunc(acc, payload.view(self.dtype), out=dst)
        self.offset += n


class _Discard:
    """Sink for the rest of a message whose receive was cancelled or refused."""
    __slots__ = ("msgid", "nbytes", "offset", "tag", "ufunc", "done", "error", "keep")
    tail = 0

    def __init__(self, msgid: int, nbytes: int, offset: int, tag: int, keep=None):
        self.msgid, self.nbytes, self.offset, self.tag = msgid, nbytes, offset, tag
        self.ufunc, self.done, self.error = True, True, None
        # A failed receive's buffer, kept alive while a peer may still write a head into it
        # (CTS_PUT): freed and reused meanwhile, another allocation would be overwritten.
        self.keep = keep

    def deliver(self, payload) -> None:
        self.offset += len(payload) if not isinstance(payload, np.ndarray) else payload.nbytes

    def fail(self, exc) -> None:
        pass  # its receive already failed


class _Parked:
    """The fragments so far of a streamed message nobody has asked for yet: a copy of each
    as it arrives (nothing allocated by the claimed size; no regrowing buffer either)."""
    __slots__ = ("msgid", "nbytes", "offset", "tag", "pieces")
    tail = 0

    def __init__(self, msgid: int, nbytes: int, tag: int):
        self.msgid, self.nbytes, self.offset, self.tag = msgid, nbytes, 0, tag
        self.pieces: list = []

    def deliver(self, payload) -> None:
        piece = payload.tobytes() if isinstance(payload, np.ndarray) else bytes(payload)
        self.pieces.append(piece)
        self.offset += len(piece)

    def fail(self, exc) -> None:
        pass  # nobody waits on it


class _Offer:
    """Where an RTS_OFFER's message lies: an address in the sender's private memory."""
    __slots__ = ("addr", "ways")

    def __init__(self, addr: int, ways: int):
        self.addr = addr
        self.ways = max(int(ways), 1)    # large messages the sender sends in its round


class Unasked:
    """A message that arrived before its receive was posted (kept per tag, in order): an
    EAGER one's ``payload``, a streamed one's ``parked`` fragments so far, or a large one's
    ``announced`` RTS (message id, bytes, where it lies in the sender's rl.empty buffer or
    None). ``held``: the bytes it counts against MAX_UNEXPECTED."""
    __slots__ = ("fp", "held", "payload", "parked", "announced")

    def __init__(self, fp, held: int, payload=None, parked=None, announced=None):
        self.fp, self.held = fp, held
        self.payload, self.parked, self.announced = payload, parked, announced


class Peer:
    """Matching and flow logic for one remote rank; subclasses move the packets.

    Subclasses implement ``_write(kind, flags, tag, msgid, length, aux, payload) -> bool``
    (False: no room now, try later) and ``_poll_in() -> bool`` which reads packets and
    calls ``_on_packet``; ``_payload_for`` tells them where DATA for a message goes.
    """

    def __init__(self, engine, rank: int, eager: int, frag: int):
        self.engine, self.rank, self.eager, self.frag = engine, rank, eager, frag
        self.posted: dict[int, deque] = {}
        self.unexpected: dict[int, deque] = {}
        self.outq: deque = deque()
        self.awaiting_cts: dict[int, SendRequest] = {}
        self.incoming: dict[int, RecvRequest] = {}
        self.next_msgid = 0
        self.last_rts = -1          # id of the last large message announced to us
        self.unexpected_bytes = 0   # small messages held until someone asks for them
        self.dead: BaseException | None = None
        self.closing = False
        self.msgs_sent = self.bytes_sent = self.msgs_recv = self.bytes_recv = 0
        # what the C fast path moved (messages, bytes sent; messages, bytes received): C adds
        # to this array in place, which costs it nothing per call (4 attributes would)
        self.fast_counts = np.zeros(4, np.int64)

    # -- posting -------------------------------------------------------------------------
    def send_now(self, tag: int, data, fp=NO_FP) -> bool:
        """Write a small message straight into the transport, the common case of a small
        send: True when it went (no request needed), False when it must be queued."""
        n = data.nbytes
        if n > self.eager or (n > self.zc_min and self.zero_copy and locate(data) is not None):
            return False
        return self._eager_now(tag, data, fp)

    def _eager_now(self, tag: int, data, fp) -> bool:
        """Write an EAGER packet now if nothing is queued ahead of it and there is room."""
        if self.outq or self.dead or not self._write(EAGER, 0, tag, -1, data.nbytes, 0, data, *fp):
            return False
        self.msgs_sent += 1
        self.bytes_sent += data.nbytes
        return True

    def zero_copy_least(self, receiving: bool, p2p: bool) -> int:
        """Above how many bytes a message goes by RTS to be read in place (an rl.empty
        buffer's) or by CMA (:meth:`by_cma`): ``zc_min`` where its sender's round
        ``receiving`` too, else ``zc_oneway_min``; a point-to-point send's ``p2p_zc_min``
        (limits.py says why each)."""
        return self.p2p_zc_min if p2p else self.zc_min if receiving else self.zc_oneway_min

    def by_cma(self, nbytes: int, receiving: bool, p2p: bool) -> int:
        """How a message past the zero-copy limit that is not read in place goes by CMA:
        RTS_CMA (read whole, where every rank copies anyway: its sender's round
        ``receiving`` too), RTS_OFFER (offered where the sender idles: split, or read whole
        where ranks outnumber cores: cma.py), or 0 (not by CMA). Past ``cma_min`` for a
        collective's message (where ranks outnumber cores, an exchange's past one EAGER
        packet too: limits.py, CMA_MIN), past ``p2p_cma_min`` for a point-to-point one."""
        crowded = self.engine.crowded
        least = (self.p2p_cma_min if p2p else
                 min(self.eager, self.cma_min) if crowded and receiving and CROWDED_EXCHANGE_CMA
                 else self.cma_min)
        if least < 0 or nbytes <= least:
            return 0
        return (RTS_CMA if receiving else
                RTS_OFFER if self.cma.splits(crowded) or self.cma.reads_whole(crowded) else 0)

    def post_send(self, req: SendRequest) -> None:
        if self.dead:
            req.fail(self.dead)
            return
        if self.zero_copy and req.nbytes > self.zero_copy_least(req.receiving, req.p2p):
            if req.in_place:    # (else an rl.empty buffer's message is a plain one's)
                req.zc = locate(req.data)      # (once: send_now is not asked again)
            # (a receive that reduces declines the read, after a round trip a stream up to
            # stream_max does without: cma.py)
            if req.zc is None and not req.reduced and req.data.flags.c_contiguous:
                req.cma = self.by_cma(req.nbytes, req.receiving, req.p2p)
        if req.nbytes <= self.eager and req.zc is None:
            if self._eager_now(req.tag, req.data, req.fp):
                req.done = True
                return
            self.outq.append(("eager", req))
        else:
            req.msgid = self.next_msgid
            self.next_msgid += 1
            self.outq.append(("rts", req))
            if req.nbytes <= self.stream_max and req.zc is None and not req.cma:
                req.stream = True
                self.outq.append(("data", req))
            else:
                self.awaiting_cts[req.msgid] = req
        self.pump_out()

    def withdraw(self, req: RecvRequest) -> bool:
        """Take back a posted receive that no message has matched yet (its waiter gave
        up): True if it was still waiting."""
        q = self.posted.get(req.tag)
        if not q or not any(r is req for r in q):
            return False
        q.remove(req)
        if not q:
            del self.posted[req.tag]
        return True

    def post_recv(self, req: RecvRequest) -> None:
        if self.dead:
            req.fail(self.dead)
            return
        q = self.unexpected.get(req.tag)
        if q:
            if q[0].fp != req.fp and CHECK_FINGERPRINTS:
                _push(self.posted, req.tag, req)
                self.engine.calls.mismatch(req.tag, req.fp, q[0].fp, self.rank)
                return
            item = _pop(self.unexpected, req.tag, q)
            self.unexpected_bytes -= item.held
            if item.payload is not None:
                self._finish_eager(req, item.payload)
            elif item.parked is not None:
                self._claim_parked(req, item.parked)
            else:
                self._accept(req, *item.announced)
            return
        _push(self.posted, req.tag, req)

    # -- progress ------------------------------------------------------------------------
    def progress(self) -> bool:
        if self.dead:
            return False
        moved = self._poll_in()
        return self.pump_out() or moved

    def pump_out(self) -> bool:
        moved = False
        while self.outq:
            kind, item = self.outq[0]
            if kind == "eager":
                if not self._write(EAGER, 0, item.tag, -1, item.nbytes, 0, item.data, *item.fp):
                    break
                self._sent(item)
            elif kind == "rts":
                if item.cma:
                    ok = self._write(RTS, item.cma, item.tag, item.msgid, item.nbytes,
                                     address(item.data), None, *item.fp, item.ways)
                elif item.zc is None:
                    ok = self._write(RTS, RTS_STREAM if item.stream else 0, item.tag, item.msgid,
                                     item.nbytes, 0, None, *item.fp)
                else:
                    alloc, fd, off = item.zc
                    # a sender that only sends in its round offers to copy half (split.py),
                    # unless ranks outnumber cores and it has other copies to make
                    helps = self.split_sender and not item.receiving and (
                        item.ways <= 1 or not self.engine.crowded or CROWDED_BUSY_HELP
                        or item.nbytes >= SPLIT_BUSY_MIN)
                    flag = RTS_ZC_HELP if helps else RTS_ZC
                    ok = self._write(RTS, flag, item.tag, item.msgid, item.nbytes, off, None,
                                     *item.fp, alloc << 32 | fd)
                if not ok:
                    break
            elif kind == "cts":
                msgid, flags, aux, zc, length = item
                if not self._write(CTS, flags, 0, msgid, length, aux, None, 0, 0, zc):
                    break
            elif kind == "put":
                msgid, length = item
                if not self._write(PUT, 0, 0, msgid, length, 0, None):
                    break
            elif kind == "abort":
                tag, mine, theirs, culprit = item
                if not self._write(ABORT, culprit, tag, theirs[0], theirs[1], 0, None, *mine):
                    break
            elif kind == "data":
                before = item.offset
                if not self._send_data(item):
                    return moved or item.offset != before
                self._sent(item)
            elif kind == "bye":
                if not self._write(BYE, 0, 0, 0, 0, 0, None):
                    break
            self.outq.popleft()
            moved = True
        return moved

    def _send_data(self, req: SendRequest) -> bool:
        """Write the message's DATA fragments from ``req.offset`` on, as far as the link
        takes them; True once all are written."""
        while req.offset < req.nbytes:
            n = min(self.frag, req.nbytes - req.offset)
            if not self._write(DATA, 0, 0, req.msgid, n, req.offset,
                               req.data[req.offset:req.offset + n]):
                return False
            req.offset += n
        return True

    def _sent(self, req: SendRequest):
        self.msgs_sent += 1
        self.bytes_sent += req.nbytes
        req.done = True

    # -- packets in ----------------------------------------------------------------------
    def _on_packet(self, kind, flags, tag, msgid, length, aux, fp, payload, zc=0) -> None:
        """Handle one packet (DATA is handled by the subclasses, which deliver it in place).
        EAGER and RTS carry the sender's collective fingerprint ``fp``: a receive posted
        with another fingerprint, or a collective of this rank running under the same tag
        with another one, is a mismatch: reported to the engine's ``calls``, which aborts
        the collective on every rank."""
        if kind == EAGER or kind == RTS:
            q = self.posted.get(tag)
            if kind == EAGER and q and q[0].fp == fp:   # the common case first
                self._finish_eager(_pop(self.posted, tag, q), payload)
                return
            self._on_message(kind, flags, tag, msgid, length, aux, fp, payload, zc, q)
        elif kind == ABORT:
            self.engine.calls.abort_received(tag, fp, (msgid, length), flags, self.rank)
        elif kind == CTS:
            self._on_cts(flags, msgid, aux, zc, length)
        elif kind == PUT and self.cma is not None:
            self._on_put(msgid, length)
        elif kind == BYE:
            self.closing = True
        elif kind != PAD:
            raise ProtocolError(f"unexpected packet kind {kind}")

    def _on_message(self, kind, flags, tag, msgid, length, aux, fp, payload, zc, q) -> None:
        """An EAGER or RTS packet: match it to the oldest receive posted for its tag (``q``),
        or keep it until one is posted."""
        stream = kind == RTS and self._check_rts(flags, msgid, length)
        if q and q[0].fp != fp and CHECK_FINGERPRINTS:
            if stream:   # its DATA is on the way: let it drain
                self.incoming[msgid] = _Discard(msgid, length, 0, tag)
            self.engine.calls.mismatch(tag, q[0].fp, fp, self.rank)
            return
        where = None
        if kind == RTS and (flags == RTS_ZC or flags == RTS_ZC_HELP):
            where = (zc >> 32, zc & 0xFFFFFFFF, aux, flags == RTS_ZC_HELP)
        elif kind == RTS and flags == RTS_CMA:
            where = aux          # an address in the sender's memory
        elif kind == RTS and flags == RTS_OFFER and self.cma is not None:
            where = _Offer(aux, zc)  # ... and the sender will write a part of it
        if q:
            if kind == EAGER:
                self._finish_eager(_pop(self.posted, tag, q), payload)
            elif stream:
                self._accept_stream(_pop(self.posted, tag, q), msgid, length)
            else:
                self._accept(_pop(self.posted, tag, q), msgid, length, where)
            return
        # A world that shrank away, or a call that failed here (timed out, refused,
        # mismatched): nobody will ask for it - drop it, not keep it for good
        if self.engine.retired(group_of(tag)) or (fp != NO_FP and tag in self.engine.calls.failed):
            if stream:
                self.incoming[msgid] = _Discard(msgid, length, 0, tag)
            return
        if kind == EAGER or stream:
            self.unexpected_bytes += length
            if self.unexpected_bytes > MAX_UNEXPECTED:
                raise ProtocolError(f"more than {MAX_UNEXPECTED >> 20} MiB of messages "
                                    f"nobody has asked for")
        if kind == EAGER:
            data = bytes(payload)
            item = Unasked(fp, len(data), data)
        elif stream:
            parked = self.incoming[msgid] = _Parked(msgid, length, tag)
            item = Unasked(fp, length, None, parked)
        else:
            item = Unasked(fp, 0, None, None, (msgid, length, where))
        _push(self.unexpected, tag, item)
        if fp != NO_FP and CHECK_FINGERPRINTS:   # (a mismatch drops it with the call's rest)
            self.engine.calls.unasked(tag, fp, self.rank)

    def _check_rts(self, flags, msgid, length) -> bool:
        """Validate an RTS header; True when its DATA follows at once (RTS_STREAM)."""
        # Senders number large messages 0, 1, 2, … in order; a reused id would
        # orphan the receive already matched to it.
        if msgid <= self.last_rts:
            raise ProtocolError(f"RTS reuses message id {msgid}")
        self.last_rts = msgid
        stream = flags == RTS_STREAM
        if stream and not self.stream_max:
            raise ProtocolError("streamed RTS on a link that does not stream")
        if stream and length <= 0:
            raise ProtocolError(f"streamed RTS of {length} bytes")
        return stream

    def _on_cts(self, flags, msgid, aux, zc=0, length=0) -> None:
        if flags == CTS_SPLIT:    # help copy it (it stays ours until CTS_DONE)
            req = self.awaiting_cts.get(msgid)
            if req is None or req.zc is None or self.split_sender is None or length < 0:
                raise ProtocolError(f"CTS_SPLIT for message {msgid}, not offered")
            self.split_sender.help(req, aux, zc, length - 1)   # (length: C's kernel + 1)
            return
        req = self.awaiting_cts.pop(msgid, None)
        if req is None:
            raise ProtocolError(f"CTS for unknown message {msgid}")
        if flags == CTS_DONE:     # the receiver read it from our shared buffer
            self._sent(req)
        elif flags == CTS_PUT:
            self._put_head(req, aux, length)
        elif flags == CTS_REJECT:
            req.fail(ValueError(
                f"send to rank {self.rank} failed: the message has {req.nbytes} bytes but "
                f"the receiver posted a buffer of {aux} bytes"))
        else:
            self.outq.append(("data", req))

    def data_target(self, msgid: int, length: int, aux: int) -> RecvRequest:
        """Validate a DATA header and return the receive it belongs to."""
        req = self.incoming.get(msgid)
        if req is None or aux != req.offset or req.offset + length > req.nbytes:
            raise ProtocolError(f"DATA fragment ({msgid}, {aux}+{length}) matches no posted receive")
        return req

    def data_done(self, req: RecvRequest) -> None:
        if req.offset + req.tail == req.nbytes:
            del self.incoming[req.msgid]
            if isinstance(req, RecvRequest):   # (not a sink: _Discard, _Parked)
                self._received(req)

    def _finish_eager(self, req: RecvRequest, payload) -> None:
        n = len(payload) if not isinstance(payload, np.ndarray) else payload.nbytes
        if n != req.nbytes:
            self._refuse(req, n)
            return
        req.deliver(payload)
        self._received(req)

    def _accept(self, req: RecvRequest, msgid: int, length: int, where=None) -> None:
        if length != req.nbytes:
            self._queue_cts(msgid, CTS_REJECT, req.nbytes)
            self._refuse(req, length)
        elif type(where) is _Offer:
            self.engine.read_in_place += 1
            self._take_offer(req, msgid, where)
        elif where is not None and (got := self.read_remote(req, where, length, msgid)) \
                is not False:
            self.engine.read_in_place += 1
            if got:   # one copy (or reduce), straight from the sender's buffer
                self._received(req)
                self._queue_cts(msgid, CTS_DONE, 0)
            else:     # (the sender copies it now: join_split completes it)
                req.msgid = msgid
        else:
            req.msgid = msgid
            self.incoming[msgid] = req
            self._queue_cts(msgid, CTS_OK, 0)
        self.pump_out()

    def _queue_cts(self, msgid: int, flags: int, aux: int, zc: int = 0, length: int = 0,
                   kind: str = "cts") -> None:
        """A CTS (or PUT) goes ahead of our DATA still queued (after other control packets):
        queued behind a long message of ours, it would hold the peer's message back until
        ours is out, and the two directions of a link would take turns instead of both
        streaming (half the rate of a shaped TCP link). DATA names its message and
        offset, so a CTS may come between two fragments."""
        i = next((k for k, (kind, _) in enumerate(self.outq) if kind == "data"), len(self.outq))
        self.outq.insert(i, (kind, (msgid, flags, aux, zc, length) if kind == "cts"
                             else (msgid, length)))

    # -- a one-way message from a plain buffer, copied by both sides at once (cma.py) -------
    def _take_offer(self, req: RecvRequest, msgid: int, offer: _Offer) -> None:
        """Receiver: ask the sender to write the head into our buffer (CTS_PUT), and read
        the tail meanwhile; the receive completes on the sender's PUT (_on_put). Where
        ranks outnumber cores, read it all instead (cma.Reader.reads_whole). A receive
        that reduces, or a buffer not contiguous, or one whose round copied locally first
        (``ways`` 0), or one at a distance from the sender's where the kernel copies slowly
        (cma.fast_offset) takes the stream (CTS_OK) instead; one whose reads the kernel
        refuses asks for the whole message to be written (or, read whole, takes the
        stream). One posted before its round's local copies (``ways`` WRITE_WHOLE: a
        gather's root, work.CollectiveWork._post) asks the sender to write it all while
        it copies its own block, even where ranks outnumber cores; once they are done
        (WRITE_WHOLE_IDLE) only there."""
        req.msgid = msgid
        self.incoming[msgid] = req
        ways, crowded = req.ways, self.engine.crowded
        # (once the root's copies are done, a late offer is split as any, where each rank
        # has a core; crowded, written whole still: read whole by the root, it lost)
        whole = ways == WRITE_WHOLE or (ways == WRITE_WHOLE_IDLE and crowded)
        if req.ufunc is not None or not req.dst.flags.c_contiguous or not ways or \
                (whole and not self.cma.put_ok):
            self._queue_cts(msgid, CTS_OK, 0)
            return
        n, addr = req.nbytes, offer.addr
        if not self.cma.fast_at(address(req.dst), addr):   # (a write is as slow there)
            self._queue_cts(msgid, CTS_OK, 0)
            return
        head = (n if whole else
                0 if self.cma.reads_whole(crowded) and self.cma.ok else
                self.cma.head_bytes(n, offer.ways, max(ways, 1)))
        if head == 0:             # we read it all (the sender is the busier side)
            if self.cma.deliver(req, addr, n):
                del self.incoming[msgid]
                self._received(req)
                self._queue_cts(msgid, CTS_DONE, 0)
            else:
                self._queue_cts(msgid, CTS_OK, 0)
            return
        self._queue_cts(msgid, CTS_PUT, req.dst.ctypes.data, length=head)
        self.pump_out()           # the sender starts on the head now
        if head < n and self.cma.read_tail(req, addr, head):
            req.tail = n - head

    def _put_head(self, req: SendRequest, addr: int, head: int) -> None:
        """Sender: write our message's first ``head`` bytes at ``addr`` in the receiver (the
        buffer its CTS_PUT named), say how many went (PUT: 0 if the kernel refused), and
        wait for its answer: CTS_DONE, or CTS_OK to stream the rest from there."""
        if req.cma != RTS_OFFER or not 0 < head <= req.nbytes:
            raise ProtocolError(f"CTS_PUT of {head} bytes for message {req.msgid}, which was "
                                f"not offered so")
        wrote = head if self.cma.put(req.data[:head], addr) else 0
        req.offset = wrote
        self.awaiting_cts[req.msgid] = req
        self._queue_cts(req.msgid, 0, 0, length=wrote, kind="put")

    def _on_put(self, msgid: int, length: int) -> None:
        """Receiver: the sender wrote our message's first ``length`` bytes (0: refused).
        Complete when the tail is in too (CTS_DONE: the sender may let go of its buffer);
        else the rest streams from the first byte missing (CTS_OK)."""
        req = self.data_target(msgid, length, 0)
        req.offset += length
        if req.offset + req.tail < req.nbytes and isinstance(req, RecvRequest):
            req.tail = 0
            self._queue_cts(msgid, CTS_OK, 0)
        else:                     # (a failed receive's sink: the sender may let go too)
            del self.incoming[msgid]
            if isinstance(req, RecvRequest):
                self._received(req)
            self._queue_cts(msgid, CTS_DONE, 0)
        self.pump_out()

    def _accept_stream(self, req: RecvRequest, msgid: int, length: int) -> None:
        """A streamed message met its receive: its DATA goes straight there."""
        if length != req.nbytes:
            self.incoming[msgid] = _Discard(msgid, length, 0, req.tag)
            self._refuse(req, length)
            return
        req.msgid = msgid
        self.incoming[msgid] = req

    def _claim_parked(self, req: RecvRequest, parked: _Parked) -> None:
        """A receive posted for a streamed message that arrived first: take what is parked,
        and the rest of its DATA as it comes."""
        done = parked.offset == parked.nbytes    # (then it has left ``incoming``)
        if parked.nbytes != req.nbytes:
            if not done:
                self.incoming[parked.msgid] = _Discard(parked.msgid, parked.nbytes,
                                                       parked.offset, parked.tag)
            self._refuse(req, parked.nbytes)
            return
        for piece in parked.pieces:    # (whole fragments: whole elements, as deliver needs)
            req.deliver(piece)
        parked.pieces = []
        if done:
            self._received(req)
        else:
            req.msgid = parked.msgid
            self.incoming[parked.msgid] = req

    def _refuse(self, req: RecvRequest, length: int) -> None:
        """Fail a receive whose message has another size (the link goes on)."""
        req.fail(ValueError(f"recv from rank {self.rank}: message has {length} bytes but the "
                            f"receive buffer has {req.nbytes} bytes; nothing was written"))

    def _received(self, req: RecvRequest):
        self.msgs_recv += 1
        self.bytes_recv += req.nbytes
        req.done = True

    # -- failure -------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """The peer is gone: fail everything that depends on it."""
        if self.dead:
            return
        self.dead = exc
        for q in self.posted.values():
            for req in q:
                req.fail(exc)
        for req in list(self.incoming.values()) + list(self.awaiting_cts.values()):
            req.fail(exc)
        for kind, item in self.outq:
            if isinstance(item, Request):
                item.fail(exc)
        self.posted.clear()
        self.incoming.clear()
        self.awaiting_cts.clear()
        self.outq.clear()
        self.engine.calls.peer_failed(self.rank, exc)

    zero_copy = False   # transports that can read a local sender's rl.empty buffer say so
    zc_min = 0          # ... and above how many bytes such a message goes by RTS, not eagerly
    zc_oneway_min = 0   # ... or, from a sender that does not receive in its round, this many
    stream_max = 0      # largest message whose DATA follows its RTS at once (0: none does)

    cma_min = -1        # ... and above how many bytes a plain buffer's is offered by address
    p2p_zc_min = 0      # zc_oneway_min and cma_min of a point-to-point send (limits.py,
    p2p_cma_min = -1    # ZERO_COPY_P2P_MIN)
    cma = None          # ... and the cma.Reader that moves such messages (shm)

    def read_remote(self, req: RecvRequest, where, nbytes: int, msgid: int):
        """Read the sender's message ``msgid`` where its RTS says it lies (an rl.empty
        buffer's (alloc id, fd, offset, whether the sender offers to copy half), or a
        private buffer's address) into ``req``: True when done, False (``req`` untouched)
        when this link cannot: then it is streamed; None when the sender copies it while
        this rank copies its own block (``req.ways`` WRITE_WHOLE): ``join_split`` then
        completes it."""
        return False

    def join_split(self, req: RecvRequest) -> None:
        """Complete ``req`` if ``read_remote`` left it to its sender (None); none here."""

    split_sender = None   # a transport whose senders copy half of a split message: its split.Sender

    def send_abort(self, tag, mine, theirs, culprit) -> None:
        self.outq.append(("abort", (tag, mine, theirs, culprit)))
        self.pump_out()

    def fail_tag(self, tag, exc) -> None:
        """Fail every posted receive of one collective (it was aborted); its sends still
        queued here stop reading the caller's buffers (``detach``)."""
        self.detach(lambda req: req.tag == tag)
        for req in self.posted.pop(tag, ()):
            req.fail(exc)
        for item in self.unexpected.pop(tag, ()):     # nobody will ask for these now
            self.unexpected_bytes -= item.held
        for msgid, req in list(self.incoming.items()):
            if req.tag == tag and not isinstance(req, _Discard):
                req.fail(exc)
                # Fragments may still be on their way: drain them instead of failing the link.
                self.incoming[msgid] = _Discard(msgid, req.nbytes, req.offset, tag,
                                                getattr(req, "dst", None))

    def retire(self, exc) -> None:
        """Forget the receives and unasked-for messages of every group the engine retired
        (a world that shrank away); the rest of their data is drained."""
        gone = self.engine.retired
        for tag in [t for t in self.posted if gone(group_of(t))]:
            for req in self.posted.pop(tag):
                req.fail(exc)
        for tag in [t for t in self.unexpected if gone(group_of(t))]:
            for item in self.unexpected.pop(tag):
                self.unexpected_bytes -= item.held
        for msgid, req in list(self.incoming.items()):
            if gone(group_of(req.tag)) and not isinstance(req, _Discard):
                req.fail(exc)
                self.incoming[msgid] = _Discard(msgid, req.nbytes, req.offset, req.tag,
                                                getattr(req, "dst", None))

    def detach(self, which) -> None:
        """The sends queued here that ``which(req)`` picks (of a call that gave up or
        failed, whose caller may write its buffers next) copy what they have yet to send,
        now, while the buffers still hold what the call was given: a receiver still
        reading them then gets those bytes, not torn ones. That includes a send whose RTS
        offers its address (by CMA, or in an rl.empty segment): its receiver may still
        answer that it wants the bytes streamed (it reduces, or the addresses lie at a slow
        distance). One that reads the caller's buffer in place instead looks, before it
        completes, for its sender's word that it gave up (work.CollectiveWork._abort_behind)."""
        queued = [item for kind, item in self.outq if kind in ("eager", "rts", "data")]
        for req in {id(r): r for r in queued + list(self.awaiting_cts.values())}.values():
            if not req.done and which(req):
                req.data = req.data.copy()

    def pending(self) -> bool:
        return bool(self.outq or self.incoming or self.awaiting_cts
                    or any(self.posted.values()))

    def close(self) -> None:
        pass


def _push(queues: dict, tag: int, item) -> None:
    q = queues.get(tag)
    if q is None:
        queues[tag] = deque((item,))
    else:
        q.append(item)


def _pop(queues: dict, tag: int, q: deque):
    """Take the oldest item of a tag's queue; forget the queue once empty (every collective
    call has its own tag, so empty queues would pile up)."""
    item = q.popleft()
    if not q:
        del queues[tag]
    return item


class ProtocolError(RingletError):
    """A peer sent a packet that breaks the protocol (corrupt, malicious or out of order)."""


def peer_failure(rank: int, why: str, left: bool = False) -> PeerFailure:
    return PeerFailure(f"rank {rank} failed: {why}", rank=rank, left=left)
