"""Silent failures: a process that hangs or vanishes without closing anything (pure).

A crash is found at once, by its closed connection. A frozen process (SIGSTOP, a kernel hang), a
cut-off node (a partition, power loss without a reset) or a rank whose training thread is stuck
(a hung kernel or collective) keeps its sockets open; its peers would wait for the whole group
timeout, and then nobody could say who is to blame. Every process sends `beat` every
TM_HEARTBEAT_S from a thread of its own (runtime/heartbeat.py); two rules name the culprit:

    silent  nothing heard from a process for TM_HEARTBEAT_TIMEOUT_S: frozen, cut off or dead.
    stuck   no rank completed a step for max(TM_PROGRESS_TIMEOUT_S, TM_PROGRESS_STEPS x the
            median recent step), and a rank (i) is behind: in a group it shares with others it
            issued fewer collectives than they did (they wait on it), and (ii) its training thread
            used no CPU meanwhile. A rank that computes, however slowly (a straggler, a
            recompile), is never stuck: that is the straggler policy's business.

A verdict starts the recovery of the node (controller/recovery.py) and fences the process
(`Fence`): its Slurm step is killed, its connection refused from then on, its node drained.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

from trainmover.controller.actions import Fence
from trainmover.controller.migration import Phase

log = logging.getLogger("trainmover.policy")


@dataclass
class Heard:
    """What the controller last heard from one process."""
    node: str
    pid: int
    t: float                               # controller's clock
    ranks: tuple[int, ...] = ()
    step: int = 0
    issued: dict = field(default_factory=dict)
    waiting: dict = field(default_factory=dict)
    cpu: list = field(default_factory=list)  # [(t, training thread CPU s)], oldest first
    evidence: str = ""                     # why the others wait on it (see _behind)
    max_gap: float = 0.0                   # longest silence seen between two of its frames
    started: bool = False                  # it completed a step or is warm: past its start-up


class Liveness:
    """Mixed into `Policy`: uses its view, config, recovery and standby handling."""

    def heard(self, now: float, node: str, pid: int, msg: dict) -> None:
        """Any message from the process `pid` on `node` proves it alive; a beat says more."""
        key = (node, pid)
        if key in self.fenced_pids:
            return
        h = self.processes.get(key)
        if h is None:
            h = self.processes[key] = Heard(node, pid, now)
        h.max_gap, h.t = max(h.max_gap, now - h.t), now
        if msg["type"] in ("step", "ready", "switched", "stalled"):
            h.started = True
        if msg["type"] == "beat":
            h.ranks, h.step, h.issued, h.waiting = tuple(msg["ranks"]), msg["step"], msg["issued"], msg["waiting"]
            h.cpu.append((now, msg["cpu_s"]))
            keep = max(8, int(self._stuck_deadline() / max(self.cfg.heartbeat_s, 1e-3)) + 4)
            del h.cpu[:-keep]

    def forget(self, node: str, pid: int) -> None:
        """The process's connection closed: the closed-connection path speaks for it."""
        self.processes.pop((node, pid), None)

    def progressed(self, now: float) -> None:
        self.last_progress_at = now

    # --- the rules --------------------------------------------------------------------
    def _stuck_deadline(self) -> float:
        hist = next(iter(self.steps.values()), [])
        gaps = [b[1] - a[1] for a, b in zip(hist[-17:], hist[-16:]) if b[0] == a[0] + 1]
        typical = statistics.median(gaps) if gaps else 0.0
        return max(self.cfg.progress_timeout_s, self.cfg.progress_steps * typical)

    def _silent(self, now: float, arrivals: dict) -> list[Heard]:
        """`arrivals`: (node, pid) -> when the connection's reader last received a frame (the
        executor's: a message still queued for the policy counts as heard)."""
        for key, t in arrivals.items():
            h = self.processes.get(key)
            if h is not None and t > h.t:
                h.t = t
        return [h for h in self.processes.values() if now - h.t > self._silence_allowed(h)]

    def _silence_allowed(self, h: Heard) -> float:
        """TM_HEARTBEAT_TIMEOUT_S, or up to TM_GROUP_TIMEOUT_S before a process's first step (or
        warm stance): starting, it builds its groups and model, and a CUDA context or a library's
        initialisation can hold the interpreter's lock, and so its heartbeat thread, for seconds
        (seen on an H200: a 1B model's worker silent for 3 s before its first step). A crash
        then is still seen at once, by its closed connection."""
        return self.cfg.heartbeat_timeout_s if h.started else max(self.cfg.heartbeat_timeout_s,
                                                                  self.cfg.group_timeout_s)

    def _stuck(self, now: float) -> tuple[list[Heard], float]:
        """Processes whose ranks the others wait on while their training thread idles."""
        deadline = self._stuck_deadline()
        if self.last_progress_at is None or now - self.last_progress_at <= deadline:
            return [], deadline
        workers = [h for h in self.processes.values() if h.ranks and h.node in self.view.rank_node.values()]
        out = []
        for h in workers:
            behind = self._behind(h, workers)
            if behind and _idle(h, now, deadline):
                h.evidence = behind
                out.append(h)
        return out, deadline

    @staticmethod
    def _behind(h: Heard, workers: list[Heard]) -> str:
        """Why the others wait on `h` ('' if they do not): a group it shares with them in which
        they issued more collectives than it did."""
        for name, mine in sorted(h.issued.items()):
            ahead = [o for o in workers if o is not h and o.issued.get(name, -1) > mine]
            if ahead:
                most = max(o.issued[name] for o in ahead)
                waiting = sorted(r for o in ahead for r in o.ranks if o.waiting.get(name))
                return (f"the others issued {most} collectives in group {name}, it issued {mine}"
                        + (f"; ranks {waiting} wait in it" if waiting else ""))
        return ""

    # --- verdicts --------------------------------------------------------------------
    def _liveness_tick(self, now: float, arrivals: dict) -> list:
        # A controller that did not run for a while (its node busy, the process stopped) has not
        # read its connections either: judging silence now would blame every rank.
        paused = self.last_tick is not None and now - self.last_tick > self.cfg.heartbeat_timeout_s / 2
        self.last_tick = now
        if self.done or self.resuming is not None or paused:
            return []
        actions: list = []
        for h in self._silent(now, arrivals):
            actions += self._judged_dead(now, h, f"no heartbeat for {now - h.t:.1f}s "
                                                 f"({'TM_HEARTBEAT_TIMEOUT_S' if h.started else 'starting: TM_GROUP_TIMEOUT_S'}"
                                                 f"={self._silence_allowed(h):g}; last: {h.step} steps complete)")
        switching = any(m.phase is Phase.SWITCHING for m in self.migrations)  # a state copy may take long
        if self.recovery() is None and not self.finished and not switching:
            stuck, deadline = self._stuck(now)
            for h in stuck:
                actions += self._judged_dead(now, h, f"stuck: no step completed for "
                                                     f"{now - self.last_progress_at:.1f}s (deadline {deadline:.1f}s), "
                                                     f"its training thread idle and {h.evidence}")
        return actions

    def _judged_dead(self, now: float, h: Heard, why: str) -> list:
        self.processes.pop((h.node, h.pid), None)
        if h.node in self.view.standbys:
            what = f"standby process {h.pid} on {h.node}"
            actions = self._standby_lost(now, h.node, why)
        elif h.node in self.view.rank_node.values() and not all(r in self.finished for r in h.ranks):
            what = f"rank{'s' if len(h.ranks) > 1 else ''} {list(h.ranks)} (process {h.pid} on {h.node})"
            actions = self._fault(now, h.node, why)
        else:  # a leaver that left, a node released: nothing depends on it any more
            return []
        log.error("%s judged dead: %s", what, why)
        self.fenced_pids.add((h.node, h.pid))
        self.fenced.append({"node": h.node, "pid": h.pid, "ranks": list(h.ranks), "t": now, "why": why})
        return [Fence(h.node, h.pid, f"{what}: {why}")] + actions


def _idle(h: Heard, now: float, window: float) -> bool:
    """Whether the training thread of `h` used (almost) no CPU over the last `window` seconds.
    Too short a record to say: not idle (never a verdict on missing evidence)."""
    old = [c for t, c in h.cpu if t <= now - window]
    if not old or not h.cpu:
        return False
    used = h.cpu[-1][1] - old[-1]
    return used < 0.05 * window
