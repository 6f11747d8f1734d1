"""The snapshot exchange over a real gloo group (threads of one process stand for ranks on
three nodes) and the checkpoint files: verified copies, a corrupted copy or file detected."""
import datetime
import threading

import pytest
import torch

from trainmover.errors import MigrationError
from trainmover.groups.tensors import digest_tensors, tensors_of
from trainmover.protocol import checkpoint_layout as layout
from trainmover.runtime.protection import checkpoint
from trainmover.runtime.transfer import state as transfer
from trainmover.runtime.protection.snapshot import Snapshots, holder_of, ward_of
from tests.unit.gloo_world import gloo_groups, serve_store

KEY = b"k" * 32  # the job's key (protocol/files.py seals the manifest with it)

TIMEOUT = datetime.timedelta(seconds=20)
WORLD = 3


def state(rank: int, step: int) -> dict:
    torch.manual_seed(rank * 100 + step)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"workload": {"model": model.state_dict(), "optimizer": opt.state_dict(), "data": {"cursor": step}},
            "rng": {"torch": torch.get_rng_state()}, "step": step}


def same(a: dict, b: dict) -> bool:
    return digest_tensors(tensors_of(a)) == digest_tensors(tensors_of(b))


def world_groups():
    master, port = serve_store(TIMEOUT)
    groups = gloo_groups(port, "snap/", WORLD, TIMEOUT)
    assert all(groups), "gloo group not built within 30 s"
    return master, groups


