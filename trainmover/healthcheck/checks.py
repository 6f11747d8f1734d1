"""Node checks other than the GPUs' (verdict.py). Each returns a list of Findings and reads
the world only through its arguments, so tests can hand it a fake filesystem."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from trainmover.healthcheck.inject import Hook


@dataclass(frozen=True)
class Finding:
    check: str       # "disk", "gpu", "inject", ...
    ok: bool
    detail: str
    skipped: bool = False
    warning: bool = False           # ok, but worth a look (never drains)
    evidence: tuple[dict, ...] = ()  # what the verdict rests on (GPU, link, counter, rate, threshold)

    def line(self) -> str:
        status = "skipped" if self.skipped else ("WARN" if self.warning else "ok") if self.ok else "FAULT"
        return f"{self.check}: {status}: {self.detail}"


def check_injected(hook: "Hook", gpu_checks: bool) -> list[Finding]:
    """The test hook (inject.py). Its text form fails the check with its first line; its JSON
    form is GPU data the GPU check applies (here only when GPU checks are off, as a fault)."""
    if hook.problem:
        return [Finding("inject", True, hook.problem, warning=True)]
    if hook.invalid:
        return [Finding("inject", False, hook.invalid)]
    if hook.text is not None:
        return [Finding("inject", False, f"{hook.text} (fault injected by {hook.path})")]
    if hook.faults and not gpu_checks:
        return [Finding("inject", False, f"GPU faults injected by {hook.path}, but the GPU checks are off")]
    return []


def check_disk(paths: Sequence[str], min_free_gb: float,
               usage: Callable[[str], "shutil._ntuple_diskusage"] = shutil.disk_usage,
               drains: bool = True) -> list[Finding]:
    """Free space on each of `paths`. `drains`: whether too little is a fault (the admin named the
    file system: --disk) or only a warning (run.REPORTED_DISKS: any user can fill /tmp, and / where
    /tmp or /var/tmp lies on it, so that alone never drains a node)."""
    out = []
    for p in paths:
        try:
            u = usage(p)
        except OSError as exc:
            out.append(Finding("disk", not drains, f"{p}: cannot stat ({exc.strerror or exc})", warning=not drains))
            continue
        free_gb = u.free / 1e9
        low = free_gb < min_free_gb
        detail = f"{p}: {free_gb:.1f} GB free (minimum {min_free_gb:g} GB)"
        if low and not drains:
            detail += " (reported only: drains only for a file system named with --disk)"
        out.append(Finding("disk", not (low and drains), detail, warning=low and not drains))
    return out


def straggler_findings(node: str, statuses: Sequence[dict]) -> list[Finding]:
    """The controllers' straggler verdicts about `node`, from the status of each TrainMover job
    running there (`runs/<job>/status.json`). Only `report` mode is a fault here: in `evict`
    mode the controller moves the node's ranks itself.

    Those files are written by the jobs' users, any of whom could name this node: as root this
    check runs only when the operator asks for it (`--straggler`; docs/security.md)."""
    out = []
    for st in statuses:
        if not isinstance(st, dict):
            continue
        verdict = st.get("straggler")
        if not isinstance(verdict, dict):
            continue
        if verdict.get("mode") == "report" and verdict.get("target") == node:
            out.append(Finding("straggler", False, f"job {st.get('job_id')}: {str(verdict.get('verdict', ''))[:200]}"))
    return out


STATUS_MAX_BYTES = 1 << 20  # a controller's status.json is a few KiB


def read_statuses(jobs: Sequence[tuple[int, str]]) -> list[dict]:
    """status.json of each (job id, work dir) that is a TrainMover job; others are skipped.
    The files are the jobs' users': read without following a final link, without blocking on
    a FIFO, at most STATUS_MAX_BYTES; anything odd (a list, bad JSON) is skipped, never raised."""
    import json
    from trainmover.protocol import files
    out = []
    for job, work_dir in jobs:
        path = Path(work_dir) / "runs" / str(job) / "status.json"
        try:
            status = json.loads(files.read_limited(path, STATUS_MAX_BYTES))
        except (OSError, ValueError, RecursionError):
            continue  # not a TrainMover job, or its status is being replaced: nothing to say
        if isinstance(status, dict):
            out.append(status)
    return out
