"""SlurmClient through pyslurm (the Slurm C API) where pyslurm has the call, and through the
command line (CliSlurm) where it has none.

pyslurm's calls run in a process of their own (slurm/pyslurm_server.py), started with the
client and kept for its life: pyslurm 25.11.2 holds the GIL through each RPC, so made in the
controller they would stop its heartbeat and every other thread while slurmctld answers. A
call is one JSON line each way on a pipe (no fork or exec per call, no output to parse).

pyslurm 25.11 needs Slurm 25.11's libslurmfull: `make pyslurm` builds it against the
25.11 root filesystem (docs/admin.md). The embedded cluster's jobs run inside that root,
so a controller there can load it; outside the root the library does not load (its C library
is newer than the host's) and `PySlurm()` raises a SlurmError saying so.

| method                  | how                                                          |
|-------------------------|--------------------------------------------------------------|
| nodes                   | pyslurm `Nodes.load()`: node and partition RPCs, filtered here |
| job                     | pyslurm `Job.load(id)`                                       |
| hostnames               | pyslurm `nodelist_from_range_str` (libslurm's hostlist, no RPC) |
| reservation_nodes, free_standbys | pyslurm `Reservation.load(name)`, then nodes()      |
| drain, resume           | pyslurm `Node.modify(Node(state=..., reason=...))`           |
| shrink                  | pyslurm `Job.modify(JobSubmitDescription(required_nodes=...))` (what `scontrol update NodeList=` sends) |
| grow                    | CLI: `salloc` for the donor (pyslurm has no interactive allocation), then the job reads and updates above |
| jobs_on, kill_steps, cancel_donors | CLI: `squeue`, `scancel` (pyslurm's job list has no per-node filter in one RPC; signals to steps are rare) |
| step_argv, step_env     | CLI: `srun` command lines (a step is a process the caller starts) |

Deadlines: each call waits for its reply at most `timeout` seconds (as a CLI command does);
past it the pyslurm process is killed, the call raises SlurmError and the next call starts a
new process. Calls are serialised (libslurm keeps global state: its configuration, errno).
"""
from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Optional

from trainmover.errors import SlurmError
from trainmover.slurm.client import CliSlurm
from trainmover.slurm.model import JobInfo, NodeInfo, UnknownNodes

__all__ = ["PySlurm"]

log = logging.getLogger("trainmover.slurm")

START_TIMEOUT_S = 30.0  # interpreter start and pyslurm's import, on a loaded node
SLOW_CALL_S = 1.0       # a call this slow is logged (slurmctld busy, or the node loaded)


class PySlurm(CliSlurm):
    """SlurmClient with pyslurm's calls (see the module's table); the rest is CliSlurm's.
    Same arguments as CliSlurm. SlurmError at once when pyslurm cannot load here."""

    def __init__(self, *, slurm_conf: Optional[str] = None, **kwargs):
        super().__init__(slurm_conf=slurm_conf, **kwargs)
        self._conf = slurm_conf or ""
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        with self._lock:
            self._start()

    # --- the pyslurm process ----------------------------------------------------------
    def _start(self) -> None:
        t0 = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self._conf:
            env["SLURM_CONF"] = self._conf
        self._proc = subprocess.Popen([sys.executable, "-m", "trainmover.slurm.pyslurm_server", self._conf],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      env=env, text=True, bufsize=1)
        first = self._reply(START_TIMEOUT_S, "start")
        if not first.get("ready"):
            self._stop()
            raise SlurmError(f"pyslurm does not load here: {first.get('error', first)}")
        log.info("pyslurm process pid %d ready in %.2fs", self._proc.pid, time.monotonic() - t0)

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def _reply(self, timeout: float, what: str) -> dict:
        """The process's next line within `timeout` s; SlurmError (and the process killed) if none."""
        proc = self._proc
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ready = select.select([proc.stdout], [], [], max(left, 0))[0] if left > 0 else []
            if ready:
                line = proc.stdout.readline()
                if line:
                    try:
                        return json.loads(line)
                    except ValueError:  # not our protocol: a stray write to its stdout
                        self._stop()
                        raise SlurmError(f"pyslurm {what}: unreadable answer {line[:200]!r}") from None
                self._stop()
                raise SlurmError(f"pyslurm {what}: its process ended (exit {proc.poll()})")
            if left <= 0:
                self._stop()
                raise SlurmError(f"pyslurm {what}: no answer within {timeout:g}s (its process was stopped)")

    def _call(self, what: str, op: str, **args):
        """One request to the pyslurm process; its error as a SlurmError naming what failed."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                log.warning("pyslurm process %s: starting a new one",
                            "stopped" if self._proc is None else f"exited ({self._proc.poll()})")
                self._start()
            t0 = time.monotonic()
            try:
                self._proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
                self._proc.stdin.flush()
            except OSError as exc:
                self._stop()
                raise SlurmError(f"pyslurm {what}: {exc}") from None
            reply = self._reply(self.timeout, what)
            took = time.monotonic() - t0
        if took > SLOW_CALL_S:
            log.warning("pyslurm %s took %.2fs", what, took)
        if "error" in reply:
            raise SlurmError(f"pyslurm {what}: {reply['error']}")
        return reply["ok"]

    def close(self) -> None:
        with self._lock:
            self._stop()

    def __del__(self):
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()

    # --- queries ------------------------------------------------------------------
    def nodes(self, names: Optional[Sequence[str]] = None) -> dict[str, NodeInfo]:
        names = list(names) if names is not None else None
        if names == []:
            return {}
        found = {d["name"]: _node(d) for d in self._call("load nodes", "nodes")}
        if names is None:
            return found
        missing = [n for n in names if n not in found]
        if missing:
            raise UnknownNodes(f"Slurm does not know node(s) {missing}")
        return {n: found[n] for n in names}

    def job(self, job_id: int) -> JobInfo:
        return _job(self._call(f"load job {job_id}", "job", job_id=int(job_id)))

    def hostnames(self, nodelist_expr: str) -> list[str]:
        if not nodelist_expr.strip():
            return []
        out = self._call(f"expand {nodelist_expr!r}", "hostnames", expr=nodelist_expr)
        if not out:
            raise SlurmError(f"invalid node list expression {nodelist_expr!r}")
        return list(out)

    def reservation_nodes(self, reservation: str) -> list[str]:
        return self.hostnames(self._call(f"load reservation {reservation}", "reservation", name=reservation))

    # --- changes --------------------------------------------------------------------
    def drain(self, node: str, reason: str) -> None:
        self._call(f"drain {node}", "drain", node=node, reason=reason)

    def resume(self, node: str) -> None:
        """As CliSlurm.resume: a node already in service is left as is."""
        try:
            self._call(f"resume {node}", "resume", node=node)
            return
        except SlurmError as exc:
            err = exc
        info = self.nodes([node])[node]
        if "DRAIN" in info.flags or info.base_state == "DOWN":
            raise SlurmError(f"could not resume {node} ({info.state}): {err}")

    def _set_nodes(self, job_id: int, keep: list[str]) -> None:
        """The job's required nodes set to `keep` (CliSlurm.shrink checks around it)."""
        self._call(f"shrink job {job_id} to {keep}", "set_nodes", job_id=int(job_id), keep=list(keep))


def _node(d: dict) -> NodeInfo:
    return NodeInfo(**{**d, "features": tuple(d["features"])})


def _job(d: dict) -> JobInfo:
    return JobInfo(**{**d, "nodes": tuple(d["nodes"])})
