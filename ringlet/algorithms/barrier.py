"""barrier: no rank leaves before every rank has entered. Messages carry zero elements.

Costs: α per message, lg = ceil(log2 p).
"""
from __future__ import annotations

import numpy as np

from ._common import lg, new

__all__ = ["dissemination"]


def dissemination(p, count=0, *, itemsize=4):
    """Dissemination (Hensgen–Finkel–Manber): in round k rank i signals rank i + 2^k and
    waits for rank i − 2^k; after lg rounds every rank has heard, transitively, from all.

    lg zero-element messages per rank:  T = lg·α.  Uses only "tmp" (0 elements).
    """
    s = new("barrier", "dissemination", p, count, itemsize)
    r = np.arange(p)
    for k in range(lg(p)):
        s.round().copy(src=r, dst=(r + (1 << k)) % p, n=0, buf="tmp")
    return s
