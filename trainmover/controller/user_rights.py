"""What the job's user may do to its job and nodes, as the controller learns it at its start:
from Slurm's records (slurm/rights.py), or, for a controller taking over, from what its
predecessor found (status.json, the job's own file in its private directory): asking Slurm
again costs 3-4 of the user's RPC tokens at every move of the controller, and a user's rights
do not change with its node.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from trainmover.errors import SlurmError

log = logging.getLogger("trainmover.controller")


def from_slurm(slurm, job_id: int, reservation: str, standbys: int, fencing) -> tuple[dict, str]:
    """(capabilities for status.json, the start error: "" when the job may start). Says what is
    missing and what follows in the log; sets what the fencing may do. A reservation that
    refuses the user, with standbys wanted, is the start error (not a standby request retried
    for ever)."""
    try:
        caps = slurm.capabilities(job_id, reservation)
    except SlurmError as exc:  # not known: try each action, and hold a fenced node whose drain fails
        log.warning("could not check what this job may do (%s): a fenced node is held if its drain fails", exc)
        return {"unknown": str(exc)[:300]}, ""
    fencing.may_drain, fencing.why_not = caps.drain, caps.why.get("drain", "")
    log.info("user %s may: grow %s, shrink %s, drain %s", caps.user,
             *("yes" if x else "no" for x in (caps.grow, caps.shrink, caps.drain)))
    for line in caps.consequences(standbys):
        log.warning("%s", line)
    return caps.as_status(), caps.start_error(standbys, reservation)


def from_predecessor(status_path: Path, fencing) -> dict | None:
    """The capabilities the previous controller found (None: ask Slurm)."""
    try:
        caps = json.loads(Path(status_path).read_text()).get("capabilities") or {}
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(caps, dict) or "unknown" in caps or not isinstance(caps.get("why"), dict) \
            or not all(isinstance(caps.get(k), bool) for k in ("grow", "shrink", "drain")):
        return None
    fencing.may_drain, fencing.why_not = caps["drain"], str(caps["why"].get("drain", ""))
    log.info("user %s may (as the previous controller found): grow %s, shrink %s, drain %s", caps.get("user"),
             *("yes" if caps[k] else "no" for k in ("grow", "shrink", "drain")))
    return caps
