"""Pure parsers for Slurm 22.05 command output (text and --json) and hostlists.

No processes here: tests feed recorded outputs (tests/unit/test_slurm_parse.py).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Iterable

from trainmover.errors import SlurmError
from trainmover.slurm.model import JobInfo, NodeInfo

__all__ = [
    "parse_kv", "parse_nodes_text", "parse_job_text", "parse_reservation_text", "parse_nodes_json",
    "parse_jobs_json", "expand_hostlist", "parse_salloc_job_id",
]

# `scontrol -o show ...` prints `Key=value` pairs separated by spaces; a value may
# itself hold spaces (OS=Linux 6.1 #1 SMP, Reason=disk bad [root@...]). A key
# starts after whitespace and is made of letters, digits, '_', ':' and '/'
# (ReqB:S:C:T, CPUs/Task).
_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")
_NULL = {"(null)", "N/A", "None", ""}


def parse_kv(line: str) -> dict[str, str]:
    """Split one `scontrol -o show` line into its fields (values stripped)."""
    matches = list(_KEY.finditer(line))
    out: dict[str, str] = {}
    for m, nxt in zip(matches, matches[1:] + [None]):
        end = nxt.start() if nxt else len(line)
        out.setdefault(m.group(1), line[m.end():end].strip())
    return out


def _null(v: str | None) -> str:
    return "" if v is None or v.strip() in _NULL else v.strip()


def _int(v: str | None, default: int = 0) -> int:
    m = re.match(r"\s*(\d+)", v or "")
    return int(m.group(1)) if m else default


_REASON_STAMP = re.compile(r"\s*\[[^\]]*@[^\]]*\]\s*$")


def _reason(v: str | None) -> str:
    """'disk bad [root@2026-11-21T10:27:50]' -> 'disk bad'."""
    return _REASON_STAMP.sub("", _null(v))


def parse_nodes_text(text: str) -> dict[str, NodeInfo]:
    """Parse `scontrol -o show node [list]` (one node a line)."""
    out = {}
    for line in text.splitlines():
        if not line.startswith("NodeName="):
            continue
        kv = parse_kv(line)
        name = kv["NodeName"]
        out[name] = NodeInfo(
            name=name, addr=_null(kv.get("NodeAddr")) or name, state=kv.get("State", "UNKNOWN").upper(),
            reason=_reason(kv.get("Reason")),
            features=tuple(f for f in (_null(kv.get("ActiveFeatures")) or "").split(",") if f),
        )
    return out


def parse_job_text(text: str) -> JobInfo:
    """Parse `scontrol -o show job J` (the first line; later lines are further
    components of an array or heterogeneous job)."""
    line = next((ln for ln in text.splitlines() if ln.startswith("JobId=")), None)
    if line is None:
        raise SlurmError(f"no job in scontrol output: {text[:200]!r}")
    kv = parse_kv(line)
    nodelist = _null(kv.get("NodeList"))
    return JobInfo(
        job_id=_int(kv.get("JobId")),
        state=kv.get("JobState", "UNKNOWN"),
        nodes=tuple(expand_hostlist(nodelist)),
        batch_host=_null(kv.get("BatchHost")),
        restart_count=_int(kv.get("Restarts")),
        work_dir=_null(kv.get("WorkDir")),
        partition=_null(kv.get("Partition")),
        num_nodes=_int(kv.get("NumNodes")),
        nodelist=nodelist,
        name=_null(kv.get("JobName")),
        reason=_null(kv.get("Reason")),
    )


def parse_reservation_text(text: str) -> dict[str, dict[str, str]]:
    """Parse `scontrol -o show reservation [name]` into {name: fields}."""
    out = {}
    for line in text.splitlines():
        if line.startswith("ReservationName="):
            kv = parse_kv(line)
            out[kv["ReservationName"]] = kv
    return out


def _json(text: str, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmError(f"{what} --json printed invalid JSON ({exc}): {text[:200]!r}") from exc
    errors = doc.get("errors") or []
    if errors:
        raise SlurmError(f"{what} --json reported errors: {errors}")
    return doc


def parse_nodes_json(text: str) -> dict[str, NodeInfo]:
    """Parse `sinfo --json` (22.05: every node, whatever -n says)."""
    out = {}
    for n in _json(text, "sinfo").get("nodes", []):
        state = str(n.get("state", "unknown")).upper()
        flags = [str(f).upper() for f in n.get("state_flags") or []]
        out[n["name"]] = NodeInfo(
            name=n["name"], addr=n.get("address") or n["name"], state="+".join([state, *flags]),
            reason=_reason(n.get("reason")),
        )
    return out


def parse_jobs_json(text: str) -> dict[int, JobInfo]:
    """Parse `squeue --json` (22.05: every job the controller still holds, whatever -j says)."""
    out = {}
    for j in _json(text, "squeue").get("jobs", []):
        nodelist = _null(j.get("nodes"))
        out[int(j["job_id"])] = JobInfo(
            job_id=int(j["job_id"]),
            state=str(j.get("job_state", "UNKNOWN")),
            nodes=tuple(expand_hostlist(nodelist)),
            batch_host=_null(j.get("batch_host")),
            restart_count=int(j.get("restart_cnt") or 0),
            work_dir=_null(j.get("current_working_directory")),
            partition=_null(j.get("partition")),
            num_nodes=int(j.get("node_count") or 0),
            nodelist=nodelist,
            name=_null(j.get("name")),
            reason=_null(j.get("state_reason")),
        )
    return out


def _split_top(expr: str) -> list[str]:
    """Split on commas outside brackets: 'a[1,3],b' -> ['a[1,3]', 'b']."""
    parts, depth, cur = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"unbalanced ']' in hostlist {expr!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise SlurmError(f"unbalanced '[' in hostlist {expr!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _range(spec: str, expr: str) -> list[str]:
    out = []
    for item in spec.split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SlurmError(f"bad range {item!r} in hostlist {expr!r}")
        width = len(lo)
        for i in range(int(lo), int(hi or lo) + 1):
            out.append(str(i).zfill(width))
    return out


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist ('spare1,train[1-3,05]', 'r[1-2]n[1-2]') in order,
    as `scontrol show hostnames` does (without sorting)."""
    names: list[str] = []
    for part in _split_top(_null(expr)):
        pieces = re.split(r"\[([^\]]*)\]", part)  # literal, range, literal, range, ...
        choices: list[Iterable[str]] = []
        for i, piece in enumerate(pieces):
            choices.append(_range(piece, expr) if i % 2 else [piece])
        names.extend("".join(c) for c in itertools.product(*choices))
    return names


_SALLOC_ID = re.compile(r"(?:Granted|Pending) job allocation (\d+)")


def parse_salloc_job_id(stderr: str) -> int | None:
    """The job id salloc announced ('Granted job allocation 8' or 'Pending job allocation 14')."""
    m = _SALLOC_ID.search(stderr or "")
    return int(m.group(1)) if m else None


def salloc_granted(stderr: str) -> bool:
    return "Granted job allocation" in (stderr or "")
