"""What the training patterns compute on: NumPy arrays or CPU torch tensors, viewed as
ndarrays without a copy (``ops.as_array``), but not bfloat16 ones: NumPy has no bfloat16
arithmetic, so a pattern's sums and matrix products cannot run on them. The collectives
move bfloat16 themselves; a pattern says so before any byte moves instead of failing
inside NumPy."""
from __future__ import annotations

import numpy as np

from ..ops import BFLOAT16, as_array


def as_numbers(buf, name: str = "buffer", writable: bool = False) -> np.ndarray:
    """``buf`` as an ndarray to compute on. One the pattern only reads (and copies where
    it moves it) may be non-contiguous - an expert's output ``(W @ x.T).T``, a slice of
    columns -: it is made contiguous here instead of refused, as a collective refuses it."""
    if not writable:
        buf = _contiguous(buf)
    arr = as_array(buf, name, writable)
    if arr.dtype == BFLOAT16:
        raise TypeError(f"{name}: a bfloat16 tensor, which ringlet.train cannot compute on "
                        f"(NumPy has no bfloat16): pass float32 (GradBuckets(..., "
                        f"comm_hook='bfloat16') sends float32 gradients as bfloat16)")
    return arr


def _contiguous(buf):
    if isinstance(buf, np.ndarray):
        return buf if buf.flags.c_contiguous else np.ascontiguousarray(buf)
    if type(buf).__module__.startswith("torch") and not buf.is_contiguous():
        return buf.contiguous()
    return buf
