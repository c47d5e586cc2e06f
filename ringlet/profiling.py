"""``rl.profile()``: how much of a stretch of code went to communication - the measured
communication-to-computation ratio, with ringlet's calls as the communication rows (as a
torch profiler table shows NCCL's).

    with rl.profile() as prof:
        for _ in range(10):
            train_step()
    print(prof.table())          # per call: count, bytes, seconds inside, seconds blocked
    prof.gamma                   # comm_seconds / compute_seconds

Every public call of ringlet (collectives, point-to-point, ``Work.wait``) is wrapped by
:func:`profiled`, the one hook into the runtime; with no profile open it costs one extra
Python call. Only the outermost ringlet call is timed (a blocking collective waits inside
itself, and that wait is part of the same call).

* ``comm_seconds``: time inside ringlet calls - launching, driving progress and waiting;
  what this rank spent communicating instead of computing;
* ``blocked_seconds``: the part of it spent blocked (in ``wait`` or a blocking call):
  exposed communication, the part overlap did not hide;
* ``compute_seconds``: the rest of the wall time inside the ``with`` block.
"""
from __future__ import annotations

import functools
import inspect
import textwrap
import time
from types import SimpleNamespace

_open: list = []      # profiles recording now (nested ones all record)
_depth = 0            # ringlet calls on the stack: only the outermost is timed


class _Row:
    __slots__ = ("calls", "bytes", "seconds", "blocked")

    def __init__(self):
        self.calls, self.bytes, self.seconds, self.blocked = 0, 0, 0.0, 0.0


class Profile:
    """What :func:`profile` measured; read it after (or inside) the ``with`` block."""

    def __init__(self):
        self.rows: dict[str, _Row] = {}
        self._start = self._stop = None

    def _add(self, name: str, nbytes: int, seconds: float, blocked: bool, call: bool) -> None:
        row = self.rows.get(name)
        if row is None:
            row = self.rows[name] = _Row()
        row.calls += call     # a wait adds time to its operation's row, not a call
        row.bytes += nbytes
        row.seconds += seconds
        if blocked:
            row.blocked += seconds

    @property
    def wall_seconds(self) -> float:
        end = self._stop if self._stop is not None else time.perf_counter()
        return end - self._start

    @property
    def comm_seconds(self) -> float:
        return sum(r.seconds for r in self.rows.values())

    @property
    def blocked_seconds(self) -> float:
        return sum(r.blocked for r in self.rows.values())

    @property
    def compute_seconds(self) -> float:
        return max(self.wall_seconds - self.comm_seconds, 0.0)

    @property
    def gamma(self) -> float:
        """comm_seconds / compute_seconds (inf if nothing but communication ran)."""
        comp = self.compute_seconds
        return self.comm_seconds / comp if comp > 0 else float("inf")

    def table(self) -> str:
        """One row per ringlet call, the busiest first, then compute and the totals."""
        wall = self.wall_seconds or 1e-12
        lines = [f"{'name':<27}{'calls':>7}{'bytes':>14}{'inside ms':>12}{'blocked ms':>12}"
                 f"{'% wall':>8}"]
        for name, r in sorted(self.rows.items(), key=lambda kv: -kv[1].seconds):
            lines.append(f"{'ringlet:' + name:<27}{r.calls:>7}{r.bytes:>14,}"
                         f"{r.seconds * 1e3:>12.3f}{r.blocked * 1e3:>12.3f}"
                         f"{100 * r.seconds / wall:>7.1f}%")
        lines.append(f"{'compute':<27}{'':>7}{'':>14}{self.compute_seconds * 1e3:>12.3f}"
                     f"{'':>12}{100 * self.compute_seconds / wall:>7.1f}%")
        lines.append(f"wall {wall * 1e3:.3f} ms; communication {self.comm_seconds * 1e3:.3f} ms "
                     f"({self.blocked_seconds * 1e3:.3f} ms blocked); gamma {self.gamma:.3g}")
        return "\n".join(lines)

    def __enter__(self) -> "Profile":
        self._start, self._stop = time.perf_counter(), None
        _open.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._stop = time.perf_counter()
        _open.remove(self)


