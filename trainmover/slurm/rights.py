"""What the job's user may do to the job and the cluster, decided from Slurm's own records
before the job relies on it: take standbys from the reservation (grow), give nodes back
(shrink), drain a node (fence). Pure: `CliSlurm.capabilities()` gathers the facts (one
`scontrol show config`, the reservation, AdminLevel where accounting runs) and `decide()`
judges them, so that a refusal is said at start, with its reason, instead of seen later as a
failed command.

Slurm's rules, as used here:
* drain: root, the SlurmUser, or an AdminLevel of Operator/Administrator in the accounting
  database (`scontrol update nodename=... state=drain` is refused to anyone else: "Invalid
  user id").
* shrink: the owner of a job may always reduce it (`scontrol update jobid=... nodelist=...`).
* grow: needs SchedulerParameters=permit_job_expansion (a donor job merged into the job), a
  slurmctld release whose job expansion does not crash it (slurm/expansion_safety.py: 25.11.0-
  25.11.7 and 26.05.0-26.05.4 die with SIGSEGV at every merge) or that the site's admin declares
  fixed (slurm/expansion_fix.py), and a reservation that admits the user: every one of its
  Users=, Accounts= and Groups= that is set must admit them (a leading '-' excludes: Users=-bob
  admits everyone but bob). The release is judged before the reservation: a refusal on an
  unsafe release must be said even where the reservation would also refuse.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Optional

from trainmover.slurm import pool_mode
from trainmover.slurm.expansion_fix import Declaration
from trainmover.slurm.expansion_safety import expansion_verdict

DRAIN_LEVELS = ("operator", "administrator")
EXPANSION_OFF = "SchedulerParameters lacks permit_job_expansion: Slurm cannot merge a node into a job"
# What stops grow (Capabilities.grow_blocked_by), and what the job's user can ask for.
ADVICE = {
    "slurm.conf": "Ask an admin to add permit_job_expansion to SchedulerParameters (docs/admin.md)",
    "release": ("Ask an admin to upgrade Slurm, or to apply the fix and declare it in trainmover-expansion-fix "
                "beside slurm.conf (docs/admin.md, the table at the top)"),
    "reservation": "Ask an admin to admit user {user} to reservation {reservation} (Users= or Accounts=)",
}


@dataclass(frozen=True)
class Facts:
    """What Slurm says about the job's user, the cluster and the reservation."""

    user: str
    uid: int
    groups: tuple[str, ...] = ()
    account: str = ""
    slurm_user: str = "root"                 # scontrol show config: SlurmUser (name)
    scheduler_parameters: str = ""
    admin_level: Optional[str] = None        # sacctmgr's AdminLevel; None: not known there
    accounting: bool = False                 # whether a slurmdbd keeps AdminLevels at all
    reservation: str = ""
    reservation_fields: Optional[Mapping[str, str]] = None  # None: the reservation does not exist
    reservation_error: str = ""              # why it could not be read
    slurm_version: str = ""                  # scontrol show config: SLURM_VERSION, slurmctld's own release
    expansion_fix: Declaration = Declaration()  # the admin's declaration of a fixed release


@dataclass(frozen=True)
class Capabilities:
    user: str
    grow: bool
    shrink: bool
    drain: bool
    why: dict = field(default_factory=dict)  # capability -> why it is missing
    grow_blocked_by: str = ""                # "" (grow: yes) or a key of ADVICE
    expansion: dict = field(default_factory=dict)  # {slurm, safe, why}: the release's verdict
    pool: Optional[pool_mode.PoolMode] = None  # where the job's standbys come from (pool_mode.py)

    def as_status(self) -> dict:
        return {"user": self.user, "grow": self.grow, "shrink": self.shrink, "drain": self.drain, "why": dict(self.why),
                **({"expansion": dict(self.expansion)} if self.expansion else {}),
                **({"pool_mode": self.pool.as_status()} if self.pool else {})}

    def for_job(self, in_job: int) -> "Capabilities":
        """These capabilities for a job that brings `in_job` standbys in its own allocation
        (TM_INJOB_STANDBYS): where grow is blocked its pool mode is in-job (pool_mode.with_in_job)."""
        if self.pool is None or not in_job:
            return self
        return dataclasses.replace(self, pool=pool_mode.with_in_job(self.pool, in_job))

    def start_error(self, standbys: int, reservation: str, in_job: int = 0) -> str:
        """Why a job that wants `standbys` cannot start ('' when it can): it could never take one
        and brings none in its own allocation (`in_job`: TM_INJOB_STANDBYS)."""
        if self.grow or not standbys or in_job:
            return ""
        advice = ADVICE.get(self.grow_blocked_by, ADVICE["reservation"]).format(user=self.user, reservation=reservation)
        # the user's own way out, with no admin: in-job standbys need no expansion (docs/admin.md, the top)
        return (f"cannot take standbys: {self.why['grow']}. {advice}; or bring standbys in the job's own "
                f"allocation: {standbys} more node(s) at submit and TM_INJOB_STANDBYS={standbys}; or set "
                "TM_STANDBYS=0 to run without migration")

    def consequences(self, standbys: int, in_job: int = 0) -> list[str]:
        """One line per missing capability: what is missing and what follows for this job."""
        out = []
        if not self.grow:
            follows = (f"the job uses the {in_job} standby(s) it brought in its own allocation (TM_INJOB_STANDBYS) "
                       "and takes none from the reservation: once they are used, a drain waits with the job "
                       "training on the drained node and a failure goes to the next recovery tier" if in_job
                       else "the job cannot take standbys: no migration or recovery is possible" if standbys
                       else "not needed: TM_STANDBYS=0")
            out.append(f"grow: no ({self.why.get('grow', '')}); {follows}")
        if not self.shrink:
            out.append(f"shrink: no ({self.why.get('shrink', '')}); a node that left keeps its place in the job")
        if not self.drain:
            out.append(f"drain: no ({self.why.get('drain', '')}); a fenced node is not drained but held in the job, "
                       "out of training and of the standby pool, until the job ends (docs/recovery.md)")
        return out


