"""Elementwise optimizers on flat arrays: the same update whether a rank owns the whole
parameter (data parallel, the single-process reference) or a shard of it (ZeRO), so a
shard's result has exactly the bits the unsharded update gives those elements."""
from __future__ import annotations

import numpy as np


class SGD:
    """p -= lr * v, v = momentum * v + g (v = g when momentum is 0)."""
    slots = ("momentum",)

    def __init__(self, lr: float = 0.01, momentum: float = 0.0):
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"SGD needs lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        self.lr, self.momentum = lr, momentum

    def state(self, n: int, dtype) -> dict:
        return {"momentum": np.zeros(n, dtype)} if self.momentum else {}

    def update(self, param: np.ndarray, grad: np.ndarray, state: dict, step: int) -> None:
        if self.momentum:
            v = state["momentum"]
            v *= self.momentum
            v += grad
            grad = v
        param -= self.lr * grad


class Adam:
    """Adam with bias correction (Kingma and Ba); ``step`` counts from 1."""
    slots = ("m", "v")

    def __init__(self, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        if lr <= 0 or not all(0 <= b < 1 for b in betas) or eps <= 0:
            raise ValueError(f"Adam needs lr > 0, 0 <= betas < 1, eps > 0; got {lr}, {betas}, {eps}")
        self.lr, self.betas, self.eps = lr, tuple(betas), eps

    def state(self, n: int, dtype) -> dict:
        return {"m": np.zeros(n, dtype), "v": np.zeros(n, dtype)}

    def update(self, param: np.ndarray, grad: np.ndarray, state: dict, step: int) -> None:
        b1, b2 = self.betas
        m, v = state["m"], state["v"]
        m *= b1
        m += (1 - b1) * grad
        v *= b2
        v += (1 - b2) * grad * grad
        mhat = m / (1 - b1 ** step)
        vhat = v / (1 - b2 ** step)
        param -= self.lr * mhat / (np.sqrt(vhat) + self.eps)


def make(optimizer, **kw):
    """"sgd" / "adam" (with their keyword arguments) or an optimizer object as it is."""
    if isinstance(optimizer, str):
        table = {"sgd": SGD, "adam": Adam}
        if optimizer not in table:
            raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
        return table[optimizer](**kw)
    if kw:
        raise TypeError("optimizer keyword arguments go with a name ('sgd', 'adam'), not an object")
    return optimizer
