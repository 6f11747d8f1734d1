"""The state of one rank process, as an explicit state machine.

    standby:  STARTING ──ready──> READY <──> WARMING          (re-warm on a newer recording)
                                  READY ──prepare──> JOINING ──> TRAINING   (joined: a worker now)
                                  JOINING ──> READY                          (cancelled, failed)
                                  READY ──recover──> TRAINING                (took a vanished rank)
    worker:   TRAINING ──> STALLED ──recover──> TRAINING                     (a collective failed)
              TRAINING ──> LEFT                                              (the leaver of a migration)
              TRAINING ──> FINISHED                                          (all steps done)

Every allowed transition is in `TRANSITIONS`; any other raises `IllegalRankTransition` naming
both ends. The values are what the controller reads in a `resync` (protocol/messages.py):
they are part of the wire protocol and must not change.
"""
from __future__ import annotations

import enum
import logging

from trainmover.errors import TrainMoverError

log = logging.getLogger("trainmover.worker")


class RankState(str, enum.Enum):
    STARTING = "starting"   # a standby warming up for the first time
    READY = "ready"         # a standby, warm, waiting for a prepare or a recover
    WARMING = "warming"     # a standby re-warming on a newer recording version
    JOINING = "joining"     # a standby taking a leaver's slot (planned migration)
    TRAINING = "training"   # a worker in the training loop
    STALLED = "stalled"     # a worker whose collective failed, waiting for the recovery plan
    LEFT = "left"           # a worker that handed its state to a joiner and left the job
    FINISHED = "finished"   # a worker that trained every step


S = RankState
# A process whose state is one of these is a worker (it holds a rank of the job); in any other, a
# standby: the process's role is derived from its state, never kept beside it.
WORKER_STATES = frozenset({RankState.TRAINING, RankState.STALLED, RankState.LEFT, RankState.FINISHED})


def role_of(state: RankState) -> str:
    """"worker" or "standby": what `hello` and `resync` call the process (protocol/messages.py)."""
    return "worker" if state in WORKER_STATES else "standby"


TRANSITIONS: dict[RankState, frozenset[RankState]] = {
    S.STARTING: frozenset({S.READY}),
    S.READY: frozenset({S.WARMING, S.JOINING, S.TRAINING}),
    S.WARMING: frozenset({S.READY}),
    # READY: cancelled or failed; TRAINING: joined, or took the rank from a replica after the leaver died
    S.JOINING: frozenset({S.READY, S.TRAINING}),
    S.TRAINING: frozenset({S.STALLED, S.LEFT, S.FINISHED}),
    S.STALLED: frozenset({S.TRAINING}),
    S.LEFT: frozenset(),
    S.FINISHED: frozenset(),
}


class IllegalRankTransition(TrainMoverError):
    """A rank was asked to move to a state it cannot reach from where it is (a bug)."""

    def __init__(self, src: RankState, dst: RankState, who: str = ""):
        self.src, self.dst = src, dst
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[src])) or "none"
        super().__init__(f"{who or 'rank'}: illegal state transition {src.value} -> {dst.value} "
                         f"(allowed from {src.value}: {allowed})")


class RankStateMachine:
    """One rank process's state: read from any thread (the link's resync, the controller-gone
    check), changed only through `to` on the process's main or warm-up thread."""

    def __init__(self, initial: RankState, who: str = ""):
        self.now, self.who = initial, who

    def to(self, dst: RankState) -> None:
        src = self.now
        if dst not in TRANSITIONS[src]:
            raise IllegalRankTransition(src, dst, self.who)
        self.now = dst
        log.info("%s: %s -> %s", self.who or "rank", src.value, dst.value)

    def __repr__(self) -> str:
        return f"RankStateMachine({self.now.value})"
