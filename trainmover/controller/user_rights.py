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


def from_slurm(slurm, job_id: int, reservation: str, standbys: int, fencing,
               expansion_fix: str = "auto", in_job: int = 0) -> tuple[dict, str]:
    """(capabilities for status.json, the start error: "" when the job may start). Says what is
    missing and what follows in the log; sets what the fencing may do. No grow (a reservation
    that refuses the user, no permit_job_expansion, a slurmctld that job expansion crashes),
    with standbys wanted, is the start error (not a standby request retried for ever, nor the
    call that takes slurmctld down), unless the job brings standbys in its own allocation
    (`in_job`: TM_INJOB_STANDBYS; its pool mode is then in-job). `expansion_fix`:
    TM_SLURM_EXPANSION_FIX."""
    try:
        caps = slurm.capabilities(job_id, reservation, expansion_fix)
    except SlurmError as exc:  # not known: try each action, and hold a fenced node whose drain fails
        log.warning("could not check what this job may do (%s): a fenced node is held if its drain fails", exc)
        return {"unknown": str(exc)[:300]}, ""
    caps = caps.for_job(in_job)
    fencing.may_drain, fencing.why_not = caps.drain, caps.why.get("drain", "")
    log.info("user %s may: grow %s, shrink %s, drain %s", caps.user,
             *("yes" if x else "no" for x in (caps.grow, caps.shrink, caps.drain)))
    if caps.pool is not None:  # which pool mode this cluster gives the job, and why (slurm/pool_mode.py)
        log.info("%s", caps.pool.line())
    for line in caps.consequences(standbys, in_job):
        log.warning("%s", line)
    return caps.as_status(), caps.start_error(standbys, reservation, in_job)


def grow_refusal(caps: dict) -> str:
    """Why no standby may be taken by job expansion ("" when it may), from the capabilities in
    status.json's form. Not known (Slurm did not answer the check) is a refusal: the release
    could be one whose slurmctld the merge crashes."""
    if caps.get("grow") is True:
        return ""
    if caps.get("grow") is False:
        return str((caps.get("why") or {}).get("grow", "grow: no"))
    return (f"what this job may do is not known ({caps.get('unknown', 'not checked')}); no job expansion is made "
            "without knowing that slurmctld's release survives it")


def from_predecessor(status_path: Path, fencing) -> dict | None:
    """The capabilities the previous controller found (None: ask Slurm). Those of a controller
    that did not judge slurmctld's release (no `expansion`: an older TrainMover) are asked again."""
    try:
        caps = json.loads(Path(status_path).read_text()).get("capabilities") or {}
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(caps, dict) or "unknown" in caps or not isinstance(caps.get("why"), dict) \
            or not all(isinstance(caps.get(k), bool) for k in ("grow", "shrink", "drain")) \
            or not isinstance(caps.get("expansion"), dict):
        return None
    fencing.may_drain, fencing.why_not = caps["drain"], str(caps["why"].get("drain", ""))
    log.info("user %s may (as the previous controller found): grow %s, shrink %s, drain %s", caps.get("user"),
             *("yes" if caps[k] else "no" for k in ("grow", "shrink", "drain")))
    mode = caps.get("pool_mode") or {}
    if mode:
        log.info("standby mode: %s (%s)", mode.get("mode"), mode.get("why"))
    return caps
