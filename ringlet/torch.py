"""ringlet as a torch.distributed backend (CPU tensors).

    import ringlet.torch                      # or nothing: torch autoloads the entry point
    dist.init_process_group("ringlet")        # "cpu:ringlet,cuda:nccl" works too

The process group is a Python ``dist.ProcessGroup`` whose every operation is one of
ringlet's collectives or point-to-point calls on CPU tensors (any dtype torch has:
bfloat16 reduces as torch does, in float32 rounded back; non-contiguous tensors are staged
through a contiguous copy). The world joins on the store torch hands the backend, with
every value ringlet writes there signed by the job token; each subgroup is known by its
rank list, so members may create groups in different orders.

From three ranks on, float all-reduces, reduces and reduce-scatters add in Gloo's order
(the ``gloo_ring`` algorithms), so a job has the same bits on either backend;
``RINGLET_TORCH_ORDER=auto`` lets ringlet's cost model pick instead. A call made with
``async_op=True`` (DDP's, FSDP's) returns while in flight and ringlet's progress thread
finishes it (where the ranks fill the cores, once driven in the call while it moves:
``ProcessGroup._issue``); a backward pass ends only once its calls have (``_join``).
``init_process_group(timeout=)`` / ``new_group(timeout=)`` is ringlet's timeout for the
group's calls. A DDP bucket's all-reduce on one host sends from shared memory
(``_adopted``), which local peers read in place.

Inside ``torch.profiler.profile()`` each operation is a ``record_function`` range named
after ringlet's call - "ringlet:all_reduce", "ringlet:send", ... - so the profiler's table
shows communication beside compute as it shows "gloo:" or "nccl:" rows.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import sys
import threading
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch._C import _distributed_c10d as c10d
from torch.autograd import _profiler_enabled as _profiling   # a C call: ~50 ns
from torch.distributed.constants import default_pg_timeout
from torch.profiler import record_function

from . import buffers
from . import collectives as C
from . import runtime
from .errors import CollectiveMismatch, RingletError
from .ops import ReduceOp, tensor_array
from .rendezvous import SignedStore, derive_token, job_token, torch_env
from .transport import copies
from .transport.limits import ZERO_COPY_MIN
from .work import AllOf

NAME = "ringlet"

_RED = dist.ReduceOp.RedOpType
# Keyed by the enum's value: hashing pybind11 enums costs microseconds per call.
_OPS = {k.value: v for k, v in {
    _RED.SUM: ReduceOp.SUM, _RED.PRODUCT: ReduceOp.PROD, _RED.MIN: ReduceOp.MIN,
    _RED.MAX: ReduceOp.MAX, _RED.BAND: ReduceOp.BAND, _RED.BOR: ReduceOp.BOR,
    _RED.BXOR: ReduceOp.BXOR, _RED.AVG: ReduceOp.AVG, _RED.PREMUL_SUM: ReduceOp.SUM}.items()}
_PREMUL = _RED.PREMUL_SUM.value


# -- completion: the one place that decides when a torch Work is done ------------------------
_NO_ROW = contextlib.nullcontext()


def _row(name: str | None):
    """While torch.profiler records, a range "ringlet:<name>" - a row of its table beside
    compute, as "gloo:all_reduce" is for Gloo; otherwise nothing (one ~50 ns check). A call
    left in flight (``_Pending``) is timed from its start to its return."""
    return record_function(f"ringlet:{name}") if name is not None and _profiling() else _NO_ROW


class _Work(dist.Work):
    """A torch Work whose ringlet calls ran (or run) in ``finish``: ``wait()`` runs it
    once and raises what it raised; ``get_future()`` does the same and hands the outcome
    to the future. ``name``: the ringlet call, for torch.profiler's table (:func:`_row`)."""

    def __init__(self, finish, result, name: str | None = None):
        super().__init__()
        self.finish, self.tensors, self.error, self.name = finish, result, None, name

    def result(self):
        """The tensors the call wrote (torch's deprecated ``Work.result()``)."""
        self.wait()
        return self.tensors

    def wait(self, timeout=None):
        if self.finish is not None:
            finish, self.finish = self.finish, None
            try:
                with _row(self.name):
                    finish()
            except Exception as exc:   # noqa: BLE001 - kept for every later wait
                self.error = exc
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        return self.finish is None

    def is_success(self):
        return self.finish is None and self.error is None

    def exception(self):
        return self.error

    def get_future(self):
        fut = torch.futures.Future()
        try:
            self.wait()
        except Exception as exc:   # noqa: BLE001
            fut.set_exception(exc)
        else:
            fut.set_result(self.tensors)
        return fut


def _completed(name: str | None, run, result):
    """A torch Work for ``run()`` (which issues blocking ringlet calls of collective
    ``name``), completed here: an error (a dead peer, a mismatch) is raised from the torch
    call itself."""
    work = _Work(run, result, name)
    work.wait()
    return work


