"""Background progress: one thread per rank that moves the bytes of asynchronous work
(collectives with ``async_op=True``, ``isend``, ``irecv``) while the caller computes.

The engine's state belongs to whoever holds ``engine.lock``: the caller while inside a
ringlet call, this thread between calls. The thread starts with the first asynchronous
work and runs only while some is unfinished; otherwise it is parked on a condition
(``idle``), from which only a caller posting asynchronous work wakes it - so a job of
blocking calls pays nothing for it but the lock each call takes. A turn takes the lock,
drives every peer and work once (``Engine.tick``) and lets it go; a turn that moves nothing
sleeps in ``select`` on the thread's own epoll - the doorbell local senders ring, the TCP
sockets, and an eventfd the caller pokes when it leaves a call - outside the lock. Futures
are resolved, and their callbacks run, outside the lock (a callback may call ringlet).

``RINGLET_PROGRESS=0`` turns it off: then, as before, whoever waits turns the crank.
"""
from __future__ import annotations

import logging
import os
import selectors
import threading
import time

import numpy as np

from ..errors import RingletError

log = logging.getLogger("ringlet")

NAP = 0.2            # longest sleep: local peers' liveness is checked at least this often
HANDOFF = 0.05       # how long the thread stands aside for a caller that wants the lock


def enabled() -> bool:
    """Read at engine start, so forked ranks see their own environment."""
    return os.environ.get("RINGLET_PROGRESS", "1") != "0"


class Progress:
    def __init__(self, engine):
        self.engine = engine
        self.on = enabled()
        self.watched: list = []     # asynchronous works not yet seen finished
        self.cv = threading.Condition(threading.Lock())   # guards watched, thread, stopping
        self.thread: threading.Thread | None = None
        # No thread, or it is parked: only callers drive the engine (each under its lock;
        # the C lanes run only then). Set by the thread as it parks, cleared by the caller
        # as it wakes it (watch).
        self.idle = True
        self.stopping = False
        self.wakefd = -1
        self.sel = None
        self.turns = self.naps = 0   # (counted for bench/overlap.py: what a step costs it)

    # -- the caller's side -----------------------------------------------------------------
    def watch(self, work) -> None:
        """Drive ``work`` (just posted, and handed to the user) until it finishes."""
        if not self.on:      # no thread: only listed, for waiters to run its callbacks (due)
            with self.cv:    # (and, with no thread to prune it, what is settled leaves here)
                self.watched = [w for w in self.watched if not w._done() or (
                    w._future is not None and not w._future.done())] + [work]
            return
        with self.cv:
            if self.stopping:
                return
            self.watched.append(work)
            self.idle = False
            if self.thread is None:
                self._start()
            self.cv.notify()
        self.poke()

    def poke(self) -> None:
        """Wake the thread from its sleep: the caller changed what it should watch."""
        if self.wakefd < 0:   # (no thread)
            return
        try:
            os.eventfd_write(self.wakefd, 1)
        except (OSError, ValueError):
            pass

    def stop(self) -> None:
        """End the thread (at destroy); what it watched is the caller's again."""
        with self.cv:
            self.stopping = True
            self.cv.notify()
            thread = self.thread
        if thread is not None:
            self.poke()
            if thread is not threading.current_thread():
                thread.join(5.0)
        if self.sel is not None:
            self.sel.close()
            os.close(self.wakefd)
            self.sel, self.wakefd = None, -1

    # -- the thread ------------------------------------------------------------------------
    def _start(self) -> None:
        eng = self.engine
        self.wakefd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.wakefd, selectors.EVENT_READ)
        if eng.doorbell is not None:
            self.sel.register(eng.doorbell, selectors.EVENT_READ)
        self.events: dict = {}      # tcp.Lane -> events registered here (0: not registered)
        self.thread = threading.Thread(target=self._main, daemon=True,
                                       name=f"ringlet-progress-{eng.rank}")
        self.thread.start()

    def _main(self) -> None:
        np.seterr(all="ignore")     # this thread's reductions (why: Engine.wait)
        try:
            self._loop()
        except BaseException as exc:   # a bug: hand the works back to their waiters
            log.exception("ringlet rank %d: background progress stopped", self.engine.rank)
            err = RingletError(f"rank {self.engine.rank}: background progress failed: {exc!r}")
            with self.cv:
                self.on = False
                works, self.watched = self.watched, []
            with self.engine.lock:
                for w in works:
                    if hasattr(w, "fail"):
                        w.fail(err)
            for w in works:
                w._settle()

    def _loop(self) -> None:
        eng = self.engine
        while True:
            with self.cv:
                while not self.watched and not self.stopping:
                    self.idle = True
                    self.cv.wait()
                if self.stopping:
                    return
            self._take()
            try:
                if eng.closed:
                    return
                self.turns += 1
                moved = eng.tick()
                finished = self._finished()
                nap = not moved and not finished and eng.nap_begin()
            finally:
                eng.lock.release()
            for w in finished:
                w._settle()
            if nap:
                self.naps += 1
                self._sleep()
                with eng.lock:
                    eng.nap_end()

    def _take(self) -> None:
        """Take the lock, but not from a caller who asked for it first: Python's lock is
        not fair, and a thread that keeps moving bytes would take it back before the
        caller it woke gets to run."""
        eng = self.engine
        deadline = None
        while eng.wanted and not eng.lock.locked():
            deadline = deadline or time.monotonic() + HANDOFF
            if time.monotonic() > deadline:
                break
            os.sched_yield()
        eng.lock.acquire()

    def due(self, waited) -> list:
        """Watched works other than ``waited`` that have finished and whose futures still
        have callbacks to run (a chained call's next step, work.Chained): a caller that
        waits on ``waited`` holds the engine, so this thread cannot run them; the caller
        must, or a next step its peers wait for never starts."""
        return [w for w in self.watched if w is not waited and w._future is not None
                and not w._future.done() and w._done()]

    def _finished(self) -> list:
        with self.cv:
            finished = [w for w in self.watched if w._done()]
            if finished:
                self.watched = [w for w in self.watched if not w._done()]
        return finished

    def _sleep(self) -> None:
        """Until a packet, room in a socket, a poke or the liveness check is due."""
        for key, _ in self.sel.select(NAP):
            if key.fileobj == self.wakefd:
                try:
                    os.eventfd_read(self.wakefd)
                except BlockingIOError:
                    pass
            elif key.fileobj is self.engine.doorbell:
                self.engine.drain_doorbell()

    def interest(self) -> None:
        """Watch each live TCP peer for input, and for room when it has bytes queued
        (called under the lock, before sleeping)."""
        for peer in self.engine.tcp_peers:
            for lane in peer.lanes:
                want = 0 if peer.dead else selectors.EVENT_READ | (
                    selectors.EVENT_WRITE if lane.wpending else 0)
                have = self.events.get(lane, 0)
                if want == have:
                    continue
                if not have:
                    self.sel.register(lane.sock, want)
                elif not want:
                    self.sel.unregister(lane.sock)
                else:
                    self.sel.modify(lane.sock, want)
                self.events[lane] = want
