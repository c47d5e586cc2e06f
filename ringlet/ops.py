"""Reduce operations, the dtypes they accept, and buffer checks shared by every call."""
from __future__ import annotations

import ctypes
import enum
import functools

import numpy as np


class ReduceOp(enum.Enum):
    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    # Members are singletons, so identity hashing agrees with equality; it is computed in C
    # where Enum's own __hash__ is a Python call (every collective call hashes its op).
    __hash__ = object.__hash__


# AVG reduces with add; the runtime divides by the group size afterwards.
UFUNC = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum,
         ReduceOp.MAX: np.maximum, ReduceOp.AVG: np.add, ReduceOp.BAND: np.bitwise_and,
         ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}

_BITWISE = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}

# bfloat16 (torch's; NumPy has none): moved as 16-bit words, reduced as torch reduces it —
# each step in float32, rounded back to nearest-even — so every rank gets the same bits.
BFLOAT16 = np.dtype([("bfloat16", "<u2")])


def bf16_to_f32(words: np.ndarray) -> np.ndarray:
    return (words.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray, out: np.ndarray) -> None:
    """Round float32 ``x`` to bfloat16: nearest, ties to even; NaN -> 0xFFFF, as torch's
    vectorised CPU kernels give it."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    words = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    words[np.isnan(x)] = 0xFFFF
    out.view(np.uint16)[...] = words


class Bfloat16Reduce:
    """``ufunc(a, b, out=)`` on bfloat16 words: the reference the C kernels match
    (transport.fast.CReduce reduces in their place)."""

    def __init__(self, ufunc):
        self.ufunc, self.__name__ = ufunc, "bfloat16_" + ufunc.__name__

    def __call__(self, a, b, out):
        f32_to_bf16(self.ufunc(bf16_to_f32(a), bf16_to_f32(b)), out)


_BF16 = {op: Bfloat16Reduce(u) for op, u in UFUNC.items()}


def dtype_named(name) -> np.dtype:
    """A dtype by name, "bfloat16" included."""
    return BFLOAT16 if str(name) == "bfloat16" else np.dtype(name)


def dtype_name(dtype: np.dtype) -> str:
    """A dtype's name, "bfloat16" included (``dtype_named``'s inverse)."""
    return "bfloat16" if dtype == BFLOAT16 else dtype.name


def fill(a: np.ndarray, value) -> None:
    """``a[...] = value`` for every dtype here (bfloat16 values rounded as torch would)."""
    if a.dtype == BFLOAT16:
        f32_to_bf16(np.broadcast_to(np.asarray(value, np.float32), a.shape), a)
    else:
        a[...] = value


def values(a: np.ndarray) -> np.ndarray:
    """What ``a`` holds, as numbers (bfloat16 words as float32)."""
    return bf16_to_f32(a) if a.dtype == BFLOAT16 else a


def reducer(op: ReduceOp, dtype: np.dtype):
    """What combines two buffers of ``dtype`` under ``op``."""
    return _BF16[op] if dtype == BFLOAT16 else UFUNC[op]


def average(flat: np.ndarray, p: int) -> None:
    """Divide a reduced buffer by the group size in place (ReduceOp.AVG)."""
    if flat.dtype == BFLOAT16:
        f32_to_bf16(bf16_to_f32(flat) / np.float32(p), flat)
    else:
        np.true_divide(flat, p, out=flat)


def as_op(op) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.upper() in ReduceOp.__members__:
        return ReduceOp[op.upper()]
    raise ValueError(f"unknown reduce op {op!r}; valid: {', '.join(ReduceOp.__members__)}")


@functools.lru_cache(maxsize=256)
def check_op_dtype(op: ReduceOp, dtype: np.dtype) -> None:
    """Reject an op that makes no sense for the dtype (BAND on floats, AVG on integers)."""
    kind = "f" if dtype == BFLOAT16 else dtype.kind
    name = "bfloat16" if dtype == BFLOAT16 else str(dtype)    # (not its (name, <u2) record)
    if kind not in "biuf":
        raise TypeError(f"cannot reduce dtype {name}: only bool, integer, float and (with SUM "
                        f"or AVG) complex arrays reduce")
    if op in _BITWISE and kind == "f":
        raise TypeError(f"ReduceOp.{op.name} needs an integer or bool dtype, not {name}; "
                        f"use SUM/PROD/MIN/MAX/AVG for floats")
    if op is ReduceOp.AVG and kind != "f":
        raise TypeError(f"ReduceOp.AVG needs a float dtype, not {name}; "
                        f"reduce with SUM and divide, or cast to float first")


def as_real(arr: np.ndarray, op: ReduceOp, what: str) -> np.ndarray:
    """A complex array, flat, as its (real, imaginary) pairs: SUM and AVG act on each part
    alone (as torch's backends reduce complex tensors). A product or an order of complex
    numbers is not taken part by part, and is refused (as torch refuses it)."""
    if op is not ReduceOp.SUM and op is not ReduceOp.AVG:
        raise TypeError(f"{what}: cannot reduce complex dtype {arr.dtype} with ReduceOp."
                        f"{op.name}; only SUM and AVG reduce complex numbers")
    return arr.reshape(-1).view(arr.real.dtype)


def as_array(buf, name: str = "buffer", writable: bool = False) -> np.ndarray:
    """View a NumPy array or CPU torch tensor as a C-contiguous ndarray without copying;
    reject what the runtime cannot move in place."""
    arr = buf
    # (one flags object, not two: each costs 20 ns. carray: C-contiguous, writeable and
    # aligned - an unaligned array takes the checks below, which accept it)
    if type(arr) is np.ndarray and (arr.flags.carray if writable else arr.flags.c_contiguous) \
            and not arr.dtype.hasobject:
        return arr
    if not isinstance(arr, np.ndarray):
        mod = type(arr).__module__
        if mod.startswith("torch"):
            if not arr.is_cpu:
                raise TypeError(f"{name}: only CPU torch tensors are supported, got device {arr.device}")
            if not arr.is_contiguous():
                raise ValueError(f"{name}: torch tensor must be contiguous (call .contiguous())")
            arr = tensor_array(arr.detach() if arr.requires_grad else arr)
        else:
            raise TypeError(f"{name}: expected a NumPy array or CPU torch tensor, got {type(buf).__name__}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: array must be C-contiguous (use np.ascontiguousarray)")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name}: array is read-only but this call writes into it")
    if arr.dtype.hasobject:
        raise TypeError(f"{name}: object arrays cannot be sent; use a numeric dtype")
    return arr


_NUMPY_DTYPES: dict = {}   # torch dtype -> NumPy's (found by torch's own conversion, once)
_SPANS: dict = {}          # bytes -> the ctypes array type of that many


def tensor_array(t) -> np.ndarray:
    """A contiguous CPU tensor's memory as an ndarray; bfloat16 (which NumPy lacks) as
    BFLOAT16 words. Not by ``t.numpy()``: torch then marks the storage not resizable for
    good, and a tensor a call had moved could not be resized after (a comm hook padding its
    bucket, FSDP freeing a storage). A ctypes array over the memory, holding the tensor so
    the memory outlives the array: about 1 us against .numpy()'s 0.7, and the torch
    backend's 8 B all_reduce no slower (docs/results.md)."""
    dtype = _NUMPY_DTYPES.get(t.dtype)
    if dtype is None:
        import torch  # only ever reached with a torch tensor in hand
        dtype = BFLOAT16 if t.dtype == torch.bfloat16 else \
            torch.empty(0, dtype=t.dtype).numpy().dtype     # (raises for what NumPy lacks)
        _NUMPY_DTYPES[t.dtype] = dtype
    if dtype.kind == "c" and (t.is_conj() or t.is_neg()) or not t.is_contiguous():
        return t.numpy()   # (raises as torch does where the bits are not the values)
    n = t.numel() * dtype.itemsize
    span = _SPANS.get(n)
    if span is None:
        if len(_SPANS) > 4096:
            _SPANS.clear()
        span = _SPANS[n] = ctypes.c_char * n
    mem = span.from_address(t.data_ptr())
    mem.tensor = t
    arr = np.frombuffer(mem, dtype)
    return arr if t.dim() == 1 else arr.reshape(t.shape)
