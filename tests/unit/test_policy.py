"""The controller's decisions, driven with a fake clock and fake observations."""
from dataclasses import dataclass

from trainmover.config import Config
from trainmover.controller.durable.migration import Phase
from trainmover.controller.durable.view import JobView
from trainmover.controller.policy.actions import AcquireStandby, Finish, LaunchStandby, Record, ReleaseNode, Send
from trainmover.controller.policy.core import Policy
from trainmover.protocol.messages import make


@dataclass
class Node:
    state: str
    reason: str = ""

    @property
    def unresponsive(self):
        return self.state.startswith("DOWN") or "NOT_RESPONDING" in self.state

    @property
    def draining(self):
        return "DRAIN" in self.state and self.state.startswith(("ALLOCATED", "MIXED"))

    @property
    def drained(self):
        return "DRAIN" in self.state and not self.draining


def new_policy(**cfg):
    view = JobView(7, 3, 1, "train1", {0: "train1", 1: "train2", 2: "train3"})
    return Policy(Config(**cfg), view)


def sends(actions, kind):
    return [a for a in actions if isinstance(a, Send) and a.msg["type"] == kind]


def ready_standby(p, now=1.0, node="spare1"):
    assert p.start(0.0) == [AcquireStandby()]
    assert p.on_standby_acquired(now, node) == [LaunchStandby(node)]
    return p.on_message(now + 1, node, {"type": "ready", "node": node, "local": 0, "warmup_s": 2.0, "shadow_steps": 2,
                                          "detail": {}})


def test_drain_of_a_job_node_starts_phase1_with_the_joiner_in_the_leavers_slot():
    p = new_policy()
    ready_standby(p)
    acts = p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN"), "train1": Node("ALLOCATED")})
    to_stayers, to_joiner = sends(acts, "prepare")
    assert set(to_stayers.nodes) == {"train1", "train3", "train2"}
    assert to_joiner.nodes == ("spare1",) and to_joiner.msg["assign"] == {"0": 1}
    assert to_stayers.msg["leavers"] == [1] and to_stayers.msg["epoch"] == 1
    m = p.active()
    assert m.phase is Phase.PREPARING and m.trigger == "drain" and m.joiner == "spare1"
    # a second observation of the same drain does not start another migration
    assert not sends(p.on_nodes(11.0, {"train2": Node("ALLOCATED+DRAIN")}), "prepare")


def test_full_migration_then_release_and_refill():
    p = new_policy(standbys=1)
    ready_standby(p)
    p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")})
    for rank, node in ((0, "train1"), (2, "train3"), (1, "train2"), (1, "spare1")):
        p.on_message(10.2, node, {"type": "prepared", "epoch": 1, "rank": rank, "groups": ["world"], "seconds": 0.1,
                                  "detail": {}})
    assert p.active().phase is Phase.SWITCHING
    for rank, node, role in ((0, "train1", "stayer"), (2, "train3", "stayer"), (1, "train2", "leaver")):
        acts = p.on_message(10.5, node, {"type": "switched", "epoch": 1, "rank": rank, "role": role, "step": 40,
                                         "t": 10.5, "detail": {}})
        assert not any(isinstance(a, ReleaseNode) for a in acts)
    assert p.on_step_exit(10.55, "train2", 0) == []  # leaver gone, but the joiner has not reported yet
    acts = p.on_message(10.6, "spare1", {"type": "switched", "epoch": 1, "rank": 1, "role": "joiner", "step": 40,
                                         "t": 10.6, "detail": {"bytes": 10}})
    assert ReleaseNode("train2") in acts and AcquireStandby() in acts  # refill the pool
    assert p.view.rank_node[1] == "spare1" and "spare1" not in p.view.standbys
    acts = p.on_released(11.0, "train2", True, "")
    assert p.migrations[0].phase is Phase.DONE
    st = p.status()
    assert [n["name"] for n in st["nodes"] if n["role"] == "released"] == ["train2"]
    assert st["migrations"][0]["joiner"] == "spare1" and st["migrations"][0]["trigger"] == "drain"


