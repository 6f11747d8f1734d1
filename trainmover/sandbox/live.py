"""The live side: a rank records its collectives for the first iterations, then stops."""
from __future__ import annotations

import logging
from pathlib import Path

from trainmover.sandbox import recording

log = logging.getLogger("trainmover.sandbox")


class Recorder:
    """Wraps every group but `skip` with a RecordingBackend from construction on, records
    `iterations` steps, then puts the live backends back (the hook is removed)."""

    def __init__(self, groups: dict, path: Path, rank: int, iterations: int, skip: str):
        self.groups, self.rank, self.iterations = groups, rank, iterations
        self.writer = recording.RecordingWriter(path, rank, iterations)
        self.live = {name: g.swap(recording.RecordingBackend(g.inner, self.writer, name))
                     for name, g in groups.items() if name != skip}
        self.writer.begin("init")
        self.step_s: list[float] = []

    def before(self, step: int) -> None:
        self.writer.begin(step)

    def after(self, step: int, loss: float, step_s: float) -> dict | None:
        """Returns the 'recorded' report once the last recorded step is done, else None."""
        self.writer.end_iteration(loss)
        self.step_s.append(step_s)
        if step + 1 < self.iterations:
            return None
        for name, live in self.live.items():
            self.groups[name].swap(live)
        size = self.writer.close()
        log.info("recorded %d iterations of collectives: %d bytes, %.3fs of overhead",
                 self.iterations, size, self.writer.overhead_s)
        return {"rank": self.rank, "iterations": self.iterations, "bytes": size,
                "overhead_s": self.writer.overhead_s, "step_s": self.step_s}
