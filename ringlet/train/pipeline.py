"""Pipeline parallelism: rank r of the group runs stage r; activations go forward to r+1
and their gradients come back, one message per micro-batch, by isend/irecv.

A stage is any object with ``forward(x) -> (y, ctx)`` and ``backward(ctx, dy) -> dx``
(it accumulates its own parameters' gradients). The last stage's ``y`` goes to
``loss(y, target) -> (value, dy)``.

Schedules (per rank, m micro-batches, p stages):

* ``"gpipe"``: every forward, then every backward (last micro-batch first); holds m
  micro-batches' activations.
* ``"1f1b"``: p - r - 1 forwards to fill the pipe, then one forward and one backward in
  turn, then the remaining backwards; holds at most p - r micro-batches' activations.

Sends never block (their handles are waited at the end of the step; what they send is a
copy, so a stage may return the same array every time); a rank blocks only on a receive it
needs now. An activation travels behind a small header with its shape.
Where nothing can overlap (the ranks fill the host's cores: ``overlap`` as in
:func:`ringlet.train.pricing.overlaps`) messages that go as one eager packet on their link
(shared memory's or TCP's, which is smaller) are sent and
received by blocking calls, which never wait for the peer's receive, so no progress thread
takes turns with the compute; larger ones stay isend (a blocking one would wait for its
receiver, and in 1F1B two neighbours send to each other at once).
"""
from __future__ import annotations

import numpy as np

from ..runtime import engine, get_rank, irecv, isend, recv, resolve, send
from ..transport.limits import SHM_EAGER_BYTES, TCP_EAGER_BYTES
from ..transport.shm import ShmPeer
from .arrays import as_numbers
from .pricing import Call, disagreement, overlaps, price

_HEADER = 8   # int64s: ndim, then up to 7 dimensions


