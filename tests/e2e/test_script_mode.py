"""Script mode end to end on the real local (CPU) Slurm cluster, submitted as the ordinary user:
examples/scripts/train_tm.py (a plain torchrun DDP script, 6 lines changed: DistributedSampler,
dropout, SGD with momentum, OneCycleLR, its own loop over epochs and batches) through
sbatch_templates/torch_script.sbatch. A drain moves rank 1 to the warm standby, a SIGKILL of
rank 1 is recovered from the snapshot tier (every rank re-enters its loop at the snapshot's
step); in both, every rank's loss at every step and the final parameter + optimizer digest
equal an uninterrupted run's. The negative control (the optimizer state left out of the copy)
must differ. Last, the script's code after its loop runs once per final rank (its saved
model file exists and is the final model), never on the rank that left."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import JOB_USER, TEST_JOB_PREFIX, as_user, assert_runs_as_user, job_ended, user_dir, wait_for
from tests.e2e.test_failures import may_miss, recoveries
from tests.e2e.test_migration import Run
from trainmover.controller.succession.keeper import sbatch_args
from trainmover.slurm import commands

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "sbatch_templates" / "torch_script.sbatch"
SCRIPT = ROOT / "examples" / "scripts" / "train_tm.py"
EPOCHS = 20
STEPS = EPOCHS * 16  # 256 samples over 2 ranks, batches of 8
DRAIN_REASON = "tm-e2e script maintenance"
# pace: every step sleeps (same bits), so that the run outlasts a standby's warm-up on 2 loaded cores
JOB = {"TM_POLL_S": "1", "TM_INJECT": "pace:0.04", "TM_SNAPSHOT_EVERY": "40"}


@pytest.fixture(scope="module")
def script_job(slurm_cluster, job_user):
    """submit(name, **env) -> Run: the template and the example script, as JOB_USER submits them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_") or k == "TM_SLURM_BACKEND"}
    env.update(SLURM_CONF=str(slurm_cluster.slurm_conf), TM_PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    runs: list[Run] = []

    def submit(name: str, **tm_env) -> Run:
        workdir = user_dir(name)
        job_env = {**env, **JOB, **{k: str(v) for k, v in tm_env.items()}}
        out = as_user(["sbatch", "--parsable", *sbatch_args(2), f"--job-name={TEST_JOB_PREFIX}{name}",
                       f"--chdir={workdir}", str(TEMPLATE), str(SCRIPT), "--epochs", str(EPOCHS),
                       "--out", str(workdir / "model.pt")], job_env).stdout
        run = Run(int(out.strip().split(";")[0]), workdir, job_env)
        runs.append(run)
        return run

    yield submit
    commands.run(["scancel", *[str(r.job_id) for r in runs]], timeout=10, env=env, check=False)
    from trainmover.slurm.client import CliSlurm
    client = CliSlurm(slurm_conf=str(slurm_cluster.slurm_conf))
    wait_for("this module's jobs to end", lambda: all(job_ended(client, r.job_id) for r in runs), timeout=60,
             interval=1.0)
    for name, node in client.nodes().items():
        if "DRAIN" in node.flags and node.reason == DRAIN_REASON:
            client.resume(name)


def _losses(run: Run) -> dict[int, list]:
    return {m["step"]: m["losses"] for m in run.metrics()}


def assert_same(run: Run, reference: Run, *lost: tuple[int, int]) -> None:
    ref, got = _losses(reference), _losses(run)
    assert sorted(got) == list(range(1, STEPS + 1)), "every step logged exactly once"
    missing = [(r, s) for s, losses in got.items() for r, x in enumerate(losses) if x is None]
    assert set(missing) <= set(lost), f"losses missing at (rank, step) {missing[:5]}, allowed {sorted(lost)}"
    for r, s in missing:
        got[s][r] = ref[s][r]
    diff = [s for s in ref if ref[s] != got[s]]
    assert not diff, f"losses differ from the uninterrupted run at steps {diff[:5]}"
    assert run.final()["digest"] == reference.final()["digest"]


@pytest.fixture(scope="module")
def reference(script_job, slurm_cluster):
    from trainmover.slurm.client import CliSlurm
    slurm_client = CliSlurm(slurm_conf=str(slurm_cluster.slurm_conf))
    run = script_job("script-reference")
    assert run.wait_done(slurm_client, timeout=300) == "COMPLETED", run.slurm_out()[-3000:]
    assert run.final()["steps"] == STEPS
    assert (run.workdir / "model.pt").exists(), "the script's code after its loop ran"
    return run


def _standby_ready(run: Run) -> None:
    wait_for("step 30", lambda: run.last_step() >= 30, timeout=120, interval=0.2)
    wait_for("a warm standby", lambda: any(s["state"] == "ready" for s in run.status()["standbys"]), timeout=120)


def test_a_drain_moves_the_scripts_rank_bit_exactly(script_job, reference, slurm_client):
    import torch
    run = script_job("script-drain")
    _standby_ready(run)
    assert_runs_as_user(run.job_id, run.env)  # JOB_USER's job, no process of it root's
    leaver = run.metrics()[-1]["nodes"][1]  # rank 1: never the batch host
    commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={DRAIN_REASON}"],
                 timeout=10, env=run.env)
    t0 = time.monotonic()
    wait_for("rank 1 on the standby", lambda: run.metrics()[-1]["nodes"][1] != leaver, timeout=30, interval=0.1)
    moved_after = time.monotonic() - t0
    wait_for(f"{leaver} out of the job", lambda: leaver not in slurm_client.job(run.job_id).nodes, timeout=60)
    assert run.wait_done(slurm_client, timeout=300) == "COMPLETED", run.slurm_out()[-3000:]
    (m,) = run.status()["migrations"]
    assert (m["leaver"], m["trigger"], m["state"]) == (leaver, "drain", "done"), m
    assert m["switch_step"] < STEPS - 10
    assert_same(run, reference)
    # the code after the loop ran on the final ranks: rank 0 saved the final model, equal to the reference's
    mine, ref = torch.load(run.workdir / "model.pt"), torch.load(reference.workdir / "model.pt")
    assert all(torch.equal(mine[k], ref[k]) for k in ref)
    print(f"\nscript: rank 1 moved {moved_after:.2f}s after the drain at step {m['switch_step']}; "
          f"downtime {m['downtime_s']:.3f}s")


