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
"""
from __future__ import annotations

import logging
import threading
import time

from trainmover.runtime import transfer

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
    """One rank's snapshots: its own versions and those it holds for its ward."""

    def __init__(self, rank: int, world: int, per_node: int, timeout_s: float, corrupt: bool = False):
        self.rank, self.world, self.per_node = rank, world, per_node
        self.timeout_s = timeout_s
        self.corrupt = corrupt  # fault injection: the first copy sent is spoilt on the wire
        self.own: dict[int, dict] = {}
        self.held: dict[int, dict[int, dict]] = {}  # ward rank -> step -> state
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.last: dict = {}  # the last exchange: bytes, seconds, copy_s

    @property
    def holder(self) -> int:
        return holder_of(self.rank, self.world, self.per_node)

    @property
    def ward(self) -> int:
        return ward_of(self.rank, self.world, self.per_node)

    def take(self, step: int, state: dict, group) -> dict:
        """At a step boundary: keep a host copy of this rank's `state` of `step`, and exchange
        copies with holder and ward on `group` (the snapshot group's backend; group rank ==
        global rank) in two background threads. Returns the copy (read-only to callers).

        The previous exchange is waited for first (bounded): versions go out in step order."""
        self._join(time.monotonic() + self.timeout_s)
        t0 = time.perf_counter()
        copy = transfer.host_copy(state)
        copy_s = time.perf_counter() - t0
        with self.lock:
            self.own = _newest({**self.own, step: copy}, KEEP)
        self.last = {"step": step, "copy_s": copy_s}
        if self.holder == self.rank:  # one node: no other node to hold a copy
            return copy
        self.threads = [threading.Thread(target=self._send, args=(step, copy, group), name="tm-snap-send",
                                         daemon=True),
                        threading.Thread(target=self._recv, args=(step, group), name="tm-snap-recv", daemon=True)]
        for t in self.threads:
            t.start()
        return copy

    def _join(self, deadline: float) -> None:
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():  # its peer is gone or stuck: the group timeout ends it; go on without waiting
                log.warning("snapshot exchange %s still running after %.0fs; not waited for", t.name, self.timeout_s)
        self.threads = []

    def _send(self, step: int, copy: dict, group) -> None:
        try:
            stats = transfer.send_verified(copy, group, dst=self.holder, corrupt=self.corrupt)
            self.corrupt = False
            self.last.update(bytes=stats.bytes, send_s=stats.seconds, attempts=stats.attempts)
        except Exception as exc:  # noqa: BLE001 - a lost peer: this version is incomplete, training goes on
            log.warning("snapshot %d: copy to rank %d failed: %s", step, self.holder, str(exc)[:300])

    def _recv(self, step: int, group) -> None:
        ward = self.ward
        try:
            state, _ = transfer.recv_verified(group, src=ward)
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
            return self.own[step]

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
