"""Recovery from an unexpected failure, on the ranks that survived and on the standby
(`RankRecovery`, one of the rank process's roles, stalls and resumes; `rebuild` does the work).

The controller revokes the groups of a vanished rank (every collective with it fails at once),
collects each live rank's `stalled` report (steps complete, state digest, what it holds) and
sends one plan, `recover`: the epoch, the failed ranks, the step S to resume from and the tier
(controller/policy/tiers.py). Everyone then builds the replacement groups (same delta as a planned
migration), gets the state of S, swaps its groups and resumes at S:

* replica: a `source` rank that completed S sends its state to each needer (the standby taking
  a failed rank, and any rank that had not completed S) over a verified transfer pair;
* snapshot: the holder of each failed rank's snapshot of S sends it to the standby (verified);
  every other rank loads its own snapshot of S (a rollback). In a one-node job the standby
  holds the copies itself (holding.py): it copies its pinned copy into its own model and
  optimizer buffers, nothing on the wire;
* checkpoint: every rank, the standby included, loads its file of S (checksums verified).

Why this is exact: the rest of a step (data, dropout) is a function of (rank, step), so a rank
holding the state of S redoes steps S+1.. exactly; with a replica, model and optimizer are
identical on the members of the workload's `replica_group`. No step is applied twice or skipped.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from trainmover import config
from trainmover.errors import MigrationError
from trainmover.groups import rng
from trainmover.groups.specs import delta
from trainmover.protocol.messages import JOINER, AbortMsg, AnticipateMsg, ForeseeMsg, MoveRole, RecoverMsg
from trainmover.runtime import phase1, stacks
from trainmover.runtime.changes import Switched, TakeRank, UseGroups
from trainmover.runtime.protection import capture, checkpoint
from trainmover.runtime.transfer import state as transfer
from trainmover.runtime.context import RankContext
from trainmover.runtime.dispatch import GONE, Plan
from trainmover.runtime.roles.foresight import Foreseen
from trainmover.runtime.roles.epoch import abort
from trainmover.runtime.protection.role import Protection
from trainmover.runtime.rankstate import RankState
from trainmover.runtime.roles.standby import StandbyRole

log = logging.getLogger("trainmover.recovery")

RECOVERY_GRACE_S = 10.0  # a stalled rank outwaits the controller's recovery deadline by this much


class Builds:
    """The backends of one recovery, built at once: each in a thread of its own, on a rendezvous
    client of its own (a TCPStore client serialises its operations: one waiting for a peer would
    hold up the others' rendezvous). Built one after another, a joiner's groups and transfer pair
    took 0.86 s + ~0.3 s after its rebind (0.87 s) on 4x H100 (bench/results/issue36); started
    together, before the rebind, they take about one communicator's build, beside the rebind."""

    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.t0 = time.perf_counter()
        self.pending: dict[str, tuple[threading.Thread, list]] = {}
        self.ready: dict[str, object] = {}  # taken from the groups a one-node standby built ahead
        self.seconds: dict[str, float] = {}

    def start(self, key: str, name: str, prefix: str, grank: int, size: int) -> None:
        if key in self.pending or key in self.ready:
            return
        build, out = self.ctx.phase1_builder(), []

        def run():
            try:
                out.append(build(name, prefix, grank, size))
            except BaseException as exc:  # noqa: BLE001 - raised again by get() on the rank's thread
                out.append(exc)
            self.seconds[key] = time.perf_counter() - self.t0
        th = threading.Thread(target=run, name=f"tm-rebuild-{key}", daemon=True)
        th.start()
        self.pending[key] = (th, out)

    def has(self, key: str) -> bool:
        return key in self.pending or key in self.ready

    def get(self, key: str):
        """The backend `key`, once built (bounded by the group timeout the builder was given)."""
        if key in self.ready:
            return self.ready.pop(key)
        th, out = self.pending.pop(key)
        th.join()
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]


