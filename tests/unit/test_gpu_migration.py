"""GPU: 3 data-parallel workers + 1 standby on a 4-GPU machine, NCCL through cuda/libtmdelta;
each worker position migrated in turn, and the run must equal an uninterrupted one bit for bit.
Skipped without 4 GPUs (CI has none; run on a GPU machine with `TM_TEST_GPU=1 pytest -m gpu`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")]

ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Phase 1 takes ~2 s (~20 steps of this model on an H200): 60 steps leave room for the switch,
# the release and steps after it (30 did not, on 2026-11-21).
JOB = ["--preset", "125m", "--steps", "60", "--gpus", "4"]


def bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_planned_migration.py"), *JOB, *args],
                          env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run for the three positions (the same job: where the leaver sits does
    not change it), so that the session fits 5 minutes on 4 H100s."""
    work = tmp_path_factory.mktemp("ref") / "work"
    out = bench("--ref-only", "--work", str(work), "--deadline-s", "120", timeout=140)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return work / "ref" / "raw.json"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("leaver", ["gpu0", "gpu1", "gpu2"])
def test_each_worker_position_migrates_bit_exactly(leaver, reference, tmp_path):
    out = bench("--migrate-at", "10", "--leaver", leaver, "--fault", "migrate", "--ref", str(reference),
                "--out", str(tmp_path), "--work", str(tmp_path / "work"), "--deadline-s", "200", timeout=230)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / f"gpu-planned-125m-{leaver}.json").read_text())
    m = result["metrics"]
    assert m["bit_exact"] and m["losses_equal"] and m["digest_equal"], m
    assert result["migrations"][0]["state"] == "done" and result["migrations"][0]["leaver"] == leaver
    assert m["comm_inits_per_stayer"] == [1, 1]        # only the world communicator is replaced
    # Phase 1 takes nothing from torch's allocator: no tensor of it stays alive on a stayer
    # (requested bytes, not memory_allocated: runtime/worker.py `memory` says why), and no
    # segment is reserved for it (its pre-connect uses the process's one buffer, groups/nccl/backend.py)
    assert m["stayer_extra_alloc_bytes"] <= 0, m
    assert m["stayer_extra_reserved_bytes"] <= 0, m
