"""Phase 1: build the replacement groups while training continues.

Runs in a background thread on every member of a changed group (stayers and joiner) and on
the leaver (which only builds its transfer group with the joiner). Nothing the live job uses
is touched: the result is a set of new backends, kept aside until the switch.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from typing import Callable

from trainmover.protocol.messages import MoveRole
from trainmover.groups.specs import Delta

log = logging.getLogger(__name__)


def xfer_prefix(epoch: int, leaver: int) -> str:
    return f"tm/e{epoch}/xfer/r{leaver}/"


@dataclass
class Prepared:
    epoch: int
    delta: Delta
    role: MoveRole
    rank: int
    backends: dict = field(default_factory=dict)   # group name -> new backend
    xfer: object | None = None         # leaver/joiner: 2-member transfer group
    seconds: float = 0.0
    error: str = ""
    memory_before: dict = field(default_factory=dict)   # at the boundary where Phase 1 began
    comms_before: int = 0
    plan: object | None = None         # leaver/joiner: the transfer's plan (transfer/plan.py), made ahead
    plan_s: float = 0.0                # the time making it took (outside the pause)
    plan_at: int | None = None         # leaver: the step boundary it was made at (it switches at a later one)
    done: threading.Event = field(default_factory=threading.Event)


# build(group name, store prefix, group rank, group size) -> a new backend
Builder = Callable[[str, str, int, int], object]


def start(prep: Prepared, build: Builder) -> threading.Thread:
    """Build in a daemon thread; `prep.done` is set on success or failure (see `prep.error`).
    Every backend is built with the deadline the builder was configured with."""

    def run():
        t0 = time.perf_counter()
        try:
            if prep.role in (MoveRole.STAYER, MoveRole.JOINER):
                for g in prep.delta.groups_to_build(prep.rank):
                    prep.backends[g.name] = build(g.name, prep.delta.prefix(g), g.ranks.index(prep.rank), len(g.ranks))
            if prep.role in (MoveRole.LEAVER, MoveRole.JOINER):
                # Leaver is group rank 0, joiner group rank 1, in a group of their own.
                prep.xfer = build("xfer", xfer_prefix(prep.epoch, prep.rank), 0 if prep.role == MoveRole.LEAVER else 1, 2)
        except Exception as exc:  # noqa: BLE001 - reported to the controller, which aborts
            prep.error = f"{type(exc).__name__}: {exc}"
            log.error("phase1 epoch %d rank %d failed: %s", prep.epoch, prep.rank, prep.error)
        prep.seconds = time.perf_counter() - t0
        prep.done.set()

    th = threading.Thread(target=run, name=f"tm-phase1-e{prep.epoch}", daemon=True)
    th.start()
    return th
