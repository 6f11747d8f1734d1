"""Protection of a rank's state against its loss: in-memory snapshots and checkpoints.

At the boundary after every `TM_SNAPSHOT_EVERY` / `TM_CHECKPOINT_EVERY` steps a rank copies its
full state into host memory; the exchange with the snapshot's holder (snapshot.py; on a one-node
job the standby, holding.py) and the checkpoint's write (checkpoint.py) run in background
threads. On GPUs a snapshot's copy is pinned and asynchronous (capture.py): the training stream
waits for it only before the next optimizer step (`snapshot_gate`, from the workload's
`before_update`). `holds` says what the recovery tiers can use from this rank.
"""
from __future__ import annotations

import logging
from pathlib import Path

from trainmover.groups.swappable import SNAPSHOT
from trainmover.runtime.protection import capture, checkpoint, holding, snapshot
from trainmover.runtime.transfer import state as transfer
from trainmover.protocol.messages import HoldMsg
from trainmover.runtime.context import RankContext

log = logging.getLogger("trainmover.worker")


class Protection:
    """A rank's protection role: its snapshots and checkpoints (a worker), or the snapshots it
    holds for another rank (a standby of a one-node job)."""

    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.snapshots: snapshot.Snapshots | None = None  # made once the rank is known (own_snapshots)
        self.checkpoints: checkpoint.Writer | None = None
        self.updates_gated = False  # the workload called before_update at least once: copies gated there
        self.holding: holding.Holding | None = None  # a standby: its holding of the rank it would take

    def stop_holding(self) -> None:
        """A standby that took a rank, or whose holder changed, holds nothing any more."""
        if self.holding is not None:
            self.holding.close()
            self.holding = None

    def own_snapshots(self) -> snapshot.Snapshots:
        if self.snapshots is None or self.snapshots.rank != self.ctx.rank:
            spec = self.ctx.spec
            self.snapshots = snapshot.Snapshots(self.ctx.rank, spec.world_size, spec.job.ranks_per_node,
                                                spec.job.group_timeout_s, corrupt=self.ctx.faults.at("snapshot-send"),
                                                device=self.ctx.device, key=self.ctx.key)
        return self.snapshots

    def protect(self, step: int) -> None:
        """At the boundary after `step` steps: a snapshot and/or a checkpoint when due. Only the
        copy into host memory is issued here; exchanges and writes run in background threads."""
        self._report_snapshots()
        link = self.snapshots.standby if self.snapshots is not None else None
        if link is not None and link.direct_due() and step < self.ctx.spec.job.steps:
            self._send_direct(link, step)
        every_s, every_c = self.ctx.spec.job.snapshot_every, self.ctx.spec.job.checkpoint_every
        if every_s and self.ctx.device == "cuda":
            cap = self.own_snapshots().capture
            if not cap.slabs and cap.allocating is None:
                # pinned host buffers for the first snapshot, allocated now in the background (the
                # layout is known once the optimizer has its state, after a first step)
                cap.prepare(self.ctx.full_state(step))
        due_s, due_c = every_s and step % every_s == 0, every_c and step % every_c == 0
        due_s = due_s or self._first_for_holder()
        if link is not None and not link.direct_sent:
            # the first version goes straight to the holder's GPU once its pair is built: a host
            # version now would wait for the holder's host buffers, pinned only after it
            due_s = False
        if step >= self.ctx.spec.job.steps or not (due_s or due_c):
            return
        if due_s:
            cap = self.own_snapshots().take(step, self.ctx.full_state(step), self.ctx.groups[SNAPSHOT].inner)
            if cap is not None and not self.updates_gated:
                # a workload that never called before_update: the training stream waits right
                # here (on the device), before anything of the next step can write the state
                self.snapshots.capture.gate()
        if due_c:
            if self.checkpoints is None or self.checkpoints.rank != self.ctx.rank:
                self.checkpoints = checkpoint.Writer(Path(self.ctx.spec.checkpoint_dir), self.ctx.rank,
                                                     self._checkpointed)
            # a copy of its own: a snapshot's slab is reused by a later snapshot while a slow
            # filesystem may still be writing this one
            self.checkpoints.submit(step, transfer.host_copy(self.ctx.full_state(step)), self.ctx.spec.job.group_timeout_s)

    def _send_direct(self, link: holding.StandbyLink, step: int) -> None:
        """The first version straight to the standby holder's GPU (holding.py): this step
        boundary waits for the copy, and the job is protected without any host memory pinned."""
        try:
            numbers = link.send_direct(step, self.ctx.full_state(step))
        except Exception as exc:  # noqa: BLE001 - the host versions still protect the job, later
            log.warning("first snapshot to %s's GPU failed (host versions follow): %s", link.holder, str(exc)[:300])
            return
        link.direct_ok = True
        self.ctx.send("snapshot_taken", rank=self.ctx.rank, step=step, detail={**numbers, "held_by": link.holder})

    def _pair_builder(self):
        """Builds the first version's 2-member transfer pair (NCCL between GPUs): GPU jobs only,
        where the host path's pinning is what delays protection; and one rank only. With several
        ranks on the node each would send its first version at its own first boundary after its
        pair is built, so their steps would differ, and a recovery needs one step that every
        lost rank's holder has (and the live ranks their own copy of it): the host versions,
        taken at the same multiples of TM_SNAPSHOT_EVERY by every rank, protect such jobs."""
        if self.ctx.device != "cuda" or self.ctx.spec.world_size != 1:
            return None
        return lambda store, prefix, grank: self.ctx.build_backend("xfer", prefix, grank, 2, store=store)

    def snapshot_gate(self) -> None:
        """Before the optimizer step (BuildContext.before_update): the training stream waits on
        the device for a snapshot's copies still in flight (nothing to wait for otherwise)."""
        self.updates_gated = True
        if self.snapshots is not None and self.snapshots.capture.pending is not None:
            self.snapshots.capture.gate()

    def _report_snapshots(self) -> None:
        if self.snapshots is None:
            return
        for numbers in self.snapshots.pop_reports():
            wait = self.snapshots.capture.last_gate_wait_s()
            self.ctx.send("snapshot_taken", rank=self.ctx.rank, step=int(numbers.pop("step")),
                          detail={**numbers, "gate_wait_s": wait, "skipped": self.snapshots.skipped})

    def _first_for_holder(self) -> bool:
        """One node on GPUs: the first version goes to the standby holder as soon as the link is
        built and the host buffers are pinned, not at the next multiple of the interval: until a
        holder has one, a SIGKILL loses the job's progress (measured as protection_ready_s)."""
        snaps = self.snapshots
        if self.ctx.device != "cuda" or snaps is None or not snaps.one_node or snaps.standby is None:
            return False
        link = snaps.standby
        return (link.built.is_set() and link.pair is not None and link.version == 0 and link.direct_sent
                and not link.direct_ok
                and bool(snaps.capture.slabs) and snaps.capture.ready() and not any(t.is_alive() for t in snaps.threads))

    def on_hold(self, msg: HoldMsg) -> None:
        """A worker of a one-node job: the controller names the standby that holds its snapshots
        (`holder` "": nobody, e.g. it took a rank)."""
        if not self.ctx.spec.job.snapshot_every or self.ctx.rank is None:
            return
        snaps = self.own_snapshots()
        if not snaps.one_node:
            return
        snaps.standby = None
        if msg.holder and self.ctx.rank in msg.wards:
            spec = self.ctx.spec
            snaps.standby = holding.StandbyLink(tuple(spec.store), msg.prefix, self.ctx.rank, msg.holder,
                                                 spec.node_addr, spec.job.group_timeout_s, key=self.ctx.key,
                                                 direct=self._pair_builder())
            log.info("snapshots of rank %d go to standby %s", self.ctx.rank, msg.holder)

    def hold_for(self, msg: HoldMsg) -> None:
        """A standby: hold the snapshots of the rank it would take (`wards`[its local index]) if
        it is the holder named; stop holding if another one is."""
        self.stop_holding()
        if msg.holder != self.ctx.spec.node or self.ctx.local >= len(msg.wards):
            return
        ward = int(msg.wards[self.ctx.local])

        def report(rank: int, steps: list[int], detail: dict) -> None:
            self.ctx.send("snapshot_held", node=self.ctx.spec.node, rank=rank, steps=steps, detail=detail)
        # the worker's state has this standby's own layout (same rank, same model): slabs allocated now
        _, paths, tensors = capture.flatten(self.ctx.full_state(0))
        spec = self.ctx.spec
        self.holding = holding.Holding(tuple(spec.store), msg.prefix, ward, spec.node_addr, spec.job.group_timeout_s,
                                       report, key=self.ctx.key, verify_on=self.ctx.device,
                                       layout=capture.specs_of(paths, tensors), direct=self._pair_builder())
        log.info("holding the snapshots of rank %d", ward)

    def _checkpointed(self, result: dict) -> None:
        self.ctx.send("checkpointed", rank=self.ctx.rank, step=result["step"], digest=result["digest"],
                      bytes=result["bytes"], seconds=result["seconds"])

    def holds(self) -> dict:
        """What the recovery tiers can use from this rank (the `holds` of a `stalled` report)."""
        name = self.ctx.workload.replica_group()
        replicas = next((list(g.ranks) for g in self.ctx.specs if g.name == name and self.ctx.rank in g.ranks), [])
        return {"replicas": replicas, **(self.snapshots.report() if self.snapshots else {"own": [], "held": {}})}
