"""Recording what each rank did: every collective call and every message, per rank.

Turn it on with ``RINGLET_TRACE=DIR`` (read by ``rl.init``), ``ringlet run --trace DIR``,
or ``with rl.trace(DIR): ...`` inside a job (``runtime.trace``). Each rank writes ``DIR/rank<R>.jsonl`` when
tracing stops (the block ends, ``rl.destroy``, or the process exits): one JSON object a
line — a header (rank, host, clocks), then per call::

    {"ev": "call", "coll": "all_reduce", "algo": "ring", "group": "world", "seq": 12,
     "bytes": 4096, "dtype": "float32", "start": t, "end": t, "waited": s, "waited_on": r,
     "predicted": s, "path": "python" | "C" | "C, then python", "tag": tag}

where "bytes" is the call's size as the cost model and every report count it (the whole
output of an all_gather or gather, the whole input of a reduce_scatter, all_to_all or
scatter) and "predicted" the model's seconds for a call of that size and dtype on this
host;

per point-to-point operation the same kind of record with "coll" send, recv, isend or
irecv, "algo" "point-to-point", "seq" null, "peer" (world rank), "user_tag" and, for
"predicted", one message's (``cost.predict_p2p``); and per
message ``{"ev": "send" | "recv", "peer": r, "bytes": n, "path": P, "ts": t, "tag": tag,
"seq": 12}`` (a point-to-point message: the wire tag, seq null), where P is how it travelled: "C fast path" (the whole call ran in C: its
messages are stamped at the call's start and end, C keeps no clock), "eager" (one packet,
copied in and out of the ring or socket), "streamed" (RTS with its data right behind),
"rendezvous" (RTS, wait for CTS, then data), "read in place" (the receiver copies
straight out of the sender's rl.empty buffer), "read by CMA" (the receiver reads it whole
from the sender's private buffer by process_vm_readv) or "offered by CMA" (the same, or
split with the sender, which has nothing else to do: cma.py). A receive is stamped when its round
completed (the rank noticed every message of the round in). Times are seconds on the
monotonic clock; the header pairs it with the wall clock so ranks of several hosts line up.

``ringlet trace merge DIR -o job.json`` turns the files into one Chrome/Perfetto trace and
``ringlet trace summary DIR`` says who everyone waited for (:mod:`ringlet.timeline`).

Cost: the runtime checks the module flag :data:`ON` once per call; while it is off nothing
else runs. While on, a call and each message cost a tuple appended to a list; the JSON and
the model's predictions are made when the file is written.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import time

from .buffers import locate
from .transport.protocol import RTS_CMA

ON = False          # checked by the runtime once per call: keep it a plain module global
_REC = None         # the Recorder while ON


class Recorder:
    """One rank's events, kept in memory as tuples (cheap to make) and written out, as
    JSON and with the model's predictions, once at :meth:`close`."""

    def __init__(self, directory: str, rank: int, world_size: int):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"rank{rank}.jsonl")
        self.rank, self.world_size = rank, world_size
        # (what, p, bytes, tag, start, end, waited, waited_on, path, error, p2p, shared,
        # dtype): what is (collective, seq, group, algorithm); p2p None, or (peer, user
        # tag, its message); shared the names of the call's rl.empty buffers; dtype the
        # elements' type's name
        self.calls: list = []
        self.msgs: list = []       # (send or recv, peer, bytes, path, ts, tag, seq)
        self.c_msgs: list = []     # what the C fast path sent and received, see c_messages
        self._predicted: dict = {}
        self.mono0, self.wall0 = time.perf_counter(), time.time()

    def predicted(self, coll: str, algo: str, p: int, nbytes: int,
                  shared: tuple = (), dtype: str | None = None) -> float | None:
        """The cost model's seconds for this call on this host (cached per shape), from
        ``shared``: the buffers that are rl.empty arrays, and ``dtype`` (a 16-bit float's
        reduction costs more); a point-to-point one's (``algo`` "point-to-point"): one
        message between two ranks."""
        key = (coll, algo, p, nbytes, shared, dtype)
        t = self._predicted.get(key, False)
        if t is False:
            try:
                from .cost import predict_host, predict_p2p
                t = predict_p2p(nbytes, shared=bool(shared)) if algo == "point-to-point" \
                    else predict_host(coll, nbytes, p, algo, shared=shared, dtype=dtype)
            except (ValueError, KeyError, RuntimeError, TypeError):
                t = None
            self._predicted[key] = t
        return t

    def call_record(self, c) -> dict:
        (coll, seq, group, algo), p, nbytes, tag, t0, t1, waited, waited_on, path, err, pp, \
            shared, dtype = c
        out = {"ev": "call", "coll": coll, "algo": algo, "group": group, "seq": seq, "p": p,
               "bytes": nbytes, "tag": tag, "start": t0, "end": t1, "waited": waited,
               "waited_on": waited_on, "path": path}
        if pp is None:
            out["dtype"] = dtype
            out["predicted"] = self.predicted(coll, algo, p, nbytes, shared, dtype)
        else:       # one message between two ranks
            out.update(peer=pp[0], user_tag=pp[1],
                       predicted=self.predicted(coll, algo, 2, nbytes, shared))
        if err is not None:
            out["error"] = err
        return out

    def close(self) -> str:
        head = {"ev": "header", "rank": self.rank, "world_size": self.world_size,
                "host": socket.gethostname(), "pid": os.getpid(),
                "mono0": self.mono0, "wall0": self.wall0}
        os.makedirs(os.path.dirname(self.path), exist_ok=True)   # (it may be gone by now)
        with open(self.path, "w") as f:
            f.write(json.dumps(head) + "\n")
            for c in self.calls:
                f.write(json.dumps(self.call_record(c)) + "\n")
            p2p = [c[10][2] for c in self.calls if c[10] is not None]
            for kind, peer, nbytes, path, ts, tag, seq in (self.msgs + p2p
                                                           + c_messages(self.c_msgs)):
                f.write(json.dumps({"ev": kind, "peer": peer, "bytes": nbytes, "path": path,
                                    "ts": ts, "tag": tag, "seq": seq}) + "\n")
        return self.path


