"""The controller's decisions after an unexpected failure (pure: events in, actions out).

A rank *vanishes* when its process dies without a report: its control connection drops or
its Slurm step ends with an error. (A rank that *reports* an error stops the job with that
error: a software fault would follow the rank to any node.) Then:

    detected ── revoke ──> every live rank stalls, reports (steps complete, state digest)
       └─ a warm standby (or the joiner already in the slot) ── recover ──> groups rebuilt,
          state from a tier (controller/policy/tiers.py: replica, else a snapshot or a checkpoint,
          to which every rank rolls back), every rank resumes at the same step ──> node released

Recoveries use the migration state machine (trigger "failure"): REQUESTED/WAITING_STANDBY
while ranks stall and a standby is found, PREPARING once the plan is sent, SWITCHING as
ranks report back, RELEASING/DONE when the dead node is handed back. The job is paused
throughout, so `recovery_timeout_s` bounds it: past it the job stops with a clear error.
"""
from __future__ import annotations

import logging
from typing import Callable

from trainmover.config import Config, parse_tiers
from trainmover.controller.durable.migration import Phase
from trainmover.controller.durable.state import PolicyState
from trainmover.controller.durable.view import StandbyState
from trainmover.controller.policy import tiers
from trainmover.controller.policy.actions import CheckpointDone, Finish, ReleaseNode, Rewind, Send
from trainmover.controller.policy.foresight import Foresight
from trainmover.controller.policy.holder import SnapshotHolder
from trainmover.controller.policy.planner import Planner
from trainmover.controller.policy.progress import Progress
from trainmover.controller.policy.standby_pool import StandbyPool
from trainmover.protocol.checkpoint_layout import KEEP as KEEP_CHECKPOINTS  # complete checkpoints kept
from trainmover.protocol.messages import CheckpointedMsg, MoveRole, StalledMsg, make, wire

log = logging.getLogger("trainmover.policy")

DETECT_WINDOW_S = 15.0  # ranks stalled but nobody found lost: how long before the job stops