def test_holders_are_the_same_local_index_on_the_next_node():
    assert [holder_of(r, 6, 2) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [ward_of(holder_of(r, 6, 2), 6, 2) for r in range(6)] == list(range(6))
    assert holder_of(1, 2, 2) == 1  # one node: nobody else to hold a copy


@pytest.mark.gloo_threads
@pytest.mark.parametrize("corrupt", [False, True])
def test_every_rank_holds_its_wards_verified_copy_and_keeps_two_versions(corrupt):
    _master, groups = world_groups()
    snaps = [Snapshots(r, WORLD, 1, timeout_s=20, corrupt=corrupt and r == 0) for r in range(WORLD)]
    for step in (50, 100, 150):
        states = {r: state(r, step) for r in range(WORLD)}
        for r in range(WORLD):  # the same step boundary on every rank
            snaps[r].take(step, states[r], groups[r])
        for s in snaps:
            s.wait(30)
            assert not any(t.is_alive() for t in s.threads)
        # rank 0's first copy is spoilt on the wire (corrupt): the checksum catches it, it is sent again
        assert snaps[0].last["attempts"] == (2 if corrupt and step == 50 else 1)
        for r in range(WORLD):
            held = snaps[holder_of(r, WORLD, 1)].held_state(r, step)
            assert same(held, states[r]) and held["step"] == step
            assert same(snaps[r].own_state(step), states[r])
    assert snaps[1].report() == {"own": [100, 150], "held": {"0": [100, 150]}}
    # the copies are the state of their step, not the tensors that training goes on updating
    live = states[0]
    kept = snaps[0].own_state(150)
    with torch.no_grad():
        for t in tensors_of(live):
            if t.is_floating_point():
                t.add_(1.0)
    assert not same(kept, live)
    snaps[2].rolled_back(100)
    assert snaps[2].report() == {"own": [100], "held": {"1": [100]}}


@pytest.mark.gloo_threads
def test_a_copy_from_a_dead_ward_is_not_kept_and_the_version_before_stays():
    _master, groups = world_groups()
    snaps = [Snapshots(r, WORLD, 1, timeout_s=20) for r in range(WORLD)]
    for r in range(WORLD):
        snaps[r].take(50, state(r, 50), groups[r])
    [s.wait(30) for s in snaps]
    # a copy whose bytes are spoilt on every attempt is refused, never kept
    for r in (0, 1):
        snaps[r].take(100, state(r, 100), groups[r])
    bad = state(2, 100)
    bad["workload"]["model"]["weight"][0, 0] = float("nan")
    snaps[2].take(100, bad, groups[2])
    [s.wait(30) for s in snaps]
    assert snaps[0].report()["held"] == {"2": [50]}  # NaN refused: the version before stays
    assert snaps[1].report()["held"] == {"0": [50, 100]}


def test_a_checkpoint_is_written_atomically_read_back_verified_and_pruned(tmp_path):
    root = tmp_path / "checkpoints"
    digests = {}
    for step in (100, 200, 300):
        for rank in range(2):
            s = state(rank, step)
            s["workload"]["half"] = torch.arange(6, dtype=torch.bfloat16)  # h5py has no bfloat16: bytes are kept
            out = checkpoint.write_rank(root, step, rank, s)
            digests[rank] = out["digest"]
            assert out["bytes"] > 0 and not list(root.glob("**/.*.tmp"))
        assert layout.complete(root, KEY) == [x for x in (100, 200) if x < step]
        layout.write_manifest(root, step, digests, KEY)
        layout.prune(root, layout.complete(root, KEY)[-2:])
    assert layout.complete(root, KEY) == [200, 300] and not layout.step_dir(root, 100).exists()
    got = checkpoint.read_rank(root, 300, 1, KEY)
    assert same(got, {**state(1, 300), "workload": {**state(1, 300)["workload"],
                                                     "half": torch.arange(6, dtype=torch.bfloat16)}})
    assert got["step"] == 300 and got["workload"]["half"].dtype == torch.bfloat16


def test_a_corrupted_or_missing_checkpoint_file_and_nan_are_refused(tmp_path):
    import h5py
    root = tmp_path / "checkpoints"
    out = checkpoint.write_rank(root, 100, 0, state(0, 100))
    layout.write_manifest(root, 100, {0: out["digest"], 1: "x"}, KEY)
    with h5py.File(out["path"], "r+") as f:  # one flipped byte in one tensor
        f["t/000000"][0] ^= 0xFF
    with pytest.raises(transfer.ChecksumMismatch):
        checkpoint.read_rank(root, 100, 0, KEY)
    with pytest.raises(MigrationError, match="unreadable"):
        checkpoint.read_rank(root, 100, 1, KEY)
    with pytest.raises(MigrationError, match="no valid manifest"):
        checkpoint.read_rank(root, 200, 0, KEY)
    bad = state(0, 300)
    bad["workload"]["model"]["bias"][0] = float("inf")
    out = checkpoint.write_rank(root, 300, 0, bad)
    layout.write_manifest(root, 300, {0: out["digest"]}, KEY)
    with pytest.raises(MigrationError, match="NaN or Inf"):
        checkpoint.read_rank(root, 300, 0, KEY)


def test_a_manifest_not_sealed_with_the_jobs_key_is_not_read(tmp_path):
    """Someone who can write the checkpoint directory replaces a rank file and writes a manifest
    with its checksum: without the job's key the manifest is refused, the checkpoint incomplete."""
    import json
    root = tmp_path / "checkpoints"
    real = checkpoint.write_rank(root, 100, 0, state(0, 100))
    layout.write_manifest(root, 100, {0: real["digest"]}, KEY)
    assert layout.complete(root, KEY) == [100]
    assert layout.complete(root, b"x" * 32) == []                  # another key: not this job's
    forged = checkpoint.write_rank(tmp_path / "other", 100, 0, state(1, 100))
    path = layout.step_dir(root, 100) / layout.MANIFEST
    meta = json.loads(path.read_text())
    meta["digests"]["0"] = forged["digest"]                         # the planted file's checksum
    path.write_text(json.dumps(meta))
    with pytest.raises(MigrationError, match="MAC does not match"):
        checkpoint.read_rank(root, 100, 0, KEY)
    path.write_text(json.dumps({"step": 100, "ranks": 1, "digests": {"0": forged["digest"]}}))  # unsealed
    with pytest.raises(MigrationError, match="no MAC"):
        checkpoint.read_rank(root, 100, 0, KEY)
    assert layout.complete(root, KEY) == []
    assert oct(real_mode := (root / "step-000000100" / "rank-00000.h5").stat().st_mode & 0o777) == "0o600", real_mode


def test_the_writer_reports_each_file_off_the_calling_thread(tmp_path):
    seen, done = [], threading.Event()

    def report(result):
        seen.append((result["step"], threading.current_thread().name))
        done.set()
    w = checkpoint.Writer(tmp_path, 3, report)
    w.submit(50, transfer.host_copy(state(3, 50)), timeout_s=10)
    assert done.wait(30) and w.wait(30)
    assert seen == [(50, "tm-checkpoint")] and checkpoint.rank_file(tmp_path, 50, 3).exists()
