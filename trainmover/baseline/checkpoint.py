"""The baseline's checkpoint on shared storage.

Layout under `<run dir>/ckpt/`:
    step-00000120/model_optim.pt   model + optimizer, written by rank 0 (data-parallel
                                   replicas hold the same values, as Megatron's DP rank 0 does)
    step-00000120/rank<r>.pt       each rank's RNG state and data cursor
    latest                         name of the last committed step directory

A checkpoint is written into `step-<N>.partial/` and renamed once every rank has written
its part, then `latest` is replaced atomically: a job killed half-way through a save
restarts from the previous committed checkpoint, never from a torn one.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SHARED = "model_optim.pt"


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}.partial"


def write_part(root: Path, step: int, rank: int, shared: dict | None, own: dict) -> int:
    """Write this rank's part of checkpoint `step` (rank 0 also writes `shared`); returns bytes
    written. The caller has made `partial_dir` exist (rank 0, before a barrier)."""
    d = partial_dir(root, step)
    written = 0
    if shared is not None:
        torch.save(shared, d / SHARED)
        written += (d / SHARED).stat().st_size
    torch.save(own, d / _rank_file(rank))
    written += (d / _rank_file(rank)).stat().st_size
    return written


def commit(root: Path, step: int, keep: int = 1) -> Path:
    """Make checkpoint `step` the latest (rank 0, after every rank wrote its part), then delete
    all but the `keep` newest committed ones (a 1B model's checkpoint is ~15 GB)."""
    final = step_dir(root, step)
    os.replace(partial_dir(root, step), final)
    tmp = root / "latest.tmp"
    tmp.write_text(final.name)
    os.replace(tmp, root / "latest")
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".partial"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(root: Path) -> Path | None:
    try:
        name = (root / "latest").read_text().strip()
    except FileNotFoundError:
        return None
    return root / name


@dataclass
class Loaded:
    shared: dict
    own: dict
    bytes: int
    seconds: float


def load(ckpt: Path, rank: int, device: torch.device) -> Loaded:
    """Read the shared part and this rank's part of checkpoint directory `ckpt`."""
    t0 = time.perf_counter()
    # weights_only: a checkpoint is data; loading it must not run code
    shared = torch.load(ckpt / SHARED, map_location=device, weights_only=True)
    own = torch.load(ckpt / _rank_file(rank), map_location="cpu", weights_only=True)
    size = (ckpt / SHARED).stat().st_size + (ckpt / _rank_file(rank)).stat().st_size
    return Loaded(shared, own, size, time.perf_counter() - t0)
