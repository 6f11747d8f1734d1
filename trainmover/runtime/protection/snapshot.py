"""In-memory snapshots: the snapshot tier of recovery from an unexpected failure.

Every `TM_SNAPSHOT_EVERY` steps, at the same step boundary on every rank, each rank keeps a
host-memory copy of its full state (model, optimizer, data position, RNG, step) and sends
another copy to its *holder*, a rank on another node, over the job's snapshot group (a
dedicated gloo group, never a node-local file): the holder is the same local index on the
next node (`holder_of`). The copy is checksummed end to end (`transfer.send_verified`).

Versions: two are kept (the newest and the one before), own and held alike, so that a failure
during an exchange still leaves the previous version complete on every live rank. Memory per
rank: 2 own + 2 held copies of one rank's state (4x its state bytes), plus one transient
buffer per dtype while a copy is on the wire.

Why ranks and not nodes: a migration always moves a whole node's ranks onto one standby, so
rank r + ranks_per_node is on the next node before and after it; the node that runs each rank
changes, and with it where the copies are. A process that joined (a standby) holds nothing
until the next snapshot; the controller decides from what each live rank *reports* it holds
(`report`), never from the mapping.

One training node: there is no other node, and the warm standby holds the copies (holding.py
says why): the controller assigns it (`hold`), and each version goes to it (`StandbyLink`)
instead of a ward exchange. Only the newest own version is kept then (no live rank would be
left to roll back with an older one), and a snapshot that comes due while the previous one is
still on its way to the standby is skipped rather than waited for: training never waits for
the network.

The copy into host memory is `capture.Capture`: on GPUs pinned, asynchronous and off the
training stream (the next optimizer step waits for it on the device: `gate`); on CPU nodes at
once.
"""
from __future__ import annotations

import logging
import threading
import time

from trainmover.runtime.protection import capture
from trainmover.runtime.transfer import state as transfer

log = logging.getLogger("trainmover.snapshot")

KEEP = 2  # versions kept: the newest and the one before


def holder_of(rank: int, world: int, per_node: int) -> int:
    """The rank holding `rank`'s copies: the same local index on the next node (in rank order,
    which is node order: ranks are assigned node by node and move with their node)."""
    return (rank + per_node) % world


def ward_of(rank: int, world: int, per_node: int) -> int:
    """The rank whose copies `rank` holds."""
    return (rank - per_node) % world


def _newest(versions: dict[int, dict], keep: int) -> dict[int, dict]:
    return {s: versions[s] for s in sorted(versions)[-keep:]}