def _admits(spec: str, names: Iterable[str]) -> Optional[bool]:
    """Whether a reservation list (Users=a,b / Users=-a) admits any of `names`; None when unset."""
    items = [x for x in (spec or "").split(",") if x and x != "(null)"]
    if not items:
        return None
    names = set(names)
    if all(x.startswith("-") for x in items):
        return not names & {x[1:] for x in items}
    return bool(names & {x.lstrip("-") for x in items if not x.startswith("-")})


def reservation_refusal(f: Facts) -> str:
    """Why the reservation refuses the user ('' when it admits them)."""
    if f.reservation_fields is None:
        return f"reservation {f.reservation} not found" + (f" ({f.reservation_error})" if f.reservation_error else "")
    r = f.reservation_fields
    checks = (("Users", [f.user]), ("Accounts", [f.account] if f.account else []), ("Groups", list(f.groups)))
    for key, names in checks:
        if _admits(r.get(key, ""), names) is False:
            return f"reservation {f.reservation} has {key}={r.get(key)}, which does not admit {f.user}" + (
                f" (account {f.account})" if key == "Accounts" else "")
    if all(_admits(r.get(k, ""), n) is None for k, n in checks):
        return f"reservation {f.reservation} names no users, accounts or groups"
    return ""


def decide(f: Facts) -> Capabilities:
    why = {}
    level = (f.admin_level or "").lower()
    drain = f.uid == 0 or f.user == f.slurm_user or level in DRAIN_LEVELS
    if not drain:
        why["drain"] = (f"{f.user} is not root, not the SlurmUser ({f.slurm_user}) and "
                        + (f"has AdminLevel {f.admin_level}" if f.admin_level is not None
                           else "not in the accounting database" if f.accounting
                           else "there is no accounting database to make it an operator"))
    pool, expansion = choose_pool(f.scheduler_parameters, f.slurm_version, f.expansion_fix, f.reservation,
                                  reservation_refusal(f))
    if pool.blocked_by:
        why["grow"] = pool.refusal
    return Capabilities(f.user, not pool.blocked_by, True, drain, why, pool.blocked_by, expansion, pool)


def choose_pool(scheduler_parameters: str, slurm_version: str, declaration: Declaration, reservation: str,
                refusal: Optional[str], in_job: int = 0) -> tuple[pool_mode.PoolMode, dict]:
    """The pool mode (pool_mode.choose) and the release's verdict ({slurm, safe, why}) from
    slurm.conf's SchedulerParameters, slurmctld's release, the admin's declaration, the
    reservation's refusal (None: not checked, as at submit) and the job's in-job standbys."""
    release = expansion_verdict(slurm_version, declaration.covers(slurm_version))
    note = "" if release.safe else declaration.note()
    pool = pool_mode.choose(expansion_permitted="permit_job_expansion" in scheduler_parameters.split(","),
                            release_safe=release.safe, release_why=release.reason + (f"; {note}" if note else ""),
                            reservation=reservation, reservation_refusal=refusal, expansion_off_why=EXPANSION_OFF,
                            in_job=in_job)
    return pool, {"slurm": slurm_version, "safe": release.safe, "why": release.reason}


def parse_config(text: str) -> dict[str, str]:
    """`scontrol show config` ('Key    = Value' lines) -> {Key: Value}."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def slurm_user_name(value: str) -> str:
    """'root(0)' or 'slurm(64030)' -> the name."""
    return value.split("(", 1)[0].strip()


def parse_admin_level(text: str) -> Optional[str]:
    """`sacctmgr -nP show user NAME format=AdminLevel` -> 'None'/'Operator'/'Administrator';
    None when the user is not in the database (no association: no level)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0].split("|")[0] if lines else None
