"""Survive a lost rank (issue 20): after a PeerFailure the survivors agree on a new world
with rl.shrink() and go on, without restarting a process."""
import json
import os
import signal

import numpy as np
import pytest

import ringlet as rl
from ringlet import runtime
from conftest import run, two_hosts


def _spawn(fn, n, *args, env=None):
    """Run a job whose rank 3 dies: it must be the only failure."""
    with pytest.raises(rl.ProcessFailed) as info:
        rl.spawn(fn, n, args=args, env=env, timeout=60, keep_going=True)
    assert info.value.rank == 3 and "SIGKILL" in info.value.detail, info.value


def _keyed_pair(rank):
    """A subgroup of ranks 0 and 1 named as the torch backend names its own (made by its
    members only), and one all_reduce on it."""
    if rank in (0, 1):
        pair = runtime.keyed_group((0, 1), "torch[0, 1]#1")
        v = np.ones(3)
        rl.all_reduce(v, group=pair, timeout=20)
        assert list(v) == [2.0] * 3


def _survive(rank, path):
    x = np.ones(1 << 16, np.float32)
    rl.all_reduce(x)
    _keyed_pair(rank)
    # Rank 3 dies once the others are through those calls: over TCP a rank may be done with
    # a call while its last bytes are still on the wire to a peer, and its death then
    # (rightly) fails that peer's call instead of the next.
    store = runtime._S.store
    if rank == 3:
        for r in range(3):
            store.get(f"test/through/{r}", timeout=30)
        os.kill(os.getpid(), signal.SIGKILL)
    store.set(f"test/through/{rank}", b"1")
    pending = rl.all_reduce(np.ones(1 << 16, np.float32), async_op=True)  # lost with the world
    with pytest.raises(rl.PeerFailure) as info:
        rl.all_reduce(x)
    assert info.value.rank == 3
    world = rl.shrink(timeout=20)
    assert (world.size, world.lost, world.previous) == (3, (3,), (0, 1, 2))
    assert rl.get_world_size() == 3 and rl.get_rank() == rank and world.rank == rank
    assert pending.is_completed()
    y = np.full(1 << 16, rank + 1.0, np.float32)       # large and small, every algorithm kind
    rl.all_reduce(y)
    assert np.all(y == 6.0)
    z = np.full(5, float(rank))
    rl.all_reduce(z, algorithm="ring")
    assert np.all(z == 3.0)
    out = np.empty((3, 4))
    rl.all_gather(out, np.full(4, float(rank)))
    assert [row[0] for row in out] == [0.0, 1.0, 2.0]
    pair = rl.new_group([0, 2])                       # subgroups of the new world
    if rank in (0, 2):
        v = np.ones(3)
        rl.all_reduce(v, group=pair)
        assert list(v) == [2.0] * 3
    # The same name again: the old world's keyed groups are retired, so the name takes a
    # new id (their traffic had been dropped under the old one).
    _keyed_pair(rank)
    got = np.zeros(2)
    if rank == 0:
        rl.send(np.array([7.0, 8.0]), 2)
    elif rank == 2:
        rl.recv(got, 0)
        assert list(got) == [7.0, 8.0]
    rl.barrier()
    open(f"{path}.{rank}", "w").write("ok")


@pytest.mark.parametrize("env", [None, two_hosts(4)], ids=["shm", "tcp"])
def test_survivors_shrink_and_continue(tmp_path, env):
    path = str(tmp_path / "done")
    _spawn(_survive, 4, path, env=env)
    assert all(os.path.exists(f"{path}.{r}") for r in range(3))


def _disagree(rank, path):
    """Rank 2 asks to shrink while everyone is alive (it saw no death); then rank 3 dies
    under ranks 0 and 1, who saw it. All three must end in the same world."""
    trio = rl.new_group([0, 1, 3])
    x = np.ones(100)
    if rank == 2:
        world = rl.shrink(timeout=30)
    else:
        if rank == 3:                       # dies once rank 2 has joined the shrink
            S = runtime._S
            S.store.get(f"g{S.generation - 1}/shrink/{S.world.id}/join/2", timeout=30)
            os.kill(os.getpid(), signal.SIGKILL)
        with pytest.raises(rl.PeerFailure):
            while True:
                rl.all_reduce(x, group=trio)
        world = rl.shrink(timeout=30)
    assert world.size == 3 and world.lost == (3,), (world, world.lost)
    y = np.array([float(rank)])
    rl.all_reduce(y)
    assert y[0] == 3.0
    with open(f"{path}.{rank}", "w") as f:
        json.dump(list(world.previous), f)


def test_ranks_that_disagree_about_who_died_converge(tmp_path):
    path = str(tmp_path / "seen")
    _spawn(_disagree, 4, path)
    seen = [json.load(open(f"{path}.{r}")) for r in range(3)]
    assert seen == [[0, 1, 2]] * 3, seen


