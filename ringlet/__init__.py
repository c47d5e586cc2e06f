"""ringlet: collective communication for distributed training — run it, price it, explain it.

    import ringlet as rl
    rl.init()                      # under `ringlet run -n 4 script.py`
    rl.all_reduce(grad)            # in place, every rank ends with the same bits
    rl.cost.predict("all_reduce", 64 << 20, 8, link=rl.cost.TIERS["infiniband"])
"""
from .errors import CollectiveMismatch, PeerFailure, RingletError, TimeoutError
from .ops import ReduceOp
from .runtime import (destroy, destroy_group, get_rank, get_world_size, init, irecv,
                      is_initialized, isend, new_group, recv, reset_stats, send, stats, trace)
from .group import Group
from .work import Work
from .launch import ProcessFailed, spawn
from .shrink import shrink
from .collectives import (all_gather, all_reduce, all_to_all, all_to_all_single, barrier,
                          broadcast, gather, reduce, reduce_scatter, scatter, schedule)
from .schedule import Schedule
from .buffers import empty, zeros
from .profiling import profile
from . import cost


__all__ = [
    "init", "destroy", "is_initialized", "get_rank", "get_world_size", "new_group",
    "destroy_group", "Group", "spawn", "shrink", "send", "recv", "isend", "irecv", "Work",
    "broadcast", "all_reduce", "reduce",
    "all_gather", "reduce_scatter", "gather", "scatter", "all_to_all", "all_to_all_single",
    "barrier", "ReduceOp", "empty", "zeros", "profile", "trace", "stats", "reset_stats", "schedule",
    "Schedule", "cost",
    "RingletError", "TimeoutError", "PeerFailure", "CollectiveMismatch", "ProcessFailed",
]


def __getattr__(name):
    # rl.train (the training patterns) loads on first use: `import ringlet` stays small
    if name == "train":
        import importlib
        return importlib.import_module(".train", __name__)
    raise AttributeError(f"module 'ringlet' has no attribute {name!r}")
