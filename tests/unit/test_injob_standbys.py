"""In-job standbys (TM_INJOB_STANDBYS, issue 40 item 1): the node split at start (pure,
controller/view.split_in_job), the policy using the job's own standbys for drains and never
growing where grow is refused, what it says when none is left, and the start check that lets
such a job run on a cluster without job expansion (controller/user_rights.py). Negative
controls: the same events with grow allowed, and a job that brings none."""
from __future__ import annotations

import logging

import pytest

from trainmover.config import Config
from trainmover.controller import user_rights
from trainmover.controller.durable.migration import Phase
from trainmover.controller.durable.view import JobView, split_in_job
from trainmover.controller.fencing import FencedNodes
from trainmover.controller.policy.actions import AcquireStandby, LaunchStandby, ReleaseNode, Send
from trainmover.controller.policy.core import Policy
from trainmover.errors import ConfigError
from trainmover.slurm import rights

from test_policy import Node  # the node-state fake the policy tests use

T = "tm_train"
REFUSED = "SchedulerParameters lacks permit_job_expansion: Slurm cannot merge a node into a job"


# --- the split (pure) ---------------------------------------------------------------------
def test_the_last_n_training_feature_nodes_are_the_standbys_in_the_controllers_order():
    nodes = ["n1", "n2", "n3", "n4", "n5"]  # the keeper is left out by the caller, as the executor does
    feats = {n: (T,) for n in nodes}
    assert split_in_job(nodes, 2, batch_host="k1", features=feats, train_feature=T) == (["n1", "n2", "n3"], ["n4", "n5"])
    assert split_in_job(nodes, 0, batch_host="k1", features=feats, train_feature=T) == (nodes, [])  # control: none


def test_only_nodes_with_the_training_feature_and_never_the_batch_host_are_standbys():
    nodes = ["a", "b", "c", "d"]
    feats = {"a": (T,), "b": (T,), "c": ("other",), "d": ()}  # c, d: allocated but not training-feature nodes
    assert split_in_job(nodes, 1, batch_host="k", features=feats, train_feature=T) == (["a", "c", "d"], ["b"])
    # no keeper: the batch host trains and runs the controller; a shrink cannot release it
    assert split_in_job(["n1", "n2", "n3"], 1, batch_host="n3", features={}, train_feature=T) == (["n1", "n3"], ["n2"])
    # a cluster without features: every node may be one
    assert split_in_job(["n1", "n2"], 1, batch_host="k", features={}, train_feature=T) == (["n1"], ["n2"])


@pytest.mark.parametrize("nodes, n, batch", [(["n1", "n2"], 2, "k"), (["n1"], 1, "k"), (["n1", "n2"], 2, "n1")])
def test_too_few_nodes_for_the_standbys_and_one_training_node_is_a_config_error(nodes, n, batch):
    with pytest.raises(ConfigError, match=f"TM_INJOB_STANDBYS={n}: .* ask for {n} more node"):
        split_in_job(nodes, n, batch_host=batch, features={}, train_feature=T)


def test_the_variable_is_one_validated_config_field():
    assert Config.from_env({"TM_INJOB_STANDBYS": "2"}).injob_standbys == 2
    assert Config().injob_standbys == 0
    with pytest.raises(ConfigError):
        Config.from_env({"TM_INJOB_STANDBYS": "-1"})
    with pytest.raises(ConfigError):
        Config.from_env({"TM_INJOB_STANDBYS": "two"})


# --- the policy ----------------------------------------------------------------------------
def new_policy(refusal, injob=2, standbys=1):
    p = Policy(Config(standbys=standbys, injob_standbys=injob),
               JobView(7, 3, 1, "k1", {0: "train1", 1: "train2", 2: "train3"}))
    p.on_grow_verdict(refusal)
    return p


def ready(p, node, now):
    return p.on_message(now, node, {"type": "ready", "node": node, "local": 0, "warmup_s": 2.0, "shadow_steps": 2,
                                    "detail": {}})


def migrate(p, leaver, now):
    """A drain of `leaver` carried to the joiner's switch; the actions of that switch."""
    acts = p.on_nodes(now, {leaver: Node("ALLOCATED+DRAIN")})
    prepare = [a for a in acts if isinstance(a, Send) and a.msg["type"] == "prepare"]
    assert prepare, "the drain found no standby"
    m = p.active()
    for node in p.view.train_nodes():
        for rank in p.view.ranks_of(node):
            p.on_message(now + .1, node, {"type": "prepared", "epoch": m.epoch, "rank": rank, "groups": ["world"],
                                          "seconds": .1, "detail": {}})
    for rank in m.leaver_ranks:
        p.on_message(now + .1, m.joiner, {"type": "prepared", "epoch": m.epoch, "rank": rank, "groups": ["world"],
                                          "seconds": .1, "detail": {}})
    assert m.phase is Phase.SWITCHING
    for node in p.view.train_nodes():
        for rank in p.view.ranks_of(node):
            p.on_message(now + .2, node, {"type": "switched", "epoch": m.epoch, "rank": rank,
                                          "role": "leaver" if node == leaver else "stayer", "step": 40, "t": now,
                                          "detail": {}})
    assert p.on_step_exit(now + .25, leaver, 0) == []  # the leaver's step ends; the joiner has not reported
    acts = []
    for rank in m.leaver_ranks:
        acts += p.on_message(now + .3, m.joiner, {"type": "switched", "epoch": m.epoch, "rank": rank, "role": "joiner",
                                                  "step": 40, "t": now, "detail": {"bytes": 1}})
    return m, acts


