"""The training loop and its step boundary: one step, its report, protection, the agreement.

After every step each rank reports it (`step`), takes a snapshot or checkpoint when due
(protection.py), looks at its control messages, and joins the boundary agreement
(boundary.py): a prepared migration switches here, on every rank at the same step, or on none.
A collective that fails (a peer vanished, or the controller revoked the groups) makes the rank
stall and wait for the controller's recovery plan (recovery.py). What failed is asked of the
groups, which mark a failed collective where it fails (groups.CollectiveFailure), never guessed
from the exception's type: any other error that ends a step (the workload's own, out of memory
included) ends this process with a `failed` report, and the controller ends the job.
"""
from __future__ import annotations

import logging
import time

from trainmover.protocol.messages import MoveRole
from trainmover import config
from trainmover.groups.swappable import CONTROL, CollectiveFailure, first_failure
from trainmover.runtime.roles import boundary
from trainmover.runtime.changes import Completed, StepTraced
from trainmover.runtime.context import RankContext
from trainmover.runtime.protection.role import Protection
from trainmover.runtime.roles.recovery import RankRecovery
from trainmover.runtime.rankstate import RankState
from trainmover.runtime.roles.switch import Switch, switch_ready
from trainmover.script.run import ScriptEnded

log = logging.getLogger("trainmover.worker")

TRACE_STEPS = 2 if config.setting("TM_TRACE_SWITCH") else 0  # log timings of the steps after a switch


def lost_peer(groups: dict) -> CollectiveFailure | None:
    """The decision after a step ended with an exception (pure): a collective failed in one of
    this rank's groups (a peer gone, a revoked group, a timeout), so the rank stalls for the
    controller's recovery; or None: nothing failed between ranks, the error is the code's own."""
    return first_failure(groups.values())


def trace(what: str) -> None:
    if TRACE_STEPS:
        log.info("trace %.6f %s", time.time(), what)


class TrainingLoop:
    """A worker's training loop: each step, its report, protection and the boundary's vote,
    handing the switch to `switch` and a failed collective to `recovery`."""

    def __init__(self, ctx: RankContext, protection: Protection, switch: Switch, recovery: RankRecovery):
        self.ctx, self.protection, self.switch, self.recovery = ctx, protection, switch, recovery
        self.pure_s = 0.0  # the last step's own compute time (see _iteration)
        self.recorder = None  # the recording rank's recorder (trainmover.sandbox.live)

    def train(self, step: int) -> int:
        self.pure_s = 0.0
        loss = 0.0
        trace("train loop entered")
        while step < self.ctx.spec.job.steps:
            self.ctx.apply(Completed(step))
            try:
                loss, step = self._iteration(step)
            except ScriptEnded:  # a script's own loop is over (trainmover/script): this rank is done
                break
            except Exception as exc:  # noqa: BLE001 - classified by the groups' marks, not by its type
                failure = lost_peer(self.ctx.groups)
                if failure is None:
                    raise  # the user's code (or ours) raised: the process reports it and the job ends
                step = self.recovery.stall(self.ctx.completed, f"{failure} ({type(exc).__name__}: {exc})")
                continue
            if step < 0:
                return 0  # this rank left the job (planned migration)
        self.ctx.state.to(RankState.FINISHED)
        self.ctx.send("finished", rank=self.ctx.rank, step=step, digest=self.ctx.digest(), loss=loss)
        return 0

    def _iteration(self, step: int) -> tuple[float, int]:
        """One training step, its report and the boundary agreement. Returns (loss, steps
        completed), steps -1 when this rank handed its state over and leaves."""
        control, world = self.ctx.groups[CONTROL], self.ctx.groups["world"]
        world.first_call_at = None
        t0, c0 = time.perf_counter(), time.process_time()
        # injected faults of this step: die, freeze or hang now, or compute longer (a straggler)
        self.ctx.faults.at("step", rank=self.ctx.rank, step=step, pure_s=self.pure_s, cpu=self.ctx.device == "cpu")
        t1, c1 = time.perf_counter(), time.process_time()
        if self.recorder:
            self.recorder.before(step)
        if self.ctx.trace_steps:
            self.ctx.apply(StepTraced())
            trace(f"step {step + 1} begins")
            self.ctx.workload.trace = trace
        elif getattr(self.ctx.workload, "trace", None):
            self.ctx.workload.trace = None
        loss = self.ctx.workload.train_step(step)
        # a rank's own compute: until its first collective (after that it may wait for peers)
        # On CPU nodes: CPU time, which co-located processes cannot inflate; on GPUs: wall time.
        if self.ctx.device == "cpu":
            first = world.first_call_cpu if world.first_call_at is not None else time.process_time()
            compute_s, self.pure_s = first - c0, first - c1
        else:
            first = world.first_call_at or time.perf_counter()
            compute_s, self.pure_s = first - t0, first - t1
        if self.recorder:
            report = self.recorder.after(step, loss, time.perf_counter() - t0)
            if report:  # the recorder stays: it records again if the collectives change shape
                self.ctx.send("recorded", **report)
        step += 1
        self.ctx.apply(Completed(step))  # from here on a failure finds this step complete in our state
        self.ctx.send("step", rank=self.ctx.rank, step=step, loss=loss, step_s=time.perf_counter() - t0,
                      compute_s=compute_s, t=time.time())
        self.protection.protect(step)
        self.ctx.release_retired(step)
        self.switch.poll_inbox()
        prep = self.ctx.pending
        ready = switch_ready(prep, step)
        if boundary.agree(control, ready) == ready and ready:
            if prep.role == MoveRole.LEAVER:
                self.switch.leave(prep, step)
                return loss, -1
            self.switch.stay(prep, step)
            trace("stayer swapped")
        return loss, step

    def start_recording(self) -> None:
        from trainmover.sandbox import live, recording
        ok, why = recording.available()
        if not ok:
            log.warning("not recording collectives: %s", why)
            return
        spec = self.ctx.spec
        rank = self.ctx.rank
        self.recorder = live.Recorder(self.ctx.groups, recording.base_of(spec.recording_dir, rank), rank,
                                      spec.job.record_iterations, skip=CONTROL, from_step=spec.job.record_from_step,
                                      max_versions=spec.job.record_versions)
