"""The process that runs on every training node and on every standby node.

One process per rank. A *worker* trains from the start; a *standby* builds the same
workload against sandboxed groups, runs shadow steps to warm up, then waits. On a
migration the leaver's slot is taken by a standby, which from then on is a worker.

    python -m trainmover.runtime.worker      (started by the controller through srun)

`Agent` is the process: its lifecycle, the control channel to the controller, its groups and
its state, one value of rankstate.py's state machine. Each role it plays is an object of a
module of its own, handed what it uses of the process (context.RankContext) and the roles it
calls; the process holds them and wires them together here:

    standby.py      a standby: rehearse the roles on recordings, stay warm, re-warm
    training.py     the training loop and its step boundary
    switch.py       a planned migration's switch: stayer, leaver and joiner
    protection.py   snapshots and checkpoints of this rank's state
    recovery.py     an unexpected failure: stall and resume, or take a vanished rank's slot

Faults are injected through one hook, `faults.at(point, ...)` (trainmover/faults.py).
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

from trainmover import faults
from trainmover.errors import MigrationError
from trainmover.groups import rng
from trainmover.groups.specs import GroupSpec
from trainmover.groups.swappable import CONTROL, SNAPSHOT, Revoked, SandboxBackend, SwappableGroup, gloo_group
from trainmover.groups.tensors import digest_tensors, tensors_of
from trainmover.logs import setup_logging
from trainmover.protocol import channel, endpoint, files
from trainmover.protocol.messages import AbortMsg, Msg, PrepareMsg, RecoverMsg, make
from trainmover.protocol.store import AuthStore
from trainmover.protocol.worker_spec import WorkerSpec
from trainmover.runtime import changes, heartbeat, phase1, usercode
from trainmover.runtime.changes import Change
from trainmover.runtime.transfer import state as transfer
from trainmover.runtime.dispatch import GONE, GONE_TYPE, Dispatcher, Plan, Started
from trainmover.runtime.link import Link
from trainmover.runtime.protection.role import Protection
from trainmover.runtime.roles.recovery import RankRecovery
from trainmover.runtime.rankstate import RankState, RankStateMachine, role_of
from trainmover.runtime.roles.standby import REWARM_POLL_S, StandbyRole
from trainmover.runtime.roles.switch import Switch
from trainmover.runtime.roles.training import TRACE_STEPS, TrainingLoop
from trainmover.slurm.job_env import JobEnv
from trainmover.workloads import base as workloads
from trainmover.workloads import registry

log = logging.getLogger("trainmover.worker")

RESEND_STEPS = 2048  # step reports kept for a restarted controller (its metrics rows of the gap)
RESEND_KINDS = ("recorded", "ready", "prepared", "prepare_failed", "switched", "stalled", "finished")
RETIRE_AFTER = 3  # steps between a switch and the release of the replaced communicators
STORE_CONNECT_S = 2.0  # a moved controller's rendezvous store: one connect attempt's deadline
OWN_LOOP_STEPS = 2**62  # a script's steps: no limit but its own loop's end
FENCED = 75  # exit code of a process the controller judged dead (EX_TEMPFAIL: its node was at fault)
FAILED = 1   # this process's own code (the user's, or TrainMover's) raised: it said so in a `failed` report
ENDED = 2    # the controller ended the job (its `bye`) while this rank was still in it


def first_store(store: tuple[str, int], controller: tuple[str, int], timeout_s: float, connect, where):
    """(store client, store address, controller address) at this process's start. A launch a
    moment before the controller moved names the old one's store (and controller.json may still
    name it, or a controller that has just died): one connect that waits the group timeout there
    got a standby counted lost (load benchmark, 24.11, three times in one job). So: short connect
    attempts, controller.json (`where()`, sealed with the job's key) read before each, until
    `timeout_s`. `connect(host, port)` raises RuntimeError when nobody serves there."""
    deadline = time.monotonic() + timeout_s
    while True:
        ep = where()
        if ep is not None and ep.store != store:
            log.info("rendezvous store moved to %s:%d before this process started", *ep.store)
            store, controller = ep.store, tuple(ep.address)  # the controller moved with it
        try:
            return connect(*store), store, controller
        except (RuntimeError, dist.DistStoreError) as exc:
            if time.monotonic() >= deadline:
                raise
            log.info("rendezvous store at %s:%d not reachable yet: %s", *store, exc)
        time.sleep(0.2)


class Agent:
    """One process of a training or standby node (module docstring): what every role shares,
    and the roles. `link`: the control channel (default: a Link to the spec's controller)."""

    def __init__(self, spec: WorkerSpec, local_index: int, link: Link | None = None):
        self.spec, self.local = spec, local_index
        self.rank = spec.my_rank(local_index)
        self.timeout = datetime.timedelta(seconds=spec.job.group_timeout_s)
        self.device, self.backend = spec.resolved()
        if self.device == "cuda":
            torch.cuda.set_device(local_index % torch.cuda.device_count())
        self.key = channel.read_secret(spec.secret_file)  # once: kept for the process's life
        # moves with the controller (see _controller_address)
        self.store, self.store_addr, self.first_address = first_store(
            tuple(spec.store), tuple(spec.controller), spec.job.group_timeout_s,
            lambda host, port: self._store_client(host, port, connect_s=STORE_CONNECT_S),
            lambda: endpoint.read(spec.controller_file, self.key) if spec.controller_file else None)
        # what a restarted controller is told (see resync_messages)
        self.state = RankStateMachine(RankState.TRAINING if spec.role == "worker" else RankState.STARTING,
                                      who=f"{spec.role} {spec.node}/{local_index}")
        self.joining = 0        # a standby: the epoch it is joining
        self.warm_t0 = time.perf_counter()  # a standby: when its warm-up began (its `ready` reports say since)
        self.switched_epoch = 0  # the epoch of this process's last switch
        self.last_sent: dict[str, dict] = {}
        self.step_reports: deque = deque(maxlen=RESEND_STEPS)
        self.pending: phase1.Prepared | None = None
        self.completed = 0     # steps whose updates this rank's state holds
        self.groups: dict[str, SwappableGroup] = {}
        self.train_thread = threading.get_native_id()  # the heartbeat reports its CPU time
        # From this node's address, as every connection of the node: a node is its address.
        self.link = link if link is not None else Link(
            self.first_address, self.key, self._hello, self.resync_messages, self._on_control,
            connect_timeout=spec.job.group_timeout_s, reconnect_timeout=spec.job.reconnect_timeout_s,
            on_gone=self._controller_gone, source=spec.node_addr, where=self._controller_address,
            news=lambda: endpoint.mtime(spec.controller_file))
        # Beats from the moment the controller knows this process: building the workload
        # (imports, a model) may take longer than the silence that would judge it dead.
        self.heartbeat = (heartbeat.Heartbeat(self.link.send, self._beat, spec.job.heartbeat_s).start()
                          if spec.job.heartbeat_s > 0 else None)
        self.faults = faults.Injector(spec.inject, spec.role)
        with usercode.user_code("construction"):  # importing and constructing it run the user's code
            loaded = registry.load(spec.job.workload, spec.workload_options)
        self.workload = usercode.UserWorkload(loaded, self._inject_user_fault)
        if getattr(loaded, "owns_loop", False):  # a script: its own loop decides when training ends, not TM_STEPS
            self.spec = spec = dataclasses.replace(spec, job=dataclasses.replace(spec.job, steps=OWN_LOOP_STEPS))
        self.specs = self.workload.group_specs(spec.world_size)
        names = {g.name for g in self.specs}
        if "world" not in names:
            self.specs.append(GroupSpec("world", tuple(range(spec.world_size))))
        # The per-step agreement runs on its own CPU group: 8 bytes over gloo cost no GPU sync.
        self.specs.append(GroupSpec(CONTROL, tuple(range(spec.world_size))))
        if spec.job.snapshot_every:  # a group of its own: exchanges run beside the step's collectives
            self.specs.append(GroupSpec(SNAPSHOT, tuple(range(spec.world_size))))
        self.retired: list = []  # old backends: released off the critical path (see retire)
        self.trace_steps = 0  # steps after a switch whose timings are logged (TM_TRACE_SWITCH)
        # The roles, each handed this process (as a RankContext) and the roles it calls.
        self.protection = Protection(self)
        self.standby = StandbyRole(self, self.protection)
        self.recovery = RankRecovery(self, self.protection, self.standby)
        self.switch = Switch(self, self.protection, self.standby, self.recovery)
        self.training = TrainingLoop(self, self.protection, self.switch, self.recovery)
        self.inbox = Dispatcher(self.link.inbox, self.state, self.routes())

    def routes(self) -> dict[tuple[RankState, str], Callable[[Msg], object]]:
        """Where each controller message goes, by what this process is now (dispatch.py): the
        one table of the process; a (state, type) not here is void."""
        S = RankState
        return {
            # a worker, at a step boundary (training.py)
            (S.TRAINING, "prepare"): self.switch.on_prepare,      # Phase 1 beside training
            (S.TRAINING, "abort"): self.switch.on_abort,
            (S.TRAINING, "hold"): self.protection.on_hold,        # where its snapshots go
            (S.TRAINING, "foresee"): self.recovery.foresee,       # build each loss's groups ahead
            # a warm standby, between messages re-warming (serve_as_standby)
            (S.READY, "prepare"): self._join,
            (S.READY, "anticipate"): self.recovery.anticipate,    # bind to a vanished rank before the plan
            (S.READY, "recover"): self._take_failed_rank,
            (S.READY, "hold"): self.protection.hold_for,          # the snapshots it holds
            (S.READY, "foresee"): self.recovery.foresee,          # each loss's groups it may take, ahead
            (S.READY, "abort"): self.ready_again_after_abort,
            (S.READY, GONE_TYPE): lambda _: GONE,
            # a joiner inside its join (switch.py): only its epoch's abort frees it; a joiner
            # whose leaver died mid-copy waits for the recovery plan like a stalled rank
            (S.JOINING, "abort"): self.switch.on_join_abort,
            (S.JOINING, "recover"): Plan,
            (S.JOINING, GONE_TYPE): lambda _: GONE,
            # a stalled worker (roles/recovery.py): only the plan
            (S.STALLED, "recover"): Plan,
            (S.STALLED, GONE_TYPE): lambda _: GONE,
        }

    @property
    def role(self) -> str:
        """"worker" or "standby", from the state (rankstate.py): a standby that took a rank is a worker."""
        return role_of(self.state.now)

    def _inject_user_fault(self, what: str, args: tuple) -> None:
        """Called inside the guard of the workload's code (usercode.py): TM_INJECT raise."""
        self.faults.at("user", what=what, rank=self.rank, step=args[0] if what == "train_step" and args else None)

    def _hello(self) -> dict:
        return make("hello", role=self.role, node=self.spec.node, ranks=[] if self.rank is None else [self.rank],
                    pid=os.getpid())

    def _on_control(self, msg: dict) -> None:
        if msg["type"] == "revoke":  # now, not at the next step: the main thread may be stuck
            self._revoke(msg)
        elif msg["type"] == "fenced":  # judged dead and replaced (a frozen process resumed, a healed partition)
            log.error("fenced by the controller: %s; exiting at once, writing nothing", msg["reason"])
            _exit_now(FENCED)

    def _controller_address(self) -> tuple[str, int]:
        """Where the controller is now (asked by the link before each reconnection attempt):
        controller.json names a successor on another node together with its rendezvous store,
        to which this process's store client then moves (groups already built need no store)."""
        ep = endpoint.read(self.spec.controller_file, self.key) if self.spec.controller_file else None
        if ep is None:  # none, or not sealed with the job's key: stay where we are
            link = getattr(self, "link", None)  # none yet while the first connection is made
            return link.address if link is not None else self.first_address
        if ep.store != self.store_addr:
            try:
                # One plain TCP connect first, 0.5 s at most: controller.json may name a controller
                # that has just died (its successor not written yet), and c10d's client retries its
                # connect with back-off beyond its deadline (seen: 6-7 s per attempt there, and a
                # rank reconnected 0.2 s after the successor's 8 s window had closed).
                socket.create_connection((ep.store_host, ep.store_port), timeout=0.5).close()
                # a short connect deadline: a connect that waits the group timeout there blocks this
                # reconnection for that long (seen: 60 s, and the job stopped)
                self.store = self._store_client(ep.store_host, ep.store_port, connect_s=STORE_CONNECT_S)
                self.store_addr = ep.store
                log.info("rendezvous store moved to %s:%d", *ep.store)
            except (OSError, RuntimeError, dist.DistStoreError) as exc:  # not listening yet: next attempt
                log.info("rendezvous store at %s:%d not reachable yet: %s", *ep.store, exc)
        return ep.address

    def _store_client(self, host: str, port: int, connect_s: float | None = None) -> AuthStore:
        """A client of the job's rendezvous store whose every value is tagged with the job's key
        (protocol/store.py): nobody else can cancel, misdirect or feed a migration through it.
        `connect_s`: the deadline of the connect alone; its operations keep the group timeout."""
        connect = self.timeout if connect_s is None else datetime.timedelta(seconds=connect_s)
        client = dist.TCPStore(host, port, is_master=False, timeout=connect, wait_for_workers=False)
        client.set_timeout(self.timeout)
        return AuthStore(client, self.key)

    def _beat(self, now: float) -> dict:
        """What the heartbeat thread says of this process (runtime/heartbeat.py)."""
        worker = self.role == "worker" and self.rank is not None
        compute = getattr(self.workload, "compute_thread", None) if hasattr(self, "workload") else None
        thread = (compute() if compute is not None else None) or self.train_thread  # a script computes in its own thread
        return heartbeat.beat([self.rank] if worker else [], self.completed, dict(self.groups) if worker else {},
                              thread, now)

    def _controller_gone(self) -> None:
        if self.role == "standby":  # nobody can call on an idle standby any more: free the node now
            log.info("controller gone for good; standby exits")
            _exit_now(0)
        if self.link.bye is not None and self.state.now != RankState.FINISHED:
            # The controller ended the job (a rank's own error, a failure it could not recover):
            # waiting here, maybe in a collective with a rank that is gone, only holds the job.
            log.error("the controller ended the job: %s; rank %s exits", self.link.bye, self.rank)
            _exit_now(ENDED)

    def resync_messages(self) -> list[dict]:
        """What a restarted controller needs, sent right after `hello` (see controller/policy/takeover.py):
        where this process is, its recent step reports (the controller skips those it logged)
        and the last message of each kind that changes the controller's view."""
        prep = self.pending
        pending = self.joining or (prep.epoch if prep is not None else 0)
        out = [make("resync", node=self.spec.node, ranks=[] if self.rank is None else [self.rank], role=self.role,
                    step=self.completed, pending=pending, switched=self.switched_epoch, state=self.state.now.value)]
        out += list(self.step_reports)
        for kind in RESEND_KINDS:
            msg = self.last_sent.get(kind)
            if msg is None:
                continue
            if kind in ("prepared", "prepare_failed") and msg["epoch"] != pending:
                continue
            if kind == "stalled" and self.state.now != RankState.STALLED:
                continue
            if kind == "ready" and self.state.now != RankState.READY:
                continue
            out.append(msg)
        return out

    def _revoke(self, msg: dict) -> None:
        # Every group, not only those holding a failed rank: this rank stalls at its next step
        # boundary and every group is rebuilt (recovery.rebuild), so a collective it leaves in
        # flight anywhere must end now rather than make its peers wait for the group timeout.
        for g in list(self.groups.values()):
            g.revoke(msg["reason"])

    def send(self, kind: str, *, enter: RankState | None = None, **fields) -> None:
        """To the controller, if reachable; training goes on either way (a restarted
        controller gets what it needs in the resync). `enter`: the state this message
        announces (a standby's `ready`, `warming`), entered once the message is kept for a
        resync and before it is sent, so that a resync never finds the state without it."""
        msg = make(kind, **fields)
        if kind == "step":
            self.step_reports.append(msg)
        elif kind in RESEND_KINDS:
            self.last_sent[kind] = msg
        if enter is not None:
            self.state.to(enter)
        if self.link.send(msg) and kind == "step" and self.heartbeat is not None:
            self.heartbeat.stepped(time.monotonic())  # a beat is redundant for a while (heartbeat.beat_due_in)

    def apply(self, change: Change) -> None:
        """A role's change to this process (runtime/changes.py): the one place where the fields
        a role reads through RankContext are written."""
        match change:
            case changes.TakeRank(rank):
                self.rank = rank
            case changes.UseGroups(groups):
                self.groups = groups
            case changes.Completed(step):
                self.completed = step
            case changes.BeginPhase1(prep):
                self.pending = prep
            case changes.DropPhase1(epoch):
                if self.pending is not None and self.pending.epoch == epoch:
                    self.pending = None
            case changes.Joining(epoch):
                self.joining = epoch
            case changes.Switched(epoch, redo_after):
                self.pending = None
                self.switched_epoch = epoch
                if redo_after is not None:  # the steps after it are redone: their old reports must not resend
                    kept = [r for r in self.step_reports if r["step"] <= redo_after]
                    self.step_reports = deque(kept, maxlen=self.step_reports.maxlen)
            case changes.StepTraced():
                self.trace_steps = max(0, self.trace_steps - 1)
            case _:
                raise TypeError(f"not a rank change: {change!r}")

    def trace_next_steps(self) -> None:
        """After a switch: log the timings of the next TRACE_STEPS steps (TM_TRACE_SWITCH)."""
        self.trace_steps = TRACE_STEPS

    def retire(self, old, step: int) -> None:
        """Release a replaced backend without pausing training: NCCL communicators are
        aborted in a background thread (safe with a departed peer) RETIRE_AFTER steps after
        the switch, so that freeing their buffers (cudaFree synchronises the device) stays
        out of the first steps; gloo contexts are kept until exit, since destroying them with
        a departed peer can block."""
        self.retired.append((step + RETIRE_AFTER, old))

    def release_retired(self, step: int) -> None:
        due = [old for at, old in self.retired if at == step]
        for old in due:
            comm = getattr(old, "comm", None)
            if comm is not None:
                threading.Thread(target=comm.abort, name="tm-retire", daemon=True).start()

    def build_backend(self, name: str, prefix: str, grank: int, size: int, store=None):
        """A real backend for group `name`: gloo for the control group (and on CPU nodes),
        NCCL through trainmover.groups.nccl on GPU nodes. `store`: the rendezvous client to use
        (default: the agent's own)."""
        store = self.store if store is None else store
        if self.backend == "nccl" and name not in (CONTROL, SNAPSHOT):
            from trainmover.groups.nccl.backend import nccl_group
            backend = nccl_group(store, prefix, grank, size, timeout_s=self.spec.job.group_timeout_s, name=name)
            backend.preconnect(p2p=name == "xfer", neighbours=any(g.p2p for g in self.specs if g.name == name))
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
                clients.append(self._store_client(*self.store_addr))
            return self.build_backend(name, prefix, grank, size, store=clients[0])
        return build

    def make_groups(self, rank: int, sandbox: bool) -> dict[str, SwappableGroup]:
        groups = {}
        for g in self.specs:
            if rank not in g.ranks:
                continue
            grank = g.ranks.index(rank)
            inner = (SandboxBackend(grank, len(g.ranks)) if sandbox else
                     self.build_backend(g.name, f"tm/e0/{g.name}/", grank, len(g.ranks)))
            groups[g.name] = SwappableGroup(g.name, grank, len(g.ranks), list(g.ranks), inner)
        return groups

    def build_context(self, rank: int) -> workloads.BuildContext:
        return workloads.BuildContext(rank=rank, world_size=self.spec.world_size, groups=self.groups,
                                      seed=self.spec.job.seed, options={**self.spec.workload_options, "device": self.device},
                                      before_update=self._before_update, local_rank=self.local,
                                      local_world_size=self.spec.job.ranks_per_node, master=tuple(self.store_addr),
                                      new_group=lambda name, ranks: self._workload_group(rank, name, ranks))

    def _workload_group(self, rank: int, name: str, ranks: tuple[int, ...]) -> SwappableGroup | None:
        """A group the workload makes while it builds (a script's dist.new_group): a job group
        like the others from then on (in every Phase 1's delta, swapped at every migration).
        Every rank, standbys included, makes the same groups in the same order, so the k-th has
        the same name and members everywhere; a fresh run of the same script gets it back."""
        known = next((g for g in self.specs if g.name == name), None)
        if known is not None and tuple(known.ranks) != tuple(ranks):
            raise MigrationError(f"group {name} was made with ranks {list(known.ranks)}, now {list(ranks)}: a script "
                                 "must make the same groups in the same order on every rank and in every run")
        if known is None:
            self.specs.append(GroupSpec(name, tuple(ranks)))
        if rank not in ranks:
            return None
        if name not in self.groups:
            sandbox = self.groups["world"].sandboxed
            grank = list(ranks).index(rank)
            inner = (SandboxBackend(grank, len(ranks)) if sandbox else
                     self.build_backend(name, f"tm/e{self.switched_epoch}/{name}/", grank, len(ranks)))
            self.groups[name] = SwappableGroup(name, grank, len(ranks), list(ranks), inner)
        return self.groups[name]

    def _before_update(self) -> None:
        """The workload's gate before its optimizer step (see BuildContext.before_update)."""
        if self.device == "cuda":
            torch.cuda.current_stream().synchronize()  # an aborted collective has ended by now
        revoked = [g.group_name_ for g in self.groups.values() if g.revoked]
        if revoked:
            raise Revoked(f"groups {revoked} revoked during this step: its gradients are not used")
        self.protection.snapshot_gate()  # the optimizer writes the state: a snapshot's copies of it must be done

    def memory(self) -> dict:
        """What a migration costs this rank in memory: torch's allocator and the device.

        `tensor_bytes` is what live tensors asked for (the allocator's requested_bytes): at two
        step boundaries of a steady loop it is the same unless something new stays alive.
        `alloc_bytes` (memory_allocated) counts the blocks handed out, and a block taken from the
        cache for a large tensor is not split when less than 1 MiB would remain (the caching
        allocator's should_split): the up to 1 MiB beyond the tensor counts as allocated. The
        gradients, freed (zero_grad set_to_none) and made again every step, land in whichever
        cached blocks are free, so alloc_bytes at a boundary moves by such remainders from
        step to step with the same tensors alive (issue 36: +1,326,080 on a 4-GPU stayer;
        -902,144 in an earlier run, which no allocation can explain)."""
        if self.device != "cuda":
            return {}
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        return {"tensor_bytes": stats.get("requested_bytes.all.current"), "alloc_bytes": torch.cuda.memory_allocated(),
                "reserved_bytes": torch.cuda.memory_reserved(), "device_used_bytes": total - free}

    def comms_created(self) -> int:
        if self.backend != "nccl":
            return 0
        from trainmover.groups.nccl import lib
        return lib.created_count()

    def full_state(self, step: int) -> dict:
        return {"workload": self.workload.state_dict(), "rng": rng.capture(), "step": step}

    def replica_state(self, step: int) -> dict:
        """What a replica gives a rebuilt rank: model, optimizer and the step (data position and
        dropout follow from rank and step, see Workload.replica_group)."""
        sd = self.workload.state_dict()
        return {"workload": {"model": sd["model"], "optimizer": sd.get("optimizer", {}), **{
            k: v for k, v in sd.items() if k not in ("model", "optimizer")}}, "step": step}

    def load_full(self, state: dict) -> None:
        """Load a full state (snapshot, checkpoint) kept elsewhere: from a copy, since an
        optimizer's load_state_dict may keep the very tensors it is given."""
        state = transfer.host_copy(state)
        self.workload.load_state_dict(state["workload"])
        rng.restore(state["rng"])

    def digest(self) -> str:
        sd = self.workload.state_dict()
        return digest_tensors(tensors_of({"model": sd["model"], "optimizer": sd.get("optimizer", {})}))

    def run(self) -> int:
        if self.role == "worker":
            self.groups = self.make_groups(self.rank, sandbox=False)
            if self.rank in self.standby.roles().values():
                self.training.start_recording()
            self.workload.build(self.build_context(self.rank))
            return self.training.train(0)
        return self.serve_as_standby()

    def serve_as_standby(self) -> int:
        """A standby's life: warm up, report `ready`, then wait for the controller: a `prepare`
        makes it a joiner (switch.py), a `recover` takes a vanished rank (recovery.py), a `hold`
        names the snapshots it holds (protection.py); between messages it re-warms on a newer
        recording (standby.py). Once it has taken a rank it trains as a worker."""
        self.warm_t0 = t0 = self.standby.warm_up()
        while True:
            out = self.inbox.wait(REWARM_POLL_S)
            if out is None:  # nothing that ended the wait: re-warm if a newer recording came
                self.standby.rewarm_if_newer(t0)
            elif out is GONE:
                log.info("controller closed the channel; standby exits")
                return 0
            elif isinstance(out, Started):  # it took a rank: a worker from now on
                self.standby.now_a_worker(out.step)
                return self.training.train(out.step)

    def _join(self, msg: PrepareMsg) -> Started | None:
        start = self.switch.join(msg)  # on this thread, at the job's priority: the job's critical path
        if start is not None:
            return Started(start)
        self.send("ready", enter=RankState.READY, node=self.spec.node, local=self.local,
                  warmup_s=time.perf_counter() - self.warm_t0, shadow_steps=0, detail={})
        return None

    def _take_failed_rank(self, msg: RecoverMsg) -> Started | None:
        if str(self.local) not in msg.assign:
            return None  # another standby's
        return Started(self.recovery.take_failed_rank(msg))

    def ready_again_after_abort(self, msg: AbortMsg) -> None:
        """An `abort` of an epoch this standby already gave up (its own Phase 1 failed, e.g. cut off
        from a moved controller's store): its `ready` then reached the controller while the join
        was still on there, and was ignored as a stale report; the abort makes the controller
        wait for a new one (seen: a migration waiting for a standby until the job ended)."""
        if self.state.now == RankState.READY:
            log.info("epoch %s aborted after this standby left it; ready again", msg.epoch)
            # no `enter`: it is ready already (ready -> ready is no transition)
            self.send("ready", node=self.spec.node, local=self.local, warmup_s=time.perf_counter() - self.warm_t0,
                      shadow_steps=0, detail={})

def main() -> int:
    files.private_umask()  # what this rank writes (logs, recordings, checkpoints) is its user's alone
    here = JobEnv.read()
    setup_logging(node=here.node or "?")
    torch.set_num_threads(1)  # determinism and fair sharing of the node's cores
    try:
        # the run directory held, if still the controller's: a `runs/` swapped in is never used
        spec = WorkerSpec.from_env().held()
    except files.UnsafePath as exc:  # nothing to report it through: the key lies in that directory
        log.error("rank process on %s refused its run directory: %s", here.node or "?", exc)
        return FAILED
    local = here.local_id
    # Bound before its __init__ runs: constructing the workload (the user's code) happens there,
    # and its error is reported through the link that __init__ opened first.
    agent = Agent.__new__(Agent)
    try:
        agent.__init__(spec, local)
        return agent.run()
    except Exception as exc:  # noqa: BLE001 - whatever ended this process is reported, with where and why
        user = isinstance(exc, usercode.UserCodeError)
        tb = exc.traceback if user else usercode.bounded(traceback.format_exc())
        if user:
            log.error("%s %s on %s: the workload's code raised in %s:\n%s", spec.role,
                      f"rank {getattr(agent, 'rank', None)}", spec.node, exc.what, tb)
        else:
            log.error("%s on %s failed: %s\n%s", spec.role, spec.node, exc, tb)
        if getattr(agent, "link", None) is not None:
            agent.send("failed", rank=agent.rank if agent.rank is not None else 0, phase=exc.what if user else agent.role,
                       error=exc.error if user else f"{type(exc).__name__}: {exc}"[:2000], step=agent.completed,
                       user=user, traceback=tb)
        return FAILED
    finally:
        if getattr(agent, "link", None) is not None:
            agent.link.flush()
            agent.link.close()


def _exit_now(code: int) -> None:
    # Skip interpreter teardown: destroying gloo/NCCL contexts whose peers have already
    # left aborts the process (std::terminate) or hangs. All results are reported by now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
