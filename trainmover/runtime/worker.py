"""The process that runs on every training node and on every standby node.

One process per rank. A *worker* trains from the start; a *standby* builds the same
workload against sandboxed groups, runs shadow steps to warm up, then waits. On a
migration the leaver's slot is taken by a standby, which from then on is a worker.

    python -m trainmover.runtime.worker      (started by the controller through srun)
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from trainmover.control import channel
from trainmover.control.messages import make
from trainmover.errors import DeadlineExceeded, MigrationError, TrainMoverError
from trainmover.runtime import boundary, checkpoint, phase1, recovery, rng, snapshot, transfer
from trainmover.runtime.link import Link
from trainmover.runtime.groups import Revoked, SandboxBackend, SwappableGroup, gloo_group
from trainmover.runtime.plan import GroupSpec, delta
from trainmover.runtime.spec import WorkerSpec
from trainmover.workloads import base as workloads

log = logging.getLogger("trainmover.worker")


CONTROL = "tm-control"
SNAPSHOT = "tm-snapshot"  # the snapshot tier's exchange (runtime/snapshot.py): gloo, host memory
RESEND_STEPS = 2048  # step reports kept for a restarted controller (its metrics rows of the gap)
RESEND_KINDS = ("recorded", "ready", "prepared", "prepare_failed", "switched", "stalled", "finished")
RETIRE_AFTER = 3  # steps between a switch and the release of the replaced communicators
RECOVERY_GRACE_S = 10.0  # a stalled rank outwaits the controller's recovery deadline by this much
REWARM_POLL_S = 1.0  # an idle standby looks for a newer recording version this often
TRACE_STEPS = 2 if os.environ.get("TM_TRACE_SWITCH") else 0  # log timings of the steps after a switch


def go_key(epoch: int, leaver: int) -> str:
    return f"tm/e{epoch}/xfer/r{leaver}/go"


def cancel_key(epoch: int, leaver: int) -> str:
    return f"tm/e{epoch}/xfer/r{leaver}/cancel"


def layout_key(epoch: int, leaver: int) -> str:
    return f"tm/e{epoch}/xfer/r{leaver}/layout"


class Agent:
    def __init__(self, spec: WorkerSpec, local_index: int):
        self.spec, self.local = spec, local_index
        self.rank = spec.my_rank(local_index)
        self.role = spec.role
        self.timeout = datetime.timedelta(seconds=spec.group_timeout_s)
        self.device, self.backend = spec.resolved()
        if self.device == "cuda":
            torch.cuda.set_device(local_index % torch.cuda.device_count())
        self.store = dist.TCPStore(spec.store[0], spec.store[1], is_master=False,
                                   timeout=self.timeout, wait_for_workers=False)
        # what a restarted controller is told (see resync_messages)
        self.state = "training" if self.role == "worker" else "starting"
        self.joining = 0        # a standby: the epoch it is joining
        self.switched_epoch = 0  # the epoch of this process's last switch
        self.last_sent: dict[str, dict] = {}
        self.step_reports: deque = deque(maxlen=RESEND_STEPS)
        self.pending: phase1.Prepared | None = None
        self.completed = 0     # steps whose updates this rank's state holds
        self.link = Link(tuple(spec.controller), channel.read_secret(spec.secret_file), self._hello,
                         self.resync_messages, self._on_control, connect_timeout=spec.group_timeout_s,
                         reconnect_timeout=spec.reconnect_timeout_s, on_gone=self._controller_gone)
        self.inbox: queue.Queue = self.link.inbox
        self.workload = workloads.load(spec.workload, spec.workload_options)
        self.specs = self.workload.group_specs(spec.world_size)
        names = {g.name for g in self.specs}
        if "world" not in names:
            self.specs.append(GroupSpec("world", tuple(range(spec.world_size))))
        # The per-step agreement runs on its own CPU group: 8 bytes over gloo cost no GPU sync.
        self.specs.append(GroupSpec(CONTROL, tuple(range(spec.world_size))))
        if spec.snapshot_every:  # a group of its own: exchanges run beside the step's collectives
            self.specs.append(GroupSpec(SNAPSHOT, tuple(range(spec.world_size))))
        self.snapshots: snapshot.Snapshots | None = None  # made once the rank is known (see protect)
        self.checkpoints: checkpoint.Writer | None = None
        self.groups: dict[str, SwappableGroup] = {}
        self.reported: set[tuple[int, str]] = set()
        self.retired: list = []  # old backends: released off the critical path (see retire)
        self.trace_steps = 0
        self.recorder = None  # the recording rank's recorder (trainmover.sandbox.live)
        self.replayed: dict[int, int] = {}  # a standby: the latest recording version it warmed on, by role rank
        self.rehearsed: int | None = None  # a standby: the rank whose role its workload is built for
        self.shadow_step: int | None = None  # step its shadow steps replay (the latest recorded one)
        self.slow, self.pure_s = 0.0, 0.0

    # --- control channel -------------------------------------------------------------
    def _hello(self) -> dict:
        return make("hello", role=self.role, node=self.spec.node, ranks=[] if self.rank is None else [self.rank],
                    pid=os.getpid())

    def _on_control(self, msg: dict) -> None:
        if msg["type"] == "revoke":  # now, not at the next step: the main thread may be stuck
            self._revoke(msg)

    def _controller_gone(self) -> None:
        if self.role == "standby":  # nobody can call on an idle standby any more: free the node now
            log.info("controller gone for good; standby exits")
            _exit_now(0)

    def resync_messages(self) -> list[dict]:
        """What a restarted controller needs, sent right after `hello` (see controller/resume.py):
        where this process is, its recent step reports (the controller skips those it logged)
        and the last message of each kind that changes the controller's view."""
        prep = self.pending
        pending = self.joining or (prep.epoch if prep is not None else 0)
        out = [make("resync", node=self.spec.node, ranks=[] if self.rank is None else [self.rank], role=self.role,
                    step=self.completed, pending=pending, switched=self.switched_epoch, state=self.state)]
        out += list(self.step_reports)
        for kind in RESEND_KINDS:
            msg = self.last_sent.get(kind)
            if msg is None:
                continue
            if kind in ("prepared", "prepare_failed") and msg["epoch"] != pending:
                continue
            if kind == "stalled" and self.state != "stalled":
                continue
            if kind == "ready" and self.state != "ready":
                continue
            out.append(msg)
        return out

    def _revoke(self, msg: dict) -> None:
        # Every group, not only those holding a failed rank: this rank stalls at its next step
        # boundary and every group is rebuilt (recovery.rebuild), so a collective it leaves in
        # flight anywhere must end now rather than make its peers wait for the group timeout.
        for g in list(self.groups.values()):
            g.revoke(msg["reason"])

    def _die_at(self) -> int | None:
        """The step at which an injected failure kills this process (workers launched for
        that rank only: a standby that later takes the rank runs on a healthy node)."""
        from trainmover.config import parse_die
        if self.spec.role != "worker":
            return None
        return next((s for r, s in (parse_die(i) for i in self.spec.inject if i.startswith("die:"))
                     if r == self.rank), None)

    def _slow_fraction(self) -> float:
        """The injected slowdown of this process (only workers launched for that rank: a joiner
        taking the rank over runs on another, healthy node)."""
        from trainmover.config import parse_slow
        if self.spec.role != "worker":
            return 0.0
        return next((f for r, f in (parse_slow(i) for i in self.spec.inject if i.startswith("slow:"))
                     if r == self.rank), 0.0)

    def _trace(self, what: str) -> None:
        if TRACE_STEPS:
            log.info("trace %.6f %s", time.time(), what)

    def retire(self, old, step: int) -> None:
        """Release a replaced backend without pausing training: NCCL communicators are
        aborted in a background thread (safe with a departed peer) RETIRE_AFTER steps after
        the switch, so that freeing their buffers (cudaFree synchronises the device) stays
        out of the first steps; gloo contexts are kept until exit, since destroying them with
        a departed peer can block."""
        self.retired.append((step + RETIRE_AFTER, old))

    def _release_retired(self, step: int) -> None:
        due = [old for at, old in self.retired if at == step]
        for old in due:
            comm = getattr(old, "comm", None)
            if comm is not None:
                threading.Thread(target=comm.abort, name="tm-retire", daemon=True).start()

    def send(self, kind: str, **fields):
        """To the controller, if reachable; training goes on either way (a restarted
        controller gets what it needs in the resync)."""
        msg = make(kind, **fields)
        if kind == "step":
            self.step_reports.append(msg)
        elif kind in RESEND_KINDS:
            self.last_sent[kind] = msg
        if kind == "ready":
            self.state = "ready"
        elif kind == "warming":
            self.state = "warming"
        self.link.send(msg)

    # --- groups ------------------------------------------------------------------------
    def build_backend(self, name: str, prefix: str, grank: int, size: int, store=None):
        """A real backend for group `name`: gloo for the control group (and on CPU nodes),
        NCCL through trainmover.nccl on GPU nodes. `store`: the rendezvous client to use
        (default: the agent's own)."""
        store = self.store if store is None else store
        if self.backend == "nccl" and name not in (CONTROL, SNAPSHOT):
            from trainmover.nccl.backend import nccl_group
            backend = nccl_group(store, prefix, grank, size, timeout_s=self.spec.group_timeout_s, name=name)
            backend.preconnect(p2p=name == "xfer")
            return backend
        return gloo_group(store, prefix, grank, size, host=self.spec.node_addr, timeout=self.timeout)

    def phase1_builder(self) -> phase1.Builder:
        """The builder of one Phase 1, on a rendezvous client of its own. A TCPStore client
        serialises its operations: a rendezvous waiting for a peer that died (up to the group
        timeout) would otherwise hold up every store operation of this process, such as the
        leaver's cancel key on an abort, the next epoch's Phase 1, or a recovery's rebuild."""
        clients = []

        def build(name: str, prefix: str, grank: int, size: int):
            if not clients:  # made in the Phase 1 thread: a connect is off the training path
                clients.append(dist.TCPStore(self.spec.store[0], self.spec.store[1], is_master=False,
                                             timeout=self.timeout, wait_for_workers=False))
            return self.build_backend(name, prefix, grank, size, store=clients[0])
        return build

    def _inject_phase1(self, who: int | str, epoch: int) -> None:
        """TM_INJECT die-in-phase1:<rank or joiner>:<epoch>: this process dies (SIGKILL) as
        its Phase 1 of `epoch` has begun (the builds are under way)."""
        from trainmover.config import parse_die_in_phase1
        if any(parse_die_in_phase1(i) == (who, epoch) for i in self.spec.inject if i.startswith("die-in-phase1:")):
            log.error("injected: %s dies (SIGKILL) in phase 1 of epoch %d", who, epoch)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    def _make_groups(self, rank: int, sandbox: bool) -> dict[str, SwappableGroup]:
        groups = {}
        for g in self.specs:
            if rank not in g.ranks:
                continue
            grank = g.ranks.index(rank)
            inner = (SandboxBackend(grank, len(g.ranks)) if sandbox else
                     self.build_backend(g.name, f"tm/e0/{g.name}/", grank, len(g.ranks)))
            groups[g.name] = SwappableGroup(g.name, grank, len(g.ranks), list(g.ranks), inner)
        return groups

    def _context(self, rank: int) -> workloads.BuildContext:
        return workloads.BuildContext(rank=rank, world_size=self.spec.world_size, groups=self.groups,
                                      seed=self.spec.seed, options={**self.spec.workload_options, "device": self.device},
                                      before_update=self._before_update)

    def _before_update(self) -> None:
        """The workload's gate before its optimizer step (see BuildContext.before_update)."""
        if self.device == "cuda":
            torch.cuda.current_stream().synchronize()  # an aborted collective has ended by now
        revoked = [g.group_name_ for g in self.groups.values() if g.revoked]
        if revoked:
            raise Revoked(f"groups {revoked} revoked during this step: its gradients are not used")

    def shadow_until_steady(self, max_steps: int) -> int:
        """Run shadow steps until a step issues the same collectives as the one before.

        Wrappers do one-time collectives in their first iterations (DDP broadcasts its
        rebuilt bucket layout in the second forward). A joiner must have done those in the
        sandbox: issuing them against the live job would mismatch the stayers' sequence."""
        sandboxes = [g.inner for g in self.groups.values()]
        previous, steps = None, 0
        while steps < max_steps:
            marks = [len(b.calls) for b in sandboxes]
            self.workload.train_step(self.workload.shadow_data_step() if self.shadow_step is None else self.shadow_step)
            steps += 1
            signature = [tuple(b.calls[m:]) for b, m in zip(sandboxes, marks)]
            if signature == previous:
                return steps
            previous = signature
        raise MigrationError(f"collectives still changing after {max_steps} shadow steps", phase="warmup",
                             host=self.spec.node)

    def memory(self) -> dict:
        """What a migration costs this rank in memory: torch's allocator and the device."""
        if self.device != "cuda":
            return {}
        free, total = torch.cuda.mem_get_info()
        return {"alloc_bytes": torch.cuda.memory_allocated(), "reserved_bytes": torch.cuda.memory_reserved(),
                "device_used_bytes": total - free}

    def comms_created(self) -> int:
        if self.backend != "nccl":
            return 0
        from trainmover.nccl import lib
        return lib.created_count()

    def full_state(self, step: int) -> dict:
        return {"workload": self.workload.state_dict(), "rng": rng.capture(), "step": step}

    def replica_state(self, step: int) -> dict:
        """What a replica gives a rebuilt rank: model, optimizer and the step (data position and
        dropout follow from rank and step, see Workload.replica_group)."""
        sd = self.workload.state_dict()
        return {"workload": {"model": sd["model"], "optimizer": sd.get("optimizer", {}), **{
            k: v for k, v in sd.items() if k not in ("model", "optimizer")}}, "step": step}

    # --- snapshot and checkpoint tiers ----------------------------------------------------
    def snapshot_keeper(self) -> snapshot.Snapshots:
        if self.snapshots is None or self.snapshots.rank != self.rank:
            self.snapshots = snapshot.Snapshots(self.rank, self.spec.world_size, self.spec.ranks_per_node,
                                                self.spec.group_timeout_s, corrupt="corrupt-snapshot" in self.spec.inject)
        return self.snapshots

    def protect(self, step: int) -> None:
        """At the boundary after `step` steps: a snapshot and/or a checkpoint when due. Only the
        copy into host memory happens here; exchanges and writes run in background threads."""
        every_s, every_c = self.spec.snapshot_every, self.spec.checkpoint_every
        due_s, due_c = every_s and step % every_s == 0, every_c and step % every_c == 0
        if step >= self.spec.steps or not (due_s or due_c):
            return
        copy = None
        if due_s:
            copy = self.snapshot_keeper().take(step, self.full_state(step), self.groups[SNAPSHOT].inner)
        if due_c:
            if self.checkpoints is None or self.checkpoints.rank != self.rank:
                self.checkpoints = checkpoint.Writer(Path(self.spec.checkpoint_dir), self.rank, self._checkpointed)
            state = copy if copy is not None else transfer.host_copy(self.full_state(step))
            self.checkpoints.submit(step, state, self.spec.group_timeout_s)

    def _checkpointed(self, result: dict) -> None:
        self.send("checkpointed", rank=self.rank, step=result["step"], digest=result["digest"],
                  bytes=result["bytes"], seconds=result["seconds"])

    def holds(self) -> dict:
        """What the recovery tiers can use from this rank (the `holds` of a `stalled` report)."""
        name = self.workload.replica_group()
        replicas = next((list(g.ranks) for g in self.specs if g.name == name and self.rank in g.ranks), [])
        return {"replicas": replicas, **(self.snapshots.report() if self.snapshots else {"own": [], "held": {}})}

    def load_full(self, state: dict) -> None:
        """Load a full state (snapshot, checkpoint) kept elsewhere: from a copy, since an
        optimizer's load_state_dict may keep the very tensors it is given."""
        state = transfer.host_copy(state)
        self.workload.load_state_dict(state["workload"])
        rng.restore(state["rng"])

    def digest(self) -> str:
        sd = self.workload.state_dict()
        return transfer.digest_tensors(transfer.tensors_of({"model": sd["model"], "optimizer": sd.get("optimizer", {})}))

    # --- lifecycle ---------------------------------------------------------------------
    def run(self) -> int:
        if self.role == "worker":
            self.groups = self._make_groups(self.rank, sandbox=False)
            if self.rank in self._roles().values():
                self._start_recording()
            self.workload.build(self._context(self.rank))
            return self.train(0)
        return self.standby()

    # --- recorded collectives (trainmover.sandbox) ------------------------------------------
    def _roles(self) -> dict[str, int]:
        """The roles a standby rehearses and the ranks that record them ({} if not recording)."""
        if not self.spec.recording_dir or not self.spec.record_iterations:
            return {}
        return self.workload.standby_roles(self.spec.world_size)

    def _start_recording(self) -> None:
        from trainmover.sandbox import live, recording
        ok, why = recording.available()
        if not ok:
            log.warning("not recording collectives: %s", why)
            return
        self.recorder = live.Recorder(self.groups, recording.base_of(self.spec.recording_dir, self.rank), self.rank,
                                      self.spec.record_iterations, skip=CONTROL,
                                      from_step=self.spec.record_from_step, max_versions=self.spec.record_versions)

    def _replay(self) -> dict:
        """Shadow iterations on the live job's recordings: the standby rehearses every role
        (each pipeline stage kind; one role without pipeline parallelism) and must compute the
        very losses and sends its rank computed. Between roles it drops the previous role's
        model and optimizer, so that it never holds more than one rank's state; the last
        role stays built (a join rebinds it to the leaver's rank)."""
        if self.spec.standby_warmup == "cold":
            return {"replay": "skipped: cold standby (TM_STANDBY_WARMUP=cold)"}
        roles = self._roles()
        if not roles:
            return {"replay": "unavailable: recording disabled"}
        from trainmover.sandbox import shadow

        # The live ranks may record later than the job start (TM_RECORD_FROM_STEP): wait longer.
        done, failed = shadow.replay_roles(
            self.specs, Path(self.spec.recording_dir), roles, 3 * self.spec.group_timeout_s, CONTROL, self._rehearse,
            self.workload.train_step, settle=lambda: self.shadow_until_steady(self.spec.shadow_steps),
            reset_peak=lambda: _reset_peak_memory(self.device), peak=lambda: _peak_memory(self.device))
        for report in done:
            self.replayed[report["rank"]], self.shadow_step = report["version"], report["last_step"]
        if failed is not None:
            return {**failed, "roles": done}
        _free_device_memory(self.device)  # keeps the last role's model and optimizer, not its activations
        return shadow.combine(done, self.memory())

    def _rehearse(self, rank: int, groups: dict[str, SwappableGroup]) -> None:
        """A standby: build the workload for `rank`'s role on `groups` (sandboxed), first
        dropping the role it holds, so that it never holds two ranks' state."""
        if self.rehearsed is not None:
            self.workload.release()
            _free_device_memory(self.device)
        self.groups = groups
        (self.workload.rebind if self.rehearsed is not None else self.workload.build)(self._context(rank))
        self.rehearsed = rank

    @contextlib.contextmanager
    def _warm_stance(self):
        """Around the shadow steps. A cold standby (a benchmark's baseline) forgets afterwards
        everything it compiled, so that its first real step compiles as in a fresh process.

        Why not skip compiling in its shadow steps (force_eager): DDP fixes its bucket layout
        from the gradient order of its first step, and eager and compiled backward passes
        order gradients differently; a joiner whose buckets differ from the job's reduces
        other parameters at the same offsets (silently wrong) or buckets of other sizes (NCCL
        hangs). So the layout comes from a compiled step, as the job's did, and only the
        compiled code is thrown away. (Every joiner's layout is checked: _layout_mismatch.)"""
        yield
        if self.spec.standby_warmup == "cold":
            _forget_compiled(self.spec.node)

    def _rewarm_if_newer(self, t0: float) -> None:
        """A warm standby re-warms when a role's live rank recorded a new version (its
        collectives changed shape): it rebinds to that role if it holds another, replays the
        version, then reports ready again with the new version's report."""
        if self.spec.standby_warmup == "cold" or not self.replayed:
            return
        from trainmover.sandbox import recording, shadow
        found = {rank: shadow.newer(recording.base_of(self.spec.recording_dir, rank), version)
                 for rank, version in self.replayed.items()}
        rank, version = next(((r, v) for r, v in found.items() if v is not None), (None, None))
        if version is None:
            return
        self.send("warming", node=self.spec.node, version=version, rank=rank)
        if rank != self.rehearsed:
            self._rehearse(rank, self._make_groups(rank, sandbox=True))
        report = shadow.rewarm(self.groups, recording.version_path(recording.base_of(self.spec.recording_dir, rank),
                                                                   version), CONTROL, self.workload.train_step)
        self.replayed[rank], self.shadow_step = version, report["last_step"]
        steps = self.shadow_until_steady(self.spec.shadow_steps)
        self.send("ready", node=self.spec.node, local=self.local, warmup_s=time.perf_counter() - t0,
                  shadow_steps=steps, detail=report)

    def standby(self) -> int:
        t0 = time.perf_counter()
        if "die-in-warmup" in self.spec.inject:  # the controller gives it to the chosen launch only
            log.error("injected: standby on %s dies (SIGKILL) as its warm-up begins", self.spec.node)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        shadow = self._replay()
        if shadow["replay"] != "done":
            log.warning("shadow iterations without a recording: %s", shadow["replay"])
            if self.rehearsed is None:  # else: a role before the missing one was rehearsed and stays built
                rehearse = self.local % self.spec.world_size  # any valid rank: a join rebinds to the leaver's
                self._rehearse(rehearse, self._make_groups(rehearse, sandbox=True))
        with self._warm_stance():
            steps = self.shadow_until_steady(self.spec.shadow_steps)
        self.send("ready", node=self.spec.node, local=self.local, warmup_s=time.perf_counter() - t0,
                  shadow_steps=steps, detail=shadow)
        log.info("standby on %s warm after %.2fs", self.spec.node, time.perf_counter() - t0)
        while True:
            try:
                msg = self.inbox.get(timeout=REWARM_POLL_S)
            except queue.Empty:
                self._rewarm_if_newer(t0)
                continue
            if msg is None:
                log.info("controller closed the channel; standby exits")
                return 0
            if msg["type"] == "prepare":
                start = self.join(msg)
                if start is not None:
                    return self.train(start)
                self.send("ready", node=self.spec.node, local=self.local, warmup_s=time.perf_counter() - t0,
                          shadow_steps=0, detail={})
            elif msg["type"] == "recover" and str(self.local) in msg["assign"]:
                return self.train(self.take_failed_rank(msg))

    def _layout_mismatch(self, epoch: int, leaver: int) -> str | None:
        """Why this joiner's collective layout cannot replace the leaver's ('' if it can; None
        if the controller aborted the epoch meanwhile). The leaver publishes its layout when it
        gets `prepare`; the wait is bounded and abortable."""
        key, deadline = layout_key(epoch, leaver), time.monotonic() + self.spec.group_timeout_s
        while not self.store.check([key]):
            if self._aborted(epoch):
                return None
            if time.monotonic() > deadline:
                return f"the leaver never published its collective layout ({self.spec.group_timeout_s:g}s)"
            time.sleep(0.05)
        ours, theirs = self.workload.collective_layout(), self.store.get(key).decode()
        if ours != theirs:
            return (f"the joiner's collective layout differs from the leaver's (its collectives would not match "
                    f"the stayers'): joiner {ours[:200]!r}, leaver {theirs[:200]!r}")
        return ""

    def _aborted(self, epoch: int) -> bool:
        """Whether the controller aborted `epoch` (other messages are not for a joining standby)."""
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return False
            if msg is not None and msg["type"] == "abort" and msg["epoch"] == epoch:
                return True

    def take_failed_rank(self, msg: dict, rebind: bool = True) -> int:
        """Unexpected failure: take a vanished rank's slot. Unlike a planned join, the job is
        paused while this runs, so only what must happen is done: rebind to the rank (its new
        wrappers' one-time collectives in the sandbox), build the groups, receive a replica's state."""
        t0 = time.perf_counter()
        rank = int(msg["assign"][str(self.local)])
        self.rank = rank
        if rebind:
            self.groups = self._make_groups(rank, sandbox=True)
            self.workload.rebind(self._context(rank))
            self.shadow_until_steady(self.spec.shadow_steps)
        rebind_s = time.perf_counter() - t0
        backends, report = recovery.rebuild(self, msg, "joiner")
        for name, backend in backends.items():
            self.retire(self.groups[name].swap(backend), msg["step"])
        self.role, self.state, self.switched_epoch = "worker", "training", msg["epoch"]
        self.send("switched", epoch=msg["epoch"], rank=rank, role="joiner", step=msg["step"], t=time.time(),
                  detail={**report, "rebind_s": rebind_s, "seconds": time.perf_counter() - t0, **self.memory()})
        log.info("took failed rank %d at step %d in %.3fs", rank, msg["step"], time.perf_counter() - t0)
        self.trace_steps = TRACE_STEPS
        return int(msg["step"])

    def join(self, msg: dict) -> int | None:
        """Take a leaver's slot. Returns the step to continue from, or None if the
        migration was cancelled (the agent then stays a standby)."""
        epoch = msg["epoch"]
        self.joining, self.state = epoch, "joining"
        try:
            return self._join(msg, epoch)
        finally:
            self.joining = 0

    def _join(self, msg: dict, epoch: int) -> int | None:
        rank = int(msg["assign"][str(self.local)])
        leaver = rank
        # Off the critical path: rebuild groups with the rank we now know, rebind the workload,
        # and run shadow steps so that the new wrappers' one-time work happens in the sandbox.
        self.groups = self._make_groups(rank, sandbox=True)
        self.workload.rebind(self._context(rank))
        with self._warm_stance():
            self.shadow_until_steady(self.spec.shadow_steps)
        prep = phase1.Prepared(epoch, delta(self.specs, msg["leavers"], epoch), "joiner", rank)
        phase1.start(prep, self.phase1_builder())
        self._inject_phase1("joiner", epoch)
        # Bounded, and abortable: a peer lost meanwhile leaves the builds waiting until the
        # group timeout, but the controller's abort frees this standby at once (the Phase 1
        # thread ends by its own deadline, on its own store client, and is discarded).
        deadline = time.monotonic() + self.spec.group_timeout_s + 5
        while not prep.done.wait(0.05):
            if self._aborted(epoch):
                log.info("epoch %d aborted during phase 1; back to standby", epoch)
                return None
            if time.monotonic() > deadline:
                break
        if not prep.done.is_set() or prep.error:
            self.send("prepare_failed", epoch=epoch, rank=rank, error=prep.error or "phase 1 deadline")
            return None
        mismatch = self._layout_mismatch(epoch, leaver)
        if mismatch is None:
            log.info("epoch %d aborted during phase 1; back to standby", epoch)
            return None
        if mismatch:
            self.send("prepare_failed", epoch=epoch, rank=rank, error=mismatch)
            return None
        self.send("prepared", epoch=epoch, rank=rank, groups=sorted(prep.backends), seconds=prep.seconds,
                  detail={"role": "joiner"})
        # Wait for the leaver's verdict: it either starts sending (go) or cancels.
        deadline = time.monotonic() + self.spec.switch_timeout_s
        while True:
            if self.store.check([cancel_key(epoch, leaver)]) or self._aborted(epoch):
                log.info("epoch %d cancelled; back to standby", epoch)
                return None
            try:
                self.store.wait([go_key(epoch, leaver)], datetime.timedelta(milliseconds=50))
                break
            except (RuntimeError, dist.DistStoreError):
                pass
            if time.monotonic() > deadline:
                self.send("prepare_failed", epoch=epoch, rank=rank, error="leaver never sent its state")
                return None
        t_switch = time.perf_counter()
        try:
            state, stats = transfer.recv_verified(prep.xfer, src=0, like=self.full_state(0))
        except (MigrationError, RuntimeError) as exc:  # the leaver died mid-copy: a replica will send it
            self.rank = rank
            self.send("stalled", rank=rank, step=0, digest="", error=str(exc)[:500], role="joiner",
                      holds={"replicas": [], "own": [], "held": {}})
            return self.take_failed_rank(self._wait_recover(exc), rebind=False)
        self.workload.load_state_dict(state["workload"])
        rng.restore(state["rng"])
        for name, backend in prep.backends.items():
            self.retire(self.groups[name].swap(backend), int(state["step"]))
        # The transfer pair is done too; dropping its last reference here would abort the
        # communicator synchronously, inside the pause (measured: 0.5 s on an H200).
        self.retire(prep.xfer, int(state["step"]))
        self.rank, self.role, self.state, self.switched_epoch = rank, "worker", "training", epoch
        self.send("switched", epoch=epoch, rank=rank, role="joiner", step=int(state["step"]), t=time.time(),
                  detail={"recv_s": stats.seconds, "copy_s": stats.copy_s, "bytes": stats.bytes,
                          "apply_s": time.perf_counter() - t_switch, "prepare_s": prep.seconds,
                          "attempts": stats.attempts,
                          "comms_created": self.comms_created(), **self.memory()})
        log.info("joined as rank %d at step %d (%d bytes in %.3fs)", rank, state["step"], stats.bytes, stats.seconds)
        self.trace_steps = TRACE_STEPS
        return int(state["step"])

    def train(self, step: int) -> int:
        self.slow, self.pure_s = self._slow_fraction(), 0.0
        die_at = self._die_at()
        loss = 0.0
        self._trace("train loop entered")
        while step < self.spec.steps:
            if step == die_at:  # injected unexpected failure: no goodbye, no report
                os.kill(os.getpid(), signal.SIGKILL)
            self.completed = step
            try:
                loss, step = self._iteration(step)
            except (RuntimeError, TrainMoverError) as exc:
                # a collective failed or was revoked (a peer is gone); an error of our own
                # communicator library counts only if the controller revoked a group meanwhile
                if not isinstance(exc, RuntimeError) and not any(g.revoked for g in self.groups.values()):
                    raise
                step = self.stall(self.completed, exc)
                continue
            if step < 0:
                return 0  # this rank left the job (planned migration)
        self.state = "finished"
        self.send("finished", rank=self.rank, step=step, digest=self.digest(), loss=loss)
        return 0

    def _iteration(self, step: int) -> tuple[float, int]:
        """One training step, its report and the boundary agreement. Returns (loss, steps
        completed), steps -1 when this rank handed its state over and leaves."""
        control, world = self.groups[CONTROL], self.groups["world"]
        world.first_call_at = None
        t0, c0 = time.perf_counter(), time.process_time()
        if self.slow:  # injected straggler: this process computes (1 + slow) times as long
            _burn(self.slow * self.pure_s, cpu=self.device == "cpu")
        t1, c1 = time.perf_counter(), time.process_time()
        if self.recorder:
            self.recorder.before(step)
        if self.trace_steps:
            self.trace_steps -= 1
            self._trace(f"step {step + 1} begins")
            self.workload.trace = self._trace
        elif getattr(self.workload, "trace", None):
            self.workload.trace = None
        loss = self.workload.train_step(step)
        # a rank's own compute: until its first collective (after that it may wait for peers)
        # On CPU nodes: CPU time, which co-located processes cannot inflate; on GPUs: wall time.
        if self.device == "cpu":
            first = world.first_call_cpu if world.first_call_at is not None else time.process_time()
            compute_s, self.pure_s = first - c0, first - c1
        else:
            first = world.first_call_at or time.perf_counter()
            compute_s, self.pure_s = first - t0, first - t1
        if self.recorder:
            report = self.recorder.after(step, loss, time.perf_counter() - t0)
            if report:  # the recorder stays: it records again if the collectives change shape
                self.send("recorded", **report)
        step += 1
        self.completed = step  # from here on a failure finds this step complete in our state
        self.send("step", rank=self.rank, step=step, loss=loss, step_s=time.perf_counter() - t0,
                  compute_s=compute_s, t=time.time())
        self.protect(step)
        self._release_retired(step)
        self._poll_inbox()
        prep = self.pending
        ready = prep.epoch if prep and prep.done.is_set() and not prep.error else 0
        if boundary.agree(control, ready) == ready and ready:
            if prep.role == "leaver":
                self.leave(prep, step)
                return loss, -1
            for name, backend in prep.backends.items():
                self.retire(self.groups[name].swap(backend), step)
            self.pending = None
            self.switched_epoch = prep.epoch
            self.trace_steps = TRACE_STEPS
            self._trace("stayer swapped")
            self.send("switched", epoch=prep.epoch, rank=self.rank, role="stayer", step=step, t=time.time(),
                      detail={"prepare_s": prep.seconds, "comms_created": self.comms_created(),
                              "comms_created_before": prep.comms_before})
        return loss, step

    # --- unexpected failure of another rank ----------------------------------------------
    def _wait_recover(self, exc: Exception) -> dict:
        """The controller's `recover` plan, within the recovery deadline. The controller's
        deadline decides (its message names what it waited for); a rank gives up only
        RECOVERY_GRACE_S later, when that decision never came."""
        deadline = time.monotonic() + self.spec.recovery_timeout_s + RECOVERY_GRACE_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MigrationError(f"no recovery plan within {self.spec.recovery_timeout_s:.0f}s after: {exc}",
                                     phase="recover", rank=self.rank, host=self.spec.node)
            try:
                msg = self.inbox.get(timeout=left)
            except queue.Empty:
                continue
            if msg is None:
                raise MigrationError(f"controller gone while stalled after: {exc}", phase="recover", rank=self.rank)
            if msg["type"] == "recover":
                return msg
            # revoke (already applied), or a planned epoch's prepare/abort: void now

    def stall(self, completed: int, exc: Exception) -> int:
        """A collective failed: report how far this rank got and wait (bounded) for the
        controller's recovery plan. Returns the step to resume from."""
        log.warning("rank %d stalled after %d steps: %s", self.rank, completed, str(exc)[:300])
        if self.pending is not None:  # a planned migration in flight is void: its groups hold the lost rank
            self._on_abort({"epoch": self.pending.epoch, "reason": "unexpected failure"})
        self.state = "stalled"
        self.send("stalled", rank=self.rank, step=completed, digest=self.digest(), error=str(exc)[:500],
                  role="stayer", holds=self.holds())
        msg = self._wait_recover(exc)
        self.state = "training"
        if completed < msg["step"] and self.rank not in msg["needers"]:
            raise MigrationError(f"recovery plan resumes at step {msg['step']} but this rank has completed "
                                 f"{completed} and gets no state", phase="recover", rank=self.rank)
        backends, report = recovery.rebuild(self, msg, "stayer")
        for name, backend in backends.items():
            self.retire(self.groups[name].swap(backend), msg["step"])
        # a rollback redoes the steps after msg["step"]: their old reports must not reach a restarted controller
        self.step_reports = deque((r for r in self.step_reports if r["step"] <= msg["step"]), maxlen=RESEND_STEPS)
        self.switched_epoch = msg["epoch"]
        self.send("switched", epoch=msg["epoch"], rank=self.rank, role="stayer", step=msg["step"], t=time.time(),
                  detail={**report, "redo_from": completed})
        self.trace_steps = TRACE_STEPS
        return int(msg["step"])

    def _poll_inbox(self):
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            if msg is None:
                continue  # controller gone: keep training without migrations
            if msg["type"] == "prepare":
                self._on_prepare(msg)
            elif msg["type"] == "abort":
                self._on_abort(msg)
        prep = self.pending
        if prep and prep.done.is_set():
            what = "failed" if prep.error else "prepared"
            if (prep.epoch, what) not in self.reported:
                self.reported.add((prep.epoch, what))
                if prep.error:
                    self.send("prepare_failed", epoch=prep.epoch, rank=self.rank, error=prep.error)
                else:  # memory measured at step boundaries, where a steady step's usage repeats
                    self.send("prepared", epoch=prep.epoch, rank=self.rank, groups=sorted(prep.backends),
                              seconds=prep.seconds, detail={"role": prep.role, "before": prep.memory_before,
                                                            "after": self.memory()})

    def _on_prepare(self, msg: dict):
        epoch = msg["epoch"]
        d = delta(self.specs, msg["leavers"], epoch)
        role = "leaver" if self.rank in d.leavers else "stayer"
        if role == "stayer" and not d.groups_to_build(self.rank):
            return  # no group of ours contains the leaver: nothing to do (never the case for world)
        if role == "leaver":  # for the joiner to check its own against (Workload.collective_layout)
            self.store.set(layout_key(epoch, self.rank), self.workload.collective_layout())
        self.pending = phase1.Prepared(epoch, d, role, self.rank)
        self.pending.memory_before, self.pending.comms_before = self.memory(), self.comms_created()
        phase1.start(self.pending, self.phase1_builder())
        log.info("phase 1 epoch %d as %s: %s", epoch, role, [g.name for g in d.groups_to_build(self.rank)])
        if self.role == "worker":
            self._inject_phase1(self.rank, epoch)

    def _on_abort(self, msg: dict):
        prep = self.pending
        if prep and prep.epoch == msg["epoch"]:
            self.pending = None
            if prep.role == "leaver":
                # Once the leaver stops offering this epoch the MIN can never equal it again:
                # tell the joiner, which waits on exactly this key.
                self.store.set(cancel_key(prep.epoch, self.rank), "1")
            log.info("epoch %d aborted: %s", prep.epoch, msg["reason"])

    def leave(self, prep: phase1.Prepared, step: int):
        state = self.full_state(step)
        if "skip-optimizer-state" in self.spec.inject:  # negative control for the digest tests
            state["workload"].pop("optimizer", None)
        self.store.set(go_key(prep.epoch, self.rank), "1")
        if "die-in-copy" in self.spec.inject:  # fault injection: the state must come from a replica
            os.kill(os.getpid(), signal.SIGKILL)
        stats = transfer.send_verified(state, prep.xfer, dst=1, corrupt="corrupt-transfer" in self.spec.inject)
        self.pending, self.state, self.switched_epoch = None, "left", prep.epoch
        self.send("switched", epoch=prep.epoch, rank=self.rank, role="leaver", step=step, t=time.time(),
                  detail={"send_s": stats.seconds, "copy_s": stats.copy_s, "bytes": stats.bytes,
                          "tensors": stats.tensors})
        log.info("left at step %d: sent %d bytes in %.3fs", step, stats.bytes, stats.seconds)


