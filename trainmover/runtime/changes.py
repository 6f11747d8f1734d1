"""What a role may change of its rank process, as values.

A role reads the process's moving parts through `RankContext` (the rank it holds, its groups,
the steps it completed, the planned migration in flight, the epoch it last switched to) and
never assigns them: it hands the process one of these changes (`RankContext.apply`), and the
process (`worker.Agent.apply`) is the one place where those fields are written. So the rules
that tie them together live there once: a switch ends the Phase 1 in flight; a rollback's
switch drops the step reports of the steps that will be redone; an abort drops only the Phase 1
of its own epoch. tests/unit/test_rank_changes.py checks that no role assigns a field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainmover.groups.swappable import SwappableGroup
    from trainmover.runtime import phase1


@dataclass(frozen=True)
class TakeRank:
    """The process now plays `rank` (a standby joining, anticipating or taking a lost rank)."""
    rank: int


@dataclass(frozen=True)
class UseGroups:
    """The process's groups, made for the rank it plays or rehearses (sandboxed or real)."""
    groups: dict[str, SwappableGroup]


@dataclass(frozen=True)
class Completed:
    """The rank's state holds the updates of `step` steps."""
    step: int


@dataclass(frozen=True)
class BeginPhase1:
    """A planned migration's Phase 1 started on this rank (until it switches or is aborted)."""
    prep: phase1.Prepared


@dataclass(frozen=True)
class DropPhase1:
    """The planned migration of `epoch` is void on this rank (aborted)."""
    epoch: int


@dataclass(frozen=True)
class Joining:
    """A standby joins the migration of `epoch` (0: no longer joining)."""
    epoch: int


@dataclass(frozen=True)
class Switched:
    """The rank switched to `epoch`'s groups; any Phase 1 in flight is over. `redo_after`: a
    recovery resumes at that step, and the reports of later steps (to be redone) are dropped."""
    epoch: int
    redo_after: int | None = None


@dataclass(frozen=True)
class StepTraced:
    """One of the steps after a switch whose timings are logged was traced."""


Change = TakeRank | UseGroups | Completed | BeginPhase1 | DropPhase1 | Joining | Switched | StepTraced
