"""Rendezvous: how ranks find each other and prove they belong to the job.

* ``handshake_server`` / ``handshake_client``: mutual HMAC-SHA256 challenge-response on
  the job token; used by the store and by every rank-to-rank TCP connection.
* ``StoreServer`` / ``TCPStore``: a small key-value store (set, get-with-wait, add,
  wait-for-count) over authenticated TCP, hosted by the launcher or by rank 0.
* ``FileStore``: the same operations on a private directory (``file://path``).
* ``env_world``: rank, world size, local rank and master address from the variables of
  torchrun, Open MPI, PMI/PMIx or SLURM.
* ``job_token``: RINGLET_TOKEN, else one derived from a per-user secret and the launcher's
  job id, so ranks started by torchrun, mpirun or srun agree on it with no extra step.
* ``SignedStore``: the store's operations on a torch.distributed (c10d) store, which has no
  authentication, every value signed with the job token.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import socketserver
import struct
import threading
import time

from .errors import AuthenticationError, RingletError, TimeoutError

log = logging.getLogger("ringlet")

MAGIC = b"RNGL1"
NONCE = 32
MAX_FRAME = 64 << 20  # a store value larger than this is refused, never allocated


# -- authentication ------------------------------------------------------------------------
def _mac(token: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(token, role + a + b, hashlib.sha256).digest()


_CHUNK = 1 << 20


def recv_exact(sock: socket.socket, n: int) -> bytes:
    if n > _CHUNK:
        # Never allocate on the sender's word: a header may claim any size, so the buffer
        # grows only with the bytes that actually come (at most 1 MiB per read).
        parts, got = [], 0
        while got < n:
            part = sock.recv(min(n - got, _CHUNK))
            if not part:
                raise ConnectionError("connection closed mid-message")
            parts.append(part)
            got += len(part)
        return b"".join(parts)
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the other side closed the connection")
        got += k
    return bytes(buf)


#: seconds a connecting side has to prove the token, in all (each read's timeout alone let
#: a stranger dripping a byte every 8 s hold its connection, and a thread, for good)
HANDSHAKE_SECONDS = 10.0


def _recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes (a handshake's few) by ``deadline`` (time.monotonic), else socket.timeout."""
    parts, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise socket.timeout
            sock.settimeout(left)
            part = sock.recv(n - got)
        except socket.timeout:
            raise socket.timeout(f"the handshake took over {HANDSHAKE_SECONDS:g} s") from None
        if not part:
            raise ConnectionError("the other side closed the connection")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def handshake_server(sock: socket.socket, token: bytes, payload: bytes = b"") -> bytes:
    """Challenge the connecting side; return the payload it sent after proving the token
    (within HANDSHAKE_SECONDS in all). Raises AuthenticationError on a wrong or missing
    token, OSError (socket.timeout) on a slow one."""
    deadline = time.monotonic() + HANDSHAKE_SECONDS
    nonce_s = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + nonce_s)
    head = _recv_by(sock, len(MAGIC) + NONCE + 32 + 4, deadline)
    if head[:len(MAGIC)] != MAGIC:
        raise AuthenticationError("peer does not speak the ringlet protocol")
    nonce_c = head[len(MAGIC):len(MAGIC) + NONCE]
    mac_c = head[len(MAGIC) + NONCE:len(MAGIC) + NONCE + 32]
    if not hmac.compare_digest(mac_c, _mac(token, b"client", nonce_s, nonce_c)):
        raise AuthenticationError("wrong job token")
    (plen,) = struct.unpack("<I", head[-4:])
    if plen > 4096:
        raise AuthenticationError("oversized handshake payload")
    their = _recv_by(sock, plen, deadline)
    sock.sendall(_mac(token, b"server", nonce_c, nonce_s) + struct.pack("<I", len(payload)) + payload)
    return their


