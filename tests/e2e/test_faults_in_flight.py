"""Faults while a planned migration is under way, end to end on the real local Slurm cluster.

* A stayer, or the joiner, SIGKILLed in Phase 1 of a drain (TM_INJECT die-in-phase1): the
  migration is aborted with no group half-switched; a lost stayer is rebuilt from a replica
  on the standby that was joining; the drain is asked again and completes on the next standby.
* The joiner SIGKILLed as the leaver's state copy starts (TM_INJECT die-in-copy:joiner): the
  leaver's send fails, it stops as a lost rank, and its rank is recovered from a replica.
* A standby SIGKILLed as its warm-up begins (TM_INJECT die-in-warmup), a drain pending: the
  controller drops it, takes another, and the drain completes there; with no standby left
  (TM_STANDBY_LOSSES) the job trains on on the drained node and says so.
* Nothing left to recover onto: the job stops at TM_RECOVERY_TIMEOUT_S with a clear error.

Each run that completes is compared bit for bit (per-step losses, final digest) with an
uninterrupted run of the same template; the job keeps its id and is never requeued.
"""
from __future__ import annotations

import json
import time

import pytest

from tests.e2e.conftest import wait_for
from trainmover.slurm import commands
from tests.e2e.test_migration import (  # noqa: F401 - fixtures shared with the planned-migration tests
    DRAIN_REASON, assert_same_training, demo, leaver_of, reference, resume_drained_nodes, start_training)

pytestmark = pytest.mark.slurm


def timeline(run) -> list[dict]:
    return [json.loads(line) for line in (run.dir / "timeline.jsonl").read_text().splitlines()]


def drain(run, node: str) -> float:
    commands.run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={DRAIN_REASON}"], timeout=10,
                 env=run.env)
    return time.time()


# Each test here waits, with training going on, for a second standby to start and warm up after
# the first was lost (its imports alone take ~15 s on 2 loaded cores): pace (the same bits) keeps
# the run's 300 steps going for that. Unpaced, the joiner test's run ended first (CI, 300 steps).
PACE = "pace:0.08"


def first_step_after(run, t: float) -> float:
    return min(m["t"] for m in run.metrics() if m["t"] > t)


def training(run, client, min_step: int) -> None:
    """start_training, with room for a slow start: on 2 shared cores under load the
    controller's and workers' imports alone took over a minute."""
    wait_for(f"job {run.job_id} to log step {min_step}", lambda: run.last_step() >= min_step, timeout=240,
             interval=0.5)
    start_training(run, client, min_step=min_step)


def warm_standby(run) -> None:
    wait_for("a warm standby", lambda: any(s["state"] == "ready" for s in run.status()["standbys"]), timeout=90)


def test_a_stayer_killed_in_phase1_aborts_the_drain_is_recovered_and_the_drain_completes(demo, reference,
                                                                                         slurm_client):
    """Rank 2 dies as Phase 1 of epoch 1 begins: the drain's migration is aborted, rank 2 is
    rebuilt from a replica on the standby that was joining (TM_STANDBYS=1: the only one), and
    the drain is retried on a new standby."""
    run = demo("stayer-in-phase1", TM_INJECT=f"die-in-phase1:2:1,{PACE}")
    training(run, slurm_client, min_step=20)
    warm_standby(run)
    leaver, victim = leaver_of(run), run.metrics()[-1]["nodes"][2]
    drain(run, leaver)
    assert run.wait_done(slurm_client, timeout=240) == "COMPLETED", run.slurm_out()[-3000:]
    planned, recovered, retry = run.status()["migrations"]
    assert planned["state"] == "aborted" and f"{victim} lost during the migration" in planned["note"]
    assert recovered["recovery"] and recovered["leaver"] == victim and recovered["state"] == "done"
    assert recovered["joiner"] == planned["joiner"]  # the aborted joiner went back to the pool and was used
    assert recovered["state_source"]["tier"] == "replica"
    assert (retry["leaver"], retry["trigger"], retry["state"]) == (leaver, "drain", "done")
    assert retry["joiner"] not in (planned["joiner"], None)
    # the victim's loss at the switch step may have died with it, and a lagger's (see may_miss)
    assert_same_training(run, reference, *[(r, recovered["switch_step"])
                                          for r in {2, *recovered["state_source"].get("laggers", [])}])
    job = slurm_client.job(run.job_id)
    assert job.restart_count == 0 and leaver not in job.nodes and victim not in job.nodes
    ev = {(e["migration"], e["event"]): e for e in timeline(run)}
    detected = ev[(recovered["id"], "detected")]["t"]
    resumed = first_step_after(run, ev[(recovered["id"], "recover")]["t"])
    print(f"\nstayer {victim} killed in phase 1: detected -> first step after recovery {resumed - detected:.2f}s; "
          f"abort to retry done {retry['phases']['done'] - planned['phases']['aborted']:.2f}s")


