"""What the checkpoint-restart baseline asks of Slurm, and nothing else.

Pure argv builders (tested without Slurm) and thin effectful wrappers; every command runs
through `trainmover.slurm.commands.run`, the one choke point (no shell, a timeout on each
call). The baseline's restart is a *resubmission* of the same batch script on the same run
directory: Slurm schedules it on healthy nodes (a drained or down node is never picked).
`scontrol requeue` is not used: Slurm 22.05 holds a requeued job for ~120 s (measured on the
local cluster: EligibleTime = requeue time + 121 s), which would only flatter TrainMover.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Callable

from trainmover.errors import DeadlineExceeded
from trainmover.slurm import commands

QUERY_TIMEOUT_S = 10.0


def sbatch_argv(script: str, args: Sequence[str], *, nodes: int, chdir: str, job_name: str,
                exclude: Sequence[str] = ()) -> list[str]:
    argv = ["sbatch", "--parsable", f"--nodes={int(nodes)}", f"--chdir={chdir}", f"--job-name={job_name}"]
    if exclude:
        argv.append(f"--exclude={','.join(exclude)}")
    return argv + [script, *map(str, args)]


def signal_argv(job_id: int, signal: str) -> list[str]:
    """Signal every task of every step of the job (not the batch shell)."""
    return ["scancel", f"--signal={signal}", str(int(job_id))]


def node_down_argv(node: str, reason: str) -> list[str]:
    """What slurmctld does when it loses a node: the node goes DOWN and its jobs are killed."""
    if not reason.strip():
        raise ValueError("a node state change needs a reason")
    return ["scontrol", "update", f"NodeName={node}", "State=DOWN", f"Reason={reason}"]


def job_state_argv(job_id: int) -> list[str]:
    return ["squeue", "-h", "-j", str(int(job_id)), "-o", "%T"]


def parse_job_id(sbatch_stdout: str) -> int:
    """`sbatch --parsable` prints `<id>[;cluster]`."""
    head = sbatch_stdout.strip().split(";")[0]
    if not head.isdigit():
        raise ValueError(f"sbatch printed no job id: {sbatch_stdout!r}")
    return int(head)


@dataclass
class SlurmOps:
    """The effects, bound to one cluster's environment (SLURM_CONF)."""
    env: Mapping[str, str]
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep

    def _run(self, argv, check=True):
        return commands.run(argv, timeout=QUERY_TIMEOUT_S, env=self.env, check=check)

    def submit(self, script: str, args: Sequence[str], *, nodes: int, chdir: str, job_name: str,
               exclude: Sequence[str] = ()) -> int:
        return parse_job_id(self._run(sbatch_argv(script, args, nodes=nodes, chdir=chdir, job_name=job_name,
                                                  exclude=exclude)).stdout)

    def signal(self, job_id: int, signal: str) -> None:
        self._run(signal_argv(job_id, signal))

    def node_down(self, node: str, reason: str) -> None:
        self._run(node_down_argv(node, reason))

    def state(self, job_id: int) -> str:
        """squeue's state of the job ('' once it left the queue)."""
        return self._run(job_state_argv(job_id), check=False).stdout.strip()

    def wait_state(self, job_id: int, done: Callable[[str], bool], what: str, timeout: float,
                   interval: float = 0.05) -> tuple[float, str]:
        """Poll until `done(state)`; returns (wall time it was seen, state). The poll interval is
        the resolution of this measurement; it is bounded by `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(job_id)
            if done(state):
                return self.clock(), state
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"job {job_id}: {what} not seen within {timeout:g}s (state {state!r})")
            self.sleep(interval)

    def cancel(self, job_id: int) -> None:
        self._run(["scancel", str(int(job_id))], check=False)


def left_running(state: str) -> bool:
    """The job no longer runs training: stopping, ended, or gone from the queue."""
    return state != "RUNNING"

