"""What a controller that hands the job over on purpose leaves its successor: its record of the
job and the reservation's node list (`handover.json` in the job's private run directory).

Why: a successor that reads them from Slurm spends two of the user's RPC tokens at every move
of the controller (`scontrol show job`, `scontrol show reservation`), and a drain of the
controller's node comes with the migration's own RPCs and often with other jobs' of the same
user (docs/admin.md, "Load on slurmctld"). Nothing else resizes a running job, so the record
the predecessor kept is Slurm's (controller/resize.py).

When it may be used: the record is sealed with the job's key (nobody else wrote it), names
this job, and was written by the controller whose claim is the journal's last before the
successor's own (so no controller that might have resized the job came in between). It is
written only when no resize is under way, and taken once: the successor removes it before
acting, so a later takeover (after a crash) reads Slurm again.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from trainmover.controller.durable import journal
from trainmover.errors import ProtocolError, TrainMoverError
from trainmover.protocol import channel, files
from trainmover.slurm.model import JobInfo

log = logging.getLogger("trainmover.controller")

NAME = "handover.json"
_PURPOSE = "trainmover controller hand-over"


@dataclasses.dataclass(frozen=True)
class HandedOver:
    job: JobInfo
    pool_nodes: list[str] | None  # the reservation's nodes as the predecessor knew them (None: ask)


def leave(root: Path, key: bytes, *, attempt: int, job: JobInfo | None, pool_nodes: list[str] | None) -> None:
    """At a planned hand-over: the record for the successor, unless `job` is None (a resize
    under way); a failure to write only costs the successor its queries."""
    if job is None:
        return
    try:
        write(root, key, attempt=attempt, job=job, pool_nodes=pool_nodes)
    except OSError as exc:
        log.warning("hand-over record not written (the successor reads Slurm): %s", exc)


def for_successor(root: Path, job_id: int) -> HandedOver | None:
    """A resuming controller's look for the record, before its own claim in the journal (so
    that the journal's last claim is still the predecessor's); None: read Slurm."""
    try:
        key = channel.read_secret(str(Path(root) / "secret"))
        last_claim = journal.read(Path(root) / "journal.jsonl", key).restarts
    except (OSError, ValueError, TrainMoverError) as exc:
        log.info("no hand-over record used (%s): the job is read from Slurm", exc)
        return None
    handed = take(root, key, job_id=job_id, last_claim=last_claim)
    if handed is not None:
        log.info("the job's record and the standby pool's nodes as the previous controller left them: "
                 "not asked of Slurm again")
    return handed


def write(root: Path, key: bytes, *, attempt: int, job: JobInfo, pool_nodes: list[str] | None) -> None:
    body = {"attempt": int(attempt), "job": {**dataclasses.asdict(job), "nodes": list(job.nodes)},
            "pool_nodes": list(pool_nodes) if pool_nodes is not None else None}
    files.write_atomic(Path(root) / NAME, json.dumps(files.seal(key, _PURPOSE, body), sort_keys=True) + "\n")


def take(root: Path, key: bytes, *, job_id: int, last_claim: int) -> HandedOver | None:
    """The record a predecessor left, removed from the directory whatever it holds; None when
    there is none or it may not be used (the caller asks Slurm). `last_claim`: the attempt of the
    journal's last claim before ours (0: the first controller's)."""
    path = Path(root) / NAME
    try:
        raw = files.read_limited(path, 64 << 10)
    except OSError:
        return None
    try:
        os.unlink(path)
    except OSError as exc:  # left there, it could be taken again by a later takeover: refuse it now
        log.warning("%s not removed (%s): the job is read from Slurm", path, exc)
        return None
    try:
        body = files.unseal(key, _PURPOSE, json.loads(raw))
        if int(body["attempt"]) != last_claim:
            log.info("%s is of controller attempt %s, not %d's: the job is read from Slurm", path, body["attempt"],
                     last_claim)
            return None
        fields = {f.name for f in dataclasses.fields(JobInfo)}
        d = {k: v for k, v in body["job"].items() if k in fields}
        job = JobInfo(**{**d, "nodes": tuple(str(n) for n in d["nodes"]), "job_id": int(d["job_id"])})
        pool = body.get("pool_nodes")
        pool = [str(n) for n in pool] if isinstance(pool, list) else None
    except ProtocolError as exc:
        log.warning("%s ignored: %s", path, exc)
        return None
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("%s ignored (malformed: %s)", path, exc)
        return None
    if job.job_id != job_id or not job.running or not job.nodes:
        log.warning("%s ignored: it describes job %d (%s), not running job %d", path, job.job_id, job.state, job_id)
        return None
    return HandedOver(job, pool)
