"""GPU: a compiled model's warm joiner against a cold one, through bench/gpu_warm_joiner.py
(1 worker + 1 standby suffice). Skipped without 2 GPUs (CI has none; `TM_TEST_GPU=1 pytest -m gpu` on a
GPU machine, after scripts/build_cuda.sh)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.timeout(600)
def test_warm_joiner_first_step_is_near_steady_and_a_cold_one_is_not(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_warm_joiner.py"), "--preset", "small",
                          "--gpus", "2", "--out", str(tmp_path), "--work", str(tmp_path / "work"),
                          "--deadline-s", "560",
                          # 4 GPUs: the warm and the cold job at once on GPUs 0-1 and 2-3 (the GPU
                          # session's longest test, 139 s one after the other on 4x H100)
                          *(["--side-by-side"] if torch.cuda.device_count() >= 4 else [])],
                         env={**os.environ}, capture_output=True, text=True, timeout=590)
    result = json.loads((tmp_path / "warm-joiner-gpu-small.json").read_text())
    assert out.returncode == 0 and result["complete"], (result["errors"], out.stdout[-3000:], out.stderr[-3000:])
    m = result["metrics"]
    assert m["standby_replay"] == "done" and m["recording_bytes"] > 0
    # a cold joiner compiles at its first real step; a warm one did so in its shadow iterations
    assert m["cold_first_step_ratio"] > 5 * m["first_step_ratio"], m
