"""Process plumbing for the embedded cluster's daemons: bounded commands, pid
files that are trusted only when the process they name is ours, bounded waits.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Optional

from trainmover.errors import DeadlineExceeded, TrainMoverError


class ClusterError(TrainMoverError):
    """The embedded cluster could not be started, stopped or inspected."""


def tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:]) or f"(empty log {path})"


def run_cmd(
    argv: Sequence[str],
    *,
    timeout: float,
    env: Optional[Mapping[str, str]] = None,
    what: str = "",
    check: bool = True,
    stdin: Optional[str] = None,
) -> subprocess.CompletedProcess:
    """A bounded, shell-free command for setting the cluster up (not for Slurm queries)."""
    argv = [str(a) for a in argv]
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=dict(env) if env is not None else None,
            input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise ClusterError(f"{what or argv[0]}: {' '.join(argv)} timed out after {timeout:g}s") from exc
    except OSError as exc:
        raise ClusterError(f"{what or argv[0]}: cannot run {argv[0]} ({exc})") from exc
    if check and proc.returncode != 0:
        out = (proc.stderr.strip() or proc.stdout.strip())[-2000:]
        raise ClusterError(f"{what or argv[0]}: {' '.join(argv)} exited with {proc.returncode}: {out}")
    return proc


def read_pid(pid_file: Path) -> Optional[int]:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _proc_text(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _realpath_in(root: str, path: str, hops: int = 16) -> str:
    """`path` inside the file system rooted at `root` with its symbolic links followed
    there (absolute link targets are relative to `root`, not to the host's /)."""
    for _ in range(hops):
        full = os.path.join(root, path.lstrip("/"))
        if not os.path.islink(full):
            return path
        target = os.readlink(full)
        path = target if target.startswith("/") else os.path.join(os.path.dirname(path), target)
    return path


def _exe_names(program: str, root: str = "") -> set[str]:
    """Basenames the kernel may report for `program` (Debian installs slurmd as an
    alternatives link to slurmd-wlm), on the host or in the root filesystem `root`."""
    names = {program, f"{program}-wlm"}  # also when `root` is gone (removed under a running cluster)
    for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        path = os.path.join(d, program)
        if os.path.lexists(os.path.join(root or "/", path.lstrip("/"))):
            names.add(os.path.basename(_realpath_in(root or "/", path)))
    return names


def owned(pid: int, program: str, marker: str, root: str = "") -> bool:
    """True when `pid` runs `program` (from the root filesystem `root` when given) and
    mentions `marker` (our state dir, as a whole path) in its command line or environment:
    a stale pid file never makes us signal a stranger, nor a cluster whose state directory
    merely starts with ours."""
    if pid <= 1:
        return False
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    if os.path.basename(exe.split(" (deleted)")[0]) not in _exe_names(program, root):
        return False
    if _proc_text(pid, "stat").split(" ")[2:3] == ["Z"]:
        return False
    # the state directory as a whole path: /var/tmp/c must not match /var/tmp/c-24.11/...
    mentions = re.compile(re.escape(marker.rstrip("/")) + r"(?=/|\s|$)")
    return bool(mentions.search(_proc_text(pid, "cmdline")) or mentions.search(_proc_text(pid, "environ")))


def running_pid(pid_file: Path, program: str, marker: str, root: str = "") -> Optional[int]:
    pid = read_pid(pid_file)
    return pid if pid is not None and owned(pid, program, marker, root) else None


def find_pids(program: str, marker: str, root: str = "") -> list[int]:
    """Processes running `program` whose command line or environment names `marker`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and owned(int(entry), program, marker, root):
            out.append(int(entry))
    return out


def wait_until(
    what: str,
    check: Callable[[], bool],
    *,
    timeout: float,
    interval: float = 0.1,
    max_interval: float = 1.0,
    on_timeout: Optional[Callable[[], str]] = None,
) -> None:
    """Poll `check` with backoff until it is true; raise DeadlineExceeded naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        now = time.monotonic()
        if now >= deadline:
            detail = on_timeout() if on_timeout else ""
            raise DeadlineExceeded(f"timed out after {timeout:g}s waiting for {what}" + (f"\n{detail}" if detail else ""))
        time.sleep(min(interval, deadline - now))
        interval = min(interval * 1.5, max_interval)


def terminate(pids: Sequence[int], program: str, marker: str, *, timeout: float = 15.0, root: str = "") -> None:
    """SIGTERM our processes, SIGKILL what is left after `timeout` seconds."""
    live = [p for p in pids if owned(p, program, marker, root)]
    for pid in live:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        wait_until(f"{program} to exit", lambda: not any(owned(p, program, marker, root) for p in live),
                   timeout=timeout)
    except DeadlineExceeded:
        for pid in live:
            if owned(pid, program, marker, root):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        wait_until(f"{program} to die after SIGKILL", lambda: not any(owned(p, program, marker, root) for p in live),
                   timeout=5)


def step_pid(job_id: int, node: str, module: str = "trainmover.runtime.worker") -> int:
    """The pid of `module`'s process that job `job_id` runs on the embedded cluster's `node`.
    For fault injection by tests and benchmarks (kill -9 from outside): every node of the
    embedded cluster is a process tree on this machine. The runtime never uses pids."""
    want = {b"SLURM_JOB_ID": str(job_id).encode(), b"SLURMD_NODENAME": node.encode()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if module.encode() not in Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0"):
                continue
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if all(env.get(k) == v for k, v in want.items()):
            return int(entry)
    raise ClusterError(f"no {module} process of job {job_id} on {node}")


@contextlib.contextmanager
def flocked(path: Path, timeout: float, held_by: str, poll_s: float = 0.2) -> Iterator[None]:
    """An exclusive lock on the file `path` (made 0600 if missing; its folder must exist, made and
    checked by rootdirs.own_dir) for the body of the context; a ClusterError after `timeout`
    seconds names `held_by`, what holds it. A link planted at `path` is an error, never followed
    (root would otherwise create or append to the file it points at)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ClusterError(f"cannot open the lock file {path} ({exc.strerror or exc}; a symbolic link there "
                           "is refused): remove it and run the command again") from exc
    with os.fdopen(fd, "a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ClusterError(f"timed out after {timeout:g}s waiting for {path} ({held_by})") from None
                time.sleep(poll_s)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
