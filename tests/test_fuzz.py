"""Fuzzing (issue 6, item 6): random, truncated and malformed frames against the
rendezvous store and a rank's data path — no crash, no hang, no unbounded memory, and a
job running alongside completes with correct results.

1a. the store, unauthenticated (5 000 connections + 100 slow-loris): random bytes,
    partial handshakes, MAGIC + garbage, replayed and role-confused MACs, huge claimed
    lengths; a well-behaved client is checked throughout.
1b. the store, authenticated (5 000 requests): random op codes, oversized key/value
    claims, truncated bodies, unparsable arguments, clients leaving mid-wait — every
    answer checked against a model of the store; 16 clients claiming 64 MiB values.
2a. a rank's TCP listener while a job initializes (two emulated hosts; ~5 000
    connections, and the job's store knocked on at the same time): the job completes
    with exact results. After init no rank listens any more (checked), so this is the
    only time the data port can be reached by a stranger.
2b. the TCP packet parser after authentication (``TcpPeer`` over a loopback pair,
    20 000 packets over ~1 800 fresh peers): random kinds, negative and huge lengths, DATA
    for unknown messages or splitting elements, oversized EAGER, CTS for unknown messages,
    reused message ids, ABORT with garbage, truncated headers and payloads.
2c. the cases the fuzzers found, pinned; allocation traced under claims of up to 2^63
    bytes; progress() under a flood.
2d. three engine-level findings (undecodable fingerprints, a flood holding a waiter past
    its deadline, a silent stranger stalling init), pinned now that they are fixed.

Everything is seeded (deterministic) and bounded by socket timeouts and deadlines. Run
with -s to see the counts, time and memory of each fuzzer.
"""
import errno
import fcntl
import json
import logging
import random
import re
import select
import socket
import struct
import termios
import threading
import time
import tracemalloc

import numpy as np
import pytest

import ringlet as rl
from ringlet import launch
from ringlet.errors import CollectiveMismatch, PeerFailure
from ringlet.rendezvous import MAGIC, MAX_FRAME, NONCE, StoreServer, TCPStore, _mac, handshake_client
from ringlet.transport.protocol import (ABORT, BYE, CTS, CTS_OK, CTS_REJECT, DATA, EAGER, HEADER,
                                        HEADER_SIZE, KINDS, PAD, RTS, RTS_STREAM, RecvRequest,
                                        SendRequest, peer_failure)
from ringlet.transport.tcp import TcpPeer
from conftest import run, two_hosts

SEED = 6_2024
TOKEN = "fuzz-" + "5a" * 30
BANNER = len(MAGIC) + NONCE            # what a server says before the client proves anything
HEAD = len(MAGIC) + NONCE + 32 + 4     # the client's handshake head
RSS_BOUND_MIB = 200                    # growth allowed for the whole of one fuzz test
N_STORE_UNAUTH = 5000
N_STORE_AUTH = 5000
N_PACKETS = 20_000
N_LISTENER = 5000                      # while the job's listeners are up (plus whatever
                                       # lands while the last rank connects)
STATS: dict = {}                       # filled by the tests, printed at the end (-s)


# -- helpers --------------------------------------------------------------------------------
def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _hwm_mib() -> int:
    with open("/proc/self/status") as f:
        return [int(line.split()[1]) >> 10 for line in f if line.startswith("VmHWM:")][0]


class Rss:
    """Peak resident-set growth of this process, sampled."""

    def __init__(self):
        self.base = self.peak = rss_mib()

    def sample(self) -> float:
        self.peak = max(self.peak, rss_mib())
        return self.peak - self.base


@pytest.fixture(autouse=True, scope="module")
def _report_stats():
    yield
    for name, st in STATS.items():   # shown with -s
        print(f"\nfuzz {name}: {st}")


@pytest.fixture
def quiet():
    """Thousands of refusals are each logged as a warning: keep them out of the output."""
    lg = logging.getLogger("ringlet")
    old = lg.level
    lg.setLevel(logging.CRITICAL)
    yield
    lg.setLevel(old)


