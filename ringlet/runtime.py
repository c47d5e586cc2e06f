"""The process-wide runtime: init and destroy, groups, point-to-point, counters."""
from __future__ import annotations

import hashlib
import math
import os
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlparse

import numpy as np

from .agreement import Agreement
from .errors import AuthenticationError, RingletError, TimeoutError
from .group import KEYED_MIN, MAX_GID, MAX_USER_TAG, Group, group_of
from .ops import as_array
from .profiling import profiled
from .rendezvous import (FileStore, SignedStore, StoreServer, TCPStore, disagree_hint, env_world,
                         job_token, local_address_towards, new_token, torchrun_store)
from .transport import fast
from .transport.engine import Engine
from .transport.limits import affinity
from .transport.shm import detect_host_id
from .tuning import trials_from_env
from .work import RequestWork, TracedRequestWork, check_timeout, fold_lanes
from . import tracing

DEFAULT_TIMEOUT = 60.0


class _State:
    """This process's part of the job; every container is its own (a class-level one
    would outlive destroy and hold the first job's engine)."""

    def __init__(self):
        self.engine: Engine | None = None
        self.world: Group | None = None
        self.groups: dict = {}    # live groups, in creation order (a dict: found at once)
        self.store = None
        self.server: StoreServer | None = None
        self.profile = None
        self.tune = 0            # calls per candidate when auto's candidates go on trial (tuning.py)
        self.generation = 0
        self.timeout = DEFAULT_TIMEOUT
        self.spawned = False     # init was done by rl.spawn before calling the user's function
        self.outstanding: list = []   # async works handed to the user, until destroy accounts for them
        self.track_limit = 64    # when track next prunes them
        # blocking calls that C ran, to run again in one C call (_fastpath.Lane): sends and
        # receives, (kind, peer, tag, bytes[, subgroup]) -> the Lane, see _lane; small
        # collectives (keys: collectives._lane_key, all_reduce's own, ("barrier"[,
        # subgroup])) -> (the group, its Prepared, the Lane, its buffers' names), see
        # collectives._lane; a subgroup's go with it (drop_group)
        self.lane: dict = {}
        self.labelled_lanes: set = set()   # of them, labelled calls' keys (LABELLED_LANES)
        # ranks that left the job (destroy) while this rank waited for them: counted once as
        # having left, in the store, so their destroy need not wait for this rank's (_departed)
        self.released: set = set()
        self.published = 0.0     # when _publish_state last wrote this rank's state
        self.gave_up: dict = {}  # group id -> the last of its calls this rank timed out of
        # the highest id new_group (or shrink) has given: a dropped group's id is not given
        # again (its calls' state, and traffic still on its way, would be the new group's)
        self.last_gid = 0
        self.departed_checked = 0.0   # when _departed last asked the store (at most once a second)
        self.aside: dict = {}    # slot -> the last store call a wait made for its reports (_aside)


_S = _State()

#: what destroy() calls last: the layers above clear what they keep of this job
#: (collectives' prepared calls hold its groups, peers and engine: 20 torch init/destroy
#: cycles had kept 20 engines, and a store socket each)
AT_DESTROY: list = []


# -- lifecycle ---------------------------------------------------------------------------
def init(backend: str | None = None, init_method: str = "env://", rank: int | None = None,
         world_size: int | None = None, timeout: float | None = None) -> Group:
    """Join the job and return the world group.

    ``init_method``: ``env://`` (torchrun, Open MPI, PMI or SLURM variables, plus
    MASTER_ADDR/MASTER_PORT), ``tcp://host:port`` or ``file:///private/dir``. Every
    connection proves the job token (RINGLET_TOKEN; ``ringlet run`` and ``spawn`` set it).
    ``backend``: "auto" (shared memory inside a host, TCP between hosts), "tcp" or "shm";
    default RINGLET_BACKEND, else "auto".
    ``timeout``: default seconds for every blocking call (else RINGLET_TIMEOUT, else 60).
    """
    if _S.engine is not None:
        return _init_again(backend, rank, world_size)
    backend, timeout = _backend_and_timeout(backend, timeout)
    env = env_world()
    rank = env["rank"] if rank is None else rank
    world_size = env["world_size"] if world_size is None else world_size
    if rank is None or world_size is None:
        raise ValueError("rank and world_size are unknown: pass them to init() or launch with "
                         "`ringlet run`, torchrun, mpirun or srun (which set RANK/WORLD_SIZE or "
                         "their own equivalents)")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world of size {world_size}")
    url = urlparse(init_method)
    master_addr, master_port = env["master_addr"], env["master_port"]
    if url.scheme == "tcp":
        master_addr, master_port = url.hostname or "127.0.0.1", url.port or master_port
    elif url.scheme not in ("env", "file"):
        raise ValueError(f"unknown init_method {init_method!r}; use env://, tcp://host:port or "
                         f"file:///path")
    store, token, server = _store(url, rank, world_size, master_addr, master_port, timeout)
    return join(store, token, rank, world_size, backend, timeout, master_addr, master_port,
                server)


def _backend_and_timeout(backend, timeout) -> tuple[str, float]:
    """init's backend and default timeout: the arguments, else the environment's."""
    backend = backend or os.environ.get("RINGLET_BACKEND", "auto")
    if backend not in ("auto", "tcp", "shm"):
        raise ValueError(f"unknown backend {backend!r}; valid: auto, tcp, shm")
    if timeout is None:
        timeout = env_timeout()
    if timeout <= 0:
        raise ValueError("timeout must be positive (seconds)")
    return backend, timeout


