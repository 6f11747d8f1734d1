"""A stub node of the control-plane scale harness (issue 38): a node's ranks without torch.

    python -m trainmover.runtime.stub_node      (the controller's launch when TM_WORKLOAD=stub)

1,024 rank processes, each importing torch (about 200 MB and seconds of CPU each), do not fit
a 2-core machine; the controller's side of a job does not care how its ranks train. So one
process per node plays all of the node's ranks (the spec's `ranks`, or `ranks_per_node`
standby slots), each over a control connection of its own (runtime/link.py: the job's key,
hello, beats, step reports, prepare/prepared, switched, stalled, recover), and the controller,
keeper and policy drive them as they drive real ranks. A rank's identity is its connection;
its `pid` in the hello is this process's pid x 64 + its local index, so that the controller
tells the node's eight ranks apart as it tells eight processes apart (liveness, fencing).

What the stub does not speak: the rendezvous store and the gloo groups (they need torch). The
boundary agreement (runtime/roles/boundary.py, a MIN all-reduce over the world) is `stub_vote.py`'s
over plain TCP, served by the process that plays rank 0, with the same outcome: every rank
switches at the same step or none does, a vanished peer fails the step everywhere (the ranks
stall), and a joiner learns the switch step from it (where a real joiner waits for the
leaver's `go` key in the store). A step is a sleep of the workload's `step_s` (workloads/stub.py),
then the reports, then the vote; the node's ranks step together.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainmover.logs import setup_logging
from trainmover.protocol import channel, endpoint, files
from trainmover.protocol.messages import make
from trainmover.protocol.worker_spec import WorkerSpec
from trainmover.runtime import heartbeat
from trainmover.runtime.link import Link
from trainmover.runtime.stub_vote import FAILED, VoteClient, VoteRoot, root_address, write_root
from trainmover.slurm.job_env import JobEnv
from trainmover.workloads.stub import STEP_S

log = logging.getLogger("trainmover.stub")

DIGEST = "stub"  # no state: every rank's digest is the same word


def identity(pid: int, local: int) -> int:
    """The `pid` a stub rank says in its hello: distinct per rank of the process."""
    return pid * 64 + local


class StubRank:
    """One rank's control connection."""

    def __init__(self, spec: WorkerSpec, key: bytes, local: int, rank: int | None, role: str):
        self.spec, self.local, self.rank, self.role, self.key = spec, local, rank, role, key
        # set by the node: Phase 1 on the reader thread, at once
        self.on_prepare: Callable[[dict, StubRank], None] = lambda msg, rank: None
        self.on_revoke: Callable[[dict], None] = lambda msg: None
        self.resync: Callable[[StubRank], list[dict]] = lambda rank: []  # the node says where it is
        host, port = spec.controller
        self.link = Link((str(host), int(port)), key, self._hello, lambda: self.resync(self), self._on_message,
                         connect_timeout=spec.job.group_timeout_s, reconnect_timeout=spec.job.reconnect_timeout_s,
                         source=spec.node_addr, where=self._where, news=lambda: endpoint.mtime(spec.controller_file))

    def _on_message(self, msg: dict) -> None:
        if msg["type"] == "prepare" and not msg["assign"] and self.rank is not None:
            self.on_prepare(msg, self)
        elif msg["type"] == "revoke":
            self.on_revoke(msg)

    def _hello(self) -> dict:
        return make("hello", role=self.role, node=self.spec.node, ranks=[] if self.rank is None else [self.rank],
                    pid=identity(os.getpid(), self.local))

    def _where(self) -> tuple[str, int]:
        ep = endpoint.read(self.spec.controller_file, self.key) if self.spec.controller_file else None
        if ep is None:
            return self.link.address
        host, port = ep.address
        return str(host), int(port)

    def send(self, kind: str, **fields) -> None:
        self.link.send(make(kind, **fields))

    def messages(self) -> list[dict]:
        out: list[dict] = []
        while True:
            try:
                msg = self.link.inbox.get_nowait()
            except queue.Empty:
                return out
            if msg is None:
                raise SystemExit(0)  # the controller said bye, or no successor came
            out.append(msg)


