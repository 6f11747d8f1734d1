"""All Slurm access goes through this package.

* `commands.run`: the one place that forks a Slurm command (no shell, timeout, counters).
* `argv`: builders for each command line; `parse`: parsers for their output.
* `client.SlurmClient`: the interface; `client.CliSlurm`: its command-line implementation;
  `pyslurm_backend.PySlurm`: its pyslurm one; `backends.client`: either, by name.
"""

from trainmover.slurm.backends import client
from trainmover.slurm.client import CliSlurm, SlurmClient
from trainmover.slurm.model import BatchHostRelease, JobInfo, NodeInfo, NoStandbyAvailable, UnknownNodes

__all__ = ["SlurmClient", "CliSlurm", "client", "NodeInfo", "JobInfo", "NoStandbyAvailable",
           "BatchHostRelease", "UnknownNodes"]