def test_in_job_standbys_are_launched_at_start_and_no_grow_is_tried_where_it_is_refused():
    p = new_policy(REFUSED)
    assert p.start(0.0, ["s1", "s2"]) == [LaunchStandby("s1"), LaunchStandby("s2")]  # no AcquireStandby
    assert set(p.view.standbys) == {"s1", "s2"} and p.view.world_size == 3
    assert not any(isinstance(a, AcquireStandby) for t in (1.0, 30.0, 300.0) for a in p.on_tick(t))
    st = p.status()["standby_pool"]
    assert st["in_job"] == {"brought": 2, "refill": "no", "left": 2} and st["wanted"] == 2
    assert st["note"] == f"2 of the job's 2 in-job standby(s) left; none is taken from the reservation: {REFUSED}"


def test_two_drains_use_the_two_in_job_standbys_release_by_shrink_and_never_grow(caplog):
    caplog.set_level(logging.INFO, "trainmover.policy")
    p = new_policy(REFUSED)
    p.start(0.0, ["s1", "s2"])
    ready(p, "s1", 1.0), ready(p, "s2", 1.0)
    m, acts = migrate(p, "train2", 10.0)
    assert m.joiner == "s1" and ReleaseNode("train2") in acts  # the leaver leaves by the shrink path
    assert not any(isinstance(a, AcquireStandby) for a in acts)  # no refill: grow refused
    p.on_released(11.0, "train2", True, "")
    assert m.phase is Phase.DONE and p.view.rank_node[1] == "s1"
    assert p.status()["standby_pool"]["in_job"]["left"] == 1
    assert "2 of the job's 2 in-job standby(s) left" in caplog.text  # said at start
    assert "1 of the job's 2 in-job standby(s) left" in caplog.text
    assert "0 of the job's 2" not in caplog.text
    m2, acts = migrate(p, "train3", 20.0)
    assert m2.joiner == "s2" and ReleaseNode("train3") in acts and AcquireStandby() not in acts
    assert p.status()["standby_pool"]["in_job"]["left"] == 0
    assert "0 of the job's 2 in-job standby(s) left (all used or lost)" in caplog.text


def test_a_third_drain_with_none_left_waits_clearly_with_the_job_running(caplog):
    caplog.set_level(logging.INFO, "trainmover.policy")
    p = new_policy(REFUSED, injob=1)
    p.start(0.0, ["s1"])
    ready(p, "s1", 1.0)
    migrate(p, "train2", 10.0)
    p.on_released(11.0, "train2", True, "")
    acts = p.on_nodes(20.0, {"train3": Node("ALLOCATED+DRAIN")})
    assert not any(isinstance(a, Send) and a.msg["type"] == "prepare" for a in acts)
    assert AcquireStandby() not in acts
    m = p.migrations[-1]
    assert m.phase is Phase.WAITING_STANDBY and m.leaver == "train3"
    st = p.status()
    assert st["waiting_for_standby"] == ["train3"]
    assert st["message"] == ("waiting for a standby: the job keeps running on train3 (no standby left: the job's 1 "
                             f"in-job standby(s) are used or lost, and none is taken from the reservation ({REFUSED}))")
    assert "no standby left" in caplog.text and "the job keeps running on train3" in caplog.text
    assert not any(isinstance(a, AcquireStandby) for t in (30.0, 300.0) for a in p.on_tick(t))
    assert p.view.rank_node[2] == "train3"  # nothing lost: it trains on


def test_control_where_grow_is_possible_the_pool_is_refilled_after_an_in_job_standby_is_used():
    p = new_policy("", injob=1)
    assert p.start(0.0, ["s1"]) == [LaunchStandby("s1")]  # one brought = one wanted: nothing to take yet
    ready(p, "s1", 1.0)
    _, acts = migrate(p, "train2", 10.0)
    assert AcquireStandby() in acts and "in_job" in p.status()["standby_pool"]
    assert p.status()["standby_pool"]["in_job"]["refill"] == "yes"


def test_control_a_job_without_in_job_standbys_takes_from_the_reservation_as_before():
    p = new_policy(None, injob=0)  # the rights check has not answered: the resizer's gate decides
    assert p.start(0.0) == [AcquireStandby()]
    assert "in_job" not in p.status()["standby_pool"]


# --- the start check ---------------------------------------------------------------------
class FakeSlurm:
    def capabilities(self, job_id, reservation, expansion_fix="auto"):
        return rights.decide(rights.Facts(user="tmuser", uid=940, groups=("tmuser",), scheduler_parameters="",
                                          reservation=reservation, reservation_fields={"Users": "tmuser"},
                                          slurm_version="24.11.5"))


def test_no_grow_with_in_job_standbys_starts_in_job_mode_and_with_neither_fails_fast():
    caps, error = user_rights.from_slurm(FakeSlurm(), 7, "trainmover_standby", 1, FencedNodes(), in_job=2)
    assert error == "" and caps["grow"] is False and caps["pool_mode"]["mode"] == "in-job"
    assert user_rights.grow_refusal(caps) == REFUSED
    caps, error = user_rights.from_slurm(FakeSlurm(), 7, "trainmover_standby", 1, FencedNodes())
    assert error.startswith("cannot take standbys: SchedulerParameters lacks permit_job_expansion")
    assert caps["pool_mode"]["mode"] == "none"


def test_trainmover_status_says_how_many_in_job_standbys_are_left():
    from trainmover.cli import _in_job_line
    p = new_policy(REFUSED, injob=2)
    p.start(0.0, ["s1", "s2"])
    assert _in_job_line(p.status()["standby_pool"]) == "  in-job standbys: 2 left of 2, refill from the reservation: no"
    assert _in_job_line(new_policy("", injob=1).status()["standby_pool"]) == (
        "  in-job standbys: 1 brought, refill from the reservation: yes")
    assert _in_job_line(new_policy(REFUSED, injob=0).status()["standby_pool"]) == ""  # control: none brought