def start(directory: str, rank: int, world_size: int) -> None:
    """Record this rank's calls until :func:`stop` (or the process exits)."""
    global ON, _REC
    if _REC is not None:
        stop()
    _REC = Recorder(directory, rank, world_size)
    ON = True


def stop() -> str | None:
    """Stop recording and write this rank's file; returns its path (None if not on)."""
    global ON, _REC
    rec, _REC, ON = _REC, None, False
    return rec.close() if rec is not None else None


atexit.register(stop)


def from_env(rank: int, world_size: int) -> None:
    """``rl.init``: start when RINGLET_TRACE names a directory."""
    directory = os.environ.get("RINGLET_TRACE")
    if directory:
        start(directory, rank, world_size)


# ------------------------------------------------------------------- runtime's hooks

def c_messages(runs) -> list:
    """Message records of calls the C fast path ran: per (plan, rounds done, receives
    done of the next round or -1, itemsize, start, end, tag, seq), the sends of the
    rounds done stamped at the start and their receives at the end, and the next round's
    sends if C sent them (its receives finish in Python, which records them)."""
    out = []
    for plan, done, mask, isz, t0, t1, tag, seq in runs:
        for rnd in plan[:done]:
            for t in rnd.sends:
                out.append(("send", t.dst, (t.s1 - t.s0) * isz, "C fast path", t0, tag, seq))
            for t in rnd.recvs:
                out.append(("recv", t.src, (t.d1 - t.d0) * isz, "C fast path", t1, tag, seq))
        if mask >= 0:
            for t in plan[done].sends:
                out.append(("send", t.dst, (t.s1 - t.s0) * isz, "C fast path", t0, tag, seq))
    return out


class Call:
    """One traced collective call; the runtime makes it only when :data:`ON` (see
    collectives._run). It stamps and keeps what it needs; the record is made at close."""
    __slots__ = ("rec", "what", "tag", "nbytes", "p", "plan", "peers", "path", "start",
                 "shared", "dtype")

    def __init__(self, what, tag: int, nbytes: int, p: int, plan, peers, shared=(),
                 dtype: str | None = None):
        self.rec = _REC
        self.what, self.tag, self.nbytes, self.p, self.plan, self.peers = \
            what, tag, nbytes, p, plan, peers
        self.shared = shared     # the names of its rl.empty buffers (read in place)
        self.dtype = dtype       # its elements' (the model prices a 16-bit reduction apart)
        self.path = "python"
        self.start = time.perf_counter()

    def posted(self, sends, bufs, receiving: bool = False, in_place: bool = True) -> None:
        """A round's sends went out (or were queued): one event each, with its path
        (``receiving``, ``in_place``: see :func:`path_of`)."""
        now, msgs, tag, seq, peers = time.perf_counter(), self.rec.msgs, self.tag, self.what.seq, self.peers
        for t in sends:
            b = bufs[t.sbuf]
            msgs.append(("send", t.dst, (t.s1 - t.s0) * b.itemsize,
                         path_of(peers[t.dst], b, t.s0, t.s1, receiving, in_place,
                                 reduced=t.reduce), now, tag,
                         seq))

    def round_done(self, recvs, bufs) -> None:
        now, msgs, tag, seq = time.perf_counter(), self.rec.msgs, self.tag, self.what.seq
        for t in recvs:
            msgs.append(("recv", t.src, (t.d1 - t.d0) * bufs[t.dbuf].itemsize, None, now, tag,
                         seq))

    def ran_in_c(self, resume, rounds: int, bufs) -> None:
        """The C fast path ran ``resume.rounds`` of the plan's ``rounds`` rounds (a
        ``fast.FastRun``): their sends are stamped at the call's start, receives at now (C keeps
        no clock). Their records are made when the file is written (:func:`c_messages`);
        a call C finished ends here."""
        done, mask = resume.rounds, resume.recv_mask
        now = time.perf_counter()
        self.rec.c_msgs.append((self.plan, done, mask, bufs["tmp"].itemsize, self.start, now,
                                self.tag, self.what.seq))
        if done == rounds:
            self.path = "C"
            self.end(resume.waited, resume.waited_on, now=now)
        else:
            self.path = "C, then python"

    def end(self, waited: float, waited_on, error=None, now=None) -> None:
        rec = self.rec
        if rec is _REC:          # not a call that outlived its trace
            rec.calls.append((self.what, self.p, self.nbytes, self.tag, self.start,
                              now or time.perf_counter(), waited, waited_on, self.path,
                              None if error is None else f"{type(error).__name__}: {error}",
                              None, self.shared, self.dtype))


