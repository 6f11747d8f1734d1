"""Issue 37, round two: another user who can rename `runs/` in a shared, others-writable submit
directory mid-job (docs/security.md, "The job's state on the shared filesystem"). Each test
makes the swap for real and shows the job reading its own directory, with a negative control
showing what the path alone would have given."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from trainmover.controller.durable import journal, records
from trainmover.controller.succession.keeper import Keeper
from trainmover.protocol import files

KEY = b"k" * 32
START = {"kind": "start", "job_id": 7, "world_size": 2, "ranks_per_node": 1, "batch_host": "k",
         "rank_node": {"0": "a", "1": "b"}}
FORGED_OUTCOME = {"outcome": {"ok": True, "message": "forged: training finished"}}


def _job(tmp_path: Path) -> tuple[Path, Path]:
    """A submit directory others can write (a shared project directory), the job's run directory
    in it, held as the keeper, the supervisor and the controller hold it."""
    submit = tmp_path / "project"
    submit.mkdir()
    os.chmod(submit, 0o777)
    root = files.private_dir(submit / "runs" / "7")
    return root, files.held_dir(root)


def _swap(root: Path, journal_lines: list[str] | None = None) -> None:
    """What another user does: rename `runs/` away and put their own in its place, with a
    status.json that says the job ended well and, if given, a journal."""
    runs = root.parent
    runs.rename(runs.with_name("runs.moved"))
    forged = runs / root.name
    forged.mkdir(parents=True)
    (forged / "status.json").write_text(json.dumps(FORGED_OUTCOME))
    if journal_lines is not None:
        (forged / "journal.jsonl").write_text("".join(journal_lines))


def test_the_keeper_reads_its_own_outcome_after_runs_is_swapped_mid_job(tmp_path):
    root, at = _job(tmp_path)
    k = Keeper.__new__(Keeper)
    k.root, k.at, k.key = root, at, KEY
    assert k._outcome() is None  # running: no outcome yet
    _swap(root)
    # negative control: the path now leads to the other user's file, which says "ok"
    assert json.loads((root / "status.json").read_text())["outcome"]["ok"] is True
    assert k._outcome() is None  # through the held directory: still running, nothing forged believed
    records.write_json(at / "status.json", {"outcome": records.sealed_outcome(KEY, False, "user code raised")})
    assert k._outcome() == 1   # the controller's real outcome, written through its held directory


def test_an_outcome_or_journal_not_sealed_with_the_jobs_key_is_never_believed(tmp_path):
    """Even read by the path (a successor that started after the swap would find the files
    there): neither the forged outcome nor a forged `end` record counts."""
    root, _ = _job(tmp_path)
    forged_end = [json.dumps({"v": 2, "seq": 1, "t": 0.0, **START}) + "\n",
                  json.dumps({"v": 2, "seq": 2, "t": 0.0, "kind": "end", "ok": True, "message": "forged"}) + "\n"]
    _swap(root, forged_end)
    # negative control: the unkeyed replay believes the forged end
    assert journal.fold(forged_end).ended == {"ok": True, "message": "forged"}
    assert records.read_outcome(root / "status.json", KEY) is None
    assert journal.ended(root / "journal.jsonl", KEY) is None
    with pytest.raises(journal.JournalError, match="MAC"):
        journal.read(root / "journal.jsonl", KEY)
    # and a record sealed with another job's key is refused the same way
    other = journal.Journal(tmp_path / "other.jsonl", key=b"o" * 32)
    other.write(1.0, [START, {"kind": "end", "ok": True, "message": "other job"}])
    other.close()
    assert journal.ended(tmp_path / "other.jsonl", KEY) is None


def test_the_supervisor_and_a_successor_read_the_journal_of_the_held_directory(tmp_path):
    root, at = _job(tmp_path)
    j = journal.Journal(at / "journal.jsonl", key=KEY)
    j.write(1.0, [START])
    _swap(root, [json.dumps({"v": 2, "seq": 1, "t": 0.0, "kind": "end", "ok": True, "message": "x"}) + "\n"])
    j.write(2.0, [{"kind": "end", "ok": False, "message": "the real end"}])  # into the held directory
    j.close()
    assert journal.ended(at / "journal.jsonl", KEY) == {"ok": False, "message": "the real end"}
    assert journal.read(at / "journal.jsonl", KEY).job_id == 7
    assert not (root / "status.json").read_text().count("the real end")  # nothing of ours went to theirs


def test_a_torn_tail_is_never_trimmed_through_a_link_or_a_fifo(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("line\nhalf a line")
    run = files.private_dir(tmp_path / "runs" / "7")
    (run / "metrics.jsonl").symlink_to(victim)
    # negative control: the old open(path, "r+b") goes through the link to the victim's file
    assert os.path.realpath(run / "metrics.jsonl") == str(victim)
    with pytest.raises(OSError):
        records.trim_torn(run / "metrics.jsonl")
    with pytest.raises(OSError):
        journal.Journal(run / "metrics.jsonl", key=KEY)
    assert victim.read_text() == "line\nhalf a line"  # untouched
    os.mkfifo(run / "timeline.jsonl")
    with pytest.raises(files.UnsafePath, match="not a regular file"):
        records.trim_torn(run / "timeline.jsonl")
    (run / "own.jsonl").write_text('{"step": 4}\n{"step": 5, "lo')
    assert records.trim_torn(run / "own.jsonl") == 4 and (run / "own.jsonl").read_text() == '{"step": 4}\n'


def test_a_directory_changed_between_the_check_and_the_hold_is_refused(tmp_path):
    root = files.private_dir(tmp_path / "runs" / "7")
    os.chmod(root, 0o777)
    with pytest.raises(files.UnsafePath, match="not the job.s user.s own directory"):
        files.held_dir(root)
    os.rmdir(root)
    root.symlink_to(tmp_path)
    with pytest.raises(OSError):
        files.held_dir(root)


def _rank_spec(root: Path, at: Path):
    """What the controller hands a rank: the plain paths of the job's files and the identity of
    the directory it made and holds (executor._spec)."""
    from trainmover.protocol.worker_spec import WorkerSpec
    return WorkerSpec(role="worker", ranks=(1,), world_size=2, node="b", node_addr="127.0.0.2",
                      controller=("127.0.0.1", 1), store=("127.0.0.1", 2), secret_file=str(root / "secret"),
                      controller_file=str(root / "controller.json"), recording_dir=str(root / "recordings"),
                      checkpoint_dir=str(root / "checkpoints"), run_dir_id=files.dir_identity(at))


def test_a_rank_writes_its_checkpoints_into_the_held_directory_after_runs_is_swapped(tmp_path):
    """A rank that started before the swap holds the controller's directory: its checkpoints and
    recordings, and the controller.json and key it reads, stay the job's. Negative control: the
    plain path the rank is handed leads into the other user's directory after the swap."""
    root, at = _job(tmp_path)
    (at / "secret").write_bytes(KEY)
    spec = _rank_spec(root, at).held()
    assert spec.secret_file != str(root / "secret") and spec.checkpoint_dir.endswith("/checkpoints")
    _swap(root)
    (root / "secret").write_bytes(b"x" * 32)  # theirs
    Path(spec.checkpoint_dir).mkdir()
    (Path(spec.checkpoint_dir) / "step-10.pt").write_bytes(b"state")
    assert Path(spec.secret_file).read_bytes() == KEY
    moved = tmp_path / "project" / "runs.moved" / "7"
    assert (moved / "checkpoints" / "step-10.pt").read_bytes() == b"state"  # in the job's own directory
    assert not (root / "checkpoints").exists()
    # negative control: the plain path the rank was handed is the other user's directory now
    assert Path(_rank_spec(root, at).checkpoint_dir).parent == root and (root / "status.json").exists()
    assert files.dir_identity(root) != files.dir_identity(at)


def test_a_rank_started_after_runs_is_swapped_refuses_the_directory(tmp_path):
    """A rank launched after the swap (a standby, a joiner) finds another directory at the path:
    refused, naming the path and why, before it reads a key or writes a file. Negative control:
    without the identity (an older launch) the same spec is taken as it is."""
    root, at = _job(tmp_path)
    spec = _rank_spec(root, at)
    _swap(root)
    os.chmod(root, 0o700)  # an owner check alone would pass: the other "user" is us in a unit test
    with pytest.raises(files.UnsafePath, match="not the run directory this job's controller made.*renamed and "
                                                "replaced"):
        spec.held()
    assert sorted(os.listdir(root)) == ["status.json"]  # nothing written there
    unchecked = dataclasses.replace(spec, run_dir_id=())
    assert unchecked.held() == unchecked and Path(unchecked.secret_file).parent == root


def test_a_rank_spec_carries_the_run_directorys_identity_through_its_json(tmp_path):
    from trainmover.protocol.worker_spec import WorkerSpec
    root, at = _job(tmp_path)
    spec = _rank_spec(root, at)
    back = WorkerSpec.from_env({"TM_WORKER_SPEC": spec.to_env()})
    assert back.run_dir_id == files.dir_identity(root) and back == spec
