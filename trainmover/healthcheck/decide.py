"""What to do with a node, given the findings and its Slurm state. Pure."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from trainmover.healthcheck.checks import Finding

REASON_PREFIX = "trainmover:"
MAX_REASON = 200


@dataclass(frozen=True)
class Action:
    drain: bool
    reason: str      # the drain reason, or why nothing is done
    faults: tuple[Finding, ...] = ()


def reason_for(faults: Sequence[Finding]) -> str:
    text = f"{REASON_PREFIX} healthcheck {faults[0].check}: {faults[0].detail}"
    if len(faults) > 1:
        text += f" (+{len(faults) - 1} more)"
    # scontrol takes the reason as one argument; keep it one printable line
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def decide(findings: Sequence[Finding], *, drained: bool, current_reason: str = "",
           may_drain: bool = True) -> Action:
    faults = tuple(f for f in findings if not f.ok and not f.skipped)
    if not faults:
        return Action(False, "healthy")
    if not may_drain:
        # NHC drains by itself with the text it is given: the reason the drain would carry
        return Action(False, f"not draining (--no-drain): {reason_for(faults)}", faults)
    if drained:
        who = "TrainMover" if current_reason.startswith(REASON_PREFIX) else "someone else"
        return Action(False, f"already drained by {who} ({current_reason or 'no reason'})", faults)
    return Action(True, reason_for(faults), faults)
