"""The controller's decisions: events in, actions out. No clock, no I/O, no Slurm.

The executor (`controller/executor.py`) feeds it what it observed (node states from Slurm,
messages from ranks, results of Slurm operations, `now`) and applies the actions it returns.

The policy is one durable state (controller/durable/state.py: journaled whole, by construction) and
parts that each own a piece of it and are handed what they need:

    pool        standby_pool.py    standbys and their states, taking a ready one, acquiring
    progress    progress.py        step reports, metrics rows, finished ranks
    planner     planner.py         planned migrations: request, dispatch, abort, release
    recovery    recovery.py        unexpected failures: detection, the recovery plan, checkpoints
    losses      standby_loss.py    a standby that dies
    liveness    liveness.py        silent and stuck processes: verdicts
    snapshots   holder.py          who holds a one-node job's snapshots
    stragglers  straggler_watch.py compute-time windows, evictions
    takeover    takeover.py        a successor controller resuming from the journal

This class routes events to them and keeps the job's outcome (done, failure).
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Protocol

from trainmover.config import Config
from trainmover.controller.durable import codec
from trainmover.controller.durable.journal import Replayed
from trainmover.controller.durable.migration import Migration, Phase
from trainmover.controller.durable.state import PolicyState
from trainmover.controller.durable.view import JobView, StandbyState
from trainmover.controller.policy.actions import Action, Fence, Finish, LaunchStandby, Record, ReleaseNode
from trainmover.controller.policy.foresight import Foresight
from trainmover.controller.policy.holder import SnapshotHolder
from trainmover.controller.policy.liveness import Heard, Liveness
from trainmover.controller.policy.planner import Planner
from trainmover.controller.policy.progress import Progress
from trainmover.controller.policy.recovery import RecoveryPolicy
from trainmover.controller.policy.standby_loss import StandbyLoss
from trainmover.controller.policy.standby_pool import StandbyPool
from trainmover.controller.policy.straggler_watch import StragglerWatch
from trainmover.controller.policy.takeover import Takeover
from trainmover.protocol.messages import (CheckpointedMsg, FailedMsg, FinishedMsg, ForeseenMsg, Message, Msg, PreparedMsg,
                                          PrepareFailedMsg, ReadyMsg, RecordedMsg, ResyncMsg, SnapshotHeldMsg,
                                          SnapshotTakenMsg, StalledMsg, StepMsg, SwitchedMsg, WarmingMsg, typed, wire)

log = logging.getLogger("trainmover.policy")


def _part(part: str, attr: str, settable: bool = False) -> Any:
    """Policy.<attr> as <part>.<attr>: read (and, where settable, set) where it lives. A property,
    typed Any: the attribute's annotation on the class gives its type."""
    def get(self: Policy) -> Any:
        return getattr(getattr(self, part), attr)

    def put(self: Policy, value: Any) -> None:
        setattr(getattr(self, part), attr, value)
    return property(get, put if settable else None, doc=f"{part}.{attr}")


class NodeStatus(Protocol):
    """What `on_nodes` reads of a node (slurm.model.NodeInfo); `reason` and `unresponsive` where
    it has them."""

    @property
    def state(self) -> str: ...

    @property
    def draining(self) -> bool: ...

    @property
    def drained(self) -> bool: ...


# The policy's vocabulary: a process's report type -> the Policy method that decides on it.
# The executor hands every report here (Policy.on_message); tests/unit/test_policy.py checks
# that every type a rank, standby or keeper sends is either in this table or heard elsewhere.
HANDLERS: dict[str, str] = {
    "ready": "_on_ready", "resync": "_on_resync", "stalled": "_on_stalled", "failed": "_on_failed",
    "checkpointed": "_on_checkpointed", "snapshot_held": "_on_snapshot_held",
    "snapshot_taken": "_on_snapshot_taken", "recorded": "_on_recorded", "warming": "_on_warming",
    "step": "_on_step_report", "finished": "_on_finished_report",
    "prepared": "_on_prepared", "prepare_failed": "_on_prepare_failed", "switched": "_on_switched",
    "foreseen": "_on_foreseen",
}

