"""The controller's decisions when a standby dies (pure: events in, actions out).

A standby is *lost* when its agent's control connection closes or its Slurm step ends while
it is still a standby: warming up, ready, or joining a migration (Phase 1 or the state copy).
The first sign wins; the second finds it gone already. Then:

    starting / ready / warming ──> dropped from the pool, its node handed back to Slurm,
                                   another standby taken (the pool is refilled)
    joining a planned migration in Phase 1 ──> that migration is aborted (no rank switched:
                                   the boundary agreement needs the joiner's epoch), and asked
                                   again as a new migration once another standby is warm
    joining a recovery not yet planned ──> the recovery picks another warm standby
    joining a recovery already planned ──> the job stops with a clear error (two failures)

Bounded: after `standby_losses` losses in one job no more standbys are taken (a node class
or a software setup that kills every standby would otherwise loop). A drain then waits, the
job training on the old node, and status and log say why.
"""
from __future__ import annotations

import logging
from typing import Callable

from trainmover.controller.durable.migration import Migration, Phase
from trainmover.controller.durable.state import PolicyState
from trainmover.controller.durable.view import StandbyState
from trainmover.controller.policy.actions import Finish, ReleaseNode, Record
from trainmover.controller.policy.planner import Planner
from trainmover.controller.policy.recovery import RecoveryPolicy
from trainmover.controller.policy.standby_pool import StandbyPool

log = logging.getLogger("trainmover.policy")


class StandbyLoss:
    """The policy's part for a standby that dies; the pool (standby_pool.py) keeps the count."""

    def __init__(self, state: PolicyState, pool: StandbyPool, planner: Planner, recovery: RecoveryPolicy,
                 done: Callable[[], bool]):
        self.state, self.pool, self.planner, self.recovery, self.done = state, pool, planner, recovery, done
        # transient: drained standbys whose release is under way (Slurm's answer comes to this controller)
        self.drained_nodes: set[str] = set()

    def drained(self, now: float, node: str, reason: str) -> list:
        """An admin (or the health check) drained a standby's node: it is given back to Slurm
        and another taken; not a loss (TM_STANDBY_LOSSES counts standbys that die). A standby
        already joining is left to its migration: as a rank on a drained node it moves again.
        Until now a drained standby stayed in the pool, and a controller on its node never
        handed over (bench/cpu_controller_move.py, a drain waited 120 s for the node to leave)."""
        s = self.pool.get(node)
        if s is None or s.state is StandbyState.JOINING:
            return []
        self.pool.remove(node)
        self.drained_nodes.add(node)
        log.info("standby %s drained (%s): given back", node, reason or "no reason")
        return ([Record("timeline", {"t": now, "migration": None, "event": "standby_drained", "node": node,
                                     "reason": reason}), ReleaseNode(node)]
                + self.planner.maybe_acquire(now) + self.planner.dispatch(now))

    def lost(self, now: float, node: str, evidence: str) -> list:
        s = self.pool.lost(now, node, evidence)
        actions: list = [Record("timeline", {"t": now, "migration": None, "event": "standby_lost", "node": node,
                                             "state": s.state.value, "evidence": evidence}),
                         ReleaseNode(node)]
        m = self.planner.active()
        if s.state is StandbyState.JOINING and m is not None and m.joiner == node:
            actions += self._joiner_lost(now, m, node, evidence)
        if self.pool.exhausted() and not self.done():
            log.error("standby pool: %s", self.pool.note())
        return (actions + self.planner.maybe_acquire(now) + self.recovery.maybe_recover(now)
                + self.planner.dispatch(now))

    def _joiner_lost(self, now: float, m: Migration, node: str, evidence: str) -> list:
        if m.recovery:
            if m.phase in (Phase.REQUESTED, Phase.WAITING_STANDBY):  # no plan sent: take another standby
                m.joiner = ""
                return [self.planner.timeline(m, now, "joiner_lost", node=node, evidence=evidence)]
            return self.planner.fail(now, m, f"the standby on {node} taking over from {m.leaver} was lost ({evidence})") + [
                    Finish(False, f"the standby on {node} taking over the lost ranks {list(m.leaver_ranks)} of "
                                  f"{m.leaver} was lost during the recovery ({evidence}): two overlapping failures "
                                  "are not recovered; the job stops")]
        if m.phase is Phase.PREPARING:
            return self.planner.abort(now, m, f"joiner {node} lost during phase 1 ({evidence})")
        # SWITCHING: the stayers may already run on groups with the joiner in the slot, which
        # is now held by a lost process: the leaver's ranks are recovered as lost, from a
        # replica onto another standby (the leaver, whose send fails, stops: roles/switch.py).
        log.error("joiner %s of migration %d lost during the switch (%s)", node, m.id, evidence)
        return self.recovery.fault(now, m.leaver, f"its joiner {node} was lost during the state copy ({evidence})")

    def released(self, now: float, node: str, ok: bool, message: str) -> list:
        """Slurm's answer to the release of a lost standby's node."""
        if ok:
            self.state.view.released.append(node)
        return [Record("timeline", {"t": now, "migration": None, "event": "standby_released" if ok else "standby_kept",
                                    "node": node, "note": message})]
