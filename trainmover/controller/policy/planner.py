"""Planned migrations: a node asked to leave, a warm standby prepared for it, the switch, the
release (pure). The migrations' own phases are controller/durable/migration.py's state machine;
the Planner is the one owner that moves them (`Migration.to` is called here only, checked by
tests/unit/test_migration_owner.py): it starts them (`request`, `dispatch`, `begin`), abandons
them (`abort`, `fail`), and ends them (`released`). Recoveries (controller/policy/recovery.py), a
successor's takeover (controller/policy/takeover.py), a lost standby and a rank's own error ask it.
"""
from __future__ import annotations

import logging
from typing import Callable

from trainmover.config import Config
from trainmover.controller.durable.migration import Migration, Phase
from trainmover.controller.durable.state import PolicyState
from trainmover.controller.policy.actions import Record, ReleaseNode, Send
from trainmover.controller.policy.progress import Progress
from trainmover.controller.policy.standby_pool import StandbyPool
from trainmover.protocol.messages import MoveRole, PreparedMsg, SwitchedMsg, make, wire

log = logging.getLogger("trainmover.policy")

MAX_ATTEMPTS = 3


class Planner:
    def __init__(self, cfg: Config, state: PolicyState, pool: StandbyPool, progress: Progress,
                 held: Callable[[], bool], done: Callable[[], bool]):
        """`held()`: whether nothing may start now (a successor waits for every rank to resync);
        `done()`: whether the job ended."""
        self.cfg, self.state, self.pool, self.progress = cfg, state, pool, progress
        self.held, self.done = held, done

    @property
    def migrations(self) -> list[Migration]:
        return self.state.migrations

    def active(self) -> Migration | None:
        return next((m for m in self.migrations if m.active), None)

    def recovery(self) -> Migration | None:
        return next((m for m in self.migrations if m.active and m.recovery), None)

    def in_flight(self) -> Migration | None:
        return next((m for m in self.migrations if m.phase in (Phase.PREPARING, Phase.SWITCHING)), None)

    def new(self, now: float, leaver: str, ranks: tuple[int, ...], trigger: str) -> Migration:
        m = Migration(len(self.migrations) + 1, leaver, ranks, trigger, now)
        self.migrations.append(m)
        return m

    def next_epoch(self) -> int:
        self.state.epoch += 1
        return self.state.epoch

    def maybe_acquire(self, now: float) -> list:
        return self.pool.maybe_acquire(now, self.done())

    @staticmethod
    def timeline(m: Migration, now: float, event: str, **extra) -> Record:
        # Fields from ranks' messages come nested under "detail": they can never replace these.
        return Record("timeline", {**extra, "t": now, "migration": m.id, "epoch": m.epoch, "event": event,
                                   "leaver": m.leaver, "joiner": m.joiner or None, "trigger": m.trigger})

    def request(self, now: float, node: str, trigger: str) -> tuple[bool, str, list]:
        """Ask for `node` to leave. Returns (accepted, message, actions)."""
        view = self.state.view
        if node not in view.rank_node.values():
            return False, f"{node} runs no rank of job {view.job_id}", []
        r = self.recovery()
        if r is not None and r.leaver == node:
            return True, f"{node} is being recovered after a failure (migration {r.id})", []
        for m in self.migrations:
            if m.leaver == node and m.active:
                return True, f"{node} is already migrating (migration {m.id}, {m.phase.value})", []
        m = self.new(now, node, view.ranks_of(node), trigger)
        actions = [self.timeline(m, now, "requested")]
        actions += self.dispatch(now)
        return True, f"migration {m.id} of {node} requested ({trigger})", actions

    def dispatch(self, now: float) -> list:
        """Start the oldest waiting migration if none is running and a standby is ready."""
        if any(m.phase in (Phase.PREPARING, Phase.SWITCHING) for m in self.migrations) or self.recovery() \
                or self.held():
            return []
        waiting = [m for m in self.migrations if m.phase in (Phase.REQUESTED, Phase.WAITING_STANDBY)]
        if not waiting:
            return []
        m = waiting[0]
        joiner = self.pool.take_ready()
        if joiner is None:
            if m.phase is Phase.REQUESTED:
                gone = self.pool.none_left()  # in-job standbys used, no refill: said, then today's wait
                if gone:
                    log.warning("migration %d of %s: %s; the job keeps running on %s", m.id, m.leaver, gone, m.leaver)
                return self.wait_standby(now, m, f"{gone or 'no warm standby'}: the job keeps running on {m.leaver}")
            return self.maybe_acquire(now)
        view = self.state.view
        m.epoch, m.joiner = self.next_epoch(), joiner
        stayers = [n for n in view.train_nodes() if n != m.leaver]
        m.expected = ({(r, MoveRole.STAYER) for n in stayers for r in view.ranks_of(n)}
                      | {(r, MoveRole.LEAVER) for r in m.leaver_ranks} | {(r, MoveRole.JOINER) for r in m.leaver_ranks})
        self.begin(now, m)
        common = dict(epoch=m.epoch, leavers=list(m.leaver_ranks), joiner_node=m.joiner, options={})
        return [
            self.timeline(m, now, "prepare", stayers=stayers),
            Send(tuple(stayers) + (m.leaver,), make("prepare", assign={}, **common)),
            Send((m.joiner,), make("prepare", assign={str(i): r for i, r in enumerate(m.leaver_ranks)}, **common)),
        ]

    def on_prepared(self, now: float, m: Migration, node: str, msg: PreparedMsg) -> list:
        role = MoveRole.JOINER if node == m.joiner else (MoveRole.LEAVER if msg.rank in m.leaver_ranks else MoveRole.STAYER)
        if (msg.rank, role) in m.prepared:  # re-sent after a controller restart
            return []
        m.prepared.add((msg.rank, role))
        actions = [self.timeline(m, now, "rank_prepared", rank=msg.rank, role=role, seconds=msg.seconds,
                                 groups=msg.groups, detail=msg.detail)]
        if m.prepared >= m.expected and m.phase is Phase.PREPARING:
            self.switching(now, m)
            actions.append(self.timeline(m, now, "prepared"))
        return actions

    def on_switched(self, now: float, m: Migration, msg: SwitchedMsg) -> list:
        if (msg.rank, msg.role) in m.switched:  # re-sent after a controller restart
            return []
        if m.phase is Phase.PREPARING:  # ranks can switch before every 'prepared' has arrived
            self.switching(now, m)
        m.switched[(msg.rank, msg.role)] = wire(msg)  # kept as sent (durable/migration.py reads it)
        m.switch_step = msg.step
        actions = []
        if msg.role != MoveRole.JOINER:
            actions.append(self.timeline(m, now, f"{msg.role}_switched", rank=msg.rank, detail=msg.detail))
        if msg.role == MoveRole.JOINER:
            self.state.view.rank_node[msg.rank] = m.joiner
            self.pool.remove(m.joiner)
            actions.append(self.timeline(m, now, "joined", rank=msg.rank, step=msg.step, detail=msg.detail))
        return actions + self.maybe_released(now, m)

    # --- the phase changes: every one is made here -------------------------------------
    def wait_standby(self, now: float, m: Migration, note: str) -> list:
        """No warm standby for `m`: it waits for one (and more are asked for)."""
        m.to(Phase.WAITING_STANDBY, now, note)
        return [self.timeline(m, now, "waiting_standby")] + self.maybe_acquire(now)

    def begin(self, now: float, m: Migration) -> None:
        """Phase 1 of `m` (planned: `prepare`; a recovery: `recover`) is sent now; the caller
        sends it and says so in the timeline."""
        m.to(Phase.PREPARING, now, "")

    def switching(self, now: float, m: Migration, note: str = "") -> None:
        """Every rank built its groups (or one switched already): the state copy and swap."""
        m.to(Phase.SWITCHING, now, note)

    def fail(self, now: float, m: Migration, note: str, evidence: str = "") -> list:
        """`m` ends unfinished and is not retried (its leaver is lost, or the job ends); the
        timeline gives `evidence` where there is more to say than the note."""
        m.to(Phase.FAILED, now, note[:300])
        return [self.timeline(m, now, "failed", reason=evidence or note)]

    def abort(self, now: float, m: Migration, reason: str, retry: bool = True) -> list:
        m.to(Phase.ABORTED, now, reason)
        if self.pool.get(m.joiner) is not None:
            self.pool.mark_starting(m.joiner, f"migration {m.id} aborted")
        nodes = tuple(self.state.view.train_nodes()) + ((m.joiner,) if m.joiner else ())
        # The node still has to leave: ask again, as a new migration, once a standby is ready;
        # after MAX_ATTEMPTS failures give up (the job keeps running on the node and says so).
        if retry:
            again = self.new(now, m.leaver, m.leaver_ranks, m.trigger)
            if sum(1 for x in self.migrations if x.leaver == m.leaver and x.phase is Phase.ABORTED) >= MAX_ATTEMPTS:
                again.to(Phase.FAILED, now, f"gave up after {MAX_ATTEMPTS} aborted attempts; {m.leaver} stays in the job")
        return [self.timeline(m, now, "aborted", reason=reason),
                Send(nodes, make("abort", epoch=m.epoch, reason=reason[:500]))] + self.dispatch(now)

    def maybe_released(self, now: float, m: Migration) -> list:
        if set(m.switched) >= m.expected and m.phase is Phase.SWITCHING:
            m.to(Phase.RELEASING, now)
            out = [self.timeline(m, now, "switched", step=m.switch_step)]
            if m.leaver_exited:
                out.append(ReleaseNode(m.leaver))
            return out + self.maybe_acquire(now)
        return []

    def released(self, now: float, m: Migration, node: str, ok: bool, message: str) -> list:
        if ok:
            self.state.view.released.append(node)
        m.to(Phase.DONE, now, "" if ok else message)
        return [self.timeline(m, now, "released" if ok else "kept", note=message, downtime_s=m.downtime_s)] \
            + self.dispatch(now)

    def tick(self, now: float) -> list:
        """Phase deadlines of the migration under way."""
        m = self.active()
        if m and m.phase is Phase.PREPARING and now - m.times["preparing"] > self.cfg.phase1_timeout_s:
            return self.abort(now, m, f"phase 1 not done within {self.cfg.phase1_timeout_s:.0f}s")
        if (m and m.phase is Phase.RELEASING and not m.leaver_exited
                and now - m.times["releasing"] > self.cfg.release_timeout_s):
            # The leaver handed over its state but its step lingers: release the node anyway
            # (Slurm ends the step), rather than hold it in the job forever.
            m.leaver_exited = True
            m.note = f"leaver's step still running {self.cfg.release_timeout_s:.0f}s after the switch; released anyway"
            return [ReleaseNode(m.leaver)]
        return []

    def rebalance(self, now: float, step: int) -> list:
        """Scheduled rebalancing: every N steps move the next node (round robin; never the
        batch host, which Slurm cannot release) to a warm standby, if one is ready and no other
        migration is under way; otherwise skip this turn."""
        n = self.cfg.rebalance_every_steps
        if not n or step % n or any(m.active for m in self.migrations):
            return []
        if not self.pool.ready_nodes():
            return []
        view = self.state.view
        movable = [node for node in view.train_nodes() if node != view.batch_host]
        if not movable:
            return []
        node = movable[(step // n) % len(movable)]
        return self.request(now, node, "rebalance")[2]
