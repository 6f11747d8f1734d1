"""controller/durable/handover.py: what a controller that hands over on purpose leaves its successor
(the job's record, the reservation's nodes), and when the successor must ask Slurm instead."""
from __future__ import annotations

import json
import os
import time

from trainmover.controller.durable import handover, journal
from trainmover.protocol import channel
from trainmover.slurm.model import JobInfo


JOB = JobInfo(job_id=7, state="RUNNING", nodes=("keep1", "train2", "spare1"), batch_host="keep1", restart_count=0,
              work_dir="/home/u/run", partition="train", num_nodes=3, nodelist="keep1,spare1,train2", name="tm")


def _run_dir(tmp_path, claims=()):
    root = tmp_path / "run"
    root.mkdir(mode=0o700)
    key = channel.write_secret(str(root / "secret"))
    first = journal.Journal(root / "journal.jsonl", key=key, attempt=0)
    first.write(time.time(), [{"kind": "start", "job_id": 7, "world_size": 1, "ranks_per_node": 1,
                               "batch_host": "keep1", "rank_node": {"0": "train2"}}])
    first.close()
    for attempt in claims:  # controllers that took over, in order
        j = journal.Journal(root / "journal.jsonl", key=key, seq=journal.read(root / "journal.jsonl", key).seq,
                            attempt=attempt)
        j.claim(time.time())
        j.close()
    return root, key


def test_the_successor_takes_the_record_once_and_asks_slurm_nothing_for_it(tmp_path):
    root, key = _run_dir(tmp_path, claims=[1])
    handover.leave(root, key, attempt=1, job=JOB, pool_nodes=["spare1", "spare2"])
    assert oct((root / handover.NAME).stat().st_mode & 0o777) == "0o600"
    got = handover.for_successor(root, 7)
    assert got is not None and got.job == JOB and got.pool_nodes == ["spare1", "spare2"]
    assert not (root / handover.NAME).exists()  # taken: a later takeover (after a crash) reads Slurm
    assert handover.for_successor(root, 7) is None


def test_a_record_of_an_earlier_controller_than_the_last_claim_is_not_used(tmp_path):
    """Attempt 1 handed over, attempt 2 claimed (and may have resized the job) then died: the
    record is stale for attempt 3."""
    root, key = _run_dir(tmp_path, claims=[1, 2])
    handover.leave(root, key, attempt=1, job=JOB, pool_nodes=None)
    assert handover.for_successor(root, 7) is None
    assert not (root / handover.NAME).exists()


def test_no_record_while_a_resize_was_under_way_and_the_first_controllers_record_counts(tmp_path):
    root, key = _run_dir(tmp_path)
    handover.leave(root, key, attempt=0, job=None, pool_nodes=["spare1"])  # resizer busy: nothing written
    assert not (root / handover.NAME).exists()
    handover.leave(root, key, attempt=0, job=JOB, pool_nodes=None)
    got = handover.for_successor(root, 7)
    assert got is not None and got.pool_nodes is None and got.job.nodes == JOB.nodes


def test_a_forged_changed_or_foreign_record_is_ignored(tmp_path):
    root, key = _run_dir(tmp_path)
    handover.leave(root, os.urandom(32), attempt=0, job=JOB, pool_nodes=None)  # not the job's key
    assert handover.for_successor(root, 7) is None
    handover.leave(root, key, attempt=0, job=JOB, pool_nodes=None)
    rec = json.loads((root / handover.NAME).read_text())
    rec["job"]["nodes"] = ["keep1", "train2"]  # a node dropped: the MAC no longer matches
    (root / handover.NAME).write_text(json.dumps(rec))
    assert handover.for_successor(root, 7) is None
    handover.leave(root, key, attempt=0, job=JOB, pool_nodes=None)
    assert handover.for_successor(root, 8) is None  # another job's
    (root / handover.NAME).write_text("{not json")
    assert handover.for_successor(root, 7) is None and not (root / handover.NAME).exists()
