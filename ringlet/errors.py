"""Exceptions a user can catch: one base class, one subclass per kind of failure."""
import builtins


class RingletError(RuntimeError):
    """Base class of every ringlet runtime error."""


class TimeoutError(RingletError, builtins.TimeoutError):
    """A blocking call did not complete in time; the message names the operation,
    the group, this rank and the peers it was waiting for."""


class PeerFailure(RingletError):
    """A peer rank died or closed its connection while this rank depended on it.
    ``left``: it left the job (called destroy()) rather than died."""

    def __init__(self, message, rank=None, left: bool = False):
        super().__init__(message)
        self.rank = rank
        self.left = left


class CollectiveMismatch(RingletError):
    """Ranks of a group called different collectives, or the same one with different
    shapes, dtypes, roots or reduce ops."""


class AuthenticationError(RingletError):
    """A connection did not prove it knows the job token."""
