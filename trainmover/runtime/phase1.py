"""Phase 1: build the replacement groups while training continues.

Runs in a background thread on every member of a changed group (stayers and joiner) and on
the leaver (which only builds its transfer group with the joiner). Nothing the live job uses
is touched: the result is a set of new backends, kept aside until the switch.
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass, field

from trainmover.runtime.groups import gloo_group
from trainmover.runtime.plan import Delta

log = logging.getLogger(__name__)


def xfer_prefix(epoch: int, leaver: int) -> str:
    return f"tm/e{epoch}/xfer/r{leaver}/"


@dataclass
class Prepared:
    epoch: int
    delta: Delta
    role: str                          # "stayer", "leaver" or "joiner"
    rank: int
    backends: dict = field(default_factory=dict)   # group name -> new backend
    xfer: object | None = None         # leaver/joiner: 2-member transfer group
    seconds: float = 0.0
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)


def start(prep: Prepared, store, host: str, timeout_s: float, joiner_of: dict[int, int] | None = None) -> threading.Thread:
    """Build in a daemon thread; `prep.done` is set on success or failure (see `prep.error`)."""

    def run():
        t0 = time.perf_counter()
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if prep.role in ("stayer", "joiner"):
                for g in prep.delta.groups_to_build(prep.rank):
                    prep.backends[g.name] = gloo_group(store, prep.delta.prefix(g), g.ranks.index(prep.rank),
                                                       len(g.ranks), host=host, timeout=timeout)
            if prep.role in ("leaver", "joiner"):
                # Leaver is group rank 0, joiner group rank 1, in a group of their own.
                prep.xfer = gloo_group(store, xfer_prefix(prep.epoch, prep.rank), 0 if prep.role == "leaver" else 1,
                                       2, host=host, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - reported to the controller, which aborts
            prep.error = f"{type(exc).__name__}: {exc}"
            log.error("phase1 epoch %d rank %d failed: %s", prep.epoch, prep.rank, prep.error)
        prep.seconds = time.perf_counter() - t0
        prep.done.set()

    th = threading.Thread(target=run, name=f"tm-phase1-e{prep.epoch}", daemon=True)
    th.start()
    return th