def env_timeout() -> float:
    """RINGLET_TIMEOUT (seconds), else DEFAULT_TIMEOUT."""
    text = os.environ.get("RINGLET_TIMEOUT")
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"RINGLET_TIMEOUT={text!r}: must be a positive, finite number of "
                         f"seconds")
    return value


def _store(url, rank: int, world_size: int, master_addr: str, master_port: int, timeout: float):
    """(the rendezvous store, the job token, the store server rank 0 hosts or None) for an
    ``env://``, ``tcp://`` or ``file://`` init_method."""
    token, source = job_token()
    server = None
    if url.scheme == "file":
        store = FileStore(url.path, timeout)
        if token is None:  # the directory's permissions guard the token
            if rank == 0:
                store.set("token", new_token().encode())
            token = store.get("token").decode()
        return store, token, server
    if token is None:
        if world_size > 1:
            raise RingletError(
                f"no job token ({source}): every ringlet connection must prove a shared job "
                "secret. `ringlet run`, ringlet.spawn, torchrun, mpirun and srun provide one; "
                "under another launcher export the same random value on every rank, e.g. "
                "RINGLET_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')")
        token = new_token()
    joined = torchrun_store() if url.scheme == "env" else None
    if joined is not None:   # torchrun's agent holds MASTER_PORT: use its store, which
        # outlives a restart: each attempt keys its own (an earlier one's values are stale)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return SignedStore(joined, token, prefix=f"ringlet/{attempt}/", timeout=timeout,
                           source=source), token, server
    if rank == 0 and os.environ.get("RINGLET_STORE_HOSTED") != "1":
        bind = local_address_towards(master_addr, master_port)
        server = StoreServer(bind, master_port, token)
    try:
        store = TCPStore(master_addr, master_port, token, timeout)
    except AuthenticationError as exc:
        if server is not None:
            server.close()
        raise AuthenticationError(f"rank {rank}: the rendezvous store at {master_addr}:"
                                  f"{master_port} refused this rank; "
                                  f"{disagree_hint(source)}") from exc
    return store, token, server


def join(store, token: str, rank: int, world_size: int, backend: str = "auto",
         timeout: float = DEFAULT_TIMEOUT, master_addr: str = "127.0.0.1",
         master_port: int = 0, server: StoreServer | None = None) -> Group:
    """Start the engine on a store every rank reaches (init's second half; the torch
    backend calls it with the store torch hands it). The store is closed on failure."""
    host_id = os.environ.get("RINGLET_HOST_ID") or detect_host_id()
    job = hashlib.sha256(token.encode()).hexdigest()[:12]
    try:
        trials_from_env()       # (a bad RINGLET_TUNE on any rank fails before the job forms)
        engine = Engine(rank, world_size, store, token, job, host_id=host_id, backend=backend,
                        master_addr=master_addr, master_port=master_port, timeout=timeout,
                        calls=Agreement(_describe_fp), generation=_S.generation)
        hosts = engine.hosts
        profile, settings = _share_profile(store, rank, world_size, _S.generation, timeout,
                                           engine.cpus)
    except BaseException:
        store.close()
        if server is not None:
            server.close()
        raise
    _S.generation += 1
    _S.released, _S.gave_up = set(), {}
    engine.on_long_wait = _publish_state
    engine.departed = _departed
    engine.hang_report = _hang_report
    _S.engine, _S.store, _S.server, _S.timeout = engine, store, server, timeout
    _S.profile, _S.tune = profile, settings["tune"]
    _S.world = Group(0, tuple(range(world_size)), rank, hosts, "world")
    _S.groups = {_S.world: None}
    _S.last_gid = 0
    tracing.from_env(rank, world_size)
    return _S.world


def _init_again(backend, rank, world_size) -> Group:
    """init inside a rank rl.spawn already initialised (as under torch's mp.spawn): the
    same world is accepted and returned; anything else is an error saying so."""
    w = _S.world
    same = ((rank is None or rank == w.rank) and (world_size is None or world_size == w.size)
            and backend in (None, _S.engine.backend))
    if _S.spawned and same:
        return w
    if _S.spawned:
        raise RingletError(f"rl.spawn already initialised this rank as rank {w.rank} of {w.size} "
                           f"(backend {_S.engine.backend!r}); init() inside it may only ask for that "
                           f"same world (got rank={rank}, world_size={world_size}, backend={backend!r})")
    raise RingletError("ringlet is already initialized; call ringlet.destroy() first")


