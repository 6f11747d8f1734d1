"""The Slurm backend by name (`TM_SLURM_BACKEND`): 'cli' (`client.CliSlurm`, the command line)
or 'pyslurm' (`pyslurm_backend.PySlurm`, the C API where it has the call). Siblings behind one
interface (`client.SlurmClient`), chosen here, above both: the interface's module never imports
an implementation, and pyslurm is imported only when asked for."""
from __future__ import annotations

from typing import Any

from trainmover.errors import SlurmError
from trainmover.slurm.client import CliSlurm, SlurmClient


def client(backend: str = "cli", **kwargs: Any) -> SlurmClient:
    """The Slurm backend by name: 'cli', or 'pyslurm' (needs a pyslurm built against the
    cluster's Slurm, pyslurm 25.11 for Slurm 25.11; SlurmError naming the fix otherwise)."""
    if backend == "cli":
        return CliSlurm(**kwargs)
    if backend == "pyslurm":
        from trainmover.slurm.pyslurm_backend import PySlurm  # imports pyslurm: only when asked for
        return PySlurm(**kwargs)
    raise SlurmError(f"unknown Slurm backend {backend!r} (available: 'cli', 'pyslurm')")
