"""The on-disk layout of checkpoints and their manifest: what the runtime writes and the
controller completes, in one place both import (runtime/protection/checkpoint.py writes and reads the
rank files; the controller writes the manifest once every rank reported its file).

    <run dir>/checkpoints/step-000000200/rank-00001.h5    one per rank (temp file + rename)
    <run dir>/checkpoints/step-000000200/manifest.json    step, ranks, per-rank checksums

A checkpoint counts only with its manifest, written last: a rank file without one (a write
cut by a failure) is never read. The manifest is sealed with the job's key (protocol/files.py):
its per-rank checksums are then the job's own, so a rank file replaced by anyone else fails
its checksum on recovery, and a manifest forged or altered without the key is not read.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from trainmover.protocol import files
from trainmover.errors import MigrationError, ProtocolError

KEEP = 2  # complete checkpoints kept on the shared directory (the controller prunes older ones)
MANIFEST = "manifest.json"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:09d}"


def rank_file(root: Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank-{rank:05d}.h5"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_PURPOSE = "trainmover checkpoint manifest"


def write_manifest(root: Path, step: int, digests: dict[int, str], key: bytes) -> Path:
    """The manifest of a checkpoint every rank wrote: written last, atomically, sealed with `key`."""
    path = step_dir(root, step) / MANIFEST
    body = {"step": step, "ranks": len(digests), "digests": {str(r): d for r, d in sorted(digests.items())}}
    files.write_atomic(path, json.dumps(files.seal(key, _PURPOSE, body), sort_keys=True), fsync=True)
    fsync_dir(path.parent)
    return path


def read_manifest(root: Path, step: int, key: bytes) -> dict[str, Any]:
    path = step_dir(root, step) / MANIFEST
    try:
        meta = files.unseal(key, _PURPOSE, json.loads(files.read_limited(path, 1 << 20)))
    except (OSError, ValueError, ProtocolError) as exc:
        raise MigrationError(f"checkpoint of step {step}: no valid manifest at {path}: {exc}",
                             phase="recover") from exc
    if meta.get("step") != step or not isinstance(meta.get("digests"), dict):
        raise MigrationError(f"checkpoint of step {step}: manifest {path} names step {meta.get('step')}",
                             phase="recover")
    return meta


def complete(root: Path, key: bytes) -> list[int]:
    """Steps of the checkpoints under `root` that have a valid manifest, oldest first."""
    steps = []
    for d in Path(root).glob("step-*"):
        try:
            step = int(d.name.removeprefix("step-"))
            read_manifest(root, step, key)
        except (ValueError, MigrationError):
            continue
        steps.append(step)
    return sorted(steps)


def prune(root: Path, keep: list[int]) -> list[Path]:
    """Delete every checkpoint directory older than the newest of `keep` and not in it."""
    newest = max(keep, default=-1)
    gone = []
    for d in Path(root).glob("step-*"):
        try:
            step = int(d.name.removeprefix("step-"))
        except ValueError:
            continue
        if step < newest and step not in keep:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


