"""What the health check keeps between runs, in its state directory (default
/var/lib/trainmover/healthcheck): per node one JSON file with each GPU's counter bases
(rates.py), the GPUs seen, the boot they were read in and the kernel log cursor.

The health check runs as root, so it trusts only what root alone could have written:
  * the directory must belong to the user running the check and not be writable by group
    or others (it is created 0700 when missing);
  * a file must be a regular file (no symlink followed), owned by that user, not writable
    by group or others, and at most MAX_FILE_BYTES.
Anything else, and a file that does not parse, is set aside with a note: the run is then a
first run (a new baseline), never a crash and never a drain. Writes are atomic (a private
temporary file, fsync, rename), so a run killed at its deadline leaves the old state whole.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from trainmover.healthcheck.rates import Base

STATE_VERSION = 1
MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class GpuState:
    index: int
    pci: str = ""
    bases: Mapping[str, Mapping[str, Base]] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeState:
    boot_id: str
    time: float                                  # when this state was read from the GPUs
    gpus: Mapping[str, GpuState] = field(default_factory=dict)  # by GPU UUID
    kmsg_seq: int = -1                           # last kernel log record seen (-1: none)


def state_path(state_dir: Path, node: str) -> Path:
    return Path(state_dir) / f"gpu-state-{node}.json"


def dir_problem(state_dir: Path) -> Optional[str]:
    """Why `state_dir` cannot be trusted, or None."""
    try:
        st = os.stat(state_dir)
    except OSError as exc:
        return f"state directory {state_dir}: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"state directory {state_dir} is not a directory"
    if st.st_uid != os.geteuid():
        return f"state directory {state_dir} belongs to uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"state directory {state_dir} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def root_trusted(path: Path) -> bool:
    """healthcheck.sh's rule for the interpreter it runs as root: the file and its folder are
    root's and not writable by group or others (so no user could have put code there)."""
    for p in (Path(path), Path(path).parent):
        st = os.stat(p)
        if st.st_uid != 0 or st.st_mode & 0o022:
            return False
    return True


def ensure_dir(state_dir: Path) -> Optional[str]:
    """Create `state_dir` (0700) when missing; why it cannot be used, or None."""
    try:
        Path(state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create state directory {state_dir}: {exc.strerror or exc}"
    return dir_problem(state_dir)


def read_trusted(path: Path) -> tuple[Optional[str], Optional[str]]:
    """(text, None) for a file only the checking user could have written; (None, None) when
    it does not exist; (None, why) when it exists but is not trusted or not readable."""
    problem = dir_problem(Path(path).parent)
    if problem:
        return None, problem if Path(path).exists() else None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, None
    except OSError as exc:  # ELOOP: a symlink
        return None, f"{path}: not opened ({exc.strerror or exc})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{path} is not a regular file"
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return None, (f"{path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: "
                          f"only a file of uid {os.geteuid()} not writable by others is trusted")
        if st.st_size > MAX_FILE_BYTES:
            return None, f"{path} is {st.st_size} bytes (at most {MAX_FILE_BYTES})"
        return os.read(fd, MAX_FILE_BYTES + 1).decode("utf-8", "replace"), None
    except OSError as exc:
        return None, f"{path}: {exc.strerror or exc}"
    finally:
        os.close(fd)


def load(state_dir: Path, node: str) -> tuple[Optional[NodeState], list[str]]:
    """The state of the last run, or None (first run) with notes saying why."""
    path = state_path(state_dir, node)
    text, problem = read_trusted(path)
    if problem:
        return None, [f"{problem}: set aside, this run takes a new baseline"]
    if text is None:
        return None, [f"first run on {node} (no {path.name}): baseline taken"]
    try:
        return from_dict(json.loads(text)), []
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return None, [f"{path} is unreadable ({type(exc).__name__}: {exc}): set aside, this run takes a new baseline"]


def save(state_dir: Path, node: str, state: NodeState) -> list[str]:
    """Write the state atomically; notes for what went wrong (never raises on OS errors)."""
    problem = ensure_dir(state_dir)
    if problem:
        return [f"{problem}: state not kept, so the next run takes a new baseline"]
    path = state_path(state_dir, node)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = (json.dumps(to_dict(state), sort_keys=True) + "\n").encode()
    try:
        try:
            os.unlink(tmp)  # left by a run of this pid killed mid-write
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        return [f"cannot write {path}: {exc.strerror or exc}: the next run takes a new baseline"]
    return []


def to_dict(s: NodeState) -> dict:
    return {"version": STATE_VERSION, "boot_id": s.boot_id, "time": s.time, "kmsg_seq": s.kmsg_seq,
            "gpus": {uuid: {"index": g.index, "pci": g.pci,
                            "bases": {link: {kind: [b.value, b.since, b.last] for kind, b in kinds.items()}
                                      for link, kinds in g.bases.items()}}
                     for uuid, g in s.gpus.items()}}


def from_dict(d: dict) -> NodeState:
    if d.get("version") != STATE_VERSION:
        raise ValueError(f"state version {d.get('version')!r}, expected {STATE_VERSION}")
    gpus = {}
    for uuid, g in d["gpus"].items():
        bases = {str(link): {str(kind): Base(int(v[0]), float(v[1]), int(v[2])) for kind, v in kinds.items()}
                 for link, kinds in g["bases"].items()}
        gpus[str(uuid)] = GpuState(int(g["index"]), str(g.get("pci", "")), bases)
    return NodeState(str(d["boot_id"]), float(d["time"]), gpus, int(d.get("kmsg_seq", -1)))
