"""Who holds a one-node job's snapshots, and what the holders and the ranks report (pure).

With two or more training nodes each rank's snapshot goes to the same local index on the next
node (runtime/protection/snapshot.py). A job with one training node has no other node: its warm standby
holds them (runtime/protection/holding.py says why). This part of the policy decides which standby: the first ready
one, while the job has one training node and takes snapshots; a holder that is no longer a
standby (lost, or it took the node's ranks) is replaced by the next ready one. Both sides are
told with one `hold` message (holder node, the node's ranks, a store prefix new for each
assignment, so that a new link never meets an old one's keys); `holder: ""` tells the ranks
to stop sending.

What the recovery tiers may use is what the holder *reports* (`snapshot_held`: the complete,
verified versions of each rank), kept on its `Standby` (`held`); a recovery prefers the holder
as the joiner (controller/policy/recovery.py), which then needs no copy over the network.
"""
from __future__ import annotations

import logging

from trainmover.controller.durable.state import PolicyState
from trainmover.controller.policy.actions import Send
from trainmover.controller.policy.standby_pool import StandbyPool
from trainmover.protocol.messages import SnapshotHeldMsg, SnapshotTakenMsg, make

log = logging.getLogger("trainmover.policy")

TAKEN_KEPT = 8  # `snapshot_taken` reports kept per rank for status (the newest)


class SnapshotHolder:
    """The policy's part that picks the holder and keeps what holders and ranks report."""

    def __init__(self, state: PolicyState, pool: StandbyPool):
        self.state, self.pool = state, pool
        # Not journaled: a successor assigns a holder afresh (its `hold` message re-links the
        # ranks, under a new prefix: state.holder_seq is journaled), and the holders and ranks
        # report what they hold and took again.
        self.holder: str | None = None     # the standby holding the one training node's snapshots
        self.taken: dict[str, list] = {}   # rank -> its last `snapshot_taken` reports, for status

    def actions(self, now: float, snapshot_every: int, reported: set) -> list:
        """Drop a holder that is no longer a standby; assign a ready standby if none holds.
        `reported`: the ranks that reported a step (a message before could reach nobody)."""
        view = self.state.view
        actions = []
        nodes = tuple(view.train_nodes())
        if self.holder is not None and self.holder not in view.standbys:
            log.info("snapshot holder %s is no longer a standby; the ranks stop sending to it", self.holder)
            self.holder = None
            actions.append(Send(nodes, make("hold", holder="", wards=[], prefix="")))
        if self.holder is not None or not snapshot_every or len(nodes) != 1:
            return actions
        if not all(r in reported for r in view.ranks_of(nodes[0])):
            return actions  # its ranks have not reported a step yet: a message now could reach nobody
        ready = self.pool.ready_nodes()  # it stays READY: holding is no join
        if not ready:
            return actions
        self.holder = ready[0]
        self.state.holder_seq += 1
        msg = make("hold", holder=self.holder, wards=list(view.ranks_of(nodes[0])),
                   prefix=f"tm/hold/a{self.state.holder_seq}/")
        log.info("snapshots of %s (ranks %s) held by standby %s", nodes[0], msg["wards"], self.holder)
        return actions + [Send(nodes + (self.holder,), msg)]

    def on_held(self, node: str, msg: SnapshotHeldMsg) -> list:
        s = self.pool.get(node)
        if s is not None:
            s.held[int(msg.rank)] = sorted(int(x) for x in msg.steps)
            s.held_detail = dict(msg.detail)
        return []

    def on_taken(self, msg: SnapshotTakenMsg) -> list:
        kept = self.taken.setdefault(str(msg.rank), [])
        kept.append({"step": msg.step, **msg.detail})
        del kept[:-TAKEN_KEPT]
        return []

    def joiner_order(self, ready: list[str]) -> list[str]:
        """Ready standbys in the order a recovery takes them: the holder first."""
        return sorted(ready, key=lambda n: (n != self.holder, n))

    def status(self) -> dict:
        s = self.pool.get(self.holder) if self.holder else None
        return {"holder": self.holder, "held": {str(r): v for r, v in (s.held if s else {}).items()},
                "held_detail": s.held_detail if s else {},
                "taken": {r: list(v) for r, v in self.taken.items()}}
