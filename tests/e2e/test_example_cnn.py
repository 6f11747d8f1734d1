"""The example workload (examples/cnn/cnn.py: BatchNorm, dropout, SGD with momentum, StepLR,
clipping, its own reshuffling generator) through sbatch_templates/torch_ddp.sbatch, unedited,
on the real local (CPU) Slurm cluster: a drain moves rank 1 to the warm standby and the run
equals an uninterrupted one bit for bit (every rank's loss at every step, the final parameter +
optimizer digest). Its negative control is the demo's (test_migration.py: the same runtime path
with the optimizer state left out of the copy; this module's own took 41 s of CI's 2 cores) and
check-workload's mistaken CNNs (tests/unit/check_workloads.py). Also: a template asking for
more nodes than the partition has is refused at submit, and an option the workload does not
take stops the job at start with its name."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import TEST_JOB_PREFIX, wait_for
from tests.e2e.test_migration import Run, assert_same_training
from tests.e2e.user_jobs import end_module_jobs, job_env
from trainmover.controller.succession.keeper import sbatch_args
from trainmover.slurm import commands

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "sbatch_templates" / "torch_ddp.sbatch"
# The drain is seen within TM_POLL_S (1 s here, not the default 10 s, for which 4000 steps
# were needed) and the leaver's node is released a second after the switch, well before the
# end: the switches landed at steps 60-111 on 2 loaded cores (~30-45 ms a step), so 600 steps
# leave ~500 after them. Each step more costs the reference, the drain and the negative control.
STEPS = 600
DRAIN_REASON = "tm-e2e cnn maintenance"
JOB = {"TM_WORKLOAD": "cnn:CNN", "TM_STEPS": str(STEPS), "TM_POLL_S": "1"}


@pytest.fixture(scope="module")
def cnn(slurm_cluster, tmp_path_factory):
    """submit(name, *sbatch_args, **env) -> Run: the template as a user submits it."""
    env = job_env(slurm_cluster, os.pathsep.join([str(ROOT), str(ROOT / "examples" / "cnn")]), keep=())
    runs: list[Run] = []

    def submit(name: str, *args: str, check: bool = True, **tm_env):
        workdir = tmp_path_factory.mktemp(name)
        env_of_job = {**env, **JOB, **{k: str(v) for k, v in tm_env.items()}}
        out = commands.run(["sbatch", "--parsable", *(args or sbatch_args(3)), f"--job-name={TEST_JOB_PREFIX}{name}",
                            f"--chdir={workdir}", str(TEMPLATE)], timeout=15, env=env_of_job, check=check)
        if not check:
            return out
        run = Run(int(out.stdout.strip().split(";")[0]), workdir, env_of_job)
        runs.append(run)
        return run

    yield submit
    end_module_jobs(slurm_cluster, env, runs, DRAIN_REASON)


@pytest.fixture(scope="module")
def reference(cnn, slurm_cluster):
    from trainmover.slurm.client import CliSlurm
    run = cnn("cnn-reference")
    assert run.wait_done(CliSlurm(slurm_conf=str(slurm_cluster.slurm_conf)), timeout=300) == "COMPLETED", \
        run.slurm_out()[-3000:]
    assert run.final()["steps"] == STEPS
    return run


def test_the_example_moves_to_a_standby_bit_exactly(cnn, reference, slurm_client):
    run = cnn("cnn-drain")
    wait_for("step 40", lambda: run.last_step() >= 40, timeout=120, interval=0.2)
    wait_for("a warm standby", lambda: any(s["state"] == "ready" for s in run.status()["standbys"]), timeout=120)
    leaver = run.metrics()[-1]["nodes"][1]  # rank 1: never the batch host, which cannot be released
    commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={DRAIN_REASON}"],
                 timeout=10, env=run.env)
    t0 = time.monotonic()
    wait_for("rank 1 to run on a standby", lambda: run.metrics()[-1]["nodes"][1] != leaver, timeout=30, interval=0.1)
    moved_after = time.monotonic() - t0
    wait_for(f"{leaver} to leave the job and reach 'drained'",
             lambda: leaver not in slurm_client.job(run.job_id).nodes and slurm_client.nodes([leaver])[leaver].drained,
             timeout=60)
    assert run.wait_done(slurm_client, timeout=300) == "COMPLETED", run.slurm_out()[-3000:]
    (m,) = run.status()["migrations"]
    assert (m["leaver"], m["trigger"], m["state"]) == (leaver, "drain", "done"), m
    assert m["joiner"].startswith("spare") and m["switch_step"] < STEPS - 10, m
    assert_same_training(run, reference, steps=STEPS)
    print(f"\ncnn:CNN: rank 1 moved {moved_after:.2f}s after the drain at step {m['switch_step']}; "
          f"downtime {m['downtime_s']:.3f}s")


def test_an_option_the_example_does_not_take_stops_the_job_at_start(cnn, slurm_client):
    run = cnn("cnn-badoption", TM_MODEL="small", TM_WORKLOAD_OPTIONS="width=4,depth=3")
    assert run.wait_done(slurm_client, timeout=60) == "FAILED"
    out = run.slurm_out()
    assert "workload 'cnn:CNN' does not accept options ['depth', 'preset'] (depth from TM_WORKLOAD_OPTIONS, " \
           "preset from TM_MODEL); it accepts: batch, clip, dropout, gamma, lr, samples, step_size, width" in out, out


def test_the_check_at_job_start_stops_a_workload_that_would_not_migrate_exactly(cnn, slurm_client):
    """TM_CHECK_WORKLOAD=1: the batch step runs check-workload before any rank starts; the CNN
    that leaves its LR scheduler out of the state never trains, and the job's output says why."""
    run = cnn("cnn-check", TM_WORKLOAD="tests.unit.check_workloads:NoScheduler", TM_CHECK_WORKLOAD=1,
              TM_CHECK_STEPS=12)
    assert run.wait_done(slurm_client, timeout=400) == "FAILED"
    out = run.slurm_out()
    assert "TM_CHECK_WORKLOAD=1: a migration of this workload would not be exact; not starting" in out, out[-3000:]
    assert "first difference at step 30" in out and "optimizer param group 0 'lr'" in out, out[-3000:]
    assert run.metrics() == []  # no step trained


def test_requests_that_could_never_start_are_refused_at_submit(cnn, slurm_cluster):
    """9 training nodes (10 with the keeper) on the 8-node partition: sbatch refuses it
    (EnforcePartLimits=ALL). 5 fit the partition only with the reserved standbys: plain sbatch
    would keep the job pending for ever; `trainmover submit` refuses it with what to change."""
    out = cnn("cnn-toobig", *sbatch_args(9), check=False)
    assert out.returncode != 0 and "Node count specification invalid" in out.stderr, out.stderr
    env = {**os.environ, "SLURM_CONF": str(slurm_cluster.slurm_conf)}
    sub = subprocess.run([sys.executable, "-m", "trainmover.cli", "submit", *sbatch_args(5),
                          f"--job-name={TEST_JOB_PREFIX}cnn-five", str(TEMPLATE)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert sub.returncode == 1 and "Requested node configuration is not available" in sub.stderr, sub.stderr
    assert ("at most 4 training nodes: submit with --nodes=5 --constraint=[tm_keeper*1&tm_train*4] "
            "(its keeper node included) or fewer") in sub.stderr