def test_drain_without_standby_waits_and_keeps_the_job_running():
    p = new_policy()
    p.start(0.0)
    p.on_standby_unavailable(1.0, "no free node in reservation trainmover_standby")
    acts = p.on_nodes(2.0, {"train3": Node("MIXED+DRAIN")})
    assert not sends(acts, "prepare")
    st = p.status()
    assert st["waiting_for_standby"] == ["train3"]
    assert "waiting for a standby" in st["message"] and "train3" in st["message"]
    # retries after standby_retry_s, not before (no tight polling)
    assert AcquireStandby() not in p.on_tick(2.0 + p.cfg.standby_retry_s / 2)
    assert AcquireStandby() in p.on_tick(2.0 + p.cfg.standby_retry_s + 0.1)
    # when one arrives and warms up, the waiting migration starts
    p.on_standby_acquired(9.0, "spare2")
    acts = p.on_message(12.0, "spare2", {"type": "ready", "node": "spare2", "local": 0, "warmup_s": 2.0, "shadow_steps": 2,
                                          "detail": {}})
    assert sends(acts, "prepare") and p.active().phase is Phase.PREPARING


def test_drain_of_a_node_outside_the_job_is_ignored_and_manual_request_rejected():
    p = new_policy()
    ready_standby(p)
    assert p.on_nodes(5.0, {"train4": Node("IDLE+DRAIN")}) == []
    ok, message, acts = p.request(5.0, "train4", "manual")
    assert not ok and "runs no rank of job 7" in message and acts == []
    assert p.migrations == []


def test_phase1_deadline_aborts_and_retries_then_gives_up():
    p = new_policy(phase1_timeout_s=5.0)
    ready_standby(p)
    p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")})
    acts = p.on_tick(15.1)
    assert sends(acts, "abort") and p.migrations[0].phase is Phase.ABORTED
    assert "phase 1 not done within 5s" in p.migrations[0].note
    for attempt in range(2):  # the standby reports ready again after a cancelled join
        p.on_message(16.0 + attempt * 10, "spare1", {"type": "ready", "node": "spare1", "local": 0, "warmup_s": 0.0, "shadow_steps": 0, "detail": {}})
        p.on_tick(16.0 + attempt * 10 + 5.5)
    assert [m.phase for m in p.migrations].count(Phase.ABORTED) == 3
    assert p.migrations[-1].phase is Phase.FAILED and "stays in the job" in p.migrations[-1].note


def test_prepare_failure_aborts_before_any_switch():
    p = new_policy()
    ready_standby(p)
    p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")})
    acts = p.on_message(10.1, "train3", {"type": "prepare_failed", "epoch": 1, "rank": 2, "error": "gloo timeout"})
    assert sends(acts, "abort")[0].msg["reason"].startswith("rank 2 on train3")


def test_metrics_rows_downtime_and_final():
    p = new_policy()
    ready_standby(p)
    rows = []
    for step in range(1, 21):
        t = step * 0.1 + (0.5 if step > 10 else 0.0)  # a 0.5 s pause between step 10 and 11
        for rank in range(3):
            rows += [a for a in p.on_message(t, f"train{rank + 1}", {"type": "step", "rank": rank, "step": step,
                     "loss": 1.0 + rank, "step_s": 0.08, "compute_s": 0.05, "t": t}) if isinstance(a, Record)]
        if step == 5:
            p.on_nodes(t, {"train2": Node("ALLOCATED+DRAIN")})
            p.migrations[0].switch_step = 10
    assert len(rows) == 20 and rows[0].payload["losses"] == [1.0, 2.0, 3.0] and rows[0].payload["loss"] == 2.0
    assert abs(p.migrations[0].downtime_s - 0.5) < 1e-6
    acts = []
    for rank in range(3):
        acts = p.on_message(3.0, "x", {"type": "finished", "rank": rank, "step": 20, "digest": "d", "loss": 1.0})
    assert isinstance(acts[-1], Finish) and acts[-1].ok
    assert acts[0].stream == "final" and acts[0].payload["steps"] == 20


def test_a_rank_that_reports_its_error_stops_the_job_with_that_root_cause():
    p = new_policy()
    acts = p.on_message(2.9, "train3", make("failed", rank=2, phase="worker", error="CUDA error: out of memory",
                                            step=7, user=False, traceback=""))
    assert acts == [Finish(False, "rank 2 on train3 failed in worker: CUDA error: out of memory")]
    assert p.on_step_exit(3.0, "train3", 1) == []  # its step's end that follows is no news