def test_example_survivors_finish_with_the_loss_of_a_run_from_the_checkpoint(tmp_path):
    """examples/shrink.py: 4 ranks train, one is SIGKILLed at a random step, 3 shrink and
    finish; a 3-rank run from that step's checkpoint ends at the same loss."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "shrink_example", os.path.join(os.path.dirname(__file__), "..", "examples", "shrink.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for seed in (3, 4):
        res = example.main(["--steps", "12", "--seed", str(seed)])
        assert res["lost"] == [res["victim"]] and res["final_world"] == 3, res
        assert res["resumed_at"] == res["kill_step"], res
        assert res["match"], res
        assert f"rank {res['victim']} failed" in res["failure"], res


def _decider_dies(rank, path):
    """Rank 3 dies; rank 1 takes shrink's decision and dies before writing it."""
    x = np.ones(8)
    rl.all_reduce(x)
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(rl.PeerFailure):
        while True:
            rl.all_reduce(x, timeout=20)
    S = runtime._S
    key = f"g{S.generation - 1}/shrink/{S.world.id}/"
    if rank == 1:
        import sys     # (rl.shrink is the function: the module by its name)
        sys.modules["ringlet.shrink"]._decide = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    else:        # (rank 1 decides: the others join once it has taken the decision)
        assert S.store.get(f"{key}decider", timeout=30) == b"1"
    world = rl.shrink(timeout=20)
    assert (world.size, world.lost, world.previous) == (2, (1, 3), (0, 2)), world
    y = np.full(3, float(rank))
    rl.all_reduce(y)
    assert (y == 2.0).all()
    open(f"{path}.{rank}", "w").close()


def test_survivors_shrink_though_the_deciding_rank_dies_in_the_decision(tmp_path):
    """The survivors waited out their timeout, and every later shrink too (on the same
    keys): the deciding rank's death now starts another round, decided by another."""
    path = str(tmp_path / "decided")
    with pytest.raises(rl.ProcessFailed) as info:
        rl.spawn(_decider_dies, 4, args=(path,), timeout=60, keep_going=True)
    assert info.value.rank in (1, 3), info.value
    assert all(os.path.exists(f"{path}.{r}") for r in (0, 2))


def _straggler_left_out(rank, path):
    x = np.ones(10)
    rl.all_reduce(x)
    if rank == 3:
        open(path + ".pid", "w").write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)         # alive, but never calls shrink
    with pytest.raises(rl.TimeoutError):
        rl.all_reduce(x, timeout=1)
    world = rl.shrink(timeout=2)                      # it is left out after 2 s
    assert world.size == 3 and world.lost == (3,)
    y = np.ones(4)
    rl.all_reduce(y)
    assert list(y) == [3.0] * 4
    rl.barrier()
    if world.rank == 0:
        os.kill(int(open(path + ".pid").read()), signal.SIGKILL)


def test_a_stopped_straggler_is_left_out_after_the_timeout(tmp_path):
    _spawn(_straggler_left_out, 4, str(tmp_path / "straggler"))


def _twice(rank, path):
    x = np.ones(100)
    for victim in (4, 1):              # old-world rank 4, then old-world rank 1
        if rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        with pytest.raises(rl.PeerFailure):
            while True:
                rl.all_reduce(x, timeout=20)
        rl.shrink(timeout=20)
    world = rl.new_group(None)         # (a subgroup of the twice-shrunk world)
    assert rl.get_world_size() == 3 and world.ranks == tuple(r for r in range(5) if r not in (1, 4))
    y = np.array([float(rank)])
    rl.all_reduce(y)
    assert y[0] == 0 + 2 + 3
    open(f"{path}.{rank}", "w").write("ok")


def test_shrink_twice(tmp_path):
    path = str(tmp_path / "twice")
    with pytest.raises(rl.ProcessFailed):
        rl.spawn(_twice, 5, args=(path,), timeout=60, keep_going=True)
    assert all(os.path.exists(f"{path}.{r}") for r in (0, 2, 3))


def _shrink_timeout_checked(rank):
    for bad in (0, -1, "5", float("nan")):
        with pytest.raises(ValueError, match="give a positive number of seconds"):
            rl.shrink(timeout=bad)
    rl.barrier(timeout=30)      # (nothing was decided: the world is whole)
    assert rl.get_world_size() == 3


def test_shrink_refuses_a_timeout_that_is_not_one():
    """shrink(timeout=0 or -1) let the first rank in decide alone at once: a world of one,
    and the three healthy others thrown out; timeout="5" raised a bare TypeError."""
    run(_shrink_timeout_checked, 3)
