"""The progress engine: owns this rank's connections to every peer and drives them.

What runs where. The caller's thread runs every ringlet call: it posts the work and, in a
blocking call or ``Work.wait``, turns the crank itself - every peer's packets move and
every in-flight collective advances, so any mix of isend/irecv and async collectives makes
progress together. A waiter spins briefly (just yielding the core when ranks outnumber
cores), then sleeps in ``select`` on its TCP sockets and its doorbell, which local senders
poke when they see it asleep. A small blocking call of local EAGER messages runs in C
(``fast.py``) on the caller's thread too.

Asynchronous work (``async_op=True``, isend, irecv) is also driven between calls, while
the caller computes, by one background thread (``progress.py``) that exists only once such
work was posted and works only while some is unfinished. ``self.lock`` says who drives:
a caller holds it to post its call and while it waits (handing it over between turns to
another thread that wants it: the progress thread, a callback, a second thread of the
user's making calls on groups of its own), the thread for one turn at a time.
``RINGLET_PROGRESS=0``: no thread, the old model.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import queue
import selectors
import socket
import threading
import time
from typing import Protocol

import numpy as np

from ..buffers import RemoteMaps
from ..errors import AuthenticationError, RingletError, TimeoutError
from ..rendezvous import handshake_client, handshake_server, local_address_towards, wait_for_ranks
from . import fast, protocol
from .limits import affinity, cpu_ranges, cpu_set
from .progress import Progress
from .protocol import RecvRequest, SendRequest, peer_failure
from .shm import (RING_BYTES, Bell, Doorbell, Ring, ShmPeer, create_segment, open_segment,
                  segment_size)
from .tcp import TcpPeer, tcp_buffers, tcp_lanes, tcp_thread_min

log = logging.getLogger("ringlet")

REPORT_AFTER = 1.0       # a wait this long publishes this rank's state for hang reports
LIVENESS_EVERY = 0.2     # seconds between checks that local peers' processes still live
SPIN_FREE = 100e-6       # spin this long before sleeping when every rank has a core
SPIN_CROWDED = 0.0       # when ranks outnumber cores, yield at once
# Then yield this long before sleeping. Waking a sleeper (doorbell, select, scheduler) costs
# tens of microseconds, paid on every hop of a chain (naive ring, tree) whose ranks wait
# their turn: a rank that yields instead is ready when its turn comes.
YIELD_CROWDED = float(os.environ.get("RINGLET_YIELD_US", 1000)) * 1e-6
# Past SPIN_FREE, a rank with a core of its own that waits on a large message in flight
# (one announced and not yet answered, or coming in) goes on spinning up to this long
# while no process waits for a core (the host's runnable count, /proc/loadavg, is at most
# its cores): the peer is copying, the spin takes nobody's time, and a sleeper's wake-up
# costs 50-600 us (issue 27: a large exchange's ranks wait 100-300 us on each other's
# copies). On a busy host it sleeps after SPIN_FREE as before: spinning 400 us at load 9
# made an 8 MiB broadcast 2-4x slower. RINGLET_IDLE_SPIN_US=0 turns it off.
IDLE_SPIN = float(os.environ.get("RINGLET_IDLE_SPIN_US", 1000)) * 1e-6
IDLE_CHECK = 20e-6       # ... looking at the runnable count this often
# On a busy host (more runnable processes than cores) such a rank yields instead, up to
# IDLE_SPIN, before it sleeps: a yield hands the core to whoever wants it, as a sleep does,
# but the rank needs no wake-up when the peer's answer comes (issue 27: at load 3-4 a
# p = 2 8 MiB all_to_all from rl.empty buffers slept in 0.44 of its calls, Open MPI,
# which polls, in none; bench/exchange_counts.py). Off (RINGLET_IDLE_YIELD=1 turns it on):
# it took the sleeps out of the calls (0.42-0.60 -> 0.00-0.03 per call and rank, load 3)
# only while the peer answered within IDLE_SPIN, and the time not at all: in-job A/B,
# bench/idle_yield.py, 8 MiB p = 2, 10 alternating blocks, load 3.1-3.3, sleep / yield on
# the median block: all_gather 0.99 plain, 0.96 rl.empty; all_to_all 1.02, 0.92.
IDLE_YIELD = os.environ.get("RINGLET_IDLE_YIELD", "0") == "1"


def _runnable(fd: int) -> int:
    """Processes running or waiting for a core on this host now (/proc/loadavg's 4th
    field, before the slash); a large number when it cannot be read."""
    try:
        return int(os.pread(fd, 64, 0).split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return 1 << 30


def _read_check_switch() -> None:
    """RINGLET_UNSAFE_NO_MISMATCH_CHECK=1 turns the mismatch check off. It exists only so
    bench/mismatch_overhead.py can measure what the check costs; read at init (not import)
    so forked ranks see their own environment."""
    protocol.CHECK_FINGERPRINTS = os.environ.get("RINGLET_UNSAFE_NO_MISMATCH_CHECK") != "1"


def host_labels(keys: list, shared: set) -> tuple:
    """Each rank's host: its detected (or declared) host key, split where ranks with one
    key could not share memory (the pairs not in ``shared``): then each set of ranks
    joined by shared memory is a host of its own."""
    parent = list(range(len(keys)))

    def root(r):
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r
    for r, q in shared:
        parent[root(q)] = root(r)
    labels = []
    for r, key in enumerate(keys):
        same_key = [q for q in range(len(keys)) if keys[q] == key]
        whole = all(root(q) == root(r) for q in same_key)
        labels.append(key if whole else f"{key}#{min(q for q in same_key if root(q) == root(r))}")
    return tuple(labels)


class CallEvents(Protocol):
    """What the engine reports about collective calls to the layer that runs them
    (``ringlet.agreement.Agreement``), which decides what fails and with which error:
    the transport only detects. ``tag`` is a call's wire tag, ``fp`` a fingerprint, and
    ranks are world ranks. The policy acts through the engine's ``send_aborts``,
    ``fail_tag``, ``fail_receives``, ``fail_peer``, ``failure_of`` and ``unasked_unlike``."""

    def attach(self, engine: "Engine") -> None:
        """The engine it acts through (given once, as the engine starts)."""

    def mismatch(self, tag: int, mine: tuple, theirs: tuple, culprit: int) -> None:
        """A message and a receive of call ``tag`` met with other fingerprints: this
        rank's ``mine``, rank ``culprit``'s ``theirs``."""

    def unasked(self, tag: int, fp: tuple, sender: int) -> None:
        """A message of call ``tag`` arrived before its receive was posted."""

    def abort_received(self, tag: int, sender_fp: tuple, culprit_fp: tuple, culprit: int,
                       sender: int) -> None:
        """Rank ``sender`` gave up on call ``tag``: ``culprit`` is the rank whose message
        (``culprit_fp``) disagreed with it, or protocol.DEAD (a member died:
        ``culprit_fp[0]``), protocol.STALE (an earlier call, ``culprit_fp[0]``, failed) or
        protocol.GAVE_UP (its timeout ran out)."""

    def peer_failed(self, rank: int, exc: BaseException) -> None:
        """Peer ``rank`` is gone: its process exited, its link broke or it broke the
        protocol (``exc`` says which)."""

    def check_members(self) -> None:
        """The engine just checked that local peers live (a waiter does every
        LIVENESS_EVERY seconds): a call with a dead member cannot complete."""



def _boot_of(host_id: str):
    """The kernel boot a detected host id names (shm.detect_host_id), or None for a
    declared one (RINGLET_HOST_ID)."""
    parts = host_id.split("/")
    return parts[1] if len(parts) == 4 and parts[2].startswith("net") else None

class Engine:
    _loadavg = -1    # /proc/loadavg, open (see IDLE_SPIN)

    def __init__(self, rank: int, world_size: int, store, token: str, job: str, *,
                 host_id: str, backend: str, master_addr: str, master_port: int,
                 timeout: float, calls: CallEvents, generation: int = 0):
        self.rank, self.world_size, self.store = rank, world_size, store
        self.calls = calls          # what becomes of a call that cannot complete
        calls.attach(self)
        self.job, self.token = job, token.encode()
        self.host_id, self.backend = host_id, backend
        self.timeout = timeout
        self.peers: dict[int, object] = {}
        self.tcp_peers: list = []
        self.remote_maps = RemoteMaps()
        self.works: list = []
        self.read_in_place = 0     # messages read from a sender's buffer (a call checks: work.py)
        # the groups of a world that shrank away: counted ids below this, and keyed ones
        self.retired_below, self.retired_keyed = 0, frozenset()
        # What the runtime adds, for the collectives it runs on this engine:
        self.on_long_wait = None    # () -> None: publish this rank's state for hang reports
        self.departed = None        # (ranks) -> those of them that left the job (destroy)
        self.hang_report = None     # (tag, work.CallId, limit, giving up) -> why that call
        #                             hangs, from its peers
        self.coll_stats: dict = {}  # collective -> work.CallStats, for rl.stats()
        self.lanes: dict = {}       # collective -> its lanes (C counts their calls: fold_lanes)
        self.sel = selectors.DefaultSelector()
        self.capacity = int(os.environ.get("RINGLET_SHM_RING", RING_BYTES)) & ~63
        self.seg = None
        self.seg_fd = None          # the rings' memfd, open until every local peer mapped it
        self.doorbell = None
        self.closed = False
        self._last_liveness = 0.0
        _read_check_switch()
        self.lock = threading.Lock()   # held by whoever drives: a call, or the thread below
        self.wanted = 0                # callers waiting for the lock
        self.background = Progress(self)   # (no thread until async work is watched)
        try:
            self._connect(master_addr, master_port, generation)
        except BaseException:
            self.close(0)
            raise
        # The cores of this machine that the job's ranks here may use, together: mpirun
        # binds each of a few ranks to a core of its own, which is not one core for all.
        ncpu = len(self.cpus)
        local = 1 + sum(isinstance(p, ShmPeer) for p in self.peers.values())
        # Crowded when more ranks than cores share this machine: the ranks of this host,
        # or more when other "hosts" are containers on the same kernel (same boot id).
        self.crowded = max(local, self.same_machine) > (ncpu or 1)
        self.spin = SPIN_CROWDED if self.crowded else SPIN_FREE
        # Small all-local calls run in C (transport/fast.py) for as long as a waiter would
        # spin or yield before sleeping; the sleep, and anything unusual, is this engine's.
        # Only in one-host jobs: there, no TCP link waits for the progress a call makes.
        self.fast = fast.enabled() and not self.tcp_peers
        self.fast_budget = YIELD_CROWDED if self.crowded else self.spin
        self.ncpu = ncpu or 1
        try:
            self._loadavg = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._loadavg = -1
        self.fast_p2p: dict = {}    # (send or recv, peer, bytes) -> its FastCall, or None

    # -- setup ---------------------------------------------------------------------------
    def _connect(self, master_addr: str, master_port: int, gen: int) -> None:
        prefix = f"g{gen}/"
        use_shm = self.backend in ("auto", "shm")
        self.hosts = (self.host_id,)
        self.same_machine = 1
        self.cpus = affinity()
        me = {"rank": self.rank, "host": self.host_id, "pid": os.getpid(),
              "cpus": cpu_ranges(self.cpus), "world": self.world_size}
        # two processes given one rank (nodes launched with different -n): the second says
        # so (counted per job token: a torchrun restart's attempt has a token of its own)
        if self.world_size > 1 and \
                self.store.add(f"{prefix}joined/{self.job}/{self.rank}", 1) > 1:
            raise RingletError(f"rank {self.rank}: init: another process has joined as rank "
                               f"{self.rank} already: two were given one RANK (were the nodes "
                               f"launched with different -n / --nproc-per-node?), or the "
                               f"store is an earlier job's (a file:// directory used again)")
        if use_shm and self.world_size > 1:
            self.seg, self.seg_fd = create_segment(segment_size(self.world_size, self.capacity))
            self.doorbell = Doorbell()
            self.sel.register(self.doorbell, selectors.EVENT_READ, None)
            me.update(seg=self.seg_fd, doorbell=self.doorbell.fileno())
        listener = None
        if self.world_size > 1:
            bind = local_address_towards(master_addr, master_port)
            listener = socket.create_server((bind, 0), backlog=self.world_size)
            listener.settimeout(1.0)
            tcp_buffers()     # (a bad RINGLET_TCP_* fails here, before any connection)
            me.update(addr=bind, port=listener.getsockname()[1], lanes=tcp_lanes(),
                      threads=tcp_thread_min() > 0)
        self.store.set(f"{prefix}addr/{self.rank}", json.dumps(me).encode())

        def same_world(r, raw):
            theirs = json.loads(raw).get("world", self.world_size)
            if theirs != self.world_size:
                raise RingletError(f"rank {self.rank}: init: rank {r} was started for a world of "
                                   f"{theirs} ranks, this rank for {self.world_size}: launch every "
                                   f"node with the same -n / --nproc-per-node and --nnodes "
                                   f"(WORLD_SIZE)")
        infos = [json.loads(v) for v in
                 wait_for_ranks(self.store, f"{prefix}addr/", self.world_size, self.timeout,
                                self.rank, same_world)]
        local = use_shm and self.world_size > 1
        opened = self._open_local(infos) if local else {}
        same = {i["rank"] for i in infos if local and i["host"] == self.host_id} - {self.rank}
        shared: set = set()
        try:
            self._connect_tcp([i for i in infos if i["rank"] not in same | {self.rank}], listener)
            if local:
                # Touch both rings of every local pair now, before any traffic can flow
                # (after the agreement below it may): their first lap would otherwise pay a
                # page fault every 4 KiB inside the first collectives.
                for r, (theirs, _) in opened.items():
                    Ring(self.seg, r, self.capacity).data[:] = 0
                    Ring(theirs, self.rank, self.capacity).data[:] = 0
                # Every rank has opened what it could (so the fd is no longer needed): agree
                # on the pairs that share memory; the rest of this host's ranks use TCP.
                shared = self._agree_on_shm(prefix, opened)
                fallback = []
                for info in infos:
                    r = info["rank"]
                    if r not in same:
                        continue
                    if (min(r, self.rank), max(r, self.rank)) in shared:
                        theirs, bell = opened.pop(r)
                        self.peers[r] = ShmPeer(self, r, Ring(self.seg, r, self.capacity),
                                                Ring(theirs, self.rank, self.capacity), bell,
                                                info["pid"])
                    else:
                        fallback.append(info)
                for theirs, bell in opened.values():   # they could not open ours
                    theirs.close()
                    bell.close()
                self._connect_tcp(fallback, listener)
            else:
                self.store.add(f"{prefix}mapped", 1)
                self.store.wait_count(f"{prefix}mapped", self.world_size, timeout=self.timeout)
        finally:
            if listener is not None:
                listener.close()
        self._close_seg_fd()
        self.hosts = host_labels([info["host"] for info in infos], shared)
        boot = _boot_of(self.host_id)
        here = [i for i in infos if (boot is not None and _boot_of(i["host"]) == boot)
                or i["host"] == self.host_id]
        self.same_machine = sum(boot is not None and _boot_of(i["host"]) == boot for i in infos)
        self.cpus = sorted(set(self.cpus).union(*(cpu_set(i.get("cpus", ())) for i in here)))

    def _open_local(self, infos: list) -> dict:
        """Rings and doorbells of the ranks that look like this host: {rank: (segment,
        bell)} for those that opened (whether they opened ours, the agreement tells)."""
        opened = {}
        for info in infos:
            r = info["rank"]
            if r == self.rank or info["host"] != self.host_id:
                continue
            theirs = None
            try:
                theirs = open_segment(info["pid"], info["seg"],
                                      segment_size(self.world_size, self.capacity))
                opened[r] = (theirs, Bell(info["pid"], info["doorbell"]))
            except OSError as exc:
                if theirs is not None:
                    theirs.close()
                log.warning("ringlet rank %d: rank %d looks local (host %s) but its shared "
                            "memory does not open here, so TCP carries that pair: %s",
                            self.rank, r, self.host_id, exc)
        return opened

    def _agree_on_shm(self, prefix: str, opened: dict) -> set:
        """The pairs (low rank, high rank) where each opened the other's shared memory:
        every rank learns every rank's result, so all agree on which pairs use it."""
        self.store.set(f"{prefix}shm/{self.rank}", json.dumps(sorted(opened)).encode())
        lists = wait_for_ranks(self.store, f"{prefix}shm/", self.world_size, self.timeout, self.rank)
        could = {(r, q) for r, v in enumerate(lists) for q in json.loads(v)}
        return {(r, q) for r, q in could if r < q and (q, r) in could}

    def _close_seg_fd(self) -> None:
        if self.seg_fd is not None:
            os.close(self.seg_fd)
            self.seg_fd = None

    def _connect_tcp(self, remote: list, listener) -> None:
        """Higher ranks dial lower ones, as many connections as both sides' lane counts
        allow (the fewer: limits.TCP_LANES); every connection proves the token both ways
        and names its dialer's rank and its lane ("5", then "5/1", "5/2", ...)."""
        me = str(self.rank).encode()
        mine, threads = tcp_lanes(), tcp_thread_min() > 0

        def conns(info):    # connections of the pair: its lanes, and one for threaded DATA
            data = threads and info.get("threads", False)
            return min(mine, info.get("lanes", 1)) + data, data
        for info in remote:
            if info["rank"] < self.rank:
                socks = []
                try:
                    for lane in range(conns(info)[0]):
                        sock = socket.create_connection((info["addr"], info["port"]),
                                                        timeout=self.timeout)
                        socks.append(sock)
                        sock.settimeout(self.timeout)
                        their = handshake_client(sock, self.token,
                                                 me + (b"/%d" % lane if lane else b""))
                        if their != str(info["rank"]).encode():
                            raise RingletError(
                                f"rank {self.rank}: connected to {info['addr']}:{info['port']} "
                                f"expecting rank {info['rank']} but it says {their!r}")
                except BaseException:
                    for sock in socks:
                        sock.close()
                    raise
                self._add_tcp(info["rank"], socks, conns(info)[1])
        expect = {(info["rank"], lane) for info in remote if info["rank"] > self.rank
                  for lane in range(conns(info)[0])}
        data = {info["rank"]: conns(info)[1] for info in remote}
        got: dict = {}
        if not expect:
            return
        # Each accepted connection proves itself in its own thread, so a silent or slow
        # stranger at the port cannot hold up the ranks that are really coming.
        proven: queue.Queue = queue.Queue()
        refused = itertools.count(1)

        def prove(sock, addr):
            sock.settimeout(10.0)
            try:
                their = handshake_server(sock, self.token, me)
                r, _, lane = their.partition(b"/")
                r, lane = int(r), int(lane or 0)
            except (AuthenticationError, OSError, ValueError, ConnectionError) as exc:
                n = next(refused)
                # (a few, then one line in a hundred, as the store: 200 silent strangers had
                # written 200 lines)
                if n <= 3 or n % 100 == 0:
                    log.warning("ringlet rank %d: refused connection from %s: %s%s", self.rank,
                                addr, exc, f" ({n} refused so far; one in 100 is logged)"
                                if n > 3 else "")
                sock.close()
                return
            proven.put((r, lane, sock, addr))

        deadline = time.monotonic() + self.timeout
        listener.settimeout(0.05)
        while expect:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: ranks {sorted({r for r, _ in expect})} "
                                   f"never connected within {self.timeout:.0f} s")
            try:
                sock, addr = listener.accept()
                threading.Thread(target=prove, args=(sock, addr), daemon=True).start()
            except socket.timeout:
                pass
            while not proven.empty():
                r, lane, sock, addr = proven.get()
                if (r, lane) not in expect:
                    log.warning("ringlet rank %d: refused connection from %s: unexpected rank %d "
                                "(connection %d)", self.rank, addr, r, lane)
                    sock.close()
                    continue
                expect.discard((r, lane))
                got.setdefault(r, {})[lane] = sock
                if not any(q == r for q, _ in expect):     # all of its lanes are in
                    lanes = got.pop(r)
                    self._add_tcp(r, [lanes[i] for i in sorted(lanes)], data[r])

    def _add_tcp(self, rank: int, socks: list, data: bool = False) -> None:
        peer = TcpPeer(self, rank, socks, data=data)   # (data: the last is the DATA threads')
        self.peers[rank] = peer
        self.tcp_peers.append(peer)
        for lane in peer.lanes:
            lane.events = selectors.EVENT_READ
            self.sel.register(lane.sock, selectors.EVENT_READ, peer)
        if peer.wake is not None:    # the DATA threads' word that a message is done
            self.sel.register(peer.wake, selectors.EVENT_READ, peer)

    # -- moving bytes --------------------------------------------------------------------
    def isend(self, peer: int, tag: int, data, fp=(0, 0)) -> SendRequest:
        """Post a send of ``data`` (a flat uint8 array viewing the caller's buffer)."""
        req = SendRequest(peer, tag, data, fp)
        req.p2p = True
        self.peers[peer].post_send(req)
        return req

    def irecv(self, peer: int, tag: int, dst, ufunc=None, acc=None, fp=(0, 0)) -> RecvRequest:
        req = RecvRequest(peer, tag, dst, ufunc, acc, fp)
        self.peers[peer].post_recv(req)
        return req

    # -- what the calls' policy acts through (``calls``, see CallEvents) -----------------
    def send_aborts(self, tag: int, ranks, mine, theirs, culprit: int) -> None:
        """An ABORT of call ``tag`` to each of ``ranks`` still alive (but this rank)."""
        for r in ranks:
            peer = self.peers.get(r)
            if r != self.rank and peer is not None and not peer.dead:
                peer.send_abort(tag, mine, theirs, culprit)

    def say_gave_up(self, tag: int, ranks) -> None:
        """Tell each of ``ranks`` on this host, in shared memory, that this rank gave up
        call ``tag`` (ShmPeer.gave_up): one reading a message of it in place fails even
        while the ABORT waits behind other traffic."""
        for r in ranks:
            peer = self.peers.get(r)
            if isinstance(peer, ShmPeer) and not peer.dead:
                peer.gave_up(tag)

    def fail_tag(self, tag: int, exc) -> None:
        """Every peer's receives of call ``tag`` fail; its unasked messages are dropped."""
        for peer in self.peers.values():
            peer.fail_tag(tag, exc)

    def fail_receives(self, rank: int, which, exc) -> None:
        """Fail the receives posted for peer ``rank`` whose tag ``which(tag)`` picks."""
        peer = self.peers.get(rank)
        if peer is not None:
            for t in [t for t in peer.posted if which(t)]:
                peer.fail_tag(t, exc)

    def fail_peer(self, rank: int, exc) -> None:
        """Treat peer ``rank`` as gone (another member saw it die)."""
        peer = self.peers.get(rank)
        if peer is not None:
            peer.fail(exc)

    def failure_of(self, rank: int):
        """Why peer ``rank`` is gone, or None while it lives."""
        return self.peers[rank].dead

    def unasked_unlike(self, tag: int, fp) -> tuple | None:
        """(rank, fingerprint) of a message waiting for call ``tag`` with a fingerprint
        other than ``fp`` (the oldest from the first such peer), or None."""
        for peer in self.peers.values():
            q = peer.unexpected.get(tag) if peer.unexpected else None
            if q and q[0].fp != fp:
                return peer.rank, q[0].fp
        return None

    def retire(self, below: int, keyed, exc) -> None:
        """Forget all traffic of the groups whose id is below ``below`` or in ``keyed``
        (a world that shrank away): later messages of theirs are dropped."""
        self.retired_below, self.retired_keyed = below, self.retired_keyed | frozenset(keyed)
        for peer in self.peers.values():
            if not peer.dead:
                peer.retire(exc)

    def retired(self, gid: int) -> bool:
        """Whether group ``gid`` belonged to a world that shrank away."""
        return gid < self.retired_below or gid in self.retired_keyed

    def progress(self) -> bool:
        moved = False
        for peer in self.peers.values():
            if peer.progress():
                moved = True
        if self.works:
            for work in self.works[:]:  # advancing may finish (remove) a work
                if work.advance():
                    moved = True
        return moved

    def enter(self) -> None:
        """Take the engine for a call (from the background thread, if it has it now)."""
        if not self.lock.acquire(False):
            self.wanted += 1
            try:
                if self.doorbell is not None:   # a holder asleep in its wait hands over now
                    self.doorbell.ring()
                self.lock.acquire()
            finally:
                self.wanted -= 1

    def leave(self) -> None:
        self.lock.release()
        if self.background.watched:   # what it sleeps on may have changed
            self.background.poke()

    @contextlib.contextmanager
    def held(self):
        """``with engine.held():`` enter() ... leave(), for code outside the hot path."""
        self.enter()
        try:
            yield self
        finally:
            self.leave()

    def tick(self) -> bool:
        """One turn for a driver not waiting on anything in particular (the background
        thread): move what can move, and now and then check that local peers live."""
        moved = self.progress()
        now = time.monotonic()
        if now - self._last_liveness > LIVENESS_EVERY:
            self._last_liveness = now
            self.check_liveness()
        return moved

    def nap_begin(self) -> bool:
        """Announce the background thread's sleep to local senders; False (and no sleep)
        if something arrived meanwhile."""
        self._nap(1)
        if self.progress():
            self._nap(-1)
            return False
        self.background.interest()
        return True

    def nap_end(self) -> None:
        self._nap(-1)

    def _nap(self, delta: int) -> None:
        """Count a sleeper in word 0 of this rank's segment (under the lock): senders that
        see it non-zero ring the doorbell."""
        if self.seg is not None:
            memoryview(self.seg)[0:8].cast("Q")[0] += delta

    def wait(self, done, timeout: float | None, describe, peers=tuple, spun: float = 0.0) -> None:
        """Drive progress until ``done()``; on expiry raise TimeoutError(describe()).
        ``spun``: seconds already spent spinning and yielding for it (by the C fast path),
        taken off this wait's own spin and yield before it sleeps (under load, yielding
        twice as long lost to other processes)."""
        if done():
            return
        # Reductions of inf and NaN give what the user asked for: no floating-point warning
        # (one made an error, as `-W error` does, killed a rank mid-call). Every driver of
        # reductions ignores them: here, a call's posting and the transport's threads.
        with np.errstate(all="ignore"):
            self._wait(done, timeout, describe, peers, spun)

    def _wait(self, done, timeout, describe, peers, spun) -> None:
        limit = self.timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + limit
        idle_since = None
        idle_until = 0.0          # spinning on past SPIN_FREE until then: the cores are idle
        report_after = min(REPORT_AFTER, limit / 4)   # (a short timeout's peers publish
        while True:                                    # sooner: its hang report reads them)
            if self.progress():
                idle_since = None
                if done():
                    return
                now = time.monotonic()
                if now < deadline:   # a peer that never stops talking must not hold us
                    # past the deadline, nor keep this wait from publishing its state (data
                    # streaming in for a whole short timeout: "did not report")
                    if now - start > report_after and self.on_long_wait is not None:
                        self.on_long_wait()
                    continue
            if done():
                return
            now = time.monotonic()
            if idle_since is None:
                idle_since, spun = now - spun, 0.0
            if now - self._last_liveness > LIVENESS_EVERY:
                self._last_liveness = now
                self.check_liveness()
                if done():
                    return
                if now - start > report_after and self.on_long_wait is not None:
                    self.on_long_wait()
                    if self.departed is not None and self._fail_departed(peers()) and done():
                        return
            if now > deadline:
                # the connections' state first: describe() may wait for the hang report
                state = self.transport_state(peers())
                raise TimeoutError(describe(limit) + state)
            if now - idle_since < self.spin or now < idle_until:
                continue
            if not self.crowded and now - idle_since < IDLE_SPIN and self._loadavg >= 0 \
                    and self._large_in_flight() and _runnable(self._loadavg) <= self.ncpu:
                idle_until = now + IDLE_CHECK
                continue
            if IDLE_YIELD and not self.crowded and now - idle_since < IDLE_SPIN \
                    and self._large_in_flight():
                os.sched_yield()
                continue
            if self.crowded and now - idle_since < YIELD_CROWDED:
                os.sched_yield()
                continue
            self._sleep(min(deadline - now, LIVENESS_EVERY) + 1e-4)

    def _fail_departed(self, ranks) -> bool:
        """Fail the peers among ``ranks`` (whom a long wait waits for) that have left the
        job: they called destroy, which waits for every rank to leave, so what this rank
        waits for from them will never come - without this, the wait ran to its timeout
        and blamed them as busy or hung. Not a peer whose bytes are still arriving (a slow
        link still delivers what it sent before it left). True if any was failed."""
        gone = self.departed(sorted(r for r in set(ranks) if r in self.peers
                                    and not self.peers[r].dead))
        failed = False
        for r in gone:
            peer = self.peers[r]
            if isinstance(peer, TcpPeer) and peer.arriving(1000):
                continue
            if isinstance(peer, ShmPeer) and peer._poll_in():
                continue    # (its last words first: the wait takes them, and looks again -
                            # failed now, the call they complete would fail with it)
            if not peer.dead:
                peer.fail(peer_failure(r, "it has left the job (it called destroy()) while "
                                          "this rank still waits for it", left=True))
                failed = True
        return failed

    def transport_state(self, ranks) -> str:
        """For a timeout's message: what this rank's TCP connections to ``ranks`` hold
        (tcp.TcpPeer.state), so a stall reads as data still to come, or sent and unread."""
        lines, slow = [], []
        for r in sorted(set(ranks)):
            peer = self.peers.get(r)
            if isinstance(peer, TcpPeer) and not peer.dead:
                lines.append(f"rank {r} over TCP: {peer.state()}")
                if peer.incoming and peer.arriving(1000):
                    slow.append(r)
        if slow:   # still moving: a slow link, not a stall
            lines.append(f"data from rank(s) {slow} was still arriving in the last second: "
                         f"if the link is this slow, give the call more time (timeout=, "
                         f"RINGLET_TIMEOUT)")
        return ("; " + "; ".join(lines)) if lines else ""

    def _large_in_flight(self) -> bool:
        """A message above the eager limit is on its way, in or out (see IDLE_SPIN)."""
        return any(p.awaiting_cts or p.incoming for p in self.peers.values())

    def _sleep(self, seconds: float) -> None:
        self._nap(1)
        try:
            if self.progress():  # something arrived before we announced the nap
                return
            for peer in self.tcp_peers:   # wake when a full socket buffer drains, too
                for lane in peer.lanes:
                    want = selectors.EVENT_READ | (selectors.EVENT_WRITE if lane.wpending else 0)
                    if want != lane.events and not peer.dead:
                        self.sel.modify(lane.sock, want, peer)
                        lane.events = want
            for key, _ in self.sel.select(max(seconds, 0)):
                if key.fileobj is self.doorbell:
                    self.drain_doorbell()
        finally:
            self._nap(-1)

    def drain_doorbell(self) -> None:
        self.doorbell.drain()

    def ring_doorbell(self, bell: Bell) -> None:
        bell.ring()

    def check_liveness(self) -> None:
        for peer in self.peers.values():
            if isinstance(peer, ShmPeer) and not peer.dead:
                peer.check_alive()
        self.calls.check_members()

    def flush_aborts(self, limit: float = 1.0) -> None:
        """Give the ABORTs that tell a collective's other members of a failure a moment to
        get out from behind data queued before them: this rank may leave (its process
        exit) right after, and a member told nothing would blame this rank's exit instead."""
        deadline = time.monotonic() + limit
        while any(kind == "abort" for p in self.peers.values() if not p.dead
                  for kind, _ in p.outq) and time.monotonic() < deadline:
            if not self.progress():
                os.sched_yield()

    def protocol_violation(self, peer, why: str) -> None:
        log.warning("ringlet rank %d: dropping rank %d: protocol violation: %s", self.rank, peer.rank, why)
        peer.fail(peer_failure(peer.rank, f"protocol violation ({why})"))

    # -- teardown ------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        if self.closed:
            return
        self.background.stop()
        self.closed = True
        # Flush what is queued and say goodbye, so peers see a clean exit, not a failure.
        for peer in self.peers.values():
            if isinstance(peer, TcpPeer) and not peer.dead:
                peer.send_bye()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(
                getattr(p, "wpending", None) and not p.dead for p in self.peers.values()):
            self.progress()
            time.sleep(0.0005)
        segs = [self.seg] + [p.outbox.seg for p in self.peers.values() if isinstance(p, ShmPeer)]
        for peer in self.peers.values():
            peer.close()
        self.seg = None
        self.remote_maps.clear()
        for seg in segs:   # (the names are gone already: this returns the descriptors)
            try:
                if seg is not None:
                    seg.close()
            except BufferError:   # a view of it is still alive somewhere: the GC will do it
                pass
        self.sel.close()
        if self.doorbell is not None:
            self.doorbell.close()
        self._close_seg_fd()
        if self._loadavg >= 0:
            os.close(self._loadavg)
            self._loadavg = -1
