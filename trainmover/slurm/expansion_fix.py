"""The admin's declaration that this cluster's slurmctld carries the fix for the job-expansion
crash (slurm/expansion_safety.py): a file, `trainmover-expansion-fix` beside slurm.conf, that
lists the Slurm releases the admin has patched (or checked), one a line:

    # slurmctld built with the NULL license_list test in _valid_license_job_expansion()
    25.11.7

Why a file of root's and not a variable a job sets: the declaration lets TrainMover make the
call that crashes an unfixed slurmctld for everybody, so only whoever runs slurmctld may make
it; and why it names the release: an upgrade (25.11.7 -> an unfixed 25.11.8) must not inherit
a declaration made for another build. `TM_SLURM_EXPANSION_FIX` (config.py) says where to look:
auto (beside slurm.conf), a path, or off.

The file is read only when nobody but root could have written it: a regular file (no symlink)
owned by root, not writable by group or others, in a directory with the same rule (the rule of
the drain notices, slurm/drain_notice.py). One that fails the rule is ignored, and the reason
says why.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

FILE_NAME = "trainmover-expansion-fix"
MAX_BYTES = 4096


@dataclass(frozen=True)
class Declaration:
    """The releases declared fixed (empty: none), where they were read, and why a file there
    was not taken ('' when taken or absent)."""

    releases: tuple[str, ...] = ()
    source: str = ""
    ignored: str = ""

    def covers(self, release: str) -> bool:
        return bool(release) and release in self.releases

    def note(self) -> str:
        """For a refusal's reason: why no declaration applied ('' when none was looked for)."""
        if self.ignored:
            return f"the declaration {self.source} was ignored: {self.ignored}"
        if self.source and self.releases:
            return f"{self.source} declares {', '.join(self.releases)} fixed, not this release"
        return ""


def location(setting: str, slurm_conf: Optional[str]) -> Optional[Path]:
    """Where to look: None for "off"; for "auto", FILE_NAME beside `slurm_conf` (default
    /etc/slurm/slurm.conf); else the path given."""
    if setting in ("", "off"):
        return None
    if setting != "auto":
        return Path(setting)
    return Path(slurm_conf or "/etc/slurm/slurm.conf").parent / FILE_NAME


def parse(text: str) -> tuple[str, ...]:
    """Releases, one a line; '#' starts a comment."""
    out = []
    for line in text.splitlines():
        item = line.split("#", 1)[0].strip()
        if item:
            out.append(item)
    return tuple(dict.fromkeys(out))


def untrusted(st: os.stat_result, owners: tuple[int, ...] = (0,)) -> str:
    """Why a file or directory with this stat could have been written by someone else ('' if not)."""
    if st.st_uid not in owners:
        return f"it belongs to uid {st.st_uid}, not root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"group or others may write it (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def read(path: Optional[Path], owners: tuple[int, ...] = (0,)) -> Declaration:
    """The declaration at `path` (None: none looked for). A missing file declares nothing;
    one that is not root's alone, or unreadable, is ignored with the reason. `owners`: the uids
    trusted (root; tests pass their own)."""
    if path is None:
        return Declaration()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return Declaration()
    except OSError as exc:
        return Declaration(source=str(path), ignored=f"not opened ({exc.strerror or exc})")
    try:
        st = os.fstat(fd)
        why = "not a regular file" if not stat.S_ISREG(st.st_mode) else untrusted(st, owners)
        if not why:
            parent = untrusted(os.stat(path.parent), owners)
            why = parent and f"its directory {path.parent}: {parent}"
        if why:
            return Declaration(source=str(path), ignored=why)
        data = os.read(fd, MAX_BYTES + 1)
    except OSError as exc:
        return Declaration(source=str(path), ignored=f"not read ({exc.strerror or exc})")
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        return Declaration(source=str(path), ignored=f"longer than {MAX_BYTES} bytes")
    return Declaration(parse(data.decode("utf-8", "replace")), str(path))