class _Pending(dist.Work):
    """A torch Work over one ringlet call in flight, moved by ringlet's progress thread:
    ``wait()`` blocks until it is done and raises its error; ``get_future()`` is completed
    (its result ``result``, or the error) by whichever thread sees the call finish. ``then``
    (a copy back, a slice kept) runs once, after the call and before either reports."""

    def __init__(self, work, result, then=None):
        super().__init__()
        self.work, self.tensors, self.then = work, result, then
        self.lock = threading.Lock()
        self.done, self.error, self.fut = False, None, None

    def _complete(self):
        """Once the ringlet call has finished: run ``then``; the error, if any."""
        with self.lock:
            if not self.done:
                try:
                    self.work.wait()   # finished: returns, or raises its error, at once
                    if self.then is not None:
                        self.then()
                except Exception as exc:   # noqa: BLE001 - reported by wait and the future
                    self.error = exc
                self.done = True
        return self.error

    def result(self):
        """The tensors the call wrote (torch's deprecated ``Work.result()``)."""
        self.wait()
        return self.tensors

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if timeout is not None else 0
        self.work.wait(seconds if seconds > 0 else None)   # a timeout raises; the call goes on
        if self._complete() is not None:
            raise self.error
        return True

    def is_completed(self):
        if not self.work.is_completed():
            return False
        self._complete()   # what the caller reads next is written
        return True

    def is_success(self):
        return self.is_completed() and self.error is None

    def exception(self):
        return self._complete() if self.is_completed() else None

    def get_future(self):
        if self.fut is None:
            fut = self.fut = _MovedFuture(self)
            self.work.get_future().add_done_callback(fut.settle)
        return self.fut


class _MovedFuture(torch.futures.Future):
    """The torch future of a call in flight, whose ``wait()`` moves the call itself. A
    future's callbacks run on the thread that sees its call finish - ringlet's progress
    thread - and one may wait on another call's future: DDP's PowerSGD hook waits, in a
    callback, for the all_reduce it has just started. Only the progress thread moved it,
    and it was the thread waiting: the rank hung for good."""

    def __init__(self, pending):
        super().__init__()
        self.pending = pending
        self.lock = threading.Lock()

    def settle(self, _=None) -> None:
        """Complete it, once, whichever thread comes first."""
        pending = self.pending
        with self.lock:
            if self.done():
                return
            if pending._complete() is None:
                self.set_result(pending.tensors)
            else:
                self.set_exception(pending.error)

    def wait(self):
        if not self.done():
            try:
                self.pending.work.wait()
            except Exception:   # noqa: BLE001 - the future carries it (settle)
                pass
            self.settle()
        return super().wait()


def _may_leave(opts) -> bool:
    """Whether an async call may return in flight at all: not when its caller waits at once
    (torch's Python collectives with ``async_op=False``), nor from a callback that runs as
    a backward pass ends (DDP's reducer reads its futures right after, and crashes on a
    failed one: torch 2.13, ``parseCppCommHookResult``). From a hook inside backward it
    may: ``_join`` makes the pass end on it first."""
    return opts.asyncOp and (torch._C._current_graph_task_id() == -1 or
                             torch._C._current_autograd_node() is not None)


# An async call that cannot overlap is driven in the call until done - or until nothing
# has moved for this long: its peers are busy elsewhere, maybe waiting for what this
# rank's caller does next (a send after an async all_reduce, a call on another group), and
# completing it here would deadlock a program that is correct under Gloo.
STALL = 0.02


def _can_overlap(group) -> bool:
    """Whether calls on ``group`` stay in flight (``runtime.can_overlap``);
    ``RINGLET_TORCH_ASYNC=always|never`` decides instead."""
    choice = os.environ.get("RINGLET_TORCH_ASYNC", "auto")
    if choice in ("always", "never"):
        return choice == "always"
    return runtime.can_overlap(group)


_joining: dict = {}   # backward pass (graph task id) -> the works it must wait for


def _join(work):
    """Make the running backward pass wait for ``work`` before it ends: the first call of a
    pass queues a callback, which runs before DDP's own (callbacks run in the order queued,
    and DDP queues its one after its first call) and raises the first error among the
    pass's works - so DDP never reads a failed future, and the error rises from backward."""
    task = torch._C._current_graph_task_id()
    works = _joining.get(task)
    if works is None:
        works = _joining[task] = []
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: _end_of_backward(task))
    works.append(work)


def _end_of_backward(task):
    error = None
    for w in _joining.pop(task, ()):
        try:
            w.wait()
        except Exception as exc:   # noqa: BLE001 - every work waited for, the first error raised
            error = error or exc
    if error is not None:
        raise error


class _P2P(_Work):
    """A send or receive in flight: ``wait()`` drives it (torch waits on every p2p work,
    and a ring of isend/irecv needs every one posted before any completes). A wait that
    times out (``wait(timeout)``) raises and leaves it posted, for a later wait."""

    def __init__(self, name: str, request, tensor, copy_back=None):
        def finish():
            request.wait()
            if copy_back is not None:
                copy_back()
        super().__init__(finish, [tensor], name)
        self.request = request

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if timeout is not None else 0
        if self.finish is not None and seconds > 0 and not self.request.is_completed():
            try:
                with _row(self.name):
                    self.request.wait(seconds)
            except TimeoutError:      # this wait's time is up: the operation goes on
                raise
            except Exception:         # noqa: BLE001 - it failed: finish() raises it again
                pass
        return super().wait()

    def is_completed(self):
        if self.finish is not None and self.request.is_completed():
            try:
                self.wait()           # (its copy back: what the caller reads next)
            except Exception:         # noqa: BLE001 - kept for wait()
                pass
        return self.finish is None


# -- tensors --------------------------------------------------------------------------------
def _dense(t: torch.Tensor):
    """(contiguous tensor ringlet can use in place, write-back or None)."""
    if not t.is_cpu:
        raise TypeError(f"the ringlet backend moves CPU tensors only, got one on {t.device}; "
                        f"use \"cpu:ringlet,cuda:nccl\" for mixed jobs")
    if t.is_contiguous():
        return t, None
    c = t.contiguous()
    return c, lambda: t.copy_(c)