def _rst_close(s: socket.socket) -> None:
    """Close with RST: no TIME_WAIT left behind by tens of thousands of connections."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    s.close()


def _recv_n(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def _shut_wr(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_WR)
    except OSError as exc:   # the server hung up first (ENOTCONN after its RST): fine
        if exc.errno != errno.ENOTCONN:
            raise


def _read_to_eof(s: socket.socket, got: bytes = b"") -> bytes:
    """Everything until the other side closes. A socket.timeout (the server hung) is not
    caught: it fails the test."""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got
            got += chunk
    except (ConnectionResetError, BrokenPipeError):
        return got


class RecordingStore(StoreServer):
    """A StoreServer that records exceptions escaping a connection handler."""

    def __init__(self, *a, **k):
        self.errors: list = []
        super().__init__(*a, **k)

    def handle_error(self, request, client_address):
        import traceback
        self.errors.append(traceback.format_exc())


def _wait_threads(limit: int, seconds: float = 5.0) -> int:
    deadline = time.monotonic() + seconds
    while threading.active_count() > limit and time.monotonic() < deadline:
        time.sleep(0.02)
    return threading.active_count()


# -- unauthenticated frames -----------------------------------------------------------------
UNAUTH_KINDS = ("random", "oversized", "magic+junk", "magic+huge-plen", "cut-head",
                "wrong-token", "nothing", "text", "replayed-mac", "role-confused",
                "bad-magic-good-mac", "good-mac-cut", "good-mac-huge-plen", "good-mac-short-payload")
NEEDS_BANNER = {"replayed-mac", "role-confused", "bad-magic-good-mac", "good-mac-cut",
                "good-mac-huge-plen", "good-mac-short-payload"}


def unauth_frame(rng: random.Random, kind: str, nonce_s: bytes | None, token: bytes) -> bytes:
    """One frame from a client that does not (fully) prove the token."""
    nonce_c = rng.randbytes(NONCE)
    if kind == "random":
        return rng.randbytes(rng.randrange(0, 200))
    if kind == "oversized":
        return rng.randbytes(rng.randrange(HEAD, 70_000))
    if kind == "magic+junk":
        return MAGIC + rng.randbytes(rng.randrange(0, 200))
    if kind == "magic+huge-plen":
        return (MAGIC + nonce_c + rng.randbytes(32)
                + struct.pack("<I", rng.choice([4097, 1 << 20, 0xFFFFFFFF, rng.randrange(1 << 32)]))
                + rng.randbytes(rng.randrange(0, 100)))
    if kind == "cut-head":
        head = MAGIC + nonce_c + rng.randbytes(32) + struct.pack("<I", 1)
        return head[:rng.randrange(0, HEAD)]
    if kind == "wrong-token":
        other = rng.randbytes(16)
        ns = nonce_s or rng.randbytes(NONCE)
        return MAGIC + nonce_c + _mac(other, b"client", ns, nonce_c) + struct.pack("<I", 1) + b"0"
    if kind == "nothing":
        return b""
    if kind == "text":
        return rng.choice([b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b'{"op": "set", "key": "k"}\n',
                           b"RNGL0" + b"\0" * 80, b"\r\n" * 50, b"SSH-2.0-OpenSSH_9.6\r\n",
                           b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\0" * 64])
    # The kinds below know the real token but still must not get in.
    assert nonce_s is not None
    if kind == "replayed-mac":      # a proof computed for another connection's challenge
        return MAGIC + nonce_c + _mac(token, b"client", rng.randbytes(NONCE), nonce_c) + b"\0" * 4
    if kind == "role-confused":     # the server's proof offered as the client's
        return MAGIC + nonce_c + _mac(token, b"server", nonce_s, nonce_c) + b"\0" * 4
    good = _mac(token, b"client", nonce_s, nonce_c)
    if kind == "bad-magic-good-mac":
        return b"RNGL2" + nonce_c + good + b"\0" * 4
    if kind == "good-mac-cut":      # the right proof, then the connection ends mid-head
        return (MAGIC + nonce_c + good)[:rng.randrange(HEAD - 36, HEAD - 1)]
    if kind == "good-mac-huge-plen":
        return MAGIC + nonce_c + good + struct.pack("<I", rng.choice([4097, 1 << 30, 0xFFFFFFFF]))
    if kind == "good-mac-short-payload":
        return MAGIC + nonce_c + good + struct.pack("<I", 1000) + rng.randbytes(rng.randrange(0, 999))
    raise AssertionError(kind)


def knock(port: int, rng: random.Random, token: bytes, kind: str | None = None,
          timeout: float = 5.0) -> tuple[str, bytes]:
    """One unauthenticated connection: send a frame, half-close, read to EOF.
    Returns (kind, everything the server sent)."""
    kind = kind or rng.choice(UNAUTH_KINDS)
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.settimeout(timeout)
        got = b""
        banner_first = kind in NEEDS_BANNER or rng.random() < 0.5
        try:
            if banner_first:
                got = _recv_n(s, BANNER)
            frame = unauth_frame(rng, kind, got[len(MAGIC):] if len(got) == BANNER else None, token)
            if kind == "nothing" and rng.random() < 0.5:
                return kind, got               # connect and vanish (RST)
            if frame:
                s.sendall(frame)
            _shut_wr(s)
        except (ConnectionResetError, BrokenPipeError):
            return kind, got
        return kind, _read_to_eof(s, got)
    finally:
        _rst_close(s)


def assert_refused(kind: str, got: bytes) -> None:
    """The server may say its banner, and nothing more: no proof, no data."""
    assert len(got) <= BANNER, f"{kind}: server sent {len(got)} bytes to a stranger: {got[:80]!r}"
    assert MAGIC.startswith(got) or got.startswith(MAGIC), (kind, got)


# -- 1a. store, unauthenticated --------------------------------------------------------------
@pytest.mark.timeout(60)
def test_store_survives_unauthenticated_garbage(quiet):
    rng = random.Random(SEED)
    server = RecordingStore("127.0.0.1", 0, TOKEN)
    rss = Rss()
    t0 = time.monotonic()
    threads0 = threading.active_count()
    good = TCPStore("127.0.0.1", server.port, TOKEN, timeout=5)
    stalled = []
    kinds: dict = {}
    try:
        # Slow-loris strangers hold connections open mid-handshake the whole time. (A burst
        # of connections must not be throttled by a tiny listen backlog either: with
        # socketserver's default of 5, these 100 took 13 s of SYN retransmissions.)
        t_burst = time.monotonic()
        for i in range(100):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall((MAGIC + rng.randbytes(NONCE + 32))[:rng.randrange(0, HEAD)])
            stalled.append(s)
        assert time.monotonic() - t_burst < 8, "100 connections took seconds to be accepted"
        counter = 0
        for i in range(N_STORE_UNAUTH):
            kind, got = knock(server.port, rng, TOKEN.encode())
            assert_refused(kind, got)
            kinds[kind] = kinds.get(kind, 0) + 1
            if i % 25 == 0:   # a well-behaved client is served, correctly, throughout
                val = rng.randbytes(rng.randrange(0, 300))
                good.set(f"good/{i}", val)
                assert good.get(f"good/{i}", timeout=5) == val
                counter += 1
                assert good.add("good/n", 1) == counter
            if i % 1000 == 999:   # and new well-behaved clients still get in
                fresh = TCPStore("127.0.0.1", server.port, TOKEN, timeout=5)
                assert fresh.get("good/n", timeout=5) == str(counter).encode()
                fresh.close()
            if i % 100 == 0:
                assert rss.sample() < RSS_BOUND_MIB, f"RSS grew {rss.sample():.0f} MiB"
        assert good.try_get("nope") is None and good.get(f"good/{0}") is not None
        for s in stalled:
            _rst_close(s)
        stalled = []
        left = _wait_threads(threads0 + 1)
        assert left <= threads0 + 1, f"{left - threads0 - 1} handler threads outlived their connections"
        assert not server.errors, server.errors[0]
        assert server.refused >= N_STORE_UNAUTH, (server.refused, N_STORE_UNAUTH)
    finally:
        for s in stalled:
            _rst_close(s)
        good.close()
        server.close()
    took = time.monotonic() - t0
    STATS["store unauthenticated"] = dict(inputs=N_STORE_UNAUTH + 100, seconds=round(took, 1),
                                          rss_growth_mib=round(rss.sample(), 1), kinds=kinds)
    assert took < 45


# -- 1b. store, authenticated ------------------------------------------------------------------
_SET, _GET, _ADD, _WAITGE = 1, 2, 3, 4
_OK, _MISSING = 0, 1
DROP, CLOSED = "drop", "closed"


class StoreModel:
    """What the store must answer, decided with the same parsers the server uses."""

    def __init__(self):
        self.kv: dict = {}

    def expect(self, op, key, val):
        """(status, value) for a reply, DROP when the server must hang up, or None when
        the request would wait (the generator avoids those)."""
        if op == _SET:
            self.kv[key] = val
            return _OK, b""
        if op == _ADD:
            try:
                enc = str(int(self.kv.get(key, b"0")) + int(val)).encode()
            except ValueError:
                return DROP
            self.kv[key] = enc
            return _OK, enc
        parts = val.split(b",")
        if len(parts) != (2 if op == _WAITGE else 1):
            return DROP
        try:
            wait = float(parts[0])
            need = int(parts[1]) if op == _WAITGE else None
            if wait != wait:
                return DROP
            cur = self.kv.get(key)
            ok = cur is not None and (need is None or int(cur) >= need)
        except ValueError:
            return DROP
        if ok:
            return _OK, cur
        return (_MISSING, cur or b"") if wait <= 0.002 else None


FUZZ_KEYS = [b"", b"k", b"n", b"x/y", b"\0\xff", b"g0/addr/0", b"9" * 40, b"k" * 4096]


class AuthClient:
    def __init__(self, port):
        self.port = port
        self.s = None

    def sock(self):
        if self.s is None:
            self.s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            self.s.settimeout(5)
            handshake_client(self.s, TOKEN.encode())
        return self.s

    def drop(self):
        if self.s is not None:
            _rst_close(self.s)
            self.s = None


def auth_request(rng: random.Random, model: StoreModel):
    """One request after a correct handshake: (label, bytes to send, outcome)."""
    r = rng.random()
    key = rng.choice(FUZZ_KEYS) if rng.random() < 0.8 else rng.randbytes(rng.randrange(0, 64))
    if r < 0.08:   # an op code the store does not have
        op = rng.choice([0, 5, 6, 7, 0x7F, 0x80, 0xFF])
        body = key + rng.randbytes(rng.randrange(0, 64))
        return "bad-op", struct.pack("<BII", op, len(key), len(body) - len(key)) + body, DROP
    if r < 0.14:   # a key longer than the store allows (claimed; the server must not read it)
        klen = rng.choice([4097, 1 << 20, 0xFFFFFFFF, rng.randrange(4097, 1 << 32)])
        return "huge-key", struct.pack("<BII", rng.randrange(1, 5), klen, 0) + rng.randbytes(16), DROP
    if r < 0.20:   # a value longer than MAX_FRAME
        vlen = rng.choice([MAX_FRAME + 1, 0xFFFFFFFF, rng.randrange(MAX_FRAME + 1, 1 << 32)])
        return "huge-value", struct.pack("<BII", rng.randrange(1, 5), 3, vlen) + b"abc", DROP
    if r < 0.26:   # the header itself cut short, then the client leaves
        return "cut-header", struct.pack("<BII", rng.randrange(256), 1, 1)[:rng.randrange(1, 9)], CLOSED
    if r < 0.34:   # a legal header claiming up to MAX_FRAME, the body cut short
        vlen = rng.choice([rng.randrange(1, 4096), rng.randrange(1 << 20, MAX_FRAME + 1), MAX_FRAME])
        sent = rng.randrange(0, min(vlen, 8192))
        return ("cut-body", struct.pack("<BII", rng.randrange(1, 5), len(key), vlen) + key
                + rng.randbytes(sent), CLOSED)
    if r < 0.36:   # a wait on a missing key, long or forever, and the client leaves
        wait = rng.choice([b"inf", b"1e9", b"30"])
        miss = b"missing/" + rng.randbytes(8)
        return "leave-waiting", struct.pack("<BII", _GET, len(miss), len(wait)) + miss + wait, CLOSED
    op = rng.choice([_SET, _SET, _GET, _GET, _ADD, _WAITGE])
    if op == _SET:
        n = rng.choice([0, 1, 7, rng.randrange(0, 2000), rng.randrange(0, 70_000)])
        val = rng.choice([rng.randbytes(n), str(rng.randrange(-10, 10)).encode(), b"1" * 4300])
    elif op == _ADD:
        val = rng.choice([str(rng.randrange(-100, 100)).encode(), b"", b"x", b" 7 ", b"1_0", b"1e3",
                          b"9" * 4300, b"\xff\xfe", b"0x10", b"-0"])
    elif op == _GET:
        val = rng.choice([b"0", b"0.001", b"-5", b"-inf", b"nan", b"NaN", b"", b"abc", b"1,2",
                          b"inf", b"1e308", b"\xff"])
    else:
        val = rng.choice([b"0,1", b"0.001,-3", b"0," + str(rng.randrange(-5, 50)).encode(), b"0", b"",
                          b"0,x", b"nan,1", b"0,1,2", b"inf,0", b"1e308,-1", b",", b"0,99999"])
    want = model.expect(op, key, val)
    if want is None:   # it would wait for real: ask without waiting instead
        val = b"0" + val[val.index(b",") if b"," in val else len(val):] if op == _WAITGE else b"0"
        want = model.expect(op, key, val)
    frame = struct.pack("<BII", op, len(key), len(val)) + key + val
    return f"op{op}", frame, want


@pytest.mark.timeout(60)
def test_store_survives_authenticated_garbage(quiet):
    rng = random.Random(SEED + 1)
    server = RecordingStore("127.0.0.1", 0, TOKEN)
    rss = Rss()
    t0 = time.monotonic()
    threads0 = threading.active_count()
    good = TCPStore("127.0.0.1", server.port, TOKEN, timeout=5)
    fuzz = AuthClient(server.port)
    model = StoreModel()
    labels: dict = {}
    try:
        for i in range(N_STORE_AUTH):
            label, frame, want = auth_request(rng, model)
            labels[label] = labels.get(label, 0) + 1
            s = fuzz.sock()
            try:
                s.sendall(frame)
            except (ConnectionResetError, BrokenPipeError):
                assert want == DROP, (i, label)
                fuzz.drop()
                continue
            if want == CLOSED:   # we leave mid-request: half-close (FIN) or reset (RST)
                if rng.random() < 0.5:
                    _shut_wr(s)
                fuzz.drop()
            elif want == DROP:
                rest = _read_to_eof(s)
                assert rest == b"", f"#{i} {label}: expected a hang-up, got {rest[:40]!r}"
                fuzz.drop()
            else:
                status, n = struct.unpack("<BI", _recv_n(s, 5))
                value = _recv_n(s, n)
                assert (status, value) == want, f"#{i} {label}: {(status, value[:40])} != {want}"
            if i % 25 == 0:
                val = rng.randbytes(rng.randrange(0, 300))
                good.set(f"good/{i}", val)
                assert good.get(f"good/{i}", timeout=5) == val
            if i % 100 == 0:
                assert rss.sample() < RSS_BOUND_MIB, f"RSS grew {rss.sample():.0f} MiB"
        fuzz.drop()
        # The store never allocates on a claim: 16 clients each announcing a MAX_FRAME
        # (64 MiB) value and sending nothing cost next to nothing (it used to be 1 GiB).
        before = rss_mib()
        claims = [AuthClient(server.port) for _ in range(16)]
        for c in claims:
            c.sock().sendall(struct.pack("<BII", _SET, 1, MAX_FRAME) + b"k" + b"v" * 100)
        grew, deadline = 0.0, time.monotonic() + 1.0   # the peak over a second of handling
        while time.monotonic() < deadline:
            grew = max(grew, rss_mib() - before)
            time.sleep(0.02)
        rss.sample()
        for c in claims:
            c.drop()
        assert grew < 32, f"16 claimed 64 MiB values cost {grew:.0f} MiB before any arrived"
        # Every handler of a dropped, truncated or abandoned request is gone (waits on
        # missing keys included: the client left, so the wait ends).
        left = _wait_threads(threads0 + 1)
        assert left <= threads0 + 1, f"{left - threads0 - 1} handler threads outlived their clients"
        assert not server.errors, server.errors[0]
        assert good.get("good/0", timeout=5) is not None
    finally:
        fuzz.drop()
        good.close()
        server.close()
    took = time.monotonic() - t0
    STATS["store authenticated"] = dict(inputs=N_STORE_AUTH, seconds=round(took, 1),
                                        rss_growth_mib=round(rss.sample(), 1), kinds=labels)
    assert took < 45


# -- 2a. a rank's listener while the job initializes ------------------------------------------
_ADDR = re.compile(rb"g\d+/addr/(\d+)$")


class HoldKV(dict):
    """The store's dict, holding back the other ranks' addresses from one rank (the
    last, which dials everyone) so that every other rank sits in its accept loop with its
    listener open while the fuzzer knocks; released by ``release``."""

    def __init__(self, world: int, hold_rank: int, on_all):
        super().__init__()
        self.world, self.hold_rank, self.on_all = world, hold_rank, on_all
        self.tls = threading.local()
        self.addrs: dict = {}
        self.release = threading.Event()

    def __setitem__(self, key, val):
        super().__setitem__(key, val)
        m = _ADDR.match(key)
        if m:                       # each rank's first write: learn whose connection this is
            self.tls.rank = int(m.group(1))
            self.addrs[int(m.group(1))] = json.loads(val)
            if len(self.addrs) == self.world:   # every rank has been forked and listens
                self.on_all(dict(self.addrs))

    def get(self, key, default=None):
        if (not self.release.is_set() and getattr(self.tls, "rank", None) == self.hold_rank
                and _ADDR.match(key)):
            return default
        return super().get(key, default)


def _parses_to_rank(p: bytes, world: int) -> bool:
    try:
        return int(p) in range(world)
    except ValueError:
        return False


# How long a stranger waits for a rank's answer. A listener that never answers still fails
# the test; 5 s did once in about ten full-suite runs on this 2-core VM, where 4 ranks and the
# test's own threads share the cores (not reproduced in 22 runs of this test alone, 10 of
# them with both cores loaded), so the test allows for a scheduling stall.
STRANGER_PATIENCE = 20.0


def knock_listener(host, port, rng, token: bytes, world: int) -> tuple[str, bytes]:
    """One stranger at a rank's data port: mostly unauthenticated frames; sometimes the
    right token with a rank id that is not expected (must be refused after the proof)."""
    if rng.random() < 0.8:
        kind, got = knock(port, rng, token, timeout=STRANGER_PATIENCE)
        assert_refused(kind, got)
        return kind, got
    s = socket.create_connection((host, port), timeout=STRANGER_PATIENCE)
    try:
        s.settimeout(STRANGER_PATIENCE)
        banner = _recv_n(s, BANNER)
        assert banner.startswith(MAGIC) and len(banner) == BANNER
        nonce_s, nonce_c = banner[len(MAGIC):], rng.randbytes(NONCE)
        while True:
            bogus = rng.choice([b"", b"-1", b"99", b"abc", b"1e3", b"\xff" * 3, b"4",
                                rng.randbytes(rng.randrange(0, 40)), b"9" * 4096])
            if not _parses_to_rank(bogus, world):
                break
        s.sendall(MAGIC + nonce_c + _mac(token, b"client", nonce_s, nonce_c)
                  + struct.pack("<I", len(bogus)) + bogus)
        got = _read_to_eof(s)
        if got:   # it proved itself to us (we know the token), then refused the rank id
            assert got[:32] == _mac(token, b"server", nonce_c, nonce_s)
            (plen,) = struct.unpack("<I", got[32:36])
            assert len(got) == 36 + plen and _parses_to_rank(got[36:], world), got
        return "good-token-bogus-rank", banner + got
    finally:
        _rst_close(s)


def _job_alongside(rank):
    """The job whose listeners were fuzzed: it must run, on the transports it should,
    with exactly the right results — and no data port may be left listening."""
    start = _hwm_mib()   # a forked rank inherits its parent's resident pages
    from ringlet import runtime
    p = rl.get_world_size()
    eng = runtime.engine()
    for r, peer in eng.peers.items():
        assert isinstance(peer, TcpPeer) == ((r < p // 2) != (rank < p // 2)), (rank, r, peer)
    # After init no rank keeps a listening data port: listeners close once the job is
    # connected (so the data path can only be fuzzed during init, as the parent did).
    gen = runtime._S.generation - 1
    rl.barrier()     # every rank is past init (another may still be closing its listener)
    for r in range(p):
        info = json.loads(runtime._S.store.get(f"g{gen}/addr/{r}", timeout=10))
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((info["addr"], info["port"]), timeout=2).close()
    x = np.arange(50_000, dtype=np.float64) * (rank + 1)
    rl.all_reduce(x, algorithm="ring")     # named: this is about transports, not the planner
    np.testing.assert_array_equal(x, np.arange(50_000) * sum(range(1, p + 1)))
    # A multi-fragment message across the emulated hosts (RTS/CTS/DATA).
    other = (rank + p // 2) % p
    out = np.random.default_rng(rank).integers(0, 1 << 62, size=(3 << 20) // 8)
    inn = np.empty_like(out)
    w = [rl.isend(out, other), rl.irecv(inn, other)]
    for wk in w:
        wk.wait()
    np.testing.assert_array_equal(inn, np.random.default_rng(other).integers(0, 1 << 62, size=inn.size))
    y = np.full(1000, rank, np.int64)
    rl.all_reduce(y, algorithm="hierarchical")
    assert (y == sum(range(p))).all()
    grew = _hwm_mib() - start               # nothing here was sized by a stranger's claim
    assert grew < 400, f"rank {rank}'s peak resident memory grew by {grew} MiB"


@pytest.mark.timeout(90)
def test_job_completes_while_strangers_fuzz_its_listeners_and_store(quiet):
    world, hold = 4, 3
    orig = launch.StoreServer
    state = dict(listener=0, listener_kinds={}, store=0, refused_after=0, errors=[], closed=set(),
                 servers=[])
    stop = threading.Event()
    threads = []

    def guarded(fn):
        def body(*a):
            try:
                fn(*a)
            except BaseException as exc:   # reported by the test, not lost in a thread
                import traceback
                state["errors"].append(f"{fn.__name__}: {exc!r}\n{traceback.format_exc()}")
                kv.release.set()
        return body

    @guarded
    def fuzz_listeners(addrs, server):
        rng = random.Random(SEED + 2)
        token = server.token
        # Ranks of host A accept host B's ranks (higher ranks dial lower ones); with the
        # last rank held back, their listeners stay open, accepting, until released. Host
        # B's ranks have nobody to accept (their other rank is local: shared memory).
        targets = [(r, i["addr"], i["port"]) for r, i in sorted(addrs.items()) if r < world // 2]
        t_start = time.monotonic()
        deadline = t_start + 10
        # Phase 1: host A's listeners are up and accepting (rank 2 is in, rank 3 held); knock.
        while state["listener"] < N_LISTENER and time.monotonic() < deadline:
            r, host, port = targets[state["listener"] % len(targets)]
            try:
                kind, _ = knock_listener(host, port, rng, token, world)
            except ConnectionRefusedError:
                raise AssertionError(f"rank {r}'s listener closed while the job was held, after "
                                     f"{state['listener']} knocks, {time.monotonic() - t_start:.1f} s")
            state["listener"] += 1
            state["listener_kinds"][kind] = state["listener_kinds"].get(kind, 0) + 1
        # Phase 2: let the last rank connect while the knocking goes on, until every
        # listener has closed (connection refused).
        kv.release.set()
        with server.data.cond:
            server.data.cond.notify_all()
        deadline = time.monotonic() + 30
        while len(state["closed"]) < len(targets) and time.monotonic() < deadline:
            for r, host, port in targets:
                if r in state["closed"]:
                    continue
                try:
                    knock_listener(host, port, rng, token, world)
                    state["listener"] += 1
                    state["refused_after"] += 1
                except ConnectionRefusedError:
                    state["closed"].add(r)
                except (ConnectionResetError, BrokenPipeError):
                    pass   # the listener closed under us, with our connection in its backlog

    @guarded
    def fuzz_store(server):
        rng = random.Random(SEED + 3)
        while not stop.is_set():
            try:
                kind, got = knock(server.port, rng, server.token)
            except OSError:
                if server.socket.fileno() == -1:   # spawn closed its store: the job is over
                    return
                raise
            assert_refused(kind, got)
            state["store"] += 1

    kv = None

    class Fuzzed(orig):
        def __init__(self, *a, **k):
            nonlocal kv
            super().__init__(*a, **k)
            state["servers"].append(self)

            def on_all(addrs):
                # Only now: a socket opened before a rank is forked would live on in it.
                for target, args in ((fuzz_listeners, (addrs, self)), (fuzz_store, (self,))):
                    t = threading.Thread(target=target, args=args, daemon=True)
                    threads.append(t)
                    t.start()
            kv = HoldKV(world, hold, on_all)
            self.data.kv = kv

    rss = Rss()
    t0 = time.monotonic()
    launch.StoreServer = Fuzzed
    try:
        run(_job_alongside, world, env=two_hosts(world), timeout=80)
    finally:
        launch.StoreServer = orig
        stop.set()
        if kv is not None:
            kv.release.set()
        for t in threads:
            t.join(timeout=10)
    took = time.monotonic() - t0
    assert not state["errors"], state["errors"][0]
    assert state["listener"] >= min(N_LISTENER, 1000), state   # (fewer only on a starved machine)
    assert len(state["closed"]) == world // 2, state
    server = state["servers"][0]
    # (the last few knocks may still have been in flight when spawn closed its store)
    assert server.refused >= state["store"] - 5 and state["store"] > 0, (server.refused, state["store"])
    STATS["listeners during init"] = dict(inputs=state["listener"], after_release=state["refused_after"],
                                          store_inputs=state["store"], seconds=round(took, 1),
                                          rss_growth_mib=round(rss.sample(), 1),
                                          kinds=state["listener_kinds"])




# -- 2b. the packet parser after authentication -------------------------------------------------
class FakeEngine:
    """What a Peer calls on its engine and the engine's ``calls`` (here the same object),
    recorded. A protocol violation fails the peer, as the real engine does; a mismatch
    aborts the tag (ABORT out, receives failed)."""

    def retired(self, gid):
        return False    # no world has shrunk away

    def __init__(self):
        self.violations: list = []
        self.mismatches = self.aborted_tags = self.fp_checks = 0
        self.calls = self
        self.failed: dict = {}      # (calls failed here, whose late messages are dropped)

    def protocol_violation(self, peer, why):
        self.violations.append(why)
        peer.fail(peer_failure(peer.rank, f"protocol violation ({why})"))

    def mismatch(self, tag, mine, theirs, culprit):
        self.mismatches += 1
        peer = self.peer
        peer.send_abort(tag, mine, theirs, culprit)
        peer.fail_tag(tag, CollectiveMismatch(f"fuzz: collective {tag} mismatched"))

    def unasked(self, tag, fp, rank):
        self.fp_checks += 1

    def abort_received(self, tag, sender_fp, culprit_fp, culprit, sender):
        self.aborted_tags += 1

    def peer_failed(self, rank, exc):
        pass

    def ring_doorbell(self, name):
        pass


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as lst:
        a = socket.create_connection(lst.getsockname(), timeout=5)
        b, _ = lst.accept()
    return a, b


I64 = (-(1 << 63), (1 << 63) - 1)
SIOCOUTQNSD = 0x894B      # Linux: bytes in a socket's send queue not yet sent
GUARD = 0xA5


N_FIELDS = len(HEADER.unpack(bytes(HEADER.size)))   # kind … fp2 (and newer fields, if any)


def hdr(kind, flags=0, tag=0, msgid=0, length=0, aux=0, fp1=0, fp2=0, *more) -> bytes:
    more = (more + (0,) * N_FIELDS)[:N_FIELDS - 8]
    return HEADER.pack(kind, flags, tag, msgid, length, aux, fp1, fp2, *more).ljust(HEADER_SIZE, b"\0")


class Wire:
    """An authenticated connection into a fresh TcpPeer; the other end (``a``) is ours
    to abuse. Receives are posted into guarded buffers (canaries on both sides)."""

    def __init__(self, eager: int, frag: int):
        self.a, b = tcp_pair()
        self.a.setblocking(False)
        self.a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.eager, self.frag = eager, frag
        self.eng = FakeEngine()
        self.peer = TcpPeer(self.eng, 1, b, eager=eager, frag=frag)
        self.eng.peer = self.peer
        self.recvs: list = []       # (request, guarded backing bytes)
        self.packets = 0
        if not hasattr(self, "rng"):
            self.rng = random.Random(SEED)

    def post(self, tag, nbytes, dtype=np.uint8, ufunc=None, acc=False, fp=(0, 0)) -> RecvRequest:
        back = np.full(nbytes + 128, GUARD, np.uint8)
        dst = back[64:64 + nbytes].view(dtype)
        req = RecvRequest(1, tag, dst, ufunc, np.ones_like(dst) if acc else None, fp)
        self.peer.post_recv(req)
        self.recvs.append((req, back))
        return req

    # -- driving ------------------------------------------------------------------------
    def pump(self, deadline: float) -> None:
        """Run the peer until it has read everything we wrote (or died)."""
        while True:
            moved = self.peer.progress()    # must never raise: failing the peer is the answer
            self.drain()
            self.check()
            if not moved and (self.peer.dead or self._in_flight() == 0):
                return
            assert time.monotonic() < deadline, "the peer never settles"

    def _in_flight(self) -> int:
        """Bytes we sent that the peer has not read yet."""
        if self.a.fileno() == -1 or self.peer.sock.fileno() == -1:
            return 0
        unsent = struct.unpack("i", fcntl.ioctl(self.a, SIOCOUTQNSD, b"\0" * 4))[0]
        unread = struct.unpack("i", fcntl.ioctl(self.peer.sock, termios.FIONREAD, b"\0" * 4))[0]
        return unsent + unread

    def drain(self) -> None:
        if self.a.fileno() == -1:
            return
        try:
            while self.a.recv(1 << 20):
                pass
        except (BlockingIOError, InterruptedError, ConnectionResetError):
            pass

    def feed(self, data: bytes, deadline: float) -> None:
        view, sent = memoryview(data), 0
        while sent < len(view) and not self.peer.dead:
            try:
                sent += self.a.send(view[sent:sent + (1 << 20)])
            except (BlockingIOError, InterruptedError):
                select.select([self.a], [self.a], [], 0.01)
            except (BrokenPipeError, ConnectionResetError):
                return
            self.pump(deadline)
            assert time.monotonic() < deadline, "writing one packet took too long: a hang?"
        self.pump(deadline)

    def check(self) -> None:
        """What must hold after any input whatsoever."""
        peer = self.peer
        for q in peer.unexpected.values():
            for item in q:
                if item.payload is not None:   # kept bytes are bounded by the eager limit, never by a claim
                    assert len(item.payload) <= peer.eager
        assert peer.ptarget is None or len(peer.ptarget) <= max(peer.eager, peer.frag)
        assert len(peer.incoming) <= len(self.recvs)
        assert sum(len(b) for b in peer.wpending) <= 2 * self.eager + 64 * (self.packets + 8)
        for req, back in self.recvs:   # nothing ever written outside a posted buffer
            assert (back[:64] == GUARD).all() and (back[64 + req.nbytes:] == GUARD).all()
            if isinstance(req.error, ValueError):   # refused for its size: untouched
                assert (back == GUARD).all()
        if peer.dead:
            assert isinstance(peer.dead, PeerFailure), peer.dead
            assert not peer.incoming and not peer.awaiting_cts
            for req, _ in self.recvs:
                assert req.done, "a receive outlived its peer: it would wait for its timeout"

    def finish(self, how: str, deadline: float) -> None:
        rng = self.rng
        if how == "cut-header" and not self.peer.dead:
            self.feed(hdr(EAGER, 0, 1, -1, 8)[:rng.randrange(1, HEADER_SIZE)], deadline)
        elif how == "cut-payload" and not self.peer.dead:
            self.feed(hdr(EAGER, 0, 77, -1, self.eager)
                      + rng.randbytes(rng.randrange(0, self.eager)), deadline)
        elif how == "bye" and not self.peer.dead:
            self.feed(hdr(BYE), deadline)
        if how == "rst":
            _rst_close(self.a)
        else:
            self.a.close()
        while not self.peer.dead:     # the end of the stream must be noticed, promptly
            self.pump(deadline)
            assert time.monotonic() < deadline, "the peer did not notice its connection end"
            time.sleep(0.0005)
        self.check()
        self.peer.close()


class Stream(Wire):
    """A Wire with random receives (copy and reduce, small and large) and sends posted,
    and a generator of random packets for it."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        super().__init__(*rng.choice([(64 << 10, 1 << 20), (1024, 4096), (256, 1024)]))
        e, f = self.eager, self.frag
        for tag in range(1, rng.randint(2, 6)):
            for _ in range(rng.choice([1, 1, 2])):
                nbytes = rng.choice([0, 1, 8, e - 8, e, e + 8, 3 * f + 8, 2 * f])
                dtype = rng.choice([np.uint8, np.float32, np.int64, np.complex128])
                nbytes -= nbytes % np.dtype(dtype).itemsize
                ufunc = rng.choice([None, np.add]) if dtype is not np.uint8 else None
                self.post(tag, nbytes, dtype, ufunc, ufunc is not None and rng.random() < 0.5)
        self.sends = [SendRequest(1, 1, np.zeros(e + 16, np.uint8)),      # RTS: awaits CTS 0
                      SendRequest(1, 2, np.zeros(8, np.uint8))]
        for s in self.sends:
            self.peer.post_send(s)
        self.hostile = rng.choice([0.01, 0.05, 0.2, 0.5])
        self.msgid = 0              # our RTS numbering
        self.last_sent = -1
        self.open: dict = {}        # msgid -> [nbytes, offset, itemsize] we think was matched

    # -- the packets --------------------------------------------------------------------
    def _posted(self):
        live = [r for r, _ in self.recvs if not r.done and r.msgid < 0]
        return self.rng.choice(live) if live and self.rng.random() < 0.8 else None

    def packet(self) -> tuple[str, bytes]:
        """One packet: well-formed (possibly unexpected, mismatched or the wrong size for
        its receive) with probability 1 - self.hostile, else malformed."""
        rng = self.rng
        if rng.random() < self.hostile:
            return self._malformed()
        fp = (0, 0) if rng.random() < 0.9 else (rng.randrange(1 << 40), rng.randrange(*I64))
        r = rng.random()
        if self.open and r < 0.35:
            return self._data()
        e = self.eager
        if r < 0.55:
            req = self._posted()
            tag = req.tag if req else rng.randrange(-5, 50)
            n = req.nbytes if req and req.nbytes <= e and rng.random() < 0.7 else rng.randrange(0, e + 1)
            return "eager", hdr(EAGER, 0, tag, -1, n, 0, *fp) + rng.randbytes(n)
        if r < 0.75:
            req = self._posted()
            tag = req.tag if req else rng.randrange(-5, 50)
            n = req.nbytes if req and rng.random() < 0.8 else rng.choice([e + 1, 1 << 40, I64[1]])
            msgid, self.msgid = self.msgid, self.msgid + rng.choice([1, 1, 1, 2, 1000])
            self.last_sent = msgid
            if req and n == req.nbytes and fp == (0, 0) and n > 0:
                self.open[msgid] = [n, 0, req.itemsize if req.ufunc is not None else 1]
            if rng.random() < 0.15:   # "the data is in my shared buffer at …": not over TCP
                return "rts-zero-copy", hdr(RTS, 1, tag, msgid, n, rng.randrange(*I64), *fp,
                                            rng.randrange(*I64))
            return "rts", hdr(RTS, 0, tag, msgid, n, 0, *fp)
        if r < 0.82 and 0 in self.peer.awaiting_cts:
            return "cts", hdr(CTS, rng.choice([CTS_OK, CTS_REJECT, rng.randrange(1 << 32)]), 0, 0, 0,
                              rng.randrange(*I64))
        if r < 0.88:   # garbage in every field but the kind: it is legal (the engine judges it)
            return "abort", hdr(ABORT, rng.randrange(1 << 32), rng.randrange(*I64), rng.randrange(*I64),
                                rng.randrange(*I64), rng.randrange(*I64), rng.randrange(*I64),
                                rng.randrange(*I64))
        if r < 0.97:
            return "pad", hdr(PAD, 0, rng.randrange(*I64), 0, rng.randrange(0, 1 << 40))
        return "bye", hdr(BYE)

    def _data(self) -> tuple[str, bytes]:
        """A DATA fragment of a message we announced and the peer accepted."""
        rng, f = self.rng, self.frag
        msgid = rng.choice(list(self.open))
        nbytes, off, isz = self.open[msgid]
        left = nbytes - off
        n = min(left, f, rng.choice([f, isz * rng.randrange(0, 64), left]))
        n -= n % isz
        self.open[msgid][1] += n
        if self.open[msgid][1] >= nbytes:
            del self.open[msgid]
        return "data", hdr(DATA, 0, 0, msgid, n, off) + rng.randbytes(n)

    def _malformed(self) -> tuple[str, bytes]:
        rng, e, f = self.rng, self.eager, self.frag
        r = rng.random()
        if r < 0.2 and self.open:
            reducing = [m for m, (_, _, isz) in self.open.items() if isz > 1]
            msgid = rng.choice(reducing or list(self.open))
            nbytes, off, isz = self.open.pop(msgid)
            left = nbytes - off
            q = rng.random()
            if q < 0.5 and isz > 1:    # splits an element of a reducing receive
                n = min(left, f, rng.randrange(1, 64))
                n += n % isz == 0
                kind = "data-split-element"
            elif q < 0.8:              # runs past the end of the message
                n, kind = min(f, left + rng.randrange(1, 64)), "data-past-end"
            else:                      # not where the message is at
                n, kind = min(left, f, 64), "data-wrong-offset"
                off += rng.choice([-1, 1, -(1 << 40), 1 << 40])
            return kind, hdr(DATA, 0, 0, msgid, n, off) + rng.randbytes(n)
        if r < 0.3:
            n = rng.randrange(0, 256)
            return "data-unknown", hdr(DATA, 0, 0, rng.randrange(*I64), n, 0) + rng.randbytes(n)
        if r < 0.36:
            return "data-oversized", hdr(DATA, 0, 0, rng.randrange(4), rng.choice([f + 1, 1 << 62]), 0)
        if r < 0.44:
            return "eager-oversized", hdr(EAGER, 0, rng.randrange(10), -1,
                                          rng.choice([e + 1, 1 << 30, I64[1]]), 0)
        if r < 0.52:   # a message id already used (or going backwards)
            req = self._posted()
            msgid = rng.choice([self.last_sent, self.last_sent - 1, -(1 << 40)])
            return "rts-reused-id", hdr(RTS, 0, req.tag if req else 1, msgid,
                                        req.nbytes if req else e + 1, 0)
        if r < 0.60:
            return "cts-unknown", hdr(CTS, 0, 0, rng.randrange(1, 1 << 62), 0, 0)
        if r < 0.70:
            kind = rng.choice([0, 8, 9, 255, 1 << 31, (1 << 32) - 1])
            return "bad-kind", hdr(kind, 0, 0, 0, rng.randrange(0, 100))
        if r < 0.82:
            kind = rng.choice(sorted(KINDS - {ABORT}))
            return "negative-length", hdr(kind, 0, 1, 0, rng.choice([-1, -64, I64[0]]), 0)
        return "random-bytes", rng.randbytes(HEADER_SIZE + rng.randrange(0, 200))


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # random bytes reduced as floats: NaN
def test_packet_parser_survives_malformed_streams():
    rng = random.Random(SEED + 4)
    rss = Rss()
    t0 = time.monotonic()
    kinds: dict = {}
    streams = 0
    reasons: dict = {}
    completed = 0
    while sum(kinds.values()) < N_PACKETS:
        st = Stream(rng)
        streams += 1
        log = []
        try:
            for _ in range(rng.randrange(1, 60)):
                kind, data = st.packet()
                log.append(kind)
                kinds[kind] = kinds.get(kind, 0) + 1
                st.packets += 1
                st.feed(data, time.monotonic() + 5)
                if st.peer.dead:
                    break
            st.finish(rng.choice(["close", "rst", "cut-header", "cut-payload", "bye"]),
                      time.monotonic() + 5)
        except BaseException as exc:
            raise AssertionError(f"stream {streams} (eager {st.eager}, frag {st.frag}), packets "
                                 f"{log}: {exc!r}") from exc
        for why in st.eng.violations:
            why = re.sub(r"-?\d+", "N", why)[:48]
            reasons[why] = reasons.get(why, 0) + 1
        completed += sum(req.done and req.error is None for req, _ in st.recvs)
        if streams % 50 == 0:
            assert rss.sample() < RSS_BOUND_MIB, f"RSS grew {rss.sample():.0f} MiB"
    took = time.monotonic() - t0
    STATS["packet parser"] = dict(inputs=sum(kinds.values()), streams=streams,
                                  receives_completed=completed, violations=reasons,
                                  seconds=round(took, 1), rss_growth_mib=round(rss.sample(), 1),
                                  kinds=kinds)
    assert took < 45


