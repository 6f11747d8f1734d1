"""What the policy asks the executor to do. Plain values: the policy never acts itself."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AcquireStandby:
    pass


@dataclass(frozen=True)
class LaunchStandby:
    node: str


@dataclass(frozen=True)
class Send:
    nodes: tuple[str, ...]
    msg: dict


@dataclass(frozen=True)
class ReleaseNode:
    node: str


@dataclass(frozen=True)
class Record:
    stream: str          # "timeline", "metrics" or "final"
    payload: dict


@dataclass(frozen=True)
class Finish:
    ok: bool
    message: str
