"""Run the checks under one deadline and apply the decision (drain) through trainmover.slurm.

Every call is bounded: each check runs in a worker thread that is abandoned when the
deadline passes (the check is then reported as a fault: a hung NVML call is a sick GPU),
and each Slurm command has its own timeout. Total: `deadline_s` + 2 Slurm calls.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from trainmover.errors import TrainMoverError
from trainmover.healthcheck import checks, gpu
from trainmover.healthcheck.checks import Finding
from trainmover.healthcheck.decide import Action, decide

DEFAULT_STATE_DIR = "/var/lib/trainmover/healthcheck"


@dataclass(frozen=True)
class Options:
    node: str
    state_dir: Path = Path(DEFAULT_STATE_DIR)
    disk_paths: tuple[str, ...] = ("/", "/tmp")
    min_free_gb: float = 1.0
    drain: bool = True
    deadline_s: float = 6.0        # all checks together
    slurm_timeout_s: float = 1.5   # each Slurm command
    gpu: bool = True
    straggler: bool = False        # ask the TrainMover jobs on the node (the CLI turns it on)


@dataclass
class Report:
    node: str
    findings: list[Finding] = field(default_factory=list)
    action: Optional[Action] = None
    drained: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not any(not f.ok and not f.skipped for f in self.findings)

    def to_dict(self) -> dict:
        return {"node": self.node, "healthy": self.healthy, "drained": self.drained,
                "action": self.action.reason if self.action else None,
                "findings": [{"check": f.check, "ok": f.ok, "skipped": f.skipped, "detail": f.detail}
                             for f in self.findings],
                "notes": self.notes, "seconds": round(self.seconds, 3)}


def _gpu_checks(opts: Options) -> list[Finding]:
    nvml, why = gpu.load_nvml()
    if nvml is None:
        return [Finding("gpu", True, why, skipped=True)]
    try:
        found = gpu.check_gpus(nvml)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    cursor = opts.state_dir / "kmsg-cursor" if opts.state_dir.is_dir() else None
    return found + gpu.check_kernel_xids(gpu.read_kmsg(), cursor)


def _straggler_checks(opts: Options) -> list[Finding]:
    from trainmover.slurm import CliSlurm
    try:
        jobs = CliSlurm(timeout=opts.slurm_timeout_s).jobs_on(opts.node)
    except TrainMoverError as exc:  # slurmctld unreachable is no fault of this node
        return [Finding("straggler", True, f"cannot ask Slurm which jobs run here: {exc}", skipped=True)]
    return checks.straggler_findings(opts.node, checks.read_statuses(jobs))


def collect(opts: Options, extra: Sequence[tuple[str, Callable[[], list[Finding]]]] = ()) -> list[Finding]:
    jobs: list[tuple[str, Callable[[], list[Finding]]]] = [
        ("inject", lambda: checks.check_injected(opts.state_dir, opts.node)),
        ("disk", lambda: checks.check_disk(opts.disk_paths, opts.min_free_gb)),
    ]
    if opts.straggler:
        jobs.append(("straggler", lambda: _straggler_checks(opts)))
    if opts.gpu:
        jobs.append(("gpu", lambda: _gpu_checks(opts)))
    jobs += list(extra)
    deadline = time.monotonic() + opts.deadline_s
    results: dict[str, list[Finding]] = {}

    def work(name: str, fn: Callable[[], list[Finding]]) -> None:
        try:
            results[name] = fn()
        except Exception as exc:  # a broken check is reported, not hidden
            results[name] = [Finding(name, False, f"check failed: {type(exc).__name__}: {exc}")]

    # Daemon threads: a check stuck in a driver call must not keep the process alive.
    threads = [(name, threading.Thread(target=work, args=(name, fn), daemon=True, name=f"healthcheck-{name}"))
               for name, fn in jobs]
    for _, t in threads:
        t.start()
    out: list[Finding] = []
    for name, t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            out.append(Finding(name, False, f"check did not finish within {opts.deadline_s:g}s"))
        else:
            out += results[name]
    return out


def run(opts: Options, client=None, *, clock: Callable[[], float] = time.monotonic,
        extra: Sequence[tuple[str, Callable[[], list[Finding]]]] = ()) -> Report:
    """Check the node; drain it through `client` (a trainmover.slurm SlurmClient) on a fault."""
    t0 = clock()
    report = Report(node=opts.node, findings=collect(opts, extra))
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
        except TrainMoverError as exc:
            report.notes.append(f"drain of {opts.node} failed: {exc}")
    report.seconds = clock() - t0
    return report
