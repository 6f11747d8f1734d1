"""Builders for every Slurm command line TrainMover runs. Pure: they return argv
lists (no shell), tested without Slurm in tests/unit/test_slurm_parse.py."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Optional

from trainmover.slurm.model import JobInfo

DONOR_PREFIX = "trainmover-donor-"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def donor_name(job_id: int) -> str:
    """Job name of the donor allocation that grows `job_id` (used to find and cancel it)."""
    return f"{DONOR_PREFIX}{job_id}"


def show_nodes(names: Sequence[str] | None) -> list[str]:
    argv = ["scontrol", "-o", "show", "node"]
    return argv + [",".join(names)] if names else argv


# --local: no REQUEST_FED_INFO before each job query (one RPC instead of two; TrainMover's jobs
# live on the cluster that runs them). Every RPC counts against the user's rate limit.
LOCAL = "--local"


def show_job(job_id: int) -> list[str]:
    return ["scontrol", LOCAL, "-o", "show", "job", str(int(job_id))]


def show_reservation(name: str) -> list[str]:
    return ["scontrol", "-o", "show", "reservation", name]


def hostnames(expr: str) -> list[str]:
    return ["scontrol", "show", "hostnames", expr]


def donor_salloc(job_id: int, *, partition: str, reservation: str, timeout: float) -> list[str]:
    """An allocation of one whole standby node that may be merged into `job_id`.

    `--no-shell` leaves the allocation without any step (a donor with steps
    cannot be merged); `--immediate` makes salloc give up (and withdraw the
    request) when no node is granted within `timeout` seconds.
    """
    return [
        "salloc", "--no-shell", f"--dependency=expand:{int(job_id)}", f"--partition={partition}",
        f"--reservation={reservation}", "--nodes=1", "--exclusive", f"--job-name={donor_name(job_id)}",
        f"--immediate={max(1, math.ceil(timeout))}",
    ]


def merge_donor(donor_id: int) -> list[str]:
    """Give the donor's nodes to the job it depends on (expand:J)."""
    return ["scontrol", LOCAL, "update", f"JobId={int(donor_id)}", "NumNodes=0"]


def absorb(job_id: int) -> list[str]:
    """Make the job take all nodes given to it."""
    return ["scontrol", LOCAL, "update", f"JobId={int(job_id)}", "NumNodes=ALL"]


def set_nodelist(job_id: int, keep: Sequence[str]) -> list[str]:
    return ["scontrol", LOCAL, "update", f"JobId={int(job_id)}", f"NodeList={','.join(keep)}"]


def drain(node: str, reason: str) -> list[str]:
    if not reason.strip():
        raise ValueError("a drain needs a reason")
    return ["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"]


def resume(node: str) -> list[str]:
    return ["scontrol", "update", f"NodeName={node}", "State=RESUME"]


def jobs_on_node(node: str) -> list[str]:
    """Running jobs on `node`: 'id|work dir' lines."""
    return ["squeue", LOCAL, "-h", "-t", "RUNNING", "-w", node, "-o", "%i|%Z"]


def jobs_named(name: str) -> list[str]:
    """This user's jobs named `name` (--me: a job of someone else's that took the name is never
    touched, even when root or an operator runs this)."""
    return ["squeue", LOCAL, "-h", "--me", f"--name={name}", "-o", "%i"]


def scancel(job_ids: Sequence[int]) -> list[str]:
    return ["scancel", *[str(int(j)) for j in job_ids]]


def steps_of(job_id: int) -> list[str]:
    """The job's steps: 'job.step|node list|step name' lines (batch and extern steps included)."""
    return ["squeue", LOCAL, "-h", "-s", f"--jobs={int(job_id)}", "-o", "%i|%N|%j"]


def kill_step(step_id: str) -> list[str]:
    """SIGKILL every task of one step (`job.step`): no task can catch or delay it."""
    job, _, step = step_id.partition(".")
    if not (job.isdigit() and step.isdigit()):
        raise ValueError(f"not a numbered step: {step_id!r}")
    return ["scancel", "--signal=KILL", f"{job}.{step}"]


def step(
    job_id: int,
    node: str,
    argv: Sequence[str],
    *,
    ntasks: int = 1,
    env_overrides: Optional[Mapping[str, str]] = None,
    srun_args: Sequence[str] = (),
) -> list[str]:
    """`srun` for a step of `ntasks` tasks on exactly `node` of running job `job_id`.

    `--overlap` lets it share the node with the job's other steps; the explicit
    `--nodes=1 --ntasks=N` override SLURM_NNODES/SLURM_NTASKS that a batch
    script's environment carries from before a resize (without `--nodes=1`, srun
    in a grown job's batch script spreads the step over the stale node count).
    `env_overrides` are applied to the task with `env NAME=VALUE ...` (values may
    hold commas, which srun's --export cannot carry).
    """
    if ntasks < 1:
        raise ValueError(f"ntasks must be >= 1, got {ntasks}")
    if not argv:
        raise ValueError("step needs a command")
    cmd = ["srun", f"--jobid={int(job_id)}", "--overlap", "--nodes=1", f"--ntasks={ntasks}",
           f"--nodelist={node}", *srun_args]
    if env_overrides:
        bad = [k for k in env_overrides if not _ENV_NAME.match(k)]
        if bad:
            raise ValueError(f"invalid environment variable names: {bad}")
        cmd += ["env", *[f"{k}={v}" for k, v in env_overrides.items()]]
    return cmd + [str(a) for a in argv]


# Variables of a batch script's environment that describe the allocation as it
# was when the script started; after a grow or shrink they are stale.
STALE_ALLOCATION_VARS = (
    "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_NNODES",
    "SLURM_JOB_CPUS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS", "SLURM_NPROCS",
    "SLURM_NTASKS_PER_NODE",
)


def step_env(job: JobInfo, base: Mapping[str, str]) -> dict[str, str]:
    """`base` (e.g. a batch script's environment) with the allocation variables
    brought up to date for `job`'s current node list, so that srun and the tasks
    see the job as it is now rather than as it was when the batch script began."""
    env = {k: v for k, v in base.items() if k not in STALE_ALLOCATION_VARS}
    nodelist = job.nodelist or ",".join(job.nodes)
    env.update({
        "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(len(job.nodes)), "SLURM_NNODES": str(len(job.nodes)),
    })
    return env
