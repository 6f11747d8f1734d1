"""The controller's Slurm work that runs beside its loop: taking a standby into the job and
releasing a node from it (controller/resize.py), fencing, the rights check. Each runs on a
thread of its own (a grow may wait minutes for a free node) and ends in one event on the
loop's queue, which the policy then hears. The events are typed: the executor matches on
their class (executor.py, `_on_event`), and the type checker sees every field by name."""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

RELEASE_WAIT_S = 30.0  # at the job's end, for releases under way (a shrink and its checks)


@dataclass(frozen=True)
class Acquired:
    """A standby was taken into the job (controller/resize.py)."""
    node: str
    addr: str


@dataclass(frozen=True)
class Unavailable:
    """No standby was taken this time, and why (the policy says so and tries again later)."""
    reason: str


@dataclass(frozen=True)
class Released:
    """A node's release from the job ended: `ok`, or why not."""
    node: str
    ok: bool
    message: str = ""


@dataclass(frozen=True)
class Fenced:
    """A fence's effects ended (controller/fencing.py): the kill's errors ("" none), whether a
    drain was asked, and the drain's error ("" none: drained, or none asked)."""
    node: str
    kill_errors: str
    drain: bool
    drain_error: str


@dataclass(frozen=True)
class RightsChecked:
    """A successor's check of what the job's user may do answered (executor._check_rights)."""


@dataclass(frozen=True)
class WorkFailed:
    """The work `name` raised: logged, and a failed acquire heard as no standby."""
    name: str
    error: Exception


WorkEvent = Acquired | Unavailable | Released | Fenced | RightsChecked | WorkFailed


class SlurmWork:
    def __init__(self):
        self.events: queue.Queue[WorkEvent] = queue.Queue()
        self.releases: list[threading.Thread] = []  # under way (see finish_releases)

    def start(self, name: str, fn: Callable[[], WorkEvent]) -> None:
        """Run `fn` on a thread; its event, or `WorkFailed(name, exc)`, is queued."""
        def run():
            try:
                self.events.put(fn())
            except Exception as exc:  # noqa: BLE001 - turned into an event for the policy
                self.events.put(WorkFailed(name, exc))
        t = threading.Thread(target=run, name=f"tm-{name}", daemon=True)
        self.releases = [x for x in self.releases if x.is_alive()] + ([t] if name == "release" else [])
        t.start()

    def finish_releases(self) -> list[Released]:
        """At the job's end: releases under way finish (each within its Slurm commands'
        deadlines, all within RELEASE_WAIT_S); their `released` events, for the policy to
        record. Other events are dropped: nothing new starts now."""
        deadline = time.monotonic() + RELEASE_WAIT_S
        for t in self.releases:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        out = []
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return out
            if isinstance(ev, Released):
                out.append(ev)
