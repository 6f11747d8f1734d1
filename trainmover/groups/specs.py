"""Which groups a migration changes: pure logic, no processes.

The parallel layout never changes: the joiner takes the leaver's global ranks, so every
group keeps its members' group ranks (which decide TP shard, PP stage, optimizer shard).
Only groups that contain a leaving rank need a replacement; the others are not touched.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupSpec:
    name: str
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    # Its members send to and receive from their neighbours in group-rank order (pipeline
    # stages: Megatron's p2p). NCCL sets those connections up apart from the ring/tree ones, at
    # their first send; a replacement group pre-connects them in Phase 1 (NcclBackend.preconnect).
    p2p: bool = False

    def __post_init__(self):
        if len(set(self.ranks)) != len(self.ranks) or not self.ranks:
            raise ValueError(f"group {self.name!r}: ranks must be distinct and non-empty: {self.ranks}")


@dataclass(frozen=True)
class Delta:
    epoch: int
    leavers: tuple[int, ...]
    changed: tuple[GroupSpec, ...]
    untouched: tuple[GroupSpec, ...]

    def groups_to_build(self, rank: int) -> tuple[GroupSpec, ...]:
        """Replacements that global `rank` (a stayer, or a joiner in a leaver's slot) builds."""
        return tuple(g for g in self.changed if rank in g.ranks)

    def prefix(self, group: GroupSpec) -> str:
        # Epoch-scoped store keys: a retried or aborted migration never meets stale keys.
        return f"tm/e{self.epoch}/{group.name}/"


def delta(groups: list[GroupSpec], leavers: set[int] | tuple[int, ...], epoch: int) -> Delta:
    if epoch <= 0:
        raise ValueError("epoch must be positive")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"group names must be unique: {names}")
    world = {r for g in groups for r in g.ranks}
    unknown = set(leavers) - world
    if not leavers or unknown:
        raise ValueError(f"leaving ranks {sorted(unknown) or '(none)'} are not in the job's groups")
    changed = tuple(g for g in groups if set(g.ranks) & set(leavers))
    untouched = tuple(g for g in groups if not set(g.ranks) & set(leavers))
    return Delta(epoch, tuple(sorted(leavers)), changed, untouched)
