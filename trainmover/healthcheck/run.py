"""Run the checks under one deadline and apply the decision (drain) through trainmover.slurm.

Every call is bounded: each check runs in a worker thread that is abandoned when the
deadline passes (the check is then reported as a fault: a hung NVML call is a sick GPU),
and each Slurm command has its own timeout. Total: `deadline_s` + 2 Slurm calls.

The GPU check is the only place here with effects on the GPU side: it reads the source,
loads the state, applies an injected fault, asks verdict.judge (pure) and saves the state.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from trainmover.errors import TrainMoverError
from trainmover.healthcheck import checks, inject, notify, state
from trainmover.healthcheck import source as sources
from trainmover.healthcheck.checks import Finding
from trainmover.healthcheck.decide import Action, decide
from trainmover.healthcheck.verdict import Policy, judge

DEFAULT_STATE_DIR = "/var/lib/trainmover/healthcheck"
REPORTED_DISKS = ("/", "/tmp")  # free space reported when no --disk is named (warnings only)


@dataclass(frozen=True)
class Options:
    node: str
    state_dir: Path = Path(DEFAULT_STATE_DIR)
    # File systems whose free space below min_free_gb drains the node: none unless the admin names
    # them (--disk). Any user can fill /tmp (and / where /tmp or /var/tmp lies on it), so by
    # default REPORTED_DISKS are only reported (a warning), never a reason to drain (issue 37).
    disk_paths: tuple[str, ...] = ()
    min_free_gb: float = 1.0
    drain: bool = True
    deadline_s: float = 6.0        # all checks together
    slurm_timeout_s: float = 1.5   # each Slurm command
    gpu: bool = True
    straggler: bool = False        # ask the TrainMover jobs on the node (the CLI turns it on unless root)
    gpu_source: str = "auto"       # source.SPECS
    policy: Policy = field(default_factory=Policy)  # rate thresholds and window, critical XIDs
    drain_notices: Optional[Path] = None  # where a drain is announced to the jobs (notify.py)


@dataclass
class Report:
    node: str
    findings: list[Finding] = field(default_factory=list)
    action: Optional[Action] = None
    drained: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    gpu_source: str = ""           # where the GPU reading came from ("" when none was read)

    @property
    def healthy(self) -> bool:
        return not any(not f.ok and not f.skipped for f in self.findings)

    def to_dict(self) -> dict:
        def finding(f: Finding) -> dict:
            d = {"check": f.check, "ok": f.ok, "skipped": f.skipped, "detail": f.detail}
            if f.warning:
                d["warning"] = True
            if f.evidence:
                d["evidence"] = list(f.evidence)
            return d
        return {"node": self.node, "healthy": self.healthy, "drained": self.drained,
                "action": self.action.reason if self.action else None, "gpu_source": self.gpu_source,
                "findings": [finding(f) for f in self.findings],
                "notes": self.notes, "seconds": round(self.seconds, 3)}


class GpuCheck:
    """The GPU job: read -> load state -> inject -> judge -> save. `source` and `clock` are
    for tests; `gpu_source` and `notes` tell the report what happened."""

    def __init__(self, opts: Options, hook: inject.Hook, source: Optional[sources.Source] = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.opts, self.hook, self.source, self.clock = opts, hook, source, clock
        self.gpu_source = ""
        self.notes: list[str] = []

    def __call__(self) -> list[Finding]:
        opts, hook = self.opts, self.hook
        src = self.source or sources.choose(opts.gpu_source)
        try:
            reading = src.read()
        except sources.Unavailable as exc:
            if hook.faults:
                return [Finding("inject", False, f"GPU faults injected by {hook.path}, but no GPU reading: {exc}")]
            return [Finding("gpu", True, str(exc), skipped=True)]
        self.gpu_source = reading.source
        prev, notes = state.load(opts.state_dir, opts.node)
        now = self.clock()
        if hook.faults:
            try:
                prev, reading = inject.apply(prev, reading, hook.faults, now)
            except inject.InjectError as exc:
                return [Finding("inject", False, f"{hook.path}: {exc}")]
            notes.append(f"faults injected by {hook.path}: {', '.join(map(inject.describe, hook.faults))}; "
                         "GPU state not saved")
        verdict = judge(prev, reading, now, opts.policy)
        notes += verdict.notes
        if not hook.faults:
            notes += state.save(opts.state_dir, opts.node, verdict.state)
        self.notes = notes
        return list(verdict.findings)


def _straggler_checks(opts: Options) -> list[Finding]:
    from trainmover.slurm import CliSlurm
    try:
        jobs = CliSlurm(timeout=opts.slurm_timeout_s).jobs_on(opts.node)
    except TrainMoverError as exc:  # slurmctld unreachable is no fault of this node
        return [Finding("straggler", True, f"cannot ask Slurm which jobs run here: {exc}", skipped=True)]
    return checks.straggler_findings(opts.node, checks.read_statuses(jobs))


# Checks that read what users write (their jobs' files): an error or a timeout there says
# nothing about the node, so it is "skipped", never a fault (a FIFO, a hung mount, bad JSON).
USER_DATA_CHECKS = frozenset({"straggler", "fenced"})


def collect(opts: Options, extra: Sequence[tuple[str, Callable[[], list[Finding]]]] = (),
            gpu_check: Optional[GpuCheck] = None) -> list[Finding]:
    hook = gpu_check.hook if gpu_check else inject.read_hook(opts.state_dir, opts.node)
    jobs: list[tuple[str, Callable[[], list[Finding]]]] = [
        ("inject", lambda: checks.check_injected(hook, opts.gpu)),
        ("disk", lambda: checks.check_disk(opts.disk_paths, opts.min_free_gb) if opts.disk_paths
         else checks.check_disk(REPORTED_DISKS, opts.min_free_gb, drains=False)),
    ]
    if opts.straggler:
        jobs.append(("straggler", lambda: _straggler_checks(opts)))
    if opts.gpu:
        jobs.append(("gpu", gpu_check or GpuCheck(opts, hook)))
    jobs += list(extra)
    deadline = time.monotonic() + opts.deadline_s
    results: dict[str, list[Finding]] = {}

    def work(name: str, fn: Callable[[], list[Finding]]) -> None:
        try:
            results[name] = fn()
        except Exception as exc:  # a broken check is reported, not hidden
            results[name] = [Finding(name, False, f"check failed: {type(exc).__name__}: {exc}",
                                     skipped=name in USER_DATA_CHECKS)]

    # Daemon threads: a check stuck in a driver call must not keep the process alive.
    threads = [(name, threading.Thread(target=work, args=(name, fn), daemon=True, name=f"healthcheck-{name}"))
               for name, fn in jobs]
    for _, t in threads:
        t.start()
    out: list[Finding] = []
    for name, t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            out.append(Finding(name, False, f"check did not finish within {opts.deadline_s:g}s",
                               skipped=name in USER_DATA_CHECKS))
        else:
            out += results[name]
    return out


def run(opts: Options, client=None, *, clock: Callable[[], float] = time.monotonic,
        extra: Sequence[tuple[str, Callable[[], list[Finding]]]] = (),
        gpu_source: Optional[sources.Source] = None) -> Report:
    """Check the node; drain it through `client` (a trainmover.slurm SlurmClient) on a fault."""
    t0 = clock()
    gpu = GpuCheck(opts, inject.read_hook(opts.state_dir, opts.node), source=gpu_source)
    report = Report(node=opts.node, findings=collect(opts, extra, gpu))
    report.gpu_source, report.notes = gpu.gpu_source, list(gpu.notes)
    drained, reason = False, ""
    if not report.healthy and opts.drain:
        if client is None:
            from trainmover.slurm import CliSlurm
            client = CliSlurm(timeout=opts.slurm_timeout_s)
        try:
            info = client.nodes([opts.node])[opts.node]
            drained, reason = ("DRAIN" in info.flags or info.drained), info.reason
        except TrainMoverError as exc:
            report.notes.append(f"cannot read the state of {opts.node} from Slurm: {exc}")
    report.action = decide(report.findings, drained=drained, current_reason=reason, may_drain=opts.drain)
    if report.action.drain:
        try:
            client.drain(opts.node, report.action.reason)
            report.drained = True
            report.notes += notify.announce(opts.drain_notices, opts.node, report.action.reason)
        except TrainMoverError as exc:
            report.notes.append(f"drain of {opts.node} failed: {exc}")
    report.seconds = clock() - t0
    return report