def _share_profile(store, rank: int, world_size: int, gen: int, timeout: float, cpus=None):
    """Rank 0's calibrated profile and settings of auto (``{"tune": RINGLET_TUNE}``), for
    every rank: algorithm="auto" must decide alike everywhere, even when hosts were
    calibrated differently or ranks were started with different environments. Where it has
    no profile, the default profile on the cores the job's ranks on rank 0's host may use
    (``cpus``): one rank bound to one core (mpirun's default for a few ranks) sees only its
    own."""
    import json
    from .cost.profile import Profile, default_profile, load_profile
    if rank == 0:
        prof = load_profile()
        mine = prof.to_dict()
        for name, params in default_profile(cpus).to_dict()["transports"].items():
            # uncalibrated: the default on the job's cores; else a partial calibration
            # is still usable, the default filling in what it lacks
            if not prof.calibrated or name not in mine["transports"]:
                mine["transports"][name] = params
        # every rank's copy names rank 0's source, and says so when it is the default
        mine["source"] = (f"rank 0's {prof.source}" if prof.calibrated else
                          "default (rank 0's)")
        rate = os.environ.get("RINGLET_LINK_RATE")
        if rate:   # the link between hosts, when the user knows it (ringlet run --link-rate)
            linked = Profile.from_dict(mine, mine["source"])
            linked = linked.with_link_rate(rate, shared=linked.shared())
            mine = dict(linked.to_dict(), source=linked.source)
        settings = {"tune": trials_from_env()}
        if world_size == 1:
            return Profile.from_dict(mine, mine.pop("source")), settings
        mine["settings"] = settings
        store.set(f"g{gen}/profile", json.dumps(mine).encode())
    got = json.loads(store.get(f"g{gen}/profile", timeout=timeout))
    settings = got.pop("settings", {"tune": 0})
    return Profile.from_dict(got, got.pop("source", "rank 0")), settings


def _state_key(rank: int) -> str:
    return f"g{_S.generation - 1}/state/{rank}"


def _aside(call, wait: float, slot: str, after: str | None = None):
    """``call()`` - a store call a wait makes for its reports - on a thread of its own,
    waited for ``wait`` seconds in all: its result, or None if it did not answer by then
    (or failed). One call per ``slot`` at a time: while the slot's last has not answered
    this one is not made. ``after``: a slot whose call must answer first (waited for within
    the same ``wait``). A store cut off by the network holds its socket ~30 s a call, and a
    call's wait must not outlast its own timeout for a report (on the far side of a
    partition a 5 s timeout raised after 40)."""
    end = time.monotonic() + wait
    for name, patience in ((slot, 0.0), (after, wait)):
        busy = _S.aside.get(name)
        if busy is not None:
            busy.join(patience)
            if busy.is_alive():
                return None
    got = []

    def run():
        try:
            got.append(call())
        except (RingletError, OSError, RuntimeError):
            pass
    t = _S.aside[slot] = threading.Thread(target=run, name=f"ringlet-store-{slot}", daemon=True)
    t.start()
    t.join(max(0.0, end - time.monotonic()))
    return got[0] if got else None


def _publish_state(waiting: str | None = None) -> None:
    """Tell the store how far this rank got in every group (for other ranks' hang
    reports); called when a wait has lasted a while, at most once a second. Cheap: it
    names the calls in flight and never builds a hang report itself."""
    import json
    now = time.monotonic()
    if now - _S.published < 1.0 or _S.store is None:
        return
    _S.published = now
    if waiting is None:
        calls = [w.what for w in _S.engine.works] if _S.engine is not None else []
        waiting = f"rank {_S.world.rank}: " + ("; ".join(calls) if calls else "a point-to-point call")
    state = {"seq": {str(g.id): g.seq for g in _S.groups}, "waiting": waiting,
             "at": time.time(),    # (a launcher out of time tells who still waited: launch.py)
             "gave_up": {str(k): v for k, v in _S.gave_up.items()},
             # (members, for groups small enough to say so: ranks that made one id from
             # different lists meet in no call, and a report must not call one "inside it")
             "ranks": {str(g.id): list(g.ranks) for g in _S.groups if len(g.ranks) <= 256}}
    key, store = _state_key(_S.engine.rank), _S.store
    _aside(lambda: store.set(key, json.dumps(state).encode()), 0.0, "publish")   # (no result)


def _left_key(rank: int) -> str:
    return f"g{_S.generation - 1}/left/{rank}"


def _departed(ranks) -> list:
    """Which of ``ranks`` have left the job (destroy marks it in the store before it waits
    for the others to leave); asked by a long wait, at most once a second."""
    now = time.monotonic()
    if now - _S.departed_checked < 1.0 or _S.store is None \
            or not hasattr(_S.store, "try_get"):
        return []
    _S.departed_checked = now
    store, keys = _S.store, [(r, _left_key(r)) for r in ranks]
    gone = _aside(lambda: [r for r, k in keys if store.try_get(k) is not None], 0.5,
                  "departed") or []
    for r in gone:
        _release(r)
    return gone


def _release(r: int) -> None:
    """A rank that left waits in destroy until every rank has left - or no longer waits
    for it: this rank counts itself done with rank ``r``, once."""
    if r not in _S.released and _S.world is not None and r in _S.world.ranks:
        _S.released.add(r)
        _S.store.add(f"g{_S.generation - 1}/bye/{_S.world.id}", 1)


