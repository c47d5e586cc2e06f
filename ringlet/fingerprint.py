"""A collective's fingerprint: what a rank believes the call is — collective, algorithm,
dtype, count, root, reduce op, and whether auto picked the algorithm for rl.empty buffers —
packed into two integers carried in the header of
every message of the call (its sequence number travels in the tag). A receiver that sees
another fingerprint than its own knows the ranks disagree, and says exactly how."""
from __future__ import annotations

import numpy as np

from .ops import ReduceOp

COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "reduce_scatter",
               "all_to_all", "gather", "scatter", "barrier")
_OPS = (None,) + tuple(ReduceOp)
ROOTED = ("broadcast", "reduce", "gather", "scatter")   # (the others' root field is 0: unused)


def encode(collective: str, algorithm: str, algorithms: tuple, dtype: np.dtype, count: int,
           root: int | None, op: ReduceOp | None, by_kind: bool = False) -> tuple[int, int]:
    """``by_kind``: algorithm="auto" picked ``algorithm`` because the buffers are rl.empty
    arrays (with NumPy ones it would have picked another)."""
    code = ((COLLECTIVES.index(collective) + 1)
            | (algorithms.index(algorithm) + 1) << 8
            | ord(dtype.char) << 16 | dtype.itemsize << 24 | int(by_kind) << 31
            | _OPS.index(op) << 32
            | ((root or 0) & 0xFFFFFF) << 40)
    return code, count


def decode(fp: tuple[int, int], algorithms_of) -> dict:
    """The fields of a fingerprint; anything that does not decode (a corrupt or hostile
    header) shows as "?" rather than raising."""
    code, count = fp
    c = (code & 0xFF) - 1
    coll = COLLECTIVES[c] if 0 <= c < len(COLLECTIVES) else "?"
    algos = tuple(algorithms_of(coll)) if coll != "?" else ()
    a = (code >> 8 & 0xFF) - 1
    o = code >> 32 & 0xFF
    op = _OPS[o] if o < len(_OPS) else "?"
    try:
        dtype = str(np.dtype(chr(code >> 16 & 0xFF)))
    except (TypeError, ValueError):
        dtype = "?"
    if dtype == "void":   # the only structured dtype that travels: ops.BFLOAT16
        dtype = "bfloat16"
    return {"collective": coll, "algorithm": algos[a] if 0 <= a < len(algos) else "?",
            "dtype": dtype, "count": count,
            "root": code >> 40 & 0xFFFFFF if coll in ROOTED or coll == "?" else None,
            "op": op if op in ("?", None) else op.name,
            "auto_for": "rl.empty" if code >> 31 & 1 else None}


def diff(mine: dict, theirs: dict, me: int, them: int) -> str:
    """'rank 0: all_reduce(count=10, ...) vs rank 1: broadcast(...); differs in: ...'"""
    def show(d):
        args = ", ".join(f"{k}={v}" for k, v in d.items() if k != "collective" and v is not None)
        return f"{d['collective']}({args})"
    fields = [k for k in mine if mine[k] != theirs[k]]
    hint = ""
    if "algorithm" in fields and (mine.get("auto_for") or theirs.get("auto_for")):
        hint = ("; algorithm='auto' picks for the kind of buffers passed (rl.empty arrays are "
                "read in place): pass the same kind on every rank, or name the algorithm")
    kinds = {mine["collective"]: mine, theirs["collective"]: theirs}
    if set(kinds) == {"all_gather", "all_to_all"} and str(kinds["all_gather"].get("dtype")) \
            == "int64":
        hint = ("; this looks like all_to_all_single given in_splits/out_splits on some ranks "
                "only (uneven splits first all_gather the split matrix): pass them on every "
                "rank, or on none")
    return (f"rank {me} called {show(mine)} but rank {them} called {show(theirs)}; "
            f"they differ in {', '.join(fields) or 'nothing visible'}{hint}")
