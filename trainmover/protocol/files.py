"""A job's files on a shared filesystem, made and read so that other users can neither read,
replace nor plant them (docs/security.md).

* `private_dir`: the run directory `runs/<job>` is the job's user's, mode 0700. One that
  exists already and belongs to someone else, is a symbolic link, or is writable by group or
  others is refused with a clear error (job ids are sequential: another user can create
  `runs/<next id>` before the job starts and plant files in it).
* `write_atomic` / `open_append`: files are 0600, temporaries get unique names (mkstemp: in the
  same directory, O_EXCL, 0600) and are renamed over the target; nothing follows a symbolic link
  (O_NOFOLLOW), so a link planted where a file will be written is an error, not a redirection.
* `seal` / `unseal`: a JSON record authenticated with the job's key (HMAC-SHA256 over a
  purpose label and the canonical JSON), for files that steer the job (controller.json,
  checkpoint manifests).
* `read_limited`: a bounded read of a file someone else may control (a FIFO, a huge file or a
  link is refused at once, without blocking).
* `held_dir`: the run directory held by a descriptor for the process's life, so that a `runs/`
  renamed and replaced by another user mid-job is never read or written in its place; a process
  handed the plain path (a rank) holds it only if it is still the directory its controller made
  (`dir_identity`: device and inode, in the rank's authenticated launch).
* `trim_torn_tail`: cut a last line a writer died inside of, in place, never through a link.

The module has no policy beyond "refuse": callers decide what a refusal means.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, TextIO

from trainmover.errors import ConfigError, ProtocolError

DIR_MODE = 0o700
FILE_MODE = 0o600
RUN_FILE_MAX = 1 << 30  # read_limited's bound for the job's own files (a long job's journal)


class UnsafePath(ConfigError):
    """A path that someone other than the job's user could have made or can change."""


def private_umask() -> None:
    """Every file and directory this process creates is its user's alone (logs, recordings and
    checkpoints that libraries such as h5py open by name included)."""
    os.umask(0o077)


def _trusted_owner(uid: int) -> bool:
    return uid == os.geteuid() or uid == 0


def check_parents(path: Path, levels: int | None = None) -> None:
    """The directories above `path` (all, or the nearest `levels`) must be root's or ours, and not
    writable by others unless sticky (/tmp): else another user could move our directory away and
    put theirs in its place."""
    for parent in list(Path(os.path.abspath(path)).parents)[:levels]:
        try:
            st = os.stat(parent)
        except OSError as exc:
            raise UnsafePath(f"cannot inspect {parent}: {exc}") from exc
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if not _trusted_owner(st.st_uid) or (writable and not st.st_mode & stat.S_ISVTX):
            raise UnsafePath(f"{parent} (above {path}) belongs to uid {st.st_uid} or is writable by others: "
                             "a job's files are not kept under a directory another user controls")


def private_dir(path: Path, *, parents: bool = True) -> Path:
    """Make `path` (0700, ours) or accept an existing one only if it is a real directory, ours,
    and not writable by group or others (its mode is then tightened to 0700)."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is not a directory (a symbolic link or a file): refusing to use it as a job's "
                         "run directory")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{path} belongs to uid {st.st_uid}, not to this job's user (uid {os.geteuid()}): someone "
                         "made it before the job started. Refusing to use it: remove it, or set TM_RUN_DIR")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePath(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): its files "
                         "could have been planted. Refusing to use it: remove it, or set TM_RUN_DIR")
    check_parents(path, levels=1)  # runs/ itself: nobody else may swap our directory
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def held_dir(path: Path, *, owner: int | None = None, identity: tuple[int, ...] | None = None) -> Path:
    """`path` (a run directory `private_dir` accepted) held open for the process's life: the path
    returned resolves through that descriptor (/proc/self/fd/N), so renaming `runs/` or any
    directory above it (a shared submit directory others can write) cannot put another directory
    in its place for this process's later reads and writes. It is checked again on the
    descriptor (a directory, ours, writable by nobody else). Valid in this process only: hand
    other processes (steps, ranks) the plain path and its `dir_identity`. `owner`: the uid it
    must belong to (root's `migrate` on a user's job), else ours. `identity`: the (device, inode)
    the directory must be (a rank: the one its controller made and holds), else any."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != (os.geteuid() if owner is None else owner) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise UnsafePath(f"{path} is not the job's user's own directory (uid {st.st_uid}, mode "
                         f"{stat.S_IMODE(st.st_mode):o}): changed since it was checked, or someone else's")
    if identity is not None and (st.st_dev, st.st_ino) != tuple(identity):
        os.close(fd)
        raise UnsafePath(f"{path} is not the run directory this job's controller made (device:inode "
                         f"{st.st_dev}:{st.st_ino}, not {identity[0]}:{identity[1]}): `runs/` or a directory "
                         "above it was renamed and replaced since the job started. Refusing to read or write "
                         "there")
    return Path(f"/proc/self/fd/{fd}")