def _hang_report(tag: int, what, limit: float, giving_up: bool) -> str:
    """Why a collective timed out after ``limit`` seconds, learned from the other ranks:
    who never entered it, who is inside it waiting for whom, who gave up on it (timed out),
    who did not report. ``giving_up``: this rank's call ends here (a blocking call's: not
    an async call's wait), which it tells them in turn."""
    import json
    collective, seq, group_name, _ = what
    g = next((x for x in _S.groups if x.id == group_of(tag)), None)
    if g is None or _S.store is None:
        return ""
    _S.published = 0.0
    _publish_state(f"rank {_S.world.rank}: {collective} #{seq} of group {group_name}")
    time.sleep(min(1.5, limit / 10))  # let waiting peers publish too (the call's own scale)
    lines, store = [], _S.store
    others = [r for r in g.ranks if r != _S.engine.rank]
    if not hasattr(store, "try_get"):
        states = {}
    else:
        states = _aside(lambda: {r: store.try_get(_state_key(r)) for r in others},
                        min(2.0, max(0.5, limit / 10)), "read", after="publish")
        if states is None:
            lines.append(f"the rendezvous store did not answer, so the other ranks' state is "
                         f"unknown (is the network to rank 0's host, which keeps it, down?)")
            others = []
    for r in others:
        raw = states.get(r)
        if raw is None:
            lines.append(f"rank {r} did not report (busy outside ringlet, or hung)")
            continue
        st = json.loads(raw)
        theirs = st["seq"].get(str(g.id), 0)
        members = st.get("ranks", {}).get(str(g.id))
        if members is not None and len(g.ranks) <= 256 and members != list(g.ranks):
            lines.append(f"rank {r} made group {group_name} from other ranks ({members} there, "
                         f"{list(g.ranks)} here): pass the same list to new_group on every "
                         f"rank")
        elif st.get("gave_up", {}).get(str(g.id), 0) >= seq:
            lines.append(f"rank {r} gave up on it (its own timeout ran out)")
        elif theirs < seq:
            lines.append(f"rank {r} never entered {collective} #{seq} of group {group_name} "
                         f"(its last call there was #{theirs}; it is in: {st['waiting']})")
        elif st["waiting"]:
            lines.append(f"rank {r} entered it and waits ({st['waiting']})")
    if giving_up:
        _S.gave_up[g.id] = seq
        _S.published = 0.0
        _publish_state(f"rank {_S.world.rank}: {collective} #{seq} of group {group_name}")
    return ("; " + "; ".join(lines)) if lines else ""


def job_profile():
    """The cost profile this job's automatic choices use (rank 0's)."""
    return _S.profile


def _describe_fp(fp) -> dict:
    from . import algorithms, fingerprint
    return fingerprint.decode(fp, lambda c: tuple(algorithms.CATALOG[c]))


def track(work, timeout: float | None = None):
    """Remember an async work for destroy(), which completes it or says it was lost.
    ``timeout``: the call's own, what its ``wait()`` waits by default."""
    if timeout is not None:
        work.limit = timeout
    out = _S.outstanding
    if len(out) >= _S.track_limit:
        # forget finished ones (a failed one until its error is seen); the next look is
        # when the list has doubled: a look at every call once 64 were pending made 20k
        # irecvs take 10 s to post, quadratic
        out[:] = [w for w in out if not (w._done() and (w._reported or (
            w.error is None and w._error() is None)))]
        _S.track_limit = max(64, 2 * len(out))
    out.append(work)
    return work


def _finish_outstanding(eng) -> tuple[list, list]:
    """Drive every async work the user did not wait for to its end; return the lost ones
    as lines "what: error", and those that never completed (failed by destroy, which
    settles their futures once the engine is closed)."""
    works, _S.outstanding = _S.outstanding, []
    # (the ranks they wait for: one that left the job - in destroy too - will send nothing
    # more, and fails them at once instead of after the whole timeout; Engine._fail_departed)
    waits_for = lambda: [r for w in works if not w._done() for r in w._waiting_on()]  # noqa: E731
    try:
        with eng.held():
            eng.wait(lambda: all(w._done() for w in works), _S.timeout, lambda t: "", waits_for)
    except RingletError:
        pass
    lost, ended = [], []
    for w in works:
        if not w._done():
            lost.append(f"{w.what}: did not complete within {_S.timeout:g} s")
            # (its wait and its future say so: a wait after destroy had met the closed
            # transport - AttributeError - and the future's callbacks never ran)
            w.error = RingletError(f"rank {eng.rank}: {w.what}: did not complete within "
                                   f"{_S.timeout:g} s, and rl.destroy() ended it")
            ended.append(w)
            continue
        err = w.error or w._error()
        if err is not None and not w._reported:   # (a PeerFailure names its call itself)
            lost.append(f"{type(err).__name__}: {err}" if getattr(err, "call", None)
                        else f"{w.what}: {type(err).__name__}: {err}")
    return lost, ended


