"""The rank process (runtime/worker.py `Agent` and its roles) driven without Slurm or controller.

Real parts: the Agent itself, its roles, its state machine, real gloo groups over a real
rendezvous store, the real transfer; ranks and the standby are threads of one (forked) process.
Fakes: the control channel (a queue in, a list out: the test plays the controller) and a
small data-parallel workload whose every step is a function of (seed, rank, step), so a run
that moved or lost a rank must end with the digests of an uninterrupted run, bit for bit.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from trainmover.config import Config
from trainmover.protocol import checkpoint_layout
from trainmover.protocol.messages import make
from trainmover.protocol.worker_spec import WorkerSpec
from trainmover.runtime.rankstate import TRANSITIONS, IllegalRankTransition, RankState, RankStateMachine
from trainmover.runtime.worker import Agent
from trainmover.workloads.base import BuildContext, Workload

S = RankState
STEPS = 20
DEADLINE_S = 60.0  # every wait of the test: a broken rank process fails it, never hangs it
HOLD = threading.Event()  # released by the test: the workers wait at `hold_at` until then


class Tiny(Workload):
    """Linear regression, data parallel over `world`: gradients averaged with an allreduce, SGD
    with momentum (so the optimizer's state is part of what a move must carry)."""

    def __init__(self, hold_at: int = -1):
        self.hold_at = hold_at

    def build(self, ctx: BuildContext) -> None:
        self.ctx = ctx
        self.w = torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(ctx.seed)))
        self.opt = torch.optim.SGD([self.w], lr=0.05, momentum=0.9)

    def rebind(self, ctx: BuildContext) -> None:  # warm parameters kept, new rank and groups
        self.ctx = ctx

    def train_step(self, step: int) -> float:
        if step == self.hold_at:
            assert HOLD.wait(DEADLINE_S), "the test never released the hold"
        # not torch's global generator: the ranks are threads of one process
        gen = torch.Generator().manual_seed(self.ctx.seed * 1_000_003 + self.ctx.rank * 10_007 + step)
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, generator=gen)
        loss = ((x @ self.w - y) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.ctx.groups["world"].allreduce([self.w.grad]).wait()
        self.w.grad /= self.ctx.world_size
        self.ctx.before_update()
        self.opt.step()
        return loss.item()

    def state_dict(self) -> dict:
        return {"model": {"w": self.w.detach()}, "optimizer": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.w.copy_(state["model"]["w"])
        if "optimizer" in state:  # left out by the negative control (skip-optimizer-state)
            self.opt.load_state_dict(state["optimizer"])

    def replica_group(self) -> str | None:
        return "world"


class FakeLink:
    """The control channel as the rank process uses it: what it sends is kept; what the test
    puts in `inbox` is what the controller says."""

    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()
        self.sent: list[dict] = []
        self.bye, self.address = None, ("127.0.0.1", 0)
        self.lock = threading.Lock()

    def send(self, msg: dict) -> bool:
        with self.lock:
            self.sent.append(msg)
        return True

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def of(self, kind: str) -> list[dict]:
        with self.lock:
            return [m for m in self.sent if m["type"] == kind]

    def wait_for(self, kind: str, **fields) -> dict:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            got = [m for m in self.of(kind) if all(m.get(k) == v for k, v in fields.items())]
            if got:
                return got[-1]
            time.sleep(0.01)
        raise AssertionError(f"no {kind} {fields} within {DEADLINE_S}s; sent: {[m['type'] for m in self.sent]}")


@pytest.fixture
def job(tmp_path):
    """A maker of rank processes of one job: its rendezvous store and secret. `job.fresh()`: a
    maker for another job (its own store: group rendezvous keys are per job)."""
    masters = []
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)

    def fresh():
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
        masters.append(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                     master_listen_fd=server.detach(), use_libuv=False,
                                     timeout=datetime.timedelta(seconds=DEADLINE_S)))

        def agent(role: str, node: str, ranks=(), **fields) -> tuple[Agent, FakeLink, list]:
            # no beat within a test (the FakeLink is the controller): one an hour
            job = Config(workload=f"{__name__}:Tiny", steps=STEPS, group_timeout_s=30.0, switch_timeout_s=30.0,
                         recovery_timeout_s=30.0, heartbeat_s=3600.0, heartbeat_timeout_s=7200.0, shadow_steps=6,
                         record_iterations=0, device="cpu", backend="gloo")
            spec = WorkerSpec.from_config(job, inject=fields.pop("inject", ()), role=role, ranks=tuple(ranks),
                                          world_size=2, node=node, node_addr="127.0.0.1",
                                          controller=("127.0.0.1", 9), store=("127.0.0.1", port),
                                          secret_file=str(secret), **fields)
            link = FakeLink()
            a = Agent(spec, 0, link=link)
            seen = [a.state.now]
            to = a.state.to

            def recording(dst: RankState) -> None:  # every state the process goes through, in order
                to(dst)
                seen.append(dst)
            a.state.to = recording
            return a, link, seen
        agent.fresh = fresh
        return agent
    yield fresh()
    masters.clear()