def main() -> int:
    logging.basicConfig(level=os.environ.get("TM_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s[" + os.environ.get("SLURMD_NODENAME", "?") + "] %(message)s")
    torch.set_num_threads(1)  # determinism and fair sharing of the node's cores
    spec = WorkerSpec.from_env()
    local = int(os.environ.get("SLURM_LOCALID", "0"))
    agent = None
    try:
        agent = Agent(spec, local)
        return agent.run()
    except (TrainMoverError, RuntimeError, DeadlineExceeded, MigrationError) as exc:
        log.error("%s on %s failed: %s", spec.role, spec.node, exc)
        if agent is not None:
            agent.send("failed", rank=agent.rank if agent.rank is not None else 0, phase=agent.role, error=str(exc)[:2000])
        return 1
    finally:
        if agent is not None:
            agent.link.flush()
            agent.link.close()


def _reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_memory(device: str) -> int | None:
    """Most bytes torch's allocator held since the last reset (None on CPU nodes)."""
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def _free_device_memory(device: str) -> None:
    """Give cached device memory back (a standby between roles, and once warm): what it keeps
    is then what it holds, not the peak of the role it rehearsed last."""
    import gc
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _forget_compiled(node: str) -> None:
    """Drop compiled code and point the compile caches at empty folders (torch's own
    recipe, torch._inductor.runtime.cache_dir_utils.temporary_cache_dir): the next compiled
    step traces, generates and builds its kernels again."""
    import tempfile
    from torch._inductor.utils import clear_caches
    fresh = tempfile.mkdtemp(prefix=f"tm-cold-{node}-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh
    os.environ["TRITON_CACHE_DIR"] = os.path.join(fresh, "triton")
    torch.compiler.reset()
    clear_caches()


def _burn(seconds: float, cpu: bool) -> None:
    """Injected slowness: on CPU nodes burn CPU (a slow node spends more cycles), else sleep."""
    if not cpu:
        time.sleep(seconds)
        return
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _exit_now(code: int) -> None:
    # Skip interpreter teardown: destroying gloo/NCCL contexts whose peers have already
    # left aborts the process (std::terminate) or hangs. All results are reported by now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
