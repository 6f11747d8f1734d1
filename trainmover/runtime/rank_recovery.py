"""Recovery from an unexpected failure, on the ranks that survived and on the standby
(`Recovery`, one of the rank process's roles, stalls and resumes; `rebuild` does the work).

The controller revokes the groups of a vanished rank (every collective with it fails at once),
collects each live rank's `stalled` report (steps complete, state digest, what it holds) and
sends one plan, `recover`: the epoch, the failed ranks, the step S to resume from and the tier
(controller/tiers.py). Everyone then builds the replacement groups (same delta as a planned
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
import queue
import time
from collections import deque
from pathlib import Path

from trainmover.protocol.messages import JOINER
from trainmover.errors import MigrationError
from trainmover.runtime import capture, checkpoint, phase1, rng, transfer
from trainmover.runtime.context import RankContext
from trainmover.runtime.epoch import abort
from trainmover.runtime.group_plan import delta
from trainmover.runtime.protection import Protection
from trainmover.runtime.rankstate import RankState
from trainmover.runtime.standby import StandbyRole

log = logging.getLogger("trainmover.recovery")

RECOVERY_GRACE_S = 10.0  # a stalled rank outwaits the controller's recovery deadline by this much


def rebuild(rec: Recovery, msg: dict, role: str) -> tuple[dict, dict]:
    """Build the replacement backends and run this rank's part of the state copy.
    Returns (new backends by group name, report fields). Deadlines: every rendezvous and
    transfer is bounded by the group timeout the builder was configured with."""
    t0 = time.perf_counter()
    epoch, step, tier = msg["epoch"], msg["step"], msg["tier"]
    # Every group is replaced, not only those holding a failed rank: a step cut short leaves
    # operations unmatched in the others too (a pipeline peer waiting for a rank that stalled
    # keeps waiting until the group timeout, which then closes that pair for good).
    plan = delta(rec.ctx.specs, sorted({r for g in rec.ctx.specs for r in g.ranks}), epoch)
    if tier == "replica" and rec.ctx.workload.replica_group() is None:
        raise MigrationError(f"workload {rec.ctx.spec.workload!r} names no replica group: a vanished rank's "
                             "state can only come from a snapshot or a checkpoint", phase="recover", rank=rec.ctx.rank)
    backends, ahead = {}, []
    built_ahead = rec.standby.ahead  # a one-node job's standby built them already (ahead.py)
    for g in plan.groups_to_build(rec.ctx.rank):
        backend = built_ahead.take(g.name, g.ranks, rec.ctx.rank) if built_ahead is not None else None
        if backend is not None:
            ahead.append(g.name)
        else:
            backend = rec.ctx.build_backend(g.name, plan.prefix(g), g.ranks.index(rec.ctx.rank), len(g.ranks))
        backends[g.name] = backend
    report = {"role": role, "build_s": time.perf_counter() - t0, "groups": sorted(backends), "tier": tier,
              "source": msg["source"], "built_ahead": ahead}
    report.update(STATE_FROM[tier](rec, msg, role))
    report["seconds"] = time.perf_counter() - t0
    log.info("recovery epoch %d: rank %d (%s) ready to resume at step %d in %.3fs", epoch, rec.ctx.rank, role, step,
             report["seconds"])
    return backends, report


def _send(rec: Recovery, state: dict, epoch: int, needer: int, step: int) -> dict:
    """Send `state` to `needer` over a new verified transfer pair (this rank is its member 0)."""
    pair = rec.ctx.build_backend("xfer", phase1.xfer_prefix(epoch, needer), 0, 2)
    stats = transfer.send_verified(state, pair, key=rec.ctx.key, context=phase1.xfer_prefix(epoch, needer), dst=1,
                                   corrupt=rec.ctx.faults.at("transfer-send"))
    rec.ctx.retire(pair, step)
    return {"to": needer, "bytes": stats.bytes, "seconds": stats.seconds, "attempts": stats.attempts}


def _receive(rec: Recovery, epoch: int, step: int, like: dict | None) -> tuple[dict, dict]:
    """This rank's state of `step` from member 0 of its verified transfer pair."""
    pair = rec.ctx.build_backend("xfer", phase1.xfer_prefix(epoch, rec.ctx.rank), 1, 2)
    state, stats = transfer.recv_verified(pair, key=rec.ctx.key, context=phase1.xfer_prefix(epoch, rec.ctx.rank),
                                          src=0, like=like)
    if int(state["step"]) != step:
        raise MigrationError(f"sent the state of step {state['step']}, not {step}", phase="recover", rank=rec.ctx.rank)
    rec.ctx.retire(pair, step)
    return state, {"recv_bytes": stats.bytes, "recv_s": stats.seconds, "attempts": stats.attempts}