def handshake_client(sock: socket.socket, token: bytes, payload: bytes = b"") -> bytes:
    head = recv_exact(sock, len(MAGIC) + NONCE)
    if head[:len(MAGIC)] != MAGIC:
        raise AuthenticationError("server does not speak the ringlet protocol")
    nonce_s = head[len(MAGIC):]
    nonce_c = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + nonce_c + _mac(token, b"client", nonce_s, nonce_c)
                 + struct.pack("<I", len(payload)) + payload)
    try:
        reply = recv_exact(sock, 36)
    except ConnectionError as exc:
        raise AuthenticationError("the other side refused our job token (is RINGLET_TOKEN "
                                  "the same on every rank?)") from exc
    if not hmac.compare_digest(reply[:32], _mac(token, b"server", nonce_c, nonce_s)):
        raise AuthenticationError("server failed to prove the job token")
    (plen,) = struct.unpack("<I", reply[32:])
    if plen > 4096:
        raise AuthenticationError("oversized handshake payload")
    return recv_exact(sock, plen)


def new_token() -> str:
    return secrets.token_hex(32)


# -- the TCP store -------------------------------------------------------------------------
_SET, _GET, _ADD, _WAITGE = 1, 2, 3, 4
REFUSED_KEY = b"refused"   # "<count> <address>" of connections that failed the token
_OK, _MISSING = 0, 1


class _Data:
    def __init__(self):
        self.kv: dict[bytes, bytes] = {}
        self.cond = threading.Condition()


