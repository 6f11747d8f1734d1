"""After the health check drained its node: the drain notice that tells the controllers of the
jobs there at once (trainmover/slurm/drain_notice.py), instead of at their next node poll.

Kept apart from run.py: the health check runs as root, and this is its only write outside its
own state directory. A notice that cannot be written is a note, never a failure: the jobs
still find the drain by their poll (TM_POLL_S)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from trainmover.slurm import drain_notice


def announce(directory: Optional[Path], node: str, reason: str) -> list[str]:
    """Write the notice for `node` into `directory` (None: no notices); notes for the report."""
    if directory is None:
        return []
    try:
        drain_notice.publish(directory, node, reason, time.time())
    except (OSError, ValueError) as exc:
        return [f"drain notice for {node} not written ({exc}); jobs there see the drain at their next node poll"]
    return []
