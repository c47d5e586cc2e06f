"""Start, watch and tear down ranks: ``spawn`` (a function in local processes) and
``ringlet run`` (a script, like torchrun). The launcher hosts the rendezvous store, makes
the job token, and when one rank fails stops the others and names the first failure.
Ranks never outlive their launcher: a signal to it reaches every rank, and a rank whose
launcher died (even of SIGKILL) dies too."""
from __future__ import annotations

import collections
import ctypes
import multiprocessing as mp
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback

from .errors import RingletError
from .rendezvous import StoreServer, is_loopback, local_address_towards, new_token

GRACE = 5.0  # seconds survivors get to notice a failure and report it themselves
TRACEBACK_LINES = 400   # a rank's traceback is held back at most this long, to go out whole


class ProcessFailed(RingletError):
    """A rank of a spawned job failed; ``rank`` and ``detail`` say which and why."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank} failed: {detail}")
        self.rank, self.detail = rank, detail


def _job_env(token: str, addr: str, port: int, world: int, torch_port: int = 0) -> dict:
    """ringlet's store is on RINGLET_STORE_PORT; MASTER_PORT is left free for a torch
    script's own store (torch's env:// binds it on rank 0)."""
    return {"RINGLET_TOKEN": token, "MASTER_ADDR": addr, "RINGLET_STORE_PORT": str(port),
            "MASTER_PORT": str(torch_port or free_port(addr)), "WORLD_SIZE": str(world),
            "RINGLET_STORE_HOSTED": "1"}


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at ``addr``, for a server another process binds soon.
    Taken below the kernel's ephemeral range: a port from bind(("", 0)) comes from that
    range, and any connect() made meanwhile, by any process, may be given it before the
    server binds it (EADDRINUSE)."""
    import random
    import socket
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    host = "127.0.0.1" if is_loopback(addr) else ""
    pick = random.Random()          # seeded afresh: forked callers must not pick alike
    for _ in range(200):
        port = pick.randrange(max(1024, low // 2), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket() as s:      # that range is taken: let the kernel choose
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent(parent: int) -> None:
    """Make this process die when ``parent`` (the launcher) does, however it ends: the
    kernel's parent-death signal on Linux, else a thread watching for a new parent."""
    if sys.platform.startswith("linux"):
        try:
            if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0:
                if os.getppid() != parent:   # it died before we asked
                    os._exit(1)
                return                       # (1: PR_SET_PDEATHSIG)
        except (OSError, AttributeError):
            pass

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="ringlet-parent-watch", daemon=True).start()


#: the exit code ``_watch`` records for the job whose time ran out (no signal was sent)
TIMED_OUT = -signal.SIGALRM


def _describe_exit(code: int) -> str:
    if code == TIMED_OUT:     # (it had said "killed by SIGALRM", which nothing sent)
        return "still running when the job's timeout ran out (stopped by the launcher)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