def _from_replica(rec: Recovery, msg: dict, role: str) -> dict:
    epoch, step = msg["epoch"], msg["step"]
    if rec.ctx.rank == msg["source"]:
        return {"sent": [_send(rec, rec.ctx.replica_state(step), epoch, needer, step) for needer in msg["needers"]]}
    if rec.ctx.rank in msg["needers"]:
        state, report = _receive(rec, epoch, step, like=rec.ctx.replica_state(step))
        rec.ctx.workload.load_state_dict(state["workload"])
        return report
    return {}


def _roll_back(rec: Recovery, role: str, load) -> dict:
    """A live rank loads its own state of the step rolled back to (`load()`), unless the
    negative control `no-rollback` keeps its state (it then redoes steps it already applied)."""
    if role == "stayer" and rec.ctx.faults.at("rollback"):
        log.warning("injected: no-rollback: rank %d keeps its state", rec.ctx.rank)
        return {"rolled_back": False}
    t0 = time.perf_counter()
    rec.ctx.load_full(load())
    return {"rolled_back": True, "load_s": time.perf_counter() - t0}


def _from_snapshot(rec: Recovery, msg: dict, role: str) -> dict:
    epoch, step = msg["epoch"], msg["step"]
    snaps = rec.protection.own_snapshots()
    report: dict = {}
    for lost, holder in sorted(msg["holders"].items()):
        if rec.ctx.rank == holder:
            report.setdefault("sent", []).append(_send(rec, snaps.held_state(int(lost), step), epoch, int(lost), step))
    if rec.ctx.rank in msg["failed"] and msg["holders"].get(str(rec.ctx.rank)) == JOINER:
        return {**report, **_from_own_holding(rec, step)}
    if rec.ctx.rank in msg["failed"]:
        state, received = _receive(rec, epoch, step, like=None)
        snaps.rolled_back(step, mine=state)
        return {**report, **received, **_roll_back(rec, role, lambda: state)}
    report.update(_roll_back(rec, role, lambda: snaps.own_state(step)))
    snaps.rolled_back(step)
    return report


def _from_own_holding(rec: Recovery, step: int) -> dict:
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


def _from_checkpoint(rec: Recovery, msg: dict, role: str) -> dict:
    step = msg["step"]
    if rec.protection.snapshots is not None:
        rec.protection.snapshots.rolled_back(step)
    ctx = rec.ctx
    return _roll_back(rec, role, lambda: checkpoint.read_rank(Path(ctx.spec.checkpoint_dir), step, ctx.rank, ctx.key))


STATE_FROM = {"replica": _from_replica, "snapshot": _from_snapshot, "checkpoint": _from_checkpoint}


