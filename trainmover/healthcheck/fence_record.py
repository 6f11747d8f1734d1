"""The ending job's fence record, read by the health check run as the node's Epilog (root).

A node whose process the controller judged dead is drained when the job's user may drain; when
not (the usual case) the job holds it until it ends (controller/fencing.py), and a hang is
nothing the GPU or kernel-log checks see. So at the job's end the Epilog (slurmd runs it as
root on each of the job's nodes, before the node is given back) runs the health check with
`--fence-record`: this check finds the node `held` in the job's `status.json`
(`fenced_nodes`) and the health check drains it with a reason naming the job and its user.

What is believed, and why it is safe: `status.json` is the job user's file, so it is a
request, not a fact. Only an entry naming *this* node counts, in the record of the job Slurm
says is ending here (SLURM_JOB_ID, SLURMD_NODENAME, never the file), found under the job's
working directory from Slurm (SLURM_JOB_WORK_DIR) and owned by the job's user (SLURM_JOB_UID),
each component opened without following a link. The most a user gets is a node their own job
was given drained at their job's end, with their job and uid in the reason: a right the admin
grants by installing the Epilog (docs/admin.md). A run directory set elsewhere (TM_RUN_DIR) is
not looked for: its node is not drained by this check.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from typing import Mapping, Optional

from trainmover.healthcheck.checks import Finding

NAME = "fenced"
MAX_BYTES = 1 << 20  # a status.json is a few kB; more is not read


@dataclass(frozen=True)
class JobEnd:
    """The ending job, as Slurm describes it to the Epilog."""
    job_id: int
    uid: int
    work_dir: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "JobEnd":
        """ValueError naming what is missing or malformed (healthcheck.sh passes these three)."""
        missing = [k for k in ("SLURM_JOB_ID", "SLURM_JOB_UID", "SLURM_JOB_WORK_DIR") if not env.get(k)]
        if missing:
            raise ValueError(f"--fence-record: not run as an Epilog ({', '.join(missing)} unset)")
        job, uid, work = env["SLURM_JOB_ID"], env["SLURM_JOB_UID"], env["SLURM_JOB_WORK_DIR"]
        if not (job.isdigit() and uid.isdigit() and os.path.isabs(work)):
            raise ValueError(f"--fence-record: malformed job {job!r}, uid {uid!r} or work dir {work!r}")
        return cls(int(job), int(uid), work)


class Untrusted(Exception):
    """The record is not the job user's plain file (a link, another owner, a FIFO)."""


def _open_below(dir_fd: int, name: str, uid: int, directory: bool) -> int:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link (or a file where a directory is)
            raise Untrusted(f"{name}: not a plain {'directory' if directory else 'file'} (a link?)") from exc
        raise
    st = os.fstat(fd)
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok or st.st_uid != uid:
        os.close(fd)
        raise Untrusted(f"{name}: {'not a plain file; ' if not kind_ok else ''}owner uid {st.st_uid}, "
                        f"the job's user is uid {uid}")
    return fd


def read_status(end: JobEnd) -> Optional[dict]:
    """The job's status.json (runs/<job>/status.json below its working directory), None where
    there is none; Untrusted where a component is a link or not the job user's."""
    try:
        top = os.open(end.work_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # Slurm's path
    except FileNotFoundError:
        return None
    fds = [top]
    try:
        for name, is_dir in (("runs", True), (str(end.job_id), True), ("status.json", False)):
            fds.append(_open_below(fds[-1], name, end.uid, is_dir))
        with os.fdopen(os.dup(fds[-1]), "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    finally:
        for fd in fds:
            os.close(fd)
    if len(raw) > MAX_BYTES:
        raise Untrusted(f"status.json: larger than {MAX_BYTES} bytes")
    try:
        record = json.loads(raw)
    except ValueError as exc:
        raise Untrusted(f"status.json: not JSON ({exc})") from exc
    return record if isinstance(record, dict) else None


def held_here(record: object, node: str) -> Optional[str]:
    """Why the job held `node` (its fence reason) if its record says so, else None. Pure."""
    fenced = record.get("fenced_nodes") if isinstance(record, dict) else None
    for entry in fenced if isinstance(fenced, list) else []:
        if isinstance(entry, dict) and entry.get("node") == node and entry.get("state") == "held":
            why = entry.get("reason")
            return why if isinstance(why, str) else "no reason given"
    return None


def findings(end: JobEnd, node: str) -> list[Finding]:
    """A fault (the node is drained) where the job held `node`; else a passing finding. What
    cannot be read is skipped, never a fault: a user's file must not decide anything else."""
    try:
        record = read_status(end)
    except (Untrusted, OSError) as exc:
        return [Finding(NAME, True, f"job {end.job_id}: fence record not read: {exc}", skipped=True)]
    if record is None:
        return [Finding(NAME, True, f"job {end.job_id}: no fence record", skipped=True)]
    why = held_here(record, node)
    if why is None:
        return [Finding(NAME, True, f"job {end.job_id} did not hold {node}")]
    # the user's text last and printable only: the reason stays one line, the job and uid first
    text = "".join(c if c.isprintable() else "?" for c in why)
    return [Finding(NAME, False, f"job {end.job_id} (uid {end.uid}) held this node after fencing it: {text}")]
