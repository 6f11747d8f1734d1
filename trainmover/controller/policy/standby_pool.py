"""The standby pool: the one owner of every standby's state, and of taking standbys (pure).

    STARTING ──> READY ──> JOINING (taken by a migration or a recovery; leaves the pool when
       ^  ^        │  ^        │    its ranks switch, `remove`)
       │  └─ WARMING <┘        │
       └───────────────────────┘ (an aborted join: it warms up again)

Every change of `Standby.state` goes through `_to`, which checks the table below and logs one
line; "pick a ready standby" is `take_ready`. Acquiring (a node from Slurm) and the bound on
standbys lost per job are here too; what a lost standby means for a migration is
controller/policy/standby_loss.py's.
"""
from __future__ import annotations

import logging

from trainmover.config import Config
from trainmover.controller.durable.state import PolicyState
from trainmover.controller.durable.view import Standby, StandbyState as S
from trainmover.controller.policy.actions import AcquireStandby
from trainmover.errors import TrainMoverError

log = logging.getLogger("trainmover.policy")

ALLOWED: dict[S, set[S]] = {
    S.STARTING: {S.READY, S.STARTING},
    S.READY: {S.JOINING, S.WARMING, S.READY, S.STARTING},  # READY again: a re-ready after a re-warm
    S.WARMING: {S.READY, S.STARTING},
    # an aborted join warms up again; a successor finds the joiner never took the epoch up
    # (controller/policy/takeover.py) and takes it as warm as it says
    S.JOINING: {S.STARTING, S.READY},
}


class IllegalStandbyTransition(TrainMoverError):
    pass


