"""Pure parsers for the Slurm command output TrainMover reads, and hostlists.

The CLI backend reads `scontrol -o show node|job|reservation` text, whose keys are the
same in Slurm 22.05, 24.11 and 26.05 (recorded lines of each release are parsed in
tests/unit/test_slurm_parse.py; tests/e2e/test_slurm_contract.py runs against each).
It reads no `--json` output: 22.05's `sinfo/squeue --json` ignore `-n`/`-j`, 24.11
changed its shape (`job_state` a list, `node_count` an object, no `nodes` list in
`sinfo --json`) and its data_parser versions differ by release (v0.0.40-42 in 24.11,
v0.0.42-45 in 26.05), while the text answered every question the same way.

No processes here: tests feed recorded outputs.
"""

from __future__ import annotations

import itertools
import re
from typing import Iterable

from trainmover.errors import SlurmError
from trainmover.slurm.model import JobInfo, NodeInfo

__all__ = [
    "parse_kv", "parse_nodes_text", "parse_job_text", "parse_reservation_text", "expand_hostlist",
    "parse_salloc_job_id", "salloc_granted",
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


# The job's own free text (JobName, the 2nd field; Command, WorkDir, Comment, StdOut... at the
# end) may hold "Key=value" look-alikes: a job named `x NodeList=evil[1-2] BatchHost=evil1` must
# not move where TrainMover thinks the job runs. Slurm prints JobName right before this run of
# fields, in this order, in every release:
_AFTER_NAME = ("UserId", "GroupId", "MCS_label")
_TAIL_KEYS = ("WorkDir",)  # the free-text fields read from the end of the line


def parse_job_fields(line: str) -> dict[str, str]:
    """The fields of one `scontrol -o show job` line, none taken from the job's own free text:
    JobName ends where the one run UserId= GroupId= MCS_label= starts; every other field is its
    first occurrence after that (the free-text fields Command, WorkDir, StdOut... come after
    all of Slurm's own), WorkDir must occur there once, and Account= (the user's pick, printed
    before Slurm's own fields) must be followed by QOS=. A line where the job's text imitates
    that run, WorkDir or a field after Account cannot be read safely: SlurmError, never a guess."""
    matches = list(_KEY.finditer(line))
    keys = [m.group(1) for m in matches]
    runs = [i for i in range(len(keys) - 2) if tuple(keys[i:i + 3]) == _AFTER_NAME]
    if len(runs) != 1 or keys[:2] != ["JobId", "JobName"]:
        raise SlurmError(f"job line not in Slurm's field order (the job's name or text imitates it?): {line[:200]!r}")
    start = runs[0]
    # Account= is the one value a user picks (sbatch --account) that Slurm prints between that run
    # and its own fields (NodeList, BatchHost...); QOS= always follows it. Anything between them
    # is the account's text imitating a field.
    if "Account" in keys[start:] and keys[keys.index("Account", start) + 1:][:1] != ["QOS"]:
        raise SlurmError(f"job line: its Account= is not followed by QOS= (the account's text imitates a field?): "
                         f"{line[:200]!r}")
    out = {"JobId": line[matches[0].end():matches[1].start()].strip(),
           "JobName": line[matches[1].end():matches[start].start()].strip()}
    later = matches[start:]
    for m, nxt in zip(later, later[1:] + [None]):
        key = m.group(1)
        value = line[m.end():nxt.start() if nxt else len(line)].strip()
        if key in _TAIL_KEYS and key in out:
            raise SlurmError(f"job line holds {key}= twice after its name (its command or output path imitates "
                             f"a field?): {line[:200]!r}")
        out.setdefault(key, value)
    return out


def parse_job_text(text: str) -> JobInfo:
    """Parse `scontrol -o show job J` (the first line; later lines are further
    components of an array or heterogeneous job). No field comes from the job's own
    name, comment or command (parse_job_fields)."""
    line = next((ln for ln in text.splitlines() if ln.startswith("JobId=")), None)
    if line is None:
        raise SlurmError(f"no job in scontrol output: {text[:200]!r}")
    kv = parse_job_fields(line)
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
        user_id=_uid(kv.get("UserId")),
    )


def _uid(value: str | None) -> int:
    """The uid of Slurm's `UserId=alice(1000)`; -1 where it does not say."""
    m = re.fullmatch(r"[^()\s]*\((\d+)\)", value or "")
    return int(m.group(1)) if m else -1


def parse_reservation_text(text: str) -> dict[str, dict[str, str]]:
    """Parse `scontrol -o show reservation [name]` into {name: fields}."""
    out = {}
    for line in text.splitlines():
        if line.startswith("ReservationName="):
            kv = parse_kv(line)
            out[kv["ReservationName"]] = kv
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


_SALLOC_READY = re.compile(r"^salloc: Nodes (\S+) are ready for job", re.M)


def salloc_ready_node(stderr: str) -> str | None:
    """The one node salloc said is ready ('Nodes spare1 are ready for job'); None when it did
    not say, or named a list (a hostlist expression: the caller asks Slurm instead)."""
    m = _SALLOC_READY.search(stderr or "")
    return m.group(1) if m and not any(c in m.group(1) for c in "[],") else None
