"""The controller's choice of a recovery tier (pure): replica, then snapshot, then checkpoint,
else a clear stop; and what the policy sends and records for each."""
import json

from trainmover.controller.durable.migration import Phase
from trainmover.controller.durable.records import RunFiles
from trainmover.controller.policy import tiers
from trainmover.controller.policy.actions import CheckpointDone, Finish, Rewind

from test_policy import new_policy, ready_standby, sends, stalled

ALL = ("replica", "snapshot", "checkpoint")


def report(rank, step, replicas=(), own=(), held=None, digest="d"):
    return {"rank": rank, "step": step, "digest": digest, "role": "stayer",
            "holds": {"replicas": list(replicas), "own": list(own), "held": held or {}}}


def test_a_replica_is_preferred_when_every_live_rank_replicates_the_lost_one():
    reports = {0: report(0, 230, (0, 1, 2), own=(150, 200), held={"2": [150, 200]}),
               2: report(2, 229, (0, 1, 2), own=(150, 200), held={"1": [150, 200]})}
    got = tiers.choose(ALL, (1,), reports, [200])
    assert got == tiers.Choice("replica", 230, 0, source=0, laggers=(2,))


def test_the_snapshot_tier_when_no_replica_rolls_everyone_back_to_the_newest_complete_step():
    reports = {0: report(0, 230, own=(150, 200), held={"2": [150, 200]}),
               2: report(2, 231, own=(150, 200), held={"1": [150, 200]})}
    got = tiers.choose(ALL, (1,), reports, [100])
    assert got == tiers.Choice("snapshot", 200, rolled_back=31, holders={1: 2})
    assert got.to_json() == {"tier": "snapshot", "step": 200, "rolled_back_steps": 31, "holders": {"1": 2}}


def test_a_snapshot_exchange_cut_by_the_failure_falls_back_to_the_version_before():
    # step 250's exchange was under way: rank 2 has not received rank 1's copy of 250
    reports = {0: report(0, 252, own=(200, 250), held={"2": [200, 250]}),
               2: report(2, 252, own=(200, 250), held={"1": [200]})}
    assert tiers.choose(ALL, (1,), reports, []) == tiers.Choice("snapshot", 200, rolled_back=52, holders={1: 2})


def test_the_checkpoint_tier_when_the_lost_ranks_holder_is_lost_too():
    # ranks 1 and 2 lost together (one ranks_per_node=2 node); rank 2 held rank 1's copies
    reports = {0: report(0, 230, own=(150, 200), held={"3": [150, 200]}),
               3: report(3, 230, own=(150, 200), held={"2": [150, 200]})}
    got = tiers.choose(ALL, (1, 2), reports, [100, 200])
    assert got == tiers.Choice("checkpoint", 200, rolled_back=30)


def test_the_checkpoint_tier_when_snapshots_are_off_or_incomplete_on_a_live_rank():
    off = {0: report(0, 230), 2: report(2, 230)}
    assert tiers.choose(ALL, (1,), off, [100]).tier == "checkpoint"
    # rank 2 misses its own copy of 200 (it joined after a migration): 200 is not common
    partial = {0: report(0, 230, own=(150, 200), held={"2": [150, 200]}), 2: report(2, 230, own=(200,), held={})}
    assert tiers.choose(ALL, (1,), partial, [100]) == tiers.Choice("checkpoint", 100, rolled_back=130)


def test_nothing_to_recover_from_stops_with_what_each_tier_lacked():
    got = tiers.choose(("snapshot", "checkpoint"), (1,), {0: report(0, 230, own=(200,)), 2: report(2, 230)}, [])
    assert isinstance(got, tiers.Stop)
    assert "snapshot: no step held by every live rank" in got.message and "checkpoint: no complete checkpoint" in got.message
    assert "not tried (TM_RECOVERY_TIERS): replica" in got.message


def test_the_tier_order_is_the_admins():
    reports = {0: report(0, 230, (0, 1, 2), own=(200,), held={"2": [200]}),
               2: report(2, 230, (0, 1, 2), own=(200,), held={"1": [200]})}
    assert tiers.choose(("checkpoint", "snapshot", "replica"), (1,), reports, [100]).tier == "checkpoint"
    assert tiers.choose(("snapshot", "replica"), (1,), reports, [100]).tier == "snapshot"


def test_replicas_that_disagree_stop_the_job():
    reports = {0: report(0, 10, (0, 1, 2), digest="a"), 2: report(2, 10, (0, 1, 2), digest="b")}
    got = tiers.choose(ALL, (1,), reports, [])
    assert isinstance(got, tiers.Stop) and "different states" in got.message


# --- through the policy: the plan sent, metrics rewound, status -----------------------------
def lose_rank_1(p):
    ready_standby(p)
    p.on_step_exit(3.0, "train2", 137)
    return p.recovery()


