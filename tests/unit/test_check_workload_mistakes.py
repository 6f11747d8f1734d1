"""`trainmover check-workload` on workloads with one mistake each (tests/unit/check_workloads.py):
each check names the first step where a migration would differ, and what differed. (Apart from
test_check_workload.py so that `make test`'s parallel workers run the two halves side by side.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.unit.test_check_workload import ROOT, TIMEOUT_S, check, finding, on_path  # noqa: F401 - on_path: a fixture


def test_a_scheduler_left_out_of_the_state_fails_at_the_first_step_after_the_switch(on_path):
    # through the command line: exit status 1 and the message
    out = subprocess.run([sys.executable, "-m", "trainmover.cli", "check-workload",
                          "tests.unit.check_workloads:NoScheduler", "--steps", "12"],
                         capture_output=True, text=True, timeout=TIMEOUT_S + 60, env=os.environ, cwd=ROOT)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "migration    FAIL first difference at step 30 (the 1st step after the switch after step 29)" in out.stdout
    assert "optimizer param group 0 'lr'" in out.stdout and "LR scheduler" in out.stdout
    assert "a migration would NOT be exact" in out.stdout


def test_a_data_generator_left_out_fails_at_the_next_epoch(on_path):
    report = check("tests.unit.check_workloads:NoGenerator")
    m = finding(report, "migration")
    # 12 steps an epoch per rank: at step 37 the reference draws the order of epoch 3, the joiner
    # (whose generator drew only at its build) the one of epoch 1 again
    assert not m.ok and m.step == 37 and "loss of rank 0" in m.message, report.text()
    assert not report.exact


@pytest.mark.parametrize("step_size", [2, 3])
def test_a_per_epoch_schedule_left_out_fails_where_a_fresh_instance_restarts(on_path, step_size):
    # epochs of 4 steps: the state after step 5 holds one epoch, a fresh instance counted none
    report = check("tests.unit.check_workloads:PerEpochSchedule", step_size=step_size)
    r = finding(report, "restart")
    assert not r.ok and "given the state after step 5: first difference at step" in r.message, report.text()
    assert "optimizer param group 0 'lr'" in r.message and not report.exact


def test_an_unseeded_generator_fails_the_determinism_check(on_path):
    report = check("tests.unit.check_workloads:Unseeded", steps=4)
    d = finding(report, "determinism")
    assert not d.ok and d.step == report.plan.rollback + 1 and "not a function of (seed, rank, state)" in d.message
    assert not finding(report, "migration").ok


def test_a_load_that_forgets_batchnorm_statistics_fails_the_rollback(on_path):
    # a migration receives tensors in place into the joiner's own buffers, which hides this
    # mistake there; restoring a copy (snapshot and checkpoint tiers) shows it
    report = check("tests.unit.check_workloads:LoadForgetsBatchNorm", steps=4)
    r = finding(report, "rollback")
    assert not r.ok and r.step == report.plan.rollback and "running_mean" in r.message, report.text()


def test_a_state_the_transfer_cannot_carry_stops_the_check_with_the_key(on_path):
    report = check("tests.unit.check_workloads:GeneratorObject", steps=4)
    assert not report.exact
    assert "/workload/data/generator (torch._C.Generator)" in report.failure, report.text()