def run(agent: Agent) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def body():
        try:
            out["rc"] = agent.run()
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            out["error"] = exc
    t = threading.Thread(target=body, name=f"rank-{agent.spec.node}", daemon=True)
    t.start()
    return t, out


def finish(*threads) -> None:
    for t, out in threads:
        t.join(DEADLINE_S)
        assert not t.is_alive(), f"{t.name} still running after {DEADLINE_S}s"
        assert "error" not in out, f"{t.name} raised {out['error']!r}"
        assert out["rc"] == 0


def uninterrupted(job) -> dict[int, str]:
    """The digests of each rank after STEPS steps of a run where nothing happens (a job of its own)."""
    job = job.fresh()
    ranks = [job("worker", f"ref{r}", ranks=(r,)) for r in (0, 1)]
    threads = [run(a) for a, _, _ in ranks]
    finish(*threads)
    return {r: link.wait_for("finished")["digest"] for r, (_, link, _) in enumerate(ranks)}


def trained_steps(link: FakeLink) -> list[int]:
    return [m["step"] for m in link.of("step")]


@pytest.mark.gloo_threads
@pytest.mark.own_process  # conftest: a fresh process, then the forked child
@pytest.mark.parametrize("negative", [False, True], ids=["exact", "negative-control"])
def test_a_standby_joins_the_leavers_slot_trains_on_and_the_run_ends_bit_exact(job, negative):
    """standby -> ready -> join (planned migration of rank 1) -> train -> finished; the leaver
    leaves. Negative control: a leaver that leaves its optimizer state out of the copy
    (TM_INJECT skip-optimizer-state) ends the run with other digests."""
    want = uninterrupted(job)
    standby, s_link, s_seen = job("standby", "spare0")
    s_thread = run(standby)
    s_link.wait_for("ready")
    assert standby.state.now is S.READY and standby.rank is None and standby.role == "standby"

    hold = 4
    inject = ("skip-optimizer-state",) if negative else ()
    workers = [job("worker", f"train{r}", ranks=(r,), workload_options={"hold_at": hold}, inject=inject)
               for r in (0, 1)]
    prepare = make("prepare", epoch=1, leavers=[1], joiner_node="spare0", assign={"0": 1}, options={})
    for _, link, _ in workers:
        link.inbox.put(prepare)  # read at the first step boundary: Phase 1 runs while they train
    w_threads = [run(a) for a, _, _ in workers]
    s_link.inbox.put(prepare)
    s_link.wait_for("prepared", epoch=1, rank=1)  # every Phase 1 build done: the joiner's groups need them all
    HOLD.set()
    finish(*w_threads, s_thread)

    (stayer, st_link, st_seen), (leaver, l_link, l_seen) = workers
    left = l_link.wait_for("switched", role="leaver")
    joined = s_link.wait_for("switched", role="joiner")
    # the same boundary on every side; no later than two boundaries after the hold (the workers
    # wait there until the joiner is prepared; the leaver votes a boundary after its plan)
    assert 0 < st_link.wait_for("switched", role="stayer")["step"] == left["step"] == joined["step"] <= hold + 2
    # the leaver trained up to the switch and left; the joiner trained from there to the end
    assert trained_steps(l_link) == list(range(1, left["step"] + 1)) and not l_link.of("finished")
    assert trained_steps(s_link) == list(range(left["step"] + 1, STEPS + 1))
    assert trained_steps(st_link) == list(range(1, STEPS + 1))
    assert [m["rank"] for m in l_link.of("prepared") + st_link.of("prepared")] == [1, 0]
    # the states each went through, in order
    assert s_seen == [S.STARTING, S.READY, S.JOINING, S.TRAINING, S.FINISHED]
    assert l_seen == [S.TRAINING, S.LEFT] and st_seen == [S.TRAINING, S.FINISHED]
    assert standby.rank == 1 and standby.role == "worker" and standby.switched_epoch == 1
    # bit for bit the uninterrupted run's state, on the joiner and on the stayer
    digests = s_link.wait_for("finished", rank=1)["digest"], st_link.wait_for("finished", rank=0)["digest"]
    if negative:
        assert digests[0] != want[1] and digests[1] != want[0]
        return
    assert digests == (want[1], want[0])
    # what a restarted controller would be told by each
    resync = leaver.resync_messages()[0]
    assert resync["state"] == "left" and resync["switched"] == 1 and resync["step"] == left["step"]
    assert standby.resync_messages()[0]["state"] == "finished"
    with pytest.raises(IllegalRankTransition, match="left -> training"):  # a leaver never trains again
        leaver.state.to(S.TRAINING)