class StubNode:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.step_s = float(spec.workload_options.get("step_s", STEP_S))
        key = channel.read_secret(spec.secret_file)
        run_dir = Path(spec.controller_file).parent if spec.controller_file else Path(spec.secret_file).parent
        self.root = None
        if spec.role == "worker" and 0 in spec.ranks:  # the vote's root lives with rank 0
            self.root = VoteRoot(spec.node_addr, spec.world_size // max(1, spec.job.ranks_per_node))
            write_root(run_dir, self.root.address)
        self.vote = VoteClient(root_address(run_dir, spec.job.group_timeout_s))
        n = len(spec.ranks) if spec.role == "worker" else spec.job.ranks_per_node
        self.ranks = [StubRank(spec, key, i, spec.ranks[i] if spec.role == "worker" else None, spec.role)
                      for i in range(n)]
        self.step = 0
        self.pending: dict | None = None  # the prepare this node holds: epoch, role, the step it came
        self.state = "training" if spec.role == "worker" else "starting"  # runtime/rankstate.py's names
        self.switched = 0  # the epoch of the last switch
        # A revoke fails a real rank's collective at once (groups/swappable.py): it stalls inside
        # its step. A stub's step is a sleep; the revoke ends it, and the node votes at once.
        self.revoke = threading.Event()
        self.revoked_epoch = 0
        for r in self.ranks:
            r.on_prepare, r.resync, r.on_revoke = self._prepare, self._resync, self._revoked
        self.stepped_at: float | None = None  # the last step reports (monotonic): beats wait (heartbeat.beat_due_in)
        threading.Thread(target=self._beat, name="tm-stub-beat", daemon=True).start()

    def _beat(self) -> None:
        """Beats as runtime/heartbeat.py sends them: every heartbeat_s, each rank's own, less
        those its step reports make redundant (heartbeat.beat_due_in)."""
        every = self.spec.job.heartbeat_s
        wait = every
        while every > 0:
            time.sleep(wait)
            wait = heartbeat.beat_due_in(every, time.monotonic(), self.stepped_at)
            if wait > 0:
                continue
            wait = every
            cpu = time.process_time()
            for r in self.ranks:
                r.send("beat", ranks=[] if r.rank is None else [r.rank], step=self.step, issued={}, waiting={},
                       cpu_s=cpu)

    def _resync(self, rank: StubRank) -> list[dict]:
        """What a restarted controller is told right after the hello (runtime/worker.py's
        resync_messages, less the step reports it may have logged already)."""
        pending = self.pending["epoch"] if self.pending else 0
        out = [make("resync", node=self.spec.node, ranks=[] if rank.rank is None else [rank.rank], role=rank.role,
                    step=self.step, pending=pending, switched=self.switched, state=self.state)]
        if self.state == "ready":
            out.append(make("ready", node=self.spec.node, local=rank.local, warmup_s=0.0, shadow_steps=0, detail={}))
        return out

    def run(self) -> int:
        if self.spec.role == "standby" and not self._standby():
            return 0
        self.vote.join_as_member()
        return self._train()

    # --- a standby -----------------------------------------------------------------------
    def _standby(self) -> bool:
        """Ready at once (nothing to warm), then wait for a prepare (a planned join) or a
        recover that names this node. True once it took ranks; False when the job ended."""
        self.state = "ready"
        for r in self.ranks:
            r.send("ready", node=self.spec.node, local=r.local, warmup_s=0.0, shadow_steps=0, detail={})
        while True:
            time.sleep(0.005)
            for msg in self.ranks[0].messages():
                for r in self.ranks[1:]:
                    r.messages()  # the same messages came to each rank: consumed here
                if msg["type"] == "prepare" and msg["assign"]:
                    if self._join(msg):
                        return True
                elif msg["type"] == "recover" and str(self.ranks[0].local) in msg["assign"]:
                    self.state, self.switched = "training", msg["epoch"]
                    for r in self.ranks:
                        r.rank, r.role = int(msg["assign"][str(r.local)]), "worker"
                        r.send("switched", epoch=msg["epoch"], rank=r.rank, role="joiner", step=msg["step"],
                               t=time.time(), detail={"stub": True})
                    self.step = msg["step"]
                    return True

    def _join(self, msg: dict) -> bool:
        t0 = time.perf_counter()
        epoch = msg["epoch"]
        self.state = "joining"
        for r in self.ranks:
            r.rank = int(msg["assign"][str(r.local)])
            r.send("prepared", epoch=epoch, rank=r.rank, groups=[], seconds=time.perf_counter() - t0,
                   detail={"role": "joiner"})
        step = self.vote.await_switch(epoch, aborted=lambda: any(
            m["type"] == "abort" and m["epoch"] == epoch for m in self.ranks[0].messages()))
        if step is None:  # aborted: ready again (runtime/worker.py's ready_again_after_abort)
            self.state = "ready"
            for r in self.ranks:
                r.rank = None
                r.send("ready", node=self.spec.node, local=r.local, warmup_s=0.0, shadow_steps=0, detail={})
            return False
        self.state, self.switched = "training", epoch
        for r in self.ranks:
            r.role = "worker"
            r.send("switched", epoch=epoch, rank=r.rank, role="joiner", step=step, t=time.time(),
                   detail={"stub": True})
        self.step = step
        return True

    # --- a worker --------------------------------------------------------------------------
    def _train(self) -> int:
        nxt = time.monotonic()
        while self.step < self.spec.job.steps:
            t0 = time.perf_counter()
            # On a grid of step_s, but never catching up: after a long wait in the vote (the start,
            # while the last nodes launch) a real rank's next step still computes; a stub that ran
            # the missed steps back to back sent 1,024 step reports per vote round, as fast as the
            # vote turned, at the 128-node start (and its controller fell seconds behind reading).
            nxt = max(nxt + self.step_s, time.monotonic())
            if self._revoked_in_step(nxt):
                # vote again on the step complete: the vote's root has failed it (a member
                # vanished), or answers its decision if it has not seen the loss yet
                if self.vote.agree(self.step, 0, leaving=False) == FAILED:
                    self._stall()
                nxt = time.monotonic()
                continue
            self.step += 1
            now = time.time()
            for r in self.ranks:
                r.send("step", rank=r.rank, step=self.step, loss=0.0, step_s=time.perf_counter() - t0,
                       compute_s=self.step_s, t=now)
            self.stepped_at = time.monotonic()
            self._control()
            prep = self.pending  # what this boundary votes on (a prepare may arrive meanwhile)
            ready = self._ready(prep)
            agreed = self.vote.agree(self.step, ready, leaving=bool(ready and prep and prep["role"] == "leaver"))
            if agreed == FAILED:
                self._stall()
                nxt = time.monotonic()
            elif prep and ready and agreed == ready:
                if self._switch(prep):
                    return 0  # a leaver: its ranks live on the joiner
        for r in self.ranks:
            r.send("finished", rank=r.rank, step=self.step, digest=DIGEST, loss=0.0)
        return 0

    def _revoked(self, msg: dict) -> None:
        """On a link's reader thread: a revoke for an epoch after the last switch (or recovery)."""
        if msg["epoch"] > self.switched:
            self.revoked_epoch = max(self.revoked_epoch, msg["epoch"])
            self.revoke.set()

    def _revoked_in_step(self, until: float) -> bool:
        """Sleep the step out, or until a revoke of an epoch not yet recovered from arrives."""
        while (left := until - time.monotonic()) > 0:
            if self.revoke.wait(left):
                self.revoke.clear()
                if self.revoked_epoch > self.switched:
                    return True
        return False

    def _prepare(self, msg: dict, rank: StubRank) -> None:
        """A stayer's or leaver's prepare, on its link's reader thread as it arrives: Phase 1
        is nothing here, so `prepared` goes back at once (a real rank starts Phase 1 at its next
        step boundary: that wait is the workload's step, not the control plane's)."""
        role = "leaver" if any(r.rank in msg["leavers"] for r in self.ranks) else "stayer"
        if rank is self.ranks[0]:
            self.pending = {"epoch": msg["epoch"], "role": role, "at": self.step}
        rank.send("prepared", epoch=msg["epoch"], rank=rank.rank, groups=[], seconds=0.0, detail={"role": role})

    def _control(self) -> None:
        """The controller's messages since the last boundary: an abort of the epoch held
        (a prepare was answered as it came, `_prepare`)."""
        for msg in self.ranks[0].messages():
            for r in self.ranks[1:]:
                r.messages()
            if msg["type"] == "abort" and self.pending and self.pending["epoch"] == msg["epoch"]:
                self.pending = None

    def _ready(self, prep: dict | None) -> int:
        """runtime/roles/switch.py's switch_ready: a leaver votes from the boundary after its prepare."""
        if not prep or (prep["role"] == "leaver" and prep["at"] >= self.step):
            return 0
        return int(prep["epoch"])

    def _switch(self, prep: dict) -> bool:
        epoch, role = prep["epoch"], prep["role"]
        self.pending, self.switched = None, epoch
        for r in self.ranks:
            r.send("switched", epoch=epoch, rank=r.rank, role=role, step=self.step, t=time.time(),
                   detail={"stub": True})
        if role == "leaver":
            for r in self.ranks:
                r.link.flush()
            return True
        return False

    def _stall(self) -> None:
        """A peer vanished (the vote failed): stall, report, wait for the recovery plan."""
        self.pending, self.state = None, "stalled"
        for r in self.ranks:
            r.send("stalled", rank=r.rank, step=self.step, digest=DIGEST, error="stub: a peer of the vote vanished",
                   role="stayer", holds={"replicas": list(range(self.spec.world_size)), "own": [], "held": {}})
        deadline = time.monotonic() + self.spec.job.recovery_timeout_s + 10.0
        while time.monotonic() < deadline:
            for msg in self.ranks[0].messages():
                for r in self.ranks[1:]:
                    r.messages()
                if msg["type"] == "recover":
                    self.step, self.state, self.switched = msg["step"], "training", msg["epoch"]
                    for r in self.ranks:
                        r.send("switched", epoch=msg["epoch"], rank=r.rank, role="stayer", step=msg["step"],
                               t=time.time(), detail={"stub": True})
                    return
            time.sleep(0.005)
        raise SystemExit(f"no recovery plan within {self.spec.job.recovery_timeout_s:.0f}s")


def main() -> int:
    files.private_umask()
    here = JobEnv.read()
    setup_logging(node=here.node or "?")
    try:
        spec = WorkerSpec.from_env().held()  # as a worker's (worker.main)
    except files.UnsafePath as exc:
        log.error("stub node %s refused its run directory: %s", here.node or "?", exc)
        return 1
    node = StubNode(spec)
    try:
        return node.run()
    finally:
        for r in node.ranks:
            r.link.flush()
            r.link.close()


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code)