# -- 2c. the cases the fuzzer found, pinned -----------------------------------------------------
def _f32_rts_split(w):      # a reducing receive sent a fragment of 3 bytes of a 4-byte element
    w.post(1, 64, np.float32, np.add)
    return hdr(RTS, 0, 1, 0, 64) + hdr(DATA, 0, 0, 0, 3, 0) + b"abc", "splits a 4-byte element"


def _rts_reused(w):         # a second RTS with the same message id used to orphan the first receive
    w.post(1, 2048)
    w.post(2, 2048)
    return hdr(RTS, 0, 1, 0, 2048) + hdr(RTS, 0, 2, 0, 2048), "reuses message id 0"


def _reset_while_answering(w):   # the other side resets before our CTS: was IndexError
    w.post(1, 2048)
    return hdr(RTS, 0, 1, 0, 2048), None


PINNED = {
    "reduce-fragment-splits-element": _f32_rts_split,
    "rts-reuses-message-id": _rts_reused,
    "reset-while-answering": _reset_while_answering,
    "eager-claims-2^62": lambda w: (hdr(EAGER, 0, 1, -1, 1 << 62), "oversized"),
    "data-claims-2^62": lambda w: (hdr(DATA, 0, 0, 0, 1 << 62), "oversized"),
    "rts-negative-length": lambda w: (hdr(RTS, 0, 1, 0, -5), "bad header"),
    # DATA right behind its RTS is for shared memory, where it cannot hoard: not over TCP
    "rts-stream-over-tcp": lambda w: (hdr(RTS, RTS_STREAM, 1, 0, 2048), "does not stream"),
    "cts-unknown": lambda w: (hdr(CTS, 0, 0, 12345, 0), "CTS for unknown"),
    "kind-0": lambda w: (hdr(0), "bad header kind=0"),
}