@pytest.mark.gloo_threads
@pytest.mark.own_process  # conftest: a fresh process, then the forked child
def test_a_join_the_controller_aborts_leaves_the_standby_ready_again(job):
    """standby -> ready -> joining -> (abort during Phase 1) -> ready; the channel's end ends it."""
    standby, s_link, s_seen = job("standby", "spare0")
    s_thread = run(standby)
    first = s_link.wait_for("ready")
    # nobody else builds the new groups: Phase 1 waits for peers until the controller's abort
    s_link.inbox.put(make("prepare", epoch=3, leavers=[1], joiner_node="spare0", assign={"0": 1}, options={}))
    wait_until("the standby joins", lambda: standby.state.now is S.JOINING)
    assert standby.joining == 3 and standby.resync_messages()[0]["pending"] == 3
    s_link.inbox.put(make("abort", epoch=3, reason="test: the leaver's node came back"))
    wait_until("ready again", lambda: len(s_link.of("ready")) == 2)
    again = s_link.of("ready")[-1]
    assert again is not first and again["shadow_steps"] == 0 and not s_link.of("prepare_failed")
    assert standby.state.now is S.READY and standby.joining == 0 and standby.rank is None
    resync = standby.resync_messages()
    assert resync[0]["state"] == "ready" and resync[0]["pending"] == 0 and resync[-1] is again
    s_link.inbox.put(None)  # the controller closed the channel: an idle standby exits
    finish(s_thread)
    assert s_seen == [S.STARTING, S.READY, S.JOINING, S.READY]


def wait_until(what: str, check) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S}s: {what}"
        time.sleep(0.01)


@pytest.mark.gloo_threads
@pytest.mark.own_process  # conftest: a fresh process, then the forked child
@pytest.mark.parametrize("tier", ["replica", "snapshot", "checkpoint", "snapshot-no-rollback", "replica-anticipated",
                                  "replica-anticipated-other-epoch", "replica-foreseen"])
