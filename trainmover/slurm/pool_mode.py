"""Where a job's standbys come from on the cluster at hand, chosen from Slurm's facts (pure):
whether slurm.conf permits job expansion, whether slurmctld's release survives it
(expansion_safety.py, with the admin's declaration), and whether the standby reservation
admits the job's user.

    reservation-grow  standbys are taken from the reservation into the running job (salloc
                      --dependency=expand, then the donor merged): needs all three facts.
    in-job            the job asks for its standby nodes at submit and keeps them in its own
                      allocation; a migration gives the drained node back by a shrink, which
                      Slurm allows every job's owner. NOT BUILT YET (issue 40, item 1): no
                      caller passes in_job=True, so no cluster gets it today.
    none              no standbys: the job can neither grow nor bring its own.

The order of the checks is the order of rights.decide, which takes grow's verdict from here:
slurm.conf first (nothing else matters without it), then the release (a refusal for a crash
is said even where the reservation would refuse too), then the reservation.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class Mode(str, enum.Enum):
    RESERVATION_GROW = "reservation-grow"
    IN_JOB = "in-job"
    NONE = "none"


IN_JOB_BUILT = False  # see the module's docstring: flip only with the in-job mode itself


@dataclass(frozen=True)
class PoolMode:
    """The mode, why in one line, and what blocks grow: ("", "") when nothing does, else a key
    of rights.ADVICE ("slurm.conf", "release", "reservation") and grow's refusal."""

    mode: Mode
    why: str
    blocked_by: str = ""
    refusal: str = ""

    def as_status(self) -> dict:
        return {"mode": self.mode.value, "why": self.why}

    def line(self) -> str:
        return f"standby mode: {self.mode.value} ({self.why})"


def choose(*, expansion_permitted: bool, release_safe: bool, release_why: str, reservation: str,
           reservation_refusal: Optional[str], expansion_off_why: str, in_job: bool = IN_JOB_BUILT) -> PoolMode:
    """The pool mode from the facts. `reservation_refusal`: why the reservation refuses the user
    ('' when it admits them; None when not checked, as at submit, before the job's account is
    known). `in_job`: whether in-job standbys exist (IN_JOB_BUILT)."""
    if not expansion_permitted:
        blocked_by, refusal = "slurm.conf", expansion_off_why
    elif not release_safe:
        blocked_by, refusal = "release", release_why
    elif reservation_refusal:
        blocked_by, refusal = "reservation", reservation_refusal
    else:
        admits = ("if it admits this job's user (checked when the job starts)" if reservation_refusal is None
                  else "which admits this job's user")
        return PoolMode(Mode.RESERVATION_GROW, f"standbys are taken from reservation {reservation}, {admits}, "
                                               f"into the running job; {release_why}")
    if in_job:
        return PoolMode(Mode.IN_JOB, f"{refusal}: the job keeps its standbys in its own allocation", blocked_by, refusal)
    return PoolMode(Mode.NONE, f"{refusal}: no standby can join the job, and standbys kept in the job's own "
                               "allocation (the mode that needs no job expansion) are not built yet", blocked_by, refusal)
