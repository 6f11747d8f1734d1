"""The user's errors are the user's, end to end on the real local Slurm cluster.

The demo job's workload raises on one rank (TM_INJECT=raise, fired inside the guard of the
workload's own code, as the user's code would raise): mid-run, a real shape-mismatch
RuntimeError from torch in train_step; at construction, torch.OutOfMemoryError as the model is
built. Either way the job ends FAILED within 10 s of the error, with the rank, node, step and the
user's traceback in status.json and the last line of slurm-<job>.out; no rank is fenced, no node
drained, no migration or recovery started, no controller started twice, no requeue.
"""
from __future__ import annotations

import datetime
import json
import re
import time

import pytest

from tests.e2e.conftest import wait_for
from tests.e2e.test_migration import demo, resume_drained_nodes  # noqa: F401 - fixtures

pytestmark = pytest.mark.slurm

RAISES = re.compile(r"^(\S+ \S+) trainmover\.faults\S* injected: rank (\d+)'s workload raises", re.M)


def run_until_failed(run, client) -> tuple[float, float]:
    """(when the user's code raised, per its worker's log; when Slurm had the job ended)."""
    wait_for(f"job {run.job_id} to end", lambda: client.job(run.job_id).state not in
             ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING"), timeout=120, interval=0.2)
    ended = time.time()
    raised = [m for log in run.dir.glob("worker-*.log") for m in RAISES.findall(log.read_text())]
    assert len(raised) == 1, raised
    t = datetime.datetime.strptime(raised[0][0], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return t, ended


def assert_user_error(run, client, rank: int, where: str, error: str) -> dict:
    raised_at, ended_at = run_until_failed(run, client)
    job = client.job(run.job_id)
    out = run.slurm_out()
    assert job.state == "FAILED", out[-3000:]
    assert ended_at - raised_at < 10, f"ended {ended_at - raised_at:.1f}s after the error"
    assert job.restart_count == 0
    status = json.loads((run.dir / "status.json").read_text())
    f = status["failure"]
    assert f["user"] and f["rank"] == rank and [n["name"] for n in status["nodes"] if rank in n["ranks"]] == [f["node"]], f
    assert error in f["error"] and error in f["traceback"] and "Traceback (most recent call last)" in f["traceback"]
    assert status["migrations"] == [] and status["liveness"]["fenced"] == [], status["migrations"]
    assert not status["outcome"]["ok"]
    drained = {n: i.reason for n, i in client.nodes().items() if "DRAIN" in i.flags}
    assert not drained, drained
    last = out.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"trainmover: job {run.job_id} FAILED: user code raised on rank {rank} ({f['node']}) "
                           f"{where}: {error}") and last.endswith(f"traceback in {run.dir / 'status.json'}"), last
    assert "Traceback (most recent call last)" in out  # the controller logged the user's traceback
    assert out.count("controller started on") == 1 and "resuming" not in out, out[-3000:]
    records = [json.loads(line) for line in (run.dir / "journal.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records if r["kind"] in ("restart", "end")] == ["end"]
    print(f"\nrank {rank}'s error ({error}) {where}: job FAILED {ended_at - raised_at:.1f}s later")
    return f


def test_a_shape_mismatch_in_one_ranks_train_step_fails_the_job_at_once(demo, slurm_client):
    run = demo("user-raise", TM_STEPS=40, TM_INJECT="raise:1:20")
    f = assert_user_error(run, slurm_client, 1, "at step 20", "RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert f["step"] == 20 and f["phase"] == "train_step" and "train_step" in f["traceback"]
    # the other ranks were told the job ended: they did not wait for a recovery plan
    logs = "".join(p.read_text() for p in run.dir.glob("worker-*.log"))
    assert "no recovery plan" not in logs


def test_out_of_memory_while_building_the_model_fails_the_job_at_once(demo, slurm_client):
    run = demo("user-oom", TM_STEPS=40, TM_INJECT="raise:2:build:oom")
    f = assert_user_error(run, slurm_client, 2, "in build", "OutOfMemoryError: CUDA out of memory")
    assert f["phase"] == "build" and f["step"] == 0


def test_a_workload_whose_constructor_raises_fails_the_job_before_any_rank_starts(demo, slurm_client):
    run = demo("user-init", TM_STEPS=10, TM_WORKLOAD="tests.e2e.user_workloads:BrokenConfig")
    wait_for(f"job {run.job_id} to end", lambda: slurm_client.job(run.job_id).state not in
             ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING"), timeout=120, interval=0.5)
    job = slurm_client.job(run.job_id)
    out = run.slurm_out()
    assert job.state == "FAILED" and job.restart_count == 0, out[-3000:]
    status = json.loads((run.dir / "status.json").read_text())
    f = status["failure"]
    assert f["user"] and f["phase"] == "construction" and f["error"] == "KeyError: 'vocab_size'", f
    assert 'self.vocab = config["vocab_size"]' in f["traceback"] and "user_workloads.py" in f["traceback"]
    last = out.rstrip("\n").splitlines()[-1]
    assert last == (f"trainmover: job {run.job_id} FAILED: user code raised constructing the workload: KeyError: "
                    f"'vocab_size'; traceback in {run.dir / 'status.json'}"), last
    assert out.count("controller started on") == 1 and "resuming" not in out, out[-3000:]
    assert not list(run.dir.glob("worker-*.log"))  # no rank was started
