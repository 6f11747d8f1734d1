"""One node-state reader per cluster: a root service reads every node's state from slurmctld in
one RPC every few seconds and writes it into the drain-notice directory (`.node-states.json`),
where every job's controller reads it instead of asking slurmctld itself.

    trainmover node-reader [--notices DIR] [--interval 2]     (root; a systemd service at a site)

The cost to slurmctld is one RPC per interval for the whole cluster, however many jobs run
(root: outside the per-user rate limit); each job's own poll (TM_POLL_S) is the fallback, used
whenever the file is missing, older than `STALE_AFTER` intervals, or not root's alone (the
trust rule of drain_notice.py). docs/admin.md, "Load on slurmctld", says what a site sets up.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Callable, Optional

from trainmover.errors import TrainMoverError
from trainmover.slurm import drain_notice
from trainmover.slurm.model import NodeInfo

__all__ = ["FILE", "write", "Shared", "serve"]

FILE = ".node-states.json"  # a leading dot: never taken for a node's drain notice
STALE_AFTER = 3             # intervals without a new file: the reader is gone, poll instead

log = logging.getLogger("trainmover.node_reader")


def write(directory: Path, states: dict[str, NodeInfo], now: float, interval: float) -> Path:
    data = {"at": now, "interval": interval,
            "nodes": {n: [i.addr, i.state, i.reason, list(i.features)] for n, i in states.items()}}
    return drain_notice.write_root_file(Path(directory), FILE, json.dumps(data).encode())


class Shared:
    """A controller's side: the reader's last table, re-read only when the file changed."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._mtime: Optional[int] = None
        self._at = 0.0
        self._interval = 0.0
        self._nodes: dict[str, NodeInfo] = {}

    def read(self, now: float) -> Optional[tuple[float, dict[str, NodeInfo]]]:
        """(when the reader read it, node -> NodeInfo) while fresh; None when there is no fresh,
        trusted table (then the caller polls Slurm itself)."""
        try:  # every loop turn: one lstat while the table is unchanged, a read when it changed
            st = os.lstat(self.directory / FILE)
        except OSError:
            return None
        if st.st_mtime_ns != self._mtime or not stat.S_ISREG(st.st_mode) or not drain_notice.root_only(st):
            got = drain_notice.read_root_file(self.directory, FILE)
            if got is None:
                return None
            raw, mtime = got
            try:
                data = json.loads(raw)
                nodes = {n: NodeInfo(n, a, s, r, tuple(f)) for n, (a, s, r, f) in data["nodes"].items()}
                self._at, self._interval, self._nodes = float(data["at"]), float(data["interval"]), nodes
            except (ValueError, KeyError, TypeError):
                return None
            self._mtime = mtime
        if now - self._at > STALE_AFTER * self._interval:
            return None
        return self._at, self._nodes


def serve(slurm, directory: Path, interval: float, *, clock: Callable[[], float] = time.time,
          sleep: Callable[[float], None] = time.sleep, rounds: Optional[int] = None) -> None:
    """Read every node (one call) and write the table, every `interval` seconds; a failed read
    is logged and the file left to go stale (the jobs then poll for themselves)."""
    n = 0
    while rounds is None or n < rounds:
        started = clock()
        try:
            write(directory, slurm.nodes(), started, interval)
        except (TrainMoverError, OSError) as exc:
            log.warning("node states not written: %s", exc)
        n += 1
        sleep(max(0.0, interval - (clock() - started)))
