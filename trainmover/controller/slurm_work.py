"""The controller's Slurm work that runs beside its loop: taking a standby into the job,
releasing a node from it, fencing. Each runs on a thread of its own (a grow may wait minutes
for a free node) and ends in one event on the loop's queue, which the policy then hears."""
from __future__ import annotations

import queue
import threading
import time

from trainmover.slurm import BatchHostRelease, NoStandbyAvailable
from trainmover.errors import SlurmError

RELEASE_WAIT_S = 30.0  # at the job's end, for releases under way (a shrink and its checks)


class SlurmWork:
    def __init__(self, slurm, job_id: int, cfg, pool, addr: dict):
        """`pool`: the node watch's view of the standby pool (controller/node_watch.py);
        `addr`: node -> address, filled in for a standby taken."""
        self.slurm, self.job_id, self.cfg, self.pool, self.addr = slurm, job_id, cfg, pool, addr
        self.events: queue.Queue = queue.Queue()
        self.releases: list[threading.Thread] = []  # under way (see finish_releases)

    def start(self, name: str, fn) -> None:
        def run():
            try:
                self.events.put(fn())
            except Exception as exc:  # noqa: BLE001 - turned into an event for the policy
                self.events.put(("error", name, exc))
        t = threading.Thread(target=run, name=f"tm-{name}", daemon=True)
        self.releases = [x for x in self.releases if x.is_alive()] + ([t] if name == "release" else [])
        t.start()

    def acquire(self):
        idle = self.pool.none_idle()
        if idle:  # the last node poll saw no free spare: asking slurmctld now would only cost RPCs
            return ("unavailable", idle)
        self.pool.asked()
        try:
            node = self.slurm.grow(self.job_id, reservation=self.cfg.reservation, timeout=self.cfg.standby_wait_s)
        except NoStandbyAvailable as exc:
            self.pool.none_granted()
            return ("unavailable", str(exc))
        except SlurmError as exc:
            return ("unavailable", f"taking a standby failed: {exc}")
        self.addr[node] = self.slurm.nodes([node])[node].addr
        return ("acquired", node)

    def release(self, node: str):
        keep = [n for n in self.slurm.job(self.job_id).nodes if n != node]
        try:
            self.slurm.shrink(self.job_id, keep)
            return ("released", node, True, "")
        except BatchHostRelease:
            return ("released", node, False, f"{node} runs the batch script: it stays in the job until the job ends")
        except SlurmError as exc:
            return ("released", node, False, f"release failed: {exc}")

    def finish_releases(self) -> list:
        """At the job's end: releases under way finish (each within its Slurm commands'
        deadlines, all within RELEASE_WAIT_S); their events, for the policy to record."""
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