# A large all_reduce among ranks of one host sends from shared memory, where a local peer
# reads each message in place: one copy fewer per message than through the shm ring. A DDP
# bucket, the second time it is all-reduced, moves to shared memory for good (_adopted).
# Another tensor goes as it is: copied into a staging buffer (rl.empty) and back, it had
# paid under load (2026-12-03, load 6: 25 MB 11.7 -> 6.3 ms), but on a quiet host it took
# as long (p = 3, 8 MiB) or longer, up to 3x (2026-12-05, p = 2, 3, 4; 6 MB, 8 MiB, 25 MB,
# 4 blocks each in one job: 8 MiB at p = 2 0.61-0.73 ms plain, 1.90-3.34 staged).
STAGE_MIN = 4 << 20
_seen = weakref.WeakSet()   # storages all-reduced once (the next time, adopted)
# RINGLET_TORCH_ADOPT=0: never move a storage torch owns (DDP's buckets) into shared memory,
# which makes it not resizable; its all-reduces then go as other tensors do.
# (Buckets a Python comm hook passes to dist.all_reduce are never moved: a hook may resize
# its bucket, as torch's batched PowerSGD pads it.)
ADOPT = os.environ.get("RINGLET_TORCH_ADOPT", "1") != "0"
_C10D_ALL_REDUCE = inspect.unwrap(dist.all_reduce).__code__   # (under torch's logging wrapper)


def _adopted(t: torch.Tensor, may_move: bool = True) -> bool:
    """Whether contiguous ``t`` lies in shared memory a local peer reads in place: rl.empty's,
    torch's (``t.share_memory_()``), or a storage a backward pass all-reduced before (DDP's
    buckets, reused every step), moved there now by torch's ``share_memory_`` - in place, so
    every tensor viewing it stays valid - if ``may_move``. Not one whose memory was handed
    out meanwhile (``.numpy()``, ``from_numpy``: then torch marks it not resizable), nor a
    storage mostly of other tensors."""
    st = t.untyped_storage()
    fd_sharing = torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    if st.is_shared() and fd_sharing:
        if buffers.locate(_array(t)) is None:   # (the first time: one fd, no copy)
            fd, size = st._share_fd_cpu_()
            buffers.adopt(st.data_ptr(), size, fd, st)
        return True
    if st in _seen:
        _seen.discard(st)
        if st.resizable() and ADOPT and may_move:   # (nobody took its memory since)
            st.share_memory_()
            fd, size = st._share_fd_cpu_()
            buffers.adopt(st.data_ptr(), size, fd, st)
            return True
        return False
    if st.resizable() and 2 * t.numel() * t.element_size() > st.nbytes() and fd_sharing and \
            torch._C._current_graph_task_id() != -1:
        _seen.add(st)
        return False
    return buffers.locate(_array(t)) is not None


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, by ringlet's own copy where both are contiguous: torch's splits a
    large tensor over its intra-op threads, which ranks that fill the cores fight over (8 MiB
    took 6.6 ms a copy under `ringlet run -n 2` on 2 cores, and its all_reduce 16 ms against
    2.4 with OMP_NUM_THREADS=1; mpirun and srun set no OMP_NUM_THREADS either)."""
    if dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype and \
            dst.numel() == src.numel():
        copies.copy(_array(dst), _array(src))
    else:
        dst.copy_(src)


def _reducible(t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """Complex tensors reduce as pairs of reals: SUM, AVG and PREMUL_SUM (a SUM here) are
    elementwise on them; a product or an order is not, and is refused (as torch refuses it
    for all_reduce itself), before any byte moves."""
    if not t.is_complex():
        return t
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"the ringlet backend cannot reduce complex tensors with {op.name}: "
                         f"only SUM, AVG and PREMUL_SUM (a complex product or order is not "
                         f"taken part by part)")
    return torch.view_as_real(t)


def _array(t: torch.Tensor):
    """A CPU, contiguous tensor's memory as an ndarray (what ringlet's calls take fastest)."""
    return tensor_array(t.detach() if t.requires_grad else t)


_SUM = dist.ReduceOp.SUM


def _op(redop):
    """(ringlet op, premultiply factor or None) of a torch ReduceOp."""
    if redop == _SUM:   # the common case, without reading pybind11 attributes
        return ReduceOp.SUM, None
    kind = (redop.op if isinstance(redop, dist.ReduceOp) else redop).value
    if kind not in _OPS:
        raise ValueError(f"the ringlet backend has no reduce op {redop}")
    return _OPS[kind], (redop.factor if kind == _PREMUL else None)


def _premul(t: torch.Tensor, factor, copy: bool) -> torch.Tensor:
    if factor is None:
        return t
    if not (t.is_floating_point() or t.is_complex()):
        # (every rank raises here, before any byte moves: a copy's product would turn
        # float and reduce, the in-place one fail, on the ranks of one call)
        raise ValueError(f"ReduceOp.PREMUL_SUM scales by a factor of any value: it needs "
                         f"floating-point or complex tensors, got {t.dtype}")
    return t * factor if copy else t.mul_(factor)


def _group_timeout(timeout) -> float | None:
    """Seconds a group's calls may wait, from the timeout torch passes its creator: the one
    given to init_process_group / new_group, or None - ringlet's own default (RINGLET_TIMEOUT,
    else 60 s) - when torch passes its 30-minute default (what it passes when none is given)."""
    if timeout is None or timeout == default_pg_timeout:
        return None
    return timeout.total_seconds()


def _spreader(outs, rows):
    """What copies row r of ``rows`` into ``outs[r]``, once the rows have arrived."""
    def spread():
        for o, r in zip(outs, rows):
            _copy(o, r.view(o.shape))
    return spread


def _one(tensors, what):
    if len(tensors) != 1:
        raise ValueError(f"ringlet {what}: one CPU tensor per rank, got {len(tensors)}")
    return tensors[0]


def _per_rank(tensors, p: int, what: str, numel: int | None = None):
    """``tensors``, a list of one per rank of the group (of ``numel`` elements each, if
    given), or ValueError: a list of another length had gathered into fewer or more tensors
    than the ranks, silently (Gloo refuses it)."""
    if len(tensors) != p:
        raise ValueError(f"ringlet {what}: expected a list of {p} tensors (one per rank of the "
                         f"group), got {len(tensors)}")
    for i, t in enumerate(tensors):
        if numel is not None and t.numel() != numel:
            raise ValueError(f"ringlet {what}: tensor {i} of the list has {t.numel()} elements, "
                             f"where each rank's has {numel} (shape {tuple(t.shape)})")
    return tensors


def _refusing(name: str, numbers=1):
    """A process group method running ringlet's ``name``: where it fails before its call
    took a number in the group's sequence (its own checks, torch's tensor ops on the
    arguments), it gives up the numbers that call would have taken (``numbers``, or the
    answer of the method of that name for the arguments), as ringlet's own checks do
    (collectives.refuse): the other ranks' calls fail at once, saying this rank refused
    them, and every rank's next call pairs again. (Before: a list of the wrong length on
    one rank left the calls after it a call apart.) Taken or not is read off the group's
    sequence number, not where the error came from: a check inside the call's lambda (a
    complex tensor's MAX) is one before its number too."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kw):
            seq = self.group.seq
            try:
                return method(self, *args, **kw)
            except (ValueError, TypeError, IndexError, RuntimeError) as exc:
                if name == "reduce_scatter" and hasattr(exc, "add_note") \
                        and isinstance(exc, CollectiveMismatch) and "all_reduce" in str(exc):
                    # (the user called a reduce_scatter: say why an all_reduce's counts)
                    exc.add_note(
                        "ringlet: torch's reduce_scatter ran here as " +
                        ("all_reduces in Gloo's order (RINGLET_TORCH_ORDER=gloo), " +
                         ("one per rank's block: the counts above are a block's"
                          if method.__name__ == "reduce_scatter" else
                          "one of its whole input: the counts above are the whole inputs'")
                         if "gloo_ring" in str(exc) else
                         "one all_reduce of the ranks' inputs of uneven sizes laid end to end: "
                         "the counts above are their sum"))
                if not getattr(exc, "_ringlet_refused", False) and self.group.seq == seq:
                    try:
                        n = getattr(self, numbers)(*args, **kw) if isinstance(numbers, str) \
                            else numbers
                    except Exception:      # (arguments too broken to tell: one call)
                        n = 1
                    C.refuse(name, exc, self.group, n)
                raise
        return call
    return wrap


