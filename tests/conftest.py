import glob
import os

import pytest

import ringlet as rl

JOB_TIMEOUT = 90.0


def run(fn, n, *args, backend=None, env=None, timeout=JOB_TIMEOUT):
    """Run fn(rank, *args) on n real local ranks; any rank's failure fails the test."""
    rl.spawn(fn, n, args=args, backend=backend, env=env, timeout=timeout)


@pytest.fixture(autouse=True)
def no_leftover_shm():
    """Every test must leave nothing of any ringlet job under /dev/shm."""
    before = set(glob.glob("/dev/shm/ringlet-*"))
    yield
    left = set(glob.glob("/dev/shm/ringlet-*")) - before
    assert not left, f"leftover shared memory: {sorted(left)}"


@pytest.fixture(params=["auto", "tcp"])
def backend(request):
    return request.param


def two_hosts(n):
    """Environment that makes ranks [0, n/2) host A and the rest host B."""
    return {"RINGLET_HOST_ID_SPLIT": str(n // 2)}
