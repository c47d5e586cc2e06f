"""Data parallelism with gradient buckets (DDP's bucketing, with overlap).

    buckets = rl.train.GradBuckets(params, bucket_cap_mb=25)
    for i in reversed(range(len(params))):      # as backward produces them
        buckets.ready(i, grad_i)                # a full bucket starts its all_reduce now
    grads = buckets.wait()                      # one wait; the mean over ranks

Parameters are packed into buckets in reverse order (the order backward produces their
gradients), each bucket at most ``bucket_cap_mb`` (a parameter larger than the cap gets a
bucket of its own). A bucket whose gradients have all arrived starts an asynchronous
all_reduce at once, while the caller goes on computing earlier layers' gradients;
buckets start in bucket order on every rank (a full bucket waits for the ones before it),
so ranks that hand over gradients in different orders still issue the same collectives.
Where the ranks fill the host's cores nothing can overlap: buckets then wait for ``wait``.
Large buckets are ``rl.empty`` arrays: their messages are read in place by local peers.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..collectives import all_gather, all_reduce, broadcast
from ..ops import ReduceOp, bf16_to_f32, f32_to_bf16
from ..runtime import get_rank, resolve
from ..transport import copies
from .arrays import as_numbers
from .pricing import (Call, agree_on, averaging, buffer, hosts_of, label, overlaps, price,
                      shared_if_large)


BF16 = "bfloat16"


class _Bucket:
    __slots__ = ("indices", "buf", "wire", "gathered", "pending", "work", "label")

    def __init__(self, indices, count, dtype, wire_dtype, p):
        self.indices = indices
        self.label = 0      # (GradBuckets._agree sets it: the bucket's calls carry it)
        self.buf = buffer(count, dtype)
        self.pending = len(indices)
        self.work = None
        self.gathered = None
        if wire_dtype == BF16:
            self.wire = buffer(count, np.uint16)
            self.gathered = buffer(p * count, np.uint16).reshape(p, count)
        else:
            self.wire = self.buf if wire_dtype is None else buffer(count, wire_dtype)


class GradBuckets:
    """Average gradients across ``group`` in buckets that start communicating as soon as
    they fill. ``comm_hook``: None, or a narrower float dtype (``"float16"``) in which
    buckets travel: each rank divides by the group size, casts, sums in that dtype and
    casts back ("compression lowers g": half the bytes, fp16's precision).
    ``"bfloat16"``: each rank rounds its bucket to bfloat16 words, all_gathers the words and
    sums them in float32 in rank order - exact and bit-identical on every rank, bf16's
    range (no overflow), (p-1)*n*2 bytes sent per rank: fewer than a float32 ring
    all_reduce's 2(p-1)/p*n*4 only below 4 ranks.
    ``overlap``: whether buckets go on the wire as they fill, in flight while backward goes
    on (None: where that can overlap, :func:`ringlet.train.pricing.overlaps`; else each
    runs in ``wait``, completed in the call)."""

    def __init__(self, params, bucket_cap_mb: float = 25, group=None, comm_hook=None,
                 overlap: bool | None = None):
        self.group = resolve(group)
        self.overlap = overlaps(self.group, overlap)
        arrays = [as_numbers(p, f"params[{i}]") for i, p in enumerate(params)]
        if not arrays:
            raise ValueError("GradBuckets needs at least one parameter")
        for i, a in enumerate(arrays):
            if a.dtype.kind != "f":
                raise TypeError(f"params[{i}] has dtype {a.dtype}: gradients must be floats")
        self.shapes = [a.shape for a in arrays]
        self.wire_dtype = None if comm_hook is None else (
            BF16 if comm_hook == BF16 else np.dtype(comm_hook))
        if self.wire_dtype == BF16:
            bad = [i for i, a in enumerate(arrays) if a.dtype not in (np.float32, np.float64)]
            if bad:
                raise TypeError(f"comm_hook='bfloat16' rounds float32 or float64 gradients; "
                                f"params[{bad[0]}] is {arrays[bad[0]].dtype}")
        elif self.wire_dtype is not None and self.wire_dtype.kind != "f":
            raise TypeError(f"comm_hook must be a float dtype such as 'float16', got {comm_hook!r}")
        if bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
        cap = bucket_cap_mb * (1 << 20)
        self.buckets: list[_Bucket] = []
        self.slot: list = [None] * len(arrays)      # (bucket, view shaped like the param, flat view)
        group_: list[int] = []
        for i in reversed(range(len(arrays))):
            a = arrays[i]
            if group_ and (sum(arrays[j].nbytes for j in group_) + a.nbytes > cap
                           or arrays[group_[0]].dtype != a.dtype):
                self._add_bucket(group_, arrays)
                group_ = []
            group_.append(i)
        self._add_bucket(group_, arrays)
        self._agree(bucket_cap_mb, comm_hook)
        self._seen = [False] * len(arrays)           # gradient handed over this step
        self._held = [False] * len(arrays)           # slot holds this window's gradient
        self._next = 0                               # first bucket not yet started
        self._sync = True

    def _agree(self, cap_mb: float, comm_hook) -> None:
        """Every rank must cut the same buckets (else its collectives disagree with the
        others' and fail as a mismatch whose cause is not named): checked once, here."""
        # (each parameter's shape, in bucket order: ranks that listed parameters of one
        # bucket's size in another order, or another shape, averaged across them silently)
        layout = [[(self.shapes[i], b.buf.dtype.str) for i in b.indices] for b in self.buckets]
        base = agree_on(
            "GradBuckets", "cut different buckets", [b.buf.size for b in self.buckets], layout,
            (float(cap_mb), str(comm_hook)), self.group,
            f"bucket_cap_mb={cap_mb}, comm_hook={comm_hook!r}, dtypes "
            f"{sorted({b.buf.dtype.name for b in self.buckets})}",
            "pass the same parameters, in the same order and shapes, bucket_cap_mb and "
            "comm_hook on every rank")
        for k, b in enumerate(self.buckets):
            b.label = label(base, k)

    @classmethod
    def for_module(cls, module, bucket_cap_mb: float = 25, group=None, comm_hook=None,
                   overlap: bool | None = None):
        """Buckets for a torch module's trainable parameters, fed by their backward as DDP
        is: each parameter's gradient is handed over the moment it is accumulated, and
        ``wait()`` writes the mean gradients back into ``.grad``, ready for the torch
        optimizer's step. Inside ``no_sync`` torch accumulates ``.grad`` itself, as with
        DDP (do not zero it between the micro-batches). As DDP, it first makes every rank's
        parameters and buffers group rank 0's: each process initializes its own module, and
        replicas that started apart would stay apart while their mean gradients agree."""
        params = [q for q in module.parameters() if q.requires_grad]
        gb = cls([q.detach() for q in params], bucket_cap_mb, group, comm_hook, overlap)
        import torch
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                if t.numel():
                    held = t.detach()
                    dense = held if held.is_contiguous() else held.contiguous()
                    broadcast(dense, 0, group=gb.group)
                    if dense is not held:
                        held.copy_(dense)
        for i, q in enumerate(params):
            q.register_post_accumulate_grad_hook(lambda q, i=i: gb._accumulated(i, q.grad))
        gb._torch_params = params
        return gb

    _torch_params = None

    def _add_bucket(self, indices, arrays):
        count = sum(arrays[i].size for i in indices)
        b = _Bucket(tuple(indices), count, arrays[indices[0]].dtype, self.wire_dtype,
                    self.group.size)
        off = 0
        for i in indices:
            flat = b.buf[off:off + arrays[i].size]
            self.slot[i] = (b, flat.reshape(arrays[i].shape), flat)
            off += arrays[i].size
        self.buckets.append(b)

    def ready(self, i: int, grad) -> None:
        """Hand over parameter ``i``'s gradient (copied into its bucket; inside
        :meth:`no_sync`, or after one there, added to what is there)."""
        if not isinstance(i, (int, np.integer)) or not 0 <= i < len(self.slot):
            raise IndexError(f"GradBuckets.ready: parameter index {i!r} outside 0..{len(self.slot) - 1}")
        g = grad if type(grad) is np.ndarray else as_numbers(grad, f"gradient of parameter {i}")
        bucket, view, flat = self.slot[i]
        if g.size != flat.size:
            raise ValueError(f"GradBuckets.ready: gradient of parameter {i} has {g.size} elements, "
                             f"the parameter {view.size} (shape {view.shape})")
        seen = self._seen
        if self._sync and seen[i]:
            raise RuntimeError(f"rank {get_rank()}: GradBuckets.ready: parameter {i} handed over "
                               f"twice in one step (its bucket may already be on the wire); "
                               f"add shared gradients up before calling ready")
        if self._held[i]:
            view += g.reshape(view.shape)
        else:
            src = g.reshape(-1)
            # A slot starts at any element of its bucket, so some lie a few bytes past their
            # gradient's page offset, where memcpy crawls (transport/copies.py).
            if src.dtype == flat.dtype and src.flags.c_contiguous:
                copies.assign(flat, src)
            else:
                flat[...] = src
            self._held[i] = True
        if not self._sync:
            return
        seen[i] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            buckets = self.buckets
            while self._next < len(buckets) and buckets[self._next].pending == 0:
                self._start(buckets[self._next])
                self._next += 1

    def _accumulated(self, i: int, grad) -> None:
        """``ready`` for a torch parameter's ``.grad``: torch adds each backward's gradient
        to it (across ``no_sync`` micro-batches too), so it replaces what the bucket holds."""
        self._held[i] = False
        self.ready(i, grad)

    def _start(self, b: _Bucket) -> None:
        """Put a full bucket on the wire now, or (where nothing can overlap) leave it for
        ``wait``, which runs every bucket back to back, completed in the call."""
        if self.overlap:
            b.work = self._launch(b, True)

    def _launch(self, b: _Bucket, async_op: bool):
        if b.gathered is not None:
            f32_to_bf16(b.buf.astype(np.float32, copy=False), b.wire)
            return all_gather(b.gathered, b.wire, group=self.group, async_op=async_op,
                              label=b.label)
        if b.wire is b.buf:
            return all_reduce(b.buf, averaging(b.buf, self.group.size), group=self.group,
                              async_op=async_op, label=b.label)
        np.multiply(b.buf, 1.0 / self.group.size, out=b.wire, casting="same_kind")
        return all_reduce(b.wire, ReduceOp.SUM, group=self.group, async_op=async_op,
                          label=b.label)

    def wait(self) -> list[np.ndarray]:
        """Wait for every bucket; return each parameter's mean gradient over the group
        (views into the buckets, valid until the next step's first ``ready``)."""
        if not self._sync:
            raise RuntimeError("GradBuckets.wait inside no_sync(): nothing is being communicated")
        missing = [i for i, seen in enumerate(self._seen) if not seen]
        if missing:
            raise RuntimeError(f"rank {get_rank()}: GradBuckets.wait: parameter(s) "
                               f"{missing[:10]} got no gradient this step; call "
                               f"ready(i, grad) for every parameter (zeros for unused ones)")
        for b in self.buckets:
            if b.work is None:
                self._launch(b, False)
            else:
                b.work.wait()
            if b.gathered is not None:
                total = bf16_to_f32(b.gathered[0])
                for r in range(1, self.group.size):
                    total += bf16_to_f32(b.gathered[r])
                total /= np.float32(self.group.size)
                np.copyto(b.buf, total, casting="same_kind")
            elif b.wire is not b.buf:
                np.copyto(b.buf, b.wire, casting="same_kind")
            b.work, b.pending = None, len(b.indices)
        self._seen = [False] * len(self.slot)
        self._held = [False] * len(self.slot)
        self._next = 0
        out = [view for _, view, _ in self.slot]
        if self._torch_params is not None:
            import torch
            for q, g in zip(self._torch_params, out):
                q.grad.copy_(torch.from_numpy(g))
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: inside, ``ready`` adds gradients to the buckets without
        communicating; the next step's gradients are added to them and averaged."""
        if any(self._seen):
            raise RuntimeError("GradBuckets.no_sync entered in the middle of a step")
        self._sync = False
        try:
            yield self
        finally:
            self._sync = True

    def calls(self) -> list[Call]:
        """The collectives of one step, for :func:`ringlet.train.pricing.price`."""
        p = self.group.size
        return [Call("all_gather", b.gathered.nbytes, p, 2, label=f"bucket {k} bf16",
                     shared=shared_if_large("all_gather", b.gathered.nbytes, p, "in", "out"))
                if b.gathered is not None else
                Call("all_reduce", b.wire.nbytes, p, b.wire.dtype.itemsize, label=f"bucket {k}",
                     shared=shared_if_large("all_reduce", b.wire.nbytes, p, "buf"),
                     dtype=b.wire.dtype)
                for k, b in enumerate(self.buckets)]

    def price(self, topology=None):
        """Communication per step on ``topology`` (see :func:`ringlet.train.pricing.price`)."""
        return price(self.calls(), topology, hosts_of(self.group))
