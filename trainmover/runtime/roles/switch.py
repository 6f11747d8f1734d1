"""The switch of a planned migration, on each side: stayer, leaver and joiner.

    prepare (controller) ──> Phase 1 in a background thread (phase1.py): stayers build the
    groups that held the leaver with the joiner in its slot; leaver and joiner a transfer pair
    ──> `prepared` ──> at the next step boundary every rank votes the epoch it is ready for
    (training.py, boundary.py) ──> stayers swap their groups' backends, the leaver sends its
    state and leaves, the joiner loads it and trains from that step.

The leaver is the authority for the joiner: it either sends its state (`go`) or cancels, so a
late abort can never leave the joiner waiting for a state that will not come.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from trainmover.errors import MigrationError
from trainmover.groups import rng
from trainmover.groups.specs import delta
from trainmover.runtime import phase1
from trainmover.runtime.changes import BeginPhase1, Joining, Switched, TakeRank, UseGroups
from trainmover.runtime.transfer import plan as xferplan, state as transfer
from trainmover.protocol.messages import AbortMsg, MoveRole, PrepareMsg
from trainmover.runtime.context import RankContext
from trainmover.runtime.dispatch import Aborted
from trainmover.runtime.roles.epoch import abort, cancel_key, go_key, layout_key
from trainmover.runtime.rankstate import RankState

if TYPE_CHECKING:  # roles this one calls, handed to it by the process (worker.Agent)
    from trainmover.runtime.protection.role import Protection
    from trainmover.runtime.roles.recovery import RankRecovery
    from trainmover.runtime.roles.standby import StandbyRole

log = logging.getLogger("trainmover.worker")


def switch_ready(prep: phase1.Prepared | None, step: int) -> int:
    """The epoch a rank votes for at the boundary after `step` (0: none): Phase 1 done, and a
    leaver's transfer plan made at an earlier boundary."""
    if not prep or not prep.done.is_set() or prep.error:
        return 0
    if prep.role == MoveRole.LEAVER and (prep.plan_at is None or prep.plan_at >= step):
        return 0
    return prep.epoch


UNREACHABLE_POLL_S = 0.05


def await_go(store, epoch: int, leaver: int, aborted, deadline: float, poll_s: float = 0.002) -> str:
    """The joiner's wait for the leaver's verdict: "go" (it is sending its state), "cancelled"
    (its cancel key, or the controller's abort) or "timeout" (monotonic `deadline` passed).
    `store()` is asked anew each round: when the controller that hosts the store is killed, the
    link's reconnection moves the process's client to its successor's store. An unreachable
    store meanwhile is "no verdict yet", never a reason for this process to die (seen: the
    controller killed mid-prepare, and the joiner's DistNetworkError stopped the job).

    Polled with `check` every `poll_s`, never with a timed `wait`: c10d logs a warning for each
    wait that times out ("waitForInput ... timed out after 49ms"), and a joiner waiting out a
    long Phase 1 filled its log with one every 50 ms (Megatron PP3, issue 36). A check answers
    at once; the go is seen at most `poll_s` late (2 ms: two store round trips on the job's
    network per poll)."""
    while True:
        if aborted():
            return "cancelled"
        started, client = time.monotonic(), store()
        try:
            if client.check([cancel_key(epoch, leaver)]):
                return "cancelled"
            if client.check([go_key(epoch, leaver)]):
                return "go"
        except (RuntimeError, dist.DistStoreError):  # the store unreachable: no verdict yet
            # it fails at once: wait longer, no busy loop while the successor comes up
            time.sleep(UNREACHABLE_POLL_S)
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(max(0.0, poll_s - (time.monotonic() - started)))


def stop_as_lost(epoch: int, step: int, exc: Exception) -> None:
    """The leaver's send failed: its joiner was lost mid-copy, or the pair broke or was taken over
    by a process outside the job (gloo admits whoever sends a pending pair's sequence number
    first: docs/security.md). The stayers switched to the joiner at this very boundary, so this
    rank cannot go back, and raising would end the job as this rank's own error. It stops the
    way a lost rank does (SIGKILL: nothing it holds is torn down half-way), and the controller
    recovers its rank as after a leaver lost in the copy: from a replica, or it ends the job
    saying why where no state is left."""
    log.error("epoch %d: sending this leaver's state at step %d failed (%s: %s); stopping as a lost rank so "
              "that the job recovers the rank", epoch, step, type(exc).__name__, str(exc)[:500])
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)


