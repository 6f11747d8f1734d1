"""What Slurm tells a process of its job through the environment, read in one place.

Every `SLURM_*` variable TrainMover reads (the batch script's, a step's, a rank's) goes through
`JobEnv.read`: one spelling of each name, one rule for a missing or malformed value (a clear
ConfigError naming the variable, never a bare KeyError or ValueError), and the knowledge of
which are the allocation's (SLURM_JOB_NODELIST is what Slurm granted at start, not the job's
nodes after a resize) in one docstring. Writing a step's environment is slurm/argv.py's.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from trainmover.errors import ConfigError
from trainmover.slurm import parse

__all__ = ["JobEnv"]


def _int(environ: Mapping[str, str], name: str) -> Optional[int]:
    text = environ.get(name, "")
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number: the process's Slurm environment is damaged") from None


@dataclass(frozen=True)
class JobEnv:
    """A process's Slurm environment. None/'' where Slurm did not set the variable (outside a
    job, or a variable of another kind of process: a batch script has no SLURM_PROCID)."""

    job_id: Optional[int] = None     # SLURM_JOB_ID
    node: str = ""                   # SLURMD_NODENAME: the node this process runs on
    nodelist: str = ""               # SLURM_JOB_NODELIST: the allocation as granted at the job's start
    partition: str = ""              # SLURM_JOB_PARTITION
    proc_id: Optional[int] = None    # SLURM_PROCID: a step task's rank
    ntasks: Optional[int] = None     # SLURM_NTASKS: a step's tasks
    local_id: int = 0                # SLURM_LOCALID: the task's index on its node
    restart_count: int = 0           # SLURM_RESTART_COUNT: a requeued job's restarts

    @classmethod
    def read(cls, environ: Optional[Mapping[str, str]] = None) -> "JobEnv":
        env = os.environ if environ is None else environ
        return cls(job_id=_int(env, "SLURM_JOB_ID"), node=env.get("SLURMD_NODENAME", ""),
                   nodelist=env.get("SLURM_JOB_NODELIST", ""), partition=env.get("SLURM_JOB_PARTITION", ""),
                   proc_id=_int(env, "SLURM_PROCID"), ntasks=_int(env, "SLURM_NTASKS"),
                   local_id=_int(env, "SLURM_LOCALID") or 0, restart_count=_int(env, "SLURM_RESTART_COUNT") or 0)

    @property
    def in_job(self) -> bool:
        return self.job_id is not None

    def require_job(self, who: str) -> int:
        """The job id, or ConfigError saying that `who` runs only inside a Slurm job."""
        if self.job_id is None:
            raise ConfigError(f"{who} runs inside a Slurm job (SLURM_JOB_ID is not set)")
        return self.job_id

    def allocation(self) -> tuple[str, ...]:
        """The nodes Slurm granted at the job's start (SLURM_JOB_NODELIST expanded; () if unset)."""
        return tuple(parse.expand_hostlist(self.nodelist)) if self.nodelist else ()
