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
Not run by the session that wrote it (no cluster there): run it as tests/e2e's others are."""
from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import JOB_USER, TEST_JOB_PREFIX, as_user, assert_runs_as_user, job_ended, user_dir, wait_for
from tests.e2e.test_failures import may_miss, recoveries
from tests.e2e.test_migration import Run
from trainmover.controller.succession.keeper import sbatch_args
from trainmover.slurm import commands

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
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_") or k == "TM_SLURM_BACKEND"}
    env.update(SLURM_CONF=str(slurm_cluster.slurm_conf), TM_PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    runs: list[Run] = []

    def submit(name: str, **tm_env) -> Run:
        workdir = user_dir(name)
        job_env = {**env, **JOB, **{k: str(v) for k, v in tm_env.items()}}
        out = as_user(["sbatch", "--parsable", *sbatch_args(2), f"--job-name={TEST_JOB_PREFIX}{name}",
                       f"--chdir={workdir}", str(TEMPLATE), str(SCRIPT), "--epochs", str(EPOCHS),
                       "--logdir", str(workdir / "logs"), "--out", str(workdir / "model.pt")], job_env).stdout
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


def metrics_csv(run: Run) -> list[dict]:
    """The Trainer's own log: one version directory for the whole job, one row per step."""
    files = sorted(run.workdir.glob("logs/lightning_logs/version_*/metrics.csv"))
    dirs = sorted(run.workdir.glob("logs/lightning_logs/version_*"))
    assert len(files) == 1 and dirs == [files[0].parent], f"one version directory for the job: {dirs}"
    with open(files[0]) as f:
        return list(csv.DictReader(f))


def assert_same(run: Run, reference: Run, *lost: tuple[int, int]) -> None:
    import torch
    ref, got = _losses(reference), _losses(run)
    assert sorted(got) == list(range(1, STEPS + 1)), "every step logged exactly once"
    missing = [(r, s) for s, losses in got.items() for r, x in enumerate(losses) if x is None]
    assert set(missing) <= set(lost), f"losses missing at (rank, step) {missing[:5]}, allowed {sorted(lost)}"
    for r, s in missing:
        got[s][r] = ref[s][r]
    diff = [s for s in ref if ref[s] != got[s]]
    assert not diff, f"losses differ from the uninterrupted run at steps {diff[:5]}"
    assert run.final()["digest"] == reference.final()["digest"]
    mine, theirs = torch.load(run.workdir / "model.pt"), torch.load(reference.workdir / "model.pt")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    rows, ref_rows = metrics_csv(run), metrics_csv(reference)
    assert [r["step"] for r in rows] == [str(s) for s in range(STEPS)], "metrics.csv: every step once, in order"
    assert rows == ref_rows, "metrics.csv equals the uninterrupted run's"


@pytest.fixture(scope="module")
def reference(lightning_job, slurm_cluster):
    from trainmover.slurm.client import CliSlurm
    slurm_client = CliSlurm(slurm_conf=str(slurm_cluster.slurm_conf))
    run = lightning_job("lightning-reference")
    assert run.wait_done(slurm_client, timeout=400) == "COMPLETED", run.slurm_out()[-3000:]
    assert run.final()["steps"] == STEPS
    assert (run.workdir / "model.pt").exists(), "the script's code after Trainer.fit ran"
    assert len(metrics_csv(run)) == STEPS
    return run


def _standby_ready(run: Run) -> None:
    wait_for("step 30", lambda: run.last_step() >= 30, timeout=180, interval=0.2)
    wait_for("a warm standby", lambda: any(s["state"] == "ready" for s in run.status()["standbys"]), timeout=180)


def test_a_drain_moves_the_lightning_rank_bit_exactly(lightning_job, reference, slurm_client):
    run = lightning_job("lightning-drain")
    _standby_ready(run)
    assert_runs_as_user(run.job_id, run.env)
    leaver = run.metrics()[-1]["nodes"][1]
    commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={DRAIN_REASON}"],
                 timeout=10, env=run.env)
    wait_for("rank 1 on the standby", lambda: run.metrics()[-1]["nodes"][1] != leaver, timeout=30, interval=0.1)
    assert run.wait_done(slurm_client, timeout=400) == "COMPLETED", run.slurm_out()[-3000:]
    (m,) = run.status()["migrations"]
    assert (m["leaver"], m["trigger"], m["state"]) == (leaver, "drain", "done"), m
    assert m["switch_step"] < STEPS - 10
    assert_same(run, reference)