class RecoveryPolicy:
    """The policy's part for unexpected failures: detection, the recovery plan, checkpoints."""

    def __init__(self, cfg: Config, state: PolicyState, pool: StandbyPool, progress: Progress, planner: Planner,
                 snapshots: SnapshotHolder, done: Callable[[], bool], foresight: Foresight | None = None):
        self.cfg, self.state, self.pool, self.progress = cfg, state, pool, progress
        self.planner, self.snapshots, self.done, self.foresight = planner, snapshots, done, foresight
        # Not journaled: a recovery in flight is not resumed by a successor (the job stops,
        # controller/policy/takeover.py), so what the stalled ranks said dies with it; the complete
        # checkpoints are read from disk by the executor (executor.py sets checkpoint_steps).
        self.stalled: dict[int, dict] = {}                 # rank -> its 'stalled' report
        self.checkpoints: dict[int, dict[int, str]] = {}   # step -> rank -> digest, until every rank wrote it
        self.checkpoint_steps: list[int] = []              # complete checkpoints (manifest written), oldest first

    # --- detection ---------------------------------------------------------------------
    def lost_unexpectedly(self, node: str, ranks: tuple[int, ...] = ()) -> bool:
        """Whether the end of `ranks`' process on `node` (unknown ranks: all of the node's) is a
        loss; losing one process of a node loses the node."""
        view = self.state.view
        if self.done() or node not in view.rank_node.values():
            return False
        ranks = tuple(r for r in ranks if view.rank_node.get(r) == node) or view.ranks_of(node)
        if all(r in self.progress.finished for r in ranks):
            return False
        # a leaver that handed its state over is expected to go
        return not any(m.leaver == node and any(role == MoveRole.LEAVER for _, role in m.switched)
                       for m in self.state.migrations)

    def fault(self, now: float, node: str, evidence: str) -> list:
        if self.done():  # the job ended (finished, or a rank's own error): nothing is lost any more
            return []
        planner, view = self.planner, self.state.view
        r = planner.recovery()
        if r is not None and node == r.joiner and r.phase in (Phase.REQUESTED, Phase.WAITING_STANDBY):
            return self._joiner_lost_before_the_plan(now, r, node, evidence)
        if r is not None and node in (r.leaver, r.joiner):
            return []  # already being recovered
        if r is not None:
            return [Finish(False, f"{node} lost ({evidence}) while recovering from the loss of {r.leaver}: "
                                  "two overlapping failures are not recovered")]
        ranks = view.ranks_of(node)
        planned = planner.active()
        epoch = planner.next_epoch()
        m = planner.new(now, node, ranks, "failure")  # first: nothing planned may start while this is active
        m.recovery, m.epoch, m.leaver_exited = True, epoch, True
        actions = []
        if planned is not None:
            if planned.phase is Phase.SWITCHING and planned.leaver == node and self._joiner_lost(planned):
                # the joiner was lost in the copy (and the leaver's send failed, or the loss of
                # the joiner is what brought us here): the slot goes to another standby
                actions += planner.fail(now, planned, f"joiner {planned.joiner} lost during the state copy; the "
                                                      "rank comes from a replica onto another standby", evidence)
            elif planned.leaver == node and planned.phase in (Phase.SWITCHING, Phase.RELEASING):
                # the leaver died during the state copy: the joiner already holds the slot
                m.joiner = planned.joiner
                actions += planner.fail(now, planned, "leaver lost during the state copy; its state comes from a replica",
                                        evidence)
                self.pool.remove(m.joiner)
                view.rank_node.update({r_: m.joiner for r_ in ranks})
            elif planned.phase in (Phase.PREPARING, Phase.SWITCHING):
                actions += planner.abort(now, planned, f"{node} lost during the migration ({evidence})",
                                         retry=planned.leaver != node)
            elif planned.leaver == node:
                actions += planner.fail(now, planned, f"{node} lost before it could migrate ({evidence})")
        live = [n for n in view.train_nodes() if n != node]
        reason = f"{node} (ranks {list(ranks)}) lost: {evidence}"
        log.error("unexpected failure: %s", reason)
        actions += [planner.timeline(m, now, "detected", evidence=evidence),
                    Send(tuple(live), make("revoke", epoch=m.epoch, failed=list(ranks), reason=reason[:500]))]
        return actions + self.maybe_recover(now)

    def _joiner_lost(self, planned) -> bool:
        """Whether the planned migration's joiner was lost since it began (a lost standby's node
        may come back later as a new standby: only a loss after the migration started counts)."""
        began = planned.times.get(Phase.PREPARING.value, planned.requested_at)
        return any(x["node"] == planned.joiner and x["t"] >= began for x in self.state.standbys_lost)

    def _joiner_lost_before_the_plan(self, now: float, r, node: str, evidence: str) -> list:
        """The standby a recovery took over from a leaver lost in the copy (it already held the
        slot) is lost too, before the plan: its ranks are the leaver's again and another standby
        is taken, as for any recovery whose standby is lost before its plan."""
        view = self.state.view
        view.rank_node.update({r_: r.leaver for r_ in r.leaver_ranks})
        self.pool.count_lost(now, node, StandbyState.JOINING, evidence)
        log.error("the standby on %s taking over from %s was lost before the recovery's plan (%s); another is "
                  "taken", node, r.leaver, evidence)
        r.joiner = ""
        return [self.planner.timeline(r, now, "joiner_lost", node=node, evidence=evidence),
                ReleaseNode(node)] + self.maybe_recover(now)

    # --- the plan ----------------------------------------------------------------------
    def on_stalled(self, now: float, node: str, msg: StalledMsg) -> list:
        self.stalled[msg.rank] = {**wire(msg), "node": node, "t": now}
        return self.maybe_recover(now)

    def maybe_recover(self, now: float) -> list:
        planner, view = self.planner, self.state.view
        m = planner.recovery()
        if m is None or m.phase not in (Phase.REQUESTED, Phase.WAITING_STANDBY):
            return []
        assign = {str(i): r for i, r in enumerate(m.leaver_ranks)}
        early = []
        if not m.joiner:
            joiner = self.pool.take_ready(self.snapshots.joiner_order)
            if joiner is None:
                if m.phase is Phase.REQUESTED:
                    return planner.wait_standby(now, m, f"no warm standby: training is paused until one is ready "
                                                        f"(at most {self.cfg.recovery_timeout_s:.0f}s)")
                return planner.maybe_acquire(now)
            m.joiner = joiner
            # the joiner binds itself and starts its groups while the live ranks stall (runtime/roles/recovery.py)
            early = [Send((joiner,), make("anticipate", epoch=m.epoch, failed=list(m.leaver_ranks), assign=assign))]
        if len(self.stalled) < view.world_size - len(m.leaver_ranks):
            # not every live rank has stopped yet: said by a count, since this runs once per
            # report (1,016 at 128 nodes; the full check below each time took 1.2 s of CPU)
            return early
        live = [r for r in range(view.world_size) if r not in m.leaver_ranks]
        stayers = [self.stalled.get(r) for r in live]
        if any(s is None or s["role"] != MoveRole.STAYER for s in stayers):
            return early  # not every live rank has stopped yet
        joiner = self.pool.get(m.joiner)
        choice = tiers.choose(parse_tiers(self.cfg.recovery_tiers), m.leaver_ranks, {s["rank"]: s for s in stayers},
                              self.checkpoint_steps, joiner=dict(joiner.held) if joiner else {},
                              completed=self.progress.completed())
        if isinstance(choice, tiers.Stop):
            return planner.fail(now, m, choice.message) + [
                    Finish(False, f"{m.leaver} (ranks {list(m.leaver_ranks)}) lost: {choice.message}")]
        step = choice.step
        needers = sorted(list(m.leaver_ranks) + list(choice.laggers))
        m.switch_step = step
        m.source = choice.to_json()
        m.expected = {(r, MoveRole.STAYER) for r in live} | {(r, MoveRole.JOINER) for r in m.leaver_ranks}
        planner.begin(now, m)
        stayer_nodes = tuple(sorted({view.rank_node[r] for r in live}))
        common = dict(epoch=m.epoch, failed=list(m.leaver_ranks), step=step, source=choice.source, needers=needers,
                      tier=choice.tier, holders={str(r): h for r, h in choice.holders.items()},
                      foreseen=self.foresight.usable(m.joiner, tuple(m.leaver_ranks)) if self.foresight else "")
        self.stalled = {}
        actions = self.progress.flush_rows(step)
        if choice.tier != "replica":  # every rank rolls back: later steps are redone and logged again
            self.progress.rewind(step)
            actions.append(Rewind(step))
        to_stayers = [Send(stayer_nodes, make("recover", assign={}, **common))] if stayer_nodes else []  # none: one worker
        return early + actions + [planner.timeline(m, now, "recover", **m.source)] + to_stayers + [
                Send((m.joiner,), make("recover", assign=assign, **common))]

    # --- checkpoints -------------------------------------------------------------------------
    def on_checkpointed(self, msg: CheckpointedMsg) -> list:
        """A rank's checkpoint file is in place; once every rank's is, the checkpoint is
        complete: its manifest is written and older ones pruned (KEEP_CHECKPOINTS kept)."""
        got = self.checkpoints.setdefault(msg.step, {})
        got[msg.rank] = msg.digest
        if len(got) < self.state.view.world_size:
            return []
        del self.checkpoints[msg.step]
        self.checkpoint_steps = sorted({*self.checkpoint_steps, msg.step})[-KEEP_CHECKPOINTS:]
        self.checkpoints = {s: v for s, v in self.checkpoints.items() if s > msg.step}
        return [CheckpointDone(msg.step, dict(got), tuple(self.checkpoint_steps))]

    def tick(self, now: float, looked_at: float | None = None) -> list:
        """Deadlines: the recovery's, and the detection window of ranks stalled with nobody
        lost. `looked_at` (liveness.py): that window counts only what the channel's reader has
        read: a lost peer's closed connection may sit unread behind a burst of stalled reports
        (seen at 128 nodes: the reader 30 s behind, and the job stopped for "nobody lost")."""
        m = self.planner.recovery()
        if m is not None and now - m.requested_at > self.cfg.recovery_timeout_s:
            waiting = {Phase.REQUESTED: "for every live rank to stop", Phase.WAITING_STANDBY: "for a standby",
                       }.get(m.phase, "for the new groups and the state copy")
            return self.planner.fail(now, m, f"no recovery within {self.cfg.recovery_timeout_s:.0f}s (waiting {waiting})") + [
                    Finish(False, f"{m.leaver} lost and not recovered within {self.cfg.recovery_timeout_s:.0f}s "
                                  f"(waiting {waiting}); the job stops")]
        if m is None and self.stalled and not self.done():
            first = min(s["t"] for s in self.stalled.values())
            if (now if looked_at is None else min(now, looked_at)) - first > DETECT_WINDOW_S:
                s = min(self.stalled.values(), key=lambda s: s["t"])
                return [Finish(False, f"rank {s['rank']} stalled ({s['error'][:300]}) but no rank was found lost "
                                      f"within {DETECT_WINDOW_S:.0f}s; the job stops")]
        return []
