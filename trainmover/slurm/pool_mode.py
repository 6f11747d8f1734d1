"""Where a job's standbys come from on the cluster at hand, chosen from Slurm's facts (pure):
whether slurm.conf permits job expansion, whether slurmctld's release survives it
(expansion_safety.py, with the admin's declaration), and whether the standby reservation
admits the job's user.

    reservation-grow  standbys are taken from the reservation into the running job (salloc
                      --dependency=expand, then the donor merged): needs all three facts.
    in-job            the job asks for its standby nodes at submit (TM_INJOB_STANDBYS=N: the
                      last N training nodes of its allocation, controller/view.split_in_job) and
                      keeps them in its own allocation; a migration gives the drained node back
                      by a shrink, which Slurm allows every job's owner. Chosen where grow is not
                      possible and the job has in-job standbys; they are not refilled there.
    none              no standbys: the job can neither grow nor brings its own.

A job with in-job standbys where grow IS possible gets reservation-grow: its in-job standbys
are used first and the pool is refilled from the reservation.

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


IN_JOB_BUILT = True  # in-job standbys exist (TM_INJOB_STANDBYS; issue 40, item 1)


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
           reservation_refusal: Optional[str], expansion_off_why: str, in_job: int = 0) -> PoolMode:
    """The pool mode from the facts. `reservation_refusal`: why the reservation refuses the user
    ('' when it admits them; None when not checked, as at submit, before the job's account is
    known). `in_job`: the job's in-job standbys (TM_INJOB_STANDBYS; 0: none)."""
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
    return with_in_job(PoolMode(Mode.NONE, f"{refusal}: no standby can join the job, and the job brings none in its "
                                           "own allocation (TM_INJOB_STANDBYS=N with N more nodes asked for at "
                                           "submit: the mode that needs no job expansion)", blocked_by, refusal),
                       in_job)


def with_in_job(pool: PoolMode, in_job: int) -> PoolMode:
    """`pool` for a job that brings `in_job` standbys in its own allocation: where grow is
    blocked, in-job (they are used and not refilled); otherwise unchanged."""
    if not in_job or not pool.blocked_by:
        return pool
    return PoolMode(Mode.IN_JOB, f"{pool.refusal}: the job keeps its {in_job} standby(s) in its own allocation "
                                 "(TM_INJOB_STANDBYS) and takes none from the reservation; a drained node leaves "
                                 "by a shrink", pool.blocked_by, pool.refusal)