@pytest.mark.parametrize("case", sorted(PINNED))
def test_tcp_peer_fails_cleanly_on(case):
    w = Wire(1024, 4096)
    data, why = PINNED[case](w)
    if why is None:
        w.a.setblocking(True)
        w.a.sendall(data)
        _rst_close(w.a)                  # before the peer has read it, let alone answered
        deadline = time.monotonic() + 5
        while not w.peer.dead:
            w.peer.progress()            # must not raise
            assert time.monotonic() < deadline
        w.check()
        assert "connection" in str(w.peer.dead), w.peer.dead
    else:
        w.feed(data, time.monotonic() + 5)
        assert w.peer.dead and why in str(w.peer.dead), (w.peer.dead, w.eng.violations)
        w.finish("close", time.monotonic() + 5)
    for req, _ in w.recvs:      # every receive is answered, none left to wait for its timeout
        assert req.done and isinstance(req.error, PeerFailure), (req.done, req.error)


def test_tcp_peer_claims_allocate_nothing():
    """No allocation is sized by a peer's claim: headers claiming up to 2^62 bytes cost the
    same few bytes as any other packet (traced by tracemalloc)."""
    claims = [1 << 20, 1 << 30, 1 << 40, 1 << 62, (1 << 63) - 1]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        w = Wire(1024, 4096)              # its bounce buffer: 4 KiB
        w.post(7, 16)
        for i in range(500):              # announced to tags nobody posted: kept, as a claim
            w.feed(hdr(RTS, 0, 100 + i, i, claims[i % len(claims)]), time.monotonic() + 5)
        w.feed(hdr(RTS, 0, 7, 500, 1 << 62), time.monotonic() + 5)   # matched: rejected, not allocated
        assert not w.peer.dead and len(w.peer.unexpected) == 500
        w.finish("close", time.monotonic() + 5)
        for kind in (EAGER, DATA):        # fatal claims, each on a fresh peer
            for n in claims:
                w = Wire(1024, 4096)
                w.feed(hdr(kind, 0, 1, -1, n), time.monotonic() + 5)
                assert w.peer.dead
                w.finish("close", time.monotonic() + 5)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, f"peak {peak} bytes traced while fed claims of up to 2^63 bytes"


