"""Work handles for asynchronous operations, and the executor of one rank's part of a
Schedule (a resumable state machine, so several collectives can be in flight at once)."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import NamedTuple

import numpy as np

from .errors import PeerFailure, RingletError, TimeoutError
from .profiling import profiled
from .group import TAG_COLLECTIVE, TAG_GROUP_SHIFT
from .schedule import REDUCE, LocalStep, PlanRound, RecvStep, SendStep
from .transport import copies
from .transport.progress import HANDOFF
from .transport.fast import _fastpath
from .transport.limits import SHM_EAGER_BYTES as BIG   # (smaller sends: order is moot)
from .transport.protocol import (RTS_CMA, WRITE_WHOLE, WRITE_WHOLE_IDLE, RecvRequest,
                                  SendRequest)

# An exchange round (large sends announced before its local copies, receives that no local
# step touches) posts its receives before the copies, and looks for the peers' messages
# every POLL_CHUNK bytes copied (_local_polling). bench/exchange_order.py (one job, the two
# orders in alternating blocks, old/new of the median block pair), 8 MiB, loaded host:
# p = 2, four runs at load 7-13: all_gather plain 1.05-1.26, rl.empty 0.96-1.24, all_to_all
# plain 1.01-1.33, rl.empty 1.03-1.41 (voluntary context switches per call 1.1-1.4 ->
# 0.9-1.3); p = 4 (ranks outnumber the 2 cores), three runs at load 10-17: 0.96-1.26,
# 0.81-1.32, 1.00-1.11, 0.90-1.03 - no loss beyond the noise there.
EARLY_RECV = True
# A root's round that copies its own block and receives large one-way messages (a
# gather's) posts its receives first too; each sender then writes its whole message into
# the root while the root copies (protocol.WRITE_WHOLE), or from rl.empty copies it in
# through the mapping, the root taking what is left after its copy (split.Receiver.offer).
# bench/exchange_order.py --round root --fresh (one job, old/new of the median block pair,
# load 0.5-1.4): plain p = 2 8 MiB 1.39-6.27, 32 MiB 1.31-1.65, p = 4 8 MiB 1.37-2.30,
# 32 MiB 1.48-3.84; rl.empty p = 2 1.18-1.93, p = 4 1.09-1.30; 2 MiB (streamed) 0.99-1.02.
EARLY_ROOT = True
POLL_CHUNK = 512 << 10


class Work:
    """Handle of an operation started with ``async_op=True``, ``isend`` or ``irecv``."""

    def __init__(self, engine, what):
        self.engine = engine
        self._what = what
        self.error: BaseException | None = None

    @property
    def what(self) -> str:
        return self._what

    @property
    def operation(self) -> str:
        """Its operation's name ("send", "recv", "all_reduce", ...): a profile's row."""
        return self._what.split(" ", 1)[0]

    _future = None

    def is_completed(self) -> bool:
        """True once it has finished (or failed: ``wait`` raises why). It only looks while
        the background thread drives; with RINGLET_PROGRESS=0 it drives one turn."""
        eng = self.engine
        if eng.closed:          # (rl.destroy ended it, done or not: wait says how)
            return True
        if not self._done() and not eng.background.on and eng.lock.acquire(False):
            try:
                eng.progress()
            finally:
                eng.lock.release()
        if self._done():
            self._settle()
            return True
        return False

    def get_future(self) -> "WorkFuture":
        """A ``concurrent.futures.Future`` completed when the work finishes (its result
        None, or the work's error) by the thread that sees it finish - the background
        thread, or a waiter - which runs its callbacks then."""
        if self._future is None:
            self._future = WorkFuture(self)
            if self._done():   # (else whoever sees it finish settles it)
                self._settle()
        return self._future

    _spun = 0.0   # seconds the C fast path already spun for it: the engine spins less

    @profiled(None)
    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation completes; raise its error if it failed.
        ``timeout`` (seconds) defaults to the one given to ``init``."""
        if timeout is not None:
            check_timeout(timeout)
        if self.engine.closed and not self._done():
            if self.error is None:
                self.error = RingletError(f"rank {self.engine.rank}: {self.what}: rl.destroy() "
                                          f"ended ringlet before it completed: it never will")
            self._settle()
            self._reported = True
            raise self.error
        spun, self._spun = self._spun, 0.0
        if not self._done() or self.error is not None:
            eng = self.engine
            bg = eng.background
            limit = (self.limit or eng.timeout) if timeout is None else timeout
            deadline = time.monotonic() + limit
            # Another thread that wants the engine (a future's callback making a blocking
            # call, the progress thread) gets it between turns of this wait: else a wait on
            # a peer that waits for that thread's call never ends.
            done = lambda: self._done() or eng.wanted > 0  # noqa: E731
            eng.enter()
            try:
                while True:
                    if bg.watched:   # (else the checks cost nothing)
                        done = lambda: self._done() or eng.wanted or bool(bg.due(self))  # noqa: E731
                    eng.wait(done, max(deadline - time.monotonic(), 0.0),
                             lambda _: self._describe_timeout(limit), self._waiting_on, spun)
                    spun = 0.0          # (C's spin counts against the first wait only)
                    if self._done():
                        break
                    # Other works finished whose futures' callbacks must run before this one
                    # can (a chained call's next step: Chained), or a callback already
                    # running in the background thread wants the engine to post that step:
                    # while this wait holds the engine neither could, and peers waiting
                    # for that step would wait for ever. Callbacks run outside the lock
                    # (they may call ringlet).
                    due = bg.due(self)
                    eng.leave()
                    try:
                        for w in due:
                            w._settle()
                        handoff = time.monotonic() + HANDOFF
                        while eng.wanted and not eng.lock.locked() \
                                and time.monotonic() < handoff:
                            os.sched_yield()    # (Python's lock is not fair)
                    finally:
                        eng.enter()
                if isinstance(self.error, PeerFailure):
                    eng.flush_aborts()
            finally:
                eng.leave()
        if self._future is not None:
            self._settle()
        if self.error is None:
            self.error = self._error()
        if self.error is not None:
            self._reported = True
            raise self.error
        return True

    _reported = False   # its error was raised to the user (destroy need not say it again)
    limit = None        # the call's own timeout (track): what wait() waits by default

    def drive_while_moving(self, stall: float) -> bool:
        """Drive the engine for this work until it is done, or until nothing has moved for
        ``stall`` seconds (a peer busy elsewhere: it may first need something from this
        rank's caller); True if done. Raises nothing: ``wait`` reports the outcome."""
        eng = self.engine
        eng.enter()
        try:
            moved = time.monotonic()
            while not self._done():
                if eng.progress():
                    moved = time.monotonic()
                elif time.monotonic() - moved > stall:
                    return False
                else:
                    os.sched_yield()    # (ranks may outnumber the cores)
        finally:
            eng.leave()
        return True

    def _settle(self) -> None:
        """Complete the future, if any (once, whichever thread sees the work finish)."""
        fut = self._future
        if fut is None or fut.done():
            return
        err = self.error if self.error is not None else self._error()
        try:
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)
                self._reported = True   # the user's future carries it (destroy need not)
        except InvalidStateError:   # the other thread settled it first
            pass

    def _done(self) -> bool:
        raise NotImplementedError

    def _error(self):
        return None

    def _waiting_on(self):
        return ()

    def _describe_timeout(self, limit: float) -> str:
        peers = sorted(set(self._waiting_on()))
        who = f" waiting for rank(s) {peers}" if peers else ""
        return f"rank {self.engine.rank}: {self.what} timed out after {limit:g} s{who}"


