"""ZeRO stages 1, 2 and 3 ("reduce-scatter the gradients, update the shard you
own, then gather the updated parameters").

Parameters come in units (a layer: one array or a list of arrays). Each unit is one flat
buffer padded to a multiple of the group size p; rank r owns block r of it.

* stage 1: optimizer state sharded. Each rank keeps a full gradient buffer, reduce_scatter'ed
  (mean) into its block; it updates its block of the parameters; an in-place all_gather
  gives every rank all of them.
* stage 2: gradients sharded too: reduce_scatter (mean) leaves each rank only its block.
* stage 3: parameters sharded too: a unit's parameters exist in full only between
  ``gather(u)`` (an all_gather, optionally prefetching the next unit) and ``free(u)``;
  gradients are reduce_scatter'ed as backward produces them (``reduce_grad``).

Per step, in bytes on the wire: stages 1 and 2 move what data parallelism's all_reduce
moves (reduce_scatter + all_gather), stage 3 adds a second all_gather (forward and
backward each gather every unit): 1.5x.

    opt = ZeroOptimizer(layers, stage=3, optimizer="adam", lr=1e-3)
    for u in range(L):  W = opt.gather(u, prefetch=u + 1); ...; opt.free(u)     # forward
    for u in reversed(range(L)):
        W = opt.gather(u, prefetch=u - 1); ...; opt.free(u); opt.reduce_grad(u, grads_u)
    opt.step()
"""
from __future__ import annotations

import numpy as np

from ..collectives import all_gather, broadcast, reduce_scatter
from ..runtime import get_rank, resolve
from .arrays import as_numbers
from . import optim
from .. import buffers
from .pricing import (Call, agree_on, averaging, buffer, hosts_of, label, lent, overlaps, price,
                      shared_if_large)


class _Done:
    """A call that completed where it was made (nothing left in flight)."""
    def wait(self):
        pass

    def is_completed(self):
        return True


_DONE = _Done()


