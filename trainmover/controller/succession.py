"""Who is the job's controller, as the keeper sees it (pure: events and `now` in, verdicts out).

The keeper (controller/keeper.py) runs the controller (the *primary*) as a step on one training
node and, from the start, a warm *successor* on another: its imports done, its control socket and
rendezvous store bound, waiting for one word. The primary moves or is lost; the keeper promotes
the successor and starts a new one:

    STARTING ──(any frame)──> SERVING ──("moving", or exit code MOVED)──> HANDING_OVER ─┐
        │                        │                                                       ├─> promote
        └──(start deadline)──────┴──(silent past the deadline, channel closed,           │
                                      step ended without an outcome)──> LOST ────────────┘
    STARTING, SERVING, LOST ──(status.json has an outcome)──> ENDING ──(its step ends)──> ENDED

Silence is measured from the last frame the keeper received from the primary (it beats every
0.25 s from a thread of its own, and answers the keeper's probes; any frame counts). A channel that closes is a loss at once: a controller
that moves says `moving` first, and one that ends the job writes its outcome (status.json) before
it closes anything: the keeper checks for it before it acts on a loss (`ending`), and a primary
ENDING is never replaced (its shutdown may be silent for a while: it waits for the steps).

Fencing is not decided here: the promoted successor's first act is its claim in the journal
(controller/journal.py), after which the old primary can act on nothing, and the keeper kills
the old primary's step as well.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from trainmover.controller.exit_codes import MOVED

log = logging.getLogger("trainmover.keeper")



class State(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    HANDING_OVER = "handing_over"
    LOST = "lost"
    ENDING = "ending"
    ENDED = "ended"


ALLOWED = {
    State.STARTING: {State.SERVING, State.HANDING_OVER, State.LOST, State.ENDING, State.ENDED},
    State.SERVING: {State.HANDING_OVER, State.LOST, State.ENDING, State.ENDED},
    State.HANDING_OVER: {State.ENDED, State.LOST},
    State.LOST: {State.ENDING, State.ENDED},
    State.ENDING: {State.ENDED, State.LOST},
    State.ENDED: set(),
}


class IllegalSuccessionTransition(Exception):
    pass


@dataclass(frozen=True)
class Promote:
    """Make the successor the primary now. `fence`: the old primary may still run (lost, not
    handing over): kill its step."""
    why: str
    fence: bool


class Primary:
    """The keeper's view of one primary controller, from its start to its promotion or end."""

    def __init__(self, node: str, attempt: int, now: float, deadline_s: float, start_deadline_s: float):
        self.node, self.attempt = node, attempt
        self.state = State.STARTING
        self.started_at = self.last_heard = now
        self.deadline_s, self.start_deadline_s = deadline_s, start_deadline_s
        self.why = ""

    def _to(self, state: State, now: float, why: str) -> None:
        if state not in ALLOWED[self.state]:
            raise IllegalSuccessionTransition(f"controller on {self.node}: {self.state.value} -> {state.value} ({why})")
        log.info("controller on %s (attempt %d): %s -> %s at %.3f: %s", self.node, self.attempt, self.state.value,
                 state.value, now, why)
        self.state, self.why = state, why

    def heard(self, now: float) -> None:
        """Any frame from the primary: it lives."""
        self.last_heard = max(self.last_heard, now)
        if self.state is State.STARTING:
            self._to(State.SERVING, now, "answers")

    def moving(self, now: float, why: str) -> Promote | None:
        """It said it hands over (its node leaves the job): promote at once, nothing to fence."""
        if self.state in (State.STARTING, State.SERVING):
            self._to(State.HANDING_OVER, now, why)
            return Promote(f"hands over: {why}", fence=False)
        return None

    def ending(self, now: float) -> None:
        """Its outcome is written: it ends the job; wait for its step to end, never replace it."""
        if self.state not in (State.ENDING, State.ENDED, State.HANDING_OVER):
            self._to(State.ENDING, now, "it wrote the job's outcome")

    def channel_closed(self, now: float) -> Promote | None:
        """Its channel closed without `moving`. A moving controller closes it after its word."""
        if self.state is State.SERVING:
            return self._lost(now, "its channel to the keeper closed")
        return None

    def exited(self, now: float, code: int, final: int | None) -> Promote | int | None:
        """Its step ended. `final`: the job's exit code if it ended the job on purpose (its
        outcome), else None. Returns the job's exit code to end with, a promotion, or None
        (already promoted)."""
        if final is not None:
            if self.state is not State.ENDED:
                self._to(State.ENDED, now, f"ended the job (exit code {final})")
            return final
        if self.state in (State.HANDING_OVER, State.ENDING):  # ENDING without an outcome: read it torn
            return None if self.state is State.HANDING_OVER else self._lost(now, f"its step ended (exit code {code}) "
                                                                              "with no readable outcome")
        if code == MOVED and self.state in (State.STARTING, State.SERVING):
            return self.moving(now, "its step ended with MOVED")
        if self.state in (State.STARTING, State.SERVING):
            return self._lost(now, f"its step ended (exit code {code}) without an outcome")
        return None

    def check(self, now: float) -> Promote | None:
        """Called every loop turn: silence past the deadline is a loss."""
        if self.state is State.SERVING and now - self.last_heard > self.deadline_s:
            return self._lost(now, f"silent for {now - self.last_heard:.1f}s (deadline {self.deadline_s:.1f}s)")
        if self.state is State.STARTING and now - self.started_at > self.start_deadline_s:
            return self._lost(now, f"never answered within {self.start_deadline_s:.0f}s")
        return None

    def _lost(self, now: float, why: str) -> Promote:
        self._to(State.LOST, now, why)  # the keeper checks for an outcome before it acts (`ending`)
        return Promote(why, fence=True)


def may_promote(why_lost: bool, attempt: int, restarts: int) -> bool:
    """A hand-over is always allowed (the node leaves on purpose); a loss only while restarts are
    left (TM_CONTROLLER_RESTARTS), so that a controller that kills every node it lands on stops."""
    return not why_lost or attempt < restarts