def check_timeout(timeout) -> None:
    """Reject a call's ``timeout`` unless it is a positive number of seconds (None: the
    job's default), before the call moves anything."""
    try:
        ok = not isinstance(timeout, bool) and timeout > 0
    except TypeError:
        ok = False
    if not ok:      # (NaN too: it is not > 0)
        raise ValueError(f"timeout={timeout!r}: give a positive number of seconds, or None "
                         f"for the job's default (init's timeout, else RINGLET_TIMEOUT)")


class WorkFuture(Future):
    """The future of a Work: ``done()``, ``result(timeout)``, ``exception()``,
    ``add_done_callback(fn)`` as in concurrent.futures, and ``wait(timeout)`` (as torch's
    futures). ``result`` and ``wait`` drive the work themselves if it is not done."""

    def __init__(self, work: Work):
        super().__init__()
        self.work = work

    def result(self, timeout: float | None = None):
        if not self.done():
            try:
                self.work.wait(timeout)
            except BaseException:
                if not self.done():   # a timeout: the work goes on
                    raise
        return super().result(0)

    def wait(self, timeout: float | None = None):
        return self.result(timeout)


class RequestWork(Work):
    """A single point-to-point send or receive."""

    def __init__(self, engine, req, what: str, on_done=None):
        super().__init__(engine, what)
        self.req = req
        self.on_done = on_done

    def _done(self) -> bool:
        return self.req.done

    def _error(self):
        error = self.req.error
        if error.__class__ is PeerFailure and error.rank is not None and \
                not getattr(error, "call", None):
            # (as a collective's: which of the rank's calls the peer's failure ended)
            error = _in_call(error, f"rank {self.engine.rank}: {self.what}")
        return error

    def _waiting_on(self):
        return () if self.req.done else (self.req.peer,)

    def _describe_timeout(self, limit: float) -> str:
        """A receive's timeout names the messages its peer sent on other tags of the group
        that no receive has taken: a tag that differs between send and recv looks so."""
        text = super()._describe_timeout(limit)
        req = self.req
        peer = self.engine.peers.get(req.peer) if isinstance(req, RecvRequest) else None
        held = getattr(peer, "unexpected", None)
        if req.done or not held:
            return text
        mine = req.tag >> TAG_GROUP_SHIFT
        tags = sorted((t & (TAG_COLLECTIVE - 1), len(q)) for t, q in held.items()
                      if t >> TAG_GROUP_SHIFT == mine and not t & TAG_COLLECTIVE and q)
        if tags:
            said = ", ".join(f"{n} on tag {t}" for t, n in tags)
            text += (f"; rank {req.peer} has sent messages that no receive has taken ({said}): "
                     f"do the send's and the recv's tags differ?")
        return text

    @property
    def operation(self) -> str:
        """The row "isend" or "irecv": only those hand their work to the caller (a blocking
        call's own wait is its call's), so a profile adds its wait to their row."""
        return "i" + super().operation


