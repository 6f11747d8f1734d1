"""What the policy asks the executor to do. Plain values: the policy never acts itself."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from trainmover.protocol.messages import Message


@dataclass(frozen=True)
class AcquireStandby:
    pass


@dataclass(frozen=True)
class LaunchStandby:
    node: str


@dataclass(frozen=True)
class Send:
    nodes: tuple[str, ...]
    msg: Message


@dataclass(frozen=True)
class ReleaseNode:
    node: str


@dataclass(frozen=True)
class Record:
    stream: str          # "timeline", "metrics" or "final"
    payload: dict[str, Any]


@dataclass(frozen=True)
class Finish:
    ok: bool
    message: str


@dataclass(frozen=True)
class Rewind:
    """A recovery rolled every rank back to `step`: rows of later steps leave metrics.jsonl
    (they are redone and logged again; each step is logged once, from the final run)."""
    step: int


@dataclass(frozen=True)
class CheckpointDone:
    """Every rank wrote its file of `step`: write the manifest (last), then delete the
    checkpoints older than the newest of `keep` that are not in it."""
    step: int
    digests: dict[int, str]  # rank -> the digest of its file
    keep: tuple[int, ...]


@dataclass(frozen=True)
class Fence:
    """A process judged dead (controller/policy/liveness.py) can never come back and act: kill its
    Slurm step, refuse its connection from now on, drain its node with `reason`."""
    node: str
    pid: int
    reason: str


# Every action the policy may return: the executor applies each in turn.
Action: TypeAlias = (AcquireStandby | LaunchStandby | Send | ReleaseNode | Record | Finish | Rewind | CheckpointDone
                     | Fence)
