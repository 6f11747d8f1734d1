"""A user's error is the user's; only a failed collective or a silent rank is a lost node.

Classified where it happens: the group wrapper marks a collective that fails (groups/swappable.py),
the workload's own calls are guarded (runtime/usercode.py), the loop decides from the marks
(runtime/roles/training.py), and the controller's policy ends the job on a rank's own error, however
the other ranks' failures that follow reach it (controller/policy/core.py). Pure parts with a fake
clock; the wrapper over real gloo groups (threads of one process) and a fake failing backend."""
from __future__ import annotations

import datetime
import json
import socket
import threading
import types

import pytest
import torch
import torch.distributed as dist

from trainmover import faults
from trainmover.controller.durable import journal, records
from trainmover.controller.durable.migration import Phase
from trainmover.controller.policy.actions import Fence, Finish, Send
from trainmover.controller.succession.supervisor import restart_decision
from trainmover.errors import ConfigError, MigrationError
from trainmover.groups.swappable import SandboxBackend, SwappableGroup, gloo_group
from trainmover.protocol.messages import make
from trainmover.runtime.rankstate import RankState, RankStateMachine
from trainmover.runtime.roles.training import TrainingLoop, lost_peer
from trainmover.runtime.usercode import MAX_TRACEBACK, UserCodeError, UserWorkload, user_code
from trainmover.runtime.worker import Agent

from test_policy import new_policy, ready_standby, sends, stalled

KEY = b"k" * 32  # the job's key: the journal and the outcome are sealed with it


# --- the wrapper marks a failed collective; the user's error marks nothing -----------------
class FailingBackend(SandboxBackend):
    """A backend whose peer is gone: its collectives raise, as gloo's do on a closed socket."""

    def allreduce(self, tensors, opts=None):
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.2]:41234")


def test_a_collective_whose_backend_fails_marks_its_group_and_a_swap_clears_it():
    g = SwappableGroup("world", 0, 2, [0, 1], FailingBackend(0, 2))
    assert g.failure is None and lost_peer({"world": g}) is None
    work = g.allreduce([torch.ones(2)])  # the error comes back through the Work (DDP's hooks)
    assert g.failure is not None and g.failure.op == "allreduce" and "Connection closed" in g.failure.error
    with pytest.raises(RuntimeError, match="Connection closed"):
        work.wait()
    assert lost_peer({"world": g, "other": SwappableGroup("o", 0, 1, [0], SandboxBackend(0, 1))}) is g.failure
    g.swap(SandboxBackend(0, 2))
    assert g.failure is None  # a new generation: nothing of it failed


def test_a_revoked_group_is_marked_even_before_anyone_waits():
    g = SwappableGroup("world", 0, 2, [0, 1], SandboxBackend(0, 2))
    g.revoke("train2 (ranks [1]) lost")
    assert g.failure.op == "revoke" and "train2" in g.failure.error


def test_the_users_error_marks_no_group_whatever_its_type():
    g = SwappableGroup("world", 0, 2, [0, 1], SandboxBackend(0, 2))
    for exc in (RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"),
                torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), KeyError("labels")):
        g.allreduce([torch.ones(2)]).wait()  # its collectives work
        with pytest.raises(UserCodeError) as got:
            with user_code("train_step"):
                raise exc
        assert got.value.__cause__ is exc and got.value.error.startswith(type(exc).__name__)
        assert lost_peer({"world": g}) is None


@pytest.fixture
def store():
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=s.detach(),
                           use_libuv=False, timeout=datetime.timedelta(seconds=20))
    yield port
    del master


