"""A standby that dies: warming up, ready, or joining a planned migration or a recovery.
Driven with a fake clock, as the controller's executor would (see standby_loss.py)."""
import pytest

from trainmover.config import Config
from trainmover.controller.durable.migration import Phase
from trainmover.controller.policy.actions import AcquireStandby, Finish, LaunchStandby, Record, ReleaseNode
from trainmover.errors import ConfigError
from trainmover.faults import Fault, parse_one
from test_policy import Node, new_policy, ready_standby, sends, stalled


def ready(p, now, node):
    return p.on_message(now, node, {"type": "ready", "node": node, "local": 0, "warmup_s": 2.0, "shadow_steps": 2,
                                    "detail": {}})


def events(actions):
    return [a.payload["event"] for a in actions if isinstance(a, Record) and a.stream == "timeline"]


def test_a_standby_dying_in_warmup_is_dropped_released_and_replaced():
    p = new_policy()
    assert p.start(0.0) == [AcquireStandby()]
    assert p.on_standby_acquired(1.0, "spare1") == [LaunchStandby("spare1")]
    acts = p.on_peer_gone(3.0, "spare1")  # killed before its 'ready'
    assert "spare1" not in p.view.standbys and ReleaseNode("spare1") in acts and AcquireStandby() in acts
    assert events(acts) == ["standby_lost"]
    assert p.status()["standbys_lost"] == [{"node": "spare1", "state": "starting", "evidence": "control connection lost",
                                            "t": 3.0}]
    assert p.on_step_exit(3.4, "spare1", 137) == []  # the second sign finds it gone already
    p.on_released(4.0, "spare1", True, "")
    assert "spare1" in p.view.released
    assert p.recovery() is None and not p.migrations  # nothing happened to the job


def test_a_drain_pending_while_the_standby_dies_completes_on_the_next_one():
    p = new_policy()
    p.start(0.0)
    p.on_standby_acquired(1.0, "spare1")
    p.on_nodes(2.0, {"train2": Node("ALLOCATED+DRAIN")})
    assert p.migrations[0].phase is Phase.WAITING_STANDBY
    p.on_peer_gone(3.0, "spare1")
    assert p.on_standby_acquired(4.0, "spare2") == [LaunchStandby("spare2")]
    acts = ready(p, 9.0, "spare2")
    assert sends(acts, "prepare") and p.active().joiner == "spare2" and p.active().leaver == "train2"


def test_the_joiner_lost_in_phase1_aborts_once_and_the_drain_is_asked_again():
    p = new_policy()
    ready_standby(p)
    p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")})
    m = p.active()
    acts = p.on_peer_gone(10.3, "spare1")
    (abort,) = sends(acts, "abort")
    assert abort.msg["epoch"] == m.epoch and m.phase is Phase.ABORTED and "lost during phase 1" in m.note
    retry = p.active()
    assert retry.leaver == "train2" and retry.phase is Phase.WAITING_STANDBY and AcquireStandby() in acts
    assert p.on_step_exit(10.5, "spare1", 137) == []  # no second abort
    p.on_standby_acquired(11.0, "spare2")
    acts = ready(p, 15.0, "spare2")
    (to_stayers, to_joiner) = sends(acts, "prepare")
    assert to_joiner.nodes == ("spare2",) and to_stayers.msg["epoch"] == m.epoch + 1


def test_after_standby_losses_no_more_are_taken_and_the_job_runs_on_saying_why():
    p = new_policy(standby_losses=1)
    p.start(0.0)
    p.on_standby_acquired(1.0, "spare1")
    p.on_nodes(2.0, {"train2": Node("ALLOCATED+DRAIN")})
    acts = p.on_peer_gone(3.0, "spare1")
    assert AcquireStandby() not in acts and ReleaseNode("spare1") in acts
    for t in (10.0, 100.0, 1000.0):  # and never later either
        assert AcquireStandby() not in p.on_tick(t)
    st = p.status()
    assert st["waiting_for_standby"] == ["train2"]
    assert "keeps running on train2" in st["message"] and "TM_STANDBY_LOSSES=1 reached" in st["message"]
    assert "no more standbys are taken" in st["standby_pool"]["note"]


def test_a_recovery_whose_standby_dies_before_the_plan_takes_another():
    p = new_policy(standbys=2)
    p.start(0.0)
    for t, node in ((1.0, "spare1"), (2.0, "spare2")):
        p.on_standby_acquired(t, node)
        ready(p, t + 0.5, node)
    p.on_peer_gone(5.0, "train3")
    m = p.recovery()
    assert m.joiner == "spare1"
    acts = p.on_peer_gone(5.1, "spare1")
    assert "joiner_lost" in events(acts) and m.joiner == "spare2" and m.active
    stalled(p, 5.2, 0, 10)
    acts = stalled(p, 5.3, 1, 10)
    (_, to_joiner) = sends(acts, "recover")
    assert to_joiner.nodes == ("spare2",)


def test_a_recovery_whose_standby_dies_after_the_plan_stops_the_job_clearly():
    p = new_policy()
    ready_standby(p)
    p.on_peer_gone(5.0, "train3")
    stalled(p, 5.2, 0, 10)
    stalled(p, 5.3, 1, 10)
    m = p.recovery()
    assert m.phase is Phase.PREPARING
    acts = p.on_peer_gone(5.5, "spare1")
    (fin,) = [a for a in acts if isinstance(a, Finish)]
    assert not fin.ok and "spare1" in fin.message and "train3" in fin.message and m.phase is Phase.FAILED


def test_phase1_and_warmup_injections_parse_and_reject_bad_items():
    assert parse_one("die-in-phase1:2:1") == Fault("die-in-phase1", who=2, at=1, text="die-in-phase1:2:1")
    assert parse_one("die-in-phase1:joiner:3") == Fault("die-in-phase1", who="joiner", at=3, text="die-in-phase1:joiner:3")
    assert parse_one("die-in-warmup:2") == Fault("die-in-warmup", at=2, text="die-in-warmup:2")
    cfg = Config.from_env({"TM_INJECT": "die-in-phase1:joiner:1,die-in-warmup:1", "TM_STANDBY_LOSSES": "1"})
    assert cfg.inject == ("die-in-phase1:joiner:1", "die-in-warmup:1") and cfg.standby_losses == 1
    for bad in ("die-in-phase1:joiner:0", "die-in-phase1:x:1", "die-in-phase1:1", "die-in-warmup:0",
                "die-in-warmup:a"):
        with pytest.raises(ConfigError, match="TM_INJECT"):
            Config.from_env({"TM_INJECT": bad})
    with pytest.raises(ConfigError, match="TM_STANDBY_LOSSES"):
        Config(standby_losses=-1)