def test_a_lost_rank_is_recovered_by_the_standby_bit_exact(job, tmp_path, tier):
    """rank 1's training thread hangs (TM_INJECT hang:1:5); the controller revokes rank 0's
    groups; rank 0 stalls, and on `recover` the standby takes rank 1 with its state from each
    tier: rank 0's replica of step 5, rank 1's snapshot of step 4 that rank 0 holds (rank 0 rolls
    back to its own), or both ranks' checkpoint files of step 4. Negative control: rank 0 keeps
    its state instead of rolling back (TM_INJECT no-rollback): the run ends with other digests.
    replica-anticipated: the standby is told before rank 0 stalls (`anticipate`, as the
    controller does once it chose it): it binds itself to rank 1 then, not after the plan (its
    groups start at the plan: an early rendezvous could outwait its group timeout). Its control:
    an anticipate of another epoch is not taken for this one, and the run is exact either way.
    replica-foreseen: before the fault every process got `foresee` (runtime/roles/foresight.py) and
    built each loss's groups and the transfer pair between its source and the standby; the
    plan names the tag, and nobody builds a group or pair after the fault (`built_ahead` is all
    of them). Its control: every other tier, where nothing was foreseen and everything is built
    after the fault (`built_ahead` empty)."""
    want = uninterrupted(job)
    foreseen = tier == "replica-foreseen"
    negative = tier == "snapshot-no-rollback"
    anticipate_epoch = {"replica-anticipated": 1, "replica-anticipated-other-epoch": 7}.get(tier)
    tier = "snapshot" if negative else "replica" if anticipate_epoch or foreseen else tier
    protect = {"snapshot": {"snapshot_every": 2},
               "checkpoint": {"checkpoint_every": 2, "checkpoint_dir": str(tmp_path / "ckpt")}}.get(tier, {})
    standby, s_link, s_seen = job("standby", "spare0", **protect)
    s_thread = run(standby)
    s_link.wait_for("ready")
    lost_at = 5
    (live, live_link, live_seen), (lost, lost_link, _) = workers = [
        job("worker", f"train{r}", ranks=(r,), inject=(f"hang:1:{lost_at}",) + ("no-rollback",) * negative,
            **protect) for r in (0, 1)]
    if foreseen:  # as the controller sends it once the standby is ready (controller/policy/foresight.py)
        foresee = make("foresee", tag="e0s1", standby="spare0", cases=[[0], [1]], sources=[1, 0])
        for link in (s_link, live_link, lost_link):
            link.inbox.put(foresee)
    live_thread, lost_thread = [run(a) for a, _, _ in workers]
    if foreseen:  # built while the job trains, before the fault
        built = [link.wait_for("foreseen", tag="e0s1") for link in (live_link, s_link)]
        assert [b["cases"] for b in built] == [[[1]], [[0], [1]]] and [b["role"] for b in built] == ["worker", "standby"]
        assert not live_link.of("stalled")
    lost_link.wait_for("step", step=lost_at)  # its last step: the next one hangs
    # The controller revokes once it has judged rank 1 lost (silent, or no progress), by which
    # time rank 0 has finished step 5 too (rank 1 finished it, and its boundary vote after it,
    # with rank 0) and waits in step 6's collective. Revoking as soon as rank 1 reports step 5
    # would race rank 0's own end of step 5: a revoke that lands inside it stalls rank 0 at
    # step 4 (legitimately: its state holds step 4) and voids the scenario under test.
    live_link.wait_for("step", step=lost_at)
    # as the link's reader thread does on the controller's `revoke`: rank 0's collective with
    # the hung rank ends now, not at the group timeout
    live._on_control(make("revoke", epoch=1, failed=[1], reason="test: rank 1 lost"))
    if anticipate_epoch:
        s_link.inbox.put(make("anticipate", epoch=anticipate_epoch, failed=[1], assign={"0": 1}))
    stalled = live_link.wait_for("stalled")
    # what the product guarantees: a rank stalls at the last step whose update its state holds,
    # the last step it reported (rank 0 cannot finish step 6 without rank 1)
    assert stalled["step"] == trained_steps(live_link)[-1] == lost_at
    assert stalled["role"] == "stayer" and stalled["holds"]["replicas"] == [0, 1]
    assert live.state.now is S.STALLED
    assert live.resync_messages()[-1] == stalled  # a restarted controller hears of the stall again
    resume_at, source, needers, holders = lost_at, 0, [1], {}
    if tier == "snapshot":  # rank 1's copy of step 4 reached rank 0 in the background
        wait_until("rank 0 holds rank 1's snapshot of step 4",
                   lambda: 4 in live.protection.snapshots.report()["held"].get("1", []))
        resume_at, source, needers, holders = 4, -1, [], {"1": 0}
    elif tier == "checkpoint":  # as the controller does once every rank wrote its file: the manifest
        written = {r: link.wait_for("checkpointed", step=4)["digest"] for r, link in enumerate((live_link, lost_link))}
        checkpoint_layout.write_manifest(tmp_path / "ckpt", 4, written, live.key)
        resume_at, source, needers = 4, -1, []
    recover = make("recover", epoch=1, failed=[1], step=resume_at, source=source, needers=needers,
                   assign={"0": 1}, tier=tier, holders=holders, foreseen="e0s1" if foreseen else "")
    live_link.inbox.put(recover)
    s_link.inbox.put(recover)
    finish(live_thread, s_thread)

    assert live_seen == [S.TRAINING, S.STALLED, S.TRAINING, S.FINISHED]
    assert s_seen == [S.STARTING, S.READY, S.TRAINING, S.FINISHED]
    resumed = live_link.wait_for("switched", role="stayer")
    assert resumed["step"] == resume_at and resumed["detail"]["tier"] == tier
    assert resumed["detail"].get("rolled_back", False) is (tier != "replica" and not negative)
    if tier != "checkpoint":  # rank 0 sent the standby its state (replica) or rank 1's (snapshot)
        assert [s["to"] for s in resumed["detail"]["sent"]] == [1]
    took = s_link.wait_for("switched", role="joiner", rank=1)
    assert took["step"] == resume_at and took["epoch"] == 1
    # the standby rehearsed rank 0 (local 0 of a 2-rank job): an anticipate bound it to rank 1 before the plan
    # (of any epoch: the binding is the rank's); only that of the plan's epoch counts as anticipated
    assert took["detail"]["prebound"] is (anticipate_epoch is not None)
    assert took["detail"]["anticipated"] is (anticipate_epoch == 1)
    # foreseen: every group of the new epoch and the transfer pair were built before the fault
    groups = took["detail"]["groups"]
    assert groups and groups == resumed["detail"]["groups"]
    assert took["detail"]["built_ahead"] == (sorted(groups + ["xfer-in"]) if foreseen else [])
    assert resumed["detail"]["built_ahead"] == (sorted(groups + ["xfer-to-1"]) if tier == "replica" and foreseen
                                                else [])
    assert trained_steps(s_link) == list(range(resume_at + 1, STEPS + 1))
    # rank 0 redoes the steps after the one it rolled back to
    assert trained_steps(live_link) == list(range(1, lost_at + 1)) + list(range(resume_at + 1, STEPS + 1))
    assert lost_thread[0].is_alive() and not lost_link.of("finished")  # still hung: replaced, not waited for
    digests = s_link.wait_for("finished", rank=1)["digest"], live_link.wait_for("finished", rank=0)["digest"]
    if negative:  # rank 0 applied step 5 twice
        assert digests[0] != want[1] and digests[1] != want[0]
        return
    assert digests == (want[1], want[0])


