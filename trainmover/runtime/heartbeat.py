"""A rank's heartbeat: proof of life that does not depend on sockets closing.

A crashed process is found at once (the kernel closes its sockets), but a frozen one
(SIGSTOP, a kernel hang), a cut-off one (a network partition) or one whose training thread is
stuck (a hung kernel or collective) keeps its sockets open. So every process sends `beat`
every TM_HEARTBEAT_S from a thread of its own (none while its step reports, which prove the same,
come at least as often: beat_due_in): its silence names a frozen or cut-off process, and what
it says lets the controller name a stuck rank (controller/policy/liveness.py):

* `step`: steps complete; `issued`: collectives issued per group since the group's last swap
  (the rank the others wait on has issued fewer); `waiting`: how long the oldest collective in
  flight has waited, per group (this rank's own watchdog around its collectives);
* `cpu_s`: CPU time of the training thread, read from /proc: a rank whose thread computes
  (a slow step, a recompile) is slow, not dead.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from trainmover.protocol.messages import make

log = logging.getLogger("trainmover.heartbeat")

_TICK_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu_s(native_id: int) -> float:
    """CPU time (user + system) of one thread of this process, from /proc (0.0 where unreadable)."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK_S  # utime, stime (fields 14 and 15)
    except (OSError, IndexError, ValueError):
        return 0.0


def beat(ranks: list[int], step: int, groups: dict, train_thread: int, now: float) -> dict:
    """One `beat` message: what this process can say about itself right now."""
    issued = {name: g.issued for name, g in groups.items() if not g.sandboxed}
    waiting = {}
    for name, g in groups.items():
        age = g.waiting_s(now) if not g.sandboxed else 0.0
        if age > 0:
            waiting[name] = round(age, 3)
    return make("beat", ranks=ranks, step=step, issued=issued, waiting=waiting,
                cpu_s=round(thread_cpu_s(train_thread), 3))


def beat_due_in(every_s: float, now: float, stepped_at: float | None) -> float:
    """Seconds until the next beat is due (0: now), asked `every_s` after the last beat.

    A step report proves its process alive as a beat does, so a beat is due `every_s` after the
    later of the last beat and the last step report (`stepped_at`, monotonic): a process that
    reports a step at least every `every_s` sends no beats, and the silence between two of its
    frames is never longer than `every_s` either way, which is all the silence rule
    (controller/policy/liveness.py) relies on. Once its steps stop, its beats follow `every_s`
    after the last one, with what the stuck rule reads (issued, waiting, the training thread's
    CPU). At 1,024 ranks with 1 s steps and 0.5 s beats this is 2 messages a second per rank
    instead of 3 (docs/scale.md)."""
    if stepped_at is None:
        return 0.0
    return max(0.0, stepped_at + every_s - now)


class Heartbeat:
    """Sends `beat` every `every_s` until stopped, less the beats that step reports make
    redundant (`stepped`, beat_due_in). `describe()` is called on this thread: it must only
    read (the training thread may hold any lock for as long as a step lasts)."""

    def __init__(self, send, describe, every_s: float):
        self.send, self.describe, self.every_s = send, describe, every_s
        self.stopped = threading.Event()
        self.stepped_at: float | None = None  # when this process last reported a step (monotonic)
        self.thread = threading.Thread(target=self._run, name="tm-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self.thread.start()
        return self

    def stepped(self, now: float) -> None:
        """A step report went to the controller at `now` (monotonic)."""
        self.stepped_at = now

    def _run(self) -> None:
        wait = self.every_s
        while not self.stopped.wait(wait):
            wait = beat_due_in(self.every_s, time.monotonic(), self.stepped_at)
            if wait > 0:
                continue
            wait = self.every_s
            try:
                self.send(self.describe(time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - a beat is never worth the process; the next one tries again
                log.warning("heartbeat not sent: %s", exc)

    def stop(self) -> None:
        self.stopped.set()