@pytest.mark.gloo_threads
def test_under_ddp_the_users_error_on_one_rank_marks_the_peers_group_not_its_own(store):
    """Rank 1's code raises before its backward; rank 0's backward waits in DDP's allreduce
    (gloo, a 2 s timeout here) and fails from inside the user's `loss.backward()`: rank 0's
    group is marked (a lost peer: it stalls), rank 1's is not (its own error: the job ends)."""
    out = {}

    def rank(r):
        client = dist.TCPStore("127.0.0.1", store, is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=20))
        g = SwappableGroup("world", r, 2, [0, 1], gloo_group(client, "ue/", r, 2, host="127.0.0.1",
                                                             timeout=datetime.timedelta(seconds=2)))
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1), process_group=g)
        try:
            with user_code("train_step"):
                loss = ddp(torch.ones(1, 3)).sum()
                if r == 1:
                    torch.ones(2, 3) @ torch.ones(4, 5)  # a shape mismatch in the user's model
                loss.backward()
        except UserCodeError as exc:
            out[r] = (exc, lost_peer({"world": g}))
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert "shapes cannot be multiplied" in out[1][0].error and out[1][1] is None
    assert out[0][1] is not None and out[0][1].op == "allreduce", out[0]


def test_the_guarded_workload_reports_the_call_and_a_bounded_traceback_and_lets_ours_through():
    class Workload:
        trace = None

        def train_step(self, step):
            if step == 3:
                raise torch.OutOfMemoryError("CUDA out of memory " + "x" * 20000)
            return 1.0

        def state_dict(self):
            raise MigrationError("ours", phase="switch")

    w = UserWorkload(Workload())
    assert w.train_step(2) == 1.0
    with pytest.raises(UserCodeError) as got:
        w.train_step(3)
    assert got.value.what == "train_step" and got.value.error.startswith("OutOfMemoryError: CUDA out of memory")
    assert len(got.value.traceback) <= MAX_TRACEBACK + 100 and "characters cut" in got.value.traceback
    with pytest.raises(MigrationError):  # TrainMover's own error is not the user's
        w.state_dict()
    w.trace = print  # attributes set through the guard are the workload's
    assert w.inner.trace is print


def test_an_injected_raise_fires_inside_the_guard_as_the_users_code_would():
    inj = faults.Injector(["raise:1:3", "raise:0:build:oom", "raise:2:5:value"], "worker")
    w = UserWorkload(types.SimpleNamespace(train_step=lambda step: 0.5, build=lambda ctx: None),
                     lambda what, args: inj.at("user", what=what, rank=1, step=args[0] if what == "train_step" else None))
    assert w.train_step(2) == 0.5
    with pytest.raises(UserCodeError, match="shapes cannot be multiplied"):  # a real RuntimeError of torch
        w.train_step(3)
    with pytest.raises(torch.OutOfMemoryError):
        inj.at("user", what="build", rank=0, step=None)
    with pytest.raises(ValueError):
        inj.at("user", what="train_step", rank=2, step=5)
    assert not faults.Injector(["raise:1:3"], "standby").at("user", what="train_step", rank=1, step=3)
    for bad in ("raise:1", "raise:x:3", "raise:1:3:segfault", "raise:-1:3"):
        with pytest.raises(ConfigError, match="raise"):
            faults.parse_one(bad)


# --- the loop decides from the marks ----------------------------------------------------------
class LoopAgent(TrainingLoop):
    """The loop's own logic, on groups and an `_iteration` given by the test; the process
    around it (its context) and the recovery role are fakes that record what they are asked."""

    def __init__(self, groups, raises):
        self.raises, self.stalls, self.sent = raises, [], []
        ctx = types.SimpleNamespace(spec=types.SimpleNamespace(job=types.SimpleNamespace(steps=4)), rank=0, groups=groups, completed=0,
                                    state=RankStateMachine(RankState.TRAINING), digest=lambda: "d",
                                    send=lambda kind, **fields: self.sent.append(kind))
        ctx.apply = lambda change: Agent.apply(ctx, change)  # the process's one writer of its fields
        super().__init__(ctx, protection=None, switch=None, recovery=types.SimpleNamespace(stall=self.stall))

    def _iteration(self, step):
        if step == 2 and self.raises:
            raise self.raises.pop(0)
        return 0.1, step + 1

    def stall(self, completed, why):
        self.stalls.append((completed, why))
        self.ctx.groups["world"].swap(SandboxBackend(0, 2))  # the recovery's new groups
        return completed