def stalled(p, now, rank, step, digest="d", node=None, holds=None):
    """A live rank's `stalled` report; `holds` defaults to a whole-job replica group (plain DDP)."""
    holds = {"replicas": [0, 1, 2], "own": [], "held": {}} if holds is None else holds
    return p.on_message(now, node or f"train{rank + 1}", make("stalled", rank=rank, step=step, digest=digest,
                                                              error="peer gone", role="stayer", holds=holds))


def test_a_vanished_rank_is_revoked_and_rebuilt_from_a_replica_with_laggers_redoing():
    p = new_policy()
    ready_standby(p)
    acts = p.on_step_exit(3.0, "train2", 137)  # killed: no report of its own
    (revoke,) = sends(acts, "revoke")
    assert set(revoke.nodes) == {"train1", "train3"} and revoke.msg["failed"] == [1]
    m = p.recovery()
    assert m.trigger == "failure" and m.leaver == "train2" and m.joiner == "spare1"
    assert not sends(stalled(p, 3.1, 0, 10), "recover")  # rank 2 has not stopped yet
    acts = stalled(p, 3.2, 2, 9)  # rank 2 failed inside step 10: it lags and gets the state too
    to_stayers, to_joiner = sends(acts, "recover")
    assert to_stayers.msg["step"] == 10 and to_stayers.msg["source"] == 0 and to_stayers.msg["needers"] == [1, 2]
    assert set(to_stayers.nodes) == {"train1", "train3"} and to_joiner.nodes == ("spare1",)
    assert to_joiner.msg["assign"] == {"0": 1} and m.phase is Phase.PREPARING
    for rank, node, role in ((0, "train1", "stayer"), (2, "train3", "stayer"), (1, "spare1", "joiner")):
        acts = p.on_message(3.5, node, {"type": "switched", "epoch": m.epoch, "rank": rank, "role": role, "step": 10,
                                        "t": 3.5, "detail": {}})
    assert ReleaseNode("train2") in acts and m.phase is Phase.RELEASING
    assert p.view.rank_node[1] == "spare1"
    p.on_released(4.0, "train2", True, "")
    assert m.phase is Phase.DONE and m.to_json()["state_source"] == {"tier": "replica", "rank": 0, "step": 10,
                                                                      "laggers": [2], "rolled_back_steps": 0}


def test_replicas_that_disagree_stop_the_job_rather_than_spread_a_bad_state():
    p = new_policy()
    ready_standby(p)
    p.on_peer_gone(3.0, "train2")
    stalled(p, 3.1, 0, 10, digest="aaa")
    acts = stalled(p, 3.2, 2, 10, digest="bbb")
    assert not sends(acts, "recover")
    assert isinstance(acts[-1], Finish) and not acts[-1].ok and "different states" in acts[-1].message


def test_no_standby_pauses_training_until_the_recovery_deadline():
    p = new_policy(recovery_timeout_s=30.0)
    p.on_peer_gone(3.0, "train2")
    stalled(p, 3.1, 0, 10)
    stalled(p, 3.2, 2, 10)
    assert p.recovery().phase is Phase.WAITING_STANDBY and "paused" in p.recovery().note
    acts = p.on_tick(40.0)
    assert any(isinstance(a, Finish) and not a.ok and "not recovered within 30s" in a.message for a in acts)


def test_a_finished_rank_closing_its_connection_is_not_a_failure():
    p = new_policy()
    p.on_message(3.0, "train2", {"type": "finished", "rank": 1, "step": 20, "digest": "d", "loss": 1.0})
    assert p.on_peer_gone(3.1, "train2") == [] and p.recovery() is None


def test_ranks_stalled_with_nobody_lost_stop_the_job_after_the_detection_window():
    p = new_policy()
    stalled(p, 3.0, 0, 10)
    assert not any(isinstance(a, Finish) for a in p.on_tick(10.0))
    acts = p.on_tick(19.0)
    assert any(isinstance(a, Finish) and "no rank was found lost" in a.message for a in acts)


def test_a_trainmover_health_check_drain_is_its_own_trigger():
    p = new_policy()
    ready_standby(p)
    p.on_nodes(10.0, {"train3": Node("ALLOCATED+DRAIN", "trainmover: xid 79 on GPU 2")})
    assert p.active().trigger == "healthcheck"


