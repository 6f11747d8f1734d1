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

from trainmover.controller.actions import Finish, ReleaseNode, Record
from trainmover.controller.migration import Phase

log = logging.getLogger("trainmover.policy")


class StandbyLoss:
    """Mixed into `Policy`: uses its view, migrations, pool and timeline."""

    def pool_exhausted(self) -> bool:
        return len(self.standbys_lost) >= self.cfg.standby_losses

    def pool_note(self) -> str:
        if not self.pool_exhausted():
            return ""
        return (f"{len(self.standbys_lost)} standby(s) lost ({', '.join(x['node'] for x in self.standbys_lost)}); "
                f"TM_STANDBY_LOSSES={self.cfg.standby_losses} reached: no more standbys are taken")

    def _standby_lost(self, now: float, node: str, evidence: str) -> list:
        s = self.view.standbys.pop(node)
        self.standbys_lost.append({"node": node, "state": s.state, "evidence": evidence, "t": now})
        log.warning("standby on %s lost while %s (%s); %d of %d allowed losses", node, s.state, evidence,
                    len(self.standbys_lost), self.cfg.standby_losses)
        actions: list = [Record("timeline", {"t": now, "migration": None, "event": "standby_lost", "node": node,
                                             "state": s.state, "evidence": evidence}),
                         ReleaseNode(node)]
        m = self.active()
        if s.state == "joining" and m is not None and m.joiner == node:
            actions += self._joiner_lost(now, m, node, evidence)
        if self.pool_exhausted() and not self.done:
            log.error("standby pool: %s", self.pool_note())
        return actions + self._maybe_acquire(now) + self._maybe_recover(now) + self._dispatch(now)

    def _joiner_lost(self, now: float, m, node: str, evidence: str) -> list:
        if m.recovery:
            if m.phase in (Phase.REQUESTED, Phase.WAITING_STANDBY):  # no plan sent: take another standby
                m.joiner = ""
                return [self._timeline(m, now, "joiner_lost", node=node, evidence=evidence)]
            m.to(Phase.FAILED, now, f"the standby on {node} taking over from {m.leaver} was lost ({evidence})")
            return [self._timeline(m, now, "failed", reason=m.note),
                    Finish(False, f"the standby on {node} taking over the lost ranks {list(m.leaver_ranks)} of "
                                  f"{m.leaver} was lost during the recovery ({evidence}): two overlapping failures "
                                  "are not recovered; the job stops")]
        if m.phase is Phase.PREPARING:
            return self._abort(now, m, f"joiner {node} lost during phase 1 ({evidence})")
        # SWITCHING: the stayers may already run on groups with the joiner in the slot; what
        # follows is a lost rank (the stayers stall, the job stops within its deadlines).
        log.error("joiner %s of migration %d lost during the switch (%s)", node, m.id, evidence)
        return []

    def on_lost_standby_released(self, now: float, node: str, ok: bool, message: str) -> list:
        if ok:
            self.view.released.append(node)
        return [Record("timeline", {"t": now, "migration": None, "event": "standby_released" if ok else "standby_kept",
                                    "node": node, "note": message})]
