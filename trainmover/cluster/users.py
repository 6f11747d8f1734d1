"""The embedded cluster's ordinary (unprivileged) users, the same on the host and in every
Slurm root filesystem a cluster runs from.

    ensure_host()          # creates JOB_USER and OTHER_USER on the host when missing (idempotent)
    ensure_root(root)      # the same names, uids and gids in a root filesystem's /etc/passwd and /etc/group

JOB_USER submits the test and demo jobs; OTHER_USER is a second user (the hostile-user
tests: another user's job and files must be out of its reach). Neither is a Slurm operator
or admin: only root drains nodes, as on a production cluster (docs/admin.md).

A root filesystem's slurmd resolves the job's uid in that root (it starts the job's steps
there), so a user must have the same uid and gid in the root as on the host: the users are
made with fixed preferred ids (the first free from PREFERRED_UID down on the host and in
every root present) and copied into a root with `useradd --root` at those ids.
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from trainmover.cluster import install, rootdirs
from trainmover.cluster.procs import ClusterError, run_cmd

JOB_USER = "tmuser"      # the user whose jobs the tests submit
OTHER_USER = "tmother"   # another ordinary user (hostile-user tests)
USERS = (JOB_USER, OTHER_USER)
# Fixed ids, high in the system range: Debian packages take system ids from 100 up, so the
# same number is free in the host and in a fresh root filesystem (checked, not assumed).
PREFERRED_UID = 940
NOLOGIN = "/usr/sbin/nologin"
# Homes under /var/tmp: bound into every root filesystem at the same path (rootfs.binds), so a
# job's $HOME (torch's caches) works on every node; made again when /var/tmp was cleaned.
HOMES = Path("/var/tmp/trainmover-users")
_TIMEOUT = 30.0


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: str


def _parse_ids(path: Path) -> dict[str, int]:
    """name -> id of an /etc/passwd or /etc/group file ({} when missing)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}
    out = {}
    for line in lines:
        fields = line.split(":")
        if len(fields) >= 3 and fields[2].isdigit():
            out[fields[0]] = int(fields[2])
    return out


def free_id(taken: Iterable[int], start: int = PREFERRED_UID, low: int = 500) -> int:
    """The first id from `start` down that none of `taken` uses."""
    used = set(taken)
    for i in range(start, low - 1, -1):
        if i not in used:
            return i
    raise ClusterError(f"no free system id between {low} and {start} for the cluster's users")


def host_account(name: str) -> Optional[Account]:
    try:
        p = pwd.getpwnam(name)
    except KeyError:
        return None
    return Account(name, p.pw_uid, p.pw_gid, p.pw_dir)


def _useradd() -> tuple[str, str]:
    useradd, groupadd = install.which("useradd"), install.which("groupadd")
    if not useradd or not groupadd:
        raise ClusterError("useradd/groupadd missing (Debian package passwd): cannot create the cluster's users")
    return useradd, groupadd


def ensure_host(roots: Iterable[Path] = (), log: Callable[[str], None] = lambda _m: None) -> list[Account]:
    """JOB_USER and OTHER_USER on the host, created when missing (no home, no login shell);
    new ids are free in the host and in `roots` too. Needs root to create."""
    out = []
    for name in USERS:
        acct = host_account(name)
        if acct is None:
            if os.geteuid() != 0:
                raise ClusterError(f"user {name} is missing and only root can create it")
            useradd, groupadd = _useradd()
            uids = {p.pw_uid for p in pwd.getpwall()} | {u for r in roots for u in _parse_ids(r / "etc/passwd").values()}
            gids = {g.gr_gid for g in grp.getgrall()} | {g for r in roots for g in _parse_ids(r / "etc/group").values()}
            i = free_id(uids | gids)
            try:
                gid = grp.getgrnam(name).gr_gid
            except KeyError:
                run_cmd([groupadd, "--system", "--gid", str(i), name], timeout=_TIMEOUT, what=f"groupadd {name}")
                gid = i
            run_cmd([useradd, "--system", "--no-create-home", "--home-dir", str(HOMES / name), "--shell", NOLOGIN,
                     "--uid", str(i), "--gid", str(gid), "--comment", "TrainMover test user", name],
                    timeout=_TIMEOUT, what=f"useradd {name}")
            log(f"created user {name} (uid {i})")
            acct = host_account(name)
            if acct is None:
                raise ClusterError(f"useradd {name} succeeded but the user is not visible")
        _ensure_home(acct)
        out.append(acct)
    return out


def _ensure_home(acct: Account) -> None:
    """The user's home (0700, theirs) when it lies under HOMES and is missing. HOMES is root's
    (0755: the users pass through it to their homes); one another user made first, or a link,
    is refused (rootdirs) before anything is made or chowned in it."""
    home = Path(acct.home)
    if home.parent != HOMES or os.geteuid() != 0:
        return
    rootdirs.own_dir(HOMES, mode=0o755)
    if os.path.lexists(home):
        return
    home.mkdir(mode=0o700)
    os.chown(home, acct.uid, acct.gid)


def ensure_root(root: Path, accounts: Iterable[Account], log: Callable[[str], None] = lambda _m: None) -> None:
    """The host's `accounts` in root filesystem `root` at the same uid and gid (slurmd there
    starts the job's steps by uid). Raises ClusterError when a name or id is taken there by
    another one (never silently a different uid)."""
    for acct in accounts:
        users, groups = _parse_ids(root / "etc/passwd"), _parse_ids(root / "etc/group")
        if users.get(acct.name) == acct.uid and acct.gid in groups.values():
            continue
        if acct.name in users:
            raise ClusterError(f"user {acct.name} has uid {users[acct.name]} in {root} but {acct.uid} on the host")
        clash = [n for n, u in users.items() if u == acct.uid]
        if clash:
            raise ClusterError(f"uid {acct.uid} of {acct.name} is taken by {clash[0]} in {root}")
        useradd, groupadd = _useradd()
        if acct.gid not in groups.values():
            if acct.name in groups:
                raise ClusterError(f"group {acct.name} has gid {groups[acct.name]} in {root} but {acct.gid} on the host")
            run_cmd([groupadd, "--root", str(root), "--system", "--gid", str(acct.gid), acct.name],
                    timeout=_TIMEOUT, what=f"groupadd {acct.name} in {root}")
        run_cmd([useradd, "--root", str(root), "--system", "--no-create-home", "--home-dir", acct.home,
                 "--shell", NOLOGIN, "--uid", str(acct.uid), "--gid", str(acct.gid), acct.name],
                timeout=_TIMEOUT, what=f"useradd {acct.name} in {root}")
        log(f"user {acct.name} (uid {acct.uid}) added to {root}")


def ensure(root: Optional[Path], log: Callable[[str], None] = lambda _m: None) -> list[Account]:
    """The users on the host and, for a cluster running from a root filesystem, in `root`."""
    accounts = ensure_host([root] if root else [], log)
    if root:
        ensure_root(root, accounts, log)
    return accounts