def feed_steps(p, steps, slow_rank=None, factor=1.3, t0=0.0):
    acts = []
    for step in range(1, steps + 1):
        for rank in range(3):
            c = 0.05 * (factor if rank == slow_rank else 1.0)
            acts += p.on_message(t0 + step * 0.1, f"train{rank + 1}", {
                "type": "step", "rank": rank, "step": step, "loss": 1.0, "step_s": 0.08, "compute_s": c,
                "t": t0 + step * 0.1})
    return acts


def test_a_persistently_slow_node_is_evicted_by_live_migration():
    p = new_policy(straggler="evict", straggler_window_steps=5, straggler_windows=3)
    ready_standby(p)
    acts = feed_steps(p, 14, slow_rank=2)  # two full windows: not yet a verdict
    assert not sends(acts, "prepare")
    acts = feed_steps(p, 1, slow_rank=2, t0=1.5)
    assert sends(acts, "prepare") and p.active().trigger == "straggler" and p.active().leaver == "train3"
    (ev,) = p.status()["straggler"]["evicted"]
    assert ev["node"] == "train3" and "30.0% slower" in ev["verdict"]


def test_a_second_straggler_soon_after_an_eviction_is_only_reported():
    """Two slow nodes within TM_STRAGGLER_COOLDOWN_S point at a shared cause; evicting would use
    up the standbys one by one. Once the cooldown has passed, a straggler is evicted again."""
    p = new_policy(straggler="evict", straggler_window_steps=5, straggler_windows=3, straggler_cooldown_s=100)
    ready_standby(p)
    p.straggler["evicted"].append({"node": "train9", "t": 1.0, "verdict": "earlier"})  # as a resumed journal has it
    acts = feed_steps(p, 15, slow_rank=2, t0=1.0)
    st = p.status()["straggler"]
    assert not sends(acts, "prepare") and p.migrations == [] and st["target"] == "train3"
    assert "not evicted" in st["verdict"] and "train9" in st["verdict"] and len(st["evicted"]) == 1
    acts = feed_steps(p, 15, slow_rank=2, t0=102.0)
    assert sends(acts, "prepare") and p.active().leaver == "train3"
    assert [e["node"] for e in p.status()["straggler"]["evicted"]] == ["train9", "train3"]


def test_report_mode_only_reports_and_noise_is_not_a_straggler():
    p = new_policy(straggler="report", straggler_window_steps=5)
    ready_standby(p)
    feed_steps(p, 15, slow_rank=0)
    assert p.migrations == [] and p.status()["straggler"]["target"] == "train1"
    q = new_policy(straggler="evict", straggler_window_steps=5)
    ready_standby(q)
    feed_steps(q, 30, slow_rank=1, factor=1.05)  # 5% is below the 10% threshold
    assert q.migrations == [] and q.status()["straggler"]["target"] is None


def test_scheduled_rebalancing_moves_a_node_every_n_steps_but_never_the_batch_host():
    p = new_policy(rebalance_every_steps=10)
    ready_standby(p)
    acts = feed_steps(p, 9)
    assert not sends(acts, "prepare")
    acts = []
    for rank in range(3):
        acts += p.on_message(1.0, f"train{rank + 1}", {"type": "step", "rank": rank, "step": 10, "loss": 1.0,
                                                       "step_s": 0.08, "compute_s": 0.05, "t": 1.0})
    m = p.active()
    assert sends(acts, "prepare") and m.trigger == "rebalance" and m.leaver != "train1"


def test_a_joiner_dying_in_phase1_aborts_at_once_and_the_job_keeps_its_node():
    p = new_policy()
    ready_standby(p)
    p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")})
    m = p.active()
    acts = p.on_step_exit(10.5, "spare1", 137)
    (abort,) = sends(acts, "abort")
    assert abort.msg["epoch"] == m.epoch and m.phase is Phase.ABORTED
    assert "spare1" not in p.view.standbys and AcquireStandby() in acts  # a new standby is sought
    assert p.view.rank_node[1] == "train2"  # nothing changed for the job