def drained_to_its_end(demo, slurm_client, name: str, inject: str):
    """A paced demo job with `inject`, its standby warm, rank 1's node drained: (run, that
    node) once the job COMPLETED."""
    run = demo(name, TM_INJECT=f"{inject},{PACE}")
    training(run, slurm_client, min_step=20)
    warm_standby(run)
    leaver = leaver_of(run)
    drain(run, leaver)
    assert run.wait_done(slurm_client, timeout=240) == "COMPLETED", run.slurm_out()[-3000:]
    return run, leaver


def test_the_joiner_killed_in_phase1_aborts_and_the_drain_completes_on_another_standby(demo, reference,
                                                                                       slurm_client):
    run, leaver = drained_to_its_end(demo, slurm_client, "joiner-in-phase1", "die-in-phase1:joiner:1")
    status = run.status()
    planned, retry = status["migrations"]
    assert planned["state"] == "aborted" and "lost during phase 1" in planned["note"]
    assert (retry["leaver"], retry["state"]) == (leaver, "done")
    (lost,) = status["standbys_lost"]
    assert lost["node"] == planned["joiner"] and lost["state"] == "joining"
    assert lost["evidence"] == "control connection lost"  # the first sign, before Slurm's step end
    # the retry joined a standby launched after the loss (Slurm may hand the same node back)
    tl = timeline(run)
    lost_at = next(i for i, e in enumerate(tl) if e["event"] == "standby_lost")
    retried_at = next(i for i, e in enumerate(tl) if e["event"] == "prepare" and e["migration"] == retry["id"])
    assert lost_at < retried_at
    assert_same_training(run, reference)
    assert slurm_client.job(run.job_id).restart_count == 0
    print(f"\njoiner {lost['node']} killed in phase 1: lost -> aborted {planned['phases']['aborted'] - lost['t']:.3f}s, "
          f"-> drain done on {retry['joiner']} {retry['phases']['done'] - lost['t']:.2f}s")


def test_the_joiner_killed_in_the_copy_stops_the_leaver_and_its_rank_is_recovered(demo, reference, slurm_client):
    """The joiner dies as it starts to receive the leaver's state (TM_INJECT die-in-copy:joiner):
    the stayers switched to it at that boundary, and the leaver's send fails. The leaver stops as
    a lost rank (raised, its error would have ended the job: roles/switch.py `stop_as_lost`), the
    drain's migration fails, and the rank is recovered onto a new standby from a replica; the
    job completes bit-exactly, never requeued."""
    run, leaver = drained_to_its_end(demo, slurm_client, "joiner-in-copy", "die-in-copy:joiner")
    status = run.status()
    planned, *after = status["migrations"]
    assert (planned["leaver"], planned["trigger"], planned["state"]) == (leaver, "drain", "failed"), planned
    assert "during the state copy" in planned["note"], planned["note"]  # the joiner's loss or the leaver's, first
    (recovered,) = [m for m in after if m["recovery"] and m["state"] == "done"]
    assert recovered["leaver"] == leaver and recovered["joiner"], recovered
    assert recovered["state_source"]["tier"] == "replica"
    # the rank went to a standby launched after the joiner's loss (Slurm may hand its node back)
    (lost,) = status["standbys_lost"]
    assert lost["node"] == planned["joiner"] and lost["state"] == "joining", lost
    tl = timeline(run)
    lost_at = next(i for i, e in enumerate(tl) if e["event"] == "standby_lost")
    assert lost_at < next(i for i, e in enumerate(tl) if e["event"] == "released" and e["migration"] == recovered["id"])
    assert all(m["state"] in ("done", "aborted") for m in after), after
    logs = "".join(p.read_text(errors="replace") for p in run.dir.glob("*.log"))
    assert "sending this leaver's state at step" in logs and "stopping as a lost rank" in logs
    assert "injected: dies at joiner-copy" in logs  # control: the fault fired where it should
    assert_same_training(run, reference, *[(r, recovered["switch_step"])
                                          for r in recovered["state_source"].get("laggers", [])])
    job = slurm_client.job(run.job_id)
    assert job.restart_count == 0 and leaver not in job.nodes
    print(f"\njoiner {planned['joiner']} killed in the copy: leaver {leaver} stopped, rank recovered on "
          f"{recovered['joiner']} ({recovered['state_source']['tier']}), "
          f"downtime {recovered['downtime_s']:.2f}s, drain failed -> recovery done "
          f"{recovered['phases']['done'] - planned['phases']['failed']:.2f}s")