# -- spawn --------------------------------------------------------------------------------
def _spawn_child(fn, rank, nprocs, args, env, backend, errq, parent):
    die_with_parent(parent)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs))
    split = os.environ.get("RINGLET_HOST_ID_SPLIT")
    if split:  # emulate hosts on one machine (TCP between them, shm inside): "2" gives
        # ranks 0-1 one host and the rest another; "2,3" ranks 0-1, 2, 3- three
        host = sum(rank >= int(b) for b in split.split(","))
        os.environ["RINGLET_HOST_ID"] = f"host{chr(ord('A') + host)}"
    from . import runtime
    try:
        runtime.init(backend=backend)
        runtime._S.spawned = True   # fn may call init() again, as under torch's mp.spawn
        fn(rank, *args)
        runtime.destroy()
    except BaseException as exc:
        errq.put((rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def spawn(fn, nprocs: int, args=(), backend: str | None = None, timeout: float | None = None,
          start_method: str = "fork", env: dict | None = None, keep_going: bool = False) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` local ranks, each already inside
    ``ringlet.init`` (``fn`` may call ``init()`` again for the same world, as with torch's
    ``mp.spawn``; it returns that world). Returns when all succeed; otherwise stops the rest and raises
    ProcessFailed naming the first rank that failed and its error. ``timeout`` bounds the
    whole job (seconds). ``keep_going``: a failed rank does not stop the others (a job
    that survives it with ``rl.shrink``); ProcessFailed is raised once all have ended."""
    if nprocs < 1:
        raise ValueError("spawn: nprocs must be >= 1")
    token = (env or {}).get("RINGLET_TOKEN") or new_token()
    server = StoreServer("127.0.0.1", 0, token)
    job_env = _job_env(token, "127.0.0.1", server.port, nprocs)
    job_env.update(env or {})
    ctx = mp.get_context(start_method)
    errq = ctx.SimpleQueue()
    procs = [ctx.Process(target=_spawn_child, args=(fn, r, nprocs, args, job_env, backend, errq,
                                                 os.getpid()),
                         daemon=False) for r in range(nprocs)]
    stopped: list = []
    end = None if timeout is None else time.time() + timeout
    try:
        for p in procs:
            p.start()
        failures = _watch([p.sentinel for p in procs], lambda i: procs[i].exitcode, timeout,
                          lambda i: procs[i].kill(), lambda i: procs[i].terminate(),
                          stopped=stopped, keep_going=keep_going)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        server.close()
    if failures:
        reports = {}
        while not errq.empty():
            r, msg, _tb = errq.get()
            reports[r] = msg
        rank, code = _first_failure(failures, reports,
                                    left=[i for i, p in enumerate(procs) if p.exitcode == 0])
        detail = _describe_exit(code) if code else LEFT_EARLY
        if code == TIMED_OUT and stopped:
            with server.data.cond:
                kv = dict(server.data.kv)
            rank, detail = _out_of_time(_waiting_at(kv, stopped, end), stopped, timeout)
        if rank in reports:
            detail = reports[rank]
        raise ProcessFailed(rank, detail)


#: how recent a rank's state must be to say it waits in a ringlet call: a wait publishes
#: it once it has lasted REPORT_AFTER (1 s), then at most once a second (runtime.py,
#: _publish_state), from a thread of its own that a crowded host may hold back a while
FRESH_STATE = 3.5


def _waiting_at(kv: dict, ranks, at: float) -> dict:
    """{rank: what it waited for inside ringlet} for those of ``ranks`` the job's store
    shows waiting at wall-clock time ``at``: in a call (its latest state, published by a
    long wait, runtime._publish_state, still fresh), in destroy() (it left: the others
    have not), or in init() while another rank never joined."""
    import json
    latest, left, joined = {}, set(), set()
    for key, raw in kv.items():
        m = re.fullmatch(rb"g(\d+)/(state|left|joined/[^/]+)/(\d+)", key)
        if not m or int(m.group(3)) not in ranks:
            continue
        gen, what, r = int(m.group(1)), m.group(2), int(m.group(3))
        if what == b"left":
            left.add(r)
        elif what != b"state":
            joined.add(r)
        elif gen >= latest.get(r, (-1, b""))[0]:
            latest[r] = (gen, raw)
    waiting = {}
    for r, (_, raw) in latest.items():
        try:
            st = json.loads(raw)
        except ValueError:
            continue
        if isinstance(st, dict) and st.get("waiting") and \
                at - float(st.get("at", 0.0)) <= FRESH_STATE:
            waiting[r] = str(st["waiting"])
    for r in left - set(waiting):
        waiting[r] = f"rank {r}: destroy(), waiting for the other ranks to leave"
    absent = sorted(set(ranks) - joined)
    for r in (joined - set(waiting) - left) if absent else ():
        waiting[r] = f"rank {r}: init(), waiting for rank(s) {absent} to join"
    return waiting


def _out_of_time(waiting: dict, running: list, timeout: float) -> tuple[int, str]:
    """(rank to blame, why) when the job's time ran out with ``running`` ranks still
    running: the first that was not waiting inside a ringlet call (the others waited for
    it), else the first of them, with what each waited in."""
    outside = sorted(r for r in running if r not in waiting)
    inside = "; ".join(waiting[r] for r in sorted(waiting))
    why = f"still running when the job's timeout ({timeout:g} s) ran out"
    if outside:
        others = f"; the others waited inside ringlet ({inside})" if inside else ""
        more = f" (as was rank {outside[1]})" if len(outside) == 2 else \
            f" (as were ranks {', '.join(map(str, outside[1:]))})" if outside[1:] else ""
        return outside[0], (f"{why}, outside any ringlet call: busy in its own code, or hung "
                            f"there{more}{others}; stopped by the launcher")
    return min(running), (f"{why}, every rank waiting inside ringlet ({inside}); stopped "
                          f"by the launcher")


def _watch(sentinels, exitcode, timeout, kill, terminate, grace=GRACE, stopped=None,
           keep_going=False):
    """Wait for all processes; on the first failure give the others ``grace`` seconds to
    notice and report it, then stop them (listed in ``stopped``) unless ``keep_going``.
    Returns the failures as (rank, exit code) in the order seen, leaving out ranks this
    launcher stopped itself."""
    from multiprocessing.connection import wait
    live = dict(enumerate(sentinels))
    failures = []
    fail_time, out_of_time = None, False
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
        if deadline is not None and now > deadline and live and fail_time != float("inf"):
            if not failures:
                failures.append((min(live), TIMED_OUT))
            fail_time = fail_time or now
            out_of_time = True     # stopped now: no grace on top of the job's time
            keep_going = False
        if fail_time is not None and live and not keep_going and (
                out_of_time or now - fail_time > grace):
            for i in live:
                terminate(i)
                if stopped is not None:
                    stopped.append(i)
            time.sleep(0.5)
            for i in live:
                kill(i)
            fail_time, out_of_time = float("inf"), False
    return failures


#: what a rank that exited normally is blamed for, when its peers failed for want of it
LEFT_EARLY = ("exited normally (status 0) while the other ranks still needed it in their "
              "calls: every rank must make the calls the others make with it before it exits")


def _first_failure(failures, reports=None, first=0, left=()):
    """The rank to blame: one that died of a signal it was not sent beats one that exited
    with an error, and a PeerFailure points at the peer it names (``first``: the global
    rank of local rank 0, as ranks are named) - even one that exited normally (in
    ``left``), returned with status 0."""
    if not failures:
        return None
    failed = {r for r, _ in failures}
    for rank, msg in (reports or {}).items():
        # ("PeerFailure: rank 0: all_reduce #2 of group world (ring): rank 3 failed: ...":
        # the call's rank, then the peer it names)
        m = re.match(r"PeerFailure: (?:rank \d+: [^:]*: )?rank (\d+) failed", msg)
        if m:
            named = int(m.group(1)) - first
            if named in failed and named != rank:
                return next(f for f in failures if f[0] == named)
            if named in left:
                return named, 0
    killed = [f for f in failures if f[1] < 0]
    return killed[0] if killed else failures[0]


# -- ringlet run --------------------------------------------------------------------------
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _Signalled(BaseException):
    """The launcher got a stop signal: pass it on to every rank."""

    def __init__(self, signum: int):
        self.signum = signum


def _on_signal(signum, frame):
    raise _Signalled(signum)


def _run_parser():
    import argparse
    ap = argparse.ArgumentParser(
        prog="ringlet run", usage="ringlet run -n N [options] SCRIPT [ARGS ...]   (ARGS are optional)",
        description="Start ranks of a ringlet job (like torchrun): each runs SCRIPT with its "
                    "optional ARGS, and RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT "
                    "and a job token set. SIGTERM, SIGINT and SIGHUP reach every rank; ranks "
                    "die with the launcher.")
    ap.add_argument("-n", "--nproc-per-node", type=int, required=True, help="ranks on this node")
    ap.add_argument("--nnodes", type=int, default=1,
                    help="nodes in the job, each running this command (default 1)")
    ap.add_argument("--node-rank", type=int, default=0,
                    help="this node's index, 0 to nnodes - 1 (default 0: it holds the store)")
    ap.add_argument("--master-addr", default="127.0.0.1",
                    help="address of node 0, where the store runs (default 127.0.0.1: one "
                         "node; give node 0's address on every node of a multi-node job)")
    ap.add_argument("--master-port", type=int, default=0,
                    help="store port (default: a free one; required with --nnodes > 1)")
    ap.add_argument("--backend", choices=("auto", "tcp", "shm"), default=None,
                    help="sets RINGLET_BACKEND for the ranks")
    ap.add_argument("--link-rate", metavar="RATE", default=None,
                    help="the link between nodes, e.g. 1gbit or 10gbit (sets RINGLET_LINK_RATE): "
                         "algorithm=auto then prices inter-node messages at that rate")
    ap.add_argument("--no-tag-output", dest="tag", action="store_false",
                    help="do not prefix each line a rank prints with its rank (as mpirun "
                         "--tag-output does; on by default)")
    ap.add_argument("--grace", type=float, default=GRACE,
                    help=f"seconds ranks get to exit after a failure or a signal before they are "
                         f"killed (default {GRACE:g})")
    ap.add_argument("--keep-going", action="store_true",
                    help="a failed rank does not stop the others (for jobs that survive it "
                         "with rl.shrink())")
    ap.add_argument("--trace", metavar="DIR", default=None,
                    help="record every rank's calls and messages into DIR (sets RINGLET_TRACE); "
                         "then `ringlet trace merge DIR -o job.json` for Perfetto")
    ap.add_argument("-m", dest="module", action="store_true", help="run SCRIPT as a module")
    # SCRIPT is checked below: argparse would name the optional ARGS as required too
    ap.add_argument("script", metavar="SCRIPT", nargs="?",
                    help="the Python file each rank runs (a module with -m)")
    ap.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                    help="optional arguments passed on to SCRIPT")
    return ap


def _interpreter(name: str) -> str | None:
    """The executable ``name`` resolves to when it names a Python interpreter (``python``,
    ``python3.11``, a path to one), else None."""
    if not re.fullmatch(r"python[0-9.]*", os.path.basename(name)):
        return None
    path = name if os.sep in name else shutil.which(name)
    return path if path and os.path.isfile(path) and os.access(path, os.X_OK) else None


def _skip_interpreter(a, ap) -> None:
    """mpirun's habit, ``ringlet run -n 2 python train.py`` (or ``python -m pkg``): the
    interpreter named before the script is the one the launcher runs ranks under, so it
    is dropped; another one is refused (each rank runs under this launcher's
    interpreter), before any rank starts."""
    named = _interpreter(a.script)
    if os.path.realpath(named) != os.path.realpath(sys.executable):
        ap.error(f"{a.script!r} ({named}) is another Python than the one this launcher runs "
                 f"ranks under ({sys.executable}): leave it out (ringlet run -n N SCRIPT "
                 f"runs SCRIPT under {sys.executable}), or install ringlet in that Python "
                 f"and start the launcher with it ({a.script} -m ringlet run ...)")
    rest = a.args
    if rest[:1] == ["-m"] and len(rest) > 1:
        a.module, a.script, a.args = True, rest[1], rest[2:]
    elif rest and not rest[0].startswith("-"):
        a.script, a.args = rest[0], rest[1:]
    else:
        ap.error(f"after {a.script!r}, expected SCRIPT or -m MODULE (interpreter options "
                 f"such as {rest[0]!r} are not passed on)" if rest else
                 f"no SCRIPT after {a.script!r}: ringlet run -n N SCRIPT [ARGS ...]")


def run_main(argv) -> int:
    ap = _run_parser()
    a = ap.parse_args(argv)
    if a.script is None:
        ap.error("no SCRIPT given: ringlet run -n N SCRIPT [ARGS ...]")
    if not a.module and _interpreter(a.script):
        _skip_interpreter(a, ap)
    if a.nproc_per_node < 1 or a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        ap.error("need -n >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes")
    if not a.grace >= 0:       # (nan passed "< 0": the survivors were never stopped)
        ap.error(f"--grace must be a number of seconds >= 0, got {a.grace}")
    world = a.nproc_per_node * a.nnodes
    token = os.environ.get("RINGLET_TOKEN")
    if a.nnodes > 1:
        if not token:
            ap.error("multi-node jobs need the same RINGLET_TOKEN exported on every node, e.g. "
                     "export RINGLET_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')")
        if not a.master_port:
            ap.error("multi-node jobs need --master-port")
    if not 0 <= a.master_port <= 65534:     # (+1: the job's second port)
        ap.error(f"--master-port must be a TCP port, 1 to 65534 (0: a free one), got "
                 f"{a.master_port}")
    if not a.module and not os.path.isfile(a.script):   # (before N ranks each say so)
        ap.error(f"no such script: {a.script!r} (or give a module with -m)")
    token = token or new_token()
    env = _options_env(a, ap)
    first = a.node_rank * a.nproc_per_node
    job = _Job(first, a.tag)
    server = None
    previous = {s: signal.signal(s, _on_signal) for s in STOP_SIGNALS}
    try:
        port = a.master_port
        if a.node_rank == 0:
            try:
                bind = "127.0.0.1" if is_loopback(a.master_addr) else \
                    local_address_towards(a.master_addr, port or 1)
                server = StoreServer(bind, port, token)
            except OSError as exc:     # (socket.gaierror too: an address that does not resolve)
                ap.error(f"cannot start the job's store at --master-addr {a.master_addr} "
                         f"--master-port {port or '(a free one)'}: {exc.strerror or exc} (is "
                         f"the port taken by another job, or the address not this node's?)")
            port = server.port
        env.update(_job_env(token, a.master_addr, port, world,
                            a.master_port + 1 if a.master_port else 0))
        for local in range(a.nproc_per_node):
            job.start(local, a.module, a.script, a.args, env)
        stopped: list = []
        failures = _watch([_PopenSentinel(p) for p in job.procs], lambda i: job.procs[i].poll(),
                          None, lambda i: job.procs[i].kill(), lambda i: job.procs[i].terminate(),
                          a.grace, stopped, a.keep_going)
        if not failures:
            return 0
        left = [i for i, p in enumerate(job.procs) if p.returncode == 0]
        local, code = _first_failure(failures, job.reports(), first, left)
        if a.keep_going and all(p.returncode == 0 for i, p in enumerate(job.procs)
                                if i not in {f for f, _ in failures}):
            job.survived([f for f, _ in failures])
        else:
            job.summary(local, _describe_exit(code) if code else LEFT_EARLY, stopped, a.grace)
        # the first failure's own status, as mpirun passes it on (a signal: 128 + it)
        return code if 0 < code < 256 else 128 - code if code < 0 else 1
    except _Signalled as sig:
        name = signal.Signals(sig.signum).name
        for s in STOP_SIGNALS:      # a second signal: kill at once
            signal.signal(s, lambda *_: job.kill())
        stopped = job.stop(sig.signum, a.grace)
        print(f"ringlet run: got {name}: passed it to every rank"
              + (f"; killed rank(s) {stopped} still running {a.grace:g} s later" if stopped else ""),
              file=sys.stderr)
        return 128 + sig.signum
    finally:
        job.kill()
        job.close()
        if server is not None:
            server.close()
        for s, h in previous.items():
            signal.signal(s, h)


def _options_env(a, ap) -> dict:
    """The ranks' environment: this one, with what the options set."""
    env = dict(os.environ)
    env["LOCAL_WORLD_SIZE"] = str(a.nproc_per_node)
    if "OMP_NUM_THREADS" not in env and a.nproc_per_node > 1:
        # As torchrun does: each rank's torch (and OpenBLAS) would start a thread per core,
        # and ranks that share the cores fight over them - under 2 ranks on 2 cores an 8 MiB
        # all_reduce through torch took 16 ms, 2.4 with 1 thread. A share of the cores each.
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // a.nproc_per_node))
    if a.backend:
        env["RINGLET_BACKEND"] = a.backend
    if a.link_rate:
        from .cost.profile import parse_rate
        try:
            parse_rate(a.link_rate)
        except ValueError as exc:
            ap.error(str(exc))
        env["RINGLET_LINK_RATE"] = a.link_rate
    if a.trace:
        env["RINGLET_TRACE"] = os.path.abspath(a.trace)
    return env


class _Job:
    """The ranks of this node: their processes, their tagged output, and the one-line
    error report each leaves on a pipe for the summary."""

    def __init__(self, first: int, tag: bool):
        self.first, self.tag = first, tag
        self.procs: list = []
        self.pipes: list = []          # read end of each rank's report pipe
        self.tails: list = []          # last lines each rank wrote to stderr
        self.pumps: list = []
        self.lines: dict = {}          # local rank -> its error report
        self.lock = threading.Lock()

    def start(self, local: int, module: bool, script: str, args, env) -> None:
        rank = self.first + local
        r, w = os.pipe()
        e = dict(env, RANK=str(rank), LOCAL_RANK=str(local), RINGLET_REPORT_FD=str(w),
                 RINGLET_LAUNCHER_PID=str(os.getpid()))
        # Not "-m ringlet.launch": the package imports that module first, and runpy
        # warns about running a module that is already imported.
        cmd = [sys.executable, "-c", _CHILD, "-m" if module else "-s", script, *args]
        out = subprocess.PIPE if self.tag else None
        # Its own process group: a Ctrl-C reaches it once, through this launcher. Not its
        # own session: with the kernel's autogroups each session is scheduled as one
        # group, and ranks in groups of their own wait longer for each other on a busy
        # host (two all_reduces of 32 KiB, 4 ranks on 2 cores, load 9: 2.2-2.5 ms against
        # 0.09-0.12 in one session).
        try:
            p = subprocess.Popen(cmd, env=e, pass_fds=(w,), stdout=out, stderr=out,
                                 process_group=0)
        finally:
            os.close(w)
        self.procs.append(p)
        self.pipes.append(r)
        tail = collections.deque(maxlen=5)
        self.tails.append(tail)
        if self.tag:
            for src, dst, keep in ((p.stdout, sys.stdout, None), (p.stderr, sys.stderr, tail)):
                t = threading.Thread(target=self._pump, args=(rank, src, dst, keep), daemon=True)
                t.start()
                self.pumps.append(t)

    def _pump(self, rank: int, src, dst, keep) -> None:
        """Copy a rank's output line by line, each prefixed with its rank. A traceback goes
        out whole, up to its exception's line: those of ranks failing at once had been
        interleaved line by line."""
        prefix = f"[{rank}] ".encode()
        out = getattr(dst, "buffer", None)
        held: list = []

        def write(lines) -> None:
            text = b"".join(prefix + line for line in lines)
            with self.lock:
                try:
                    if out is not None:
                        out.write(text)
                        out.flush()
                    else:
                        dst.write(text.decode(errors="replace"))
                        dst.flush()
                except (OSError, ValueError):
                    pass    # our own output is gone (| head): keep draining, or the rank blocks
        for line in iter(src.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            if keep is not None and line.strip():
                keep.append(line.decode(errors="replace").rstrip())
            if held or line.startswith(b"Traceback (most recent call last):"):
                held.append(line)
                # (its frames are indented; the first line that is not names the exception)
                if len(held) > 1 and not line[:1].isspace() or len(held) >= TRACEBACK_LINES:
                    write(held)
                    held = []
                continue
            write((line,))
        if held:
            write(held)
        src.close()

    def reports(self) -> dict:
        """Each rank's one-line error report (local rank -> line), for those that left one;
        read once its process has ended."""
        for i, fd in enumerate(self.pipes):
            if fd is None or self.procs[i].poll() is None:
                continue
            os.set_blocking(fd, False)
            try:
                text = os.read(fd, 65536).decode(errors="replace").strip()
            except OSError:
                text = ""
            if text:
                self.lines[i] = text.splitlines()[-1]
            os.close(fd)
            self.pipes[i] = None
        return self.lines

    def summary(self, first_local: int, exit_text: str, stopped, grace: float) -> None:
        """One report: which rank failed first and with what, then what each other saw."""
        for t in self.pumps:
            t.join(timeout=2.0)
        reports = self.reports()
        detail = reports.get(first_local) or exit_text
        verb = "failed first" if self.procs[first_local].returncode else "left first"
        lines = [f"ringlet run: rank {self.first + first_local} {verb}: {detail}"]
        for i, p in enumerate(self.procs):
            if i == first_local:
                continue
            if i in stopped:
                seen = f"still running {grace:g} s later; stopped by the launcher"
            elif p.returncode == 0:
                seen = "exited normally"
            else:
                seen = reports.get(i) or (self.tails[i][-1] if self.tails[i] else
                                          _describe_exit(p.returncode))
            lines.append(f"ringlet run:   then rank {self.first + i}: {seen}")
        # Ranks that timed out waiting for a rank that never reported, which the launcher
        # then found still running: that one is where to look (the first timeout named
        # only a peer it waited on).
        hung = sorted(self.first + i for i in stopped
                      if any(f"rank {self.first + i} did not report" in r
                             for r in reports.values()))
        if hung:
            lines.append(f"ringlet run: rank(s) {hung} did not report to the ranks that timed "
                         f"out, and were still running: busy outside ringlet, or hung - look "
                         f"there first")
        print("\n".join(lines), file=sys.stderr)

    def survived(self, lost) -> None:
        """The report of a --keep-going job whose other ranks all finished: who was lost."""
        for t in self.pumps:
            t.join(timeout=2.0)
        reports = self.reports()
        lines = [f"ringlet run: rank {self.first + i} was lost: "
                 f"{reports.get(i) or _describe_exit(self.procs[i].returncode)}" for i in lost]
        went_on = [self.first + i for i in range(len(self.procs)) if i not in lost]
        lines.append(f"ringlet run: the other ranks ({', '.join(map(str, went_on))}) kept going "
                     "and exited normally; the exit status is the first lost rank's"
                     if went_on else "ringlet run: no rank kept going; the exit status is "
                     "the first lost rank's")
        print("\n".join(lines), file=sys.stderr)

    def stop(self, signum: int, grace: float) -> list:
        """Pass a signal to every rank; kill those still running ``grace`` s later."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.02)
        late = [self.first + i for i, p in enumerate(self.procs) if p.poll() is None]
        self.kill()
        return late

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def close(self) -> None:
        for t in self.pumps:
            t.join(timeout=2.0)
        for fd in self.pipes:
            if fd is not None:
                os.close(fd)
        self.pipes = [None] * len(self.pipes)


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
    """Run a rank's script (dying with the launcher); on an uncaught exception leave a
    one-line summary for the launcher before the traceback is printed."""
    die_with_parent(int(os.environ["RINGLET_LAUNCHER_PID"]))
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
    fd = os.environ.get("RINGLET_REPORT_FD")
    if fd:
        try:
            os.write(int(fd), ((line.splitlines() or [""])[0] + "\n").encode())
        except OSError:
            pass
