"""The Hugging Face Trainer under script mode (trainmover/integrations/huggingface.py).

examples/huggingface/train.py (train_plain.py with TrainMoverCallback: 2 lines) is exact under
`trainmover check-workload` (2 ranks over gloo: a GPT-2 from a config, dropout, AdamW, cosine
warm-up, gradient accumulation, clipping, evaluation and a checkpoint each epoch): migration
mid-epoch, rollback, restarts mid-epoch and at an epoch's end, and a joiner issues the stayers'
collectives. A negative control whose callback leaves the LR scheduler out of the state and
makes the step's token count while re-entering fails both checks; the example runs under plain torchrun
unchanged, with the plain script's losses (the Trainer's log history) and final model.
"""
from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "examples" / "huggingface"
EPOCHS = "16"  # 4 optimizer steps an epoch (64 samples, 2 ranks, batches of 4, 2 accumulated): 64 steps


def _code_lines(path: Path) -> list[str]:
    return re.sub(r'\A"""(.|\n)*?"""\n', "", path.read_text()).splitlines()


def test_the_huggingface_example_adds_at_most_five_lines():
    diff = [ln for ln in difflib.unified_diff(_code_lines(HF / "train_plain.py"), _code_lines(HF / "train.py"),
                                               lineterm="", n=0)
            if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    removed, added = sum(ln.startswith("-") for ln in diff), sum(ln.startswith("+") for ln in diff)
    assert added <= 5 and removed <= 1, diff
    assert any("TrainMoverCallback()" in ln for ln in diff)


def _check(script: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmover.cli", "check-workload", "--steps", "8", str(script),
                           *args], capture_output=True, text=True, timeout=900, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})


def test_the_checker_finds_the_huggingface_example_exact(tmp_path):
    out = _check(HF / "train.py", tmp_path, "--epochs", EPOCHS, "--outdir", str(tmp_path / "out"))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "migration    ok" in out.stdout and "a migration would be exact" in out.stdout, out.stdout
    assert "collectives  ok" in out.stdout, out.stdout  # the switch is mid-epoch: the deferred token count


FORGETFUL = '''
class Forgetful(TrainMoverCallback):
    """Negative control: the LR scheduler left out (a rank taking over starts its warm-up again),
    and the step's token count made while re-entering (in the re-entry's sandbox), as the
    integration once did: a joiner then skips the stayers' gather of its first step."""
    def state(self):
        out = super().state()
        out["huggingface"]["scheduler"] = None
        return out

    def _num_items(self, original, batch_samples, device):
        return original(batch_samples, device)
'''


def test_the_checker_fails_a_callback_that_leaves_the_scheduler_out_or_gathers_while_reentering(tmp_path):
    """Two mistakes in one run (a check costs ~50 s of 2 cores), each named by its own check:
    the scheduler left out by `migration`, the gather made in the sandbox by `collectives`."""
    text = (HF / "train.py").read_text()
    text = text.replace("\n\nclass Tokens", FORGETFUL + "\n\nclass Tokens").replace("TrainMoverCallback()]",
                                                                                   "Forgetful()]")
    assert "Forgetful()]" in text
    bad = tmp_path / "forgetful.py"
    bad.write_text(text)
    out = _check(bad, tmp_path, "--epochs", EPOCHS, "--outdir", str(tmp_path / "out"))
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    assert "migration    FAIL" in out.stdout and "a migration would NOT be exact" in out.stdout, out.stdout
    assert re.search(r"collectives  FAIL at step \d+ \(the 1st after the switch after step \d+\) the joiner of rank \d "
                     r"issued \d+ collective\(s\) in group 'world' where the uninterrupted rank issued \d+",
                     out.stdout), out.stdout


def _torchrun(script: Path, tmp_path: Path, name: str) -> tuple[list[dict], dict]:
    out = tmp_path / f"{name}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), "--epochs", "2", "--outdir", str(tmp_path / f"out-{name}"), "--out", str(out)],
                          capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = json.loads(Path(str(out) + ".log.json").read_text())
    timeless = [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))} for e in history]
    return timeless, torch.load(out)


def test_the_huggingface_example_runs_under_plain_torchrun_unchanged(tmp_path):
    plain_log, plain_model = _torchrun(HF / "train_plain.py", tmp_path, "plain")
    tm_log, tm_model = _torchrun(HF / "train.py", tmp_path, "tm")
    assert sum("loss" in e for e in plain_log) == 8 and tm_log == plain_log  # 2 epochs of 4 optimizer steps
    assert sum("eval_loss" in e for e in plain_log) == 2
    assert all(torch.equal(plain_model[k], tm_model[k]) for k in plain_model)
    assert sorted(p.name for p in (tmp_path / "out-tm").iterdir()) == ["checkpoint-4", "checkpoint-8"]