def start_builds(rec: RankRecovery, msg: RecoverMsg, builds: Builds | None = None) -> Builds:
    """Start building everything this rank's part of recovery `msg` needs: every group of the
    new epoch and the transfer pairs of the state copy. Needs only the epoch, the tier and who
    sends to whom, all in the plan."""
    builds = Builds(rec.ctx) if builds is None else builds
    rank, epoch = rec.ctx.rank, msg.epoch
    # Every group is replaced, not only those holding a failed rank: a step cut short leaves
    # operations unmatched in the others too (a pipeline peer waiting for a rank that stalled
    # keeps waiting until the group timeout, which then closes that pair for good).
    plan = delta(rec.ctx.specs, sorted({r for g in rec.ctx.specs for r in g.ranks}), epoch)
    built_ahead = rec.standby.ahead  # a one-node job's standby built them already (ahead.py)
    tag, case = msg.foreseen, tuple(int(r) for r in msg.failed)
    for g in plan.groups_to_build(rank):
        if builds.has(g.name):
            continue
        if tag:  # every member built this loss's groups before the fault (foresight.py): take them
            got = rec.foreseen.take(tag, case, g.name)
            if got is None:  # the others take theirs: a new one here would never meet its peers
                raise MigrationError(f"the plan takes the groups foreseen under {tag} for ranks {list(case)}, but "
                                     f"this process holds none for group {g.name}", phase="recover", rank=rank)
            builds.ready[g.name] = got
            builds.seconds[g.name] = 0.0
            continue
        backend = built_ahead.take(g.name, g.ranks, rank) if built_ahead is not None else None
        if backend is not None:
            builds.ready[g.name] = backend
            builds.seconds[g.name] = 0.0
            continue
        builds.start(g.name, g.name, plan.prefix(g), g.ranks.index(rank), len(g.ranks))
    # a transfer pair foreseen is the one between the case's named source and the standby: taken
    # when the plan's replica source is that rank (the same both ends: both read the same plan)
    foreseen_pairs = bool(tag) and msg.tier == "replica" and rec.foreseen.source(case) == msg.source
    for key, (peer, grank) in pairs(msg, rank).items():
        got = rec.foreseen.take(tag, case, key) if foreseen_pairs and peer in case else None
        if got is not None:
            builds.ready[key] = got
            builds.seconds[key] = 0.0
            continue
        builds.start(key, "xfer", phase1.xfer_prefix(epoch, peer), grank, 2)
    return builds


def pairs(msg: RecoverMsg, rank: int) -> dict[str, tuple[int, int]]:
    """This rank's transfer pairs in plan `msg`: key -> (the needer the pair is named for, this
    rank's place in it: 0 sends, 1 receives)."""
    out: dict[str, tuple[int, int]] = {}
    if msg.tier == "replica":
        if rank == msg.source:
            out.update({f"xfer-to-{n}": (n, 0) for n in msg.needers})
        elif rank in msg.needers:
            out["xfer-in"] = (rank, 1)
    elif msg.tier == "snapshot":
        for lost, holder in sorted(msg.holders.items()):
            if rank == holder:
                out[f"xfer-to-{int(lost)}"] = (int(lost), 0)
        if rank in msg.failed and msg.holders.get(str(rank)) != JOINER:
            out["xfer-in"] = (rank, 1)
    return out


def rebuild(rec: RankRecovery, msg: RecoverMsg, role: str, builds: Builds | None = None) -> tuple[dict, dict]:
    """Build the replacement backends (or take those `builds` started earlier) and run this
    rank's part of the state copy. Returns (new backends by group name, report fields).
    Deadlines: every rendezvous and transfer is bounded by the group timeout the builder was
    configured with."""
    t0 = time.perf_counter()
    epoch, tier = msg.epoch, msg.tier
    if tier == "replica" and rec.ctx.workload.replica_group() is None:
        raise MigrationError(f"workload {rec.ctx.spec.job.workload!r} names no replica group: a vanished rank's "
                             "state can only come from a snapshot or a checkpoint", phase="recover", rank=rec.ctx.rank)
    builds = start_builds(rec, msg, builds)
    early = t0 - builds.t0  # a joiner's builds started before: at its rebind's start
    ahead = sorted(builds.ready)
    plan = delta(rec.ctx.specs, sorted({r for g in rec.ctx.specs for r in g.ranks}), epoch)
    backends = {g.name: builds.get(g.name) for g in plan.groups_to_build(rec.ctx.rank)}
    report = {"role": role, "build_s": time.perf_counter() - t0, "groups": sorted(backends), "tier": tier,
              "source": msg.source, "built_ahead": ahead, "builds_started_early_s": round(early, 4),
              "group_build_s": {k: round(v, 4) for k, v in builds.seconds.items()}}
    rec.builds = builds  # the transfer pairs, for _send and _receive
    try:
        report.update(STATE_FROM[tier](rec, msg, role))
    finally:
        rec.builds = None
    report["seconds"] = time.perf_counter() - t0
    log.info("recovery epoch %d: rank %d (%s) ready to resume at step %d in %.3fs", epoch, rec.ctx.rank, role,
             msg.step, report["seconds"])
    return backends, report