def destroy() -> None:
    """Leave the job: complete every async operation still in flight, flush and close
    every connection. Raises RingletError naming the async operations that could not
    complete (a peer is gone) and whose error nobody has seen. Safe to call twice."""
    eng = _S.engine
    if eng is None:
        return
    tracing.stop()
    lost, ended = [], []
    try:
        lost, ended = _finish_outstanding(eng)
        with eng.held():
            eng.check_liveness()
            eng.progress()
        world = _S.world
        for r in world.ranks:     # told by a peer that r left (an ABORT), not by the store
            if r != eng.rank and getattr(eng.peers[r].dead, "left", False):
                try:
                    _release(r)
                except RingletError:
                    pass
        if world.size > 1 and not any(eng.peers[r].dead for r in world.ranks if r != eng.rank):
            # nobody may leave while a peer still needs them (a dead peer never says bye);
            # one count per world, as it may have shrunk
            bye = f"g{_S.generation - 1}/bye/{world.id}"
            try:
                # peers still waiting for this rank learn it left (Engine._fail_departed);
                # (its published state stays its last call's, which hang reports name)
                _S.store.set(_left_key(eng.rank), b"1")
                _S.store.add(bye, 1)
                _wait_for_byes(eng, world, bye)
                # Rank 0 may host the store (torch's TCPStore, or init's own server): it
                # leaves once the others have made their last call to it, which would
                # otherwise break (torch logs a warning of it).
                _S.store.add(bye + "/last", 1)
                if eng.rank == 0:
                    _S.store.wait_count(bye + "/last", world.size, timeout=min(2.0, _S.timeout))
            except (RingletError, TimeoutError):
                pass
        eng.close()
    finally:
        _S.store.close()
        if _S.server is not None:
            _S.server.close()
        _S.engine = _S.world = _S.store = _S.server = None
        _S.groups = {}
        drop_lanes()     # (the engine is gone: nothing left to count)
        _S.spawned = False
        for forget in AT_DESTROY:   # caches that hold this job's groups (and so its engine)
            forget()
        # Their futures fail now, the engine closed: a callback that waits on its work (the
        # torch backend's) is told at once; settled before, each waited a whole timeout.
        for w in ended:
            w._settle()
    if lost:
        raise RingletError(f"rank {eng.rank}: destroy(): {len(lost)} async operation(s) could "
                           f"not complete, their results are missing: " + "; ".join(lost))


def _wait_for_byes(eng, world: Group, bye: str) -> None:
    """Wait (up to the timeout) until every rank of ``world`` said bye under ``bye``,
    or one of them is gone: a rank that exits without destroy() never says it, and its
    peers would wait out the whole timeout at the end of the job."""
    deadline = time.monotonic() + _S.timeout
    while True:
        try:
            left = max(0.0, deadline - time.monotonic())
            _S.store.wait_count(bye, world.size, timeout=min(0.1, left))
            return
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise
        with eng.held():
            eng.check_liveness()
            eng.progress()
        if any(eng.peers[r].dead for r in world.ranks if r != eng.rank):
            return


def is_initialized() -> bool:
    return _S.engine is not None


def engine() -> Engine:
    if _S.engine is None:
        raise RingletError("ringlet is not initialized: call ringlet.init() first "
                           "(or it was destroyed)")
    return _S.engine


def resolve(group: Group | None) -> Group:
    """The group a call acts on; it must be live and include this rank."""
    if _S.engine is None:
        engine()      # (raises: not initialized)
    g = _S.world if group is None else group
    if not isinstance(g, Group) or g not in _S.groups:
        gone = " (rl.shrink() made a new world: groups made before it are gone; make them " \
            "again with rl.new_group)" if isinstance(g, Group) and _S.world.previous else ""
        raise ValueError(f"{group!r} is not a live ringlet group{gone}")
    if g.rank < 0:
        raise ValueError(f"rank {_S.world.rank} is not a member of {g.name} (ranks {list(g.ranks)})")
    return g


def can_overlap(group: Group) -> bool:
    """Whether a call on ``group`` left in flight can overlap the caller's compute: when
    background progress is on and the group crosses hosts (it waits on a wire), or this host
    has a core to spare beyond one per local rank. Where the job's ranks fill the cores, a
    shared-memory transfer moved by the progress thread only takes turns with the compute
    and pays thread switches for it (DDP step, p = 2 on 2 cores: 0.85-0.98x Gloo in flight,
    1.24-1.41x completed in the call; examples/train_mlp.py dp, 4 ranks: 11.5 ms of
    communication per step in flight, 0.7 ms completed in the call). The torch backend and
    ringlet.train decide with it."""
    if not engine().background.on:
        return False
    if len(set(group.hosts)) > 1:
        return True
    local = _S.world.hosts.count(_S.world.hosts[_S.world.rank])
    e = engine()   # (a rank bound to one core shares it with its own progress thread)
    return len(affinity()) > 1 and e.ncpu > max(local, e.same_machine)


def get_rank(group: Group | None = None) -> int:
    """This rank's rank in the group; -1 if it is not in it."""
    engine()
    g = _S.world if group is None else group
    return g.rank


def get_world_size(group: Group | None = None) -> int:
    """The group's size; -1 on a rank not in it (as torch's; ``group.size`` is its size
    anywhere)."""
    engine()
    g = _S.world if group is None else group
    return g.size if g.rank >= 0 else -1


@contextmanager
def trace(directory: str):
    """``with rl.trace("traces/"):`` records this rank's calls inside the block into
    ``traces/rank<R>.jsonl`` (every rank of the job should enter it)."""
    tracing.start(directory, get_rank(), get_world_size())
    try:
        yield
    finally:
        tracing.stop()


def new_group(ranks=None, timeout: float | None = None) -> Group:
    """Create a subgroup. Every world rank must call it, in the same order (as in torch);
    ranks not in ``ranks`` get a handle whose ``rank`` is -1 and cannot use it.
    ``timeout``: how long its calls wait by default (else init's); a call's own wins."""
    engine()
    if timeout is not None:
        check_timeout(timeout)
    world = _S.world
    ranks = tuple(range(world.size)) if ranks is None else tuple(int(r) for r in ranks)
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"new_group: ranks {list(ranks)} contain duplicates")
    for r in ranks:
        if not 0 <= r < world.size:
            raise ValueError(f"new_group: rank {r} is outside the world of size {world.size}")
    gid = next_gid()
    g = Group(gid, tuple(world.ranks[r] for r in ranks),   # (the world may have shrunk)
              ranks.index(world.rank) if world.rank in ranks else -1,
              tuple(world.hosts[r] for r in ranks), timeout=timeout)
    _S.groups[g] = None
    return g


