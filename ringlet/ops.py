"""Reduce operations, the dtypes they accept, and buffer checks shared by every call."""
from __future__ import annotations

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


def as_op(op) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.upper() in ReduceOp.__members__:
        return ReduceOp[op.upper()]
    raise ValueError(f"unknown reduce op {op!r}; valid: {', '.join(ReduceOp.__members__)}")


@functools.lru_cache(maxsize=256)
def check_op_dtype(op: ReduceOp, dtype: np.dtype) -> None:
    """Reject an op that makes no sense for the dtype (BAND on floats, AVG on integers)."""
    kind = dtype.kind
    if kind not in "biuf":
        raise TypeError(f"cannot reduce dtype {dtype}: only bool, integer and float arrays reduce")
    if op in _BITWISE and kind == "f":
        raise TypeError(f"ReduceOp.{op.name} needs an integer or bool dtype, not {dtype}; "
                        f"use SUM/PROD/MIN/MAX/AVG for floats")
    if op is ReduceOp.AVG and kind != "f":
        raise TypeError(f"ReduceOp.AVG needs a float dtype, not {dtype}; "
                        f"reduce with SUM and divide, or cast to float first")


def as_array(buf, name: str = "buffer", writable: bool = False) -> np.ndarray:
    """View a NumPy array or CPU torch tensor as a C-contiguous ndarray without copying;
    reject what the runtime cannot move in place."""
    arr = buf
    if type(arr) is np.ndarray and arr.flags.c_contiguous and not arr.dtype.hasobject and (
            arr.flags.writeable or not writable):
        return arr
    if not isinstance(arr, np.ndarray):
        mod = type(arr).__module__
        if mod.startswith("torch"):
            if arr.device.type != "cpu":
                raise TypeError(f"{name}: only CPU torch tensors are supported, got device {arr.device}")
            if not arr.is_contiguous():
                raise ValueError(f"{name}: torch tensor must be contiguous (call .contiguous())")
            arr = arr.detach().numpy()
        else:
            raise TypeError(f"{name}: expected a NumPy array or CPU torch tensor, got {type(buf).__name__}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: array must be C-contiguous (use np.ascontiguousarray)")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name}: array is read-only but this call writes into it")
    if arr.dtype.hasobject:
        raise TypeError(f"{name}: object arrays cannot be sent; use a numeric dtype")
    return arr