def _pair(rec: RankRecovery, key: str, epoch: int, needer: int, grank: int):
    builds = rec.builds
    if builds is not None and builds.has(key):
        return builds.get(key)
    return rec.ctx.build_backend("xfer", phase1.xfer_prefix(epoch, needer), grank, 2)


def _send(rec: RankRecovery, state: dict, epoch: int, needer: int, step: int) -> dict:
    """Send `state` to `needer` over a new verified transfer pair (this rank is its member 0)."""
    pair = _pair(rec, f"xfer-to-{needer}", epoch, needer, 0)
    stats = transfer.send_verified(state, pair, key=rec.ctx.key, context=phase1.xfer_prefix(epoch, needer), dst=1,
                                   corrupt=rec.ctx.faults.at("transfer-send"))
    rec.ctx.retire(pair, step)
    return {"to": needer, "bytes": stats.bytes, "seconds": stats.seconds, "attempts": stats.attempts}


def _receive(rec: RankRecovery, epoch: int, step: int, like: dict | None) -> tuple[dict, dict]:
    """This rank's state of `step` from member 0 of its verified transfer pair."""
    pair = _pair(rec, "xfer-in", epoch, rec.ctx.rank, 1)
    state, stats = transfer.recv_verified(pair, key=rec.ctx.key, context=phase1.xfer_prefix(epoch, rec.ctx.rank),
                                          src=0, like=like)
    if int(state["step"]) != step:
        raise MigrationError(f"sent the state of step {state['step']}, not {step}", phase="recover", rank=rec.ctx.rank)
    rec.ctx.retire(pair, step)
    return state, {"recv_bytes": stats.bytes, "recv_s": stats.seconds, "attempts": stats.attempts}


def _from_replica(rec: RankRecovery, msg: RecoverMsg, role: str) -> dict:
    epoch, step = msg.epoch, msg.step
    if rec.ctx.rank == msg.source:
        return {"sent": [_send(rec, rec.ctx.replica_state(step), epoch, needer, step) for needer in msg.needers]}
    if rec.ctx.rank in msg.needers:
        state, report = _receive(rec, epoch, step, like=rec.ctx.replica_state(step))
        rec.ctx.workload.load_state_dict(state["workload"])
        return report
    return {}


def _roll_back(rec: RankRecovery, role: str, load) -> dict:
    """A live rank loads its own state of the step rolled back to (`load()`), unless the
    negative control `no-rollback` keeps its state (it then redoes steps it already applied)."""
    if role == MoveRole.STAYER and rec.ctx.faults.at("rollback"):
        log.warning("injected: no-rollback: rank %d keeps its state", rec.ctx.rank)
        return {"rolled_back": False}
    t0 = time.perf_counter()
    rec.ctx.load_full(load())
    return {"rolled_back": True, "load_s": time.perf_counter() - t0}


def _from_snapshot(rec: RankRecovery, msg: RecoverMsg, role: str) -> dict:
    epoch, step = msg.epoch, msg.step
    snaps = rec.protection.own_snapshots()
    report: dict = {}
    for lost, holder in sorted(msg.holders.items()):
        if rec.ctx.rank == holder:
            report.setdefault("sent", []).append(_send(rec, snaps.held_state(int(lost), step), epoch, int(lost), step))
    if rec.ctx.rank in msg.failed and msg.holders.get(str(rec.ctx.rank)) == JOINER:
        return {**report, **_from_own_holding(rec, step)}
    if rec.ctx.rank in msg.failed:
        state, received = _receive(rec, epoch, step, like=None)
        snaps.rolled_back(step, mine=state)
        return {**report, **received, **_roll_back(rec, role, lambda: state)}
    report.update(_roll_back(rec, role, lambda: snaps.own_state(step)))
    snaps.rolled_back(step)
    return report


