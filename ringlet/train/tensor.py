"""Megatron-style tensor parallelism: a linear layer's weight split over a group.

* :class:`ColumnParallelLinear`: rank r holds columns block r of W (in x out) and of b;
  forward computes its block of the output (an all_gather joins the blocks, unless the
  next layer takes them split); backward all_reduces the input gradient (each rank's
  block contributes a part of it).
* :class:`RowParallelLinear`: rank r holds rows block r of W; forward multiplies its block
  of the input and all_reduces the partial outputs, then adds b; backward gives each rank
  its block of the input gradient (all_gathered if the input was not split).

Column(gather_output=False) followed by Row(input_is_parallel=True) is Megatron's MLP:
one all_reduce forward, one backward. Layers hold their gradients in ``.grads`` (this
rank's blocks), for a data-parallel group to average.
"""
from __future__ import annotations

import numpy as np

from ..collectives import all_gather, all_reduce
from ..runtime import get_rank, resolve
from .arrays import as_numbers
from .pricing import Call, digest, disagreement, hosts_of, price


def _block(n: int, p: int, r: int, what: str) -> slice:
    if n % p:
        raise ValueError(f"{what} ({n}) must divide evenly over the {p} ranks of the group")
    return slice(r * n // p, (r + 1) * n // p)


def _agree(layer: str, w: np.ndarray, bias, flag: str, value: bool, group) -> None:
    """Every rank must build the layer from the same full weight: a rank whose weight has
    other columns (rows) would take another block and every collective would still agree,
    joining blocks of different layers, silently. Checked once, here, on every rank."""
    if w.ndim != 2:
        raise ValueError(f"rank {get_rank()}: {layer}: weight must be 2-D (in, out), got "
                         f"shape {w.shape}")
    b = None if bias is None else np.shape(bias)
    every = disagreement([*w.shape, digest((b, w.dtype.str, value))], group)
    if every is not None:
        said = "; ".join(f"rank {r}: weight {tuple(v[:-1])}" for r, v in enumerate(every))
        raise ValueError(f"rank {get_rank()}: {layer}: the ranks passed different layers "
                         f"({said}; here bias {b}, dtype {w.dtype}, {flag}={value}): pass the "
                         f"same full weight, bias and {flag} on every rank of the group")


def _join_columns(local: np.ndarray, p: int, group) -> np.ndarray:
    """(T, out/p) blocks of every rank -> (T, out)."""
    parts = np.empty((p,) + local.shape, local.dtype)
    all_gather(parts, np.ascontiguousarray(local), group=group)
    return np.moveaxis(parts, 0, -2).reshape(local.shape[:-1] + (p * local.shape[-1],))


class ColumnParallelLinear:
    """y = x W + b, W's columns split over ``group``. ``weight`` (in, out) and ``bias`` (out,)
    are the full initial values, the same on every rank; each keeps its block."""

    def __init__(self, weight, bias=None, group=None, gather_output: bool = True):
        self.group = g = resolve(group)
        w = as_numbers(weight, "weight")
        _agree("ColumnParallelLinear", w, bias, "gather_output", gather_output, g)
        self.cols = _block(w.shape[1], g.size, g.rank, "output features")
        self.w = w[:, self.cols].copy()
        self.b = None if bias is None else as_numbers(bias, "bias")[self.cols].copy()
        self.gather_output = gather_output
        self.grads: list = []

    def forward(self, x):
        x = as_numbers(x, "input")
        self._x = x
        y = x @ self.w
        if self.b is not None:
            y += self.b
        return _join_columns(y, self.group.size, self.group) if self.gather_output else y

    def backward(self, dy, x=None):
        """``x``: the forward's input (default: the last forward's), so micro-batches in
        flight in a pipeline each bring their own."""
        dy = as_numbers(dy, "output gradient")
        if self.gather_output:
            dy = dy[..., self.cols]
        x = self._x if x is None else as_numbers(x, "input")     # (grads: NumPy either way)
        x2, dy2 = x.reshape(-1, self.w.shape[0]), dy.reshape(-1, self.w.shape[1])
        self.grads = [x2.T @ dy2] + ([] if self.b is None else [dy2.sum(0)])
        dx = np.ascontiguousarray(dy @ self.w.T)
        all_reduce(dx, group=self.group)
        return dx

    def calls(self, tokens: int, itemsize: int | None = None) -> list[Call]:
        """Per step (forward and backward) for ``tokens`` rows of input, of the weight's
        dtype (``itemsize``: bytes an element instead)."""
        p, (i, o) = self.group.size, (self.w.shape[0], self.w.shape[1] * self.group.size)
        itemsize, dt = _wire(self.w, itemsize)
        out = [Call("all_reduce", tokens * i * itemsize, p, itemsize, label="dx", dtype=dt)]
        if self.gather_output:
            out.append(Call("all_gather", tokens * o * itemsize, p, itemsize, label="y",
                            dtype=dt))
        return out

    def price(self, tokens: int, topology=None, itemsize: int | None = None):
        return price(self.calls(tokens, itemsize), topology, hosts_of(self.group))


def _wire(w, itemsize):
    """(bytes an element, dtype) of a layer's collectives: its activations and gradients
    are of its weight's dtype (a float16 reduction is priced as float16's: cost.reduce_gamma);
    ``itemsize`` given: that many bytes, dtype unknown (priced as float32's reduction)."""
    return (w.dtype.itemsize, w.dtype) if itemsize is None else (int(itemsize), None)


class RowParallelLinear:
    """y = x W + b, W's rows split over ``group``. With ``input_is_parallel`` the caller
    passes this rank's block of x's features (a ColumnParallelLinear's un-gathered
    output); otherwise the whole x, and the layer takes its block."""

    def __init__(self, weight, bias=None, group=None, input_is_parallel: bool = True):
        self.group = g = resolve(group)
        w = as_numbers(weight, "weight")
        _agree("RowParallelLinear", w, bias, "input_is_parallel", input_is_parallel, g)
        self.rows = _block(w.shape[0], g.size, g.rank, "input features")
        self.w = w[self.rows].copy()
        self.b = None if bias is None else as_numbers(bias, "bias").copy()
        self.input_is_parallel = input_is_parallel
        self.grads: list = []

    def forward(self, x):
        x = as_numbers(x, "input")
        if not self.input_is_parallel:
            x = x[..., self.rows]
        self._x = x
        y = np.ascontiguousarray(x @ self.w)
        all_reduce(y, group=self.group)
        if self.b is not None:
            y += self.b
        return y

    def backward(self, dy, x=None):
        """``x``: the forward's input (default: the last forward's)."""
        dy = as_numbers(dy, "output gradient")
        if x is None:
            x = self._x
        else:
            x = as_numbers(x, "input")
            if not self.input_is_parallel:
                x = x[..., self.rows]
        x2, dy2 = x.reshape(-1, self.w.shape[0]), dy.reshape(-1, self.w.shape[1])
        self.grads = [x2.T @ dy2] + ([] if self.b is None else [dy2.sum(0)])
        dx = dy @ self.w.T
        return dx if self.input_is_parallel else _join_columns(dx, self.group.size, self.group)

    def calls(self, tokens: int, itemsize: int | None = None) -> list[Call]:
        """As ColumnParallelLinear's."""
        p, (i, o) = self.group.size, (self.w.shape[0] * self.group.size, self.w.shape[1])
        itemsize, dt = _wire(self.w, itemsize)
        out = [Call("all_reduce", tokens * o * itemsize, p, itemsize, label="y", dtype=dt)]
        if not self.input_is_parallel:
            out.append(Call("all_gather", tokens * i * itemsize, p, itemsize, label="dx",
                            dtype=dt))
        return out

    def price(self, tokens: int, topology=None, itemsize: int | None = None):
        return price(self.calls(tokens, itemsize), topology, hosts_of(self.group))
