"""The live side: the recording rank records its collectives, then watches their shapes and
records a new version when they change (standbys re-warm on it).

States of a `Recorder`, one value, one log line per transition:

    waiting    before the first recorded step (TM_RECORD_FROM_STEP)
    recording  this step's collective outputs go to the writer
    writing    the writer thread completes the file; steps are timed, shapes watched
    measuring  steady steps after the write, timed: the baseline of the recording's cost
    watching   shapes compared with the last recorded iteration's at every step
    stopped    no more recordings (TM_RECORD_VERSIONS reached, or the writer failed)
"""
from __future__ import annotations

import enum
import logging
import statistics
from pathlib import Path

import torch

from trainmover.errors import MigrationError
from trainmover.sandbox import recording

log = logging.getLogger("trainmover.sandbox")

STEADY_STEPS = 5  # steps timed after a recording is written: the steady step time it is compared with


class State(enum.Enum):
    WAITING = "waiting"
    RECORDING = "recording"
    WRITING = "writing"
    MEASURING = "measuring"
    WATCHING = "watching"
    STOPPED = "stopped"


ALLOWED = {
    State.WAITING: {State.RECORDING},
    State.RECORDING: {State.WRITING, State.STOPPED},
    State.WRITING: {State.MEASURING, State.STOPPED},
    State.MEASURING: {State.WATCHING, State.STOPPED},
    State.WATCHING: {State.RECORDING, State.STOPPED},
    State.STOPPED: set(),
}