def test_a_sigkilled_lightning_rank_is_recovered_bit_exactly(lightning_job, reference, slurm_client):
    run = lightning_job("lightning-kill", TM_INJECT="pace:0.04,die:1:130")
    assert run.wait_done(slurm_client, timeout=400) == "COMPLETED", run.slurm_out()[-3000:]
    (m,) = recoveries(run)
    src = m["state_source"]
    assert m["state"] == "done" and src["tier"] == "snapshot" and src["step"] == 120, src
    # Losses, digest, the saved model and metrics.csv: after the rollback every rank re-entered,
    # rank 0's CSVLogger in the job's one version directory (it went on in a new version_N before:
    # Lightning makes the writer before the first callback hook).
    assert_same(run, reference, *may_miss(m))


def test_without_the_optimizer_state_the_lightning_job_differs(lightning_job, reference, slurm_client):
    run = lightning_job("lightning-negative", TM_INJECT="pace:0.04,skip-optimizer-state")
    _standby_ready(run)
    ok = run.cli("migrate", "--job", str(run.job_id), "--node", run.metrics()[-1]["nodes"][1])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert run.wait_done(slurm_client, timeout=400) == "COMPLETED", run.slurm_out()[-3000:]
    (m,) = run.status()["migrations"]
    assert m["state"] == "done"
    ref, got = _losses(reference), _losses(run)
    assert all(got[s] == ref[s] for s in range(1, m["switch_step"] + 1)), "identical before the switch"
    assert any(got[s] != ref[s] for s in range(m["switch_step"] + 1, STEPS + 1)), "diverges after it"
    assert run.final()["digest"] != reference.final()["digest"]


# -- Hugging Face Trainer: examples/huggingface/train.py (TrainMoverCallback: a GPT-2 from a config,
# dropout, AdamW, cosine warm-up, gradient accumulation, clipping, evaluation and a checkpoint each
# epoch). The same three runs as Lightning's; the Trainer's own files compared: the last
# checkpoint's trainer_state.json log history (wall-clock timings left out), and the saved model.
# Not run by the session that wrote it (no cluster there).

HF_SCRIPT = ROOT / "examples" / "huggingface" / "train.py"
HF_EPOCHS = 40
HF_STEPS = HF_EPOCHS * 4  # 64 samples over 2 ranks, batches of 4, 2 batches per optimizer step
HF_DRAIN_REASON = "tm-e2e huggingface maintenance"


@pytest.fixture(scope="module")
def hf_job(slurm_cluster, job_user):
    """submit(name, **env) -> Run: the template and the Hugging Face example, as JOB_USER submits them."""
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_") or k == "TM_SLURM_BACKEND"}
    env.update(SLURM_CONF=str(slurm_cluster.slurm_conf), TM_PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    runs: list[Run] = []

    def submit(name: str, **tm_env) -> Run:
        workdir = user_dir(name)
        job_env = {**env, **JOB, **{k: str(v) for k, v in tm_env.items()}}
        out = as_user(["sbatch", "--parsable", *sbatch_args(2), f"--job-name={TEST_JOB_PREFIX}{name}",
                       f"--chdir={workdir}", str(TEMPLATE), str(HF_SCRIPT), "--epochs", str(HF_EPOCHS),
                       "--outdir", str(workdir / "hf-out"), "--out", str(workdir / "model.pt")], job_env).stdout
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
        if "DRAIN" in node.flags and node.reason == HF_DRAIN_REASON:
            client.resume(name)


def hf_log_history(run: Run) -> list[dict]:
    """The last checkpoint's trainer_state.json log history, less wall-clock timings."""
    import json
    last = run.workdir / "hf-out" / f"checkpoint-{HF_STEPS}" / "trainer_state.json"
    history = json.loads(last.read_text())["log_history"]
    return [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))} for e in history]