def test_a_snapshot_recovery_sends_the_holders_and_rewinds_the_metrics():
    p = new_policy(recovery_tiers="snapshot,checkpoint")
    for step in (229, 230, 231):  # rows of steps that will be redone (231 incomplete: rank 1 is gone)
        for rank in (0, 2) if step == 231 else (0, 1, 2):
            p.on_message(2.0, f"train{rank + 1}", {"type": "step", "rank": rank, "step": step, "loss": 1.0,
                                                   "step_s": 0.01, "compute_s": 0.01, "t": 2.0})
    m = lose_rank_1(p)
    stalled(p, 3.1, 0, 231, holds={"replicas": [], "own": [150, 200], "held": {"2": [150, 200]}})
    acts = stalled(p, 3.2, 2, 231, holds={"replicas": [], "own": [150, 200], "held": {"1": [150, 200]}})
    to_stayers, to_joiner = sends(acts, "recover")
    assert to_stayers.msg["tier"] == "snapshot" and to_stayers.msg["step"] == 200
    assert to_stayers.msg["holders"] == {"1": 2} and to_joiner.msg["assign"] == {"0": 1}
    assert Rewind(200) in acts and 231 not in p.rows
    assert m.switch_step == 200 and m.to_json()["state_source"] == {"tier": "snapshot", "step": 200,
                                                                     "rolled_back_steps": 31, "holders": {"1": 2}}
    # the redone steps are logged once each, from the final run
    row = [a for rank in (0, 1, 2) for a in p.on_message(4.0, "spare1" if rank == 1 else f"train{rank + 1}", {
        "type": "step", "rank": rank, "step": 201, "loss": 2.0, "step_s": 0.01, "compute_s": 0.01, "t": 4.0})]
    assert [a.payload["step"] for a in row if getattr(a, "stream", "") == "metrics"] == [201]


def test_a_checkpoint_recovery_when_snapshots_are_off_and_checkpoints_complete_once_every_rank_wrote():
    p = new_policy(recovery_tiers="snapshot,checkpoint", snapshot_every=0, checkpoint_every=100)
    for rank in (0, 1):
        assert p.on_message(1.0, f"train{rank + 1}", {"type": "checkpointed", "rank": rank, "step": 200,
                                                      "digest": f"d{rank}", "bytes": 9, "seconds": 0.1}) == []
    (done,) = p.on_message(1.0, "train3", {"type": "checkpointed", "rank": 2, "step": 200, "digest": "d2",
                                           "bytes": 9, "seconds": 0.1})
    assert done == CheckpointDone(200, {0: "d0", 1: "d1", 2: "d2"}, (200,)) and p.checkpoint_steps == [200]
    lose_rank_1(p)
    stalled(p, 3.1, 0, 230, holds={"replicas": [], "own": [], "held": {}})
    acts = stalled(p, 3.2, 2, 230, holds={"replicas": [], "own": [], "held": {}})
    (to_stayers, _) = sends(acts, "recover")
    assert to_stayers.msg["tier"] == "checkpoint" and to_stayers.msg["step"] == 200 and Rewind(200) in acts
    assert p.status()["protection"]["checkpoints"] == [200]


def test_checkpoints_keep_the_two_newest():
    p = new_policy(checkpoint_every=100)
    for step in (100, 200, 300):
        acts = [a for r in range(3) for a in p.on_message(1.0, f"train{r + 1}", {
            "type": "checkpointed", "rank": r, "step": step, "digest": "d", "bytes": 1, "seconds": 0.1})]
    assert acts[-1].keep == (200, 300) and p.checkpoint_steps == [200, 300]


def test_no_tier_stops_the_job_with_a_clear_error():
    p = new_policy(recovery_tiers="snapshot,checkpoint")
    m = lose_rank_1(p)
    stalled(p, 3.1, 0, 230, holds={"replicas": [0, 1, 2], "own": [], "held": {}})
    acts = stalled(p, 3.2, 2, 230, holds={"replicas": [0, 1, 2], "own": [], "held": {}})
    assert not sends(acts, "recover") and m.phase is Phase.FAILED
    (stop,) = [a for a in acts if isinstance(a, Finish)]
    assert not stop.ok and "train2 (ranks [1]) lost: no recovery tier can restore rank(s) [1]" in stop.message
    assert "no complete checkpoint" in stop.message


def test_rewinding_the_metrics_keeps_each_step_once_and_appends_after(tmp_path):
    files = RunFiles(tmp_path)
    for step in range(1, 8):
        files.append("metrics", {"step": step, "loss": 1.0})
    assert files.rewind("metrics", 4) == 3
    files.append("metrics", {"step": 5, "loss": 2.0})
    files.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 2.0)]


def test_snapshots_are_taken_only_where_they_could_be_used():
    from trainmover.controller.policy.tiers import snapshots_needed
    default = ("replica", "snapshot", "checkpoint")
    assert not snapshots_needed(default, (0, 1, 2, 3), 4)       # plain DDP: every rank has a live replica
    assert snapshots_needed(default, (0, 2), 4)                  # replicas of part of the job only
    assert snapshots_needed(default, None, 4)                    # no replica group (Megatron without DP)
    assert snapshots_needed(("snapshot", "replica"), (0, 1, 2, 3), 4)  # snapshot preferred
    assert not snapshots_needed(("replica", "checkpoint"), None, 4)    # snapshot tier not allowed


def test_the_chosen_standby_is_told_its_rank_at_the_fault_before_the_plan():
    """`anticipate` goes to the standby once, when the controller chooses it (the live ranks have
    not stalled yet), naming the rank the plan will assign it: it binds itself and starts its
    groups while the others stall (runtime/roles/recovery.py). Control: the plan itself only
    comes once every live rank stalled, and it sends no second anticipate."""
    p = new_policy()
    ready_standby(p)
    acts = p.on_step_exit(3.0, "train2", 137)
    (early,) = sends(acts, "anticipate")
    assert early.nodes == ("spare1",) and early.msg["assign"] == {"0": 1} and early.msg["failed"] == [1]
    assert not sends(acts, "recover")
    acts = stalled(p, 3.1, 0, 231)
    assert not sends(acts, "recover") and not sends(acts, "anticipate")
    acts = stalled(p, 3.2, 2, 231)
    (_, to_joiner) = sends(acts, "recover")
    assert not sends(acts, "anticipate")
    assert to_joiner.msg["assign"] == early.msg["assign"] and to_joiner.msg["epoch"] == early.msg["epoch"]