def test_tcp_peer_progress_returns_under_a_flood():
    """A peer streaming packets faster than we parse them: each progress() call returns
    after a bounded amount of work (it used to loop until the flood stopped)."""
    w = Wire(64 << 10, 1 << 20)
    w.a.setblocking(True)
    blob = hdr(PAD) * 16384
    stop = threading.Event()

    def flood():
        give_up = time.monotonic() + 10  # without the fix the first progress() returns only then
        while not stop.is_set() and time.monotonic() < give_up:
            try:
                w.a.sendall(blob)
            except OSError:
                return
    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        assert select.select([w.peer.sock], [], [], 10)[0], "the flood never started"
        longest, moved = 0.0, 0
        for _ in range(20):
            t0 = time.monotonic()
            moved += bool(w.peer.progress())   # (a call may find the socket drained just then)
            longest = max(longest, time.monotonic() - t0)
        assert t.is_alive(), "the flood ended before the calls did: nothing was measured"
        assert moved, "no progress() call found packets to parse"
        assert longest < 1.5, f"one progress() call took {longest:.2f} s under a flood"
    finally:
        stop.set()
        w.a.shutdown(socket.SHUT_RDWR)   # wakes the flooder if it is blocked in sendall
        t.join(5)
        assert not t.is_alive()
        _rst_close(w.a)
        w.peer.close()


