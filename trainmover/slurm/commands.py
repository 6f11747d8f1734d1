"""The single choke point through which every Slurm command runs.

No shell, a timeout on every call, a per-command call counter, and one error
type (`SlurmError`) that names the command, its exit status and its stderr.
Tests replace the executor with `intercept()`; nothing else in TrainMover may
fork a Slurm command.

Where the Slurm programs are: on PATH, unless the cluster that SLURM_CONF names
says otherwise. An embedded cluster whose Slurm lives in a Debian root filesystem
(`trainmover cluster up --slurm 24.11`, trainmover/cluster/rootfs.py) writes
`slurm-exec.json` beside its slurm.conf: the argv prefix that runs a program in
that root (`{"slurm": "24.11.5", "prefix": [...], "root_id": [dev, inode]}`).
`run()` puts that prefix before the command, except in a process that already
runs inside that root (a job step: its "/" is the root's top directory);
`CliSlurm.step_argv()` puts it before the srun it returns, since its callers start
that themselves (`run()` leaves such an argv as it is).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Optional

from trainmover.errors import SlurmError

__all__ = ["run", "calls", "seconds", "reset_calls", "intercept", "Runner", "build_env", "exec_prefix",
           "EXEC_FILE"]

# An executor takes (argv, timeout, env) and returns a CompletedProcess (text mode).
# It may raise subprocess.TimeoutExpired; run() turns that into SlurmError.
Runner = Callable[[list[str], float, dict[str, str]], subprocess.CompletedProcess]

_lock = threading.Lock()
_calls: collections.Counter[str] = collections.Counter()
_seconds: collections.Counter[str] = collections.Counter()
_hook: Optional[Runner] = None

# Variables passed through even when the caller gives its own environment:
# without them the command talks to a different cluster (or none).
_PASSTHROUGH = ("SLURM_CONF", "PATH")

_STDERR_TAIL = 2000

EXEC_FILE = "slurm-exec.json"
_exec_cache: dict[str, tuple[int, list[str]]] = {}  # exec file -> (mtime_ns, prefix to use here)


def build_env(env: Optional[Mapping[str, str]]) -> dict[str, str]:
    """The environment a Slurm command runs with.

    `env=None` means the current process environment. A given `env` is used as
    is, except that SLURM_CONF and PATH are taken from the process environment
    when `env` lacks them (a user who ran `eval "$(trainmover cluster env)"`
    must reach the same cluster from every command).
    """
    if env is None:
        return dict(os.environ)
    out = dict(env)
    for key in _PASSTHROUGH:
        if key not in out and key in os.environ:
            out[key] = os.environ[key]
    return out


def exec_prefix(env: Mapping[str, str]) -> list[str]:
    """The argv prefix that runs a Slurm program of the cluster `env`'s SLURM_CONF names
    (see the module docstring); [] for a Slurm on PATH."""
    conf = env.get("SLURM_CONF")
    if not conf:
        return []
    path = os.path.join(os.path.dirname(conf), EXEC_FILE)
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return []
    cached = _exec_cache.get(path)
    if cached and cached[0] == mtime:
        return cached[1]
    why = untrusted(path)
    if why:  # its prefix would run as whoever runs this (root, for the health check)
        raise SlurmError(f"{path} not used: {why}")
    try:
        with open(path) as f:
            spec = json.load(f)
        prefix = [str(a) for a in spec["prefix"]]
        root_id = [int(x) for x in spec["root_id"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SlurmError(f"{path} is unreadable ({exc}); `trainmover cluster up` rewrites it") from exc
    st = os.stat("/")
    prefix = [] if [st.st_dev, st.st_ino] == root_id else prefix
    with _lock:
        _exec_cache[path] = (mtime, prefix)
    return prefix


def untrusted(path: str) -> str:
    """Why `path` cannot be trusted to say what to run ('' if it can): it and every directory
    above it must belong to root (or to this process's own user, who could run anything anyway)
    and be writable by nobody else (a sticky directory such as /tmp excepted, above the file)."""
    me = os.geteuid()
    try:
        st = os.stat(path)
    except OSError as exc:
        return str(exc)
    if st.st_uid not in (0, me) or st.st_mode & 0o022:
        return f"it belongs to uid {st.st_uid} or is writable by group or others"
    d = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            st = os.stat(d)
        except OSError as exc:
            return str(exc)
        if st.st_uid not in (0, me) or (st.st_mode & 0o022 and not st.st_mode & 0o1000):
            return f"{d} belongs to uid {st.st_uid} or is writable by group or others"
        if d == "/":
            return ""
        d = os.path.dirname(d)


def _execute(argv: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
    )


def _name(argv: list[str]) -> str:
    return os.path.basename(argv[0]) if argv else "?"


def _tail(text: Optional[str | bytes]) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = text.strip()
    return text if len(text) <= _STDERR_TAIL else "..." + text[-_STDERR_TAIL:]


def run(
    argv: list[str],
    *,
    timeout: float,
    env: Optional[Mapping[str, str]] = None,
    check: bool = True,
    user: Optional[str] = None,
) -> subprocess.CompletedProcess:
    """Run one Slurm command and return its CompletedProcess (stdout/stderr as text).

    `user`: run it as that user (`runuser -u USER --`, so only from root: tests and admin
    tools acting as an ordinary user; inside a root filesystem when the cluster's Slurm lives
    in one, where the user exists too). The environment is kept (SLURM_CONF, TM_*).

    Raises SlurmError when the command cannot be started, runs past `timeout`
    seconds, or (with `check=True`) exits non-zero. The message names the
    command, the exit status and the tail of stderr.
    """
    if not argv:
        raise ValueError("run() needs a non-empty argv")
    if timeout is None or timeout <= 0:
        raise ValueError(f"run({argv[0]!r}) needs a positive timeout, got {timeout!r}")
    argv = [str(a) for a in argv]
    full_env = build_env(env)
    prefix = exec_prefix(full_env)
    if prefix and argv[:len(prefix)] == prefix:  # already prefixed (CliSlurm.step_argv)
        argv = argv[len(prefix):]
    name = _name(argv)
    with _lock:
        _calls[name] += 1
        hook = _hook
    started = time.monotonic()
    try:
        # An intercepting runner stands in for Slurm itself: it gets the command as written.
        as_user = ["runuser", "-u", user, "--"] if user else []
        proc = hook(as_user + argv, timeout, full_env) if hook else _execute(prefix + as_user + argv, timeout, full_env)
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(
            f"{name} timed out after {timeout:g}s: {' '.join(argv)}"
            + (f"; stderr: {_tail(exc.stderr)}" if exc.stderr else "")
        ) from exc
    except OSError as exc:
        raise SlurmError(f"{name} could not be started ({exc}): {' '.join(argv)}") from exc
    finally:
        with _lock:
            _seconds[name] += time.monotonic() - started
    if check and proc.returncode != 0:
        raise SlurmError(
            f"{name} exited with status {proc.returncode}: {' '.join(argv)}; "
            f"stderr: {_tail(proc.stderr) or '(empty)'}"
        )
    return proc


def calls() -> dict[str, int]:
    """Calls per command name since the last reset (e.g. {'scontrol': 3})."""
    with _lock:
        return dict(_calls)


def seconds() -> dict[str, float]:
    """Wall seconds spent per command name since the last reset."""
    with _lock:
        return dict(_seconds)


def reset_calls() -> None:
    with _lock:
        _calls.clear()
        _seconds.clear()


@contextlib.contextmanager
def intercept(runner: Runner) -> Iterator[None]:
    """Route every run() through `runner` instead of forking (tests, dry runs)."""
    global _hook
    with _lock:
        previous, _hook = _hook, runner
    try:
        yield
    finally:
        with _lock:
            _hook = previous
