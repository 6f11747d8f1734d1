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

TRIGGERS = {"drain", "manual", "failure", "healthcheck", "straggler", "rebalance"}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Migration:
    id: int
    leaver: str
    leaver_ranks: tuple[int, ...]
    trigger: str
    requested_at: float
    epoch: int = 0
    joiner: str = ""
    phase: Phase = Phase.REQUESTED
    times: dict[str, float] = field(default_factory=dict)   # phase name -> wall time entered
    prepared: set = field(default_factory=set)               # (rank, role) that finished Phase 1
    switched: dict = field(default_factory=dict)             # (rank, role) -> switched message
    expected: set = field(default_factory=set)               # (rank, role) that must report
    switch_step: int | None = None
    downtime_s: float | None = None
    leaver_exited: bool = False
    note: str = ""
    recovery: bool = False     # an unexpected failure: the leaver is gone, the job paused
    source: dict = field(default_factory=dict)   # recovery: where the state came from

    def __post_init__(self):
        if self.trigger not in TRIGGERS:
            raise ValueError(f"unknown trigger {self.trigger!r}")
        self.times[self.phase.value] = self.requested_at

    @property
    def active(self) -> bool:
        return self.phase not in TERMINAL

    def to(self, phase: Phase, now: float, note: str = "") -> None:
        if phase not in ALLOWED[self.phase]:
            raise IllegalTransition(f"migration {self.id} ({self.leaver}): {self.phase.value} -> {phase.value} is not allowed")
        log.info("migration %d %s: %s -> %s%s", self.id, self.leaver, self.phase.value, phase.value,
                 f" ({note})" if note else "")
        self.phase = phase
        self.times[phase.value] = now
        if note:
            self.note = note

    def to_record(self) -> dict:
        """What the journal keeps (see controller.journal): enough to rebuild the migration.
        Who prepared or switched is not kept: a restarted controller asks the ranks."""
        return {"id": self.id, "leaver": self.leaver, "leaver_ranks": list(self.leaver_ranks), "trigger": self.trigger,
                "requested_at": self.requested_at, "epoch": self.epoch, "joiner": self.joiner, "phase": self.phase.value,
                "times": dict(self.times), "switch_step": self.switch_step, "downtime_s": self.downtime_s,
                "leaver_exited": self.leaver_exited, "note": self.note, "recovery": self.recovery,
                "source": dict(self.source)}

    @classmethod
    def from_record(cls, d: dict) -> "Migration":
        m = cls(d["id"], d["leaver"], tuple(d["leaver_ranks"]), d["trigger"], d["requested_at"], epoch=d["epoch"],
                joiner=d["joiner"], phase=Phase(d["phase"]), switch_step=d.get("switch_step"),
                downtime_s=d.get("downtime_s"), leaver_exited=bool(d.get("leaver_exited")), note=d.get("note", ""),
                recovery=bool(d.get("recovery")), source=dict(d.get("source") or {}))
        m.times = dict(d["times"])
        return m

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