# -- 2d. found by fuzzing, to be fixed in the engine (see the reasons) -------------------------
def _garbage_fingerprint_abort(rank, path):
    from ringlet import runtime
    if rank == 1:
        peer = runtime.engine().peers[0]
        assert isinstance(peer, TcpPeer)
        # A well-formed ABORT whose fingerprints decode to nothing (collective #255).
        peer._write(ABORT, 5, 12345, 0xFF, 7, 0, None, 0xFF, 1)
        rl.recv(np.zeros(1), 0, tag=2, timeout=30)
    else:
        try:
            rl.recv(np.zeros(1), 1, tag=1, timeout=1.0)
            outcome = "completed"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        with open(path, "w") as f:
            f.write(outcome)
        rl.send(np.zeros(1), 1, tag=2)


def test_garbage_fingerprint_in_abort_is_not_a_crash(tmp_path, quiet):
    path = str(tmp_path / "outcome")
    run(_garbage_fingerprint_abort, 2, path, env=two_hosts(2), timeout=40)
    outcome = open(path).read()
    assert outcome.split(":")[0] in ("TimeoutError", "PeerFailure", "CollectiveMismatch"), outcome


def _flooded_wait(rank, path):
    from ringlet import runtime
    if rank == 1:
        sock = runtime.engine().peers[0].sock
        blob = memoryview(hdr(PAD) * 16384)
        off, end = 0, time.monotonic() + 4
        while time.monotonic() < end or off:   # whole packets only: stop at a blob boundary
            try:
                off = (off + sock.send(blob[off:])) % len(blob)
            except (BlockingIOError, InterruptedError):
                select.select([], [sock], [], 0.05)
        rl.send(np.zeros(1), 0, tag=2)
    else:
        t = time.monotonic()
        try:
            rl.recv(np.zeros(1), 1, tag=1, timeout=0.5)
            outcome = "completed"
        except rl.TimeoutError:
            outcome = "timeout"
        with open(path, "w") as f:
            json.dump({"outcome": outcome, "after": time.monotonic() - t}, f)
        rl.recv(np.zeros(1), 1, tag=2, timeout=30)   # reading on, until the flood is over