def _from_own_holding(rec: RankRecovery, step: int) -> dict:
    """A one-node job's standby, which holds the lost rank's snapshots itself: the version of
    `step` goes from its (pinned) host slab into its own model and optimizer buffers in place
    (capture.restore_into), RNG and data position from the same version. Its slab then stands as
    this rank's own snapshot of `step` (it is not written again: holding stopped)."""
    held = rec.protection.holding
    if held is None:
        raise MigrationError(f"the plan says this standby holds rank {rec.ctx.rank}'s snapshot of step {step}, but "
                             "it holds none", phase="recover", rank=rec.ctx.rank)
    held.close()
    t0 = time.perf_counter()
    version = held.version(step)
    state, placed = capture.restore_into(version.state(), like=rec.ctx.full_state(step))
    rec.ctx.workload.load_state_dict(state["workload"])
    rng.restore(state["rng"])
    if int(state["step"]) != step:
        raise MigrationError(f"held snapshot is of step {state['step']}, not {step}", phase="recover",
                             rank=rec.ctx.rank)
    rec.protection.own_snapshots().rolled_back(step, mine=version.state())
    return {"held_by": "joiner", "recv_bytes": version.slab.bytes, "recv_s": 0.0, "restore_s": time.perf_counter() - t0,
            "restore_GBps": placed / max(time.perf_counter() - t0, 1e-9) / 1e9, "pinned": version.slab.pinned}


def _from_checkpoint(rec: RankRecovery, msg: RecoverMsg, role: str) -> dict:
    step = msg.step
    if rec.protection.snapshots is not None:
        rec.protection.snapshots.rolled_back(step)
    ctx = rec.ctx
    return _roll_back(rec, role, lambda: checkpoint.read_rank(Path(ctx.spec.checkpoint_dir), step, ctx.rank, ctx.key))


STATE_FROM = {"replica": _from_replica, "snapshot": _from_snapshot, "checkpoint": _from_checkpoint}


