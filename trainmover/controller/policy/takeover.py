"""A restarted controller takes the job over from its journal (pure: events in, actions out).

    resume(journal) ──> every rank and standby reconnects and says where it is (`resync`)
        └─ all ranks accounted for (or `reconnect_timeout_s` passed) ──> the migration that
           was in flight is resolved, once, deterministically:

    committed  some rank reports it switched in the migration's epoch. The boundary
               agreement is all-or-nothing (boundary.py), so every live rank did: the
               migration is completed (the leaver, gone, is counted as switched).
    resumed    no rank switched, and every rank and the joiner still hold that epoch
               prepared or preparing: it goes on as if nothing happened.
    aborted    otherwise: some rank lacks the epoch, so its boundary vote vetoes the switch
               for ever; `abort` makes the others drop it and the node is asked again as a
               new migration (a new epoch), as after any failed Phase 1.

A recovery from an unexpected failure in flight is not resumed: the job stops with a message
saying so (the ranks are paused, their plan died with the controller).
"""
from __future__ import annotations

import logging

from trainmover.config import Config
from trainmover.controller.durable import codec
from trainmover.controller.durable.journal import Replayed
from trainmover.controller.durable.migration import Migration, Phase
from trainmover.controller.durable.state import PolicyState
from trainmover.controller.policy.actions import Finish, Record, ReleaseNode, Send
from trainmover.controller.policy.planner import Planner
from trainmover.controller.policy.progress import Progress
from trainmover.controller.policy.recovery import RecoveryPolicy
from trainmover.controller.policy.standby_pool import StandbyPool
from trainmover.protocol.messages import MoveRole, ResyncMsg, make, wire

log = logging.getLogger("trainmover.policy")