def test_every_state_is_reachable_and_an_illegal_transition_names_both_ends():
    reach, todo = {S.STARTING, S.TRAINING}, [S.STARTING, S.TRAINING]  # a standby's start, a worker's
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - reach:
            reach.add(nxt)
            todo.append(nxt)
    assert reach == set(RankState) and set(TRANSITIONS) == set(RankState)

    m = RankStateMachine(S.STARTING, who="standby spare0/0")
    m.to(S.READY)
    with pytest.raises(IllegalRankTransition, match=r"standby spare0/0: illegal state transition ready -> finished "
                                                r"\(allowed from ready: joining, training, warming\)") as got:
        m.to(S.FINISHED)
    assert (got.value.src, got.value.dst) == (S.READY, S.FINISHED) and m.now is S.READY  # unchanged
    for terminal in (S.LEFT, S.FINISHED):
        with pytest.raises(IllegalRankTransition, match="allowed from .*: none"):
            RankStateMachine(terminal).to(S.TRAINING)
    # the values are the wire's: the controller reads them in a resync (controller/policy/takeover.py)
    assert [s.value for s in RankState] == ["starting", "ready", "warming", "joining", "training", "stalled",
                                            "left", "finished"]


def _store(port: int = 0, master: bool = True) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=5))


def test_the_joiners_wait_for_go_outlives_its_store_host_and_follows_the_successors_store():
    """The controller hosting the store killed while a joiner waits for the leaver's go: the
    store's errors are "no verdict yet" (seen: they killed the joiner and stopped the job); once
    the link moves the client to the successor's store, its go is seen."""
    from trainmover.protocol.store import AuthStore
    from trainmover.runtime.roles.epoch import go_key
    from trainmover.runtime.roles.switch import await_go

    key = b"k" * 32
    first = _store()
    current = {"store": AuthStore(_store(first.port, master=False), key)}
    del first  # the store's host is gone: every call of the client fails at once
    successor = _store()
    AuthStore(successor, key).set(go_key(3, 1), b"1")

    def move_later():
        time.sleep(0.5)
        current["store"] = AuthStore(_store(successor.port, master=False), key)

    threading.Thread(target=move_later, daemon=True).start()
    started = time.monotonic()
    assert await_go(lambda: current["store"], 3, 1, lambda: False, time.monotonic() + 10) == "go"
    assert 0.4 < time.monotonic() - started < 5