def _client_gone(sock: socket.socket) -> bool:
    """True when the other side has closed the connection (without consuming input)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        server: StoreServer = self.server  # type: ignore[assignment]
        sock = self.request
        sock.settimeout(10.0)
        try:
            handshake_server(sock, server.token)
        except (AuthenticationError, OSError, ConnectionError) as exc:
            with server.data.cond:   # for ranks waiting on the one refused (why_absent)
                server.refused += 1
                n = server.refused
                server.data.kv[REFUSED_KEY] = f"{n} {self.client_address[0]}".encode()
            # (a few, then one line in a hundred: a flood of strangers must not flood the log)
            if n <= 3 or n % 100 == 0:
                log.warning("ringlet store: refused connection from %s: %s%s",
                            self.client_address, exc,
                            f" ({n} refused so far; one in 100 is logged)" if n > 3 else "")
            return
        sock.settimeout(None)
        data = server.data
        try:
            while True:
                head = sock.recv(9, socket.MSG_WAITALL)
                if len(head) < 9:
                    return
                op, klen, vlen = struct.unpack("<BII", head)
                if klen > 4096 or vlen > MAX_FRAME or op not in (_SET, _GET, _ADD, _WAITGE):
                    log.warning("ringlet store: dropped malformed request from %s", self.client_address)
                    return
                key = recv_exact(sock, klen)
                val = recv_exact(sock, vlen)
                if op == _SET:
                    with data.cond:
                        data.kv[key] = val
                        data.cond.notify_all()
                    self._reply(_OK, b"")
                elif op == _ADD:
                    with data.cond:
                        cur = int(data.kv.get(key, b"0")) + int(val)
                        data.kv[key] = str(cur).encode()
                        data.cond.notify_all()
                    self._reply(_OK, str(cur).encode())
                else:  # GET or WAITGE: val carries "timeout" or "timeout,count"
                    parts = val.split(b",")
                    # Whatever a client sends: WAITGE needs its ",count", and a NaN
                    # timeout would make the wait loop below spin forever.
                    if len(parts) != (2 if op == _WAITGE else 1):
                        raise ValueError("malformed wait argument")
                    wait = float(parts[0])
                    if wait != wait:
                        raise ValueError("NaN wait")
                    deadline = time.monotonic() + wait
                    need = int(parts[1]) if op == _WAITGE else None
                    with data.cond:
                        while True:
                            cur = data.kv.get(key)
                            if cur is not None and (need is None or int(cur) >= need):
                                break
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break
                            data.cond.wait(min(left, 1.0))
                            # A waiter whose client has gone stops waiting: a long or
                            # infinite wait must not outlive its connection.
                            if _client_gone(sock):
                                return
                    if cur is not None and (need is None or int(cur) >= need):
                        self._reply(_OK, cur)
                    else:
                        self._reply(_MISSING, cur or b"")
        except (OSError, ValueError, ConnectionError):
            return

    def _reply(self, status: int, value: bytes):
        self.request.sendall(struct.pack("<BI", status, len(value)) + value)


class StoreServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """Key-value store served from a background thread; every connection must prove
    the job token. Bind to loopback unless ranks on other hosts must reach it."""
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default listen backlog (5) overflows in a burst of connections (every
    # rank of a large job starting at once, or strangers knocking), and each dropped SYN
    # costs its client a 1 s retransmission.
    request_queue_size = 1024

    def __init__(self, host: str, port: int, token: str):
        self.token = token.encode()
        self.data = _Data()
        self.refused = 0
        super().__init__((host, port), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, name="ringlet-store", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def close(self):
        self.shutdown()
        self.server_close()


class TCPStore:
    """Client of a StoreServer."""
    ANSWER_MIN = 5.0     # seconds an answer may take, however short the job's timeout

    def __init__(self, host: str, port: int, token: str, timeout: float = 60.0):
        self.timeout = timeout
        deadline = time.monotonic() + timeout
        last = None
        while True:  # the server may not be up yet
            try:
                sock = socket.create_connection((host, port), timeout=min(10.0, timeout))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                handshake_client(sock, token.encode())
                sock.settimeout(None)
                break
            except AuthenticationError:
                raise
            except (OSError, ConnectionError) as exc:
                last = exc
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not reach the rendezvous store at {host}:{port} "
                                       f"within {timeout:.0f} s ({last}); is rank 0 or the launcher "
                                       f"running, and MASTER_ADDR/MASTER_PORT right?") from exc
                time.sleep(0.05)
        self.sock = sock
        self.where = f"{host}:{port}"
        self.lock = threading.Lock()
        self.broken = None      # why the connection is no use any more

    def _call(self, op: int, key: str, val: bytes, wait: float = 0.0) -> tuple[int, bytes]:
        k = key.encode()
        # (no more than the job's timeout for an answer: a store out of reach had shrink
        # and destroy each wait 30 s a call, 125 s in all past a 20 s timeout)
        answer = min(30.0, max(self.ANSWER_MIN, self.timeout))
        with self.lock:
            if self.broken:
                raise RingletError(self.broken)
            self.sock.settimeout(wait + answer if op in (_GET, _WAITGE) else answer)
            try:
                self.sock.sendall(struct.pack("<BII", op, len(k), len(val)) + k + val)
                status, n = struct.unpack("<BI", recv_exact(self.sock, 5))
                return status, recv_exact(self.sock, n)
            except socket.timeout as exc:
                # Its answer may come later, and be read as the next call's: the connection
                # is done with, and every later call fails at once.
                self.broken = (f"the rendezvous store at {self.where} did not answer within "
                               f"{answer:g} s: is the network to its host down?")
                self.close()
                raise RingletError(self.broken) from exc
            except (OSError, ConnectionError) as exc:
                self.broken = f"lost the rendezvous store at {self.where}: {exc}"
                raise RingletError(self.broken) from exc

    def set(self, key: str, value: bytes) -> None:
        self._call(_SET, key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        t = self.timeout if timeout is None else timeout
        status, val = self._call(_GET, key, f"{t}".encode(), t)
        if status != _OK:
            raise TimeoutError(f"rendezvous: key {key!r} did not appear within {t:.1f} s")
        return val

    def try_get(self, key: str) -> bytes | None:
        status, val = self._call(_GET, key, b"0", 0)
        return val if status == _OK else None

    def add(self, key: str, delta: int) -> int:
        return int(self._call(_ADD, key, str(delta).encode())[1])

    def wait_count(self, key: str, count: int, timeout: float | None = None) -> int:
        t = self.timeout if timeout is None else timeout
        status, val = self._call(_WAITGE, key, f"{t},{count}".encode(), t)
        if status != _OK:
            have = int(val) if val else 0
            raise TimeoutError(f"rendezvous: only {have} of {count} ranks reached {key!r} "
                               f"within {t:.1f} s")
        return int(val)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def wait_for_ranks(store, prefix: str, world_size: int, timeout: float, me: int,
                   check=None) -> list:
    """Every rank's value under ``prefix<rank>``; on timeout a TimeoutError naming the
    ranks that did not join and the likely cause. ``check(rank, value)`` sees each value
    as it comes (and may raise: a rank launched for another world need not wait)."""
    deadline = time.monotonic() + timeout
    out = []
    for r in range(world_size):
        try:
            out.append(store.get(f"{prefix}{r}", timeout=max(0.0, deadline - time.monotonic())))
            if check is not None:
                check(r, out[-1])
        except TimeoutError:
            missing = [q for q in range(r, world_size) if store.try_get(f"{prefix}{q}") is None]
            raise TimeoutError(f"rank {me}: init: rank(s) {missing} of {world_size} did not join "
                               f"within {timeout:g} s: {why_absent(store)}") from None
    return out


def why_absent(store) -> str:
    """The likely reason ranks did not join: the store refused someone's token, or not."""
    raw = store.try_get(REFUSED_KEY.decode())
    if raw:
        count, addr = raw.decode().split(" ", 1)
        return (f"the store refused {count} connection(s) that failed to authenticate (the "
                f"last from {addr}): a rank started with another RINGLET_TOKEN, or something "
                f"else that reached the port (a stranger's connection is refused too); if no "
                f"rank of this job runs on {addr}, they likely never started")
    return ("none failed to authenticate with the store: they likely never started or died "
            "before init (or use another MASTER_ADDR/MASTER_PORT)")