class Snapshots:
    """One rank's snapshots: its own versions and those it holds for its ward (or, on a one-node
    job, the link to the standby that holds them)."""

    def __init__(self, rank: int, world: int, per_node: int, timeout_s: float, corrupt: bool = False,
                 device: str = "cpu", key: bytes | None = None):
        """`key`: the job's, sealing each copy's manifest (transfer.seal_manifest)."""
        self.rank, self.world, self.per_node = rank, world, per_node
        self.key = key
        self.timeout_s = timeout_s
        self.corrupt = corrupt  # fault injection: the first copy sent is spoilt on the wire
        self.one_node = holder_of(rank, world, per_node) == rank
        self.capture = capture.Capture(device, slabs=1 if self.one_node else KEEP)
        self.own: dict[int, capture.Captured | dict] = {}
        self.held: dict[int, dict[int, dict]] = {}  # ward rank -> step -> state
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.last: dict = {}  # the last version: step, bytes, seconds, copy_s, ...
        self.standby = None   # one node: the link to the standby that holds our copies (holding.StandbyLink)
        self.skipped = 0      # one node: versions skipped while the one before was still on its way
        self.reports: list[dict] = []  # finished versions' numbers, for the controller (`snapshot_taken`)

    @property
    def holder(self) -> int:
        return holder_of(self.rank, self.world, self.per_node)

    @property
    def ward(self) -> int:
        return ward_of(self.rank, self.world, self.per_node)

    def take(self, step: int, state: dict, group) -> capture.Captured | None:
        """At a step boundary: a host copy of this rank's `state` of `step` (capture.Capture), and
        the exchange of copies in background threads: with holder and ward on `group` (the
        snapshot group's backend; group rank == global rank), or with the standby holder on a
        one-node job. Returns the capture, None when skipped.

        The previous exchange is waited for first (bounded): versions go out in step order. On
        a one-node job a version still on its way means this one is skipped instead."""
        if not self.capture.ready():  # host buffers still being pinned (capture.prepare): never wait for them
            self.skipped += 1
            log.warning("snapshot %d skipped: host buffers still being allocated", step)
            return None
        if self.one_node and any(t.is_alive() for t in self.threads):
            self.skipped += 1
            log.warning("snapshot %d skipped: version %s still on its way to the standby (%d skipped so far)",
                        step, self.last.get("step"), self.skipped)
            return None
        self._join(time.monotonic() + self.timeout_s)
        cap = self.capture.take(step, state)
        with self.lock:
            self.own = _newest({**self.own, step: cap}, 1 if self.one_node else KEEP)
        self.last = {"step": step, "issue_s": cap.issue_s, "bytes": cap.slab.bytes, "pinned": cap.slab.pinned,
                     "alloc_s": self.capture.prepare_s}
        if self.one_node:
            self.threads = [threading.Thread(target=self._to_standby, args=(cap,), name="tm-snap-standby",
                                             daemon=True)]
        else:
            self.threads = [threading.Thread(target=self._send, args=(cap, group), name="tm-snap-send", daemon=True),
                            threading.Thread(target=self._recv, args=(step, group), name="tm-snap-recv",
                                             daemon=True)]
        for t in self.threads:
            t.start()
        return cap

    def _join(self, deadline: float) -> None:
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():  # its peer is gone or stuck: the group timeout ends it; go on without waiting
                log.warning("snapshot exchange %s still running after %.0fs; not waited for", t.name, self.timeout_s)
        self.threads = []

    def _finish(self, cap: capture.Captured, **numbers) -> None:
        self.last.update(copy_s=cap.copy_s, staged=cap.staged is not None, stage_s=cap.stage_s, **numbers)
        self.reports.append(dict(self.last))

    def _to_standby(self, cap: capture.Captured) -> None:
        try:
            cap.wait(self.timeout_s)
            link = self.standby
            if link is None:
                self._finish(cap, held_by=None)
                return
            stats = link.send(cap, corrupt=self.corrupt)
            self.corrupt = False
            self._finish(cap, held_by=link.holder, **stats)
        except Exception as exc:  # noqa: BLE001 - a lost standby: this version is not held, training goes on
            log.warning("snapshot %d: copy to the standby failed: %s", cap.step, str(exc)[:300])
            self._finish(cap, held_by=None, error=str(exc)[:300])

    def _send(self, cap: capture.Captured, group) -> None:
        try:
            cap.wait(self.timeout_s)
            stats = transfer.send_verified(cap.state(), group, key=self.key, context=f"snapshot/r{self.rank}",
                                           dst=self.holder, corrupt=self.corrupt)
            self.corrupt = False
            self._finish(cap, send_s=stats.seconds, attempts=stats.attempts, held_by=self.holder)
        except Exception as exc:  # noqa: BLE001 - a lost peer: this version is incomplete, training goes on
            log.warning("snapshot %d: copy to rank %d failed: %s", cap.step, self.holder, str(exc)[:300])

    def _recv(self, step: int, group) -> None:
        ward = self.ward
        try:
            state, _ = transfer.recv_verified(group, key=self.key, context=f"snapshot/r{ward}", src=ward)
        except Exception as exc:  # noqa: BLE001 - as above
            log.warning("snapshot %d: copy from rank %d failed: %s", step, ward, str(exc)[:300])
            return
        if int(state["step"]) != step:
            log.error("snapshot %d: rank %d sent step %s; not kept", step, ward, state["step"])
            return
        with self.lock:
            self.held[ward] = _newest({**self.held.get(ward, {}), step: state}, KEEP)

    def wait(self, timeout_s: float) -> None:
        """Wait (bounded) for the exchange in flight: tests and benchmarks."""
        self._join(time.monotonic() + timeout_s)

    def report(self) -> dict:
        """What this rank holds, for the controller's choice of a step to roll back to."""
        with self.lock:
            return {"own": sorted(self.own), "held": {str(w): sorted(v) for w, v in self.held.items()}}

    def own_state(self, step: int) -> dict:
        with self.lock:
            if step not in self.own:
                raise KeyError(f"rank {self.rank} holds no snapshot of step {step} (has {sorted(self.own)})")
            version = self.own[step]
        if isinstance(version, capture.Captured):
            version.wait(self.timeout_s)
            return version.state()
        return version

    def pop_reports(self) -> list[dict]:
        """Numbers of the versions finished since the last call (for `snapshot_taken`)."""
        out, self.reports = self.reports, []
        return out

    def held_state(self, ward: int, step: int) -> dict:
        with self.lock:
            versions = self.held.get(ward, {})
            if step not in versions:
                raise KeyError(f"rank {self.rank} holds no snapshot of rank {ward} at step {step} "
                               f"(has {sorted(versions)})")
            return versions[step]

    def rolled_back(self, step: int, mine: dict | None = None) -> None:
        """After a rollback to `step`: versions past it belong to steps that are redone (equal
        anyway, but not yet agreed); `mine`: a joiner's own state of `step`, received."""
        with self.lock:
            if mine is not None:
                self.own[step] = mine
            self.own = {s: v for s, v in self.own.items() if s <= step}
            self.held = {w: {s: v for s, v in vs.items() if s <= step} for w, vs in self.held.items()}
