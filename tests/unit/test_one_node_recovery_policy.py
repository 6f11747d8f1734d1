"""A one-node job (one worker and its standby): who holds the snapshots, what the recovery plan
says when no rank survives, and the pause of a planned migration without a stayer. Pure: a
fake clock and fake observations, as test_policy.py."""
from trainmover.config import Config
from trainmover.controller.durable.migration import Phase
from trainmover.controller.durable.view import JobView
from trainmover.controller.policy import tiers
from trainmover.controller.policy.actions import AcquireStandby, Finish, LaunchStandby, Rewind
from trainmover.controller.policy.core import Policy
from trainmover.protocol.messages import JOINER, make

from test_policy import sends


def one_node(**cfg):
    return Policy(Config(**{"snapshot_every": 40, **cfg}), JobView(7, 1, 1, "gpu0", {0: "gpu0"}))


def ready(p, node="gpu1", now=1.0):
    assert p.start(0.0) == [AcquireStandby()]
    assert LaunchStandby(node) in p.on_standby_acquired(now, node)
    return p.on_message(now + 1, node, make("ready", node=node, local=0, warmup_s=2.0, shadow_steps=2, detail={}))


def step(p, s, t, node="gpu0"):
    return p.on_message(t, node, make("step", rank=0, step=s, loss=1.0, step_s=0.2, compute_s=0.2, t=t))


def test_the_first_ready_standby_holds_a_one_node_jobs_snapshots_and_both_sides_are_told():
    p = one_node()
    assert not sends(ready(p), "hold")  # the worker has not reported a step: it may not be connected yet
    step(p, 1, 2.5)
    (hold,) = sends(p.on_tick(2.6), "hold")
    assert set(hold.nodes) == {"gpu0", "gpu1"}
    assert hold.msg["holder"] == "gpu1" and hold.msg["wards"] == [0] and hold.msg["prefix"] == "tm/hold/a1/"
    assert not sends(p.on_tick(3.0), "hold")  # assigned once
    p.on_message(4.0, "gpu1", make("snapshot_held", node="gpu1", rank=0, steps=[40], detail={"bytes": 9}))
    p.on_message(4.0, "gpu0", make("snapshot_taken", rank=0, step=40, detail={"copy_s": 0.3}))
    snap = p.status()["protection"]["snapshots"]
    assert snap["holder"] == "gpu1" and snap["held"] == {"0": [40]} and snap["taken"]["0"] == [{"step": 40, "copy_s": 0.3}]


def test_a_lost_holder_is_replaced_and_the_ranks_stop_sending_to_it():
    p = one_node(standbys=2)
    step(p, 1, 0.5)
    ready(p)
    assert p.holder == "gpu1"
    acts = p.on_peer_gone(5.0, "gpu1")
    assert "gpu1" not in p.view.standbys
    stop = [a for a in sends(acts + p.on_tick(5.1), "hold") if a.msg["holder"] == ""]
    assert stop and stop[0].nodes == ("gpu0",) and p.holder is None
    p.on_standby_acquired(6.0, "gpu2")
    (hold,) = sends(p.on_message(7.0, "gpu2", make("ready", node="gpu2", local=0, warmup_s=1.0, shadow_steps=2,
                                                   detail={})), "hold")
    assert hold.msg["holder"] == "gpu2" and hold.msg["prefix"] == "tm/hold/a2/"  # a new link, new keys


def test_no_holder_with_several_training_nodes_or_without_snapshots():
    p = Policy(Config(snapshot_every=40), JobView(7, 2, 1, "n1", {0: "n1", 1: "n2"}))
    p.start(0.0)
    p.on_standby_acquired(1.0, "s1")
    assert not sends(p.on_message(2.0, "s1", make("ready", node="s1", local=0, warmup_s=1.0, shadow_steps=2,
                                                  detail={})), "hold")
    p = one_node(snapshot_every=0)
    step(p, 1, 0.5)
    assert not sends(ready(p), "hold")


