"""Drain notices: the push path from a drain that TrainMover itself makes (its health check,
`trainmover drain`) to the controllers of the jobs on that node, without an RPC per job.

Root writes one file per drained node, named for the node, into a directory that root owns
and nobody else can write (`publish`); a job's controller looks at that directory's mtime
every loop turn (a `stat`, about every 0.2 s) and, when a notice for one of its nodes is
newer than what it has seen (`Watcher.fresh`), asks Slurm once about that node and acts on
Slurm's answer, never on the file's content. So:

* root never reads anything a user can write: it only writes, into a directory it checked is
  its own (opened with O_NOFOLLOW, written through that descriptor, renamed into place), under
  directories all root's and writable by nobody else unless sticky (`_above`: else a user who
  can rename one of them could put their own directory, with a link in it, in its place);
* a user cannot forge a notice: the watcher ignores a directory or file that is not root's
  or that group or others may write; and even a notice that passed would only trigger one
  Slurm query, whose answer (the node drained or not) decides.

The directory must be one that every node's controller sees: the embedded cluster's is
`trainmover-drains` beside slurm.conf; a site names a shared one (docs/admin.md, "Load on
slurmctld").
"""
from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Optional

from trainmover.slurm.commands import untrusted

__all__ = ["DIR_NAME", "publish", "Watcher", "default_dir"]

DIR_NAME = "trainmover-drains"
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def default_dir(slurm_conf: Optional[str]) -> Optional[Path]:
    """`trainmover-drains` beside `slurm_conf` (default /etc/slurm/slurm.conf) when it exists."""
    d = Path(slurm_conf or "/etc/slurm/slurm.conf").parent / DIR_NAME
    return d if d.is_dir() else None


def root_only(st: os.stat_result) -> bool:
    return st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _above(directory: Path) -> str:
    """Why `directory` or a directory above it cannot be trusted ('' if they can): every one
    root's (or this process's user's) and writable by nobody else, sticky ones above excepted
    (slurm/commands.py `untrusted`, the rule a cluster's exec prefix follows)."""
    return untrusted(str(directory))


def publish(directory: Path, node: str, reason: str, now: float) -> Path:
    """Root's side: write the notice for `node`. The directory is created (0755) when missing;
    an existing one must be a real directory, root's, writable by root alone (PermissionError
    otherwise: a user-writable directory could hold a link that redirects root's write)."""
    if not _NODE.match(node):
        raise ValueError(f"not a node name: {node!r}")
    data = json.dumps({"node": node, "reason": reason[:200], "at": now}).encode() + b"\n"
    return write_root_file(Path(directory), node, data)


def write_root_file(directory: Path, name: str, data: bytes) -> Path:
    """Root writes `data` to `directory`/`name` (0644), atomically; the directory checks of publish()."""
    try:
        os.mkdir(directory, 0o755)
    except FileExistsError:
        pass
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        above = _above(directory)
        if not root_only(os.fstat(fd)) or os.geteuid() != 0 or above:
            raise PermissionError(f"{directory}: drain notices are written by root into a directory only root "
                                  f"can write, under directories only root can change{': ' + above if above else ''}")
        tmp = f".{name.lstrip('.')}.{os.getpid()}.tmp"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd)
        try:
            os.write(out, data)
            os.fchmod(out, 0o644)  # whatever the umask: every job's controller reads it
        finally:
            os.close(out)
        os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)  # atomic: a reader never sees half a file
    finally:
        os.close(fd)
    return directory / name


def read_root_file(directory: Path, name: str) -> Optional[tuple[bytes, int]]:
    """(content, mtime_ns) of `directory`/`name` when the directory and the file are root's alone
    and the file is a regular file (not a link); None otherwise or when missing."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        if not root_only(os.fstat(fd)) or _above(directory):
            return None
        try:
            f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError:
            return None
        try:
            st = os.fstat(f)
            if not stat.S_ISREG(st.st_mode) or not root_only(st):
                return None
            chunks = []
            while chunk := os.read(f, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks), st.st_mtime_ns
        finally:
            os.close(f)
    finally:
        os.close(fd)


class Watcher:
    """A controller's side: which of its nodes got a new notice since it last looked.

    `fresh(nodes)` costs one stat of the directory while nothing changed. Notices already there
    when the watcher starts are old news (the controller's first node poll covers them)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._dir_mtime: Optional[int] = None
        self._seen: dict[str, int] = {}  # node -> mtime_ns of its notice last seen
        self.refused = ""                 # why the directory is not trusted ("" while it is)
        self._scan(set(), first=True)

    def fresh(self, nodes) -> list[str]:
        """Nodes among `nodes` whose notice is new since the last call."""
        try:
            st = os.stat(self.directory)
        except OSError:
            return []
        # Unchanged since the last scan, and not within the last second: a second rename in the same
        # timestamp tick as the one scanned would leave the mtime as it was.
        if st.st_mtime_ns == self._dir_mtime and time.time_ns() - st.st_mtime_ns > 1_000_000_000:
            return []
        return self._scan(set(nodes))

    def _scan(self, nodes: set[str], first: bool = False) -> list[str]:
        try:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return []
        try:
            st = os.fstat(fd)
            self._dir_mtime = st.st_mtime_ns
            above = _above(self.directory)
            if not root_only(st) or above:
                self.refused = (f"{self.directory} is not root's alone ({above or 'its owner or mode'}): its drain "
                                "notices are ignored")
                return []
            self.refused = ""
            new = []
            for name in os.listdir(fd):
                if not _NODE.match(name):
                    continue  # a writer's temporary file, or not a notice
                try:
                    fst = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(fst.st_mode) or not root_only(fst):
                    continue
                if self._seen.get(name) != fst.st_mtime_ns:
                    self._seen[name] = fst.st_mtime_ns
                    if not first and name in nodes:
                        new.append(name)
            return sorted(new)
        finally:
            os.close(fd)
