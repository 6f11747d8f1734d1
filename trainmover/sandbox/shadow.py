"""The standby side: shadow iterations answered from the live job's recording."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from trainmover.runtime.groups import SandboxBackend, SwappableGroup
from trainmover.sandbox import recording

log = logging.getLogger("trainmover.sandbox")


def replay(specs, path: Path, timeout_s: float, local_only: str,
           build: Callable[[int, dict], object], step: Callable[[int], float]) -> tuple[dict, dict]:
    """Rehearse the recorded rank: build its groups (sandboxed, answered from the recording
    except `local_only`), call `build(rank, groups)`, run the recorded iterations with `step`,
    and compare the losses. Returns (groups, report); report["replay"] != "done" says why
    nothing was replayed (the caller then warms up with locally answered collectives)."""
    ok, why = recording.available()
    if not ok:
        return {}, {"replay": f"unavailable: {why}"}
    deadline = time.monotonic() + timeout_s
    log.info("standby waits for the recording %s", path)
    while not path.exists():  # written by the live rank during its first iterations
        if time.monotonic() > deadline:
            return {}, {"replay": f"unavailable: no recording at {path} after {timeout_s:.0f}s"}
        time.sleep(0.2)
    rec = recording.Replay(path)
    rank = rec.rank
    log.info("replaying %d recorded iterations of rank %d", rec.iterations, rank)
    groups = {}
    for g in specs:
        if rank in g.ranks:
            grank = g.ranks.index(rank)
            answers = None if g.name == local_only else rec.for_group(g.name)
            groups[g.name] = SwappableGroup(g.name, grank, len(g.ranks), list(g.ranks),
                                            SandboxBackend(grank, len(g.ranks), answers=answers))
    rec.begin("init")
    build(rank, groups)
    pairs = []
    for it in range(rec.iterations):
        rec.begin(it)
        pairs.append((rec.loss(it), step(it)))
    rec.close()
    for g in groups.values():  # later shadow steps: answered locally
        g.swap(SandboxBackend(g.rank(), g.size()))
    return groups, {"replay": "done", "rank": rank, "iterations": len(pairs),
                    "recorded_losses": [a for a, _ in pairs], "shadow_losses": [b for _, b in pairs],
                    "loss_equal": all(a == b for a, b in pairs)}
