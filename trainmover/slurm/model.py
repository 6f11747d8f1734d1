"""Values that describe the cluster as TrainMover sees it, and the Slurm errors.

Backend-neutral: the CLI backend and a future pyslurm backend both return these.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmover.errors import SlurmError

# The node features a TrainMover job asks for (docs/admin.md, "No special node"): its batch
# script runs on a keeper node, its ranks on training nodes. Here, beside the node values,
# because the keeper, the controller and the embedded cluster all need them.
KEEPER_FEATURE = "tm_keeper"
TRAIN_FEATURE = "tm_train"

__all__ = ["KEEPER_FEATURE", "TRAIN_FEATURE", "NodeInfo", "JobInfo", "SlurmError", "NoStandbyAvailable", "BatchHostRelease", "UnknownNodes"]


class NoStandbyAvailable(SlurmError):
    """No standby node of the reservation could be absorbed within the deadline.
    Nothing was changed: the donor request was withdrawn and the job keeps running."""


class BatchHostRelease(SlurmError):
    """A shrink would release the node that runs the job's batch script; Slurm
    cannot do that (scontrol answers only 'Invalid node name specified')."""


class UnknownNodes(SlurmError):
    """Slurm does not know one or more of the requested node names."""


# Node base states whose node holds (or is ending) a job allocation.
_BUSY = {"ALLOCATED", "MIXED", "COMPLETING"}


@dataclass(frozen=True)
class NodeInfo:
    """One node. `state` is Slurm's compact node state as `scontrol show node`
    prints it: the base state, then '+'-joined flags (e.g. 'ALLOCATED+DRAIN',
    'IDLE+RESERVED', 'DOWN+NOT_RESPONDING')."""

    name: str
    addr: str
    state: str
    reason: str = ""
    features: tuple[str, ...] = ()   # ActiveFeatures (e.g. tm_keeper: see controller/succession/keeper.py)

    @property
    def base_state(self) -> str:
        return self.state.split("+", 1)[0].upper()

    @property
    def flags(self) -> frozenset[str]:
        return frozenset(f.upper() for f in self.state.split("+")[1:])

    @property
    def busy(self) -> bool:
        """The node holds (part of) a job allocation."""
        return self.base_state in _BUSY or "COMPLETING" in self.flags

    @property
    def unresponsive(self) -> bool:
        """slurmctld lost the node's slurmd (DOWN, or NOT_RESPONDING after SlurmdTimeout)."""
        return self.base_state == "DOWN" or "NOT_RESPONDING" in self.flags

    @property
    def draining(self) -> bool:
        """Drain requested, a job still runs there (sinfo: 'draining')."""
        return "DRAIN" in self.flags and self.busy

    @property
    def drained(self) -> bool:
        """Drain requested and no job left (sinfo: 'drained')."""
        return "DRAIN" in self.flags and not self.busy

    @property
    def down(self) -> bool:
        return self.base_state == "DOWN" or "NOT_RESPONDING" in self.flags

    @property
    def idle(self) -> bool:
        """Free for a new allocation: idle, not draining, down or powered off, and no job still
        completing there (the scheduler will not place a job on it until its epilog ends)."""
        blocked = {"COMPLETING", "DRAIN", "NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN", "MAINTENANCE", "FAIL", "REBOOT_REQUESTED"}
        return self.base_state == "IDLE" and not (self.flags & blocked)

    @property
    def reserved(self) -> bool:
        return "RESERVED" in self.flags


@dataclass(frozen=True)
class JobInfo:
    """One job. `nodes` is the expanded node list; `nodelist` is Slurm's own
    (compressed) expression for it, e.g. 'spare1,train[1-2]'."""

    job_id: int
    state: str
    nodes: tuple[str, ...]
    batch_host: str
    restart_count: int
    work_dir: str
    partition: str
    num_nodes: int
    nodelist: str = ""
    name: str = ""
    reason: str = ""
    user_id: int = -1  # Slurm's UserId (its uid); -1: not known (root's `migrate` then refuses)

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"