class FileStore:
    """The store's operations on a directory only this user can read (file://path)."""

    def __init__(self, path: str, timeout: float = 60.0):
        self.path = path
        self.timeout = timeout
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise RingletError(f"file store {path} must be a directory owned by you with mode 0700")

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key.replace("/", "%"))

    def set(self, key: str, value: bytes) -> None:
        tmp = self._file(key) + f".tmp{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, self._file(key))

    def try_get(self, key: str) -> bytes | None:
        try:
            with open(self._file(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def get(self, key: str, timeout: float | None = None) -> bytes:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            val = self.try_get(key)
            if val is not None:
                return val
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous: key {key!r} did not appear in {self.path}")
            time.sleep(0.005)

    def add(self, key: str, delta: int) -> int:
        import fcntl
        fd = os.open(os.path.join(self.path, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            cur = int(self.try_get(key) or b"0") + delta
            self.set(key, str(cur).encode())
            return cur
        finally:
            os.close(fd)

    def wait_count(self, key: str, count: int, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            cur = int(self.try_get(key) or b"0")
            if cur >= count:
                return cur
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous: only {cur} of {count} ranks reached {key!r}")
            time.sleep(0.005)

    def close(self):
        pass


# -- env:// --------------------------------------------------------------------------------
_RANK = ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
_SIZE = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
_LOCAL = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK",
          "SLURM_LOCALID")


def _first(env, names):
    for n in names:
        if env.get(n, "") != "":
            return int(env[n])
    return None


def env_world(env=None) -> dict:
    """Read rank, world size, local rank and master address from torchrun, Open MPI,
    PMI/PMIx or SLURM variables (the first family present wins, in that order). Without
    MASTER_ADDR/MASTER_PORT: SLURM's first node (else this host) and a port derived from
    the launcher's job id, so concurrent jobs of mpirun or srun do not collide."""
    env = os.environ if env is None else env
    rank, size = _first(env, _RANK), _first(env, _SIZE)
    port = env.get("RINGLET_STORE_PORT") or env.get("MASTER_PORT")
    return {"rank": rank, "world_size": size, "local_rank": _first(env, _LOCAL),
            "master_addr": env.get("MASTER_ADDR") or _slurm_first_node(env) or "127.0.0.1",
            "master_port": int(port) if port else job_port(env)}


def job_port(env=None) -> int:
    """A port every rank of the job computes alike (29500 when no launcher names the job),
    and its successor (torch's store): both below Linux's default ephemeral range (32768
    on), from which the kernel gives outgoing connections their local ports - one such
    connection on the port would make the store's bind fail (EADDRINUSE)."""
    job = launcher_job_id(env)
    if job is None:
        return 29500
    return 20000 + int.from_bytes(hashlib.sha256(job.encode()).digest()[:4], "little") % 12766


def torch_env(env=None) -> dict:
    """The variables torch.distributed's env:// needs (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT) for a job started by mpirun or srun, which set none of them:
    a torch script then runs unchanged. Empty when they are set or no launcher is known.
    torch's store gets the port after ringlet's own (a script may use both)."""
    env = os.environ if env is None else env
    if env.get("RANK") or env.get("WORLD_SIZE"):
        return {}
    w = env_world(env)
    if w["rank"] is None or w["world_size"] is None:
        return {}
    out = {"RANK": str(w["rank"]), "WORLD_SIZE": str(w["world_size"]),
           "MASTER_ADDR": w["master_addr"], "MASTER_PORT": str(w["master_port"] + 1)}
    if w["local_rank"] is not None:
        out["LOCAL_RANK"] = str(w["local_rank"])
    return {k: v for k, v in out.items() if not env.get(k)}


def _slurm_first_node(env) -> str | None:
    """The first host of SLURM's node list ("n[01-04,07],m2" -> "n01")."""
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodes or not env.get("SLURM_PROCID"):
        return None
    head = nodes.split(",")[0] if "[" not in nodes.split(",")[0] else nodes.split("]")[0]
    if "[" in head:
        prefix, ranges = head.split("[", 1)
        return prefix + ranges.split(",")[0].split("-")[0]
    return head


def is_loopback(host: str) -> bool:
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def local_address_towards(host: str, port: int) -> str:
    """The local interface address that routes to ``host`` (bind only where needed)."""
    if is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


# -- the job token when no launcher of ours set one -----------------------------------------
# Variables naming the job, per launcher (first family present wins); a job's ranks share them.
_JOB_IDS = (("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"),
            ("SLURM_JOB_ID", "SLURM_STEP_ID"),
            ("PMIX_NAMESPACE",), ("OMPI_MCA_ess_base_jobid",), ("OMPI_MCA_orte_ess_jobid",),
            ("PMI_JOBID",))


def launcher_job_id(env=None) -> str | None:
    """The launcher's name for this job (torchrun, SLURM, Open MPI/PMIx, PMI), or None."""
    env = os.environ if env is None else env
    for names in _JOB_IDS:
        if env.get(names[0]):
            return "|".join(f"{n}={env.get(n, '')}" for n in names)
    return None


def secret_path(env=None) -> str:
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "ringlet", "secret")


def user_secret(path: str | None = None) -> bytes:
    """This user's ringlet secret, created on first use (mode 0600): every rank of a job on
    one host, or on a cluster with a shared home, reads the same one."""
    path = path or secret_path()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(new_token())
    except FileExistsError:
        pass
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RingletError(f"{path} must be owned by you and readable only by you "
                           f"(chmod 600 {path}); it keys every job token derived from it")
    for _ in range(100):   # another rank may be writing it this very moment
        with open(path, "rb") as f:
            secret = f.read().strip()
        if secret:
            return secret
        time.sleep(0.01)
    raise RingletError(f"{path} is empty: delete it and run again")


def job_token(env=None) -> tuple[str | None, str]:
    """(token, where it came from): RINGLET_TOKEN, else the user's secret mixed with the
    launcher's job id; (None, why not) when neither exists."""
    env = os.environ if env is None else env
    if env.get("RINGLET_TOKEN"):
        return env["RINGLET_TOKEN"], "RINGLET_TOKEN"
    job = launcher_job_id(env)
    if job is None:
        return None, "no RINGLET_TOKEN and no launcher job id (torchrun, srun, mpirun)"
    return derive_token(job, env), f"derived from {secret_path(env)} and the job id {job}"


def derive_token(job: str, env=None) -> str:
    """The job token of job ``job`` for this user: only holders of the secret can make it."""
    secret = user_secret(secret_path(env))
    return hmac.new(secret, b"ringlet job " + job.encode(), hashlib.sha256).hexdigest()


def disagree_hint(source: str) -> str:
    """What to check when ranks do not prove the same token."""
    if source == "RINGLET_TOKEN":
        return "is RINGLET_TOKEN the same on every rank?"
    return (f"ranks could not agree on the job token ({source}): a rank on another host or "
            f"user has another secret file, or saw another job id; export the same "
            f"RINGLET_TOKEN on every rank")


class SignedStore:
    """ringlet's store operations (set, get, try_get, add, wait_count) on a c10d store.

    That store authenticates nobody, so each value carries an HMAC of (key, value) under
    the job token and a value without a valid one is refused: a stranger who can reach the
    store can delay or stop the job but not steer it. Counters are not signed (c10d adds
    them itself): a forged count can end a wait early, before the signed values it waits
    for exist (reading those still waits), or take a ticket (shrink's decider's: then no
    survivor decides, and shrink times out). Under ringlet's own store (``ringlet run``,
    ``rl.spawn``, ``tcp://``) every connection proves the token first."""

    def __init__(self, store, token: str, prefix: str = "ringlet/", timeout: float = 60.0,
                 source: str = "RINGLET_TOKEN"):
        self.store, self.key, self.prefix = store, token.encode(), prefix
        self.timeout, self.source = timeout, source

    def _sign(self, key: str, value: bytes) -> bytes:
        return hmac.new(self.key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self.prefix + key, self._sign(key, value) + value)

    def _open(self, key: str, raw: bytes) -> bytes:
        mac, value = raw[:32], raw[32:]
        if not hmac.compare_digest(mac, self._sign(key, value)):
            raise AuthenticationError(f"rendezvous: store key {key!r} is not signed with this "
                                      f"rank's job token; {disagree_hint(self.source)}")
        return value

    def get(self, key: str, timeout: float | None = None) -> bytes:
        import datetime
        t = self.timeout if timeout is None else timeout
        try:
            self.store.wait([self.prefix + key], datetime.timedelta(seconds=t))
        except RuntimeError as exc:   # c10d's DistStoreError on timeout
            if "imeout" not in str(exc) and "timed out" not in str(exc):
                raise RingletError(f"lost the rendezvous store: {exc}") from exc
            raise TimeoutError(f"rendezvous: key {key!r} did not appear within {t:.1f} s") from None
        return self._open(key, self.store.get(self.prefix + key))

    def try_get(self, key: str) -> bytes | None:
        if not self.store.check([self.prefix + key]):
            return None
        return self._open(key, self.store.get(self.prefix + key))

    def add(self, key: str, delta: int) -> int:
        try:
            return int(self.store.add(self.prefix + key, delta))
        except RuntimeError as exc:   # c10d's errors: the store's host has gone
            raise RingletError(f"lost the rendezvous store: {exc}") from exc

    def wait_count(self, key: str, count: int, timeout: float | None = None) -> int:
        t = self.timeout if timeout is None else timeout
        deadline, pause = time.monotonic() + t, 0.0005
        while True:
            cur = self.add(key, 0)
            if cur >= count:
                return cur
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous: only {cur} of {count} ranks reached {key!r} "
                                   f"within {t:.1f} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def close(self):
        # Not ours to close (torch's, or torchrun's agent's), and no longer ours to use.
        # The last one is kept: rank 0 hosts it, and a next init_process_group on the same
        # port shares its server (torch's stores are multi-tenant) - let go, a rank quicker
        # to init again could reach it just before it went, and lose it. (Every one was
        # kept before: 20 init/destroy cycles held 20.)
        global _LAST_CLOSED
        _LAST_CLOSED, self.store = self.store, _ClosedStore()


_LAST_CLOSED = None


class _ClosedStore:
    def __getattr__(self, name):
        raise RingletError("the rendezvous store was closed (destroy() has run)")


def torchrun_store(env=None):
    """torchrun's own store (on MASTER_PORT, which its agent holds), or None when not
    under torchrun. ringlet joins it rather than binding the port a second time."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import datetime
    import torch.distributed as dist   # present: torchrun is part of torch
    return dist.TCPStore(env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"]),
                         is_master=False, timeout=datetime.timedelta(seconds=60))