class RankRecovery:
    """A rank's part in recovering from an unexpected failure: a live rank stalls and resumes;
    a standby takes a vanished rank's slot."""

    def __init__(self, ctx: RankContext, protection: Protection, standby: StandbyRole):
        self.ctx, self.protection, self.standby = ctx, protection, standby
        self.builds: Builds | None = None  # during rebuild(): the backends being built (transfer pairs)
        self.early: tuple[int, int] | None = None  # a standby's anticipate: (epoch, rank) it bound itself to
        self.foreseen = Foreseen(ctx)  # groups built ahead for losses that may come (foresight.py)

    def stall(self, completed: int, exc: Exception | str) -> int:
        """A collective failed: report how far this rank got and wait (bounded) for the
        controller's recovery plan. Returns the step to resume from."""
        log.warning("rank %d stalled after %d steps: %s", self.ctx.rank, completed, str(exc)[:300])
        if self.ctx.pending is not None:  # a planned migration in flight is void: its groups hold the lost rank
            abort(self.ctx, AbortMsg(epoch=self.ctx.pending.epoch, reason="unexpected failure"))
        self.ctx.state.to(RankState.STALLED)
        self.ctx.send("stalled", rank=self.ctx.rank, step=completed, digest=self.ctx.digest(), error=str(exc)[:500],
                      role=MoveRole.STAYER, holds=self.protection.holds())
        msg = self.wait_recover(exc)
        self.ctx.state.to(RankState.TRAINING)
        if completed < msg.step and self.ctx.rank not in msg.needers:
            raise MigrationError(f"recovery plan resumes at step {msg.step} but this rank has completed "
                                 f"{completed} and gets no state", phase="recover", rank=self.ctx.rank)
        backends, report = rebuild(self, msg, MoveRole.STAYER)
        for name, backend in backends.items():
            self.ctx.retire(self.ctx.groups[name].swap(backend), msg.step)
        self.foreseen.drop(msg.step)  # the other cases' groups: the membership they were for is gone
        # a rollback redoes the steps after msg.step: their old reports must not reach a restarted controller
        self.ctx.apply(Switched(msg.epoch, redo_after=msg.step))
        self.ctx.send("switched", epoch=msg.epoch, rank=self.ctx.rank, role=MoveRole.STAYER, step=msg.step,
                      t=time.time(), detail={**report, "redo_from": completed})
        self.ctx.trace_next_steps()
        return int(msg.step)

    def wait_recover(self, exc: Exception | str) -> RecoverMsg:
        """The controller's `recover` plan, within the recovery deadline. The controller's
        deadline decides (its message names what it waited for); a rank gives up only
        RECOVERY_GRACE_S later, when that decision never came."""
        deadline = time.monotonic() + self.ctx.spec.job.recovery_timeout_s + RECOVERY_GRACE_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MigrationError(f"no recovery plan within {self.ctx.spec.job.recovery_timeout_s:.0f}s after: {exc}",
                                     phase="recover", rank=self.ctx.rank, host=self.ctx.spec.node)
            out = self.ctx.inbox.wait(left)  # only the plan is routed now (dispatch.py): the rest is void
            if out is GONE:
                raise MigrationError(f"controller gone while stalled after: {exc}", phase="recover", rank=self.ctx.rank)
            if isinstance(out, Plan):
                return out.msg

    def foresee(self, msg: ForeseeMsg) -> None:
        """Build, in the background, the groups of each loss this process may be part of
        recovering from (roles/foresight.py); the old tag's are dropped."""
        self.foreseen.on_foresee(msg, self.ctx.completed)

    def anticipate(self, msg: AnticipateMsg) -> None:
        """A standby the controller chose to take a vanished rank, told before the plan (which
        waits for every live rank to stall): it binds itself to that rank now (new wrappers,
        shadow steps in the sandbox), which was on the recovery's critical path after the plan
        (0.87 s of 2.76 s on 4x H100, bench/results/issue36). The plan decides:
        `take_failed_rank` rebinds again if it assigns another rank (the controller never does:
        the plan's `assign` is made from the same choice).
        Its groups are NOT started here: their rendezvous is bounded by the group timeout, and the
        plan may come later than that after the fault (a pipeline peer of the stalled rank waits
        in a gloo receive until the group timeout: the Megatron TP2xPP2 e2e test, TM_GROUP_TIMEOUT_S
        20 s, saw the joiner's early world group time out and the job stop). They start at the
        plan, all at once (Builds)."""
        mine = msg.assign.get(str(self.ctx.local))
        if mine is None:
            return
        rank = int(mine)
        t0 = time.perf_counter()
        self.ctx.apply(TakeRank(rank))
        self.early = (int(msg.epoch), rank)
        self._bind(rank)
        log.info("anticipating rank %d (epoch %d): bound in %.3fs", rank, msg.epoch, time.perf_counter() - t0)

    def _bind(self, rank: int) -> bool:
        """Bind the workload to `rank` unless it is already (a one-node job's standby binds
        itself to the rank it will take, ahead.py; an anticipate did it). True if it was."""
        groups = self.ctx.groups
        if self.standby.rehearsed == rank and bool(groups) and all(g.sandboxed for g in groups.values()):
            return True
        self.ctx.apply(UseGroups(self.ctx.make_groups(rank, sandbox=True)))
        self.ctx.workload.rebind(self.ctx.build_context(rank))
        self.standby.rehearsed = rank
        self.standby.shadow_until_steady(self.ctx.spec.job.shadow_steps)
        return False

    def take_failed_rank(self, msg: RecoverMsg, rebind: bool = True) -> int:
        """Unexpected failure: take a vanished rank's slot. Unlike a planned join, the job is
        paused while this runs, so only what must happen is done: rebind to the rank (its new
        wrappers' one-time collectives in the sandbox), build the groups, receive a replica's
        state. The groups and transfer pair are built in threads while the rebind runs (which an
        `anticipate` did already)."""
        t0 = time.perf_counter()
        if config.setting("TM_TRACE_SWITCH"):
            stacks.sample()
        rank = int(msg.assign[str(self.ctx.local)])
        self.ctx.apply(TakeRank(rank))
        early, self.early = self.early, None
        anticipated = early == (int(msg.epoch), rank)
        if early is not None and not anticipated:
            log.warning("anticipated rank %d (epoch %d), the plan assigns rank %d (epoch %d)", early[1], early[0],
                        rank, msg.epoch)
        builds = start_builds(self, msg)  # the groups and the transfer pair, at once
        prebound = self._bind(rank) if rebind else False
        rebind_s = time.perf_counter() - t0
        backends, report = rebuild(self, msg, MoveRole.JOINER, builds)
        t1 = time.perf_counter()
        for name, backend in backends.items():
            self.ctx.retire(self.ctx.groups[name].swap(backend), msg.step)
        self.ctx.state.to(RankState.TRAINING)  # a worker now (its role follows its state)
        self.foreseen.drop(msg.step)  # as a worker's: retired after its first steps, off the critical path
        self.ctx.apply(Switched(msg.epoch))
        report["after_rebuild_s"] = time.perf_counter() - t1
        self.ctx.send("switched", epoch=msg.epoch, rank=rank, role=MoveRole.JOINER, step=msg.step, t=time.time(),
                      detail={**report, "rebind_s": rebind_s, "prebound": prebound, "anticipated": anticipated,
                              "seconds": time.perf_counter() - t0, **self.ctx.memory()})
        log.info("took failed rank %d at step %d in %.3fs", rank, msg.step, time.perf_counter() - t0)
        self.ctx.trace_next_steps()
        return int(msg.step)
