"""A migration's phases as an explicit state machine.

    REQUESTED -> WAITING_STANDBY -> PREPARING -> SWITCHING -> RELEASING -> DONE
                        \\_____________/ \\-> ABORTED (Phase 1 failed/late: nothing changed)
    any non-terminal -> FAILED

Phase 1 is PREPARING (training continues). The pause is inside SWITCHING. RELEASING hands
the leaver's node back to Slurm.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from trainmover.controller.codec import transient

log = logging.getLogger("trainmover.migration")


class Phase(enum.Enum):
    REQUESTED = "requested"
    WAITING_STANDBY = "waiting_standby"
    PREPARING = "preparing"
    SWITCHING = "switching"
    RELEASING = "releasing"
    DONE = "done"
    ABORTED = "aborted"
    FAILED = "failed"


TERMINAL = {Phase.DONE, Phase.ABORTED, Phase.FAILED}
ALLOWED: dict[Phase, set[Phase]] = {
    Phase.REQUESTED: {Phase.WAITING_STANDBY, Phase.PREPARING, Phase.FAILED},
    Phase.WAITING_STANDBY: {Phase.PREPARING, Phase.FAILED},
    Phase.PREPARING: {Phase.SWITCHING, Phase.ABORTED, Phase.FAILED},
    Phase.SWITCHING: {Phase.RELEASING, Phase.FAILED},
    Phase.RELEASING: {Phase.DONE, Phase.FAILED},
    Phase.DONE: set(),
    Phase.ABORTED: set(),
    Phase.FAILED: set(),
}

class Trigger(enum.StrEnum):
    """Why a node leaves."""
    DRAIN = "drain"
    MANUAL = "manual"
    FAILURE = "failure"
    HEALTHCHECK = "healthcheck"
    STRAGGLER = "straggler"
    REBALANCE = "rebalance"


TRIGGERS = {t.value for t in Trigger}


class IllegalPhaseTransition(RuntimeError):
    pass


@dataclass
class Migration:
    id: int
    leaver: str
    leaver_ranks: tuple[int, ...]
    trigger: Trigger
    requested_at: float
    epoch: int = 0
    joiner: str = ""
    phase: Phase = Phase.REQUESTED
    times: dict[str, float] = field(default_factory=dict)   # phase name -> wall time entered
    # Who prepared or switched is not journaled: a controller that takes over asks the ranks
    # (resync, controller/takeover.py), and recomputes who must report.
    prepared: set = transient("(rank, role) that finished Phase 1: the ranks say again", default_factory=set)
    switched: dict = transient("(rank, role) -> switched message: the ranks say again", default_factory=dict)
    expected: set = transient("(rank, role) that must report: recomputed on takeover", default_factory=set)
    switch_step: int | None = None
    downtime_s: float | None = None
    leaver_exited: bool = False
    note: str = ""
    recovery: bool = False     # an unexpected failure: the leaver is gone, the job paused
    source: dict = field(default_factory=dict)   # recovery: where the state came from

    def __post_init__(self):
        if self.trigger not in TRIGGERS:
            raise ValueError(f"unknown trigger {self.trigger!r}")
        self.trigger = Trigger(self.trigger)
        self.times[self.phase.value] = self.requested_at

    @property
    def active(self) -> bool:
        return self.phase not in TERMINAL

    def to(self, phase: Phase, now: float, note: str = "") -> None:
        if phase not in ALLOWED[self.phase]:
            raise IllegalPhaseTransition(f"migration {self.id} ({self.leaver}): {self.phase.value} -> {phase.value} is not allowed")
        log.info("migration %d %s: %s -> %s%s", self.id, self.leaver, self.phase.value, phase.value,
                 f" ({note})" if note else "")
        self.phase = phase
        self.times[phase.value] = now
        if note:
            self.note = note

    def to_json(self) -> dict:
        t = self.times
        def span(a, b):
            return round(t[b] - t[a], 6) if a in t and b in t else None
        return {
            "id": self.id, "epoch": self.epoch, "leaver": self.leaver, "leaver_ranks": list(self.leaver_ranks),
            "joiner": self.joiner or None, "trigger": self.trigger, "state": self.phase.value,
            "phases": {k: round(v, 6) for k, v in t.items()},
            "durations": {"wait_standby_s": span("requested", "preparing") if "waiting_standby" in t else 0.0,
                          "phase1_s": span("preparing", "switching"), "switch_s": span("switching", "releasing"),
                          "release_s": span("releasing", "done")},
            "switch_step": self.switch_step, "downtime_s": self.downtime_s, "note": self.note,
            "recovery": self.recovery, "state_source": self.source or None,
            "transfer": next((m["detail"] for (r, role), m in self.switched.items() if role == "joiner"), None),
            # one per moved rank (a whole node moves several): rank -> the joiner's report
            "transfers": {str(r): m["detail"] for (r, role), m in sorted(self.switched.items()) if role == "joiner"},
        }
