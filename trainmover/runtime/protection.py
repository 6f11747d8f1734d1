"""Protection of a rank's state against its loss: in-memory snapshots and checkpoints.

At the boundary after every `TM_SNAPSHOT_EVERY` / `TM_CHECKPOINT_EVERY` steps a rank copies its
full state into host memory (the only part on the training thread); the exchange with the
snapshot's holder on the next node (snapshot.py) and the checkpoint's write (checkpoint.py) run
in background threads. `holds` says what the recovery tiers can use from this rank.
"""
from __future__ import annotations

from pathlib import Path

from trainmover.runtime import checkpoint, snapshot, transfer
from trainmover.runtime.groups import SNAPSHOT


class Protection:
    """Mixed into `Agent` (worker.py): uses its spec, rank, groups, full_state and send."""

    def snapshot_keeper(self) -> snapshot.Snapshots:
        if self.snapshots is None or self.snapshots.rank != self.rank:
            self.snapshots = snapshot.Snapshots(self.rank, self.spec.world_size, self.spec.ranks_per_node,
                                                self.spec.group_timeout_s, corrupt=self.faults.at("snapshot-send"))
        return self.snapshots

    def protect(self, step: int) -> None:
        """At the boundary after `step` steps: a snapshot and/or a checkpoint when due. Only the
        copy into host memory happens here; exchanges and writes run in background threads."""
        every_s, every_c = self.spec.snapshot_every, self.spec.checkpoint_every
        due_s, due_c = every_s and step % every_s == 0, every_c and step % every_c == 0
        if step >= self.spec.steps or not (due_s or due_c):
            return
        copy = None
        if due_s:
            copy = self.snapshot_keeper().take(step, self.full_state(step), self.groups[SNAPSHOT].inner)
        if due_c:
            if self.checkpoints is None or self.checkpoints.rank != self.rank:
                self.checkpoints = checkpoint.Writer(Path(self.spec.checkpoint_dir), self.rank, self._checkpointed)
            state = copy if copy is not None else transfer.host_copy(self.full_state(step))
            self.checkpoints.submit(step, state, self.spec.group_timeout_s)

    def _checkpointed(self, result: dict) -> None:
        self.send("checkpointed", rank=self.rank, step=result["step"], digest=result["digest"],
                  bytes=result["bytes"], seconds=result["seconds"])

    def holds(self) -> dict:
        """What the recovery tiers can use from this rank (the `holds` of a `stalled` report)."""
        name = self.workload.replica_group()
        replicas = next((list(g.ranks) for g in self.specs if g.name == name and self.rank in g.ranks), [])
        return {"replicas": replicas, **(self.snapshots.report() if self.snapshots else {"own": [], "held": {}})}
