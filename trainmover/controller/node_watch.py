"""Where a controller learns the Slurm state of its nodes, at the least cost to slurmctld
(docs/admin.md, "Load on slurmctld"):

* the cluster's node-state reader (slurm/node_states.py), when it runs: its table, no RPC;
* else its own poll every TM_POLL_S: one call for the job's nodes and the reservation's
  (one RPC with tm_nodes);
* and at once, a drain notice for one of its rank nodes (slurm/drain_notice.py), confirmed by
  one query about that node: Slurm's answer decides, never the file.

It also remembers whether the poll saw an idle spare in the reservation, so that a standby is
asked for (salloc: several RPCs) only when one could be granted (`PoolWatch`).

Effects only (Slurm queries, file stats); what the states mean is the policy's.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from trainmover.errors import SlurmError
from trainmover.slurm import drain_notice, node_states

log = logging.getLogger("trainmover.controller")


class PoolWatch:
    """The reservation's spare nodes, as the node poll last saw them. The reservation's node
    list is read once, and again after each standby request (an admin may have changed it)."""

    def __init__(self, slurm, reservation: str):
        self.slurm, self.reservation = slurm, reservation
        self._nodes: list[str] | None = None
        self.idle: list[str] | None = None  # None: not seen yet (then ask Slurm)

    def nodes(self) -> list[str]:
        if self._nodes is None:
            try:
                self._nodes = self.slurm.reservation_nodes(self.reservation)
            except SlurmError as exc:
                log.warning("cannot read reservation %s: %s", self.reservation, exc)
                self._nodes = []
        return self._nodes or []

    def known(self) -> list[str] | None:
        """The node list as last read (None: not read, or to be read again)."""
        return None if self._nodes is None else list(self._nodes)

    def prime(self, nodes: list[str]) -> None:
        """The node list a predecessor read (controller/durable/handover.py): not asked again."""
        self._nodes = list(nodes)

    def saw(self, states: dict) -> None:
        if self._nodes:
            self.idle = [n for n in self._nodes if n in states and states[n].idle]

    def none_idle(self) -> str:
        """Why not to ask for a standby now ("": ask)."""
        if self.idle == []:
            return f"no idle node in reservation {self.reservation} at the last node poll"
        return ""

    def asked(self) -> None:
        """A standby request is made: read the reservation again at the next poll."""
        self._nodes = None

    def none_granted(self) -> None:
        """A request found none free: wait for a poll that sees one idle."""
        self.idle = []


def notice_watcher(setting: str, slurm_conf: str | None) -> drain_notice.Watcher | None:
    """TM_DRAIN_NOTICES: "off", "auto" (beside slurm.conf, when there) or a directory."""
    if setting == "off":
        return None
    directory = drain_notice.default_dir(slurm_conf) if setting == "auto" else Path(setting)
    if directory is None:
        return None
    watcher = drain_notice.Watcher(directory)
    if watcher.refused:
        log.warning("%s", watcher.refused)
    return watcher


class NodeWatch:
    def __init__(self, slurm, *, reservation: str, poll_s: float, notices: str, slurm_conf: str | None):
        self.slurm, self.poll_s = slurm, poll_s
        self.pool = PoolWatch(slurm, reservation)
        self.notices = notice_watcher(notices, slurm_conf)
        self.shared = node_states.Shared(self.notices.directory) if self.notices is not None else None
        self._shared_at = 0.0
        self._on_shared = False
        self.next_poll = 0.0
        self.seen: dict = {}  # node -> its NodeInfo at the last poll (the reservation's spares too)
        self._primed: dict | None = None
        # node -> how and when its current drain was first seen ("node-reader", "poll", "drain
        # notice", "start"): status.json says it, so that a user (and `trainmover demo`) can tell
        # why a drain took the time it did
        self.drains_seen: dict[str, dict] = {}

    def prime(self, now: float, states: dict) -> None:
        """The controller's first read of its nodes and the reservation's (`states`) stands in for
        the first poll: one RPC fewer at every start and takeover."""
        self._primed = dict(states)
        self.next_poll = now + self.poll_s

    def addr(self, node: str) -> str:
        """`node`'s address as the last poll saw it ("" if it did not): a standby just taken is one
        of the reservation's nodes, which every poll reads, so it costs no query of its own."""
        info = self.seen.get(node)
        return info.addr if info is not None else ""

    def turn(self, now: float, mine: list[str], ranks: Iterable[str]) -> dict:
        """States new this loop turn (node -> NodeInfo) of `mine` (the job's nodes), and of a rank
        node in `ranks` whose drain notice just came; {} when nothing new."""
        states = {}
        via = "poll"
        wanted = list(dict.fromkeys(list(mine) + self.pool.nodes()))
        table = self.shared.read(now) if self.shared is not None else None
        if table is not None and all(n in table[1] for n in wanted):
            self.next_poll = now + self.poll_s  # the cluster's reader stands in for our poll
            self._on_shared = True
            via = "node-reader"
            if table[0] != self._shared_at:
                self._shared_at = table[0]
                states = {n: table[1][n] for n in wanted}
        elif self._primed is not None:
            states, self._primed, via = self._primed, None, "start"
        elif now >= self.next_poll or self._on_shared:  # the reader's table just went stale: poll now
            # On a fixed grid: a turn that comes a little late (the loop waits up to 0.2 s) does not
            # push the next poll back, so that a drain is seen within TM_POLL_S of the last poll and a
            # minute holds 60 / TM_POLL_S polls, not fewer and never more.
            late = now - self.next_poll
            self.next_poll = (self.next_poll if 0 <= late < self.poll_s and not self._on_shared else now) + self.poll_s
            self._on_shared = False
            try:
                states = self.slurm.nodes(wanted)
            except SlurmError as exc:  # slurmctld slow or down: keep training, try again
                log.warning("node poll failed: %s", exc)
        if states:
            self.pool.saw(states)
            self.seen.update(states)
        states = {n: i for n, i in states.items() if n in set(mine)}
        self._note_drains(now, states, via)
        fresh = self.notices.fresh(ranks) if self.notices is not None else []
        if fresh:
            try:
                confirmed = self.slurm.nodes(fresh)
                log.info("drain notice for %s; Slurm says %s", fresh, {n: i.state for n, i in confirmed.items()})
                self._note_drains(now, confirmed, "drain notice")
                states.update(confirmed)
            except SlurmError as exc:  # the next poll finds the drain
                log.warning("drain notice for %s: cannot confirm with Slurm: %s", fresh, exc)
        return states

    def _note_drains(self, now: float, states: dict, via: str) -> None:
        for n, info in states.items():
            if info.draining or info.drained:
                if n not in self.drains_seen:
                    self.drains_seen[n] = {"via": via, "at": round(now, 3)}
                    log.info("drain of %s seen through %s", n, via)
            else:
                self.drains_seen.pop(n, None)  # resumed: its next drain is a new one

    def status(self) -> dict:
        """For status.json: where the node states come from now, and how each drain was seen."""
        return {"source": "node-reader" if self._on_shared else "poll", "poll_s": self.poll_s,
                "drains_seen": dict(self.drains_seen)}