class StandbyPool:
    def __init__(self, cfg: Config, state: PolicyState):
        self.cfg, self.state = cfg, state
        # An acquisition runs in the executor's background: one in flight dies with its controller
        # (a successor adopts any node Slurm gave the job meanwhile as a standby), and the retry
        # timer starts afresh with the successor's clock. Not journaled.
        self.acquiring = False
        self.next_acquire_at = 0.0
        self.acquire_note = ""
        # Why no standby is taken from the reservation ("": one may be; None: not known yet, so
        # the resizer is asked and its gate answers). Set by the executor from the rights check
        # (slurm/pool_mode.py): where grow is refused the pool is what the job brought
        # (TM_INJOB_STANDBYS) and is not refilled. Not journaled: a successor learns it again.
        self.refill_refused: str | None = None

    @property
    def standbys(self) -> dict[str, Standby]:
        return self.state.view.standbys

    def get(self, node: str) -> Standby | None:
        return self.standbys.get(node)

    # --- transitions ---------------------------------------------------------------------
    def _to(self, s: Standby, new: S, now: float | None, why: str = "") -> None:
        if new not in ALLOWED[s.state]:
            raise IllegalStandbyTransition(f"standby {s.node}: {s.state.value} -> {new.value} is not allowed")
        if new is not s.state:
            log.info("standby %s: %s -> %s%s", s.node, s.state.value, new.value, f" ({why})" if why else "")
        s.state = new
        if now is not None:
            s.since = now

    def add(self, now: float, node: str) -> Standby:
        s = self.standbys[node] = Standby(node, S.STARTING, now)
        log.info("standby %s: starting", node)
        return s

    def ready_nodes(self) -> list[str]:
        return sorted(s.node for s in self.standbys.values() if s.state is S.READY)

    def take_ready(self, order=sorted) -> str | None:
        """The one way a standby is picked: the first ready one in `order` (a function of the
        ready nodes' names), taken for a join (JOINING); None if none is ready."""
        ready = order(self.ready_nodes())
        if not ready:
            return None
        self._to(self.standbys[ready[0]], S.JOINING, None, "taken")
        return ready[0]

    def mark_ready(self, now: float, node: str, warmup_s: float, shadow_steps: int, shadow: dict) -> None:
        s = self.standbys[node]
        self._to(s, S.READY, now)
        s.warmup_s, s.shadow_steps = warmup_s, shadow_steps
        s.shadow = shadow or s.shadow  # a re-ready after a cancelled join keeps the first report

    def mark_warming(self, now: float, node: str) -> None:
        """A ready standby re-warms on a newer recording: not offered until ready again."""
        s = self.standbys.get(node)
        if s is not None and s.state is S.READY:
            self._to(s, S.WARMING, now)

    def mark_starting(self, node: str, why: str) -> None:
        """Its join was called off: each of its processes reports 'ready' again once back."""
        s = self.standbys[node]
        self._to(s, S.STARTING, None, why)
        s.warm = set()

    def mark_rejoined(self, node: str, ready: bool) -> None:
        """A successor learnt that the joiner never took its epoch up: as warm as it says."""
        self._to(self.standbys[node], S.READY if ready else S.STARTING, None, "never took the epoch up")

    def remove(self, node: str) -> Standby | None:
        """It joined the ranks, or was lost: no longer a standby."""
        s = self.standbys.pop(node, None)
        if s is not None and self.refill_refused and self.cfg.injob_standbys:
            log.info("standby pool: %s", self.left_line())
        return s

    def restore(self, now: float, states: dict[str, S]) -> None:
        """A successor's pool from the journal: a joiner stays taken until the migration in
        flight is resolved; every other standby starts over (its processes report 'ready' again
        on their new connection)."""
        self.standbys.clear()
        for node, st in states.items():
            self.standbys[node] = Standby(node, S.JOINING if st is S.JOINING else S.STARTING, now)

    def add_in_job(self, now: float, nodes: list[str]) -> None:
        """The job's own standbys (TM_INJOB_STANDBYS), at its start: in the pool as any taken one."""
        for node in nodes:
            self.add(now, node)
        if nodes:
            log.info("standby pool: %d in-job standby(s) from the job's own allocation: %s", len(nodes),
                     ", ".join(nodes))
        if nodes and self.refill_refused:
            log.info("standby pool: %s", self.left_line())

    # --- acquiring ------------------------------------------------------------------------
    def wanted(self) -> int:
        """The pool's size to keep: TM_STANDBYS, and no fewer than the job brought in its allocation."""
        return max(self.cfg.standbys, self.cfg.injob_standbys)

    def refill_off(self, refusal: str | None) -> None:
        """The rights check's verdict on grow (see refill_refused)."""
        self.refill_refused = refusal
        if refusal:  # what status says where the job brought none (the resizer's words for it)
            self.acquire_note = f"no standby is taken: {refusal}"
        if refusal and self.cfg.injob_standbys and self.standbys:  # a successor's pool; at start: add_in_job says it
            log.info("standby pool: %s", self.left_line())

    def left_line(self) -> str:
        """Where no refill is possible: how many of the job's in-job standbys are left."""
        left = len(self.standbys)
        return (f"{left} of the job's {self.cfg.injob_standbys} in-job standby(s) left"
                + ("" if left else " (all used or lost)")
                + f"; none is taken from the reservation: {self.refill_refused}")

    def exhausted(self) -> bool:
        return len(self.state.standbys_lost) >= self.cfg.standby_losses

    def note(self) -> str:
        lost = self.state.standbys_lost
        if self.refill_refused and self.cfg.injob_standbys and not self.exhausted():
            return self.left_line()
        if not self.exhausted():
            return ""
        return (f"{len(lost)} standby(s) lost ({', '.join(x['node'] for x in lost)}); "
                f"TM_STANDBY_LOSSES={self.cfg.standby_losses} reached: no more standbys are taken")

    def none_left(self) -> str:
        """Why a migration finds no standby and none will come ('' when one may still come): the
        in-job standbys are used and grow is refused. What follows is today's path without a
        standby: a drain waits, the job training on its node; a failure goes to the next tier."""
        if self.standbys or not self.refill_refused:
            return ""
        brought = (f"the job's {self.cfg.injob_standbys} in-job standby(s) are used or lost"
                   if self.cfg.injob_standbys else "the job has no standby")
        return f"no standby left: {brought}, and none is taken from the reservation ({self.refill_refused})"

    def maybe_acquire(self, now: float, done: bool) -> list:
        if self.refill_refused:  # grow is refused: never asked (the job keeps what it brought)
            return []
        want = len(self.standbys) < self.wanted() and not done and not self.exhausted()
        if want and not self.acquiring and now >= self.next_acquire_at:
            self.acquiring = True
            return [AcquireStandby()]
        return []

    def acquired(self) -> None:
        self.acquiring, self.acquire_note = False, ""

    def unavailable(self, now: float, reason: str) -> None:
        self.acquiring = False
        self.next_acquire_at = now + self.cfg.standby_retry_s
        self.acquire_note = reason

    def lost(self, now: float, node: str, evidence: str) -> Standby:
        """Drop a lost standby from the pool and count it against TM_STANDBY_LOSSES."""
        s = self.standbys.pop(node)
        self.count_lost(now, node, s.state, evidence)
        log.warning("standby on %s lost while %s (%s); %d of %d allowed losses", node, s.state.value, evidence,
                    len(self.state.standbys_lost), self.cfg.standby_losses)
        if self.refill_refused and self.cfg.injob_standbys:
            log.info("standby pool: %s", self.left_line())
        return s

    def count_lost(self, now: float, node: str, state: S, evidence: str) -> None:
        """One lost standby in the job's record (status.standbys_lost; TM_STANDBY_LOSSES counts
        them): one already out of the pool too, e.g. a recovery's joiner lost before its plan."""
        self.state.standbys_lost.append({"node": node, "state": state.value, "evidence": evidence, "t": now})

    def status(self) -> dict:
        out = {"wanted": self.wanted(), "acquiring": self.acquiring, "note": self.note() or self.acquire_note}
        if self.cfg.injob_standbys:
            refill = "not known yet" if self.refill_refused is None else "no" if self.refill_refused else "yes"
            out["in_job"] = {"brought": self.cfg.injob_standbys, "refill": refill,
                             **({"left": len(self.standbys)} if self.refill_refused else {})}
        return out