def test_the_joiners_wait_for_go_ends_on_cancel_abort_or_its_deadline():
    from trainmover.protocol.store import AuthStore
    from trainmover.runtime.roles.epoch import cancel_key
    from trainmover.runtime.roles.switch import await_go

    key = b"k" * 32
    server = _store()
    store = AuthStore(_store(server.port, master=False), key)
    assert await_go(lambda: store, 1, 0, lambda: False, time.monotonic() + 0.3) == "timeout"
    assert await_go(lambda: store, 1, 0, lambda: True, time.monotonic() + 10) == "cancelled"
    store.inner.set(cancel_key(1, 0), b"forged")  # not tagged with the job's key: ignored
    assert await_go(lambda: store, 1, 0, lambda: False, time.monotonic() + 0.3) == "timeout"
    store.set(cancel_key(1, 0), b"1")
    assert await_go(lambda: store, 1, 0, lambda: False, time.monotonic() + 10) == "cancelled"


def test_the_joiners_wait_for_go_sees_it_at_once_and_logs_nothing_while_it_waits(capfd):
    """A joiner waits out a whole Phase 1 for the go: its wait must not log (c10d warns on every
    timed store wait that times out: one line every 50 ms filled a standby's log, issue 36), and
    sees the go within a few ms. Control: one timed wait of 50 ms on the same store does log."""
    from trainmover.protocol.store import AuthStore
    from trainmover.runtime.roles.epoch import go_key
    from trainmover.runtime.roles.switch import await_go

    key = b"k" * 32
    server = _store()
    store = AuthStore(_store(server.port, master=False), key)
    setter = AuthStore(_store(server.port, master=False), key)
    t_set = {}

    def go_later():
        time.sleep(0.6)
        t_set["t"] = time.monotonic()
        setter.set(go_key(4, 1), b"1")
    threading.Thread(target=go_later, daemon=True).start()
    assert await_go(lambda: store, 4, 1, lambda: False, time.monotonic() + 10) == "go"
    assert time.monotonic() - t_set["t"] < 0.05
    waited = capfd.readouterr().err
    assert "timed out" not in waited, waited[-500:]
    with pytest.raises(Exception):
        store.inner.wait([go_key(5, 1)], datetime.timedelta(seconds=0.05))
    assert "timed out" in capfd.readouterr().err  # the control: what a timed wait logs