def test_a_standby_killed_in_warmup_is_replaced_and_a_pending_drain_completes(demo, reference, slurm_client):
    run = demo("standby-in-warmup", TM_INJECT=f"die-in-warmup:1,{PACE}")
    training(run, slurm_client, min_step=5)
    leaver = leaver_of(run)
    drained_at = drain(run, leaver)
    assert run.wait_done(slurm_client, timeout=240) == "COMPLETED", run.slurm_out()[-3000:]
    status = run.status()
    (lost,) = status["standbys_lost"]
    assert lost["state"] == "starting"
    (m,) = status["migrations"]
    assert (m["leaver"], m["state"]) == (leaver, "done")
    assert_same_training(run, reference)
    assert slurm_client.job(run.job_id).restart_count == 0
    events = [e["event"] for e in timeline(run)]
    assert "standby_lost" in events and events.index("standby_lost") < events.index("prepare")
    print(f"\nstandby {lost['node']} killed in warm-up; drain done on {m['joiner']} "
          f"{m['phases']['done'] - drained_at:.2f}s after the drain, {m['phases']['done'] - lost['t']:.2f}s after the loss")


def test_with_no_standby_left_the_drained_node_keeps_training_and_says_so(demo, reference, slurm_client):
    run = demo("no-standby-left", TM_INJECT=f"die-in-warmup:1,{PACE}", TM_STANDBY_LOSSES=1)  # paced: an unloaded machine ran all 300 steps before the drain was seen
    training(run, slurm_client, min_step=5)
    leaver = leaver_of(run)
    drain(run, leaver)
    wait_for("the status to say why the drain waits",
             lambda: "no more standbys are taken" in run.status()["message"], timeout=60, interval=0.5)
    status = run.status()
    assert f"keeps running on {leaver}" in status["message"] and status["waiting_for_standby"] == [leaver]
    assert run.wait_done(slurm_client, timeout=240) == "COMPLETED", run.slurm_out()[-3000:]
    (m,) = run.status()["migrations"]
    assert m["state"] == "waiting_standby" and m["leaver"] == leaver
    assert all(x["nodes"][1] == leaver for x in run.metrics())
    assert "TM_STANDBY_LOSSES=1 reached" in run.slurm_out()
    assert_same_training(run, reference)


def test_nothing_left_to_recover_onto_stops_the_job_at_the_recovery_deadline(demo, slurm_client):
    """Rank 2 and the joiner both die in Phase 1, and no other standby may be taken: training
    pauses for at most TM_RECOVERY_TIMEOUT_S, then the job stops with a clear error."""
    run = demo("nothing-left", TM_INJECT="die-in-phase1:2:1,die-in-phase1:joiner:1", TM_STANDBY_LOSSES=1,
               TM_RECOVERY_TIMEOUT_S=15)
    training(run, slurm_client, min_step=20)
    warm_standby(run)
    drain(run, leaver_of(run))
    assert run.wait_done(slurm_client, timeout=120) == "FAILED"
    status = json.loads((run.dir / "status.json").read_text())
    outcome = status["outcome"]
    assert not outcome["ok"] and "not recovered within 15s (waiting for a standby)" in outcome["message"], outcome
    recovered = next(m for m in status["migrations"] if m["recovery"])
    assert recovered["state"] == "failed"
    waited = recovered["phases"]["failed"] - recovered["phases"]["requested"]
    assert 15 <= waited < 15 + 5, waited  # bounded by the deadline (one poll late at most)
    assert slurm_client.job(run.job_id).restart_count == 0
    print(f"\nnothing left to recover onto: stopped {waited:.1f}s after the loss: {outcome['message']}")