def destroy_group(group: Group) -> None:
    """Forget a subgroup made by ``new_group``: its handle no longer works, and its id may
    be given again once ids run out. Every world rank calls it, in the same order, as
    new_group (ids are counted alike everywhere); a call still in flight on it should be
    waited for first. The world cannot be destroyed this way: ``rl.destroy()``."""
    engine()
    if not isinstance(group, Group) or group not in _S.groups:
        raise ValueError(f"destroy_group: {group!r} is not a live ringlet group")
    if group is _S.world:
        raise ValueError("destroy_group: the world group ends with rl.destroy()")
    drop_group(group)


def highest_gid() -> int:
    """The highest counted group id in use here or given before: not the keyed groups',
    which only their members know of. (Every counted id is given by next_gid or a shrink,
    and each raises ``_S.last_gid``; scanning the groups made 16k new_groups quadratic.)"""
    return _S.last_gid


def next_gid() -> int:
    """The id of the next group new_group creates, as every rank counts alike: one past
    ``highest_gid``, unless that reaches KEYED_MIN - then the lowest one not in use."""
    gid = highest_gid() + 1
    if gid >= KEYED_MIN:
        used = {g.id for g in _S.groups}
        gid = next((i for i in range(1, KEYED_MIN) if i not in used), None)
        if gid is None:
            raise RingletError(f"more than {KEYED_MIN - 1} groups at once: destroy some first")
    _S.last_gid = max(_S.last_gid, gid)
    return gid


def keyed_ids_in_use() -> set[int]:
    """The keyed group ids this rank cannot give a new keyed group: its live groups' and a
    shrunk-away world's (whose traffic may still be in flight)."""
    eng = engine()
    return {g.id for g in _S.groups if g.id >= KEYED_MIN} | set(eng.retired_keyed)


def keyed_group(ranks, key: str) -> Group:
    """A subgroup every member names alike by ``key`` (torch's group name and rank list),
    created by its members only: its id, and so its traffic, does not depend on which
    groups each rank created before (new_group's ids count creations). The members swap
    the keyed ids each uses through the job's store (``_ids_taken``), then each takes the
    first from a hash of ``key`` that none uses: the same id on every member. (Hashing the
    name alone, two of a rank's groups clashed once it had about 50 - a birthday collision
    in 16384 ids - and the later one could not be made.) Groups that share no member may
    share an id: no message goes between them. The world's id goes into the hash: a world
    that shrank away may still have keyed traffic in flight."""
    world = _S.world
    ranks = tuple(int(r) for r in ranks)
    span = MAX_GID + 1 - KEYED_MIN
    digest = hashlib.sha256(f"{world.id}/{key}".encode()).digest()
    start = int.from_bytes(digest[:8], "little") % span
    used = _ids_taken(ranks, key) if world.rank in ranks else keyed_ids_in_use()
    gid = next((KEYED_MIN + (start + i) % span for i in range(span)
                if KEYED_MIN + (start + i) % span not in used), None)
    if gid is None:
        raise RingletError(f"group {key!r}: all {span} keyed group ids are in use by its "
                           f"members (rank {world.rank}); destroy some groups first")
    g = Group(gid, ranks, ranks.index(world.rank) if world.rank in ranks else -1,
              tuple(world.hosts[r] for r in ranks), name=key)
    _S.groups[g] = None
    return g


def _ids_taken(ranks: tuple, key: str) -> set[int]:
    """The keyed ids any member of the group ``key`` uses, each member's set as it makes
    the group, swapped through the job's store (which every rank of the world shares)."""
    world, eng = _S.world, engine()
    mine = keyed_ids_in_use()
    if len(ranks) == 1:
        return mine
    prefix = f"ids/{eng.job}/{world.id}/{key}/"
    _S.store.set(prefix + str(world.rank), " ".join(map(str, sorted(mine))).encode())
    taken = set(mine)
    for r in ranks:
        if r != world.rank:
            taken.update(int(i) for i in _S.store.get(prefix + str(r), timeout=_S.timeout).split())
    return taken


def drop_group(g: Group) -> None:
    """Forget a subgroup (torch destroyed it), and its calls' lanes (a lane's call runs
    without asking whether its group is live); its id may be used again."""
    if g is _S.world:
        return
    _S.groups.pop(g, None)
    eng = _S.engine
    if eng is None:
        return
    with eng.lock:      # (stats() folds the lanes; another thread may open one)
        # (a collective's lane keeps its group first; a send's or receive's, last in its key)
        for k in [k for k, hit in _S.lane.items()
                  if (hit[0] if type(hit) is tuple else k[-1]) is g]:
            del _S.lane[k]
            _S.labelled_lanes.discard(k)
        fold_lanes(eng)       # (count what they ran first; the tuner's trial lanes too)
        for made in eng.lanes.values():
            made[:] = [c for c in made if c.group is not g]