class Switch:
    """A rank's part in planned migrations: Phase 1 on `prepare`, the vote's readiness, and the
    switch itself as leaver, or (a standby) as joiner."""

    def __init__(self, ctx: RankContext, protection: Protection, standby: StandbyRole, recovery: RankRecovery):
        self.ctx, self.protection, self.standby, self.recovery = ctx, protection, standby, recovery
        self.reported: set[tuple[int, str]] = set()  # (epoch, prepared/failed) already reported

    def poll_inbox(self):
        """At a step boundary: the controller's messages (a prepare, an abort, a hold: the
        process's routes, dispatch.py), then this rank's Phase 1 outcome, reported once."""
        self.ctx.inbox.poll()
        prep = self.ctx.pending
        if prep and prep.done.is_set():
            what = "failed" if prep.error else "prepared"
            if what == "prepared" and prep.role == MoveRole.LEAVER and prep.plan_at is None:
                # The transfer's plan is made at this boundary; the leaver is ready to switch
                # from the next one on (`switch_ready`): with no stayer to wait for, the switch
                # could follow at this very boundary, and making the plan put ~0.1 s into the
                # pause (measured on H100s).
                self._plan_ahead(prep)
                prep.plan_at = self.ctx.completed
                return
            if (prep.epoch, what) not in self.reported:
                self.reported.add((prep.epoch, what))
                if prep.error:
                    self.ctx.send("prepare_failed", epoch=prep.epoch, rank=self.ctx.rank, error=prep.error)
                else:  # memory measured at step boundaries, where a steady step's usage repeats
                    self.ctx.send("prepared", epoch=prep.epoch, rank=self.ctx.rank, groups=sorted(prep.backends),
                                  seconds=prep.seconds, detail={"role": prep.role, "before": prep.memory_before,
                                                                "after": self.ctx.memory()})

    def on_prepare(self, msg: PrepareMsg) -> None:
        epoch = msg.epoch
        d = delta(self.ctx.specs, msg.leavers, epoch)
        role = MoveRole.LEAVER if self.ctx.rank in d.leavers else MoveRole.STAYER
        if role == MoveRole.STAYER and not d.groups_to_build(self.ctx.rank):
            return  # no group of ours contains the leaver: nothing to do (never the case for world)
        if role == MoveRole.LEAVER:  # for the joiner to check its own against (Workload.collective_layout)
            self.ctx.store.set(layout_key(epoch, self.ctx.rank), self.ctx.workload.collective_layout())
        prep = phase1.Prepared(epoch, d, role, self.ctx.rank)
        prep.memory_before, prep.comms_before = self.ctx.memory(), self.ctx.comms_created()
        self.ctx.apply(BeginPhase1(prep))
        phase1.start(prep, self.ctx.phase1_builder())
        log.info("phase 1 epoch %d as %s: %s", epoch, role, [g.name for g in d.groups_to_build(self.ctx.rank)])
        if self.ctx.role == "worker":
            self.ctx.faults.at("phase1", who=self.ctx.rank, epoch=epoch)

    def on_abort(self, msg: AbortMsg) -> None:
        abort(self.ctx, msg)

    def on_join_abort(self, msg: AbortMsg) -> Aborted | None:
        """An abort heard inside a join: it frees the joiner when it is of the epoch it joins."""
        return Aborted(msg.epoch) if msg.epoch == self.ctx.joining else None

    def _plan_ahead(self, prep: phase1.Prepared, like: dict | None = None) -> None:
        """The transfer's plan (transfer/plan.py), made at a step boundary before the pause: the
        leaver's from the state it will send, the joiner's from the buffers it will fill."""
        t0 = time.perf_counter()
        try:
            state = like if like is not None else self.ctx.full_state(0)
            prep.plan = xferplan.of_state(state)[1]
            prep.plan.warm(finite=like is not None)  # the joiner receives (and checks norms), the leaver sends
            transfer.warm_manifest(state, prep.plan)
        except (RuntimeError, ValueError) as exc:  # made again in the pause instead (slower, still exact)
            log.warning("transfer plan not made ahead: %s", exc)
            prep.plan = None
        prep.plan_s = max(time.perf_counter() - t0, 1e-9)  # set: made (or tried) once

    def stay(self, prep: phase1.Prepared, step: int) -> None:
        """The stayer's side, at the boundary every rank agreed on: its groups that held the
        leaver take the backends Phase 1 built (the old ones retired once no step uses them)."""
        for name, backend in prep.backends.items():
            self.ctx.retire(self.ctx.groups[name].swap(backend), step)
        self.ctx.apply(Switched(prep.epoch))
        self.ctx.trace_next_steps()
        self.ctx.send("switched", epoch=prep.epoch, rank=self.ctx.rank, role=MoveRole.STAYER, step=step, t=time.time(),
                      detail={"prepare_s": prep.seconds, "comms_created": self.ctx.comms_created(),
                              "comms_created_before": prep.comms_before})

    def leave(self, prep: phase1.Prepared, step: int):
        state = self.ctx.full_state(step)
        if self.ctx.faults.at("leaver-state"):  # skip-optimizer-state: negative control for the digest tests
            state["workload"].pop("optimizer", None)
        self.ctx.store.set(go_key(prep.epoch, self.ctx.rank), "1")
        self.ctx.faults.at("copy")  # die-in-copy: the state must then come from a replica
        try:
            stats = transfer.send_verified(state, prep.xfer, key=self.ctx.key, dst=1, plan=prep.plan,
                                           context=phase1.xfer_prefix(prep.epoch, prep.rank),  # sealed for this pair only
                                           corrupt=self.ctx.faults.at("transfer-send"))
        except (MigrationError, RuntimeError) as exc:
            stop_as_lost(prep.epoch, step, exc)
        self.ctx.apply(Switched(prep.epoch))
        self.ctx.state.to(RankState.LEFT)
        self.ctx.send("switched", epoch=prep.epoch, rank=self.ctx.rank, role=MoveRole.LEAVER, step=step, t=time.time(),
                      detail={"send_s": stats.seconds, "copy_s": stats.copy_s, "bytes": stats.bytes,
                              "tensors": stats.tensors, "plan_s": prep.plan_s, "parts": stats.parts})
        log.info("left at step %d: sent %d bytes in %.3fs", step, stats.bytes, stats.seconds)

    def join(self, msg: PrepareMsg) -> int | None:
        """Take a leaver's slot. Returns the step to continue from, or None if the
        migration was cancelled (the agent then stays a standby)."""
        epoch = msg.epoch
        self.ctx.apply(Joining(epoch))
        self.ctx.state.to(RankState.JOINING)
        try:
            return self._join(msg, epoch)
        finally:
            self.ctx.apply(Joining(0))

    def _join(self, msg: PrepareMsg, epoch: int) -> int | None:
        rank = int(msg.assign[str(self.ctx.local)])
        leaver = rank
        # Off the critical path: rebuild groups with the rank we now know, rebind the workload,
        # and run shadow steps so that the new wrappers' one-time work happens in the sandbox.
        self.ctx.apply(UseGroups(self.ctx.make_groups(rank, sandbox=True)))
        self.ctx.workload.rebind(self.ctx.build_context(rank))
        with self.standby.warm_stance():
            self.standby.shadow_until_steady(self.ctx.spec.job.shadow_steps)
        prep = phase1.Prepared(epoch, delta(self.ctx.specs, msg.leavers, epoch), MoveRole.JOINER, rank)
        phase1.start(prep, self.standby.ahead_builder(self.ctx.phase1_builder()))  # groups built ahead: one-node jobs
        self.ctx.faults.at("phase1", who="joiner", epoch=epoch)
        # Bounded, and abortable: a peer lost meanwhile leaves the builds waiting until the
        # group timeout, but the controller's abort frees this standby at once (the Phase 1
        # thread ends by its own deadline, on its own store client, and is discarded).
        deadline = time.monotonic() + self.ctx.spec.job.group_timeout_s + 5
        while not prep.done.wait(0.05):
            if self._aborted(epoch):
                log.info("epoch %d aborted during phase 1; back to standby", epoch)
                return None
            if time.monotonic() > deadline:
                break
        if not prep.done.is_set() or prep.error:
            self.ctx.send("prepare_failed", epoch=epoch, rank=rank, error=prep.error or "phase 1 deadline")
            return None
        mismatch = self._layout_mismatch(epoch, leaver)
        if mismatch is None:
            log.info("epoch %d aborted during phase 1; back to standby", epoch)
            return None
        if mismatch:
            self.ctx.send("prepare_failed", epoch=epoch, rank=rank, error=mismatch)
            return None
        like = self.ctx.full_state(0)
        self._plan_ahead(prep, like)
        self.ctx.send("prepared", epoch=epoch, rank=rank, groups=sorted(prep.backends), seconds=prep.seconds,
                      detail={"role": "joiner"})
        # Wait for the leaver's verdict: it either starts sending (go) or cancels.
        verdict = await_go(lambda: self.ctx.store, epoch, leaver, lambda: self._aborted(epoch),
                           time.monotonic() + self.ctx.spec.job.switch_timeout_s)
        if verdict == "cancelled":
            log.info("epoch %d cancelled; back to standby", epoch)
            return None
        if verdict == "timeout":
            self.ctx.send("prepare_failed", epoch=epoch, rank=rank, error="leaver never sent its state")
            return None
        t_switch = time.perf_counter()
        self.ctx.faults.at("joiner-copy")  # die-in-copy:joiner: the leaver's send fails
        try:
            state, stats = transfer.recv_verified(prep.xfer, key=self.ctx.key, src=0, like=like, plan=prep.plan,
                                                  context=phase1.xfer_prefix(prep.epoch, prep.rank))
        except (MigrationError, RuntimeError) as exc:  # the leaver died mid-copy: a replica will send it
            self.ctx.apply(TakeRank(rank))
            self.ctx.send("stalled", rank=rank, step=0, digest="", error=str(exc)[:500], role=MoveRole.JOINER,
                          holds={"replicas": [], "own": [], "held": {}})
            return self.recovery.take_failed_rank(self.recovery.wait_recover(exc), rebind=False)
        t_received = time.perf_counter()
        self.ctx.workload.load_state_dict(state["workload"])
        rng.restore(state["rng"])
        t_loaded = time.perf_counter()
        for name, backend in prep.backends.items():
            self.ctx.retire(self.ctx.groups[name].swap(backend), int(state["step"]))
        # The transfer pair is done too; dropping its last reference here would abort the
        # communicator synchronously, inside the pause (measured: 0.5 s on an H200).
        self.ctx.retire(prep.xfer, int(state["step"]))
        self.ctx.apply(TakeRank(rank))
        self.ctx.state.to(RankState.TRAINING)
        self.ctx.apply(Switched(epoch))
        self.ctx.send("switched", epoch=epoch, rank=rank, role=MoveRole.JOINER, step=int(state["step"]), t=time.time(),
                      detail={"recv_s": stats.seconds, "copy_s": stats.copy_s, "bytes": stats.bytes,
                              "apply_s": time.perf_counter() - t_switch, "prepare_s": prep.seconds,
                              "attempts": stats.attempts, "plan_s": prep.plan_s,
                              # the pause on this side, in parts: receive (manifest, copy, checks),
                              # load into the workload, swap the groups in
                              "pause_parts": {**(stats.parts or {}), "receive_s": round(t_received - t_switch, 5),
                                              "load_s": round(t_loaded - t_received, 5),
                                              "swap_s": round(time.perf_counter() - t_loaded, 5)},
                              "comms_created": self.ctx.comms_created(), **self.ctx.memory()})
        log.info("joined as rank %d at step %d (%d bytes in %.3fs)", rank, state["step"], stats.bytes, stats.seconds)
        self.ctx.trace_next_steps()
        return int(state["step"])

    def _layout_mismatch(self, epoch: int, leaver: int) -> str | None:
        """Why this joiner's collective layout cannot replace the leaver's ('' if it can; None
        if the controller aborted the epoch meanwhile). The leaver publishes its layout when it
        gets `prepare`; the wait is bounded and abortable."""
        key, deadline = layout_key(epoch, leaver), time.monotonic() + self.ctx.spec.job.group_timeout_s
        while not self.ctx.store.check([key]):
            if self._aborted(epoch):
                return None
            if time.monotonic() > deadline:
                return f"the leaver never published its collective layout ({self.ctx.spec.job.group_timeout_s:g}s)"
            time.sleep(0.05)
        ours, theirs = self.ctx.workload.collective_layout(), self.ctx.store.get(key).decode()
        if ours != theirs:
            return (f"the joiner's collective layout differs from the leaver's (its collectives would not match "
                    f"the stayers'): joiner {ours[:200]!r}, leaver {theirs[:200]!r}")
        return ""

    def _aborted(self, epoch: int) -> bool:
        """Whether the controller aborted `epoch` (what else a joiner hears is void: dispatch.py)."""
        return self.ctx.inbox.poll() == Aborted(epoch)
