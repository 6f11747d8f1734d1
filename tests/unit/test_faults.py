"""Fault injection (trainmover/faults.py): parsed as data, reached through one hook."""
from __future__ import annotations

import os
import signal
import time

import pytest

from trainmover import faults
from trainmover.config import Config
from trainmover.errors import ConfigError
from trainmover.faults import Injector


def test_every_documented_form_parses_and_bad_items_name_the_form():
    items = ["die:1:30", "slow:2:0.2", "freeze:0:5", "hang:3:7", "die-in-phase1:joiner:1", "die-in-phase1:2:3",
             "die-in-warmup:1", "die-in-copy", "corrupt-transfer", "skip-optimizer-state", "corrupt-snapshot",
             "no-rollback", "controller-die:prepare", "controller-die:preparing", "pace:0.05"]
    parsed = faults.parse(items)
    assert [f.text for f in parsed] == items
    assert parsed[0] == faults.Fault("die", who=1, at=30, text="die:1:30")
    assert parsed[1].value == 0.2 and parsed[2].kind == "freeze" and parsed[3].at == 7
    assert Config.from_env({"TM_INJECT": ",".join(items)}).inject == tuple(items)
    for bad, says in [("die:1", "die:<rank>:<step>"), ("freeze:x:1", "freeze:<rank>:<step>"),
                      ("slow:1:12", "fraction in"), ("hang:-1:2", "rank must be >= 0"),
                      ("controller-die:later", "known controller faults"), ("explode", "unknown injection"),
                      ("pace:0", "pace:<seconds>"), ("pace:soon", "pace:<seconds>"), ("pace:1:2", "pace:<seconds>"),
                      ("die-in-warmup", "unknown injection")]:  # the bare form is the controller's, not a user's
        with pytest.raises(ConfigError, match="TM_INJECT") as exc:
            Config.from_env({"TM_INJECT": bad})
        assert says in str(exc.value)


def test_die_in_warmup_reaches_only_the_chosen_standby_of_the_first_controller():
    items = ("die-in-warmup:2", "no-rollback")
    assert faults.for_launch(items, "standby", 2, first_controller=True) == ("no-rollback", "die-in-warmup")
    assert faults.for_launch(items, "standby", 1, first_controller=True) == ("no-rollback",)
    assert faults.for_launch(items, "standby", 2, first_controller=False) == ("no-rollback",)
    assert faults.for_launch(items, "worker", 2, first_controller=True) == ("no-rollback",)
    assert faults.parse(faults.for_launch(items, "standby", 2, True), launched=True)[1].kind == "die-in-warmup"


def test_data_faults_answer_true_only_at_their_point():
    inj = Injector(["corrupt-transfer", "skip-optimizer-state"], "worker")
    assert inj.at("transfer-send") and inj.at("leaver-state")
    assert not inj.at("snapshot-send") and not inj.at("rollback")
    assert not Injector([], "worker").at("transfer-send")


def test_rank_faults_act_only_in_the_process_launched_for_that_rank(monkeypatch):
    kills = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append(sig))
    inj = Injector(["die:1:5", "freeze:2:3"], "worker")
    inj.at("step", rank=1, step=4)
    inj.at("step", rank=0, step=5)
    assert kills == []
    inj.at("step", rank=1, step=5)
    inj.at("step", rank=2, step=3)
    assert kills == [signal.SIGKILL, signal.SIGSTOP]
    Injector(["die:1:5"], "standby").at("step", rank=1, step=5)  # a joiner that took rank 1 over
    assert kills == [signal.SIGKILL, signal.SIGSTOP]


def test_slow_burns_its_fraction_of_the_steps_own_compute_time():
    inj = Injector(["slow:0:0.5"], "worker")
    t0 = time.process_time()
    inj.at("step", rank=0, step=1, pure_s=0.2, cpu=True)
    assert time.process_time() - t0 >= 0.1
    t1 = time.process_time()
    inj.at("step", rank=1, step=1, pure_s=0.2, cpu=True)
    assert time.process_time() - t1 < 0.1


def test_pace_sleeps_each_step_in_every_role_that_trains(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    for role in ("worker", "standby"):  # a joiner that took a rank over keeps the job's pace
        Injector(["pace:0.05"], role).at("step", rank=1, step=7, pure_s=0.01, cpu=True)
    assert slept == [0.05, 0.05]


def test_controller_faults_fire_only_in_the_first_controller(monkeypatch):
    kills = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append(sig))
    Injector(["controller-die:prepare"], "controller", first_controller=False).at("controller", at="prepare")
    assert kills == []
    inj = Injector(["controller-die:prepare"], "controller")
    inj.at("controller", at="preparing")
    assert kills == []
    inj.at("controller", at="prepare")
    assert kills == [signal.SIGKILL]