class Recovery:
    """A rank's part in recovering from an unexpected failure: a live rank stalls and resumes;
    a standby takes a vanished rank's slot."""

    def __init__(self, ctx: RankContext, protection: Protection, standby: StandbyRole):
        self.ctx, self.protection, self.standby = ctx, protection, standby

    def stall(self, completed: int, exc: Exception | str) -> int:
        """A collective failed: report how far this rank got and wait (bounded) for the
        controller's recovery plan. Returns the step to resume from."""
        log.warning("rank %d stalled after %d steps: %s", self.ctx.rank, completed, str(exc)[:300])
        if self.ctx.pending is not None:  # a planned migration in flight is void: its groups hold the lost rank
            abort(self.ctx, {"epoch": self.ctx.pending.epoch, "reason": "unexpected failure"})
        self.ctx.state.to(RankState.STALLED)
        self.ctx.send("stalled", rank=self.ctx.rank, step=completed, digest=self.ctx.digest(), error=str(exc)[:500],
                      role="stayer", holds=self.protection.holds())
        msg = self.wait_recover(exc)
        self.ctx.state.to(RankState.TRAINING)
        if completed < msg["step"] and self.ctx.rank not in msg["needers"]:
            raise MigrationError(f"recovery plan resumes at step {msg['step']} but this rank has completed "
                                 f"{completed} and gets no state", phase="recover", rank=self.ctx.rank)
        backends, report = rebuild(self, msg, "stayer")
        for name, backend in backends.items():
            self.ctx.retire(self.ctx.groups[name].swap(backend), msg["step"])
        # a rollback redoes the steps after msg["step"]: their old reports must not reach a restarted controller
        reports = self.ctx.step_reports
        self.ctx.step_reports = deque((r for r in reports if r["step"] <= msg["step"]), maxlen=reports.maxlen)
        self.ctx.switched_epoch = msg["epoch"]
        self.ctx.send("switched", epoch=msg["epoch"], rank=self.ctx.rank, role="stayer", step=msg["step"],
                      t=time.time(), detail={**report, "redo_from": completed})
        self.ctx.trace_next_steps()
        return int(msg["step"])

    def wait_recover(self, exc: Exception | str) -> dict:
        """The controller's `recover` plan, within the recovery deadline. The controller's
        deadline decides (its message names what it waited for); a rank gives up only
        RECOVERY_GRACE_S later, when that decision never came."""
        deadline = time.monotonic() + self.ctx.spec.recovery_timeout_s + RECOVERY_GRACE_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MigrationError(f"no recovery plan within {self.ctx.spec.recovery_timeout_s:.0f}s after: {exc}",
                                     phase="recover", rank=self.ctx.rank, host=self.ctx.spec.node)
            try:
                msg = self.ctx.inbox.get(timeout=left)
            except queue.Empty:
                continue
            if msg is None:
                raise MigrationError(f"controller gone while stalled after: {exc}", phase="recover", rank=self.ctx.rank)
            if msg["type"] == "recover":
                return msg
            # revoke (already applied), or a planned epoch's prepare/abort: void now

    def take_failed_rank(self, msg: dict, rebind: bool = True) -> int:
        """Unexpected failure: take a vanished rank's slot. Unlike a planned join, the job is
        paused while this runs, so only what must happen is done: rebind to the rank (its new
        wrappers' one-time collectives in the sandbox), build the groups, receive a replica's state."""
        t0 = time.perf_counter()
        rank = int(msg["assign"][str(self.ctx.local)])
        self.ctx.rank = rank
        # bound already (a one-node job's standby binds itself to the rank it will take, ahead.py)
        groups = self.ctx.groups
        prebound = self.standby.rehearsed == rank and bool(groups) and all(g.sandboxed for g in groups.values())
        if rebind and not prebound:
            self.ctx.groups = self.ctx.make_groups(rank, sandbox=True)
            self.ctx.workload.rebind(self.ctx.build_context(rank))
            self.standby.shadow_until_steady(self.ctx.spec.shadow_steps)
        rebind_s = time.perf_counter() - t0
        backends, report = rebuild(self, msg, "joiner")
        for name, backend in backends.items():
            self.ctx.retire(self.ctx.groups[name].swap(backend), msg["step"])
        self.ctx.role = "worker"
        self.ctx.state.to(RankState.TRAINING)
        self.ctx.switched_epoch = msg["epoch"]
        self.ctx.send("switched", epoch=msg["epoch"], rank=rank, role="joiner", step=msg["step"], t=time.time(),
                      detail={**report, "rebind_s": rebind_s, "prebound": prebound, "seconds": time.perf_counter() - t0,
                              **self.ctx.memory()})
        log.info("took failed rank %d at step %d in %.3fs", rank, msg["step"], time.perf_counter() - t0)
        self.ctx.trace_next_steps()
        return int(msg["step"])