def test_the_loop_ends_on_the_users_error_even_a_runtime_error_and_stalls_only_on_a_marked_failure():
    g = SwappableGroup("world", 0, 2, [0, 1], SandboxBackend(0, 2))
    agent = LoopAgent({"world": g}, [UserCodeError("train_step", RuntimeError("shape mismatch"))])
    with pytest.raises(UserCodeError):
        agent.train(0)
    assert agent.stalls == [] and "finished" not in agent.sent

    bad = SwappableGroup("world", 0, 2, [0, 1], FailingBackend(0, 2))
    try:  # the user's code saw the failed collective and raised its own error about it
        with user_code("train_step"):
            bad.allreduce([torch.ones(1)]).wait()
    except UserCodeError as exc:
        wrapped = exc
    agent = LoopAgent({"world": bad}, [wrapped])
    assert agent.train(0) == 0
    assert len(agent.stalls) == 1 and agent.stalls[0][0] == 2 and "allreduce" in agent.stalls[0][1]
    assert agent.sent == ["finished"] and agent.ctx.state.now is RankState.FINISHED


# --- the controller: a user error ends the job, its consequences start no recovery ----------
def failed(rank, step=300, phase="train_step"):
    return make("failed", rank=rank, phase=phase, error="RuntimeError: mat1 and mat2 shapes cannot be multiplied",
                step=step, user=True, traceback="Traceback (most recent call last):\n  ...\nRuntimeError: mat1")


def test_a_user_error_ends_the_job_at_once_with_rank_node_step_and_traceback():
    p = new_policy()
    ready_standby(p)
    acts = p.on_message(10.0, "train2", failed(1))
    assert acts == [Finish(False, "user code raised on rank 1 (train2) at step 300: RuntimeError: mat1 and mat2 "
                                  "shapes cannot be multiplied")]
    st = p.status()
    assert st["failure"]["rank"] == 1 and st["failure"]["node"] == "train2" and st["failure"]["step"] == 300
    assert "Traceback" in st["failure"]["traceback"] and st["finished"] is False and st["migrations"] == []
    # what follows from it is no news: its connection closes, its step ends, the others stall
    assert p.on_peer_gone(10.1, "train2", (1,)) == []
    assert p.on_step_exit(10.2, "train2", 1) == []
    assert stalled(p, 10.3, 0, 300) == [] and stalled(p, 10.3, 2, 300) == []
    for t in (12.0, 20.0, 40.0):  # nobody is judged dead, nothing fenced, no recovery, no second Finish
        assert p.on_tick(t, {}) == []
    assert p.recovery() is None and p.fenced == []


def test_a_user_error_at_construction_ends_the_job_too():
    p = new_policy()
    (fin,) = p.on_message(1.0, "train3", failed(2, step=0, phase="build"))
    assert fin.message == "user code raised on rank 2 (train3) in build: RuntimeError: mat1 and mat2 shapes cannot " \
                          "be multiplied"


def test_a_recovery_started_before_the_user_error_arrived_is_void():
    """The race: the controller heard of the consequences first (the failing rank's step
    ended before its report was read, the others stalled), and started a recovery."""
    p = new_policy()
    ready_standby(p)
    stalled(p, 10.0, 0, 300)
    acts = p.on_step_exit(10.1, "train2", 1)
    assert sends(acts, "revoke") and p.recovery() is not None
    m = p.recovery()
    acts = p.on_message(10.2, "train2", failed(1))
    assert isinstance(acts[-1], Finish) and "user code raised on rank 1" in acts[-1].message
    assert m.phase is Phase.FAILED and m.note.startswith("void: user code raised")
    assert not sends(stalled(p, 10.3, 2, 300), "recover")  # the last stall completes nothing
    assert p.on_tick(30.0, {}) == [] and not any(isinstance(a, Fence) for a in acts)