def test_timeout_holds_while_a_peer_floods(tmp_path):
    path = str(tmp_path / "outcome.json")
    run(_flooded_wait, 2, path, env=two_hosts(2), timeout=40)
    seen = json.load(open(path))
    assert seen["outcome"] == "timeout" and seen["after"] < 2.5, seen


def _nothing(rank):
    pass


@pytest.mark.timeout(60)
def test_an_idle_stranger_at_a_data_port_does_not_stall_init(quiet):
    world, hold = 4, 3
    orig = launch.StoreServer
    idle, released = [], []
    kv = None

    class Held(orig):
        def __init__(self, *a, **k):
            nonlocal kv
            super().__init__(*a, **k)

            def on_all(addrs):   # once every rank runs: one silent connection, then go
                idle.append(socket.create_connection(("127.0.0.1", addrs[0]["port"]), timeout=5))
                time.sleep(0.2)
                released.append(time.monotonic())
                kv.release.set()
            kv = HoldKV(world, hold, lambda addrs: threading.Thread(
                target=on_all, args=(addrs,), daemon=True).start())
            self.data.kv = kv

    launch.StoreServer = Held
    try:
        run(_nothing, world, env=two_hosts(world), timeout=50)
    finally:
        launch.StoreServer = orig
        for s in idle:
            _rst_close(s)
    took = time.monotonic() - released[0]
    assert took < 5, f"the job needed {took:.1f} s after release: one silent stranger held it up"


def test_a_store_that_stops_answering_fails_its_calls_within_the_jobs_timeout(monkeypatch):
    """A store out of reach (its host cut off) held every call 30 s, whatever the job's
    timeout: shrink and destroy ran 125 s past a 20 s one. An answer may now take the
    job's timeout; after one did not come, the connection is done with (a late answer
    would be read as the next call's) and every later call fails at once, saying why."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from ringlet.errors import RingletError
    monkeypatch.setattr(TCPStore, "ANSWER_MIN", 0.5)
    server = subprocess.Popen(
        [sys.executable, "-c", "import time; from ringlet.rendezvous import StoreServer; "
         f"s = StoreServer('127.0.0.1', 0, {TOKEN!r}); print(s.port, flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        store = TCPStore("127.0.0.1", int(server.stdout.readline()), TOKEN, timeout=0.5)
        store.set("a", b"1")
        os.kill(server.pid, signal.SIGSTOP)
        t = time.monotonic()
        with pytest.raises(RingletError, match="did not answer within 0.5 s: is the network"):
            store.set("b", b"2")
        with pytest.raises(RingletError, match="did not answer within 0.5 s"):
            store.try_get("a")
        assert time.monotonic() - t < 3
    finally:
        server.kill()
