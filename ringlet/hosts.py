"""Emulated hosts on one machine: network namespaces joined through a bridge by links
shaped with ``tc`` (tbf), each host with its own hostname and its own /dev/shm.

    with Hosts(2, rate="1gbit") as hosts:          # 10.77.0.1, 10.77.0.2
        procs = hosts.ringlet_run("train.py", nproc=2)   # one job: shm inside, TCP between
        hosts.wait(procs, timeout=60)

A namespace alone is not a host: its ranks would share the hostname and /dev/shm with every
other one, and ringlet would rightly use shared memory across it. So each host is a
long-lived holder process (``unshare --uts --mount`` inside ``ip netns exec``) with a
tmpfs on /dev/shm and a hostname of its own; commands join all three of its namespaces
(``nsenter``). Host i is ``10.77.0.<i+1>/24`` on eth0, a veth whose other end is port
``h<i>`` of a bridge in a switch namespace; both ends' egress is shaped to ``rate``, so a
link carries ``rate`` each way. ``bucket`` is tbf's burst in seconds at the rate: the
default 2 ms keeps a large transfer at the rate, but lets a message below the bucket pass
at once; 200 us makes a 64 KiB message see the rate, and a large transfer still reaches
87-91% of it (``_burst``). Nothing is created in the caller's namespaces.
``Hosts(n, isolate=False)`` gives each host only its network: its ranks share the hostname
and /dev/shm with the others' (containers with one IPC namespace but separate networks),
and ringlet still tells the hosts apart by their network namespace.

Teardown is always done: on leaving the ``with`` block, on SIGTERM/SIGHUP while inside it
(turned into SystemExit), at interpreter exit, and for namespaces left by a process that
was SIGKILLed (swept by the next ``Hosts``: their names carry the owner's pid).
Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; else ``HostsUnavailable`` says why.

``python -m ringlet.hosts 2 --rate 1gbit`` builds two hosts, shows them and what one
link carries, and tears them down.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

PREFIX = "rlh"               # namespaces: rlh<pid>-<i> (hosts), rlh<pid>-sw (the bridge)
MASTER_PORT = 29500           # inside our own namespaces: nothing else listens there


class HostsUnavailable(RuntimeError):
    """Emulated hosts cannot be built here (not root, no iproute2, no namespaces)."""


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def _bits(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: use tc's form, e.g. 1gbit, 10gbit, 500mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _burst(rate: str, bucket: float = 2e-3) -> tuple[int, int]:
    """tbf's bucket (bytes) for ``bucket`` seconds at the link rate, and the largest GSO
    packet the host may hand it (0: the kernel's; tbf would cut a larger one into MTU
    frames). 2 ms (the default): at least 256 KiB, and a large transfer keeps the rate
    (a small bucket loses rate whenever tbf's timer fires late), but a message up to the
    bucket's size passes at once, faster than the link. 200 us: a 64 KiB message at
    1 Gbit/s sees the rate (there and back in 0.76-0.79 ms, median, against 1.05 on the
    wire and 0.55 - at best 0.04 - through 2 ms), and one stream each way still reaches
    0.87-0.91 Gbit/s (0.90 through 2 ms; load 3)."""
    nbytes = int(_bits(rate) / 8 * bucket)
    if bucket >= 2e-3:
        return max(256 << 10, nbytes), 0
    gso = min(64 << 10, max(8 << 10, nbytes // 3 >> 13 << 13))   # 3 packets per bucket
    return max(3 * gso, nbytes), gso if gso < 64 << 10 else 0


def sweep() -> list[str]:
    """Delete namespaces of earlier Hosts whose owner process is gone."""
    removed = []
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)-(\w+)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _kill_inside(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


def _kill_inside(ns: str) -> None:
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in proc.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Hosts:
    """``n`` emulated hosts joined by links of ``rate`` (tc form: "1gbit", "10gbit"; None
    leaves them unshaped)."""

    def __init__(self, n: int, rate: str | None = "1gbit", isolate: bool = True,
                 bucket: float = 2e-3):
        if n < 1:
            raise ValueError("need at least one host")
        if rate:
            _burst(rate, bucket)         # a bad rate fails here, not inside tc
        self.n, self.rate, self.isolate, self.bucket = n, rate, isolate, bucket
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-{i}" for i in range(n)]
        self.addrs = [f"10.77.0.{i + 1}" for i in range(n)]
        self.hostnames = [f"h{i}" for i in range(n)]
        self.holders: list[subprocess.Popen] = []
        self.procs: list[subprocess.Popen] = []
        self.up = False
        self._old_handlers: dict = {}

    # -- building and tearing down ---------------------------------------------------------
    def __enter__(self) -> "Hosts":
        if os.geteuid() != 0:
            raise HostsUnavailable("emulated hosts need root (network namespaces, tc, mounts)")
        for tool in ("ip", "tc", "unshare", "nsenter"):
            if shutil.which(tool) is None:
                raise HostsUnavailable(f"emulated hosts need `{tool}` (iproute2, util-linux)")
        sweep()
        self._catch_signals()
        atexit.register(self.down)
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        self.up = True
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        # A switch forwards frames; with br_netfilter loaded a Linux bridge would also run
        # every frame through the (empty) IP firewall hooks: 10-25% more CPU per byte
        # between hosts here. Off in the switch's own namespace only (the host keeps its own).
        subprocess.run(["ip", "netns", "exec", self.switch, "sh", "-c",
                        "for f in /proc/sys/net/bridge/bridge-nf-call-*; do "
                        "[ -w $f ] && echo 0 > $f; done; true"], capture_output=True)
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"h{i}",
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"h{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"h{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate:
                for where, dev in ((ns, "eth0"), (self.switch, f"h{i}")):
                    self._shape(where, dev)
            self.holders.append(self._holder(ns, self.hostnames[i], self.isolate))

    def _shape(self, ns: str, dev: str) -> None:
        burst, gso = _burst(self.rate, self.bucket)
        if gso:
            _ip("-n", ns, "link", "set", "dev", dev, "gso_max_size", str(gso))
        cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
               "rate", self.rate, "burst", str(burst), "latency", "20ms"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise HostsUnavailable(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")

    @staticmethod
    def _holder(ns: str, hostname: str, isolate: bool = True) -> subprocess.Popen:
        """The process whose namespaces are the host's: own hostname, private /dev/shm
        (unless not ``isolate``: then only its network is its own, like containers that
        share the IPC namespace and hostname)."""
        if not isolate:
            holder = subprocess.Popen(["ip", "netns", "exec", ns, "sh", "-c",
                                       "echo ready && exec sleep 1000000"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        else:
            script = ("mount -t tmpfs -o mode=1777 tmpfs /dev/shm && hostname " + hostname +
                      " && echo ready && exec sleep 1000000")
            holder = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "--mount",
                                       "--propagation", "private", "sh", "-c", script],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if holder.stdout.readline().strip() != "ready":
            holder.kill()
            raise HostsUnavailable(f"could not give host {hostname} its own hostname and "
                                   f"/dev/shm: {holder.stderr.read().strip()}")
        return holder

    def down(self) -> None:
        """Stop everything started on the hosts and delete every namespace (idempotent)."""
        for p in self.procs + self.holders:
            if p.poll() is None:
                p.kill()
        for p in self.procs + self.holders:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.names + [self.switch]:
            _kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.procs, self.holders, self.up = [], [], False
        self._restore_signals()
        atexit.unregister(self.down)

    def _catch_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def leave(signum, frame):
            raise SystemExit(128 + signum)   # unwinds through __exit__: teardown runs
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                self._old_handlers[sig] = signal.signal(sig, leave)

    def _restore_signals(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}

    # -- running things on them ------------------------------------------------------------
    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` as run on host ``i`` (its network, hostname and /dev/shm)."""
        return ["nsenter", "-t", str(self.holders[i].pid), "--net", "--uts", "--mount",
                "--", *argv]

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(self.command(i, argv), **kw)
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(i, argv), timeout=timeout, **kw)

    def ringlet_run(self, script: str, nproc: int = 1, args=(), env: dict | None = None,
                    python: str = sys.executable, **kw) -> list[subprocess.Popen]:
        """One ringlet job over all hosts: ``ringlet run -n nproc --nnodes N --node-rank i
        --master-addr <host 0>`` on each, sharing a fresh job token."""
        import secrets
        job_env = dict(os.environ, RINGLET_TOKEN=secrets.token_hex(32), **(env or {}))
        return [self.popen(i, [python, "-m", "ringlet.cli", "run", "-n", str(nproc),
                               "--nnodes", str(self.n), "--node-rank", str(i),
                               "--master-addr", self.addrs[0], "--master-port",
                               str(MASTER_PORT), script, *args], env=job_env, **kw)
                for i in range(self.n)]

    @staticmethod
    def wait(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
        """(exit code, stdout, stderr) of each; kills them all if the deadline passes."""
        deadline = time.monotonic() + timeout
        out = []
        for p in procs:
            try:
                o, e = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                o, e = p.communicate()
                e = (e or "") + f"\n[killed: the job outlived its {timeout:g} s]"
            out.append((p.returncode, o, e))
        return out


_SINK = """
import socket, time
srv = socket.create_server(("0.0.0.0", 29501))
conn, _ = srv.accept()
buf, got, t0 = bytearray(1 << 20), 0, None
while n := conn.recv_into(buf):
    t0 = t0 or time.perf_counter()
    got += n
print(f"{got * 8 / (time.perf_counter() - t0) / 1e9:.2f} Gbit/s over {got >> 20} MiB")
"""
_SOURCE = """
import socket, sys
s = socket.create_connection((sys.argv[1], 29501))
s.sendall(bytes(32 << 20))
s.close()
"""


def _main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m ringlet.hosts", description=__doc__.split("\n\n")[0])
    ap.add_argument("n", type=int, nargs="?", default=2, help="hosts (default 2)")
    ap.add_argument("--rate", default="1gbit", help="link rate, tc form (default 1gbit)")
    ap.add_argument("--bucket", type=float, default=2e-3,
                    help="tbf's bucket, seconds at the rate (default 0.002; 0.0002: a 64 KiB "
                         "message sees the rate)")
    a = ap.parse_args(argv)
    try:
        with Hosts(a.n, a.rate, bucket=a.bucket) as hosts:
            for i in range(a.n):
                name = hosts.run(i, ["hostname"], capture_output=True, text=True).stdout.strip()
                print(f"host {i}: {hosts.names[i]}  {hosts.addrs[i]}  hostname {name}")
            # what one link carries: host 0 sends 32 MiB to the last host over TCP
            sink = hosts.popen(a.n - 1, [sys.executable, "-c", _SINK], stdout=subprocess.PIPE,
                               text=True)
            time.sleep(0.5)
            hosts.run(0, [sys.executable, "-c", _SOURCE, hosts.addrs[-1]])
            print(f"host 0 -> host {a.n - 1}: {sink.communicate(timeout=60)[0].strip()}")
    except HostsUnavailable as exc:
        print(f"emulated hosts unavailable: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
