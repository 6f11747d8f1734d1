"""Checkpoints on the job's shared directory: the last tier of recovery.

Every `TM_CHECKPOINT_EVERY` steps each rank copies its full state into host memory at the
step boundary (the only part on the training thread) and a background thread writes it:

    <run dir>/checkpoints/step-000000200/rank-00001.h5    one per rank (temp file + rename)
    <run dir>/checkpoints/step-000000200/manifest.json    step, ranks, per-rank checksums

(the layout and the manifest: protocol/checkpoint_layout.py, which the controller imports too). Each rank reports its file to the controller (`checkpointed`: step, checksum); once every rank
has, the controller writes the manifest (temp + rename, last) and prunes all but the newest
KEEP complete checkpoints. A checkpoint counts only with its manifest: a rank file without one
(a write cut by a failure) is never read.

File layout (HDF5): dataset `manifest` holds `transfer.pack`'s manifest (the same format a
state transfer sends: skeleton, per-tensor key path/shape/dtype, checksum), datasets
`t/<index>` each tensor's bytes. Reading recomputes the checksum and compares it with both the
file's and the manifest's; NaN or Inf is refused, as on the replica path.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import torch

from trainmover.errors import MigrationError
from trainmover.groups.tensors import tensors_of
from trainmover.protocol import files
from trainmover.protocol.checkpoint_layout import fsync_dir, rank_file, read_manifest
from trainmover.runtime.transfer import state as transfer

log = logging.getLogger("trainmover.checkpoint")

def write_rank(root: Path, step: int, rank: int, state: dict) -> dict:
    """Write one rank's state of `step` atomically. Returns {path, digest, bytes, seconds}."""
    import h5py
    t0 = time.perf_counter()
    path = rank_file(root, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True, mode=files.DIR_MODE)
    manifest, tensors, digest = transfer.pack(state)
    tmp = files.temp_path(path)  # a unique 0600 name: never a planted link
    with h5py.File(tmp, "w") as f:
        f.create_dataset("manifest", data=np.frombuffer(manifest, dtype=np.uint8))
        for i, t in enumerate(tensors):
            f.create_dataset(f"t/{i:06d}", data=t.cpu().reshape(-1).view(torch.uint8).numpy())
        f.attrs.update(step=step, rank=rank, digest=digest)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)  # readers never see a half-written file
    fsync_dir(path.parent)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return {"path": str(path), "digest": digest, "bytes": nbytes, "seconds": time.perf_counter() - t0}


def read_rank(root: Path, step: int, rank: int, key: bytes, like: dict | None = None) -> dict:
    """Rank `rank`'s state of the complete checkpoint `step`, verified against the file's and the
    manifest's checksum (the manifest sealed with the job's `key`); NaN or Inf refused. Every
    failure is a MigrationError naming the file."""
    import h5py
    expected = read_manifest(root, step, key)["digests"].get(str(rank))
    path = rank_file(root, step, rank)
    if expected is None:
        raise MigrationError(f"checkpoint of step {step} has no file of rank {rank}", phase="recover", rank=rank)
    try:
        with h5py.File(path, "r") as f:
            meta, into = transfer.unpack(f["manifest"][()].tobytes(), like)
            with torch.no_grad():
                for i, t in enumerate(into):
                    data = torch.from_numpy(f[f"t/{i:06d}"][()])
                    if data.numel() != t.numel() * t.element_size():
                        raise MigrationError(f"{path}: tensor {i} holds {data.numel()} bytes, expected "
                                             f"{t.numel() * t.element_size()}", phase="recover", rank=rank)
                    t.view(-1).view(torch.uint8).copy_(data)
    except (OSError, KeyError) as exc:
        raise MigrationError(f"checkpoint file {path} unreadable: {exc}", phase="recover", rank=rank) from exc
    state, got = transfer.assemble(meta, into)
    if got != expected:
        raise transfer.ChecksumMismatch(f"{path}: checksum {got[:12]} differs from the manifest's {expected[:12]}",
                                        phase="recover", rank=rank)
    bad = transfer.nonfinite(tensors_of(state))
    if bad:
        raise MigrationError(f"{path}: refused: {bad} tensor(s) hold NaN or Inf", phase="recover", rank=rank)
    return state


class Writer:
    """Writes a rank's checkpoints in a background thread, one at a time; `report(result)` is
    called (in that thread) after each file is in place. A checkpoint submitted while the
    previous one is still being written waits for it (bounded: the deadline of `submit`)."""

    def __init__(self, root: Path, rank: int, report):
        self.root, self.rank, self.report = Path(root), rank, report
        self.jobs: queue.Queue = queue.Queue(maxsize=1)
        self.idle = threading.Event()
        self.idle.set()
        self.thread = threading.Thread(target=self._run, name="tm-checkpoint", daemon=True)
        self.thread.start()

    def submit(self, step: int, state: dict, timeout_s: float) -> None:
        """`state` must be a host copy the caller no longer changes (transfer.host_copy)."""
        if not self.idle.wait(timeout_s):
            raise MigrationError(f"checkpoint writer still busy after {timeout_s:.0f}s", phase="checkpoint",
                                 rank=self.rank)
        self.idle.clear()
        self.jobs.put((step, state))

    def wait(self, timeout_s: float) -> bool:
        return self.idle.wait(timeout_s)

    def _run(self) -> None:
        while True:
            step, state = self.jobs.get()
            try:
                result = write_rank(self.root, step, self.rank, state)
                self.report({"step": step, **result})
            except Exception as exc:  # noqa: BLE001 - a failed write leaves this checkpoint incomplete
                log.error("checkpoint of step %d, rank %d failed: %s", step, self.rank, exc)
            finally:
                self.idle.set()