def profile() -> Profile:
    """A context manager recording this rank's time in ringlet calls (see the module)."""
    return Profile()


def profiled(name: str | None, blocking: bool | None = None, refused=None):
    """Decorate a public ringlet call so an open profile times it under ``name`` (None:
    a ``Work.wait``, named after its operation). ``blocking``: whether the call blocks
    (None: unless its ``async_op`` argument is true). ``refused(name, exc, arguments)``:
    called when the call raises ValueError or TypeError (its arguments failed a check), before
    the error goes on (a collective's: collectives._refused); a try costs nothing until
    something raises.

    The wrapper has the function's own signature (written out and compiled once here):
    with no profile open it is one plain Python call more, ~600 instructions of the ~18,000
    a blocking 8 B all_reduce costs around its C part (~32,000 before issue 27). A
    ``*args, **kw`` wrapper cost 1,450 (its tuple, its dict, a call through them; with a
    keyword argument the call cost 3,000 more than before the hook) -
    bench/blocking_callgrind.py."""
    def wrap(fn):
        sig = inspect.signature(fn)
        params, passed = [], []
        for p in sig.parameters.values():
            star = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
            if p.kind == p.KEYWORD_ONLY and not any(x.startswith("*") for x in params):
                params.append("*")
            params.append(star + p.name + ("" if p.default is p.empty else f"=_defaults.{p.name}"))
            passed.append(f"{p.name}={p.name}" if p.kind == p.KEYWORD_ONLY else star + p.name)
        call = f"_fn, {', '.join(passed)}"
        first = next(iter(sig.parameters))     # the buffer (its bytes), or the Work waited on
        # ... and a collective's other buffer: the row counts the larger, the size convention
        # of the cost model (a reduce_scatter's input, not the block it leaves)
        names = list(sig.parameters)
        second = names[1] if len(names) > 1 and names[1] in ("inp", "out") else "None"
        is_async = "async_op" if "async_op" in sig.parameters else "False"
        # (made by a function of the module's own globals, which _timed rebinds _depth in;
        # no lambda in it: the parameters it closed over would cost a cell each, every call)
        body = (f"if not _open or _depth:\n"
                f"    return _fn({', '.join(passed)})\n"
                f"return _timed(_name, _blocking, {first}, {second}, {is_async}, {call})\n")
        if refused is not None:
            body = ("try:\n" + textwrap.indent(body, "    ") +
                    "except (ValueError, TypeError) as _e:\n"
                    "    _refused(_name, _e, locals())\n"
                    "    raise\n")
        src = (f"def make(_fn, _name, _blocking, _defaults, _refused):\n"
               f"    def {fn.__name__}({', '.join(params)}):\n"
               f"{textwrap.indent(body, ' ' * 8)}"
               f"    return {fn.__name__}\n")
        scope: dict = {}
        exec(compile(src, f"<rl.profile's hook on {fn.__qualname__}>", "exec"), globals(), scope)
        defaults = SimpleNamespace(**{p.name: p.default for p in sig.parameters.values()})
        return functools.wraps(fn)(scope["make"](fn, name, blocking, defaults, refused))
    return wrap


def _timed(name, blocking, first, second, is_async, fn, *args, **kw):
    """Run the outermost ringlet call ``fn(*args, **kw)`` and add its time to every open
    profile."""
    global _depth
    _depth = 1
    t = time.perf_counter()
    try:
        return fn(*args, **kw)
    finally:
        dt = time.perf_counter() - t
        _depth = 0
        if name is None:
            row, nbytes, blocked = first.operation, 0, True
        else:
            row = name
            nbytes = max(getattr(first, "nbytes", 0), getattr(second, "nbytes", 0))
            blocked = not is_async if blocking is None else blocking
        for prof in _open:
            prof._add(row, nbytes, dt, blocked, name is not None)
