"""Survive a lost rank: ``rl.shrink()`` makes the survivors' new world, agreed by all.

After a ``PeerFailure`` every survivor calls ``shrink()``. Each records in the job's store
that it is alive and whom it saw die; the first to arrive decides for everyone: it waits
until every rank of the old world has either joined or is known dead (by its own
liveness checks or any joiner's report), or until the timeout, and writes the members.
Everyone reads that one decision, so ranks that disagreed about who died (one saw the
death, another was still waiting on a live rank) end in the same world. The store is
the job's reliable point: under ``ringlet run`` and ``rl.spawn`` the launcher hosts it;
when rank 0 hosts it, a dead rank 0 cannot be survived.

The processes and their connections stay: the new world is a group of the survivors'
ranks under a fresh group id, and every message, receive and call of the old world's
groups is failed or dropped (``Engine.retire``), so no stale byte reaches the new one.
"""
from __future__ import annotations

import json
import time

from . import runtime
from .errors import PeerFailure, RingletError, TimeoutError
from .group import KEYED_MIN, Group
from .work import check_timeout

POLL = 0.005   # seconds between the decider's looks at who has joined


def shrink(timeout: float | None = None) -> Group:
    """Called by every surviving rank after a PeerFailure: returns the new world (ranks
    renumbered 0..n-1 in the old order; ``.lost``: the old world's ranks left out,
    ``.previous``: each new rank's old rank). Collectives and point-to-point then act on
    it (``group=None``); old groups are gone — make new ones with ``rl.new_group``. Calls
    in flight on the old world fail. ``timeout``: how long to wait for live ranks that
    have not called shrink (default: init's); those still missing then are left out."""
    eng = runtime.engine()
    if timeout is not None:      # (0 or -1 had the first rank in decide alone, at once)
        check_timeout(timeout)
    S = runtime._S
    old = S.world
    limit = S.timeout if timeout is None else timeout
    gone = PeerFailure(f"rank {eng.rank}: the call was abandoned by rl.shrink()")
    with eng.held():                   # (the background thread drives the engine too)
        for work in eng.works[:]:      # nothing more moves on the old world
            work.fail(gone)
    for w in S.outstanding:
        w._reported = True             # (their failures are why we shrink: not news)
    S.outstanding = []
    key = f"g{S.generation - 1}/shrink/{old.id}/"
    try:
        # Rounds: a decider that dies before its decision is written (its wait for the
        # others is up to the timeout) is seen dead by the others, who decide again in
        # the next round. (One round only: every survivor then waited out its timeout, and
        # every later shrink too, on the same keys.)
        decision, rnd = None, 0
        while decision is None:
            decision = _round(eng, S.store, f"{key}{rnd}/" if rnd else key, old, limit)
            rnd += 1
    except TimeoutError as exc:
        raise TimeoutError(f"rank {eng.rank}: shrink: no decision on the new world within "
                           f"{limit + 5:g} s (no rank took the decision, or the deciding rank "
                           f"cannot be reached); restart the job") from exc
    except RingletError as exc:
        raise RingletError(f"rank {eng.rank}: shrink needs the job's store, gone or out of "
                           f"reach ({exc}): it lives in the launcher of `ringlet run` (first "
                           f"node) or rl.spawn, which must outlive the lost ranks (`ringlet run "
                           f"--keep-going`) and stay reachable from every survivor; under "
                           f"other launchers in rank 0, whose loss takes it along") from exc
    members, gid = decision["members"], decision["gid"]
    if eng.rank not in members:
        raise RingletError(f"rank {eng.rank}: shrink: the survivors made their new world "
                           f"without this rank (it joined after {limit:g} s, or was reported "
                           f"dead); it cannot take part any more")
    with eng.held():
        eng.calls.retire(gid, [g.id for g in S.groups if g.id >= KEYED_MIN], gone)
    world = Group(gid, tuple(members), members.index(eng.rank),
                  tuple(eng.hosts[r] for r in members), "world",
                  lost=tuple(old.group_rank(r) for r in old.ranks if r not in members),
                  previous=tuple(old.group_rank(r) for r in members))
    S.world = world
    S.groups = {world: None}
    S.last_gid = max(S.last_gid, gid)
    runtime.drop_lanes()      # (the peers' numbers changed)
    return world


def _round(eng, store, key: str, old: Group, limit: float) -> dict | None:
    """One round of the agreement under ``key``: join; the first to join decides; the
    decision, or None once this rank sees the round's decider dead without one."""
    with eng.held():
        eng.check_liveness()
        eng.progress()
        mine = {"dead": _dead(eng, old), "gid": runtime.highest_gid()}
    store.set(f"{key}join/{eng.rank}", json.dumps(mine).encode())
    if store.add(f"{key}ticket", 1) == 1:
        store.set(f"{key}decider", str(eng.rank).encode())
        decision = _decide(eng, store, key, old, limit)
        store.set(f"{key}decision", json.dumps(decision).encode())
        return decision
    deadline = time.monotonic() + limit + 5.0
    decider = None
    while True:
        raw = store.try_get(f"{key}decision")
        if raw is not None:
            return json.loads(raw)
        if decider is None:
            raw = store.try_get(f"{key}decider")
            decider = int(raw) if raw is not None else None
        if decider is not None:
            with eng.held():
                eng.check_liveness()
                eng.progress()
                dead = eng.peers[decider].dead
            if dead:
                # (read again: a decider that wrote its decision and died between our look
                # and its death would else leave this rank to a next round, and in another
                # world than the ranks that read the decision)
                raw = store.try_get(f"{key}decision")
                return json.loads(raw) if raw is not None else None
        if time.monotonic() > deadline:
            raise TimeoutError(f"no decision in {limit + 5:g} s")
        time.sleep(POLL)


def _dead(eng, group: Group) -> list:
    return [r for r in group.ranks if r != eng.rank and eng.peers[r].dead]


def _decide(eng, store, key: str, old: Group, limit: float) -> dict:
    """Wait until every old rank has joined or is known dead (or the time is up); the
    members are those that joined."""
    deadline = time.monotonic() + limit
    joined: dict = {}
    while True:
        for r in old.ranks:
            if r not in joined:
                raw = store.try_get(f"{key}join/{r}")
                if raw is not None:
                    joined[r] = json.loads(raw)
        with eng.held():
            eng.check_liveness()
            eng.progress()
        dead = set(_dead(eng, old)).union(*(set(j["dead"]) for j in joined.values()))
        if all(r in joined or r in dead for r in old.ranks) or time.monotonic() > deadline:
            break
        time.sleep(POLL)
    return {"members": sorted(joined), "gid": 1 + max(j["gid"] for j in joined.values())}