def dir_identity(path: Path) -> tuple[int, int]:
    """(device, inode) of the directory at `path` (a held one: the directory itself, wherever it
    was moved): what a process handed the plain path checks with `held_dir(identity=...)`."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def trim_torn_tail(path: Path) -> bytes:
    """Cut a last line its writer died inside of (no newline at its end), in place: opened
    read-write without following a link or blocking on a FIFO, a regular file only. Returns the
    complete lines' bytes (b"" where there is no file)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePath(f"{path}: not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
        if data and not data.endswith(b"\n"):
            data = data[:data.rfind(b"\n") + 1]
            os.ftruncate(fd, len(data))
        return data
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str, *, fsync: bool = False) -> None:
    """Replace `path` with `data` (0600): a unique temporary in the same directory, renamed over
    the target (readers never see half a file; a planted `.x.tmp` link is never followed)."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # O_EXCL, 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def temp_path(path: Path) -> Path:
    """A fresh, unique, empty 0600 file beside `path` for a library that writes by name (h5py);
    the caller renames it over `path` (os.replace) or removes it."""
    fd, tmp = tempfile.mkstemp(dir=Path(path).parent, prefix=f".{Path(path).name}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def open_append(path: Path, encoding: str = "utf-8", buffering: int = -1) -> TextIO:
    """A text file opened for appending, created 0600; a symbolic link there is an error."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    return os.fdopen(fd, "a", encoding=encoding, buffering=buffering)


def read_limited(path: str | Path, max_bytes: int, *, owner: int | None = None) -> bytes:
    """The bytes of a regular file of at most `max_bytes`, read without following a final
    symbolic link and without blocking on a FIFO. `owner`: the uid it must belong to.
    Raises OSError (the caller treats it as 'nothing to read')."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: not a regular file")
        if owner is not None and st.st_uid != owner:
            raise OSError(f"{path}: belongs to uid {st.st_uid}, not {owner}")
        if st.st_size > max_bytes:
            raise OSError(f"{path}: {st.st_size} bytes, more than {max_bytes}")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))  # os.read allocates what it is asked for
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise OSError(f"{path}: more than {max_bytes} bytes")
        return data
    finally:
        os.close(fd)


# --- records authenticated with the job's key ------------------------------------------------

def _mac(key: bytes, purpose: str, body: dict[str, Any]) -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, purpose.encode() + b"\0" + canon, hashlib.sha256).hexdigest()


def seal(key: bytes, purpose: str, body: dict[str, Any]) -> dict[str, Any]:
    """`body` with a `mac` field: HMAC-SHA256 under the job's key over `purpose` and the
    canonical JSON (a record cannot be moved to another purpose, or changed, without the key)."""
    if "mac" in body:
        raise ValueError("a sealed record has no field of its own named 'mac'")
    return {**body, "mac": _mac(key, purpose, body)}


def unseal(key: bytes, purpose: str, record: object) -> dict[str, Any]:
    """The body of a record `seal` made with `key` for `purpose`; ProtocolError otherwise."""
    if not isinstance(record, dict) or not isinstance(record.get("mac"), str):
        raise ProtocolError(f"{purpose}: record carries no MAC (not written by this job)")
    body = {k: v for k, v in record.items() if k != "mac"}
    if not hmac.compare_digest(record["mac"], _mac(key, purpose, body)):
        raise ProtocolError(f"{purpose}: MAC does not match the job's key (changed or not written by this job)")
    return body
