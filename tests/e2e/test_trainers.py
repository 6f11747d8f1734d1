"""Trainers that run the loop themselves, end to end on the real local (CPU) Slurm cluster,
submitted as the ordinary user: examples/lightning/train.py (a Lightning script with
TrainMoverCallback: DDP, bf16, gradient accumulation, clipping, OneCycle, a CSVLogger and
ModelCheckpoint) through sbatch_templates/torch_script.sbatch. A drain moves rank 1 to the
warm standby; a SIGKILL of rank 1 is recovered from the snapshot tier (every rank re-enters
Lightning's loop at the snapshot's step); in both, every rank's loss at every step, the final
digest, the Trainer's metrics.csv (one row per step, the same values) and the saved model equal
an uninterrupted run's. The negative control (the optimizer state left out) must differ.
The same three for examples/huggingface/train.py (the Hugging Face Trainer with its callback;
its checkpoints' trainer_state.json log history and the saved model compared).
Run as tests/e2e's others are (13 tests with test_script_mode.py and test_example_cnn.py: 441 s)."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.e2e.conftest import JOB_USER
from tests.e2e.test_migration import Run, assert_same_training
from tests.e2e.user_jobs import TrainerRuns, assert_same_model, user_script_jobs

pytestmark = pytest.mark.slurm
pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "sbatch_templates" / "torch_script.sbatch"
SCRIPT = ROOT / "examples" / "lightning" / "train.py"
EPOCHS = 28
STEPS = EPOCHS * 8  # 256 samples over 2 ranks, batches of 8, 2 batches per optimizer step
DRAIN_REASON = "tm-e2e lightning maintenance"
JOB = {"TM_POLL_S": "1", "TM_INJECT": "pace:0.04", "TM_SNAPSHOT_EVERY": "40"}
assert JOB_USER


@pytest.fixture(scope="module")
def lightning_job(slurm_cluster, job_user):
    """submit(name, **env) -> Run: the template and the Lightning example, as JOB_USER submits them."""
    yield from user_script_jobs(slurm_cluster, TEMPLATE, JOB, DRAIN_REASON, lambda workdir: [
        str(SCRIPT), "--epochs", str(EPOCHS), "--logdir", str(workdir / "logs"), "--out", str(workdir / "model.pt")])


def metrics_csv(run: Run) -> list[dict]:
    """The Trainer's own log: one version directory for the whole job, one row per step."""
    files = sorted(run.workdir.glob("logs/lightning_logs/version_*/metrics.csv"))
    dirs = sorted(run.workdir.glob("logs/lightning_logs/version_*"))
    assert len(files) == 1 and dirs == [files[0].parent], f"one version directory for the job: {dirs}"
    with open(files[0]) as f:
        return list(csv.DictReader(f))


def assert_same(run: Run, reference: Run, *lost: tuple[int, int]) -> None:
    assert_same_training(run, reference, *lost, steps=STEPS)
    assert_same_model(run, reference)
    rows, ref_rows = metrics_csv(run), metrics_csv(reference)
    assert [r["step"] for r in rows] == [str(s) for s in range(STEPS)], "metrics.csv: every step once, in order"
    assert rows == ref_rows, "metrics.csv equals the uninterrupted run's"


RUNS = TrainerRuns(steps=STEPS, drain_reason=DRAIN_REASON, timeout=400, standby_timeout=180, assert_same=assert_same)


@pytest.fixture(scope="module")
def reference(lightning_job, slurm_cluster):
    run = RUNS.reference(lightning_job("lightning-reference"), slurm_cluster, "the script's code after Trainer.fit ran")
    assert len(metrics_csv(run)) == STEPS
    return run


def test_a_drain_moves_the_lightning_rank_bit_exactly(lightning_job, reference, slurm_client):
    run = lightning_job("lightning-drain")
    RUNS.drain_moves_rank_1(run, reference, slurm_client)


