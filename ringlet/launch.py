"""Start, watch and tear down ranks: ``spawn`` (a function in local processes) and
``ringlet run`` (a script, like torchrun). The launcher hosts the rendezvous store, makes
the job token, and when one rank fails stops the others and names the first failure."""
from __future__ import annotations

import glob
import hashlib
import multiprocessing as mp
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback

from .errors import RingletError
from .rendezvous import StoreServer, is_loopback, local_address_towards, new_token

GRACE = 5.0  # seconds survivors get to notice a failure and report it themselves


class ProcessFailed(RingletError):
    """A rank of a spawned job failed; ``rank`` and ``detail`` say which and why."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank} failed: {detail}")
        self.rank, self.detail = rank, detail


def _job_env(token: str, addr: str, port: int, world: int, torch_port: int = 0) -> dict:
    """ringlet's store is on RINGLET_STORE_PORT; MASTER_PORT is left free for a torch
    script's own store (torch's env:// binds it on rank 0)."""
    return {"RINGLET_TOKEN": token, "MASTER_ADDR": addr, "RINGLET_STORE_PORT": str(port),
            "MASTER_PORT": str(torch_port or _free_port(addr)), "WORLD_SIZE": str(world),
            "RINGLET_STORE_HOSTED": "1"}


def _free_port(addr: str) -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1" if is_loopback(addr) else "", 0))
        return s.getsockname()[1]


