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

from pathlib import Path

import pytest

from tests.e2e.test_migration import assert_same_training
from tests.e2e.user_jobs import TrainerRuns, assert_same_model, user_script_jobs

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
    yield from user_script_jobs(slurm_cluster, TEMPLATE, JOB, DRAIN_REASON, lambda workdir: [
        str(SCRIPT), "--epochs", str(EPOCHS), "--out", str(workdir / "model.pt")])


def assert_same(run, reference, *lost: tuple[int, int]) -> None:
    assert_same_training(run, reference, *lost, steps=STEPS)


RUNS = TrainerRuns(steps=STEPS, drain_reason=DRAIN_REASON, timeout=300, standby_timeout=120, assert_same=assert_same)


@pytest.fixture(scope="module")
def reference(script_job, slurm_cluster):
    return RUNS.reference(script_job("script-reference"), slurm_cluster, "the script's code after its loop ran")


def test_a_drain_moves_the_scripts_rank_bit_exactly(script_job, reference, slurm_client):
    run = script_job("script-drain")
    m, moved_after = RUNS.drain_moves_rank_1(run, reference, slurm_client, leaver_leaves=True)
    # the code after the loop ran on the final ranks: rank 0 saved the final model, equal to the reference's
    assert_same_model(run, reference)
    print(f"\nscript: rank 1 moved {moved_after:.2f}s after the drain at step {m['switch_step']}; "
          f"downtime {m['downtime_s']:.3f}s")


def test_a_sigkilled_rank_of_the_script_is_recovered_bit_exactly(script_job, reference, slurm_client):
    run = script_job("script-kill", TM_INJECT="pace:0.04,die:1:130")
    RUNS.recovered_from_snapshot(run, reference, slurm_client)


def test_without_the_optimizer_state_the_script_differs(script_job, reference, slurm_client):
    run = script_job("script-negative", TM_INJECT="pace:0.04,skip-optimizer-state")
    RUNS.differs_without_optimizer_state(run, reference, slurm_client)