def test_a_sigkilled_lightning_rank_is_recovered_bit_exactly(lightning_job, reference, slurm_client):
    run = lightning_job("lightning-kill", TM_INJECT="pace:0.04,die:1:130")
    # Losses, digest, the saved model and metrics.csv: after the rollback every rank re-entered,
    # rank 0's CSVLogger in the job's one version directory (it went on in a new version_N before:
    # Lightning makes the writer before the first callback hook).
    RUNS.recovered_from_snapshot(run, reference, slurm_client)


def test_without_the_optimizer_state_the_lightning_job_differs(lightning_job, reference, slurm_client):
    run = lightning_job("lightning-negative", TM_INJECT="pace:0.04,skip-optimizer-state")
    RUNS.differs_without_optimizer_state(run, reference, slurm_client)


# -- Hugging Face Trainer: examples/huggingface/train.py (TrainMoverCallback: a GPT-2 from a config,
# dropout, AdamW, cosine warm-up, gradient accumulation, clipping, evaluation and a checkpoint each
# epoch). The same three runs as Lightning's; the Trainer's own files compared: the last
# checkpoint's trainer_state.json log history (wall-clock timings left out), and the saved model.

HF_SCRIPT = ROOT / "examples" / "huggingface" / "train.py"
HF_EPOCHS = 40
HF_STEPS = HF_EPOCHS * 4  # 64 samples over 2 ranks, batches of 4, 2 batches per optimizer step
HF_DRAIN_REASON = "tm-e2e huggingface maintenance"


@pytest.fixture(scope="module")
def hf_job(slurm_cluster, job_user):
    """submit(name, **env) -> Run: the template and the Hugging Face example, as JOB_USER submits them."""
    pytest.importorskip("transformers")
    yield from user_script_jobs(slurm_cluster, TEMPLATE, JOB, HF_DRAIN_REASON, lambda workdir: [
        str(HF_SCRIPT), "--epochs", str(HF_EPOCHS), "--outdir", str(workdir / "hf-out"),
        "--out", str(workdir / "model.pt")])


def hf_log_history(run: Run) -> list[dict]:
    """The last checkpoint's trainer_state.json log history, less wall-clock timings."""
    import json
    last = run.workdir / "hf-out" / f"checkpoint-{HF_STEPS}" / "trainer_state.json"
    history = json.loads(last.read_text())["log_history"]
    return [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))} for e in history]


def assert_same_hf(run: Run, reference: Run, *lost: tuple[int, int]) -> None:
    assert_same_training(run, reference, *lost, steps=HF_STEPS)
    checkpoints = sorted(p.name for p in (run.workdir / "hf-out").glob("checkpoint-*"))
    assert checkpoints == sorted(p.name for p in (reference.workdir / "hf-out").glob("checkpoint-*"))
    history = hf_log_history(run)
    assert [e["step"] for e in history if "loss" in e] == list(range(1, HF_STEPS + 1)), "one loss entry a step"
    assert history == hf_log_history(reference), "the Trainer's log history equals the uninterrupted run's"
    assert_same_model(run, reference)


HF_RUNS = TrainerRuns(steps=HF_STEPS, drain_reason=HF_DRAIN_REASON, timeout=400, standby_timeout=180,
                      assert_same=assert_same_hf)


@pytest.fixture(scope="module")
def hf_reference(hf_job, slurm_cluster):
    return HF_RUNS.reference(hf_job("hf-reference"), slurm_cluster, "the script's code after Trainer.train ran")


def test_a_drain_moves_the_huggingface_rank_bit_exactly(hf_job, hf_reference, slurm_client):
    run = hf_job("hf-drain")
    HF_RUNS.drain_moves_rank_1(run, hf_reference, slurm_client)


def test_a_sigkilled_huggingface_rank_is_recovered_bit_exactly(hf_job, hf_reference, slurm_client):
    run = hf_job("hf-kill", TM_INJECT="pace:0.04,die:1:130")
    HF_RUNS.recovered_from_snapshot(run, hf_reference, slurm_client)


def test_without_the_optimizer_state_the_huggingface_job_differs(hf_job, hf_reference, slurm_client):
    run = hf_job("hf-negative", TM_INJECT="pace:0.04,skip-optimizer-state")
    HF_RUNS.differs_without_optimizer_state(run, hf_reference, slurm_client)