def _sweep_shm(token: str) -> None:
    """Remove any segment a rank created but did not live to unlink."""
    job = hashlib.sha256(token.encode()).hexdigest()[:12]
    for path in glob.glob(f"/dev/shm/ringlet-{job}-*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


# -- spawn --------------------------------------------------------------------------------
def _spawn_child(fn, rank, nprocs, args, env, backend, errq):
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs))
    split = os.environ.get("RINGLET_HOST_ID_SPLIT")
    if split:  # emulate two hosts on one machine (TCP between them, shm inside)
        os.environ["RINGLET_HOST_ID"] = "hostA" if rank < int(split) else "hostB"
    from . import runtime
    try:
        runtime.init(backend=backend)
        fn(rank, *args)
        runtime.destroy()
    except BaseException as exc:
        errq.put((rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def spawn(fn, nprocs: int, args=(), backend: str | None = None, timeout: float | None = None,
          start_method: str = "fork", env: dict | None = None) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` local ranks, each already inside
    ``ringlet.init``. Returns when all succeed; otherwise stops the rest and raises
    ProcessFailed naming the first rank that failed and its error. ``timeout`` bounds the
    whole job (seconds)."""
    if nprocs < 1:
        raise ValueError("spawn: nprocs must be >= 1")
    token = new_token()
    server = StoreServer("127.0.0.1", 0, token)
    job_env = _job_env(token, "127.0.0.1", server.port, nprocs)
    job_env.update(env or {})
    ctx = mp.get_context(start_method)
    errq = ctx.SimpleQueue()
    procs = [ctx.Process(target=_spawn_child, args=(fn, r, nprocs, args, job_env, backend, errq),
                         daemon=False) for r in range(nprocs)]
    try:
        for p in procs:
            p.start()
        failures = _watch([p.sentinel for p in procs], lambda i: procs[i].exitcode, timeout,
                          lambda i: procs[i].kill(), lambda i: procs[i].terminate())
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        server.close()
        _sweep_shm(token)
    if failures:
        reports = {}
        while not errq.empty():
            r, msg, _tb = errq.get()
            reports[r] = msg
        rank, code = _first_failure(failures, reports)
        detail = _describe_exit(code)
        if rank in reports:
            detail = reports[rank]
        raise ProcessFailed(rank, detail)


def _watch(sentinels, exitcode, timeout, kill, terminate):
    """Wait for all processes; on the first failure give the others GRACE seconds to
    notice and report it, then stop them. Returns the failures as (rank, exit code) in the
    order seen, leaving out ranks this launcher stopped itself."""
    from multiprocessing.connection import wait
    live = dict(enumerate(sentinels))
    failures = []
    fail_time = None
    deadline = None if timeout is None else time.monotonic() + timeout
    while live:
        ready = wait(list(live.values()), timeout=0.5)
        for i, s in list(live.items()):
            if s in ready:
                code = exitcode(i)
                if code is None:
                    continue
                del live[i]
                if code != 0 and fail_time != float("inf"):
                    failures.append((i, code))
                    fail_time = fail_time or time.monotonic()
        now = time.monotonic()
        if deadline is not None and now > deadline and not failures:
            failures.append((min(live), -signal.SIGALRM))
            fail_time = now
        if fail_time is not None and live and now - fail_time > GRACE:
            for i in live:
                terminate(i)
            time.sleep(0.5)
            for i in live:
                kill(i)
            fail_time = float("inf")
    return failures


def _first_failure(failures, reports=None):
    """The rank to blame: one that died of a signal it was not sent beats one that exited
    with an error, and a PeerFailure points at the peer it names."""
    if not failures:
        return None
    failed = {r for r, _ in failures}
    for rank, msg in (reports or {}).items():
        if msg.startswith("PeerFailure: rank "):
            named = int(msg.split()[2])
            if named in failed and named != rank:
                return next(f for f in failures if f[0] == named)
    killed = [f for f in failures if f[1] < 0]
    return killed[0] if killed else failures[0]


# -- ringlet run --------------------------------------------------------------------------
def run_main(argv) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="ringlet run", description="Start ranks of a ringlet job "
                                 "(like torchrun): each runs SCRIPT with RANK, WORLD_SIZE, "
                                 "LOCAL_RANK, MASTER_ADDR, MASTER_PORT and a job token set.")
    ap.add_argument("-n", "--nproc-per-node", type=int, required=True, help="ranks on this node")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=0,
                    help="store port (default: a free one; required with --nnodes > 1)")
    ap.add_argument("--backend", default=None, help="sets RINGLET_BACKEND for the ranks")
    ap.add_argument("-m", dest="module", action="store_true", help="run SCRIPT as a module")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.nproc_per_node < 1 or a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        ap.error("need -n >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes")
    world = a.nproc_per_node * a.nnodes
    token = os.environ.get("RINGLET_TOKEN")
    if a.nnodes > 1:
        if not token:
            ap.error("multi-node jobs need the same RINGLET_TOKEN exported on every node, e.g. "
                     "export RINGLET_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')")
        if not a.master_port:
            ap.error("multi-node jobs need --master-port")
    token = token or new_token()
    server = None
    port = a.master_port
    if a.node_rank == 0:
        bind = "127.0.0.1" if is_loopback(a.master_addr) else local_address_towards(a.master_addr, port or 1)
        server = StoreServer(bind, port, token)
        port = server.port
    env = dict(os.environ)
    env.update(_job_env(token, a.master_addr, port, world,
                        a.master_port + 1 if a.master_port else 0))
    env["LOCAL_WORLD_SIZE"] = str(a.nproc_per_node)
    if a.backend:
        env["RINGLET_BACKEND"] = a.backend
    errdir = f"/tmp/ringlet-run-{os.getpid()}-{hashlib.sha256(token.encode()).hexdigest()[:8]}"
    os.makedirs(errdir, mode=0o700, exist_ok=True)
    procs = []
    try:
        for local in range(a.nproc_per_node):
            rank = a.node_rank * a.nproc_per_node + local
            e = dict(env, RANK=str(rank), LOCAL_RANK=str(local),
                     RINGLET_ERROR_FILE=os.path.join(errdir, str(rank)))
            # Not "-m ringlet.launch": the package imports that module first, and runpy
            # warns about running a module that is already imported.
            cmd = [sys.executable, "-c", _CHILD, "-m" if a.module else "-s", a.script, *a.args]
            procs.append(subprocess.Popen(cmd, env=e))
        failures = _watch([_PopenSentinel(p) for p in procs], lambda i: procs[i].poll(), None,
                          lambda i: procs[i].kill(), lambda i: procs[i].terminate())
        if not failures:
            return 0
        local, code = _first_failure(failures)
        rank = a.node_rank * a.nproc_per_node + local
        detail = _describe_exit(code)
        try:
            with open(os.path.join(errdir, str(rank))) as f:
                detail = f.read().strip() or detail
        except OSError:
            pass
        print(f"ringlet run: rank {rank} failed first: {detail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if server is not None:
            server.close()
        _sweep_shm(token)
        import shutil
        shutil.rmtree(errdir, ignore_errors=True)


class _PopenSentinel:
    """Lets multiprocessing.connection.wait watch a subprocess through a pidfd."""

    def __init__(self, proc):
        self.fd = os.pidfd_open(proc.pid)

    def fileno(self):
        return self.fd


# sys.path[0] as "-m" would set it: the launch directory, absolute (a rank may chdir).
_CHILD = ("import os, sys; sys.path[0] = os.getcwd(); "
          "from ringlet.launch import _child_main; _child_main(sys.argv[1:])")


def _child_main(argv) -> None:
    """Run a rank's script; on an uncaught exception leave a one-line summary for the
    launcher before the traceback is printed."""
    mode, target, rest = argv[0], argv[1], argv[2:]
    sys.argv = [target, *rest]
    try:
        if mode == "-m":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _record(f"SystemExit: {exc.code}")
        raise
    except BaseException as exc:
        _record(f"{type(exc).__name__}: {exc}")
        raise


def _record(line: str) -> None:
    path = os.environ.get("RINGLET_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            f.write(line.splitlines()[0] if line else line)

