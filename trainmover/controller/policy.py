"""The controller's decisions: events in, actions out. No clock, no I/O, no Slurm.

The executor (`controller.main`) feeds it what it observed (node states from Slurm,
messages from ranks, results of Slurm operations, `now`) and applies the actions it returns.
"""
from __future__ import annotations

import logging
import statistics

from trainmover.config import Config
from trainmover.control.messages import make
from trainmover.controller.actions import AcquireStandby, Finish, LaunchStandby, Record, ReleaseNode, Send
from trainmover.controller.holder import SnapshotHolder
from trainmover.controller.liveness import Liveness
from trainmover.controller.migration import Migration, Phase
from trainmover.controller.recovery import Recovering
from trainmover.controller.resume import Resuming
from trainmover.controller.standby_loss import StandbyLoss
from trainmover.controller.view import JobView, Standby
from trainmover.policy import straggler

log = logging.getLogger("trainmover.policy")

MAX_ATTEMPTS = 3


class Policy(Recovering, Resuming, StandbyLoss, Liveness, SnapshotHolder):
    def __init__(self, cfg: Config, view: JobView):
        self.cfg, self.view = cfg, view
        self.migrations: list[Migration] = []
        self.epoch = 0
        self.acquiring = False
        self.next_acquire_at = 0.0
        self.acquire_note = ""
        self.steps: dict[int, list[tuple[int, float]]] = {}     # rank -> [(step, t)]
        self.rows: dict[int, dict[int, dict]] = {}              # step -> rank -> report
        self.finished: dict[int, dict] = {}
        self.recordings: dict[str, dict] = {}  # by recording rank (one per standby role)
        self.snapshot_every = cfg.snapshot_every  # the executor sets 0 where no snapshot could be used
        self.samples: dict[int, list[float]] = {}             # rank -> compute times of this window
        self.windows: list[dict[int, float]] = []             # oldest first: rank -> median compute time
        self.straggler: dict = {"mode": cfg.straggler, "verdict": "", "target": None, "windows": 0, "evicted": []}
        self.stalled: dict[int, dict] = {}                     # rank -> its 'stalled' report
        self.checkpoints: dict[int, dict[int, str]] = {}       # step -> rank -> digest, until every rank wrote it
        self.checkpoint_steps: list[int] = []                  # complete checkpoints (manifest written), oldest first
        self.failed_reports: dict[str, dict] = {}              # node -> a rank's 'failed' report
        self.failure: dict | None = None                        # the report that ended the job (status.json)
        self.standbys_lost: list[dict] = []                    # standbys that died (see standby_loss.py)
        self.done = False
        self.metrics_through = 0     # last step in metrics.jsonl (a resumed controller skips older reports)
        self.restarts = 0            # controllers that took over from a dead one
        self.resuming: dict | None = None  # while a restarted controller waits for every rank (see resume.py)
        self.processes: dict = {}            # (node, pid) -> what was last heard from it (see liveness.py)
        self.fenced_pids: set = set()        # (node, pid) judged dead: never heard again
        self.fenced: list[dict] = []         # their verdicts, for status
        self.last_progress_at: float | None = None  # when any rank last completed a step (controller's clock)
        self.last_tick: float | None = None
        self.pool_choice: dict | None = None  # TM_STANDBYS=auto: the size picked at start and why (standbys/auto.py)

    # --- helpers -----------------------------------------------------------------------
    def active(self) -> Migration | None:
        return next((m for m in self.migrations if m.active), None)

    def _want_standby(self) -> bool:
        return len(self.view.standbys) < self.cfg.standbys and not self.done and not self.pool_exhausted()

    def _maybe_acquire(self, now: float) -> list:
        if self._want_standby() and not self.acquiring and now >= self.next_acquire_at:
            self.acquiring = True
            return [AcquireStandby()]
        return []

    def _timeline(self, m: Migration, now: float, event: str, **extra) -> Record:
        # Fields from ranks' messages come nested under "detail": they can never replace these.
        return Record("timeline", {**extra, "t": now, "migration": m.id, "epoch": m.epoch, "event": event,
                                   "leaver": m.leaver, "joiner": m.joiner or None, "trigger": m.trigger})

    # --- events ------------------------------------------------------------------------
    def start(self, now: float) -> list:
        return self._maybe_acquire(now)

    def on_standby_acquired(self, now: float, node: str) -> list:
        self.acquiring = False
        self.acquire_note = ""
        self.view.standbys[node] = Standby(node, "starting", now)
        return [LaunchStandby(node)] + self._maybe_acquire(now)

    def on_standby_unavailable(self, now: float, reason: str) -> list:
        self.acquiring = False
        self.next_acquire_at = now + self.cfg.standby_retry_s
        self.acquire_note = reason
        return []

    def on_nodes(self, now: float, states: dict[str, object]) -> list:
        """`states`: node name -> object with `.state` (text) and `.draining` (bool)."""
        actions = []
        for node, info in states.items():
            self.view.node_state[node] = info.state
            if node in self.view.rank_node.values() and (info.draining or info.drained):
                # TrainMover's own health check drains with a "trainmover:" reason
                trigger = "healthcheck" if getattr(info, "reason", "").startswith("trainmover:") else "drain"
                actions += self.request(now, node, trigger)[2]
            elif node in self.view.rank_node.values() and getattr(info, "unresponsive", False):
                # Slurm lost the node's slurmd. Its ranks may still run (slurmstepd outlives
                # slurmd): move them as planned; if they died too, the recovery path takes over.
                actions += self.request(now, node, "failure")[2]
        return actions

    def request(self, now: float, node: str, trigger: str) -> tuple[bool, str, list]:
        """Ask for `node` to leave. Returns (accepted, message, actions)."""
        if node not in self.view.rank_node.values():
            return False, f"{node} runs no rank of job {self.view.job_id}", []
        r = self.recovery()
        if r is not None and r.leaver == node:
            return True, f"{node} is being recovered after a failure (migration {r.id})", []
        for m in self.migrations:
            if m.leaver == node and m.active:
                return True, f"{node} is already migrating (migration {m.id}, {m.phase.value})", []
        m = Migration(len(self.migrations) + 1, node, self.view.ranks_of(node), trigger, now)
        self.migrations.append(m)
        actions = [self._timeline(m, now, "requested")]
        actions += self._dispatch(now)
        return True, f"migration {m.id} of {node} requested ({trigger})", actions

    def _dispatch(self, now: float) -> list:
        """Start the oldest waiting migration if none is running and a standby is ready."""
        if (any(m.phase in (Phase.PREPARING, Phase.SWITCHING) for m in self.migrations) or self.recovery()
                or self.resuming is not None):
            return []
        waiting = [m for m in self.migrations if m.phase in (Phase.REQUESTED, Phase.WAITING_STANDBY)]
        if not waiting:
            return []
        m = waiting[0]
        ready = sorted(s.node for s in self.view.standbys.values() if s.state == "ready")
        if not ready:
            if m.phase is Phase.REQUESTED:
                m.to(Phase.WAITING_STANDBY, now, f"no warm standby: the job keeps running on {m.leaver}")
                return [self._timeline(m, now, "waiting_standby")] + self._maybe_acquire(now)
            return self._maybe_acquire(now)
        self.epoch += 1
        m.epoch, m.joiner = self.epoch, ready[0]
        self.view.standbys[m.joiner].state = "joining"
        stayers = [n for n in self.view.train_nodes() if n != m.leaver]
        m.expected = ({(r, "stayer") for n in stayers for r in self.view.ranks_of(n)}
                      | {(r, "leaver") for r in m.leaver_ranks} | {(r, "joiner") for r in m.leaver_ranks})
        m.to(Phase.PREPARING, now, "")
        common = dict(epoch=m.epoch, leavers=list(m.leaver_ranks), joiner_node=m.joiner, options={})
        return [
            self._timeline(m, now, "prepare", stayers=stayers),
            Send(tuple(stayers) + (m.leaver,), make("prepare", assign={}, **common)),
            Send((m.joiner,), make("prepare", assign={str(i): r for i, r in enumerate(m.leaver_ranks)}, **common)),
        ]

    def on_message(self, now: float, node: str, msg: dict) -> list:
        kind = msg["type"]
        if kind == "ready":
            s = self.view.standbys.get(node)
            if s is None or s.state == "joining":  # a re-warm's report that crossed a prepare: the join decides
                return []
            # A node runs ranks_per_node standby processes; it takes a whole node's ranks, so it
            # is ready once every one of them is warm.
            s.warm.add(msg["local"])
            if len(s.warm) < self.view.ranks_per_node:
                return []
            s.state, s.since, s.warmup_s, s.shadow_steps = "ready", now, msg["warmup_s"], msg["shadow_steps"]
            s.shadow = msg["detail"] or s.shadow  # a re-ready after a cancelled join keeps the first report
            return self._maybe_recover(now) + self._dispatch(now) + self.holder_actions(now)
        if kind == "resync":
            return self.on_resync(now, node, msg)
        if kind == "stalled":
            return self._on_stalled(now, node, msg)
        if kind == "failed":
            return self._on_failed(now, node, msg)
        if kind == "checkpointed":
            return self._on_checkpointed(msg)
        if kind == "snapshot_held":
            return self.on_snapshot_held(node, msg)
        if kind == "snapshot_taken":
            return self.on_snapshot_taken(msg)
        if kind == "recorded":
            self.recordings[str(msg["rank"])] = {k: msg[k] for k in ("rank", "iterations", "bytes", "overhead_s",
                                                                     "step_s", "version", "detail")}
            return []
        if kind == "warming":  # not offered to a migration until it is ready again
            s = self.view.standbys.get(node)
            if s is not None and s.state == "ready":
                s.state, s.since = "warming", now
            return []
        if kind in ("step", "finished") and msg["rank"] not in self.view.rank_node:
            log.warning("ignoring %s from %s for rank %d, which job %d does not have", kind, node, msg["rank"],
                        self.view.job_id)
            return []
        if kind == "step":
            if msg["step"] <= self.metrics_through:  # re-sent after a controller restart: logged already
                return []
            return self._on_step(now, node, msg)
        if kind == "finished":
            self.finished[msg["rank"]] = msg
            if len(self.finished) == self.view.world_size and not self.done:
                self.done = True
                digests = [self.finished[r]["digest"] for r in range(self.view.world_size)]
                import hashlib
                combined = hashlib.sha256("".join(digests).encode()).hexdigest()
                return [Record("final", {"job_id": self.view.job_id, "steps": msg["step"], "digest": combined,
                                         "rank_digests": digests, "final_loss": msg["loss"],
                                         "migrations": sum(1 for m in self.migrations if m.phase is Phase.DONE)}),
                        Finish(True, "training finished")]
            return []
        m = next((x for x in self.migrations if x.active and x.epoch and x.epoch == msg.get("epoch")), None)
        if m is None:
            return []
        if kind == "prepared":
            role = "joiner" if node == m.joiner else ("leaver" if msg["rank"] in m.leaver_ranks else "stayer")
            if (msg["rank"], role) in m.prepared:  # re-sent after a controller restart
                return []
            m.prepared.add((msg["rank"], role))
            actions = [self._timeline(m, now, "rank_prepared", rank=msg["rank"], role=role, seconds=msg["seconds"],
                                      groups=msg["groups"], detail=msg["detail"])]
            if m.prepared >= m.expected and m.phase is Phase.PREPARING:
                m.to(Phase.SWITCHING, now)
                actions.append(self._timeline(m, now, "prepared"))
            return actions
        if kind == "prepare_failed":
            return self._abort(now, m, f"rank {msg['rank']} on {node}: {msg['error']}")
        if kind == "switched":
            if (msg["rank"], msg["role"]) in m.switched:  # re-sent after a controller restart
                return []
            if m.phase is Phase.PREPARING:  # ranks can switch before every 'prepared' has arrived
                m.to(Phase.SWITCHING, now)
            m.switched[(msg["rank"], msg["role"])] = msg
            m.switch_step = msg["step"]
            actions = []
            if msg["role"] != "joiner":
                actions.append(self._timeline(m, now, f"{msg['role']}_switched", rank=msg["rank"], detail=msg["detail"]))
            if msg["role"] == "joiner":
                self.view.rank_node[msg["rank"]] = m.joiner
                self.view.standbys.pop(m.joiner, None)
                actions.append(self._timeline(m, now, "joined", rank=msg["rank"], step=msg["step"], detail=msg["detail"]))
            return actions + self._maybe_released(now, m)
        return []

    def _on_failed(self, now: float, node: str, msg: dict) -> list:
        """A process said why it ends. From a rank (not a standby: its loss is handled as such),
        this is the job's root cause and ends it now: the workload's own error (`user`) would
        follow the rank to any node, so it is never taken for a lost node. Authoritative over
        what its consequences look like: the other ranks' collectives with it fail next, and a
        recovery started for it (its connection dropped, its step ended, in whatever order the
        controller heard of them) is void."""
        self.failed_reports[node] = msg
        if self.done or node not in self.view.rank_node.values():
            return []
        self.done = True
        user, step, phase = bool(msg.get("user")), msg.get("step", 0), msg["phase"]
        if user:
            when = f"at step {step}" if phase == "train_step" else f"in {phase}" + (f" after step {step}" if step else "")
            message = f"user code raised on rank {msg['rank']} ({node}) {when}: {msg['error']}"
        else:
            message = f"rank {msg['rank']} on {node} failed in {phase}: {msg['error']}"
        self.failure = {"rank": msg["rank"], "node": node, "step": step, "phase": phase, "user": user,
                        "error": msg["error"], "traceback": msg.get("traceback", ""), "t": now}
        actions: list = []
        for m in self.migrations:
            if m.active and m.recovery:
                m.to(Phase.FAILED, now, f"void: {message}"[:300])
                actions.append(self._timeline(m, now, "failed", reason=f"void: {message}"))
        log.error("the job ends: %s", message)
        return actions + [Finish(False, message)]

    def _abort(self, now: float, m: Migration, reason: str, retry: bool = True) -> list:
        m.to(Phase.ABORTED, now, reason)
        if m.joiner in self.view.standbys:
            s = self.view.standbys[m.joiner]  # each of its processes reports 'ready' again once it is back
            s.state, s.warm = "starting", set()
        nodes = tuple(self.view.train_nodes()) + ((m.joiner,) if m.joiner else ())
        # The node still has to leave: ask again, as a new migration, once a standby is ready;
        # after MAX_ATTEMPTS failures give up (the job keeps running on the node and says so).
        if retry:
            again = Migration(len(self.migrations) + 1, m.leaver, m.leaver_ranks, m.trigger, now)
            self.migrations.append(again)
            if sum(1 for x in self.migrations if x.leaver == m.leaver and x.phase is Phase.ABORTED) >= MAX_ATTEMPTS:
                again.to(Phase.FAILED, now, f"gave up after {MAX_ATTEMPTS} aborted attempts; {m.leaver} stays in the job")
        return [self._timeline(m, now, "aborted", reason=reason),
                Send(nodes, make("abort", epoch=m.epoch, reason=reason[:500]))] + self._dispatch(now)

    def _on_step(self, now: float, node: str, msg: dict) -> list:
        rank, step = msg["rank"], msg["step"]
        self.progressed(now)
        straggler_actions = self._on_compute(now, rank, msg["compute_s"])
        hist = self.steps.setdefault(rank, [])
        hist.append((step, msg["t"]))
        del hist[:-64]
        row = self.rows.setdefault(step, {})
        row[rank] = {"loss": msg["loss"], "step_s": msg["step_s"], "node": node, "t": msg["t"]}
        actions = []
        if len(row) == self.view.world_size:
            del self.rows[step]
            actions += self._maybe_rebalance(now, step)
            actions.append(self._metrics_row(step, row))
        for m in self.migrations:
            if m.switch_step is not None and m.downtime_s is None and step == m.switch_step + 1:
                m.downtime_s = self._downtime(m)
        return actions + straggler_actions

    def _metrics_row(self, step: int, row: dict) -> Record:
        """One line of metrics.jsonl. A rank that died before reporting `step` has no loss
        there (None): its process took it along; the others' are kept."""
        ranks = range(self.view.world_size)
        got = [row[r] for r in ranks if r in row]
        return Record("metrics", {
            "step": step, "loss": sum(x["loss"] for x in got) / len(got),
            "losses": [row[r]["loss"] if r in row else None for r in ranks], "step_s": max(x["step_s"] for x in got),
            "step_s_ranks": [round(row[r]["step_s"], 6) if r in row else None for r in ranks],
            "nodes": [row[r]["node"] if r in row else None for r in ranks], "t": max(x["t"] for x in got)})

    def flush_rows(self, upto: int) -> list:
        """Rows that can never complete (a recovery resumes after them): written as they are."""
        done = sorted(s for s in self.rows if s <= upto)
        return [self._metrics_row(s, self.rows.pop(s)) for s in done]

    def _maybe_rebalance(self, now: float, step: int) -> list:
        """Scheduled rebalancing: every N steps move the next node (round robin; never the
        batch host, which Slurm cannot release) to a warm standby, if one is ready and no other
        migration is under way; otherwise skip this turn."""
        n = self.cfg.rebalance_every_steps
        if not n or step % n or any(m.active for m in self.migrations):
            return []
        if not any(s.state == "ready" for s in self.view.standbys.values()):
            return []
        movable = [node for node in self.view.train_nodes() if node != self.view.batch_host]
        if not movable:
            return []
        node = movable[(step // n) % len(movable)]
        return self.request(now, node, "rebalance")[2]

    def _on_compute(self, now: float, rank: int, compute_s: float) -> list:
        """Fold each rank's own compute time into windows and ask the straggler policy."""
        if self.cfg.straggler == "off" or self.active() is not None:
            return []
        self.samples.setdefault(rank, []).append(compute_s)
        n = self.cfg.straggler_window_steps
        if len(self.samples) < self.view.world_size or min(len(v) for v in self.samples.values()) < n:
            return []
        # median, not mean: one rank's spike (a page fault, a neighbour's burst) is not slowness
        self.windows.append({r: statistics.median(v[:n]) for r, v in self.samples.items()})
        del self.windows[:-self.cfg.straggler_windows]
        self.samples = {}
        try:
            decision = straggler.decide(self.windows, self.view.rank_node, straggler.StragglerConfig(
                self.cfg.straggler_threshold, self.cfg.straggler_windows,
                "evict" if self.cfg.straggler == "evict" else "report"), reported=self.straggler["target"])
        except straggler.StragglerInputError as exc:  # e.g. fewer than 3 nodes: nothing to compare
            self.straggler.update(verdict=f"not evaluated: {exc}")
            return []
        self.straggler.update(verdict=decision.reason, target=decision.target, windows=decision.windows_considered,
                              last_window_s={str(r): round(v, 6) for r, v in sorted(self.windows[-1].items())})
        evicted = self.straggler["evicted"]
        if decision.action == "evict" and evicted and now - evicted[-1]["t"] < self.cfg.straggler_cooldown_s:
            # A second slow node so soon after an eviction points at a shared cause (the network,
            # a file system, a neighbour) that moving nodes does not fix, and would use up the
            # standbys one by one: reported, not acted on, until TM_STRAGGLER_COOLDOWN_S has passed.
            self.straggler["verdict"] = (f"{decision.reason}; not evicted: {now - evicted[-1]['t']:.0f}s after the "
                                         f"eviction of {evicted[-1]['node']} (TM_STRAGGLER_COOLDOWN_S="
                                         f"{self.cfg.straggler_cooldown_s:g})")
            return []
        if decision.action == "evict":
            evicted.append({"node": decision.target, "t": now, "verdict": decision.reason})
            self.windows = []  # the layout changes: measure afresh afterwards
            return self.request(now, decision.target, "straggler")[2]
        return []

    def _downtime(self, m: Migration) -> float | None:
        """Pause seen by the stayers: last step before the switch to the first after, minus
        one normal step (median interval before), each rank on its own clock; the worst rank.

        A planned migration with no stayer (a one-node job) has nobody who sees the pause from
        outside: it is then the leaver's ranks' own, the end of step s reported by the leaver and
        of step s+1 by the joiner, i.e. measured on the joiner's side against the leaver's last
        report (two processes: one clock on one host, else the clocks' skew adds to it)."""
        worst = None
        stayers = [r for r in self.steps if r not in m.leaver_ranks]
        for rank, hist in self.steps.items():
            if rank in m.leaver_ranks and (stayers or m.recovery):
                continue
            t = dict(hist)
            s = m.switch_step
            if s not in t or s + 1 not in t:
                continue
            before = [t[k + 1] - t[k] for k in range(s - 16, s) if k in t and k + 1 in t]
            if not before:
                continue
            gap = t[s + 1] - t[s] - statistics.median(before)
            worst = gap if worst is None else max(worst, gap)
        return None if worst is None else round(max(worst, 0.0), 6)

    def on_step_exit(self, now: float, node: str, code: int) -> list:
        m = next((m for m in self.migrations if m.leaver == node and m.phase in (Phase.SWITCHING, Phase.RELEASING)), None)
        if m is not None:
            if m.leaver_exited:  # known already (a recovery's leaver), release under way
                return []
            m.leaver_exited = True
            if m.phase is Phase.RELEASING:
                return [ReleaseNode(node)]
            return []
        if node in self.view.standbys:  # usually known lost already, from its closed connection
            return self._standby_lost(now, node, f"its Slurm step exited with code {code}")
        r = self.recovery()
        if r is not None and node in (r.leaver, r.joiner):
            if node == r.joiner and r.phase is not Phase.RELEASING:
                return [Finish(False, f"the standby on {node} taking over from {r.leaver} exited (code {code})")]
            return []
        if node in self.view.rank_node.values() and not self.done:
            if code == 0:  # its 'finished' report may still be queued behind this exit
                return []
            if self._lost_unexpectedly(node):
                return self._fault(now, node, f"its Slurm step exited with code {code}")
        return []

    def on_released(self, now: float, node: str, ok: bool, message: str) -> list:
        m = next((m for m in self.migrations if m.leaver == node and m.phase is Phase.RELEASING), None)
        if m is None:
            if any(x["node"] == node for x in self.standbys_lost):
                return self.on_lost_standby_released(now, node, ok, message)
            return []
        if ok:
            self.view.released.append(node)
        m.to(Phase.DONE, now, "" if ok else message)
        return [self._timeline(m, now, "released" if ok else "kept", note=message, downtime_s=m.downtime_s)] + self._dispatch(now)

    def on_tick(self, now: float, arrivals: dict | None = None) -> list:
        """`arrivals`: (node, pid) -> when a frame of that process last arrived (liveness.py)."""
        if self.resuming is not None:  # nothing is decided before every rank has said where it is
            return self._resume_tick(now)
        actions = self._liveness_tick(now, arrivals or {}) + self._recovery_tick(now)
        m = self.active()
        if m and m.phase is Phase.PREPARING and now - m.times["preparing"] > self.cfg.phase1_timeout_s:
            actions += self._abort(now, m, f"phase 1 not done within {self.cfg.phase1_timeout_s:.0f}s")
        elif (m and m.phase is Phase.RELEASING and not m.leaver_exited
              and now - m.times["releasing"] > self.cfg.release_timeout_s):
            # The leaver handed over its state but its step lingers: release the node anyway
            # (Slurm ends the step), rather than hold it in the job forever.
            m.leaver_exited = True
            m.note = f"leaver's step still running {self.cfg.release_timeout_s:.0f}s after the switch; released anyway"
            actions.append(ReleaseNode(m.leaver))
        return (actions + self._maybe_recover(now) + self._maybe_acquire(now) + self._dispatch(now)
                + self.holder_actions(now))

    # --- reporting -----------------------------------------------------------------------
    def status(self) -> dict:
        v = self.view
        nodes = [{"name": n, "role": "train", "ranks": list(v.ranks_of(n)), "slurm_state": v.node_state.get(n, "")}
                 for n in v.train_nodes()]
        nodes += [{"name": n, "role": "released", "ranks": [], "slurm_state": v.node_state.get(n, "")} for n in v.released]
        waiting = [m for m in self.migrations if m.phase is Phase.WAITING_STANDBY]
        return {
            "job_id": v.job_id, "world_size": v.world_size, "batch_host": v.batch_host,
            "nodes": nodes,
            "standbys": [{"node": s.node, "state": s.state, "warmup_s": s.warmup_s, "shadow_steps": s.shadow_steps,
                          "shadow": s.shadow, "slurm_state": v.node_state.get(s.node, "")} for s in v.standbys.values()],
            "recordings": self.recordings,
            "standby_pool": {"wanted": self.cfg.standbys, "acquiring": self.acquiring, "note": self.pool_note() or self.acquire_note,
                             "choice": self.pool_choice or {"setting": "fixed", "standbys": self.cfg.standbys,
                                                            "why": f"TM_STANDBYS={self.cfg.standbys}"}},
            "waiting_for_standby": [m.leaver for m in waiting],
            "message": (f"waiting for a standby: the job keeps running on {', '.join(m.leaver for m in waiting)}"
                        + (f" ({self.pool_note()})" if self.pool_exhausted() else "") if waiting else ""),
            "standbys_lost": list(self.standbys_lost),
            "migrations": [m.to_json() for m in self.migrations],
            "straggler": self.straggler,
            "liveness": {"heartbeat_timeout_s": self.cfg.heartbeat_timeout_s, "stuck_deadline_s": round(self._stuck_deadline(), 3),
                         "max_beat_gap_s": round(max((h.max_gap for h in self.processes.values()), default=0.0), 3),
                         "fenced": list(self.fenced)},
            "finished": self.done and self.failure is None,
            "failure": self.failure,
            "controller": {"restarts": self.restarts, "resuming": self.resuming is not None},
            "protection": {"tiers": self.cfg.recovery_tiers, "snapshot_every": self.snapshot_every,
                           "checkpoint_every": self.cfg.checkpoint_every, "checkpoints": list(self.checkpoint_steps),
                           "snapshots": self.holder_status()},
        }
