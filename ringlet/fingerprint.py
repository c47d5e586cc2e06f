"""A collective's fingerprint: what a rank believes the call is — collective, algorithm,
dtype, count, root (or a label: all_gather's), reduce op, whether auto picked the algorithm
for rl.empty buffers, and a checksum of the group's members in order — packed into two
integers carried in the header of every message of the call (its sequence number travels in the tag). A receiver that sees
another fingerprint than its own knows the ranks disagree, and says exactly how."""
from __future__ import annotations

import zlib

import numpy as np

from .ops import ReduceOp

COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "reduce_scatter",
               "all_to_all", "gather", "scatter", "barrier")
_OPS = (None,) + tuple(ReduceOp)
ROOTED = ("broadcast", "reduce", "gather", "scatter")   # (the others' root field is 0: unused)
_COUNT_BITS = 48       # the second integer: the count, then the members' checksum (15 bits)


def members_code(ranks) -> int:
    """A 15-bit checksum of a group's world ranks in order: ranks that made a group from
    different lists (new_group is called by each rank with its own) share its id, and
    would otherwise run its calls on different plans until one times out."""
    return zlib.crc32(np.asarray(ranks, np.int64).tobytes()) & 0x7FFF


def layout_code(dtype: np.dtype) -> int:
    """7 bits that tell apart dtypes of one kind character, which alone names neither the
    byte order (>f4, <f4), a datetime's unit (M8[s], M8[ms]), a string's length nor a
    structured dtype's fields (all "V"): a checksum of its full description."""
    return zlib.crc32(f"{dtype.str}{dtype.descr}".encode()) & 0x7F


def encode(collective: str, algorithm: str, algorithms: tuple, dtype: np.dtype, count: int,
           root: int | None, op: ReduceOp | None, by_kind: bool = False,
           members: int = 0) -> tuple[int, int]:
    """``by_kind``: algorithm="auto" picked ``algorithm`` because the buffers are rl.empty
    arrays (with NumPy ones it would have picked another); ``members``: ``members_code``
    of the group."""
    code = ((COLLECTIVES.index(collective) + 1)
            | (algorithms.index(algorithm) + 1) << 8
            | ord(dtype.char) << 16 | layout_code(dtype) << 24 | int(by_kind) << 31
            | _OPS.index(op) << 32
            | ((root or 0) & 0xFFFFFF) << 40)
    return code, count & ((1 << _COUNT_BITS) - 1) | members << _COUNT_BITS


def labelled(fp: tuple[int, int], label: int) -> tuple[int, int]:
    """The fingerprint of a call with no root (``fp``'s root field 0) carrying ``label``
    (collectives._labelled: the label + 1) there."""
    return fp[0] | (label & 0xFFFFFF) << 40, fp[1]


def decode(fp: tuple[int, int], algorithms_of) -> dict:
    """The fields of a fingerprint; anything that does not decode (a corrupt or hostile
    header) shows as "?" rather than raising."""
    code, count = fp
    members, count = count >> _COUNT_BITS, count & ((1 << _COUNT_BITS) - 1)
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
    if chr(code >> 16 & 0xFF) == "V":   # ops.BFLOAT16, or any structured dtype
        from .ops import BFLOAT16
        dtype = "bfloat16" if code >> 24 & 0x7F == layout_code(BFLOAT16) else "structured"
    return {"collective": coll, "algorithm": algos[a] if 0 <= a < len(algos) else "?",
            "dtype": dtype, "count": count,
            "root": code >> 40 & 0xFFFFFF if coll in ROOTED or coll == "?" else None,
            # (a call with no root may carry a label there: all_gather(label=) + 1)
            "label": (code >> 40 & 0xFFFFFF) - 1 if coll not in ROOTED and coll != "?"
            and code >> 40 & 0xFFFFFF else None,
            "op": op if op in ("?", None) else op.name,
            "auto_for": "rl.empty" if code >> 31 & 1 else None, "members": members,
            "layout": code >> 24 & 0x7F}


def diff(mine: dict, theirs: dict, me: int, them: int) -> str:
    """'rank 0: all_reduce(count=10, ...) vs rank 1: broadcast(...); differs in: ...'"""
    def show(d):
        args = ", ".join(f"{k}={v}" for k, v in d.items()
                         if k not in ("collective", "members", "layout") and v is not None)
        return f"{d['collective']}({args})"
    fields = [k for k in mine if mine[k] != theirs[k]]
    hint = ""
    if "layout" in fields and "dtype" in fields:
        fields.remove("layout")      # (plainly different dtypes: their layouts differ too)
    elif "layout" in fields:         # ... dtypes that print alike
        fields[fields.index("layout")] = "the dtype's layout"
        hint = ("; the dtypes' byte order, datetime unit, length or fields differ "
                "(compare dtype.str and dtype.descr on each rank)")
    if "members" in fields:
        fields[fields.index("members")] = "the group's members"
        hint = ("; the group was made from different rank lists: every rank must pass "
                "new_group the same ranks, in the same order")
    if "algorithm" in fields and (mine.get("auto_for") or theirs.get("auto_for")):
        hint = ("; algorithm='auto' picks for the kind of buffers passed (rl.empty arrays are "
                "read in place): pass the same kind on every rank, or name the algorithm")
    if fields == ["label"]:
        hint = ("; the label names which of a training object's buckets or units (or which "
                "all_gather(label=)) the call moves: the ranks called them in other orders")
    kinds = {mine["collective"]: mine, theirs["collective"]: theirs}
    if set(kinds) == {"all_gather", "all_to_all"} and str(kinds["all_gather"].get("dtype")) \
            == "int64":
        hint = ("; this looks like all_to_all_single given in_splits/out_splits on some ranks "
                "only (uneven splits first all_gather the split matrix): pass them on every "
                "rank, or on none")
    return (f"rank {me} called {show(mine)} but rank {them} called {show(theirs)}; "
            f"they differ in {', '.join(fields) or 'nothing visible'}{hint}")