def default_timeout() -> float:
    return _S.timeout


# -- point-to-point ---------------------------------------------------------------------
def _peer(g: Group, peer: int, what: str) -> int:
    if not isinstance(peer, (int, np.integer)):
        raise TypeError(f"{what}: peer rank must be an int, got {type(peer).__name__}")
    if not 0 <= peer < g.size:
        raise ValueError(f"{what}: rank {peer} is out of range for {g.name} of size {g.size}")
    if peer == g.rank:
        raise ValueError(f"{what}: rank {g.rank} cannot {what} to/from itself")
    return g.ranks[peer]


def _tag(g: Group, tag: int) -> int:
    if not isinstance(tag, (int, np.integer)) or not 0 <= tag < MAX_USER_TAG:
        raise ValueError(f"tag must be an int in [0, 2**40), got {tag!r}")
    return g.p2p_tag(int(tag))


@profiled("isend", blocking=False)
def isend(buf, dst: int, group: Group | None = None, tag: int = 0,
          timeout: float | None = None) -> RequestWork:
    """``timeout``: what its ``wait()`` waits by default (else init's)."""
    args = _p2p("send", buf, dst, group, tag)
    return track(_post(*args, tr=_traced("isend", args, group, tag) if tracing.ON else None),
                 args[4][2].timeout if timeout is None else timeout)


@profiled("irecv", blocking=False)
def irecv(buf, src: int, group: Group | None = None, tag: int = 0,
          timeout: float | None = None) -> RequestWork:
    """``timeout``: what its ``wait()`` waits by default (else init's)."""
    args = _p2p("recv", buf, src, group, tag)
    return track(_post(*args, tr=_traced("irecv", args, group, tag) if tracing.ON else None),
                 args[4][2].timeout if timeout is None else timeout)


@profiled("send", blocking=True)
def send(buf, dst: int, group: Group | None = None, tag: int = 0, timeout: float | None = None) -> None:
    if timeout is not None:
        check_timeout(timeout)
    if _lane("send", dst, tag, buf, group):
        return
    args = _p2p("send", buf, dst, group, tag)
    if tracing.ON:
        return _traced_blocking("send", args, group, tag, timeout)
    _blocking(args, timeout)


@profiled("recv", blocking=True)
def recv(buf, src: int, group: Group | None = None, tag: int = 0, timeout: float | None = None) -> int:
    if timeout is not None:
        check_timeout(timeout)
    if _lane("recv", src, tag, buf, group):
        return src
    args = _p2p("recv", buf, src, group, tag)
    if tracing.ON:
        _traced_blocking("recv", args, group, tag, timeout)
    else:
        _blocking(args, timeout)
    return src


def _p2p(kind: str, buf, peer: int, group, tag: int) -> tuple:
    """A send's or receive's arguments, checked: (kind, world rank of the peer, wire tag,
    the buffer as a flat array, who: (peer, tag, group) to name it in errors by ``_what``)."""
    g = resolve(group)
    world = _peer(g, peer, kind)
    arr = as_array(buf, "send buffer") if kind == "send" else \
        as_array(buf, "receive buffer", writable=True)
    flat = arr if arr.ndim == 1 else arr.reshape(-1)
    # (what to call it is formatted only when a request is posted: 0.2 us of a blocking call)
    return kind, world, _tag(g, tag), flat, (peer, tag, g)


def _what(kind: str, who: tuple) -> str:
    peer, tag, g = who
    return (f"send to rank {peer}" if kind == "send" else f"recv from rank {peer}") + \
        f" (tag {tag}, {g.name})"


def _traced(op: str, args: tuple, group, tag: int):
    kind, world, wire, flat, _ = args
    return tracing.P2P(op, kind, world, wire, flat, resolve(group).name, int(tag))


def _traced_blocking(op: str, args: tuple, group, tag: int, timeout) -> None:
    tr = _traced(op, args, group, tag)
    if _blocking(args, timeout, tr):
        tr.ran_in_c()


def _post(kind: str, world: int, wire: int, flat, who: tuple, watch: bool = True,
          tr=None) -> RequestWork:
    what = _what(kind, who)
    eng = engine()
    eng.enter()
    try:
        if kind == "send":
            req = eng.isend(world, wire, flat.view(np.uint8))
        else:
            req = eng.irecv(world, wire, flat)
    finally:
        eng.leave()
    if tr is None:
        work = RequestWork(eng, req, what)
    else:
        if kind == "send":
            tr.sent(tracing.path_of(eng.peers[world], flat, 0, flat.size, p2p=True), req.done)
        work = TracedRequestWork(eng, req, what, tr)
    if watch and not req.done:
        eng.background.watch(work)
    return work