class Takeover:
    """The policy's part for a controller that takes over from its journal."""

    def __init__(self, cfg: Config, state: PolicyState, pool: StandbyPool, progress: Progress, planner: Planner,
                 recovery: RecoveryPolicy):
        self.cfg, self.state, self.pool, self.progress = cfg, state, pool, progress
        self.planner, self.recovery = planner, recovery
        # Not journaled: `resuming` lives only while this controller waits for the ranks to
        # resync; `restarts` is the journal's own count of claims (journal.Replayed.restarts).
        self.resuming: dict | None = None  # {"since", "seen": rank -> resync, "nodes": standby node -> resync}
        self.restarts = 0
        # The new controller serves another rendezvous store than its predecessor's (a successor on
        # another node: the old store ended with the old controller). A Phase 1 in flight builds its
        # groups through the old one and cannot finish: an uncommitted migration is then aborted and
        # asked again, never resumed (seen: it stayed 'preparing' until the job ended). Set by the executor.
        self.store_moved = False

    def resume(self, now: float, j: Replayed, metrics_through: int) -> list:
        v = self.state.view
        codec.assign(self.state, j.durable())  # every durable field, in place (the executor holds the view)
        self.pool.restore(now, {n: s.state for n, s in v.standbys.items()})
        self.progress.metrics_through = metrics_through
        self.resuming = {"since": now, "seen": {}, "nodes": {}}
        self.restarts = j.restarts  # the journal ends in our own claim (`restart`, journal.Journal.claim)
        migrations = self.state.migrations
        flight = self.planner.in_flight()
        if flight is not None and not flight.recovery:  # who must report: recomputed as Planner.dispatch did
            flight.expected = ({(r, MoveRole.STAYER) for r in range(v.world_size) if r not in flight.leaver_ranks}
                               | {(r, role) for r in flight.leaver_ranks for role in (MoveRole.LEAVER, MoveRole.JOINER)})
        log.info("resuming job %d from its journal (%d records): %d migrations, in flight: %s", v.job_id, j.records,
                 len(migrations), f"migration {flight.id} epoch {flight.epoch} ({flight.phase.value})"
                 if flight else "none")
        actions = [Record("timeline", {"t": now, "event": "controller_resumed", "attempt": j.restarts,
                                       "in_flight": flight.id if flight else None, "migration": None})]
        # a release its predecessor left due (it moved off that very node, or died before)
        actions += [ReleaseNode(m.leaver) for m in migrations if m.phase is Phase.RELEASING and m.leaver_exited]
        r = self.planner.recovery()
        if r is not None:
            actions += self.planner.fail(now, r, "the controller restarted during this recovery")
            self.resuming = None
            return actions + [Finish(False, f"the controller restarted while recovering from the loss of {r.leaver} "
                                            f"(migration {r.id}); a recovery in flight is not resumed: the job stops")]
        return actions

    def on_resync(self, now: float, node: str, msg: ResyncMsg) -> list:
        stale = self._stale_epoch(node, msg)
        if self.resuming is None:
            return stale
        if msg.state == "left":  # a leaver that handed its ranks over: it speaks for none
            return stale
        for r in msg.ranks:
            self.resuming["seen"][r] = {**wire(msg), "node": node}
        if msg.role == "standby":
            self.resuming["nodes"][node] = wire(msg)
        return stale + self._maybe_resolve(now)

    def _stale_epoch(self, node: str, msg: ResyncMsg) -> list:
        """A process that reconnects still holding an epoch that was aborted while it was cut off
        (the abort went out before it reached the new controller) is told again: a joiner would
        otherwise wait for a leaver that never comes, up to the group timeout, and a standby
        stays out of the pool meanwhile (seen: a migration asked again found no ready standby)."""
        pending = msg.pending
        m = next((m for m in self.state.migrations if m.epoch == pending), None) if pending else None
        if m is None or m.phase is not Phase.ABORTED:
            return []
        log.info("%s still holds aborted epoch %d: the abort again", node, pending)
        return [Send((node,), make("abort", epoch=pending, reason=f"epoch {pending} was aborted: {m.note}"[:500]))]

    def _maybe_resolve(self, now: float) -> list:
        res = self.resuming
        seen = res["seen"]
        missing = [r for r in range(self.state.view.world_size) if r not in seen]
        m = self.planner.in_flight()
        joiner_known = m is None or not m.joiner or m.joiner in res["nodes"] or any(
            s["node"] == m.joiner for s in seen.values())
        waited = now - res["since"]
        lost = sorted({self.state.view.rank_node[r] for r in missing})
        # One node's ranks missing past the short window: the node that died with the controller
        # (its home); more than one node: wait the full TM_RECONNECT_TIMEOUT_S, then stop.
        late = waited > (self.reconnect_window() if len(lost) <= 1 else self.cfg.reconnect_timeout_s)
        if (missing or not joiner_known) and not late:
            return []
        self.resuming = None
        waited = round(waited, 6)
        committed = m is not None and any(s["switched"] == m.epoch for s in seen.values())
        if len(lost) > 1:
            return [Finish(False, f"ranks {missing} did not reconnect within {self.cfg.reconnect_timeout_s:.0f}s "
                                  "after the controller restarted; the job stops")]
        if missing:
            why = f"its ranks {missing} did not reconnect within {waited:.1f}s after the controller moved or restarted"
            # A failure like any other, recovered once the rest is resolved as if they had reported.
            actions = self._resolve_in_flight(now, m, committed, waited, seen, res["nodes"]) if m is not None else []
            return actions + self.recovery.fault(now, lost[0], why)
        if m is None:
            return [Record("timeline", {"t": now, "event": "controller_resynced", "migration": None,
                                        "waited_s": waited})] + self.planner.dispatch(now)
        return self._resolve_in_flight(now, m, committed, waited, seen, res["nodes"])

    def reconnect_window(self) -> float:
        """How long a resumed controller waits for one node's ranks: a live rank reconnects within
        its backoff (at most 2 s between attempts) once the successor is up; one that has not after
        twice the heartbeat timeout and that backoff is taken for lost (bounded by
        TM_RECONNECT_TIMEOUT_S)."""
        return min(self.cfg.reconnect_timeout_s, 2 * self.cfg.heartbeat_timeout_s + 2.0)

    def _resolve_in_flight(self, now: float, m: Migration, committed: bool, waited: float, seen: dict,
                           standbys_seen: dict) -> list:
        """The migration the dead controller left in flight: completed, resumed or aborted."""
        if committed:
            return self._complete(now, m, waited)
        holders = {r for r, s in seen.items() if s["pending"] == m.epoch}
        joiner = standbys_seen.get(m.joiner)
        if (holders >= set(range(self.state.view.world_size)) and joiner is not None and joiner["pending"] == m.epoch
                and not self.store_moved):
            log.info("migration %d epoch %d resumed: every rank still holds it", m.id, m.epoch)
            return [self.planner.timeline(m, now, "resumed", resolution="resumed", waited_s=waited)]
        lacking = sorted(set(range(self.state.view.world_size)) - holders)
        actions = [self.planner.timeline(m, now, "resumed", resolution="aborted", waited_s=waited)]
        why = (("the rendezvous store moved with the controller; " if self.store_moved else "")
               + f"the controller restarted before the switch of epoch {m.epoch} "
               f"(not prepared on ranks {lacking[:8]}{' ...' if len(lacking) > 8 else ''}"
               f"{'' if joiner and joiner['pending'] == m.epoch else ' nor on the joiner'})")
        actions += self.planner.abort(now, m, why)
        if joiner is not None and joiner["pending"] != m.epoch and m.joiner in self.state.view.standbys:
            # the joiner never took this epoch up: it is as warm as it says
            self.pool.mark_rejoined(m.joiner, ready=joiner["state"] == "ready")
            actions += self.planner.dispatch(now)
        return actions

    def _complete(self, now: float, m: Migration, waited: float) -> list:
        log.info("migration %d epoch %d was switched while the controller was down: completed", m.id, m.epoch)
        if m.phase is Phase.PREPARING:
            self.planner.switching(now, m, "switched while the controller was down")
        for r in m.leaver_ranks:  # the leaver handed its state over and left
            m.switched.setdefault((r, MoveRole.LEAVER), {"rank": r, "role": MoveRole.LEAVER, "step": m.switch_step or 0,
                                                  "detail": {"implied": "controller restart"}})
        actions = [self.planner.timeline(m, now, "resumed", resolution="completed", waited_s=waited)]
        return actions + self.planner.maybe_released(now, m)

    def tick(self, now: float) -> list:
        return self._maybe_resolve(now) if self.resuming is not None else []