def test_a_stayer_lost_during_phase1_aborts_the_planned_migration_and_recovers_first():
    p = new_policy(standbys=2)
    p.start(0.0)
    p.on_standby_acquired(1.0, "spare1")
    p.on_message(1.5, "spare1", {"type": "ready", "node": "spare1", "local": 0, "warmup_s": 2.0, "shadow_steps": 2, "detail": {}})
    p.on_standby_acquired(2.0, "spare2")
    p.on_message(3.0, "spare2", {"type": "ready", "node": "spare2", "local": 0, "warmup_s": 2.0, "shadow_steps": 2, "detail": {}})
    p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")})
    planned = p.active()
    acts = p.on_peer_gone(10.2, "train3")  # a stayer dies while Phase 1 runs
    assert sends(acts, "abort") and sends(acts, "revoke")
    assert planned.phase is Phase.ABORTED and p.recovery().leaver == "train3"
    retry = [m for m in p.migrations if m.leaver == "train2" and m.active]
    assert retry and retry[0].phase is Phase.REQUESTED  # the drain is retried after the recovery


def test_a_node_whose_slurmd_stopped_answering_is_migrated_as_planned():
    """slurmd killed: its ranks' processes still run, so their state is copied from them."""
    p = new_policy()
    ready_standby(p)
    acts = p.on_nodes(10.0, {"train3": Node("ALLOCATED+NOT_RESPONDING")})
    assert sends(acts, "prepare") and p.active().trigger == "failure" and not p.active().recovery
    # ...and a node being recovered is not asked to migrate on top of it
    q = new_policy()
    ready_standby(q)
    q.on_peer_gone(3.0, "train2")
    assert q.request(4.0, "train2", "drain")[1].startswith("train2 is being recovered")


# --- several ranks per node (whole-node migration) ---------------------------------------
def new_two_rank_policy(**cfg):
    """2 nodes of 2 ranks (TP2 inside a node): train1 holds 0, 1; train2 holds 2, 3."""
    view = JobView(7, 4, 2, "train1", {0: "train1", 1: "train1", 2: "train2", 3: "train2"})
    return Policy(Config(ranks_per_node=2, **cfg), view)


def ready_msg(node, local):
    return {"type": "ready", "node": node, "local": local, "warmup_s": 2.0, "shadow_steps": 2, "detail": {}}


