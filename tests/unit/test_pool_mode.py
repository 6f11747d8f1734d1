"""Where a job's standbys come from on the cluster at hand (slurm/pool_mode.py): the mode from
Slurm's facts, why in one line, and the same verdict as grow's (slurm/rights.py)."""
from __future__ import annotations

import itertools

import pytest

from trainmover.slurm import pool_mode, rights
from trainmover.slurm.expansion_fix import Declaration
from trainmover.slurm.pool_mode import Mode

SAFE = "Slurm 24.11.5: job expansion is safe (...)"
CRASH = "Slurm 25.11.7: slurmctld crashes (SIGSEGV in _valid_license_job_expansion(), job_mgr.c)"


def choose(permitted=True, safe=True, refusal="", in_job=0):
    return pool_mode.choose(expansion_permitted=permitted, release_safe=safe, release_why=SAFE if safe else CRASH,
                            reservation="trainmover_standby", reservation_refusal=refusal,
                            expansion_off_why=rights.EXPANSION_OFF, in_job=in_job)


def test_all_three_facts_give_reservation_grow():
    m = choose()
    assert m.mode is Mode.RESERVATION_GROW and m.blocked_by == "" and m.refusal == ""
    assert m.why == ("standbys are taken from reservation trainmover_standby, which admits this job's user, into the "
                     f"running job; {SAFE}")
    assert m.as_status() == {"mode": "reservation-grow", "why": m.why}
    assert m.line() == f"standby mode: reservation-grow ({m.why})"
    unchecked = choose(refusal=None)  # at submit: the job's account is not known yet
    assert unchecked.mode is Mode.RESERVATION_GROW and "(checked when the job starts)" in unchecked.why


@pytest.mark.parametrize("facts, blocked_by, said", [
    (dict(permitted=False), "slurm.conf", rights.EXPANSION_OFF),
    (dict(safe=False), "release", CRASH),
    (dict(refusal="reservation trainmover_standby not found"), "reservation", "reservation trainmover_standby not found"),
    (dict(permitted=False, safe=False, refusal="x"), "slurm.conf", rights.EXPANSION_OFF),   # slurm.conf first
    (dict(safe=False, refusal="reservation refuses"), "release", CRASH),                  # then the release
])
def test_without_one_fact_there_is_no_standby_and_the_first_missing_one_is_said(facts, blocked_by, said):
    m = choose(**facts)
    assert m.mode is Mode.NONE and m.blocked_by == blocked_by and m.refusal == said
    assert m.why.startswith(f"{said}: no standby can join the job") and "TM_INJOB_STANDBYS" in m.why


@pytest.mark.parametrize("facts, blocked_by", [
    (dict(permitted=False), "slurm.conf"), (dict(safe=False), "release"), (dict(refusal="refused"), "reservation"),
])
def test_in_job_standbys_are_chosen_where_grow_is_not_possible_and_the_job_brings_them(facts, blocked_by):
    assert pool_mode.IN_JOB_BUILT
    m = choose(**facts, in_job=2)
    assert m.mode is Mode.IN_JOB and m.blocked_by == blocked_by and m.refusal
    assert m.why.startswith(f"{m.refusal}: the job keeps its 2 standby(s) in its own allocation (TM_INJOB_STANDBYS)")
    assert choose(**facts).mode is Mode.NONE  # negative control: the same cluster, a job that brings none


def test_a_job_that_brings_standbys_still_grows_where_grow_is_possible():
    assert choose(in_job=2).mode is Mode.RESERVATION_GROW
    assert pool_mode.with_in_job(choose(), 2) == choose()  # nothing blocked: unchanged
    assert pool_mode.with_in_job(choose(safe=False), 0).mode is Mode.NONE


def test_rights_give_in_job_for_a_job_with_in_job_standbys_and_it_may_start():
    caps = rights.decide(rights.Facts(user="tmuser", uid=940, groups=("tmuser",), scheduler_parameters="",
                                      reservation="trainmover_standby", reservation_fields={"Users": "tmuser"},
                                      slurm_version="24.11.5"))
    assert not caps.grow and caps.pool.mode is Mode.NONE
    assert caps.start_error(1, "trainmover_standby").startswith("cannot take standbys")  # neither: fails fast
    assert caps.start_error(0, "trainmover_standby") == ""
    job = caps.for_job(2)
    assert job.pool.mode is Mode.IN_JOB and not job.grow and job.as_status()["pool_mode"]["mode"] == "in-job"
    assert job.start_error(1, "trainmover_standby", in_job=2) == ""
    assert "uses the 2 standby(s) it brought" in job.consequences(1, in_job=2)[0]
    assert caps.for_job(0) is caps


def test_rights_grow_is_yes_exactly_where_the_mode_is_reservation_grow():
    for params, version, users, declared in itertools.product(
            ("permit_job_expansion", "batch_sched_delay=0"), ("24.11.5", "25.11.7", "26.05.5", ""),
            ("root,tmuser", "root,alice"), ((), ("25.11.7",))):
        caps = rights.decide(rights.Facts(
            user="tmuser", uid=940, groups=("tmuser",), scheduler_parameters=params, reservation="trainmover_standby",
            reservation_fields={"Users": users}, slurm_version=version,
            expansion_fix=Declaration(declared, "/etc/slurm/trainmover-expansion-fix")))
        assert caps.grow == (caps.pool.mode is Mode.RESERVATION_GROW), (params, version, users, declared)
        assert caps.as_status()["pool_mode"]["mode"] == caps.pool.mode.value
        if not caps.grow:
            assert caps.why["grow"] == caps.pool.refusal and caps.pool.why.startswith(caps.why["grow"])