def _promoted(tensors) -> torch.dtype:
    """The dtype torch.cat gives ``tensors``."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))


class _Scratch:
    """The tensors one call of this backend allocates, fills and reads itself (a gathered
    result it spreads into the caller's list, a flattened or stacked input): when large and
    every peer reads in place, lent from ringlet's reused shared memory (``buffers.lend``),
    so local peers read their messages there - one copy fewer, for free, as the caller's
    tensors cannot be (all_gather p = 2 8 MiB into an rl.empty result: 1.5x) - else torch's.
    ``done(then)`` gives them back after ``then``, once the call is over. Only for calls
    where every rank has them: algorithm="auto" picks for the kind of buffers passed, so a
    root's alone (gather's result, scatter's input) would have the ranks pick apart."""
    __slots__ = ("shared", "lent")

    def __init__(self, shared: bool):
        self.shared, self.lent = shared, []

    def empty(self, shape, dtype) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        if not self.shared or n <= ZERO_COPY_MIN:
            return torch.empty(shape, dtype=dtype)
        buf = buffers.lend(n)
        self.lent.append(buf)
        return torch.from_numpy(buf[:n]).view(dtype).view(shape)

    def cat(self, tensors, dim=0) -> torch.Tensor:
        """torch.cat of ``tensors`` (one-dimensional, or all of one shape but along
        ``dim``) into one of these, of the dtype torch.cat gives them."""
        shape = list(tensors[0].shape)
        shape[dim] = sum(t.shape[dim] for t in tensors)
        with torch.no_grad():   # (out= refuses tensors that require grad; values are all we send)
            return torch.cat(tensors, dim=dim, out=self.empty(tuple(shape), _promoted(tensors)))

    def flatten(self, tensors) -> torch.Tensor:
        if not tensors:
            return torch.empty(0)
        return self.cat([t.reshape(-1) for t in tensors])

    def gathered(self, p: int, rank: int, tensors) -> tuple[torch.Tensor, torch.Tensor]:
        """(an all_gather's result, p rows, and its row ``rank``: ``tensors`` flattened into
        it, the call's input). An in-place all_gather: the input in shared memory too, so
        every message of every algorithm is read in place, and every rank passes buffers
        of one kind, as algorithm="auto" needs (an rl.empty result with the caller's input
        had p = 3 pick recursive doubling over direct, 0.85x)."""
        if not tensors:
            return torch.empty((p, 0)), torch.empty(0)
        res = self.empty((p, sum(t.numel() for t in tensors)), _promoted(tensors))
        row = res[rank]
        with torch.no_grad():
            torch.cat([t.reshape(-1) for t in tensors], out=row)
        return res, row

    def stack(self, tensors) -> torch.Tensor:
        with torch.no_grad():
            return torch.stack(tensors, out=self.empty((len(tensors),) + tuple(tensors[0].shape),
                                                       tensors[0].dtype))

    def done(self, then=None):
        """What the call runs once it is over: ``then``, and the lent memory given back."""
        if not self.lent:
            return then

        def finish():
            if then is not None:
                then()
            for buf in self.lent:
                buffers.give_back(buf)
        return finish


def _unflatten_into(flat, tensors):
    off = 0
    for t in tensors:
        _copy(t, flat[off:off + t.numel()].view(t.shape))
        off += t.numel()


# -- the process group ----------------------------------------------------------------------
class ProcessGroup(dist.ProcessGroup):
    """torch.distributed's process group over one ringlet group."""

    def __init__(self, group, rank: int, size: int, owns_world: bool = False,
                 timeout: float | None = None):
        super().__init__(rank, size)
        self.group, self.owns_world = group, owns_world
        self.timeout = timeout   # seconds a call may wait (None: ringlet's default)
        # From three ranks on, a float sum's bits depend on how its additions are grouped:
        # reduce as Gloo does, so a job gets the same bits on either backend.
        self.gloo_order = size > 2 and os.environ.get("RINGLET_TORCH_ORDER", "gloo") == "gloo"
        self.overlaps = _can_overlap(group)
        # RINGLET_TORCH_ASYNC=never: every async call completes before it returns (a
        # program whose peers need something from it first then waits out its timeout)
        self.never = os.environ.get("RINGLET_TORCH_ASYNC") == "never"
        # every peer reads a send from shared memory in place (one host, shm transport)
        peers = runtime.engine().peers
        self.in_place = all(getattr(peers.get(w), "zero_copy", False)
                            for w in group.ranks if w != group.ranks[group.rank])

    def _timeout(self, opts) -> float | None:
        """The call's own timeout if torch passed one (it is -1 ms unless set), else the
        group's."""
        t = opts.timeout
        return t.total_seconds() if t.days >= 0 and t else self.timeout

    def _algorithm(self, t: torch.Tensor) -> str:
        """The all_reduce or reduce algorithm for ``t``: Gloo's ring for floats when ordered
        as Gloo."""
        return "gloo_ring" if self.gloo_order and (t.is_floating_point() or t.is_complex()) \
            else "auto"

    def shutdown(self):
        """dist.destroy_process_group: leave ringlet if torch's world started it."""
        if self.owns_world:
            runtime.destroy()
        elif self.group.id != 0:
            runtime.drop_group(self.group)

    abort = shutdown

    def getBackendName(self):
        return NAME

    def _get_backend_name(self):
        return NAME

    def __repr__(self):
        return f"<ringlet torch ProcessGroup over {self.group!r}>"

    # torch's name and description of the group (DeviceMesh and the functional
    # collectives find groups by name); the C++ base keeps them in backends it has none of.
    _name = _desc = ""

    def _set_group_name(self, name):
        self._name = name

    def _set_group_desc(self, desc):
        self._desc = desc

    setGroupName, setGroupDesc = _set_group_name, _set_group_desc

    def getGroupName(self):
        return self._name

    def getGroupDesc(self):
        return self._desc

    group_name = property(getGroupName)
    group_desc = property(getGroupDesc)

    def _issue(self, name, opts, result, call, then=None):
        """Run ``call(async_op)`` - one ringlet call of collective ``name`` - the way the
        caller can take it: to the end, for a caller that waits at once (it gets None) or
        a callback that ends a backward pass (a completed Work, or the error raised here);
        in flight otherwise (a pending Work) - where it cannot overlap, once driven here
        while it moves (``STALL``): done then, a completed Work or the error raised here."""
        def run():
            call(False)
            if then is not None:
                then()
        if not opts.asyncOp:
            if _profiling():
                with _row(name):
                    run()
            else:   # (the common call: no context manager to enter)
                run()
            return None
        if not _may_leave(opts) or self.never:
            return _completed(name, run, result)
        with _row(name):
            work = _Pending(call(True), result, then)
            # in flight at once where it overlaps the caller's compute and a progress
            # thread moves it; elsewhere driven here first
            at_once = self.overlaps and runtime.engine().background.on
            if not at_once and work.work.drive_while_moving(STALL):
                if work._complete() is not None:   # (done here: its error from the call)
                    raise work.error
                return work
        if torch._C._current_graph_task_id() != -1:
            _join(work)
        return work

    # reductions
    @_refusing("all_reduce")
    def allreduce(self, tensors, opts=c10d.AllreduceOptions()):
        t = _one(tensors, "allreduce")
        op, factor = _op(opts.reduceOp)
        big = self.in_place and t.numel() * t.element_size() > STAGE_MIN and t.is_cpu
        # (a bucket DDP's reducer all-reduces itself, called from C++: one a Python comm
        # hook passes, through torch's API, it may resize - batched PowerSGD pads it)
        if big and t.is_contiguous() and \
                _adopted(t, sys._getframe(2).f_code is not _C10D_ALL_REDUCE):   # (2: _refusing)
            buf, back = t, None
        else:
            buf, back = _dense(t)
        arr = _array(_reducible(_premul(buf, factor, False), op))
        algorithm, timeout = self._algorithm(t), self._timeout(opts)
        return self._issue("all_reduce", opts, tensors, lambda a: C.all_reduce(
            arr, op, self.group, async_op=a, algorithm=algorithm, timeout=timeout), back)

    @_refusing("all_reduce")
    def allreduce_coalesced(self, tensors, opts=c10d.AllreduceCoalescedOptions()):
        op, factor = _op(opts.reduceOp)
        own = _Scratch(self.in_place)
        flat = _premul(own.flatten(tensors), factor, False)   # one call for all of them
        algorithm, timeout = self._algorithm(flat), self._timeout(opts)
        return self._issue("all_reduce", opts, tensors, lambda a: C.all_reduce(
            _reducible(flat, op), op, self.group, async_op=a, algorithm=algorithm, timeout=timeout),
            own.done(lambda: _unflatten_into(flat, tensors)))

    @_refusing("reduce")
    def reduce(self, tensors, opts=c10d.ReduceOptions()):
        op, factor = _op(opts.reduceOp)
        t = _one(tensors, "reduce")
        root, mine = opts.rootRank, self.group.rank == opts.rootRank
        buf, back = _dense(t)
        buf = _premul(buf, factor, not mine)
        timeout = self._timeout(opts)
        return self._issue("reduce", opts, tensors, lambda a: C.reduce(
            _reducible(buf, op), root, op, self.group, async_op=a,
            algorithm=self._algorithm(buf), timeout=timeout),
            back if mine else None)

    def _reduce_scatter(self, out, src, op, opts, result, owned=True, after=None):
        """``out`` = this rank's block of op over every rank's ``src`` (p blocks, contiguous;
        ``owned``: ours to overwrite), then ``after()``. Ordered as Gloo, it is Gloo's
        algorithm: the whole of ``src`` all-reduced by ``gloo_ring``, this rank's block kept."""
        buf, back = _dense(out)
        timeout = self._timeout(opts)
        gloo = self._algorithm(src) == "gloo_ring"
        if gloo and not owned:
            src = src.clone()

        def then():
            if gloo:
                buf.copy_(src.view(self.size(), -1)[self.group.rank].view(buf.shape))
            if back:
                back()
            if after:
                after()
        if gloo:
            call = lambda a: C.all_reduce(_reducible(src, op), op, self.group,  # noqa: E731
                                          async_op=a, algorithm="gloo_ring", timeout=timeout)
        else:
            call = lambda a: C.reduce_scatter(_reducible(buf, op), _reducible(src, op),  # noqa: E731
                                              op, self.group, async_op=a, timeout=timeout)
        return self._issue("reduce_scatter", opts, result, call,
                           then if gloo or back or after else None)

    @_refusing("reduce_scatter", "_reduce_scatter_numbers")
    def reduce_scatter(self, outputs, inputs, opts=c10d.ReduceScatterOptions()):
        op, factor = _op(opts.reduceOp)
        out, ins = _one(outputs, "reduce_scatter"), _one(inputs, "reduce_scatter")
        _per_rank(ins, self.size(), "reduce_scatter inputs")
        if ins[self.group.rank].numel() != out.numel():
            raise ValueError(f"ringlet reduce_scatter: the output has {out.numel()} elements, "
                             f"this rank's input (number {self.group.rank} of the list) "
                             f"{ins[self.group.rank].numel()}")
        own = _Scratch(self.in_place)
        if self.gloo_order and self._algorithm(out) == "gloo_ring":   # (even or uneven)
            return self._reduce_scatter_as_gloo(out, ins, op, factor, opts, outputs, own)
        if any(t.numel() != out.numel() for t in ins):
            # uneven (input i is rank i's size, as torch allows): the inputs laid end to
            # end are all-reduced, and this rank keeps its part
            flat = _premul(own.flatten(ins), factor, False)
            start = sum(t.numel() for t in ins[:self.group.rank])
            mine = flat[start:start + out.numel()].view(out.shape)
            algorithm, timeout = self._algorithm(flat), self._timeout(opts)
            return self._issue("reduce_scatter", opts, outputs, lambda a: C.all_reduce(
                _reducible(flat, op), op, self.group, async_op=a, algorithm=algorithm,
                timeout=timeout), own.done(lambda: _copy(out, mine)))
        flat = _premul(own.stack([t.reshape(out.shape) for t in ins]), factor, False)
        return self._reduce_scatter(out, flat, op, opts, outputs, after=own.done())

    def _reduce_scatter_numbers(self, outputs, inputs, opts=None):
        """The calls a list reduce_scatter makes (_refusing): Gloo's order runs one
        all_reduce per rank's block."""
        out = outputs[0] if len(outputs) == 1 else None
        return self.size() if out is not None and self.gloo_order and \
            self._algorithm(out) == "gloo_ring" else 1

    def _alltoall_numbers(self, out, inp, out_splits, in_splits, opts=None):
        """Uneven splits take two numbers (the table's all_gather, the exchange)."""
        return 2 if list(out_splits) or list(in_splits) else 1

    def _reduce_scatter_as_gloo(self, out, ins, op, factor, opts, outputs, own):
        """The list form in Gloo's order, as Gloo runs it: one all_reduce per block (Gloo's
        ring splits each block among the ranks, so one call over them all, split once,
        adds in another order), this rank's block kept."""
        blocks = [_premul(own.empty(t.shape, t.dtype).copy_(t), factor, False) for t in ins]
        arrays = [_array(_reducible(b, op)) for b in blocks]
        timeout = self._timeout(opts)

        def call(a):
            if a:
                works = [C.all_reduce(x, op, self.group, async_op=True, algorithm="gloo_ring",
                                      timeout=timeout) for x in arrays]
                return AllOf(runtime.engine(), works, "reduce_scatter")
            for i, x in enumerate(arrays):
                try:
                    C.all_reduce(x, op, self.group, algorithm="gloo_ring", timeout=timeout)
                except BaseException as exc:   # (the blocks after it: given up, as a whole)
                    C.abandon(self.group, len(arrays) - 1 - i, exc)
                    raise
            return None
        return self._issue("reduce_scatter", opts, outputs, call, own.done(
            lambda: _copy(out, blocks[self.group.rank].view(out.shape))))

    @_refusing("reduce_scatter")
    def _reduce_scatter_base(self, out, inp, opts=c10d.ReduceScatterOptions()):
        op, factor = _op(opts.reduceOp)
        src = _premul(inp.contiguous(), factor, True)
        return self._reduce_scatter(out, src, op, opts, [out], owned=factor is not None)

    @_refusing("reduce_scatter")
    def reduce_scatter_tensor_coalesced(self, outs, ins, opts=c10d.ReduceScatterOptions()):
        op, factor = _op(opts.reduceOp)
        p = self.size()
        # one call: rank i's block of the concatenation is its blocks of each
        own = _Scratch(self.in_place)
        flat = own.cat([_premul(i.reshape(p, -1), factor, True) for i in ins], dim=1)
        res = own.empty((flat.shape[1],), flat.dtype)
        return self._reduce_scatter(res, flat, op, opts, outs,
                                    after=own.done(lambda: _unflatten_into(res, outs)))

    # copies
    @_refusing("broadcast")
    def broadcast(self, tensors, opts=c10d.BroadcastOptions()):
        t = _one(tensors, "broadcast")
        buf, back = _dense(t)
        root, timeout = opts.rootRank, self._timeout(opts)
        return self._issue("broadcast", opts, tensors, lambda a: C.broadcast(
            buf, root, self.group, async_op=a, timeout=timeout), back)

    @_refusing("all_gather")
    def allgather(self, outputs, inputs, opts=c10d.AllgatherOptions()):
        outs, inp = _one(outputs, "allgather"), _one(inputs, "allgather")
        _per_rank(outs, self.size(), "all_gather outputs", inp.numel())
        own = _Scratch(self.in_place)
        res, src = own.gathered(self.size(), self.group.rank, [inp])
        timeout = self._timeout(opts)
        return self._issue("all_gather", opts, outputs, lambda a: C.all_gather(
            res, src, self.group, async_op=a, timeout=timeout), own.done(_spreader(outs, res)))

    @_refusing("all_gather")
    def _allgather_base(self, out, inp, opts=c10d.AllgatherOptions()):
        buf, back = _dense(out)
        src, timeout = inp if inp.is_contiguous() else inp.contiguous(), self._timeout(opts)
        return self._issue("all_gather", opts, [out], lambda a: C.all_gather(
            buf, src, self.group, async_op=a, timeout=timeout), back)

    @_refusing("all_gather")
    def allgather_coalesced(self, output_lists, inputs, opts=c10d.AllgatherOptions()):
        _per_rank(output_lists, self.size(), "all_gather_coalesced output lists")
        own = _Scratch(self.in_place)
        res, flat = own.gathered(self.size(), self.group.rank, inputs)
        timeout = self._timeout(opts)

        def spread():   # row r of the result is rank r's inputs, concatenated
            for outs, row in zip(output_lists, res):
                _unflatten_into(row, outs)
        return self._issue("all_gather", opts, output_lists, lambda a: C.all_gather(
            res, flat, self.group, async_op=a, timeout=timeout), own.done(spread))

    @_refusing("all_gather")
    def allgather_into_tensor_coalesced(self, outs, ins, opts=c10d.AllgatherOptions()):
        own, p, timeout = _Scratch(self.in_place), self.size(), self._timeout(opts)
        res, flat = own.gathered(p, self.group.rank, ins)

        def spread():   # one call; row r of the result is rank r's inputs, concatenated
            off = 0
            for o, i in zip(outs, ins):
                o.view(p, -1).copy_(res[:, off:off + i.numel()])
                off += i.numel()
        return self._issue("all_gather", opts, outs, lambda a: C.all_gather(
            res, flat, self.group, async_op=a, timeout=timeout), own.done(spread))

    @_refusing("gather")
    def gather(self, outputs, inputs, opts=c10d.GatherOptions()):
        inp, root, timeout = _one(inputs, "gather"), opts.rootRank, self._timeout(opts)
        src, res, spread = inp.contiguous(), None, None
        if self.group.rank == root:   # (torch's memory: see _Scratch)
            outs = _per_rank(_one(outputs, "gather"), self.size(), "gather outputs", inp.numel())
            res = torch.empty((self.size(),) + tuple(inp.shape), dtype=inp.dtype)
            spread = _spreader(outs, res)
        return self._issue("gather", opts, outputs, lambda a: C.gather(
            src, res, root, self.group, async_op=a, timeout=timeout), spread)

    @_refusing("scatter")
    def scatter(self, outputs, inputs, opts=c10d.ScatterOptions()):
        out, root, timeout = _one(outputs, "scatter"), opts.rootRank, self._timeout(opts)
        src = None
        if self.group.rank == root:   # (torch's memory: see _Scratch)
            ins = _per_rank(_one(inputs, "scatter"), self.size(), "scatter inputs", out.numel())
            src = torch.stack([t.reshape(out.shape) for t in ins])
        buf, back = _dense(out)
        return self._issue("scatter", opts, outputs, lambda a: C.scatter(
            buf, src, root, self.group, async_op=a, timeout=timeout), back)

    @_refusing("all_to_all_single", "_alltoall_numbers")
    def alltoall_base(self, out, inp, out_splits, in_splits, opts=c10d.AllToAllOptions()):
        buf, back = _dense(out)
        src, timeout = inp.contiguous(), self._timeout(opts)
        outs, ins = list(out_splits) or None, list(in_splits) or None
        return self._issue("all_to_all", opts, [out], lambda a: C.all_to_all_single(
            buf, src, outs, ins, self.group, async_op=a, timeout=timeout), back)

    @_refusing("all_to_all", 2)
    def alltoall(self, outs, ins, opts=c10d.AllToAllOptions()):
        dense = [_dense(o) for o in outs]
        srcs, timeout = [i.contiguous() for i in ins], self._timeout(opts)
        backs = [back for _, back in dense if back is not None]

        def copy_back():
            for back in backs:
                back()
        return self._issue("all_to_all", opts, outs, lambda a: C.all_to_all(
            [d for d, _ in dense], srcs, self.group, async_op=a, timeout=timeout),
            copy_back if backs else None)

    @_refusing("barrier")
    def barrier(self, opts=c10d.BarrierOptions()):
        timeout = self._timeout(opts)
        return self._issue("barrier", opts, [], lambda a: C.barrier(
            self.group, async_op=a, timeout=timeout))

    # torch 2.13's Python API calls these names; C++ callers (DDP, functional
    # collectives) the older ones above.
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # _coalescing_manager(device=...): each call inside already completed on its own.
    def _start_coalescing(self, device):
        pass

    def _end_coalescing(self, device):
        return _completed(None, lambda: None, [])

    # point-to-point
    def send(self, tensors, dst, tag):
        t = _one(tensors, "send")
        return _P2P("send", runtime.isend(t.contiguous(), dst, self.group, tag, self.timeout), t)

    def recv(self, tensors, src, tag):
        t = _one(tensors, "recv")
        buf, back = _dense(t)
        return _P2P("recv", runtime.irecv(buf, src, self.group, tag, self.timeout), t, back)

    def recv_anysource(self, tensors, tag):
        raise NotImplementedError("the ringlet backend receives from a named rank only: "
                                  "pass src= to recv/irecv")


# -- creation -------------------------------------------------------------------------------
_INITS = 0   # the worlds torch made here (each init_process_group with this backend)


def _token(store, rank: int, timeout: float) -> tuple[str, str]:
    """RINGLET_TOKEN, a launcher-derived token, or one derived from a job nonce rank 0 puts
    in torch's store (the store is not secret; the per-user secret mixed into it is)."""
    token, source = job_token()
    if token is not None:
        return token, source
    import secrets
    import datetime
    # (a key of its own each time: a next init_process_group on the same port shares the
    # last one's store, whose old nonce a rank could read before rank 0 sets the new one)
    global _INITS
    _INITS += 1
    key = f"ringlet/job/{_INITS}"
    if rank == 0:
        store.set(key, secrets.token_hex(16))
    store.wait([key], datetime.timedelta(seconds=timeout))
    job = store.get(key).decode()
    return derive_token(job), f"derived from this user's ringlet secret and job {job}"


def _world(store, rank: int, size: int, timeout: float, calls: float | None):
    """(ringlet's world group, whether torch started it). ``timeout``: for the store;
    ``calls``: the seconds ringlet's calls may wait (None: its default)."""
    owns = not runtime.is_initialized()
    if owns:
        token, source = _token(store, rank, timeout)
        backend = os.environ.get("RINGLET_BACKEND", "auto")
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if calls is None:
            calls = runtime.env_timeout()
        runtime.join(SignedStore(store, token, timeout=timeout, source=source), token, rank,
                     size, backend, calls, addr)
    world = runtime.resolve(None)
    if (world.rank, world.size) != (rank, size):
        raise RingletError(f"torch's world (rank {rank} of {size}) is not ringlet's, already "
                           f"initialized as rank {world.rank} of {world.size}")
    return world, owns


def _create(opts, backend_options=None):
    """torch calls this on each member of each group it creates with this backend."""
    rank, size = opts.group_rank, opts.group_size
    ranks = list(opts.global_ranks_in_group) or list(range(size))
    timeout, calls = opts.timeout.total_seconds(), _group_timeout(opts.timeout)
    if not dist.is_initialized():   # torch is creating its world (default) group
        _created.clear()
        world, owns = _world(opts.store, rank, size, timeout, calls)
        return ProcessGroup(world, rank, size, owns_world=owns, timeout=calls)
    # torch's group names can differ between members (a hashed name depends on the groups
    # each rank created before), so a group is its ranks and how many groups of those
    # ranks this rank has created: the same on every member.
    nth = _created.get(tuple(ranks), 0)
    _created[tuple(ranks)] = nth + 1
    return ProcessGroup(runtime.keyed_group(ranks, f"torch{ranks}#{nth}"), rank, size,
                        timeout=calls)


_created: dict = {}   # rank list -> torch groups of those ranks created here (since init)


def _register():
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])


_register()
for _k, _v in torch_env().items():   # under mpirun / srun: torch's env:// then just works
    os.environ.setdefault(_k, _v)
