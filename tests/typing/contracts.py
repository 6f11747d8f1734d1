"""What the type checker proves of the interfaces (`make test`'s mypy phase checks this file):
each implementation is what its Protocol says, method by method, so that a change to one side
that the other does not follow fails the check, not a job.

* `runtime.context.RankContext`: what a rank's roles may use of their process; `worker.Agent`
  is that process.
* `slurm.client.SlurmClient`: all Slurm access; `CliSlurm` (the command line) and `PySlurm`
  (pyslurm) are its two backends.

Nothing here runs: pytest does not collect this file, and no code imports it.
"""
from __future__ import annotations

from trainmover.runtime.context import RankContext
from trainmover.runtime.worker import Agent
from trainmover.slurm.client import CliSlurm, SlurmClient
from trainmover.slurm.pyslurm_backend import PySlurm


def the_agent_is_a_rank_context(agent: Agent) -> RankContext:
    return agent


def both_backends_are_slurm_clients(cli: CliSlurm, pyslurm: PySlurm) -> tuple[SlurmClient, SlurmClient]:
    return cli, pyslurm