def test_a_user_error_from_a_standby_is_that_standbys_loss_not_the_jobs_end():
    p = new_policy()
    ready_standby(p)
    assert p.on_message(5.0, "spare1", failed(0, phase="build")) == []
    assert not p.done


def test_a_lost_node_is_still_recovered_when_nobody_reports_an_error():
    p = new_policy()
    ready_standby(p)
    acts = p.on_peer_gone(3.0, "train2", (1,))
    assert sends(acts, "revoke") and p.recovery() is not None and not any(isinstance(a, Finish) for a in acts)


# --- a controller that ended the job is never started again; the last line says how ------
def test_a_controller_that_journaled_the_jobs_end_is_never_restarted(tmp_path):
    path = tmp_path / "journal.jsonl"
    assert journal.ended(path, KEY) is None  # no journal yet
    j = journal.Journal(path, key=KEY)
    j.write(1.0, [{"kind": "start", "job_id": 7, "world_size": 2, "ranks_per_node": 1, "batch_host": "k",
                   "rank_node": {"0": "a", "1": "b"}}])
    assert journal.ended(path, KEY) is None
    j.write(2.0, [{"kind": "end", "ok": False, "message": "user code raised on rank 1 (b) at step 3: ..."}])
    j.close()
    end = journal.ended(path, KEY)
    assert end == {"ok": False, "message": "user code raised on rank 1 (b) at step 3: ..."}
    assert journal.read(path, KEY).ended == end
    # a crash (70) or a kill during its shutdown: still no restart
    assert restart_decision(70, 0, 3, stopping=False, ended=end)[0] is False
    assert restart_decision(-9, 0, 3, stopping=False, ended=end)[0] is False
    assert restart_decision(70, 0, 3, stopping=False)[0] is True  # without an end: restarted as before


def test_the_last_line_names_the_state_the_cause_and_where_the_traceback_is(tmp_path):
    (tmp_path / "status.json").write_text(json.dumps({
        "outcome": {"ok": False, "message": "user code raised on rank 1 (train2) at step 300: RuntimeError: x\ny"},
        "failure": {"rank": 1, "traceback": "Traceback ..."}}))
    line = records.final_line(tmp_path, 12, 1)
    assert line == (f"trainmover: job 12 FAILED: user code raised on rank 1 (train2) at step 300: RuntimeError: x y; "
                    f"traceback in {tmp_path / 'status.json'}")
    (tmp_path / "status.json").write_text(json.dumps({"outcome": {"ok": True, "message": "training finished"}}))
    assert records.final_line(tmp_path, 12, 0) == "trainmover: job 12 COMPLETED: training finished"
    (tmp_path / "status.json").unlink()
    assert records.final_line(tmp_path, 12, 1, "controller on a lost; no restart left") == \
        "trainmover: job 12 FAILED: controller on a lost; no restart left"
    assert records.final_line(tmp_path, 12, 143, stopped=True).startswith("trainmover: job 12 CANCELLED")


def test_a_workload_that_cannot_be_constructed_is_refused_once_with_the_users_traceback(tmp_path, capsys):
    """The batch step constructs the workload before anything starts (preflight): the user's
    error there is final (exit 2: no node would do better), said in status.json and last line."""
    from trainmover.controller.succession import supervisor
    try:
        with user_code("construction"):
            {}["vocab_size"]
    except UserCodeError as exc:
        code = supervisor._refused(tmp_path / "runs" / "5", 5, exc, last_line=True)
    assert code == 2
    status = json.loads((tmp_path / "runs" / "5" / "status.json").read_text())
    assert status["failure"]["user"] and "KeyError: 'vocab_size'" in status["failure"]["traceback"]
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("trainmover: job 5 FAILED: user code raised constructing the workload: KeyError: "
                           "'vocab_size'; traceback in ")
