"""trainmover.baseline: phase breakdown of a checkpoint-restart from records (pure), and the
Slurm command lines of the baseline (no Slurm needed)."""
from __future__ import annotations

import pytest

from trainmover.baseline import phases, slurm_ops


def steps(gen, first, last, t0, dt=0.1):
    return [{"gen": gen, "step": s, "t": t0 + (s - first) * dt} for s in range(first, last + 1)]


def restart_events(gen, t0):
    names = ["process_start", "torch_imported", "communicators_ready", "model_built", "checkpoint_loaded"]
    # two ranks; rank 1 is always 0.05 s later: the job waits for its slowest rank
    return [{"gen": gen, "rank": r, "event": n, "t": t0 + i + 0.05 * r} for i, n in enumerate(names) for r in (0, 1)]


def test_planned_restart_phases_add_up_and_downtime_subtracts_one_step():
    metrics = steps("1.0", 1, 50, 100.0) + steps("2.0", 51, 60, 120.0)   # old ends at 104.9; new first step at 120
    events = [{"gen": "1.0", "rank": r, "event": "checkpoint_saved", "reason": "stop", "t": 105.0 + 0.1 * r} for r in (0, 1)]
    events += restart_events("2.0", 110.0)
    r = phases.analyse("planned", 104.95, [{"gen": "2.0", "event": "batch_started", "t": 109.0}], events, metrics,
                       {"job_left": 105.5, "resubmitted": 105.6})
    assert r.old_gen == "1.0" and r.new_gen == "2.0"
    assert r.downtime_s == pytest.approx(120.0 - 104.9 - 0.1)
    assert [p["milestone"] for p in r.phases] == ["checkpoint_saved", "job_left", "resubmitted", "batch_started",
                                                 "process_start", "torch_imported", "communicators_ready",
                                                 "model_built", "checkpoint_loaded", "first_step_done"]
    assert sum(p["seconds"] for p in r.phases) == pytest.approx(120.0 - 104.9)
    assert r.phases[0]["seconds"] == pytest.approx(105.1 - 104.9)      # latest rank's save
    assert r.phases[4]["seconds"] == pytest.approx(110.05 - 109.0)     # launch ends at the slowest rank's start
    assert r.lost_steps == 0 and r.resumed_from_step == 50


def test_failure_counts_lost_steps_and_time_to_regain_them():
    metrics = steps("1.0", 1, 47, 100.0) + steps("2.0", 41, 60, 120.0)   # checkpoint at 40, fault after step 47
    r = phases.analyse("failure", 104.65, [], restart_events("2.0", 110.0), metrics, {"job_left": 104.7})
    assert r.last_step_before == 47 and r.resumed_from_step == 40 and r.lost_steps == 7
    assert r.downtime_s == pytest.approx(120.0 - 104.65)
    assert r.regained_s == pytest.approx(120.0 + 0.6 - 104.65)
    assert r.phases[0]["milestone"] == "job_left" and r.phases[0]["phase"].startswith("detect")


def test_one_generation_is_not_a_restart():
    with pytest.raises(phases.RecordsError, match="needs two"):
        phases.analyse("planned", 0.0, [], [], steps("1.0", 1, 5, 0.0), {})


def test_planned_without_a_stop_checkpoint_is_an_error():
    metrics = steps("1.0", 1, 5, 0.0) + steps("2.0", 6, 8, 10.0)
    with pytest.raises(phases.RecordsError, match="no checkpoint taken at the stop"):
        phases.analyse("planned", 0.45, [], [], metrics, {})


def test_slurm_command_lines():
    assert slurm_ops.sbatch_argv("b.sbatch", ["/r", "--steps", 5], nodes=3, chdir="/w", job_name="x") == [
        "sbatch", "--parsable", "--nodes=3", "--chdir=/w", "--job-name=x", "b.sbatch", "/r", "--steps", "5"]
    assert slurm_ops.signal_argv(7, "USR1") == ["scancel", "--signal=USR1", "7"]
    assert slurm_ops.node_down_argv("train2", "r") == ["scontrol", "update", "NodeName=train2", "State=DOWN", "Reason=r"]
    assert slurm_ops.parse_job_id("42;cluster\n") == 42
    with pytest.raises(ValueError):
        slurm_ops.node_down_argv("train2", " ")


def test_checkpoint_commit_is_atomic_and_keeps_only_the_newest(tmp_path):
    import torch

    from trainmover.baseline import checkpoint
    assert checkpoint.latest(tmp_path) is None
    for step in (10, 20):
        checkpoint.partial_dir(tmp_path, step).mkdir()
        checkpoint.write_part(tmp_path, step, 0, {"model": {"w": torch.full((2,), float(step))}}, {"step": step})
        checkpoint.write_part(tmp_path, step, 1, None, {"step": step})
        assert checkpoint.latest(tmp_path) == (None if step == 10 else checkpoint.step_dir(tmp_path, 10))
        checkpoint.commit(tmp_path, step)
    assert checkpoint.latest(tmp_path) == checkpoint.step_dir(tmp_path, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000020"]
    loaded = checkpoint.load(checkpoint.latest(tmp_path), 1, torch.device("cpu"))
    assert loaded.own == {"step": 20} and loaded.shared["model"]["w"].tolist() == [20.0, 20.0]


def test_labels_name_the_phases_of_another_launcher():
    metrics = steps("g1", 1, 47, 100.0) + steps("g2", 41, 60, 120.0)
    r = phases.analyse("failure", 104.65, [], restart_events("g2", 110.0), metrics, {"job_left": 104.7},
                       {"job_left": "detect (launcher) + kill"})
    assert r.phases[0]["phase"] == "detect (launcher) + kill"
