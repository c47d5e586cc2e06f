"""Every member of a collective call completes it, or every member fails it.

The transport detects (``transport.engine.CallEvents``): a message whose fingerprint
differs from the receive or the call it meets, an ABORT from a peer, a peer that is
gone. This module decides what follows: which calls fail, with which error (naming the
call, the ranks and what they disagree on), and which members are told - an ABORT to
each, so nobody waits for a call that cannot complete. It keeps the calls in flight on
this rank by wire tag, the aborts peers sent for calls this rank has not entered yet,
and the tags that already failed here (ABORTs for them are old news).
"""
from __future__ import annotations

from .errors import CollectiveMismatch, PeerFailure, RingletError, TimeoutError
from .fingerprint import diff
from .group import TAG_COLLECTIVE, call_number, group_of
from .transport import protocol
from .transport.protocol import ABANDONED, DEAD, GAVE_UP, LEFT, NO_FP, REFUSED, STALE

REMEMBER = 1024   # tags kept in ``aborts`` and ``failed`` (a peer cannot make us keep more)


def _refusal(exc, earlier: int) -> tuple:
    """What an ABORT tells the peers of a call refused because an earlier call of its group
    failed: that a member died (naming it), or that the earlier call was mismatched."""
    if isinstance(exc, PeerFailure) and exc.rank is not None:
        return _death(exc), DEAD
    return (earlier, 0), STALE


def _death(exc) -> tuple:
    """A DEAD ABORT's fingerprint words for ``exc`` (a PeerFailure): the rank, and LEFT if
    it left the job (destroy) rather than died, so the members told say which."""
    return exc.rank, LEFT if getattr(exc, "left", False) else 0


def _bounded_put(d: dict, tag: int, value) -> None:
    d[tag] = value
    if len(d) > REMEMBER:
        d.pop(next(iter(d)))