class Policy:
    def __init__(self, cfg: Config, view: JobView) -> None:
        self.cfg = cfg
        self.state = PolicyState.initial(view)
        self.pool = StandbyPool(cfg, self.state)
        self.progress = Progress(self.state)
        self.planner = Planner(cfg, self.state, self.pool, self.progress,
                               held=lambda: self.takeover.resuming is not None, done=lambda: self.done)
        self.snapshots = SnapshotHolder(self.state, self.pool)
        self.foresight = Foresight(cfg.foresee_nodes, self.state, self.pool,
                                   busy=lambda: self.done or self.planner.active() is not None,
                                   order=self.snapshots.joiner_order)
        self.recovery_part = RecoveryPolicy(cfg, self.state, self.pool, self.progress, self.planner, self.snapshots,
                                      done=lambda: self.done, foresight=self.foresight)
        self.losses = StandbyLoss(self.state, self.pool, self.planner, self.recovery_part, done=lambda: self.done)
        self.liveness = Liveness(cfg, self.state, self.progress)
        self.stragglers = StragglerWatch(cfg, self.state)
        self.takeover = Takeover(cfg, self.state, self.pool, self.progress, self.planner, self.recovery_part)
        # Not journaled: a job that ended has no successor; the executor sets these at start.
        self.done = False
        self.failure: dict[str, Any] | None = None   # the report that ended the job (status.json)
        self.failed_reports: dict[str, Message] = {}  # node -> a process's 'failed' report
        self.recordings: dict[str, dict[str, Any]] = {}  # by recording rank (one per standby role): reported again
        self.snapshot_every = cfg.snapshot_every  # the executor sets 0 where no snapshot could be used
        self.pool_choice: dict[str, Any] | None = None  # TM_STANDBYS=auto: the size picked at start and why (standbys/auto.py)

    # --- the durable state and what the executor and tests read of it ----------------------
    def durable(self) -> PolicyState:
        """A snapshot of the durable state: what the journal keeps. The executor takes one after
        each decision and journals the difference from the last (journal.diff)."""
        return codec.snapshot(self.state)

    # What the executor and tests read of the parts (and the two the executor sets at start).
    view: JobView = _part("state", "view")
    migrations: list[Migration] = _part("state", "migrations")
    epoch: int = _part("state", "epoch")
    fenced_pids: set[tuple[str, int]] = _part("state", "fenced_pids")
    standbys_lost: list[dict[str, Any]] = _part("state", "standbys_lost")
    checkpoint_steps: list[int] = _part("recovery_part", "checkpoint_steps", settable=True)  # from disk
    store_moved: bool = _part("takeover", "store_moved", settable=True)  # from the predecessor's endpoint
    resuming: dict[str, Any] | None = _part("takeover", "resuming")
    restarts: int = _part("takeover", "restarts")
    rows: dict[int, dict[int, Message]] = _part("progress", "rows")
    holder: str | None = _part("snapshots", "holder")
    processes: dict[tuple[str, int], Heard] = _part("liveness", "processes")
    fenced: list[dict[str, Any]] = _part("liveness", "fenced")

    @property
    def straggler(self) -> dict[str, Any]:
        return self.stragglers.status()

    def active(self) -> Migration | None:
        return self.planner.active()

    def recovery(self) -> Migration | None:
        return self.planner.recovery()

    def in_flight(self) -> Migration | None:
        return self.planner.in_flight()

    def reconnect_window(self) -> float:
        return self.takeover.reconnect_window()

    def flush_rows(self, upto: int) -> list[Action]:
        return self.progress.flush_rows(upto)

    # --- events ------------------------------------------------------------------------
    def start(self, now: float, in_job: list[str] | tuple[str, ...] = ()) -> list[Action]:
        """The job starts: its in-job standbys (TM_INJOB_STANDBYS, controller/view.split_in_job)
        join the pool and are launched as a standby taken from the reservation is; then the pool
        is filled where grow is possible."""
        self.pool.add_in_job(now, list(in_job))
        return [LaunchStandby(n) for n in in_job] + self.planner.maybe_acquire(now)

    def on_grow_verdict(self, refusal: str | None) -> None:
        """Why no standby may be taken from the reservation ("": one may; None: not known yet),
        from the rights check (slurm/pool_mode.py). Refused: the pool is never refilled."""
        self.pool.refill_off(refusal)

    def resume(self, now: float, j: Replayed, metrics_through: int) -> list[Action]:
        return self.takeover.resume(now, j, metrics_through)

    def heard(self, now: float, node: str, pid: int, msg: Message | Msg) -> None:
        """`msg` as its class (the executor types each message once) or as sent (tests)."""
        self.liveness.heard(now, node, pid, msg if isinstance(msg, Msg) else typed(msg))

    def forget(self, node: str, pid: int) -> None:
        self.liveness.forget(node, pid)

    def request(self, now: float, node: str, trigger: str) -> tuple[bool, str, list[Action]]:
        """Ask for `node` to leave. Returns (accepted, message, actions)."""
        return self.planner.request(now, node, trigger)

    def on_standby_acquired(self, now: float, node: str) -> list[Action]:
        if node in self.view.released:  # it left the job earlier and is back: a standby now, not released
            self.view.released.remove(node)
        self.pool.acquired()
        self.pool.add(now, node)
        return [LaunchStandby(node)] + self.planner.maybe_acquire(now)

    def on_standby_unavailable(self, now: float, reason: str) -> list[Action]:
        self.pool.unavailable(now, reason)
        return []

    def on_nodes(self, now: float, states: dict[str, NodeStatus]) -> list[Action]:
        """`states`: node name -> its state (text), whether it drains or is drained."""
        actions: list[Action] = []
        rank_nodes = self.view.rank_node.values()
        for node, info in states.items():
            self.view.node_state[node] = info.state
            if node in rank_nodes and (info.draining or info.drained):
                # TrainMover's own health check drains with a "trainmover:" reason
                trigger = "healthcheck" if getattr(info, "reason", "").startswith("trainmover:") else "drain"
                actions += self.request(now, node, trigger)[2]
            elif node in rank_nodes and getattr(info, "unresponsive", False):
                # Slurm lost the node's slurmd. Its ranks may still run (slurmstepd outlives
                # slurmd): move them as planned; if they died too, the recovery path takes over.
                actions += self.request(now, node, "failure")[2]
            elif node in self.view.standbys and (info.draining or info.drained):
                actions += self.losses.drained(now, node, getattr(info, "reason", ""))
        return actions

    def on_peer_gone(self, now: float, node: str, ranks: tuple[int, ...] = ()) -> list[Action]:
        """A worker's or a standby's control connection closed. `ranks`: the ranks that process
        ran, where known; a node with several ranks has a connection per process, and one
        rank's process may end (finished) before its node-mates report."""
        if self.pool.get(node) is not None:  # a standby, or a joiner that has not switched yet
            return self.losses.lost(now, node, "control connection lost")
        if self.recovery_part.lost_unexpectedly(node, ranks):
            return self.recovery_part.fault(now, node, "control connection lost")
        return []

    def on_message(self, now: float, node: str, msg: Message | Msg) -> list[Action]:
        """A process's report, to its handler by type (HANDLERS: one table, the policy's whole
        vocabulary). A type without a handler is not the policy's to decide on: `hello` and
        `beat` are heard (`heard`), the CLI's and the keeper's requests are the executor's."""
        name = HANDLERS.get(msg.TYPE if isinstance(msg, Msg) else msg["type"])
        if name is None:
            return []
        handler: Callable[[float, str, Msg], list[Action]] = getattr(self, name)
        return handler(now, node, msg if isinstance(msg, Msg) else typed(msg))  # as its class

    def _on_ready(self, now: float, node: str, msg: ReadyMsg) -> list[Action]:
        s = self.pool.get(node)
        if s is None or s.state is StandbyState.JOINING:  # a re-warm's report that crossed a prepare: the join decides
            return []
        # A node runs ranks_per_node standby processes; it takes a whole node's ranks, so it
        # is ready once every one of them is warm.
        s.warm.add(msg.local)
        if len(s.warm) < self.view.ranks_per_node:
            return []
        self.pool.mark_ready(now, node, msg.warmup_s, msg.shadow_steps, msg.detail)
        return (self.recovery_part.maybe_recover(now) + self.planner.dispatch(now) + self._holder_actions(now)
                + self.foresight.actions(now))

    def _on_resync(self, now: float, node: str, msg: ResyncMsg) -> list[Action]:
        return self.takeover.on_resync(now, node, msg)

    def _on_stalled(self, now: float, node: str, msg: StalledMsg) -> list[Action]:
        return self.recovery_part.on_stalled(now, node, msg)

    def _on_checkpointed(self, now: float, node: str, msg: CheckpointedMsg) -> list[Action]:
        return self.recovery_part.on_checkpointed(msg)

    def _on_snapshot_held(self, now: float, node: str, msg: SnapshotHeldMsg) -> list[Action]:
        return self.snapshots.on_held(node, msg)

    def _on_snapshot_taken(self, now: float, node: str, msg: SnapshotTakenMsg) -> list[Action]:
        return self.snapshots.on_taken(msg)

    def _on_recorded(self, now: float, node: str, msg: RecordedMsg) -> list[Action]:
        self.recordings[str(msg.rank)] = {k: v for k, v in wire(msg).items() if k != "type"}
        return []

    def _on_warming(self, now: float, node: str, msg: WarmingMsg) -> list[Action]:
        self.pool.mark_warming(now, node)  # not offered to a migration until it is ready again
        return []

    def _of_a_rank(self, node: str, msg: StepMsg | FinishedMsg) -> bool:
        """Whether a rank's report names a rank of this job (else it is logged and ignored)."""
        if msg.rank in self.view.rank_node:
            return True
        log.warning("ignoring %s from %s for rank %d, which job %d does not have", msg.TYPE, node, msg.rank,
                    self.view.job_id)
        return False

    def _on_step_report(self, now: float, node: str, msg: StepMsg) -> list[Action]:
        if not self._of_a_rank(node, msg) or msg.step <= self.progress.metrics_through:
            return []  # (the latter: re-sent after a controller restart, logged already)
        return self._on_step(now, node, msg)

    def _on_finished_report(self, now: float, node: str, msg: FinishedMsg) -> list[Action]:
        return self._on_finished(msg) if self._of_a_rank(node, msg) else []

    def _migration_of(self, msg: PreparedMsg | PrepareFailedMsg | SwitchedMsg) -> Migration | None:
        """The active migration of a report's epoch (None: a report of an epoch no longer acted on)."""
        return next((x for x in self.migrations if x.active and x.epoch and x.epoch == msg.epoch), None)

    def _on_prepared(self, now: float, node: str, msg: PreparedMsg) -> list[Action]:
        m = self._migration_of(msg)
        return self.planner.on_prepared(now, m, node, msg) if m is not None else []

    def _on_prepare_failed(self, now: float, node: str, msg: PrepareFailedMsg) -> list[Action]:
        m = self._migration_of(msg)
        return self.planner.abort(now, m, f"rank {msg.rank} on {node}: {msg.error}") if m is not None else []

    def _on_switched(self, now: float, node: str, msg: SwitchedMsg) -> list[Action]:
        m = self._migration_of(msg)
        return self.planner.on_switched(now, m, msg) if m is not None else []

    def _on_finished(self, msg: FinishedMsg) -> list[Action]:
        finished = self.progress.finished
        finished[msg.rank] = wire(msg)  # kept as sent
        if len(finished) < self.view.world_size or self.done:
            return []
        self.done = True
        digests = [finished[r]["digest"] for r in range(self.view.world_size)]
        combined = hashlib.sha256("".join(digests).encode()).hexdigest()
        return [Record("final", {"job_id": self.view.job_id, "steps": msg.step, "digest": combined,
                                 "rank_digests": digests, "final_loss": msg.loss,
                                 "migrations": sum(1 for m in self.migrations if m.phase is Phase.DONE)}),
                Finish(True, "training finished")]

    def _on_failed(self, now: float, node: str, msg: FailedMsg) -> list[Action]:
        """A process said why it ends. From a rank (not a standby: its loss is handled as such),
        this is the job's root cause and ends it now: the workload's own error (`user`) would
        follow the rank to any node, so it is never taken for a lost node. Authoritative over
        what its consequences look like: the other ranks' collectives with it fail next, and a
        recovery started for it (its connection dropped, its step ended, in whatever order the
        controller heard of them) is void."""
        self.failed_reports[node] = wire(msg)
        if self.done or node not in self.view.rank_node.values():
            return []
        self.done = True
        user, step, phase = msg.user, msg.step, msg.phase
        if user:
            when = f"at step {step}" if phase == "train_step" else f"in {phase}" + (f" after step {step}" if step else "")
            message = f"user code raised on rank {msg.rank} ({node}) {when}: {msg.error}"
        else:
            message = f"rank {msg.rank} on {node} failed in {phase}: {msg.error}"
        self.failure = {"rank": msg.rank, "node": node, "step": step, "phase": phase, "user": user,
                        "error": msg.error, "traceback": msg.traceback, "t": now}
        actions: list[Action] = []
        for m in self.migrations:
            if m.active and m.recovery:
                actions += self.planner.fail(now, m, f"void: {message}")
        log.error("the job ends: %s", message)
        return actions + [Finish(False, message)]

    def _on_step(self, now: float, node: str, msg: StepMsg) -> list[Action]:
        self.liveness.progressed(now)
        evicted: list[Action] = []
        if self.active() is None:  # a migration changes the layout: no verdict across it
            target = self.stragglers.on_compute(now, msg.rank, msg.compute_s)
            evicted = self.request(now, target, "straggler")[2] if target else []
        row = self.progress.record(node, msg)
        step = msg.step
        actions: list[Action] = []
        if row is not None:
            actions += self.planner.rebalance(now, step)
            actions.append(self.progress.metrics_row(step, row))
        for m in self.migrations:
            if m.switch_step is not None and m.downtime_s is None and step == m.switch_step + 1:
                m.downtime_s = self.progress.downtime(m)
        return actions + evicted

    def on_step_exit(self, now: float, node: str, code: int) -> list[Action]:
        m = next((m for m in self.migrations if m.leaver == node and m.phase in (Phase.SWITCHING, Phase.RELEASING)), None)
        if m is not None:
            if m.leaver_exited:  # known already (a recovery's leaver), release under way
                return []
            m.leaver_exited = True
            if m.phase is Phase.RELEASING:
                return [ReleaseNode(node)]
            return []
        if self.pool.get(node) is not None:  # usually known lost already, from its closed connection
            return self.losses.lost(now, node, f"its Slurm step exited with code {code}")
        r = self.recovery()
        if r is not None and node in (r.leaver, r.joiner):
            if node == r.joiner and r.phase is not Phase.RELEASING:
                return [Finish(False, f"the standby on {node} taking over from {r.leaver} exited (code {code})")]
            return []
        if node in self.view.rank_node.values() and not self.done:
            if code == 0:  # its 'finished' report may still be queued behind this exit
                return []
            if self.recovery_part.lost_unexpectedly(node):
                return self.recovery_part.fault(now, node, f"its Slurm step exited with code {code}")
        return []

    def on_released(self, now: float, node: str, ok: bool, message: str) -> list[Action]:
        m = next((m for m in self.migrations if m.leaver == node and m.phase is Phase.RELEASING), None)
        if m is None:
            if any(x["node"] == node for x in self.standbys_lost) or node in self.losses.drained_nodes:
                return self.losses.released(now, node, ok, message)
            return []
        return self.planner.released(now, m, node, ok, message)

    def on_tick(self, now: float, arrivals: dict[tuple[str, int], float] | None = None,
                looked_at: float | None = None) -> list[Action]:
        """`arrivals`: (node, pid) -> when a frame of that process last arrived; `looked_at`: when
        the channel's reader last looked at every connection (liveness.py)."""
        if self.takeover.resuming is not None:  # nothing is decided before every rank has said where it is
            return self.takeover.tick(now)
        switching = any(m.phase is Phase.SWITCHING for m in self.migrations)  # a state copy may take long
        verdicts = self.liveness.verdicts(now, arrivals or {}, looked_at=looked_at, judging=not self.done,
                                          stuck_rule=self.recovery() is None and not self.progress.finished
                                          and not switching)
        actions = [a for h, why in verdicts for a in self._judged_dead(now, h, why)]
        actions += self.recovery_part.tick(now, looked_at) + self.planner.tick(now)
        return (actions + self.recovery_part.maybe_recover(now) + self.planner.maybe_acquire(now)
                + self.planner.dispatch(now) + self._holder_actions(now) + self.foresight.actions(now))

    def _judged_dead(self, now: float, h: Heard, why: str) -> list[Action]:
        if self.pool.get(h.node) is not None:
            what = f"standby process {h.pid} on {h.node}"
            actions = self.losses.lost(now, h.node, why)
        elif h.node in self.view.rank_node.values() and not all(r in self.progress.finished for r in h.ranks):
            what = f"rank{'s' if len(h.ranks) > 1 else ''} {list(h.ranks)} (process {h.pid} on {h.node})"
            actions = self.recovery_part.fault(now, h.node, why)
        else:  # a leaver that left, a node released: nothing depends on it any more
            self.liveness.forget(h.node, h.pid)
            return []
        log.error("%s judged dead: %s", what, why)
        self.liveness.fence(now, h, why)
        return [Fence(h.node, h.pid, f"{what}: {why}")] + actions

    def _on_foreseen(self, now: float, node: str, msg: ForeseenMsg) -> list[Action]:
        return self.foresight.on_foreseen(node, msg)

    def _holder_actions(self, now: float) -> list[Action]:
        return self.snapshots.actions(now, self.snapshot_every, set(self.progress.steps))

    # --- reporting -----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        v = self.view
        nodes = [{"name": n, "role": "train", "ranks": list(v.ranks_of(n)), "slurm_state": v.node_state.get(n, "")}
                 for n in v.train_nodes()]
        nodes += [{"name": n, "role": "released", "ranks": [], "slurm_state": v.node_state.get(n, "")} for n in v.released]
        waiting = [m for m in self.migrations if m.phase is Phase.WAITING_STANDBY]
        return {
            "job_id": v.job_id, "world_size": v.world_size, "batch_host": v.batch_host,
            "nodes": nodes,
            "standbys": [{"node": s.node, "state": s.state.value, "warmup_s": s.warmup_s,
                          "shadow_steps": s.shadow_steps, "shadow": s.shadow,
                          "slurm_state": v.node_state.get(s.node, "")} for s in v.standbys.values()],
            "recordings": self.recordings,
            "standby_pool": {**self.pool.status(),
                             "choice": self.pool_choice or {"setting": "fixed", "standbys": self.cfg.standbys,
                                                            "why": f"TM_STANDBYS={self.cfg.standbys}"}},
            "waiting_for_standby": [m.leaver for m in waiting],
            "message": (f"waiting for a standby: the job keeps running on {', '.join(m.leaver for m in waiting)}"
                        + (f" ({self.pool.none_left() or self.pool.note()})"
                           if self.pool.exhausted() or self.pool.none_left() else "") if waiting else ""),
            "standbys_lost": list(self.standbys_lost),
            "migrations": [m.to_json() for m in self.migrations],
            "straggler": self.straggler,
            "liveness": self.liveness.status(),
            "finished": self.done and self.failure is None,
            "failure": self.failure,
            "controller": {"restarts": self.takeover.restarts, "resuming": self.takeover.resuming is not None},
            "protection": {"tiers": self.cfg.recovery_tiers, "snapshot_every": self.snapshot_every,
                           "checkpoint_every": self.cfg.checkpoint_every, "checkpoints": list(self.checkpoint_steps),
                           "snapshots": self.snapshots.status()},
        }
