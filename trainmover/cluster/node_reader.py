"""The embedded cluster's node-state reader, run as a site runs it (docs/admin.md, "One
node-state reader per cluster"): `trainmover node-reader` as root, every INTERVAL_S, writing
its table into the drain-notice directory beside slurm.conf, where every job's controller reads
it instead of polling slurmctld. A plain `scontrol` drain then reaches a job within about a
second at no per-job cost (the jobs' own poll, TM_POLL_S, stays the fallback whenever the table
is stale: the reader stopped or killed).

A process of the cluster like its daemons: a pid file under run/, a log under log/, started by
`cluster up` (unless the spec says node_reader=False: tests and benchmarks that measure each
job's own poll) and stopped by `cluster down`. Its marker is the state directory on its command
line, so a stale pid file never makes us signal a stranger (procs.owned).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from trainmover.cluster import daemons
from trainmover.cluster.procs import ClusterError, read_pid, running_pid, tail, terminate
from trainmover.cluster.spec import ClusterSpec
from trainmover.slurm import drain_notice, node_states

INTERVAL_S = 1.0      # 60 RPCs a minute for the whole cluster, as root (outside the users' rate limit)
START_TIMEOUT_S = 20.0
ROOT = Path(__file__).resolve().parents[2]  # the checkout whose trainmover the reader runs


def _program() -> str:
    """The interpreter's file name as /proc/<pid>/exe names it (procs.owned compares it)."""
    return os.path.basename(os.path.realpath(sys.executable))


def pid_file(spec: ClusterSpec) -> Path:
    return spec.run / "node-reader.pid"


def log_file(spec: ClusterSpec) -> Path:
    return spec.log / "node-reader.log"


def notices(spec: ClusterSpec) -> Path:
    return spec.etc / drain_notice.DIR_NAME


def running(spec: ClusterSpec) -> Optional[int]:
    return running_pid(pid_file(spec), _program(), str(spec.state_dir))


def _fresh(spec: ClusterSpec, since: float) -> bool:
    try:
        return (notices(spec) / node_states.FILE).stat().st_mtime >= since
    except OSError:
        return False


def start(spec: ClusterSpec) -> Optional[int]:
    """Start the reader unless it runs; wait for its first table. None when the spec has none."""
    if not spec.node_reader:
        return None
    pid = running(spec)
    if pid is not None:
        return pid
    t0 = time.time()
    env = {**daemons.env(spec), "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    with open(log_file(spec), "ab") as log:
        # its own session: a `cluster up` run from a terminal does not take it down with a ^C
        proc = subprocess.Popen([sys.executable, "-m", "trainmover.cli", "node-reader", "--interval",
                                 f"{INTERVAL_S:g}", "--notices", str(notices(spec))],
                                env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    pid_file(spec).write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _fresh(spec, t0):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)  # reaped: no zombie left in a long-lived caller
            raise ClusterError(f"node-reader failed: no table in {notices(spec)} after {time.time() - t0:.0f}s\n"
                               f"--- last lines of {log_file(spec)} ---\n{tail(log_file(spec))}")
        time.sleep(0.1)
    return proc.pid


def stop(spec: ClusterSpec) -> Optional[int]:
    """Stop the reader (any spec: a cluster started with one and now told none). Its pid, or None."""
    pid = read_pid(pid_file(spec))
    if pid is None:
        return None
    terminate([pid], _program(), str(spec.state_dir), timeout=10)
    pid_file(spec).unlink(missing_ok=True)
    return pid


def ensure(spec: ClusterSpec, log: Callable[[str], None]) -> None:
    """The reader running, or stopped, as the spec says (`cluster up`, a running cluster too)."""
    if not spec.node_reader:
        if stop(spec):
            log("node-reader stopped (each job polls for itself)")
        return
    was = running(spec)
    if start(spec) != was:
        log(f"node-reader up (every {INTERVAL_S:g} s, table in {notices(spec)})")
