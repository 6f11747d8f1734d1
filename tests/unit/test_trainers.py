"""Trainers that run the loop themselves, under script mode (trainmover/integrations).

Lightning: examples/lightning/train.py (train_plain.py with TrainMoverCallback: 2 lines), with a
validation loader, loader workers and 16-mixed added, is exact under `trainmover check-workload`
(2 ranks over gloo: DDP, gradient accumulation, clipping, OneCycle, dropout, a shuffling loader,
a CSVLogger, ModelCheckpoint); a negative
control whose callback leaves the loader's position out of the state fails; the example runs
under plain torchrun unchanged, with the plain script's losses and final model.
"""
from __future__ import annotations

import csv
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LIGHTNING = ROOT / "examples" / "lightning"


def _code_lines(path: Path) -> list[str]:
    return re.sub(r'\A"""(.|\n)*?"""\n', "", path.read_text()).splitlines()


def test_the_lightning_example_adds_at_most_five_lines():
    diff = [ln for ln in difflib.unified_diff(_code_lines(LIGHTNING / "train_plain.py"),
                                               _code_lines(LIGHTNING / "train.py"), lineterm="", n=0)
            if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    removed, added = sum(ln.startswith("-") for ln in diff), sum(ln.startswith("+") for ln in diff)
    assert added <= 5 and removed <= 1, diff
    assert any("TrainMoverCallback()" in ln for ln in diff)


def _check(script: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmover.cli", "check-workload", "--steps", "8", str(script),
                           *args], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


FORGETFUL = '''
class Forgetful(TrainMoverCallback):
    """Negative control: the loader's position left out (a rank taking over starts the epoch over)."""
    def _data_position(self):
        return {**super()._data_position(), "fetched": 0, "done": False}
'''


def test_the_checker_fails_a_callback_that_leaves_the_loader_position_out(tmp_path):
    text = (LIGHTNING / "train.py").read_text()
    text = text.replace("\n\ndef make_data", FORGETFUL + "\n\ndef make_data").replace("TrainMoverCallback()]",
                                                                                      "Forgetful()]")
    bad = tmp_path / "forgetful.py"
    bad.write_text(text)
    out = _check(bad, tmp_path, "--epochs", "8")
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    assert "migration    FAIL" in out.stdout and "a migration would NOT be exact" in out.stdout, out.stdout


def _torchrun(script: Path, tmp_path: Path, name: str) -> tuple[list[dict], dict]:
    out, logdir = tmp_path / f"{name}.pt", tmp_path / f"logs-{name}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), "--epochs", "2", "--logdir", str(logdir), "--out", str(out)],
                          capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = logdir.glob("lightning_logs/version_*/metrics.csv")
    with open(metrics) as f:
        return list(csv.DictReader(f)), torch.load(out)


def test_the_lightning_example_runs_under_plain_torchrun_unchanged(tmp_path):
    plain_rows, plain_model = _torchrun(LIGHTNING / "train_plain.py", tmp_path, "plain")
    tm_rows, tm_model = _torchrun(LIGHTNING / "train.py", tmp_path, "tm")
    assert len(plain_rows) == 16 and tm_rows == plain_rows  # 2 epochs of 8 optimizer steps, one row each
    assert all(torch.equal(plain_model[k], tm_model[k]) for k in plain_model)


def test_the_checker_finds_a_variant_with_validation_workers_and_a_scaler_exact(tmp_path):
    """The example with a validation loader (sync_dist logging), 2 loader workers and 16-mixed
    (a GradScaler in the precision plugin): a superset of the example, so the example's own check
    is this one (a check costs ~45 s of 2 cores; the example itself moves for real in
    tests/e2e/test_trainers.py)."""
    text = (LIGHTNING / "train.py").read_text()
    text = text.replace('''        self.log("train_loss", loss)
        return loss
''', '''        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)
''')
    text = text.replace("shuffle=True)", "shuffle=True, num_workers=2)\n    val = DataLoader(make_data(args.seed + 1, 64), "
                        "batch_size=16)").replace("trainer.fit(model, loader)", "trainer.fit(model, loader, val)")
    text = text.replace('precision="bf16-mixed"', 'precision="16-mixed"')
    assert text.count("val") >= 4 and "16-mixed" in text
    variant = tmp_path / "variant.py"
    variant.write_text(text)
    out = _check(variant, tmp_path, "--epochs", "8")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "migration    ok" in out.stdout and "a migration would be exact" in out.stdout, out.stdout
