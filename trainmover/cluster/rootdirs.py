"""Root's state directories (the embedded cluster's state directory, the address-block registry,
the parent of the users' homes, the demo's submit directories): most live under /var/tmp, where
any local user can create a name first. A user who made `/var/tmp/trainmover-cluster` (or a link
by that name) before root's first `cluster up` would have root write through their links and
load their cluster.json, whose `root` names the file system the daemons run chrooted in
(issue 37). So, as OpenSSH's StrictModes does for a key file:

    own_dir(path, mode)   make `path` ours with `mode` (0700 unless others must pass through it),
                          or accept an existing one only if check_dir does
    check_dir(path)       a real directory (lstat: no link), ours, not writable by group or others,
                          under directories only root or we own and others cannot write into
                          (sticky /tmp and /var/tmp allowed): else UnsafeDir, naming the path,
                          its owner and mode, and what to do
    read_own(path)        a file there: never through a link, never blocking on a FIFO, ours and
                          not writable by group or others, bounded (what root believes)
    write_own(path, data) a file there, 0600 (cluster.json holds the database password),
                          atomically and never through a link (trainmover.protocol.files)

"Ours" is the effective uid: root when root runs the cluster, as it must.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from trainmover.cluster.procs import ClusterError
from trainmover.protocol import files

MAX_FILE_BYTES = 1 << 20  # cluster.json is a few hundred bytes


class UnsafeDir(ClusterError):
    """A directory or file of root's that another user could have made or can change."""


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"


def _refuse(path: Path, st: os.stat_result, why: str) -> UnsafeDir:
    return UnsafeDir(
        f"{path} {why} ({_describe(st)}): root keeps its state only where no other user could have made or "
        f"can change it (a user may have planted it). Check what it holds, remove it (rm -r {path}) or "
        f"choose another directory (--dir or $TM_CLUSTER_DIR for a cluster), then run the command again")


def _writable_by_others(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _check_ancestors(top: Path, below: Path) -> None:
    """`top` and each directory above it, as written and as resolved, are root's or ours and not
    writable by others unless sticky (then nobody else can rename what lies `below` away); a link
    on the way must be root's or ours (another user could point it elsewhere at any time)."""
    me = os.geteuid()
    real = Path(os.path.realpath(top))
    for chain in ([top, *top.parents], [real, *real.parents]):
        for d in chain:
            st = os.lstat(d)
            if st.st_uid not in (0, me):
                raise _refuse(d, st, f"(above {below}) belongs to another user")
            if stat.S_ISLNK(st.st_mode):
                continue  # root's or ours; its target is judged in the resolved chain
            if _writable_by_others(st) and not st.st_mode & stat.S_ISVTX:
                raise _refuse(d, st, f"(above {below}) is writable by group or others and not sticky")


def check_dir(path: os.PathLike | str) -> Path:
    """`path` if root (we) may trust it (see the module's docstring); UnsafeDir otherwise,
    FileNotFoundError when it does not exist."""
    path = Path(os.path.abspath(path))
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, st, f"is a symbolic link (to {os.readlink(path)}), not a directory")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, st, "is not a directory")
    if st.st_uid != os.geteuid():
        raise _refuse(path, st, f"belongs to uid {st.st_uid}, not to uid {os.geteuid()} who runs this")
    if _writable_by_others(st):
        raise _refuse(path, st, "is writable by group or others")
    _check_ancestors(path.parent, path)
    return path


def own_dir(path: os.PathLike | str, mode: int = 0o700) -> Path:
    """`path`, made with `mode` (and its missing parents 0755) when absent, else checked as it is
    (check_dir; its mode is left alone). `mode`: 0755 where other users pass through (the
    cluster's etc/ holds the slurm.conf their jobs read; their homes lie under HOMES)."""
    path = Path(os.path.abspath(path))
    if not os.path.lexists(path):
        # nothing made under a directory someone else controls: judge what exists first
        _check_ancestors(next(p for p in path.parents if os.path.lexists(p)), path)
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        try:
            os.mkdir(path, mode)
            os.chmod(path, mode)  # the umask may have taken bits off; ours, just made: no link
        except FileExistsError:
            pass  # made at the same moment: judged below like any existing one
    return check_dir(path)


def read_own(path: os.PathLike | str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The text of `path` if it is a regular file of ours that group and others cannot write,
    opened without following a link or blocking on a FIFO; UnsafeDir otherwise,
    FileNotFoundError when it does not exist."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, os.lstat(path), "is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, st, "is not a regular file")
        if st.st_uid != os.geteuid() or _writable_by_others(st):
            raise _refuse(path, st, "could have been written by another user")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafeDir(f"{path}: more than {max_bytes} bytes; not read")
    return data.decode()


def write_own(path: os.PathLike | str, data: str | bytes) -> None:
    """`path` replaced by `data`, 0600, atomically, never through a link."""
    files.write_atomic(Path(path), data)
