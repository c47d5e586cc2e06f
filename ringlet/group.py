"""Process groups: which world ranks take part, this rank's place among them, and the
per-group sequence number that keeps two groups' (or two calls') traffic apart."""
from __future__ import annotations

from dataclasses import dataclass, field

# A wire tag: the group's id from bit TAG_GROUP_SHIFT up; below it, a collective call sets
# TAG_COLLECTIVE and its sequence number, a point-to-point message the user's tag.
TAG_GROUP_SHIFT = 48
TAG_COLLECTIVE = 1 << 47
MAX_USER_TAG = 1 << 40
# Group ids (bits 48-62: 1 .. 0x7FFF; the first world is 0). new_group, which every rank
# calls, counts them up from 1 below KEYED_MIN; keyed_group (torch's subgroups, made by
# their members only) hashes a name into KEYED_MIN and up. Apart, so a rank's count does
# not depend on which keyed groups it is in.
KEYED_MIN = 0x4000
MAX_GID = 0x7FFF


def group_of(tag: int) -> int:
    """The id of the group a wire tag belongs to."""
    return tag >> TAG_GROUP_SHIFT


def call_number(tag: int) -> int:
    """The sequence number of the collective call a wire tag names."""
    return tag & (TAG_COLLECTIVE - 1)


@dataclass(eq=False)
class Group:
    id: int
    ranks: tuple[int, ...]          # world rank of each group rank
    rank: int                       # this process's rank in the group, -1 if not a member
    hosts: tuple[str, ...]          # host identity of each group rank
    name: str = ""
    seq: int = 0                    # collectives issued on this group so far
    lost: tuple[int, ...] = ()      # a world made by rl.shrink: the old world's ranks lost
    previous: tuple[int, ...] = ()  # ... and each of its ranks' rank in the old world
    timeout: float | None = None    # new_group(timeout=): its calls' default (else init's)
    _index: dict = field(default_factory=dict)

    def __post_init__(self):
        self._index = {w: g for g, w in enumerate(self.ranks)}
        # (the tag's fixed bits, once: 3-digit integers cost an allocation per operation)
        self._tag_base = (self.id << TAG_GROUP_SHIFT) | TAG_COLLECTIVE
        if not self.name:
            self.name = "world" if self.id == 0 else f"group{self.id}{list(self.ranks)}"

    @property
    def size(self) -> int:
        return len(self.ranks)

    def group_rank(self, world_rank: int) -> int:
        return self._index.get(world_rank, -1)

    def p2p_tag(self, tag: int) -> int:
        return (self.id << TAG_GROUP_SHIFT) | tag

    def next_collective_tag(self) -> tuple[int, int]:
        """(sequence number, wire tag) of the next collective on this group."""
        seq = self.seq = self.seq + 1
        return seq, self._tag_base | (seq % TAG_COLLECTIVE)

    def host_indices(self) -> tuple[int, ...]:
        """Host of each group rank as small integers (first appearance order)."""
        seen: dict[str, int] = {}
        return tuple(seen.setdefault(h, len(seen)) for h in self.hosts)

    def __repr__(self) -> str:
        return f"<ringlet Group {self.name}: size {self.size}, my rank {self.rank}>"