class Recorder:
    """Observes every group but `skip` (through `SwappableGroup.observer`, which a migration's
    backend swap leaves in place). `base`: the recordings' base name (see recording.version_path)."""

    def __init__(self, groups: dict, base: Path, rank: int, iterations: int, skip: str, *,
                 from_step: int = 0, max_versions: int = 4, steady_steps: int = STEADY_STEPS):
        if iterations < 1:
            raise MigrationError("a recording needs at least one iteration", phase="record")
        # A group of one rank never leaves the node and its answer is the rank's own data
        # (what a sandbox gives locally): not recorded. With Megatron and DP=1 its gradient
        # "all-reduce" alone would be most of a recording.
        self.groups = {n: g for n, g in groups.items() if n != skip and g.size() > 1}
        self.base, self.rank, self.iterations = Path(base), rank, iterations
        self.from_step, self.max_versions, self.steady_steps = from_step, max_versions, steady_steps
        self.state = State.WAITING
        self.version = 0
        self.writer: recording.RecordingWriter | None = None
        self.signature: list[tuple] = []       # this step's collectives
        self.reference: list[tuple] | None = None  # the last recorded iteration's
        self.changed_at: int | None = None     # step whose collectives differed from the reference
        self.candidate: list[tuple] | None = None  # a differing signature seen once (see _compare)
        self.previous: list[tuple] | None = None   # the previous recorded iteration's
        self.recorded = 0
        self.times: dict[str, list[float]] = {}
        self.device_bytes: list[int] = []      # this step's outputs on a GPU (what a recording would copy)
        self.pool = recording.PinnedPool(pinned=torch.cuda.is_available())
        self.reserving = None                  # the thread pinning the next recording's buffers
        for g in self.groups.values():
            g.observer = self._observe
        if from_step == 0:  # the recording starts with the workload's construction
            self._start(0, init=True)

    def _to(self, state: State, why: str) -> None:
        if state not in ALLOWED[self.state]:
            raise MigrationError(f"recorder: {self.state.value} -> {state.value} is not allowed", phase="record")
        log.info("recorder v%d: %s -> %s (%s)", self.version, self.state.value, state.value, why)
        self.state = state

    def _observe(self, group: str, op: str, args, work):
        """Returns the Work to hand to the caller instead of `work` (None: `work`)."""
        outs = recording.outputs_of(op, args)
        if outs is None:
            return None
        self.signature.append(recording.signature_of(group, op, outs))
        self.device_bytes += [t.numel() * t.element_size() for t in outs if t.is_cuda]
        if self.state is State.RECORDING:
            return self.writer.record(group, op, outs, work)
        return None

    def _start(self, step: int, init: bool) -> None:
        self.version += 1
        self.writer = recording.RecordingWriter(recording.version_path(self.base, self.version), self.rank,
                                                self.iterations, version=self.version, first_step=step, pool=self.pool)
        self.recorded, self.times, self.previous = 0, {"recording": [], "writing": [], "steady": []}, None
        self._to(State.RECORDING, f"from step {step}" + (" and the workload's construction" if init else ""))
        if init:
            self.writer.begin("init")

    def before(self, step: int) -> None:
        self.signature, self.device_bytes = [], []
        if self.state is State.WAITING and step >= self.from_step:
            self._start(step, init=False)
        elif self.state is State.WATCHING and self.changed_at is not None:
            self._start(step, init=False)
            self.changed_at = None
        if self.state is State.RECORDING:
            self.writer.begin(self.recorded, step)

    def after(self, step: int, loss: float, step_s: float) -> dict | None:
        """Call after every step. Returns the 'recorded' report of a version once it is written
        and measured, else None."""
        state = self.state
        if state is State.RECORDING:
            self.writer.end_iteration(loss)
            self.times["recording"].append(step_s)
            self.recorded += 1
            if self.recorded == self.iterations:
                if self.previous is not None and self.previous != self.signature:
                    log.warning("recording v%d ends on a step whose collectives differ from the step before "
                                "(one-time collectives of a wrapper?): more TM_RECORD_ITERATIONS would end it "
                                "on a steady step", self.version)
                self.reference, self.candidate = list(self.signature), None
                self.writer.finish()
                self._to(State.WRITING, f"{self.iterations} iterations recorded, the file is written in the background")
            self.previous = list(self.signature)
            return None
        if state is State.WAITING and step + 1 == self.from_step:
            self._reserve()
        if state in (State.WAITING, State.STOPPED):
            return None
        self._compare(step)
        if self.changed_at == step:
            self._reserve()  # the next step is recorded with these sizes
        if self.state is State.WRITING:
            self.times["writing"].append(step_s)
            if not self.writer.done():
                return None
            if self.writer.error is not None:
                log.error("recording v%d failed: %s", self.version, self.writer.error)
                self._stop(f"writer failed: {self.writer.error}")
                return None
            self.pool.clear()
            self._to(State.MEASURING, f"{self.writer.size} bytes written")
            if self.changed_at is None:
                return None
            # the shapes changed while the file was written: report without a steady baseline
        elif self.state is State.MEASURING:
            self.times["steady"].append(step_s)
            if len(self.times["steady"]) < self.steady_steps and self.changed_at is None:
                return None
        else:
            return None
        report = self.report()
        self._to(State.WATCHING, "reported")
        return report

    def _compare(self, step: int) -> None:
        """A change is a differing signature seen in two consecutive steps: a one-off step (an
        evaluation, a wrapper's one-time broadcast) is not worth a recording."""
        if self.reference is None or self.changed_at is not None:
            return
        if self.signature == self.reference:
            self.candidate = None
            return
        if self.signature != self.candidate:
            self.candidate = list(self.signature)
            return
        first = next((i for i, (a, b) in enumerate(zip(self.signature, self.reference)) if a != b),
                     min(len(self.signature), len(self.reference)))
        now = self.signature[first] if first < len(self.signature) else "nothing"
        was = self.reference[first] if first < len(self.reference) else "nothing"
        if self.version >= self.max_versions:
            log.warning("step %d: collective #%d is %s, recorded %s; not recording again (%d versions, "
                        "TM_RECORD_VERSIONS)", step, first, now, was, self.version)
            self._stop("collectives changed again after the last allowed version")
            return
        log.info("step %d: collective #%d is %s, recorded %s: recording version %d next",
                 step, first, now, was, self.version + 1)
        self.changed_at, self.candidate = step, None

    def _reserve(self) -> None:
        """Pin the host buffers of the coming recording now, in the background: this step's
        outputs are the next ones' sizes (one set per recorded iteration)."""
        if self.device_bytes:
            self.reserving = self.pool.reserve(self.device_bytes * self.iterations)

    def _stop(self, why: str) -> None:
        for g in self.groups.values():
            g.observer = None
        self._to(State.STOPPED, why)

    def report(self) -> dict:
        """Size, and cost in step time: recorded and writing steps against the steady steps
        measured right after (all wall time of whole steps, GPU work included: a step ends with
        the loss on the host)."""
        w, t = self.writer, self.times
        steady = statistics.median(t["steady"]) if t["steady"] else None
        affected = t["recording"] + t["writing"]
        extra = sum(affected) - steady * len(affected) if steady is not None else None
        return {"rank": self.rank, "iterations": self.iterations, "bytes": w.size,
                "overhead_s": round(extra, 6) if extra is not None else 0.0, "step_s": t["recording"],
                "version": self.version,
                "detail": {"first_step": w.first_step,
                           "host_s": w.host_s, "writer_s": w.writer_s, "pinned_bytes": w.pool.allocated_bytes,
                           "pinned_reserved_bytes": w.pool.reserved_bytes,
                           "writing_step_s": t["writing"], "steady_step_s": t["steady"],
                           "step_ratio_recording": (statistics.median(t["recording"]) / steady) if steady else None,
                           "measured": extra is not None}}

    def close(self, timeout_s: float = 60.0) -> None:
        """Training ended: let a recording in progress finish (bounded), unhook the groups."""
        for g in self.groups.values():
            g.observer = None
        if self.state in (State.RECORDING, State.WRITING) and self.writer is not None:
            if self.state is State.RECORDING:
                log.warning("training ended during recording v%d: the recording is incomplete and dropped",
                            self.version)
                return
            self.writer.wait(timeout_s)
