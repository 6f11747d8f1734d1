"""The Slurm steps a controller runs (one per node: its workers, or a standby agent), and who
launches them.

A step lives exactly as long as the `srun` that launched it (SIGKILL that srun and Slurm ends the
step). So the sruns must run where they outlive a controller:

* `LocalSteps`: the controller's own children (as in the batch step of a job without a keeper
  node, and on the single-host GPU machines);
* `KeeperSteps`: the job's keeper (controller/succession/keeper.py, the batch script on the job's keeper
  node) runs them; the controller asks it over the control channel (`launch`) and learns of
  their ends (`step_exit`). A controller can then move from node to node while every step runs on.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from trainmover.protocol import files
from trainmover.protocol.messages import make

log = logging.getLogger("trainmover.controller")


class Adopted:
    """A Slurm step started by a controller that died: not our child, so watched by pid
    (srun runs on this node). Its exit code is unknown; a lost rank is detected by its
    channel (takeover.py), so an exit reads as 0 here."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return 0
        return 0 if state in ("Z", "X") else None

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.1)
        return 0

    def terminate(self) -> None:
        try:
            os.kill(self.pid, signal.SIGTERM)
        except OSError:
            pass

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass


# What a launched step's environment may hold (the rest of the controller's environment, access
# tokens and the like, is not sent to the keeper nor given to the step): Slurm's, TrainMover's,
# the interpreter's and the accelerator libraries' settings.
STEP_ENV_NAMES = {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "TZ", "TMPDIR", "TERM", "PWD",
                  "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV", "CONDA_PREFIX"}
STEP_ENV_PREFIXES = ("TM_", "SLURM_", "SLURMD_", "CUDA_", "NCCL_", "NVIDIA_", "GLOO_", "TORCH", "PYTORCH_", "OMP_",
                     "MKL_", "OPENBLAS_", "PYTHON", "LC_", "HF_", "UCX_", "FI_", "TRITON_")


# Credentials hide under allowed prefixes (SLURM_JWT, HF_TOKEN, HF_HUB_TOKEN, ...), and the
# launch message carries the environment in clear to the keeper: a name with any of these parts
# is never sent nor given to a step (issue 37). No TrainMover setting (TM_*) has one. A workload
# that needs a token reads it from a file of its user's (e.g. ~/.cache/huggingface/token).
SECRET_NAME_PARTS = ("TOKEN", "JWT", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL")


def _secret_name(name: str) -> bool:
    upper = name.upper()
    return any(part in upper for part in SECRET_NAME_PARTS)


def step_environment(env: dict) -> dict:
    """The part of `env` a step needs (STEP_ENV_NAMES and STEP_ENV_PREFIXES), less any name that
    looks like a credential's (SECRET_NAME_PARTS)."""
    return {k: v for k, v in env.items()
            if (k in STEP_ENV_NAMES or k.startswith(STEP_ENV_PREFIXES)) and not _secret_name(k)}


def start_srun(argv: list[str], env: dict, log_path: Path | None, stdin_pipe: bool = False) -> subprocess.Popen:
    """One step's srun, its output appended to `log_path` (None: this process's own output),
    a 0600 file never opened through a link. `stdin_pipe`: a pipe to the step's task (srun
    forwards its stdin: the keeper's word to a warm successor controller)."""
    if log_path is None:
        return subprocess.Popen(argv, env=env, stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL)
    with files.open_append(log_path, encoding="latin-1") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


class LocalSteps:
    """Steps whose sruns are this process's children."""

    remote = False

    def __init__(self):
        self.procs: dict = {}  # node -> Popen or Adopted

    def launch(self, node: str, role: str, argv: list[str], env: dict, log_path: Path) -> int:
        self.procs[node] = start_srun(argv, env, log_path)
        return self.procs[node].pid

    def adopt(self, node: str, pid: int) -> None:
        self.procs[node] = Adopted(pid)

    def exited(self) -> list[tuple[str, int]]:
        """(node, exit code) of the steps that ended since the last call."""
        out = []
        for node, proc in list(self.procs.items()):
            code = proc.poll()
            if code is not None:
                del self.procs[node]
                out.append((node, code))
        return out

    def get(self, node: str):
        return self.procs.get(node)

    def stop(self, deadline_s: float) -> None:
        deadline = time.time() + deadline_s
        for node, proc in self.procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                log.warning("step on %s did not end; terminating it", node)
                proc.terminate()


class KeeperSteps:
    """Steps run by the job's keeper. Launches wait (in order) until the keeper is connected."""

    remote = True

    def __init__(self):
        self.conn = None                 # the keeper's connection, once it said hello
        self.queued: list[dict] = []     # launches asked before it connected
        self.running: dict[str, str] = {}  # node -> role, as the keeper reports them
        self.ended: list[tuple[str, int]] = []

    def launch(self, node: str, role: str, argv: list[str], env: dict, log_path: Path) -> int:
        msg = make("launch", node=node, role=role, argv=[str(a) for a in argv], env=dict(env), log=str(log_path))
        self.running[node] = role
        self.queued.append(msg)
        self.flush()
        return 0

    def adopt(self, node: str, pid: int) -> None:
        pass  # the keeper says what still runs (`steps`)

    def connected(self, conn, running: dict[str, str]) -> None:
        """The keeper (re)connected and said what runs: steps this controller believed running
        that it does not run have ended (exit code unknown: 0, as for an adopted step)."""
        self.conn = conn
        for node in [n for n in self.running if n not in running and not any(
                q["node"] == n for q in self.queued)]:
            self.running.pop(node)
            self.ended.append((node, 0))
        self.running.update(running)
        self.flush()

    def gone(self) -> None:
        self.conn = None

    def on_exit(self, node: str, code: int) -> None:
        """A step's end, also one that ended while no controller ran (the keeper kept it)."""
        self.running.pop(node, None)
        self.ended.append((node, code))

    def flush(self) -> None:
        while self.queued and self.conn is not None:
            try:
                self.conn.send(self.queued[0])
            except OSError as exc:
                log.warning("keeper unreachable (%s): %d launch(es) wait for it", exc, len(self.queued))
                self.conn = None
                return
            self.queued.pop(0)

    def exited(self) -> list[tuple[str, int]]:
        out, self.ended = self.ended, []
        return out

    def get(self, node: str):
        return None  # no local process: fencing goes through Slurm (scancel)

    def stop(self, deadline_s: float) -> None:
        pass  # the keeper waits for its steps after the controller ends