class Chained(Work):
    """Two works as one: ``first``, then the work ``then()`` starts once first has
    succeeded. Whichever thread sees first finish starts the second from first's future's
    callback - outside the engine's lock, as callbacks run - so nobody need wait for it."""

    def __init__(self, engine, first: Work, then, what: str):
        super().__init__(engine, what)
        self.first, self.then, self.second = first, then, None
        self.started = threading.Event()   # second started, or never will be
        first.get_future().add_done_callback(self._start)

    def _start(self, fut) -> None:
        try:
            if fut.exception() is None:
                self.second = self.then()
        except BaseException as exc:   # (a bad argument found once first's data is in)
            self.error = exc
        finally:
            self.started.set()
        if self.second is None:
            self._settle()
        else:
            self.second.get_future().add_done_callback(lambda _: self._settle())

    def _done(self) -> bool:
        return self.started.is_set() and (self.second is None or self.second._done())

    def _error(self):
        w = self.first if self.second is None else self.second
        return w.error if w.error is not None else w._error()

    def _waiting_on(self):
        return (self.first if self.second is None else self.second)._waiting_on()

    def is_completed(self) -> bool:
        if not self.started.is_set() and not self.first.is_completed():
            return False
        self.started.wait()   # (the thread that settled first is starting the second)
        if self.second is not None and not self.second.is_completed():
            return False
        self._settle()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        start = time.monotonic()
        self.first.wait(timeout)   # (its error settles this work's future through _start)
        self.started.wait()
        if self.error is None and self.second is not None:
            left = None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)
            try:
                self.second.wait(left)
            except BaseException as exc:
                if not self.second._done():   # a timeout: it goes on
                    raise
                self.error = exc
        self._settle()
        if self.error is not None:
            self._reported = True
            raise self.error
        return True


class AllOf(Work):
    """Works issued together as one (what the caller sees as one call): done when every
    one is, failed with the first one's error. Each one's future settles this one's
    once all are done, so nobody need wait for it."""

    def __init__(self, engine, works: list, what: str):
        super().__init__(engine, what)
        self.works = works
        for w in works:
            w.get_future().add_done_callback(self._one_done)

    def _one_done(self, _) -> None:
        if self._done():
            self._settle()

    def _done(self) -> bool:
        return all(w._done() for w in self.works)

    def _error(self):
        for w in self.works:
            err = w.error if w.error is not None else w._error()
            if err is not None:
                return err
        return None

    def _waiting_on(self):
        return tuple(r for w in self.works if not w._done() for r in w._waiting_on())

    def wait(self, timeout: float | None = None) -> bool:
        try:
            return super().wait(timeout)
        finally:
            if self.error is not None:
                for w in self.works:       # (its error is this one's: raised once)
                    w._reported = True