def assert_same_hf(run: Run, reference: Run, *lost: tuple[int, int]) -> None:
    import torch
    ref, got = _losses(reference), _losses(run)
    assert sorted(got) == list(range(1, HF_STEPS + 1)), "every step logged exactly once"
    missing = [(r, s) for s, losses in got.items() for r, x in enumerate(losses) if x is None]
    assert set(missing) <= set(lost), f"losses missing at (rank, step) {missing[:5]}, allowed {sorted(lost)}"
    for r, s in missing:
        got[s][r] = ref[s][r]
    diff = [s for s in ref if ref[s] != got[s]]
    assert not diff, f"losses differ from the uninterrupted run at steps {diff[:5]}"
    assert run.final()["digest"] == reference.final()["digest"]
    checkpoints = sorted(p.name for p in (run.workdir / "hf-out").glob("checkpoint-*"))
    assert checkpoints == sorted(p.name for p in (reference.workdir / "hf-out").glob("checkpoint-*"))
    history = hf_log_history(run)
    assert [e["step"] for e in history if "loss" in e] == list(range(1, HF_STEPS + 1)), "one loss entry a step"
    assert history == hf_log_history(reference), "the Trainer's log history equals the uninterrupted run's"
    mine, theirs = torch.load(run.workdir / "model.pt"), torch.load(reference.workdir / "model.pt")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.fixture(scope="module")
def hf_reference(hf_job, slurm_cluster):
    from trainmover.slurm.client import CliSlurm
    slurm_client = CliSlurm(slurm_conf=str(slurm_cluster.slurm_conf))
    run = hf_job("hf-reference")
    assert run.wait_done(slurm_client, timeout=400) == "COMPLETED", run.slurm_out()[-3000:]
    assert run.final()["steps"] == HF_STEPS
    assert (run.workdir / "model.pt").exists(), "the script's code after Trainer.train ran"
    return run


def test_a_drain_moves_the_huggingface_rank_bit_exactly(hf_job, hf_reference, slurm_client):
    run = hf_job("hf-drain")
    _standby_ready(run)
    assert_runs_as_user(run.job_id, run.env)
    leaver = run.metrics()[-1]["nodes"][1]
    commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={HF_DRAIN_REASON}"],
                 timeout=10, env=run.env)
    wait_for("rank 1 on the standby", lambda: run.metrics()[-1]["nodes"][1] != leaver, timeout=30, interval=0.1)
    assert run.wait_done(slurm_client, timeout=400) == "COMPLETED", run.slurm_out()[-3000:]
    (m,) = run.status()["migrations"]
    assert (m["leaver"], m["trigger"], m["state"]) == (leaver, "drain", "done"), m
    assert m["switch_step"] < HF_STEPS - 10
    assert_same_hf(run, hf_reference)


def test_a_sigkilled_huggingface_rank_is_recovered_bit_exactly(hf_job, hf_reference, slurm_client):
    run = hf_job("hf-kill", TM_INJECT="pace:0.04,die:1:130")
    assert run.wait_done(slurm_client, timeout=400) == "COMPLETED", run.slurm_out()[-3000:]
    (m,) = recoveries(run)
    src = m["state_source"]
    assert m["state"] == "done" and src["tier"] == "snapshot" and src["step"] == 120, src
    assert_same_hf(run, hf_reference, *may_miss(m))


def test_without_the_optimizer_state_the_huggingface_job_differs(hf_job, hf_reference, slurm_client):
    run = hf_job("hf-negative", TM_INJECT="pace:0.04,skip-optimizer-state")
    _standby_ready(run)
    ok = run.cli("migrate", "--job", str(run.job_id), "--node", run.metrics()[-1]["nodes"][1])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert run.wait_done(slurm_client, timeout=400) == "COMPLETED", run.slurm_out()[-3000:]
    (m,) = run.status()["migrations"]
    assert m["state"] == "done"
    ref, got = _losses(hf_reference), _losses(run)
    assert all(got[s] == ref[s] for s in range(1, m["switch_step"] + 1)), "identical before the switch"
    assert any(got[s] != ref[s] for s in range(m["switch_step"] + 1, HF_STEPS + 1)), "diverges after it"
    assert run.final()["digest"] != hf_reference.final()["digest"]