class Agreement:
    """The engine's ``calls``: the runtime registers each collective it starts (``start``,
    ``end``), the engine reports what it detects (the ``CallEvents`` methods)."""

    def __init__(self, describe_fp):
        self.describe_fp = describe_fp   # fingerprint -> dict of its fields (for errors)
        self.engine = None
        self.active: dict = {}     # tag -> CollectiveWork in flight on this rank
        self.aborts: dict = {}     # tag -> the error of a call not entered yet
        self.failed: dict = {}     # tags of calls already failed here
        # tag -> (sender, why) of a call a peer gave up on (GAVE_UP: its timeout; REFUSED:
        # its arguments; ABANDONED: an earlier part of its call failed) before this rank
        # entered it, if it ever does: one it finished meanwhile (run whole in C) stands
        self.given_up: dict = {}

    def attach(self, engine) -> None:
        self.engine = engine

    # -- the runtime's side --------------------------------------------------------------
    def start(self, work) -> None:
        """Register a collective; fail it at once if a peer already reported a mismatch
        for its tag, or a message already waiting for it carries another fingerprint."""
        tag, eng = work.tag, self.engine
        exc = self.aborts.pop(tag, None)
        if exc is None and tag in self.given_up:
            exc = self.gave_up_error(work.what, *self.given_up.pop(tag))
        if exc is None and self.aborts:
            # A call of this group that this rank finished was aborted by a peer that
            # disagreed with it: report it now rather than never.
            group = group_of(tag)
            earlier = [t for t in self.aborts if group_of(t) == group and t < tag]
            if earlier:
                exc = self.aborts.pop(min(earlier))
                for t in earlier:
                    self.aborts.pop(t, None)
                # Peers entering this call would wait for us forever: abort it for them too.
                theirs, why = _refusal(exc, min(earlier))
                eng.send_aborts(tag, work.world_of, work.fp, theirs, why)
        if exc is not None:
            # Failed here, so another peer's abort of this call arriving later is not kept
            # for (and wrongly charged to) this group's next call.
            _bounded_put(self.failed, tag, True)
            work.fail(exc)
            return
        self.active[tag] = work
        if not protocol.CHECK_FINGERPRINTS:
            return
        odd = eng.unasked_unlike(tag, work.fp)
        if odd is not None:
            rank, fp = odd
            self.mismatch(tag, work.fp, fp, rank)

    def end(self, work) -> None:
        if self.active.get(work.tag) is work:
            del self.active[work.tag]

    def gave_up(self, work, exc) -> None:
        """This rank's wait for collective ``work`` timed out (``exc``): the call is over
        here - its receives fail, so nothing more is written into its buffers - and its
        other members are told (an ABORT, and in shared memory: one reading a message of
        it in place must fail, as the ABORT may come late), so none waits on for this
        rank."""
        self.engine.say_gave_up(work.tag, work.world_of)
        self.engine.send_aborts(work.tag, work.world_of, work.fp, NO_FP, GAVE_UP)
        self._fail_collective(work.tag, exc)

    def gave_up_unstarted(self, tag: int, ranks, why: int = GAVE_UP) -> None:
        """This rank will never run call ``tag``, whose number it took - with the call
        before it (an uneven all_to_all's exchange, after its split table's all_gather
        failed here), or for a call whose arguments failed their checks here (``why`` =
        REFUSED: collectives._refused; ABANDONED: the earlier part of one call failed here,
        not by its timeout): its other members are told as for a call given up,
        so one that runs it fails at once instead of waiting its timeout. Every rank took
        the number, so the calls after it keep one numbering everywhere. (A refusal is not
        said in shared memory too: that word's readers take it for a timeout.)"""
        if why == GAVE_UP:
            self.engine.say_gave_up(tag, ranks)
        self.engine.send_aborts(tag, ranks, NO_FP, NO_FP, why)
        _bounded_put(self.failed, tag, True)
        # (what its members sent before they heard: kept for good, else; later: dropped)
        self.engine.fail_tag(tag, self.gave_up_error("a call given up here", self.engine.rank))

    def gave_up_behind(self, tag: int, sender: int, what: str) -> TimeoutError:
        """Rank ``sender``, which this rank read a message of call ``tag`` from in place,
        said it gave up the call (ShmPeer.gave_up_on) before its ABORT came: the call fails
        here as the ABORT would fail it, and the ABORT, when it comes, is spent."""
        exc = self.gave_up_error(what, sender)
        if tag in self.active:
            self._fail_collective(tag, exc)
        else:
            _bounded_put(self.failed, tag, True)
        return exc

    def propagate_failure(self, work, exc) -> None:
        """A member of this collective died: tell the other members, who may be waiting
        on someone alive who will now never send. Also when a peer told this rank (an
        ABORT): a member waiting on this rank may not have heard from that peer yet, and
        this rank's exit would reach it first, blamed as this rank's failure. (At most one
        ABORT per call and member: a call fails here once.)"""
        dead = getattr(exc, "rank", None)
        if dead is None:
            return
        self.engine.send_aborts(work.tag, [r for r in work.world_of if r != dead], work.fp,
                                _death(exc), DEAD)

    def retire(self, below: int, keyed, exc) -> None:
        """The world shrank: fail every call still in flight and forget all traffic of the
        groups whose id is below ``below`` or in ``keyed``, so the new world starts clean."""
        for work in self.engine.works[:]:
            work.fail(exc)
        self.engine.retire(below, keyed, exc)
        for tags in (self.active, self.aborts, self.failed, self.given_up):
            for tag in [t for t in tags if self.engine.retired(group_of(t))]:
                del tags[tag]

    # -- the transport's side (CallEvents) -----------------------------------------------
    def mismatch(self, tag: int, mine, theirs, culprit: int) -> None:
        """This rank saw a message of another fingerprint: fail here and tell every peer
        of the collective, so nobody waits for a call that cannot complete."""
        eng = self.engine
        exc = self._mismatch_error(tag, mine, eng.rank, theirs, culprit)
        work = self.active.get(tag)
        eng.send_aborts(tag, work.world_of if work is not None else eng.peers, mine, theirs,
                        culprit)
        self._fail_collective(tag, exc)

    def unasked(self, tag: int, fp, sender: int) -> None:
        work = self.active.get(tag)
        if work is not None and work.fp != fp:
            self.mismatch(tag, work.fp, fp, sender)

    def abort_received(self, tag: int, sender_fp, culprit_fp, culprit: int, sender: int) -> None:
        if tag in self.failed or self.engine.retired(group_of(tag)):
            return
        if culprit == DEAD:
            dead = culprit_fp[0]   # (an ABORT's fingerprint field names the dead rank)
            left = culprit_fp[1] == LEFT
            what = "failed: it has left the job (it called destroy())" if left else "failed"
            exc = PeerFailure(f"rank {dead} {what} (reported by rank {sender})", rank=dead,
                              left=left)
            # Every call with it fails alike (peer_failed), not only this one: members need
            # not be in the same call, and the reporter may exit before we see the death.
            if dead != sender:
                self.engine.fail_peer(dead, exc)
            if tag in self.failed:   # a call in flight here: it failed with the rest
                return
        elif culprit == GAVE_UP or culprit == REFUSED or culprit == ABANDONED:
            if tag not in self.active:
                # Not entered yet: it fails as it starts. (Or finished here, every message it
                # needed having arrived: it stands, and this is never asked for.)
                _bounded_put(self.given_up, tag, (sender, culprit))
                return
            exc = self.gave_up_error(self.active[tag].what, sender, culprit)
        elif culprit == STALE:
            earlier = culprit_fp[0]   # (... or the earlier call's tag)
            exc = CollectiveMismatch(
                f"{self._call(tag)}: rank {sender} refused it because collective "
                f"#{call_number(earlier)} of this group was mismatched across ranks")
        else:
            exc = self._mismatch_error(tag, sender_fp, sender, culprit_fp, culprit, reporter=sender)
        if tag in self.active:
            self._fail_collective(tag, exc)
        else:
            _bounded_put(self.aborts, tag, exc)
            self._fail_after(tag, exc, sender)

    def peer_failed(self, rank: int, exc) -> None:
        """A peer is gone: every collective in flight that has it as a member is doomed -
        fail each now, and tell its other members, not only the one waiting on that peer
        (members need not be in the same call: one waiting on a survivor would otherwise
        blame the survivor's exit)."""
        for tag, work in list(self.active.items()):
            if rank in work.world_of:
                self.propagate_failure(work, exc)
                self._fail_collective(tag, exc)

    def check_members(self) -> None:
        """A call with a dead member cannot complete, even while it still waits on live
        ones. Blame one it waits for first: another may have died only after reporting it."""
        eng = self.engine
        for work in eng.works[:]:
            members = (*work._waiting_on(), *work.world_of)
            dead = next((eng.failure_of(r) for r in members
                         if r != eng.rank and eng.failure_of(r)), None)
            if dead is not None:
                self.propagate_failure(work, dead)
                self._fail_collective(work.tag, dead)

    # -- what fails, and how -------------------------------------------------------------
    def gave_up_error(self, what: str, sender: int, why: int = GAVE_UP):
        if why == REFUSED:
            return CollectiveMismatch(
                f"rank {self.engine.rank}: {what}: rank {sender} refused it: its arguments "
                f"failed the call's checks there (rank {sender}'s error says which); this "
                f"call's outputs here are undefined")
        if why == ABANDONED:
            return RingletError(
                f"rank {self.engine.rank}: {what}: rank {sender} abandoned it: it is a part of "
                f"one call whose earlier part (an uneven all_to_all's table of splits, an "
                f"earlier block of a reduce_scatter) failed there - rank {sender}'s error "
                f"says why; this call's outputs here are undefined")
        return TimeoutError(f"rank {self.engine.rank}: {what}: rank {sender} gave up on it (its "
                            f"timeout ran out); this call's outputs here are undefined")

    def _call(self, tag: int) -> str:
        work = self.active.get(tag)
        return work.what if work is not None else f"collective #{call_number(tag)}"

    def _mismatch_error(self, tag, a_fp, a_rank, b_fp, b_rank, reporter=None) -> CollectiveMismatch:
        a, b = self.describe_fp(a_fp), self.describe_fp(b_fp)
        work = self.active.get(tag)
        ranks = list(getattr(getattr(work, "group", None), "ranks", None) or ())
        if ranks != list(range(len(ranks))):
            # a root is a rank of the group, the ranks named are the world's: say both
            for d in (a, b):
                root = d.get("root")
                if isinstance(root, int) and 0 <= root < len(ranks):
                    d["root"] = f"{root} (world rank {ranks[root]})"
        text = diff(a, b, a_rank, b_rank)
        via = f" (reported by rank {reporter})" if reporter is not None else ""
        return CollectiveMismatch(f"{self._call(tag)}: ranks disagree: {text}{via}")

    def _fail_after(self, tag: int, exc, sender: int) -> None:
        """A call of this group that this rank finished (as a pure sender, a broadcast's
        root) was aborted: the group's later calls in flight here cannot complete, nor
        (after a mismatch) can receives from the rank that gave up on it."""
        group = group_of(tag)
        theirs, why = _refusal(exc, tag)
        for t in [t for t in self.active if group_of(t) == group and t > tag]:
            work = self.active[t]
            # Peers in it would wait for us: abort it for them too.
            self.engine.send_aborts(t, work.world_of, work.fp, theirs, why)
            self._fail_collective(t, exc)
        if why == STALE:
            self.engine.fail_receives(sender, lambda t: group_of(t) == group
                                      and not t & TAG_COLLECTIVE, exc)

    def _fail_collective(self, tag: int, exc) -> None:
        _bounded_put(self.failed, tag, True)
        work = self.active.pop(tag, None)
        self.engine.fail_tag(tag, exc)
        if work is not None:
            work.fail(exc)
        else:
            _bounded_put(self.aborts, tag, exc)