class CallId(NamedTuple):
    """Which collective call a work is: its n-th call (``seq``) on a group."""
    collective: str
    seq: int
    group: str
    algorithm: str

    def __str__(self) -> str:
        return f"{self.collective} #{self.seq} of group {self.group} ({self.algorithm})"


class TracedRequestWork(RequestWork):
    """A point-to-point operation while tracing is on: ends its trace record
    (:class:`ringlet.tracing.P2P`) the first time anyone sees it done - its waiter or the
    progress thread."""

    def __init__(self, engine, req, what: str, tr):
        super().__init__(engine, req, what)
        self.tr = tr

    def _done(self) -> bool:
        if not self.req.done:
            return False
        tr, self.tr = self.tr, None
        if tr is not None:
            tr.end(error=self.req.error)
        return True


class CollectiveWork(Work):
    """Runs one rank's plan of a schedule: per round, local steps, then post all receives
    and sends; the next round starts when they are all done."""

    _giving_up = False   # a blocking call's wait: a timeout ends the call (wait_or_give_up)

    @property
    def _what(self) -> CallId:
        # Made when asked (an error, a hang report, a profile): not on every call.
        return CallId(self.call.collective, self.seq, self.group.name, self.call.algorithm)

    @property
    def what(self) -> str:
        return str(self._what)

    @property
    def operation(self) -> str:
        return self.call.collective

    def __init__(self, engine, call, group, seq: int, tag: int, bufs: dict, finish=None,
                 resume=None, tr=None):
        """Call number ``seq`` on ``group`` of a prepared call (``collectives.Prepared``:
        the plan, reduction, fingerprint and scratch pool) on ``bufs``, whose "tmp" goes
        back to the pool when it succeeds. ``resume``: how far the C fast path ran the
        plan (a ``fast.FastRun``), if it began it."""
        self.engine, self.error = engine, None   # (Work.__init__, inlined)
        self.call, self.group, self.seq = call, group, seq
        plan = self.plan = call.plan
        self.bufs, self.ufunc, self.fp = bufs, call.ufunc, call.fp
        self.world_of = group.ranks       # group rank -> world rank
        self.tag = tag
        self.finish = finish
        self.i = 0
        self.reqs: list = []
        self.done = False
        self.waited = 0.0                 # seconds spent waiting on peers, and on whom last
        self.last_peer = None
        self._posted_at = 0.0
        self.handed_over = resume is not None   # the C fast path began it
        self.tr = tr
        # (a call C began may have read in place already: then it checks at its end too)
        self._reads = engine.read_in_place - (resume is not None and bool(call.fast.readers))
        engine.works.append(self)
        engine.calls.start(self)
        if self.done:
            return
        if resume is not None:
            self.i, mask = resume.rounds, resume.recv_mask
            self.waited, self._spun = resume.waited, resume.stalled
            if mask >= 0:   # its local steps and sends are done, and these receives
                self.reqs = self._post_recvs(plan[self.i], mask)
                if resume.pending:
                    self.reqs += self._adopt_sends(plan[self.i], resume.pending)
                self._posted_at = time.perf_counter()
                self.i += 1
        with np.errstate(all="ignore"):     # (why: Engine.wait)
            self.advance()

    def _done(self) -> bool:
        return self.done

    def _waiting_on(self):
        return tuple(r.peer for r in self.reqs if not r.done)

    def advance(self) -> bool:
        if self.done:
            return False
        moved = False
        while True:
            reqs = self.reqs
            for r in reqs:
                if not r.done:
                    self.last_peer = r.peer
                    return moved
            if reqs:
                self.waited += time.perf_counter() - self._posted_at
                self._posted_at = -1.0      # (counted: a failure before the next post adds none)
                if self.tr is not None:
                    self.tr.round_done(self.plan[self.i - 1].recvs, self.bufs)
                for r in reqs:
                    if r.error is not None:
                        if isinstance(r.error, PeerFailure):
                            self.engine.calls.propagate_failure(self, r.error)
                        self._end(r.error)
                        return True
            if self.i == len(self.plan):
                if self.engine.read_in_place != self._reads and self._abort_behind():
                    return True
                err = None
                if self.finish is not None:
                    try:
                        self.finish()
                    except BaseException as exc:  # surfaced at wait()
                        err = exc
                self._end(err)
                return True
            rnd = self.plan[self.i]
            if rnd.early:       # posted with the first round: its turn to be waited for
                self.reqs, self._early = self._early, None
                self._posted_at = time.perf_counter()
            else:
                self._post(rnd)
                if rnd.then >= 0 and not self.done:
                    self._post_early(self.plan[rnd.then])
            self.i += 1
            moved = True
            if self.done:   # failed while posting (a mismatch, a peer lost while it polled)
                return True

    def _abort_behind(self) -> bool:
        """Whether the call failed on an ABORT waiting behind what this rank read: a
        message read in place from a sender that gave up the call while it was read (its
        user may then write the buffer) had its ABORT sent, and its giving up said in
        shared memory (ShmPeer.gave_up), before that sender returned.
        (Asked when a call that read messages in place completes: the C path asks too,
        collectives._gave_up_meanwhile.)"""
        for r in set(self.world_of):
            peer = self.engine.peers.get(r)
            waiting = getattr(peer, "abort_waiting", None)
            if waiting is not None and waiting(self.tag):
                peer.progress()     # (the ABORT fails this call)
            # ... or it waits behind other traffic still: the sender said so in shared memory
            if not self.done and waiting is not None and peer.gave_up_on(self.tag):
                self.engine.calls.gave_up_behind(self.tag, r, self.what)
        return self.done

    def _post_early(self, rnd: PlanRound) -> None:
        """Post a later round now, right after the first (``PlanRound.then``): a rooted
        call's data moves while its agreement goes on. Both ends of every pair post in
        that order (messages of one pair and call are matched in order). Its requests
        wait for its turn; the call ends only after every round, the agreement's too."""
        first, at = self.reqs, self._posted_at
        self._post(rnd)
        self._early, self.reqs, self._posted_at = self.reqs, first, at

    def fail(self, exc) -> None:
        if not self.done:
            if self.reqs and self._posted_at >= 0:   # the round it waited in: waited too
                self.waited += time.perf_counter() - self._posted_at
            self._end(exc)

    def wait_or_give_up(self, timeout) -> None:
        """A blocking call's wait. If it times out, the call is over on this rank (its
        caller has no work to wait on again): later progress must write nothing more into
        buffers the user has back, and its members must not wait on for this rank. (An
        async call's ``wait(timeout)`` leaves the work pending instead.)"""
        self._giving_up = True     # (its hang report tells the peers: _describe_timeout)
        try:
            self.wait(timeout)
        except TimeoutError as exc:
            eng = self.engine
            eng.enter()
            try:
                if not self.done:
                    eng.calls.gave_up(self, exc)
                    eng.flush_aborts()
            finally:
                eng.leave()
            raise

    def _describe_timeout(self, limit: float) -> str:
        text = super()._describe_timeout(limit)
        report = self.engine.hang_report
        if report is not None:
            text += report(self.tag, self._what, limit, self._giving_up)
        return text

    def _end(self, error) -> None:
        if error.__class__ is PeerFailure and error.rank is not None and \
                not getattr(error, "call", None):
            # (said by the transport for every call with that peer: which one failed here)
            error = _in_call(error, f"rank {self.engine.rank}: {self.what}")
        self.error = error
        self.done = True
        self.reqs = []
        if error is None:   # a failed call's scratch may be in use
            self.call.pool.append(self.bufs["tmp"])
        eng = self.engine
        try:
            eng.works.remove(self)
        except ValueError:
            pass
        eng.calls.end(self)
        record_call(eng, self.call.collective, self.call.algorithm, self.waited, self.last_peer,
                    handed_over=self.handed_over)
        if self.tr is not None:
            self.tr.end(self.waited, self.last_peer, error)

    def _post(self, rnd: PlanRound) -> None:
        bufs = self.bufs
        sent = []
        late = rnd.sends
        reqs = None
        if rnd.local and late and (late[0].s1 - late[0].s0) * bufs[late[0].sbuf].itemsize > BIG:
            # A large send whose bytes no local step of this round writes goes first: it is
            # announced (read in place, by CMA, or streamed) while this rank copies, so the
            # peer's copy of it overlaps ours instead of following it. (cma.py shares a
            # one-way copy by the copies this rank makes meanwhile: its local ones too.)
            early, late = _independent(rnd, bufs)
            self._send(early, rnd, sent, rnd.copies_out + len(rnd.local))
            if EARLY_RECV and early and not late and _receives(rnd) and _apart(rnd, bufs):
                # An exchange: receive during the local copy, as Open MPI's sendrecv-then-
                # copy does. The peer's message is read as soon as its RTS is seen, and our
                # CTS_DONE lets it go while we still copy: the round then ends on our own
                # copy instead of on a wait (and often a sleep) for the peer's answer.
                reqs = self._post_recvs(rnd)
                self._local_polling(rnd.local, reqs)
        elif EARLY_ROOT and rnd.local and _receives_offered(rnd, bufs, self.engine.peers) \
                and _apart(rnd, bufs):
            # A root's round (a gather's): it copies its own block and receives large
            # one-way messages. Posted first, each is written into our buffer by its sender
            # (cma.py, split.py) while we copy ours, instead of waiting on our copy to start.
            early, late = _independent(rnd, bufs) if late else ((), ())
            if not late:
                self._send(early, rnd, sent, rnd.copies_out + len(rnd.local))
                reqs = self._post_recvs(rnd, ways=WRITE_WHOLE)
                self._local_polling(rnd.local, reqs)
                peers = self.engine.peers
                for r in reqs:      # (one from rl.empty announced from now on: split at once)
                    r.ways = WRITE_WHOLE_IDLE
                    peers[r.peer].join_split(r)     # (from rl.empty: what its sender left)
        if reqs is not None:
            self._posted(rnd, reqs, sent)
            return
        if rnd.local:
            self._local(rnd.local)
        # Sends before receives: a receive whose message was announced already from a
        # buffer read in place (rl.empty, CMA) is copied as it is posted, and the peer
        # waiting on our announcement meanwhile would sit idle (and sleep) through the copy.
        self._send(late, rnd, sent, rnd.copies_out)
        self._posted(rnd, self._post_recvs(rnd), sent)

    def _adopt_sends(self, rnd: PlanRound, pending) -> list:
        """The sends of ``rnd`` whose RTS the C fast path wrote (RTS_CMA: read from our
        buffer) and whose answer it did not wait for: ``pending`` (send, message id)
        pairs. Ours to wait for now, as if we had posted them (``fast.FastRun.pending``)."""
        reqs, peers = [], self.engine.peers
        for k, msgid in pending:
            t = rnd.sends[k]
            req = SendRequest(t.dst, self.tag, self.bufs[t.sbuf][t.s0:t.s1].view(np.uint8),
                              self.fp)
            req.msgid, req.cma, req.receiving = msgid, RTS_CMA, True
            peers[t.dst].awaiting_cts[msgid] = req
            reqs.append(req)
        return reqs

    def _posted(self, rnd: PlanRound, reqs: list, sent: list) -> None:
        """The round is posted: its receives and its sends not gone at once are what it
        waits on."""
        if sent:
            reqs += sent
        self.reqs = reqs
        self._posted_at = time.perf_counter()
        if self.tr is not None:
            self.tr.posted(rnd.sends, self.bufs, _receives(rnd), self.call.in_place)

    def _send(self, sends, rnd: PlanRound, sent: list, ways: int) -> None:
        """Post ``sends`` (steps of ``rnd``); the requests of those not gone at once join
        ``sent``. ``ways``: the copies this rank makes while they go (cma.py shares a
        one-way copy by it)."""
        bufs, peers, tag, fp = self.bufs, self.engine.peers, self.tag, self.fp
        in_place = self.call.in_place
        for t in sends:
            data = bufs[t.sbuf][t.s0:t.s1].view(np.uint8)
            peer = peers[t.dst]
            if not peer.send_now(tag, data, fp):   # small sends mostly go at once
                req = SendRequest(t.dst, tag, data, fp)
                req.receiving = _receives(rnd)    # this rank copies in too (cma.py)
                req.in_place = in_place
                req.ways = ways
                req.reduced = t.reduce
                sent.append(req)
                peer.post_send(req)

    def _local(self, steps) -> None:
        bufs, ufunc = self.bufs, self.ufunc
        for t in steps:
            dst = bufs[t.dbuf][t.d0:t.d1]
            if t.reduce:
                # The accumulator is usually the destination: one view for both keeps
                # NumPy off its overlap check (a third of a small call's reduce time).
                acc = dst if t.abuf is None else bufs[t.abuf][t.a0:t.a1]
                ufunc(acc, bufs[t.sbuf][t.s0:t.s1], out=dst)
            else:
                copies.assign(dst, bufs[t.sbuf][t.s0:t.s1])

    def _local_polling(self, steps, reqs: list) -> None:
        """The local steps, copies in POLL_CHUNK pieces with a look at the receives' peers
        before each while a receive is not done: a message announced meanwhile is read (or
        its DATA taken) then, not after the whole copy."""
        peers = {self.engine.peers[r.peer] for r in reqs}
        bufs = self.bufs
        for t in steps:
            if t.reduce:
                self._local((t,))
                continue
            src, dst = bufs[t.sbuf][t.s0:t.s1], bufs[t.dbuf][t.d0:t.d1]
            step = max(POLL_CHUNK // max(src.itemsize, 1), 1)
            k = 0
            while k < src.size:
                if all(r.done for r in reqs):     # nothing left to look for: the rest at once
                    copies.assign(dst[k:], src[k:])
                    break
                for peer in peers:
                    peer.progress()
                copies.assign(dst[k:k + step], src[k:k + step])
                k += step
        for peer in peers:
            peer.progress()

    def _post_recvs(self, rnd: PlanRound, skip: int = 0, ways: int | None = None) -> list:
        """Post a round's receives (but those whose bit is set in ``skip``)."""
        bufs, ufunc, peers, tag, fp = self.bufs, self.ufunc, self.engine.peers, self.tag, self.fp
        reqs = []
        # (0: this round copied locally first, and its receives take no split: cma.py)
        if ways is None:
            ways = 0 if rnd.local else rnd.copies_in
        for k, t in enumerate(rnd.recvs):
            if skip >> k & 1:
                continue
            dst = bufs[t.dbuf][t.d0:t.d1]
            if t.reduce:
                acc = None if t.abuf is None else bufs[t.abuf][t.a0:t.a1]
                req = RecvRequest(t.src, tag, dst, ufunc, acc, fp)
            else:
                req = RecvRequest(t.src, tag, dst, None, None, fp)
            req.ways = ways           # (cma.py shares a one-way copy by it)
            reqs.append(req)
            peers[t.src].post_recv(req)
        return reqs


def _receives(rnd: PlanRound) -> bool:
    """Whether this rank copies bytes in during ``rnd``: an empty receive (the signal of an
    agreement, which a "dissemination" algorithm sends beside its data) copies nothing,
    so a send beside one is one-way (split between its two ends: cma.py, split.py)."""
    return rnd.copies_in > 0


def _receives_offered(rnd: PlanRound, bufs: dict, peers: dict) -> bool:
    """Whether some receive of ``rnd`` is large enough that its sender, from a plain
    buffer, offers it by CMA (the peer's ``cma_min``; -1: never, as over TCP). Smaller ones
    stream through the ring, where posting them first gained nothing (gather p = 2 2 MiB,
    0.91-1.0x); nor is one its receive reduces (SendStep.reduce)."""
    for t in rnd.recvs:
        if t.reduce:
            continue
        least = peers[t.src].cma_min
        if 0 <= least < (t.d1 - t.d0) * bufs[t.dbuf].itemsize:
            return True
    return False


def _apart(rnd: PlanRound, bufs: dict) -> bool:
    """Whether no receive of ``rnd`` may write memory a local step of it reads or writes
    (then the receives may complete during the local steps)."""
    local = [bufs[b][x0:x1] for t in rnd.local for b, x0, x1 in
             ((t.sbuf, t.s0, t.s1), (t.dbuf, t.d0, t.d1), (t.abuf, t.a0, t.a1)) if b is not None]
    return not any(np.may_share_memory(bufs[t.dbuf][t.d0:t.d1], m)
                   for t in rnd.recvs for m in local)


def _independent(rnd: PlanRound, bufs: dict) -> tuple[tuple, tuple]:
    """(sends of ``rnd`` whose source no local step of it writes, the other sends). By
    memory, not by name: a caller's buffers may overlap (an in-place all_gather's "in" is a
    block of its "out"); a possible overlap counts as one (the send waits for the step).
    A send after a late one to the same peer is late too: one pair's messages are matched
    in order (an uneven hierarchical all_gather sends a peer a block its copy writes, then
    an empty one)."""
    dsts = [bufs[t.dbuf][t.d0:t.d1] for t in rnd.local]
    early, late, waits = [], [], set()
    for t in rnd.sends:
        src = bufs[t.sbuf][t.s0:t.s1]
        if t.dst in waits or any(np.may_share_memory(src, d) for d in dsts):
            late.append(t)
            waits.add(t.dst)
        else:
            early.append(t)
    return tuple(early), tuple(late)


def _in_call(exc: PeerFailure, call: str) -> PeerFailure:
    """A peer's failure as the error of ``call``, which it failed."""
    out = PeerFailure(f"{call}: {exc}", rank=exc.rank, left=exc.left)
    out.call = call
    return out


def record_call(engine, collective: str, algorithm: str, waited: float, last_peer,
                fast: bool = False, handed_over: bool = False) -> None:
    """Count one finished call (``fast``: run wholly by the C fast path; ``handed_over``:
    begun in C, finished in Python)."""
    if collective in engine.lanes and _fastpath.unfolded():   # (what they ran came first)
        fold_lanes(engine, collective)
    st = engine.coll_stats.get(collective)
    if st is None:
        st = engine.coll_stats[collective] = CallStats()
    # (here, not in a method of CallStats: a Python call more is 1% of an 8 B call)
    st.algorithm = algorithm
    st.calls += 1
    st.wait_s += waited
    if waited >= st.max_wait_s:
        st.max_wait_s = waited
    if last_peer is not None:
        st.last_arrival = last_peer
    if fast:
        st.fast_calls += 1
    elif handed_over:
        st.handovers += 1


def fold_lanes(engine, collective: str | None = None) -> None:
    """Count in ``engine.coll_stats`` the calls the lanes of ``collective`` (None: of every
    collective) ran since last folded - C counts them in the lane, not here - in the order
    they ran (the last one's algorithm and last arrival stand)."""
    for name in (engine.lanes if collective is None else (collective,)):
        taken = [(*lane.take(), lane.algorithm) for lane in engine.lanes[name] if lane.calls]
        taken.sort(key=lambda t: t[4])      # (in the order their last calls ran)
        for calls, waited, longest, last_peer, _seq, algorithm in taken:
            st = engine.coll_stats.get(name)
            if st is None:
                st = engine.coll_stats[name] = CallStats()
            st.algorithm = algorithm
            st.calls += calls
            st.fast_calls += calls
            st.wait_s += waited
            if longest >= st.max_wait_s:
                st.max_wait_s = longest
            if last_peer is not None:
                st.last_arrival = last_peer


class CallStats:
    """Counters of one collective on this rank, for ``rl.stats()``."""
    __slots__ = ("calls", "fast_calls", "handovers", "wait_s", "max_wait_s", "last_arrival",
                 "algorithm")

    def __init__(self):
        self.calls, self.fast_calls, self.handovers, self.wait_s, self.max_wait_s = 0, 0, 0, 0.0, 0.0
        self.last_arrival = self.algorithm = None

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def compile_plan(plan, world_of, pieces_of=None) -> tuple[PlanRound, ...]:
    """A rank's plan (``Schedule.rank_plan``) in the executor's form (``PlanRound``) — the
    same transfers, with group ranks turned into world ranks and offsets into slice
    bounds, so a small call spends no time on arithmetic. An accumulator equal to the
    destination is None. A message for which ``pieces_of(transfer)`` gives k > 0 goes as
    packets of k elements (its peer's plan splits it alike: collectives._pieces_of)."""
    def acc(t):
        ab, ao = t.acc
        return (None, 0, 0) if (ab, ao) == (t.dbuf, t.doff) else (ab, ao, ao + t.n)

    def spans(t):       # (offset into the message, elements) of each packet
        k = pieces_of(t) if pieces_of is not None else 0
        return ((0, t.n),) if not k else tuple((i, min(k, t.n - i)) for i in range(0, t.n, k))

    def recvs(t):
        src, (ab, a0, _) = world_of[t.src], acc(t)
        return (RecvStep(src, t.op == REDUCE, t.dbuf, t.doff + i, t.doff + i + n, ab,
                         a0 + i if ab is not None else 0, a0 + i + n if ab is not None else 0)
                for i, n in spans(t))

    # a round posted early goes right after the rank's first (Schedule.early)
    early = next((i for i, rnd in enumerate(plan) if rnd.early and i > 0), -1)
    return tuple(PlanRound(
        tuple(LocalStep(t.op == REDUCE, t.sbuf, t.soff, t.soff + t.n, t.dbuf, t.doff,
                        t.doff + t.n, *acc(t)) for t in rnd.local),
        tuple(SendStep(world_of[t.dst], t.sbuf, t.soff + i, t.soff + i + n, t.op == REDUCE)
              for t in rnd.sends for i, n in spans(t)),
        tuple(r for t in rnd.recvs for r in recvs(t)),
        early if k == 0 else -1, k == early)
        for k, rnd in enumerate(plan))