class _Unit:
    """One layer's parameters as a flat buffer of ``p * shard`` elements."""

    def __init__(self, arrays, p: int, rank: int):
        self.shapes = [a.shape for a in arrays]
        self.sizes = [a.size for a in arrays]
        self.dtype = arrays[0].dtype
        self.n = sum(self.sizes)
        self.shard = -(-self.n // p)
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        self.full = None          # all p blocks (stages 1, 2: always; 3: while gathered)
        self.work = None          # the all_gather filling ``full`` (stage 3)
        self.grad = None          # stage 1: full gradient; 2, 3: this rank's block
        self.mean = None          # stage 1: this rank's block of the mean gradient
        self.grad_in = None       # stages 2, 3: the full gradient a reduce_scatter is reading
        self.grad_work = None
        self.grad_ready = None    # its gradient, filled, waiting for its turn on the wire
        self.lent = {}            # "full" / "grad_in" -> the reused buffer under it (stage 3 / 2, 3)

    def give_back(self, what: str) -> None:
        buf = self.lent.pop(what, None)
        if buf is not None:
            buffers.give_back(buf)

    def views(self, full):
        out, off = [], 0
        for shape, size in zip(self.shapes, self.sizes):
            out.append(full[off:off + size].reshape(shape))
            off += size
        return out


def _listed(unit) -> list:
    return list(unit) if isinstance(unit, (list, tuple)) else [unit]


class ZeroOptimizer:
    """Sharded data-parallel optimizer over ``group``. ``params``: a list of units, each an
    array or a list of arrays (NumPy or CPU torch; group rank 0's values are the initial
    parameters, as with DDP). ``optimizer``: "sgd" (``lr``, ``momentum``) or
    "adam" (``lr``, ``betas``, ``eps``). ``overlap``: whether collectives are left in
    flight - gradients averaging while backward goes on, the next unit's parameters
    gathered ahead (None: where that can overlap, :func:`ringlet.train.pricing.overlaps`;
    else each completes in the call that starts it, and ``prefetch`` is ignored)."""

    def __init__(self, params, stage: int = 1, optimizer="sgd", group=None, overlap=None,
                 **optimizer_kw):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        self.stage, self.group = stage, resolve(group)
        self.overlap = overlaps(self.group, overlap)
        self.opt = optim.make(optimizer, **optimizer_kw)
        p, r = self.group.size, self.group.rank
        self.units: list[_Unit] = []
        self.state: list[dict] = []
        self.shards: list[np.ndarray] = []    # this rank's block of each unit's parameters
        units = [[as_numbers(a, f"params[{k}]") for a in _listed(unit)]
                 for k, unit in enumerate(params)]
        for k, arrays in enumerate(units):
            if not arrays or any(a.dtype != arrays[0].dtype or a.dtype.kind != "f" for a in arrays):
                raise TypeError(f"params[{k}]: a unit is one or more float arrays of one dtype")
        self._agree(units, optimizer, optimizer_kw)
        for arrays in units:
            u = _Unit(arrays, p, r)
            flat = np.zeros(p * u.shard, u.dtype)
            flat[:u.n] = np.concatenate([a.reshape(-1) for a in arrays])
            # group rank 0's initial values (as DDP): each rank keeps a block of them, and
            # blocks of initial values that differed between ranks would make a model none
            # of them passed, trained from a first step on models that differ
            broadcast(flat, 0, group=self.group)
            if stage < 3:
                u.full = buffer(flat.size, u.dtype)
                u.full[:] = flat
                self.shards.append(u.full[u.lo:u.hi])
                u.grad = buffer(flat.size, u.dtype) if stage == 1 else np.empty(u.shard, u.dtype)
            else:
                shard = buffer(u.shard, u.dtype)    # (all_gather's input: read in place)
                shard[:] = flat[u.lo:u.hi]
                self.shards.append(shard)
            self.units.append(u)
            self.state.append(self.opt.state(u.shard, u.dtype))
        self.t = 0
        self._turn = len(self.units) - 1   # the unit whose gradient goes on the wire next
        self.peak_gathered = 0    # most bytes of gathered (stage 3) units held at once
        self.peak_grad_in = 0     # most bytes of full gradients held for reduce_scatters

    def _agree(self, units, optimizer, optimizer_kw) -> None:
        """Every rank must pass units of the same sizes and the same settings: units padded
        to one length would agree in every collective, and a rank's extra elements would be
        averaged with another's padding, silently. Checked once, here, on every rank."""
        named = optimizer if isinstance(optimizer, str) else type(optimizer).__qualname__
        # (an optimizer object by its settings too: one lr per rank had passed)
        given = optimizer_kw if isinstance(optimizer, str) else getattr(optimizer, "__dict__", {})
        sizes = [sum(a.size for a in arrays) for arrays in units]
        layout = [[(a.shape, a.dtype.str) for a in arrays] for arrays in units]
        settings = (self.stage, named, sorted((k, repr(v)) for k, v in given.items()))
        # (each unit's collectives carry label(base, unit): pricing.agree_on)
        self._labels = agree_on(
            "ZeroOptimizer", "passed different units", sizes, layout, settings, self.group,
            f"stage={self.stage}, optimizer={named!r}, {given}",
            "pass the same parameters (shapes and order), stage and optimizer settings on "
            "every rank")

    # -- parameters --------------------------------------------------------------------
    def gather(self, u: int, prefetch: int | None = None) -> list[np.ndarray]:
        """Unit ``u``'s parameters in full (views; stage 3: valid until ``free(u)`` or
        ``step``).
        Stage 3 gathers them (waiting for a prefetch started earlier) and, with
        ``prefetch``, starts gathering that unit too."""
        unit = self._unit(u)
        if self.stage == 3:
            if unit.full is None:
                self._start_gather(unit, u)
            if self.overlap and prefetch is not None and 0 <= prefetch < len(self.units) \
                    and self.units[prefetch].full is None:
                self._start_gather(self.units[prefetch], prefetch)
            if unit.work is not None:
                unit.work.wait()
                unit.work = None
        return unit.views(unit.full)

    def _start_gather(self, unit: _Unit, u: int) -> None:
        unit.full, unit.lent["full"] = lent(len(self.shards[u]) * self.group.size, unit.dtype)
        # (labelled by the unit: ranks that gathered other units of one size, prefetching
        # differently, had each got a mix of both, silently)
        unit.work = all_gather(unit.full.reshape(self.group.size, -1), self.shards[u],
                               group=self.group, async_op=self.overlap,
                               label=label(self._labels, u))
        held = sum(x.full.nbytes for x in self.units if x.full is not None)
        self.peak_gathered = max(self.peak_gathered, held)

    def free(self, u: int) -> None:
        """Stage 3: drop unit ``u``'s gathered parameters (the other stages keep them)."""
        unit = self._unit(u)
        if self.stage == 3:
            if unit.work is not None:
                unit.work.wait()
            unit.full, unit.work = None, None
            unit.give_back("full")

    # -- gradients and the step --------------------------------------------------------
    def reduce_grad(self, u: int, grads) -> None:
        """Start averaging unit ``u``'s gradients over the group (a reduce_scatter into this
        rank's block: from the full gradient buffer stage 1 keeps, from a lent one in stages
        2 and 3); ``step`` waits. Units go
        on the wire last unit first, as a backward pass hands them over, whatever order
        this rank's calls come in (ranks that differed in it had swapped the gradients of
        units of one size): a unit handed over early waits for its turn."""
        unit = self._unit(u)
        arrays = [as_numbers(g, f"gradient of unit {u}") for g in _listed(grads)]
        if [a.size for a in arrays] != unit.sizes:
            raise ValueError(f"rank {get_rank()}: ZeroOptimizer.reduce_grad: unit {u} has "
                             f"parameters of {unit.sizes} elements, got gradients of "
                             f"{[a.size for a in arrays]}")
        if unit.grad_work is not None or unit.grad_ready is not None:
            raise RuntimeError(f"ZeroOptimizer.reduce_grad: unit {u}'s gradient was already "
                               f"handed over this step")
        p = self.group.size
        for other in self.units:    # free the inputs of reduce_scatters that have finished
            if other.grad_in is not None and other.grad_work.is_completed():
                other.grad_in = None
                other.give_back("grad_in")
        if self.stage == 1:
            flat = unit.grad
        else:
            flat, unit.lent["grad_in"] = lent(p * unit.shard, unit.dtype)
        off = 0
        for a in arrays:
            flat[off:off + a.size] = a.reshape(-1)
            off += a.size
        flat[off:] = 0
        unit.grad_ready = flat
        self._note_grad_in()
        while self._turn >= 0 and self.units[self._turn].grad_ready is not None:
            self._reduce(self.units[self._turn], self._turn)
            self._turn -= 1

    def _reduce(self, unit: _Unit, u: int) -> None:
        """Put a unit's filled gradient on the wire."""
        flat, unit.grad_ready, p = unit.grad_ready, None, self.group.size
        if self.stage == 1:
            # (a reduce_scatter, not an all_reduce: only this rank's block is read, and an
            # all_reduce had moved 1.5x what data parallelism moves)
            if unit.mean is None:
                unit.mean = np.empty(unit.shard, unit.dtype)
            unit.grad_work = reduce_scatter(unit.mean, flat.reshape(p, -1), averaging(flat, p),
                                            group=self.group, async_op=self.overlap,
                                            label=label(self._labels, u)) or _DONE
        else:
            if unit.grad is None:
                unit.grad = np.empty(unit.shard, unit.dtype)
            unit.grad_in = flat
            unit.grad_work = reduce_scatter(unit.grad, flat.reshape(p, -1),
                                            averaging(flat, p), group=self.group,
                                            async_op=self.overlap,
                                            label=label(self._labels, u)) or _DONE
            if unit.grad_work is _DONE:
                unit.grad_in = None
                unit.give_back("grad_in")

    def _note_grad_in(self) -> None:
        if self.stage > 1:      # (stage 1 reduces in the gradient buffer it keeps)
            held = sum(x.nbytes for u in self.units for x in (u.grad_in, u.grad_ready)
                       if x is not None)
            self.peak_grad_in = max(self.peak_grad_in, held)

    def step(self, grads=None) -> None:
        """Update the parameters with the averaged gradients: ``grads`` (one entry per
        unit, handed to ``reduce_grad`` last unit first) or those already handed over."""
        if grads is not None:
            if len(grads) != len(self.units):
                raise ValueError(f"ZeroOptimizer.step: {len(grads)} gradients for "
                                 f"{len(self.units)} units")
            for u in reversed(range(len(self.units))):
                self.reduce_grad(u, grads[u])
        missing = [k for k, unit in enumerate(self.units)
                   if unit.grad_work is None and unit.grad_ready is None]
        if missing:
            raise RuntimeError(f"rank {get_rank()}: ZeroOptimizer.step: unit(s) {missing} got no "
                               f"gradient this step (reduce_grad every unit, zeros if unused)")
        self.t += 1
        self._turn = len(self.units) - 1
        for k, unit in enumerate(self.units):
            unit.grad_work.wait()
            unit.grad_work = unit.grad_in = None
            unit.give_back("grad_in")
            g = unit.mean if self.stage == 1 else unit.grad
            self.opt.update(self.shards[k], g, self.state[k], self.t)
        if self.stage == 3:
            # A unit still gathered (its free skipped, or prefetched) holds the old values:
            # dropped, so the next gather gathers the new ones.
            for k, unit in enumerate(self.units):
                if unit.full is not None:
                    self.free(k)
            return
        works = [all_gather(unit.full.reshape(self.group.size, -1), self.shards[k],
                            group=self.group, async_op=self.overlap,
                            label=label(self._labels, k))
                 for k, unit in enumerate(self.units)]
        for w in works:
            if w is not None:
                w.wait()

    def _unit(self, u: int) -> _Unit:
        if not isinstance(u, (int, np.integer)) or not 0 <= u < len(self.units):
            raise IndexError(f"ZeroOptimizer: unit {u!r} outside 0..{len(self.units) - 1}")
        return self.units[u]

    # -- what a rank holds, and what a step costs --------------------------------------
    def memory(self) -> dict:
        """Bytes this rank holds now, counted on the arrays themselves: parameters (full
        buffers in stages 1, 2; this rank's blocks in stage 3), gradients, optimizer state;
        and the most bytes held at once, in flight: ``gathered_peak`` (stage 3's gathered
        units) and ``grad_in_peak`` (stages 2, 3: full gradients being reduce-scattered;
        freed as each reduce_scatter finishes)."""
        params = sum(u.full.nbytes if self.stage < 3 else s.nbytes
                     for u, s in zip(self.units, self.shards))
        grads = sum(u.grad.nbytes for u in self.units if u.grad is not None)
        state = sum(a.nbytes for st in self.state for a in st.values())
        return {"params": params, "grads": grads, "optimizer": state,
                "total": params + grads + state, "gathered_peak": self.peak_gathered,
                "grad_in_peak": self.peak_grad_in}

    def ddp_memory(self) -> int:
        """What plain data parallelism holds for the same model: full parameters,
        gradients and optimizer state on every rank."""
        n = sum(u.n * u.dtype.itemsize for u in self.units)
        return n * (2 + len(self.opt.state(1, np.float32)))

    def calls(self) -> list[Call]:
        """The collectives of one step (size convention of :mod:`ringlet.cost.model`)."""
        p, out = self.group.size, []
        for k, u in enumerate(self.units):
            nb, item = p * u.shard * u.dtype.itemsize, u.dtype.itemsize
            # (the block it reduces into is a plain array)
            out.append(Call("reduce_scatter", nb, p, item, label=f"unit {k} grad",
                            shared=shared_if_large("reduce_scatter", nb, p, "in"),
                            dtype=u.dtype))
            out.append(Call("all_gather", nb, p, item, 2 if self.stage == 3 else 1,
                            label=f"unit {k} params",
                            shared=shared_if_large("all_gather", nb, p, "in", "out")))
        return out

    def price(self, topology=None):
        """Communication per step on ``topology`` (see :func:`ringlet.train.pricing.price`)."""
        return price(self.calls(), topology, hosts_of(self.group))
