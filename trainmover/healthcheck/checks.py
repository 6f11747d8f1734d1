"""Node checks. Each returns a list of Findings and reads the world only through its
arguments, so tests can hand it a fake filesystem or NVML."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

INJECT_PREFIX = "inject-fault-"


@dataclass(frozen=True)
class Finding:
    check: str       # "disk", "gpu", "inject", ...
    ok: bool
    detail: str
    skipped: bool = False

    def line(self) -> str:
        status = "skipped" if self.skipped else ("ok" if self.ok else "FAULT")
        return f"{self.check}: {status}: {self.detail}"


def inject_path(state_dir: Path, node: str) -> Path:
    return Path(state_dir) / f"{INJECT_PREFIX}{node}"


def check_injected(state_dir: Path, node: str) -> list[Finding]:
    """The test hook: a file <state dir>/inject-fault-<node> makes the check fail; its
    first line (if any) is the fault's description."""
    path = inject_path(state_dir, node)
    try:
        text = path.read_text(errors="replace").strip()
    except FileNotFoundError:
        return []
    except OSError as exc:
        return [Finding("inject", False, f"{path} exists but cannot be read ({exc})")]
    what = text.splitlines()[0][:120] if text else "injected fault"
    return [Finding("inject", False, f"{what} (fault injected by {path})")]


def check_disk(paths: Sequence[str], min_free_gb: float,
               usage: Callable[[str], "shutil._ntuple_diskusage"] = shutil.disk_usage) -> list[Finding]:
    out = []
    for p in paths:
        try:
            u = usage(p)
        except OSError as exc:
            out.append(Finding("disk", False, f"{p}: cannot stat ({exc.strerror or exc})"))
            continue
        free_gb = u.free / 1e9
        ok = free_gb >= min_free_gb
        out.append(Finding("disk", ok, f"{p}: {free_gb:.1f} GB free (minimum {min_free_gb:g} GB)"))
    return out


def straggler_findings(node: str, statuses: Sequence[dict]) -> list[Finding]:
    """The controllers' straggler verdicts about `node`, from the status of each TrainMover job
    running there (`runs/<job>/status.json`). Only `report` mode is a fault here: in `evict`
    mode the controller moves the node's ranks itself."""
    out = []
    for st in statuses:
        verdict = st.get("straggler") or {}
        if verdict.get("mode") == "report" and verdict.get("target") == node:
            out.append(Finding("straggler", False, f"job {st.get('job_id')}: {verdict.get('verdict', '')}"))
    return out


def read_statuses(jobs: Sequence[tuple[int, str]]) -> list[dict]:
    """status.json of each (job id, work dir) that is a TrainMover job; others are skipped."""
    import json
    out = []
    for job, work_dir in jobs:
        path = Path(work_dir) / "runs" / str(job) / "status.json"
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # not a TrainMover job, or its status is being replaced: nothing to say
    return out