class P2P:
    """One traced point-to-point operation (send, recv, isend, irecv); the runtime makes it
    only when :data:`ON`. Its call spans posting to completion (a blocking one: the whole
    call); its message is a send stamped when posted, or a receive stamped when done, with
    the wire tag both sides use, so the merge draws the arrow between them (both records
    are made from the call's one tuple when the file is written). ``waited``: a receive's
    whole span (it waits for its sender); a send's time after it was posted if it could not
    go at once (a rendezvous waits for the receiver), else 0; in C, the span."""
    __slots__ = ("rec", "what", "kind", "peer", "wire", "nbytes", "user_tag", "start",
                 "posted", "sent_at", "path", "shared")

    def __init__(self, op: str, kind: str, world: int, wire: int, data, group: str,
                 user_tag: int):
        self.rec = _REC
        self.what = (op, None, group, "point-to-point")
        self.kind, self.peer, self.wire, self.nbytes, self.user_tag = \
            kind, world, wire, data.nbytes, user_tag
        # a send from an rl.empty buffer (read in place when large: priced so)
        self.shared = ("buf",) if kind == "send" and locate(data) is not None else ()
        self.posted = self.path = None
        self.start = self.sent_at = time.perf_counter()

    def sent(self, path: str, done: bool) -> None:
        """The send went out (``done``) or was posted to go when it can."""
        now = time.perf_counter()
        self.posted = None if done else now
        self.sent_at, self.path = now, path

    def ran_in_c(self) -> None:
        """C did the whole blocking call (its send is stamped at the start, as in
        :meth:`Call.ran_in_c`; C does not tell waiting from copying: all of it is waited)."""
        self.path = "C fast path"
        self.posted = self.start
        self.end(in_c=True)

    def end(self, in_c: bool = False, error=None) -> None:
        now, rec = time.perf_counter(), self.rec
        if self.kind == "recv":
            waited = now - self.start
            msg = ("recv", self.peer, self.nbytes, "C fast path" if in_c else None, now,
                   self.wire, None)
        else:
            waited = 0.0 if self.posted is None else now - self.posted
            msg = ("send", self.peer, self.nbytes, self.path, self.sent_at, self.wire, None)
        if rec is _REC:
            rec.calls.append((self.what, 2, self.nbytes, self.wire, self.start, now, waited,
                              self.peer, "C" if in_c else "python",
                              None if error is None else f"{type(error).__name__}: {error}",
                              (self.peer, self.user_tag, msg), self.shared, None))


def path_of(peer, buf, start: int, stop: int, receiving: bool = False,
            in_place: bool = True, p2p: bool = False, reduced: bool = False) -> str:
    """How a send of ``buf[start:stop]`` travels over ``peer``: the rules of
    ``Peer.send_now`` and ``Peer.post_send`` (``receiving``: its round receives too;
    ``in_place``: its call lets rl.empty messages be read in place; ``p2p``: a
    point-to-point send's limits; ``reduced``: its receiver reduces it). (A receiver
    cannot tell; the merge gives a receive its send's.)"""
    view = buf[start:stop]
    n = view.nbytes
    if peer.zero_copy and n > peer.zero_copy_least(receiving, p2p):
        if in_place and locate(view) is not None:
            return "read in place"
        if not reduced and view.flags.c_contiguous:
            way = peer.by_cma(n, receiving, p2p)
            if way:
                return "read by CMA" if way == RTS_CMA else "offered by CMA"
    if n <= peer.eager:
        return "eager"
    return "streamed" if n <= peer.stream_max else "rendezvous"


__all__ = ["ON", "start", "stop", "from_env", "Call", "P2P", "path_of"]