def test_the_lone_workers_loss_is_recovered_from_the_standbys_own_copy():
    p = one_node(recovery_tiers="replica,snapshot,checkpoint")
    ready(p)
    for s in range(38, 63):
        step(p, s, 2.0 + s * 0.2)
    p.on_message(9.0, "gpu1", make("snapshot_held", node="gpu1", rank=0, steps=[0, 40], detail={}))
    acts = p.on_peer_gone(20.0, "gpu0")
    (recover,) = sends(acts, "recover")
    assert recover.nodes == ("gpu1",) and recover.msg["assign"] == {"0": 0}
    assert recover.msg["tier"] == "snapshot" and recover.msg["step"] == 40
    assert recover.msg["holders"] == {"0": JOINER} and recover.msg["needers"] == [0]
    assert Rewind(40) in acts
    m = p.recovery()
    assert m.to_json()["state_source"] == {"tier": "snapshot", "step": 40, "rolled_back_steps": 22,
                                           "holders": {"0": "joiner"}}
    assert m.phase is Phase.PREPARING


def test_the_lone_workers_loss_without_a_held_copy_stops_with_what_each_tier_lacked():
    p = one_node()
    ready(p)
    step(p, 30, 5.0)
    acts = p.on_peer_gone(6.0, "gpu0")
    (stop,) = [a for a in acts if isinstance(a, Finish)]
    assert not stop.ok and "replica: no live rank" in stop.message and "snapshot: no step held" in stop.message


def test_tiers_with_no_live_rank():
    got = tiers.choose(("replica", "snapshot", "checkpoint"), (0,), {}, [], joiner={0: [40, 80]}, completed=95)
    assert got == tiers.Choice("snapshot", 80, 15, holders={0: JOINER})
    got = tiers.choose(("replica", "snapshot", "checkpoint"), (0,), {}, [50], joiner={}, completed=95)
    assert got == tiers.Choice("checkpoint", 50, 45)
    # with live ranks the joiner's copy is preferred to a live holder's (nothing on the wire)
    live = {1: {"rank": 1, "step": 90, "digest": "d", "holds": {"replicas": [], "own": [80], "held": {"0": [80]}}}}
    got = tiers.choose(("snapshot",), (0,), live, [], joiner={0: [80]}, completed=90)
    assert got.holders == {0: JOINER} and got.step == 80
    assert tiers.choose(("snapshot",), (0,), live, [], joiner={}).holders == {0: 1}


def test_snapshots_on_a_one_node_job_even_with_a_replica_group():
    # a replica group inside one node dies with it: the snapshot tier is the only protection
    assert tiers.snapshots_needed(("replica", "snapshot", "checkpoint"), (0,), 1)
    assert tiers.snapshots_needed(("replica", "snapshot", "checkpoint"), (0, 1, 2, 3), 4, ranks_per_node=4)
    assert not tiers.snapshots_needed(("replica", "snapshot", "checkpoint"), (0, 1, 2, 3), 4, ranks_per_node=2)


def test_a_planned_migration_without_a_stayer_is_timed_on_the_leavers_rank():
    p = one_node(snapshot_every=0)
    ready(p)
    for s in range(1, 21):
        step(p, s, 10.0 + s * 0.2)
    p.request(15.0, "gpu0", "manual")
    m = p.active()
    for rank, node, role in ((0, "gpu0", "leaver"), (0, "gpu1", "joiner")):
        p.on_message(15.1, node, make("prepared", epoch=m.epoch, rank=rank, groups=["world"], seconds=0.1, detail={}))
    p.on_message(15.3, "gpu0", make("switched", epoch=m.epoch, rank=0, role="leaver", step=20, t=14.1, detail={}))
    p.on_message(15.4, "gpu1", make("switched", epoch=m.epoch, rank=0, role="joiner", step=20, t=14.3, detail={}))
    step(p, 21, 14.0 + 0.5, node="gpu1")  # the joiner's first step ends 0.5 s after the leaver's last
    assert abs(m.downtime_s - 0.3) < 1e-6  # minus one steady step (0.2 s)
