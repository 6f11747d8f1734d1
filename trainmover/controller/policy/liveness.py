"""Silent failures: a process that hangs or vanishes without closing anything (pure).

A crash is found at once, by its closed connection. A frozen process (SIGSTOP, a kernel hang), a
cut-off node (a partition, power loss without a reset) or a rank whose training thread is stuck
(a hung kernel or collective) keeps its sockets open; its peers would wait for the whole group
timeout, and then nobody could say who is to blame. Every process sends `beat` every
TM_HEARTBEAT_S from a thread of its own (runtime/heartbeat.py), except while its step reports
come as often (any frame proves its sender alive); two rules name the culprit:

    silent  nothing heard from a process for TM_HEARTBEAT_TIMEOUT_S: frozen, cut off or dead.
    stuck   no rank completed a step for max(TM_PROGRESS_TIMEOUT_S, TM_PROGRESS_STEPS x the
            median recent step), and a rank (i) is behind: in a group it shares with others it
            issued fewer collectives than they did (they wait on it), and (ii) its training thread
            used no CPU meanwhile. A rank that computes, however slowly (a straggler, a
            recompile), is never stuck: that is the straggler policy's business.

A verdict (`Liveness.verdicts`; the policy acts on it) starts the recovery of the node
(controller/policy/recovery.py) and fences the process (`Fence`): its Slurm step is killed, its connection refused from then on, its node drained.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from trainmover.config import Config
from trainmover.controller.durable.state import PolicyState
from trainmover.controller.policy.progress import Progress
from trainmover.protocol.messages import BeatMsg, Msg, ReadyMsg, StalledMsg, StepMsg, SwitchedMsg


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
    """The policy's liveness part: what was last heard from each process, and its verdicts.
    It decides who is dead (`verdicts`); the policy acts on them (recovery, standby loss) and
    records the fence here (`fence`)."""

    def __init__(self, cfg: Config, state: PolicyState, progress: Progress):
        self.cfg, self.state, self.progress = cfg, state, progress
        # Not journaled: a successor hears every live process again within a heartbeat, and
        # its clock for silence, progress and its own pauses starts afresh. Only the fenced
        # (node, pid) are kept (state.fenced_pids): a process judged dead stays so.
        self.processes: dict = {}            # (node, pid) -> Heard
        self.fenced: list[dict] = []         # the verdicts, for status
        self.last_progress_at: float | None = None  # when any rank last completed a step (controller's clock)
        self._stuck_rule_on = True  # whether the stuck rule applied at the last verdicts (see verdicts)
        self.last_tick: float | None = None

    def heard(self, now: float, node: str, pid: int, msg: Msg) -> None:
        """Any message from the process `pid` on `node` proves it alive; a beat says more."""
        key = (node, pid)
        if key in self.state.fenced_pids:
            return
        h = self.processes.get(key)
        if h is None:
            h = self.processes[key] = Heard(node, pid, now)
        h.max_gap, h.t = max(h.max_gap, now - h.t), now
        if isinstance(msg, (StepMsg, ReadyMsg, SwitchedMsg, StalledMsg)):
            h.started = True
        if isinstance(msg, StepMsg) and not h.ranks:  # ranks report steps instead of beating (runtime/heartbeat.py)
            h.ranks = (msg.rank,)
        if isinstance(msg, BeatMsg):
            h.ranks, h.step, h.issued, h.waiting = tuple(msg.ranks), msg.step, msg.issued, msg.waiting
            h.cpu.append((now, msg.cpu_s))
            keep = max(8, int(self.stuck_deadline() / max(self.cfg.heartbeat_s, 1e-3)) + 4)
            del h.cpu[:-keep]

    def forget(self, node: str, pid: int) -> None:
        """The process's connection closed: the closed-connection path speaks for it."""
        self.processes.pop((node, pid), None)

    def progressed(self, now: float) -> None:
        self.last_progress_at = now

    # --- the rules --------------------------------------------------------------------
    def stuck_deadline(self) -> float:
        return max(self.cfg.progress_timeout_s, self.cfg.progress_steps * self.progress.typical_step_s())

    def _silent(self, seen: float, arrivals: dict) -> list[Heard]:
        """`arrivals`: (node, pid) -> when the connection's reader last received a frame (the
        executor's: a message still queued for the policy counts as heard); `seen`: up to when
        the reader has read everything sent."""
        for key, t in arrivals.items():
            h = self.processes.get(key)
            if h is not None and t > h.t:
                h.t = t
        return [h for h in self.processes.values() if seen - h.t > self.silence_allowed(h)]

    def silence_allowed(self, h: Heard) -> float:
        """TM_HEARTBEAT_TIMEOUT_S, or up to TM_GROUP_TIMEOUT_S before a process's first step (or
        warm stance): starting, it builds its groups and model, and a CUDA context or a library's
        initialisation can hold the interpreter's lock, and so its heartbeat thread, for seconds
        (seen on an H200: a 1B model's worker silent for 3 s before its first step). A crash
        then is still seen at once, by its closed connection."""
        return self.cfg.heartbeat_timeout_s if h.started else max(self.cfg.heartbeat_timeout_s,
                                                                  self.cfg.group_timeout_s)

    def _stuck(self, now: float) -> tuple[list[Heard], float]:
        """Processes whose ranks the others wait on while their training thread idles."""
        deadline = self.stuck_deadline()
        if self.last_progress_at is None or now - self.last_progress_at <= deadline:
            return [], deadline
        rank_nodes = set(self.state.view.rank_node.values())
        workers = [h for h in self.processes.values() if h.ranks and h.node in rank_nodes]
        out = []
        for h in workers:
            behind = _behind(h, workers)
            if behind and _idle(h, now, deadline):
                h.evidence = behind
                out.append(h)
        return out, deadline

    # --- verdicts --------------------------------------------------------------------
    def verdicts(self, now: float, arrivals: dict, judging: bool, stuck_rule: bool,
                 looked_at: float | None = None) -> list[tuple[Heard, str]]:
        """Processes judged dead now, and why. `judging`: whether the policy judges at all (not
        once the job ended or while a successor resumes); `stuck_rule`: whether the stuck rule
        applies (no recovery, nobody finished, no state copy under way, which may take long).
        `looked_at`: when the channel's reader last finished a look at every connection (None:
        now). Silence is counted up to then, not to now: a reader that is behind (a turn over
        1,024 connections stalled for 3.2 s on a loaded host, docs/scale.md) has not read what
        was sent meanwhile, and counting to now blamed hundreds of live processes at once."""
        # A controller that did not run for a while (its node busy, the process stopped) has not
        # read its connections either: judging silence now would blame every rank.
        paused = self.last_tick is not None and now - self.last_tick > self.cfg.heartbeat_timeout_s / 2
        self.last_tick = now
        if not judging or paused:
            return []
        out = [(h, f"no heartbeat for {now - h.t:.1f}s "
                   f"({'TM_HEARTBEAT_TIMEOUT_S' if h.started else 'starting: TM_GROUP_TIMEOUT_S'}"
                   f"={self.silence_allowed(h):g}; last: {h.step} steps complete)")
               for h in self._silent(now if looked_at is None else min(now, looked_at), arrivals)]
        if stuck_rule and not self._stuck_rule_on and self.last_progress_at is not None:
            # The rule was suspended (a recovery, a state copy): the ranks get a whole deadline from
            # now to complete a step, not what is left of one counted from before the pause (seen: a
            # recovery that waited 60 s for a rank blocked in a pipeline receive, then every rank judged
            # stuck 0.2 s after it resumed, before any could finish a step)
            self.last_progress_at = max(self.last_progress_at, now)
        self._stuck_rule_on = stuck_rule
        if stuck_rule:
            stuck, deadline = self._stuck(now)
            out += [(h, f"stuck: no step completed for {now - self.last_progress_at:.1f}s (deadline {deadline:.1f}s), "
                        f"its training thread idle and {h.evidence}") for h in stuck]
        return out

    def fence(self, now: float, h: Heard, why: str) -> None:
        """`h` judged dead: never heard again (journaled, state.fenced_pids)."""
        self.processes.pop((h.node, h.pid), None)
        self.state.fenced_pids.add((h.node, h.pid))
        self.fenced.append({"node": h.node, "pid": h.pid, "ranks": list(h.ranks), "t": now, "why": why})

    def status(self) -> dict:
        return {"heartbeat_timeout_s": self.cfg.heartbeat_timeout_s, "stuck_deadline_s": round(self.stuck_deadline(), 3),
                "max_beat_gap_s": round(max((h.max_gap for h in self.processes.values()), default=0.0), 3),
                "fenced": list(self.fenced)}


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


def _idle(h: Heard, now: float, window: float) -> bool:
    """Whether the training thread of `h` used (almost) no CPU over the last `window` seconds.
    Too short a record to say: not idle (never a verdict on missing evidence)."""
    old = [c for t, c in h.cpu if t <= now - window]
    if not old or not h.cpu:
        return False
    used = h.cpu[-1][1] - old[-1]
    return used < 0.05 * window