def test_a_standby_node_is_ready_once_each_of_its_processes_is():
    p = new_two_rank_policy()
    ready_standby(p)  # local 0 only
    assert p.view.standbys["spare1"].state == "starting"
    assert not sends(p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")}), "prepare")  # waits for the node
    assert p.on_message(10.5, "spare1", ready_msg("spare1", 0)) == []  # the same process again
    acts = p.on_message(11.0, "spare1", ready_msg("spare1", 1))
    assert p.view.standbys["spare1"].state == "joining" and sends(acts, "prepare")


def test_a_drained_node_moves_whole_each_rank_into_its_slot():
    p = new_two_rank_policy(standbys=1)
    ready_standby(p)
    p.on_message(2.5, "spare1", ready_msg("spare1", 1))
    acts = p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")})
    to_stayers, to_joiner = sends(acts, "prepare")
    assert to_stayers.msg["leavers"] == [2, 3] and set(to_stayers.nodes) == {"train1", "train2"}
    assert to_joiner.nodes == ("spare1",) and to_joiner.msg["assign"] == {"0": 2, "1": 3}
    m = p.active()
    assert m.leaver_ranks == (2, 3) and len(m.expected) == 6
    for rank, role, node in [(0, "stayer", "train1"), (1, "stayer", "train1"), (2, "leaver", "train2"),
                             (3, "leaver", "train2"), (2, "joiner", "spare1"), (3, "joiner", "spare1")]:
        p.on_message(11.0, node, {"type": "prepared", "epoch": 1, "rank": rank, "groups": [], "seconds": 0.1,
                                  "detail": {}})
    assert m.phase is Phase.SWITCHING
    for rank, role, node in [(0, "stayer", "train1"), (1, "stayer", "train1"), (2, "leaver", "train2"),
                             (3, "leaver", "train2"), (2, "joiner", "spare1")]:
        p.on_message(12.0, node, {"type": "switched", "epoch": 1, "rank": rank, "role": role, "step": 40, "t": 12.0,
                                  "detail": {"bytes": 10 + rank}})
    assert m.phase is Phase.SWITCHING, "not before every moved rank joined"
    assert p.on_peer_gone(12.1, "train2", (2,)) == [] and p.recovery() is None  # a leaver that handed over
    p.on_message(12.2, "spare1", {"type": "switched", "epoch": 1, "rank": 3, "role": "joiner", "step": 40, "t": 12.2,
                                  "detail": {"bytes": 13}})
    assert m.phase is Phase.RELEASING and p.view.ranks_of("spare1") == (2, 3) and p.view.ranks_of("train2") == ()
    assert ReleaseNode("train2") in p.on_step_exit(13.0, "train2", 0)
    assert m.to_json()["transfers"] == {"2": {"bytes": 12}, "3": {"bytes": 13}}


def test_one_finished_process_of_a_two_rank_node_is_not_the_loss_of_the_node():
    p = new_two_rank_policy()
    ready_standby(p)
    p.on_message(3.0, "train2", {"type": "finished", "rank": 2, "step": 20, "digest": "d", "loss": 1.0})
    assert p.on_peer_gone(3.1, "train2", (2,)) == [] and p.recovery() is None
    # its node-mate vanishing before it finished is a loss of the node (both ranks)
    p.on_peer_gone(3.2, "train2", (3,))
    assert p.recovery() is not None and p.recovery().leaver_ranks == (2, 3)


def test_one_node_planned_pause_is_the_gap_no_rank_trained_not_against_a_median_step():
    """With no stayer the pause is from the leaver's report of the switch step to the start of
    the joiner's next step: slow steps before it (Phase 1) or a fast first step after it do
    not move it (against the median interval it read 0.0 here, clamped)."""
    from trainmover.controller.durable.migration import Migration
    from trainmover.controller.policy.progress import Progress
    from trainmover.controller.durable.state import PolicyState
    prog = Progress(PolicyState.__new__(PolicyState))
    t = 0.0
    for step in range(1, 11):
        step_s = 0.36 if step < 6 else 0.47          # the leaver slowed by its Phase 1
        t += step_s
        prog.steps.setdefault(0, []).append((step, t, step_s))
    leaver_end = t
    joiner_start = leaver_end + 0.09                  # the pause: 90 ms nobody trained
    prog.steps[0].append((11, joiner_start + 0.30, 0.30))  # a first step faster than the median
    m = Migration.__new__(Migration)
    m.leaver_ranks, m.recovery, m.switch_step = [0], False, 10
    assert abs(prog.downtime(m) - 0.09) < 1e-9
    # with a stayer the stayers' view stays: their gap across the switch less a median step
    for step in range(1, 12):
        prog.steps.setdefault(1, []).append((step, step * 0.4 + (0.2 if step == 11 else 0.0), 0.4))
    assert abs(prog.downtime(m) - 0.2) < 1e-9


def test_a_standbys_ready_that_crossed_the_abort_of_its_join_is_said_again_and_the_retry_goes_on():
    """The joiner's own Phase 1 failed (cut off from a moved controller's store): it went back to
    ready and said so while the controller still had it joining (ignored there, as a stale
    report), then the controller aborted the epoch and waits for a new `ready`. The standby says
    it again when the abort reaches it (worker.Agent.ready_again_after_abort), and the retry runs."""
    p = new_policy()
    ready_standby(p)
    p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")})
    ready = {"type": "ready", "node": "spare1", "local": 0, "warmup_s": 0.0, "shadow_steps": 0, "detail": {}}
    assert p.on_message(10.5, "spare1", ready) == []  # crossed: still joining here
    acts = p.on_message(10.6, "train3", {"type": "prepare_failed", "epoch": 1, "rank": 2, "error": "store gone"})
    assert sends(acts, "abort") and p.migrations[0].phase is Phase.ABORTED
    assert p.migrations[1].phase is Phase.WAITING_STANDBY and not sends(p.on_tick(11.0), "prepare")
    again = p.on_message(11.2, "spare1", ready)  # what the standby sends on the abort
    assert sends(again, "prepare") and p.migrations[1].joiner == "spare1"


def test_a_ready_standby_says_ready_again_on_an_abort_and_a_joining_one_does_not():
    from trainmover.runtime.rankstate import RankState, RankStateMachine
    from trainmover.protocol.messages import AbortMsg
    from trainmover.runtime.worker import Agent

    class Stub:  # Agent.send's part that matters here: a state entered with the message
        def __init__(self, *path):
            self.state = RankStateMachine(RankState.STARTING, who="standby spare1/0")
            for st in path:
                self.state.to(st)
            self.spec, self.local, self.sent, self.warm_t0 = type("P", (), {"node": "spare1"})(), 0, [], 0.0

        def send(self, kind, *, enter=None, **fields):
            if enter is not None:
                self.state.to(enter)
            self.sent.append((kind, fields))

    ready, joining = Stub(RankState.READY), Stub(RankState.READY, RankState.JOINING)
    Agent.ready_again_after_abort(ready, AbortMsg(epoch=1, reason="r"))  # ready -> ready would raise
    Agent.ready_again_after_abort(joining, AbortMsg(epoch=1, reason="r"))
    assert [k for k, _ in ready.sent] == ["ready"] and ready.state.now is RankState.READY
    assert joining.sent == []


def test_a_released_node_taken_again_is_a_standby_not_released():
    """A node that left the job (released), was resumed and was taken again as a standby: the live
    controller drops it from `released`; a successor that finds it in the job unjournaled (its
    grow's controller died) makes it a standby too (executor.came_back), so a drain of it counts."""
    from trainmover.controller.durable.view import came_back
    p = new_policy()
    p.view.released.append("spare1")
    p.on_standby_acquired(1.0, "spare1")
    assert "spare1" not in p.view.released and "spare1" in p.view.standbys
    view = JobView(7, 3, 1, "train1", {0: "train1", 1: "train2", 2: "spare3"})
    view.released += ["spare1", "train3", "spare4", "spare5"]
    got = came_back(["keep1", "train1", "train2", "spare3", "spare1", "spare4", "spare5"], view,
                    leaving={"spare4"}, keeper="keep1", fenced={"spare5"})
    assert got == ["spare1"]  # not the ranks' nodes, the keeper, a leaver or a fenced node; train3 is gone


def test_a_drained_standby_is_given_back_and_replaced_not_counted_as_lost():
    p = new_policy()
    ready_standby(p)
    acts = p.on_nodes(5.0, {"spare1": Node("IDLE+DRAIN")})
    assert ReleaseNode("spare1") in acts and AcquireStandby() in acts
    assert any(isinstance(a, Record) and a.payload["event"] == "standby_drained" for a in acts)
    assert "spare1" not in p.view.standbys and p.standbys_lost == []
    rel = p.on_released(6.0, "spare1", True, "")
    assert "spare1" in p.view.released and rel and rel[0].payload["event"] == "standby_released"
    # a standby already joining is left to its migration
    q = new_policy()
    ready_standby(q)
    q.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")})
    assert q.active().joiner == "spare1"
    assert q.on_nodes(10.5, {"spare1": Node("ALLOCATED+DRAIN")}) == [] and "spare1" in q.view.standbys


# Every message type of the protocol, by who decides on it. A new type must be placed here,
# so none reaches the controller and is dropped unseen.
TO_RANKS = {"abort", "anticipate", "bye", "fenced", "foresee", "hold", "prepare", "recover", "revoke"}  # controller -> processes
TO_KEEPER_OR_CLI = {"alive", "launch", "moving", "reply"}                                     # controller -> keeper, CLI
EXECUTORS = {"hello", "beat", "migrate", "status", "steps", "step_exit"}  # heard or answered by the executor itself


def test_every_report_type_has_one_handler_in_the_policys_table():
    from trainmover.controller.policy.core import HANDLERS
    from trainmover.protocol.messages import SCHEMA
    assert set(HANDLERS) | TO_RANKS | TO_KEEPER_OR_CLI | EXECUTORS == set(SCHEMA)
    assert not set(HANDLERS) & (TO_RANKS | TO_KEEPER_OR_CLI | EXECUTORS)
    p = new_policy()
    for kind, name in HANDLERS.items():
        assert callable(getattr(p, name, None)), f"{kind}: Policy has no method {name}"


def test_a_report_reaches_its_handler_and_another_type_decides_nothing():
    p = new_policy(ranks_per_node=1)
    ready_standby(p)
    assert p.on_message(2.0, "spare1", make("warming", node="spare1", version=2, rank=0)) == []
    assert [s["state"] for s in p.status()["standbys"]] == ["warming"]  # the table routed it to the pool
    for kind in ("beat", "hello", "migrate"):  # the control: not the policy's, nothing decided, nothing changed
        before = p.status()
        assert p.on_message(3.0, "spare1", {"type": kind}) == [] and p.status() == before
