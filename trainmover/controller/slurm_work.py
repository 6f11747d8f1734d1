"""The controller's Slurm work that runs beside its loop: taking a standby into the job and
releasing a node from it (controller/resize.py), fencing, the rights check. Each runs on a
thread of its own (a grow may wait minutes for a free node) and ends in one event on the
loop's queue, which the policy then hears."""
from __future__ import annotations

import queue
import threading
import time

RELEASE_WAIT_S = 30.0  # at the job's end, for releases under way (a shrink and its checks)


class SlurmWork:
    def __init__(self):
        self.events: queue.Queue = queue.Queue()
        self.releases: list[threading.Thread] = []  # under way (see finish_releases)

    def start(self, name: str, fn) -> None:
        """Run `fn` on a thread; its result (an event tuple), or ("error", name, exc), is queued."""
        def run():
            try:
                self.events.put(fn())
            except Exception as exc:  # noqa: BLE001 - turned into an event for the policy
                self.events.put(("error", name, exc))
        t = threading.Thread(target=run, name=f"tm-{name}", daemon=True)
        self.releases = [x for x in self.releases if x.is_alive()] + ([t] if name == "release" else [])
        t.start()

    def finish_releases(self) -> list:
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
            if ev[0] == "released":
                out.append(ev)