def test_a_sigkilled_rank_of_the_script_is_recovered_bit_exactly(script_job, reference, slurm_client):
    run = script_job("script-kill", TM_INJECT="pace:0.04,die:1:130")
    assert run.wait_done(slurm_client, timeout=300) == "COMPLETED", run.slurm_out()[-3000:]
    (m,) = recoveries(run)
    src = m["state_source"]
    assert m["state"] == "done" and src["tier"] == "snapshot" and src["step"] == 120, src
    assert_same(run, reference, *may_miss(m))


def test_without_the_optimizer_state_the_script_differs(script_job, reference, slurm_client):
    run = script_job("script-negative", TM_INJECT="pace:0.04,skip-optimizer-state")
    _standby_ready(run)
    ok = run.cli("migrate", "--job", str(run.job_id), "--node", run.metrics()[-1]["nodes"][1])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert run.wait_done(slurm_client, timeout=300) == "COMPLETED", run.slurm_out()[-3000:]
    (m,) = run.status()["migrations"]
    assert m["state"] == "done"
    ref, got = _losses(reference), _losses(run)
    assert all(got[s] == ref[s] for s in range(1, m["switch_step"] + 1)), "identical before the switch"
    assert any(got[s] != ref[s] for s in range(m["switch_step"] + 1, STEPS + 1)), "diverges after it"
    assert run.final()["digest"] != reference.final()["digest"]