def _blocking(args: tuple, timeout, tr=None) -> bool:
    """A blocking send or receive of one EAGER packet (at most 512 KiB) to a local rank runs
    in C (transport/fast.py); anything else, or one C could not finish, is posted and
    waited for (traced by ``tr``, if given). True if C did it."""
    eng = _S.engine     # (_p2p's resolve found it initialized)
    spun = 0.0
    if eng.fast:
        kind, world, wire, flat, (peer, tag, g) = args
        eng.enter()        # (as in collectives._run)
        try:
            done, spun = fast.p2p(eng, kind, world, wire, flat)
        finally:
            eng.leave()
        if done:
            key = (kind, peer, tag, flat.nbytes) if g is _S.world else \
                (kind, peer, tag, flat.nbytes, g)
            if type(peer) is int and type(tag) is int and key not in _S.lane and \
                    len(_S.lane) < 1024:
                _S.lane[key] = fast.lane(eng.fast_p2p[(kind, world, flat.nbytes)], ("buf",),
                                         (flat.nbytes,), (kind == "recv",), tag=wire)
            return True
    work = _post(*args, watch=False, tr=tr)
    work._spun = spun
    if timeout is None:
        timeout = args[4][2].timeout     # (the group's, if new_group gave one)
    try:
        work.wait(timeout)
    except TimeoutError as exc:
        if args[0] == "recv":
            if not _withdraw(work, args[1], exc):
                # A message already matched it and is landing: waited for, a period at a
                # time, while its bytes keep coming. (It had raised while the message went
                # on into the buffer and the send returned: the message was lost to both.)
                req, landed = work.req, -1
                while landed != req.offset + req.tail:
                    landed = req.offset + req.tail
                    try:
                        work.wait(timeout)
                        return False
                    except TimeoutError:
                        pass
        else:
            _detach(work, args[1])
        raise
    return False


def _detach(work, world: int) -> None:
    """A blocking send that timed out stays posted (its receiver may still ask for it),
    but what it has yet to send is copied now, while the caller's buffer still holds it
    (Peer.detach): the caller may write the buffer next. (Not a message whose receiver
    reads it in place, over shared memory: README, "Errors and failures".)"""
    eng = _S.engine
    eng.enter()
    try:
        peer = eng.peers.get(world)
        if peer is not None:
            peer.detach(lambda req: req is work.req)
    finally:
        eng.leave()


def _withdraw(work, world: int, exc) -> bool:
    """A blocking receive that timed out, taken back if no message has matched it yet:
    the message that comes later then goes to the next receive that asks for it, instead
    of into a buffer the caller has back. False when one already matched it (it lands
    where it was going)."""
    eng = _S.engine
    eng.enter()
    try:
        peer = eng.peers.get(world)
        if peer is not None and peer.withdraw(work.req):
            work.req.fail(exc)
            return True
        return False
    finally:
        eng.leave()


def _lane(kind: str, peer, tag, buf, group=None) -> bool:
    """Run a blocking send or receive in one C call (its ``_fastpath.Lane``), as C ran
    one before with the same kind, peer, tag, size and group (``_S.lane``; a subgroup's
    key ends with the group, whose ``destroy_group`` drops it): its checks
    passed then, and what they checked has not changed; only the buffer is new, checked
    here (an ndarray, not of objects) and by C (C-contiguous, writable to receive into).
    Not while a progress thread may drive the engine, anything else is in flight on it,
    or calls are traced; nor when C declines the buffer or the peer is busy: False
    (nothing done): take the full path. It is the full path's checks and calls, not C,
    that a small message waits on: 8 B one-way at p = 2 took 5.0-5.4 us a call the full
    way, 0.4-1.6 of it in C (bench/small_vs_mpi.py)."""
    if type(buf) is not np.ndarray or type(peer) is not int or type(tag) is not int:
        return False
    if group is None or group is _S.world:
        lane = _S.lane.get((kind, peer, tag, buf.nbytes))
    elif type(group) is Group:
        lane = _S.lane.get((kind, peer, tag, buf.nbytes, group))
    else:
        return False
    if lane is None:
        return False
    eng = _S.engine
    if eng.works or not eng.background.idle or tracing.ON or buf.dtype.hasobject:
        return False
    if not eng.lock.acquire(False):   # another thread of the user's is in a call
        return False
    try:
        return lane.run(eng.fast_budget, eng.crowded, buf, None) is True
    finally:
        eng.lock.release()


def drop_lanes() -> None:
    """Forget every lane (the world changed), counting what they ran first."""
    if _S.engine is not None:
        fold_lanes(_S.engine)
        _S.engine.lanes.clear()
    _S.lane = {}
    _S.labelled_lanes = set()


# -- counters ----------------------------------------------------------------------------
def stats() -> dict:
    """Per-peer (world rank) messages and bytes sent and received since init or reset, and
    per collective: calls, fast_calls (run wholly by the C fast path, transport/fast.py), time
    waited for peers (total and longest), the rank that arrived last, the last algorithm."""
    eng = engine()
    out = {"sent": {}, "received": {}}
    with eng.lock:
        fold_lanes(eng)
        for r, p in sorted(eng.peers.items()):
            ms, bs, mr, br = (int(c) for c in p.fast_counts)   # (those C moved)
            out["sent"][r] = {"messages": p.msgs_sent + ms, "bytes": p.bytes_sent + bs}
            out["received"][r] = {"messages": p.msgs_recv + mr, "bytes": p.bytes_recv + br}
        out["collectives"] = {k: v.as_dict() for k, v in eng.coll_stats.items()}
    return out


def reset_stats() -> None:
    eng = engine()
    with eng.lock:
        for p in eng.peers.values():
            p.msgs_sent = p.bytes_sent = p.msgs_recv = p.bytes_recv = 0
            p.fast_counts[:] = 0
        fold_lanes(eng)     # (and so zeroed)
        eng.coll_stats.clear()