class Pipeline:
    """``stage``: this rank's stage. ``micro_batches``: m. ``dtype``: what activations
    and their gradients are cast to between stages (float64 by default: pass float32 for
    a float32 model, or its messages double and the next stage computes in float64)."""

    def __init__(self, stage, micro_batches: int, schedule: str = "1f1b", group=None,
                 loss=None, dtype=np.float64, overlap: bool | None = None):
        if schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.group = resolve(group)
        self.overlap = overlaps(self.group, overlap)
        self.stage, self.m, self.schedule = stage, int(micro_batches), schedule
        self.loss, self.dtype = loss, np.dtype(dtype)
        self.first, self.last = self.group.rank == 0, self.group.rank == self.group.size - 1
        if self.last and loss is None:
            raise ValueError("the last stage's rank needs loss=(y, target) -> (value, dy)")
        self._agree()
        self.peak_in_flight = 0   # most micro-batches whose activations this rank held

    def _agree(self) -> None:
        """Every stage must run the same micro-batches, schedule and activation dtype:
        else a stage would wait for a message that never comes, until its timeout.
        Checked once, here, on every rank."""
        every = disagreement([self.m, ("gpipe", "1f1b").index(self.schedule),
                              ord(self.dtype.char)], self.group)
        if every is not None:
            said = "; ".join(f"stage {r}: micro_batches={m}, schedule={('gpipe', '1f1b')[k]!r}, "
                             f"dtype={np.dtype(chr(c))}" for r, (m, k, c) in enumerate(every))
            raise ValueError(f"rank {get_rank()}: Pipeline: the stages disagree ({said}); "
                             f"construct it with the same micro_batches, schedule and dtype "
                             f"on every rank of the group")

    def order(self) -> list[tuple[str, int]]:
        """This rank's sequence of ("F" | "B", micro-batch)."""
        m, p, r = self.m, self.group.size, self.group.rank
        if self.schedule == "gpipe":
            return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
        warm = min(p - r - 1, m)
        out = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            out += [("F", warm + i), ("B", i)]
        return out + [("B", i) for i in range(m - warm, m)]

    def step(self, inputs=None, targets=None) -> list | None:
        """Run one training step's forwards and backwards over the micro-batches: the first
        rank passes ``inputs`` (m arrays), the last ``targets`` (m). Returns the last
        rank's m loss values (None elsewhere)."""
        g, m = self.group, self.m
        for name, need, given in (("inputs", self.first, inputs), ("targets", self.last, targets)):
            if need and (given is None or len(given) != m):
                raise ValueError(f"rank {get_rank()}: Pipeline.step needs {m} {name} on this stage")
        ctx, shapes, losses, sends = {}, {}, [None] * m, []
        prev, nxt = g.rank - 1, g.rank + 1
        for kind, i in self.order():
            if kind == "F":
                if self.first:
                    x = as_numbers(inputs[i], f"inputs[{i}]")
                else:
                    x = self._recv_activation(prev, i)
                y, c = self.stage.forward(x)
                if self.last:
                    losses[i], dy = self.loss(y, targets[i])
                    ctx[i] = (c, dy)
                else:
                    y = np.ascontiguousarray(y, self.dtype)
                    if y.ndim > _HEADER - 1:
                        raise ValueError(f"rank {get_rank()}: Pipeline.step: micro-batch {i}'s "
                                         f"activation has {y.ndim} dimensions, more than the "
                                         f"{_HEADER - 1} a stage may pass on: reshape it")
                    shapes[i] = y.shape
                    header = np.zeros(_HEADER, np.int64)
                    header[0], header[1:1 + y.ndim] = y.ndim, y.shape
                    self._send(header, nxt, 3 * i, sends)
                    self._send(y, nxt, 3 * i + 1, sends)
                    ctx[i] = (c, None)
                self.peak_in_flight = max(self.peak_in_flight, len(ctx))
            else:
                c, dy = ctx.pop(i)
                if dy is None:
                    dy = np.empty(shapes.pop(i), self.dtype)
                    self._recv(dy, nxt, 3 * i + 2)
                dx = self.stage.backward(c, dy)
                if not self.first:
                    self._send(np.ascontiguousarray(dx, self.dtype), prev, 3 * i + 2, sends)
        for w in sends:
            w.wait()
        return losses if self.last else None

    def _recv_activation(self, src: int, i: int) -> np.ndarray:
        header = np.empty(_HEADER, np.int64)
        recv(header, src, self.group, tag=3 * i)
        x = np.empty(tuple(header[1:1 + header[0]]), self.dtype)
        self._recv(x, src, 3 * i + 1)
        return x

    def _send(self, buf, dst: int, tag: int, sends: list) -> None:
        if not self.overlap and buf.nbytes <= self._eager(dst):
            send(buf, dst, self.group, tag=tag)
        else:   # (a copy: the stage may write the array it returned again meanwhile)
            sends.append(isend(buf.copy(), dst, self.group, tag=tag))

    def _eager(self, dst: int) -> int:
        """The largest message to group rank ``dst`` that goes as one eager packet, so a
        blocking send of it never waits for the receiver: its link's (TCP's is smaller)."""
        peer = engine().peers.get(self.group.ranks[dst])
        return SHM_EAGER_BYTES if isinstance(peer, ShmPeer) else TCP_EAGER_BYTES

    def _recv(self, buf, src: int, tag: int) -> None:
        if self.overlap:
            irecv(buf, src, self.group, tag=tag).wait()
        else:
            recv(buf, src, self.group, tag=tag)

    def calls(self, activation_elements: int) -> list[Call]:
        """One step's messages between two neighbouring stages: per micro-batch an
        activation forward (behind a header with its shape) and its gradient back,
        ``activation_elements`` each (a 2-rank broadcast is one message, so it prices one)."""
        nb = activation_elements * self.dtype.itemsize
        return [Call("broadcast", _HEADER * 8, 2, 8, self.m, "activation's shape", p2p=True),
                Call("broadcast", nb, 2, self.dtype.itemsize, 2 * self.m, "activation / gradient",
                     p2p=True)]

    def price(self, activation_elements: int, topology=None):
        """This rank's messages with its next stage (the last stage: its previous) on
        ``topology``: across hosts when that stage runs on another."""
        ids, r = self.group.host_indices(), self.group.rank
        peer = r + 1 if r + 1 < self.group.size else r - 1
        hosts = (0, 1) if peer >= 0 and ids[peer] != ids[r] else None
        return price(self.calls(activation_elements), topology, hosts)
