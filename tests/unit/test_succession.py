"""The controller's succession (controller/succession.py, pure, a fake clock) and the journal as
its lease (controller/journal.py: a successor's claim demotes the old controller)."""
from __future__ import annotations

import json

import pytest

from trainmover.controller import journal
from trainmover.controller.journal import Journal, Superseded, fold
from trainmover.controller.succession import IllegalSuccessionTransition, Primary, Promote, State, may_promote

KEY = b"k" * 32  # the job's key: the journal and the outcome are sealed with it


def epoch(n):
    """A state record that sets the policy's epoch (controller/state.py)."""
    return {"kind": "state", "ops": [["set", ["epoch"], n]]}


def primary(now=100.0, deadline=2.0):
    return Primary("train1", 0, now, deadline_s=deadline, start_deadline_s=120.0)


# --- promotion ------------------------------------------------------------------------------
def test_a_hand_over_promotes_at_once_without_fencing():
    p = primary()
    p.heard(101.0)
    assert p.moving(101.5, "train1 leaves the job") == Promote("hands over: train1 leaves the job", fence=False)
    assert p.state is State.HANDING_OVER
    assert p.channel_closed(101.6) is None            # its channel closes after its word: no news
    assert p.exited(102.0, 3, final=None) is None      # nor its step's end: promoted already
    assert p.check(200.0) is None                      # nor the silence that follows


def test_silence_past_the_deadline_is_a_loss_and_not_before():
    p = primary(deadline=2.0)
    p.heard(100.5)
    for t in (101.0, 102.0, 102.5):                    # within 2 s of the last frame
        assert p.check(t) is None
    p.heard(102.4)                                     # a reply: the clock starts again
    assert p.check(104.3) is None
    verdict = p.check(104.5)
    assert verdict is not None and verdict.fence and "silent for 2.1s" in verdict.why
    assert p.state is State.LOST
    assert p.check(110.0) is None                      # one verdict, once


def test_a_closed_channel_or_a_step_ended_without_an_outcome_is_a_loss():
    p = primary()
    p.heard(101.0)
    assert p.channel_closed(101.2).fence
    q = primary()
    q.heard(101.0)
    verdict = q.exited(101.3, -9, final=None)
    assert isinstance(verdict, Promote) and verdict.fence and "exit code -9" in verdict.why


def test_a_step_ended_with_moved_is_a_hand_over_even_without_the_word():
    p = primary()
    p.heard(101.0)
    assert p.exited(101.3, 3, final=None) == Promote("hands over: its step ended with MOVED", fence=False)


def test_a_controller_that_ends_the_job_is_never_replaced():
    p = primary()
    p.heard(101.0)
    verdict = p.check(104.0)                           # silent while it shuts down
    assert verdict is not None
    p.ending(104.0)                                    # ... but its outcome is written
    assert p.state is State.ENDING
    assert p.check(200.0) is None and p.channel_closed(200.0) is None
    assert p.exited(201.0, 0, final=0) == 0 and p.state is State.ENDED


def test_a_controller_that_never_answers_is_lost_after_the_start_deadline():
    p = primary(now=0.0)
    assert p.check(119.0) is None                      # imports on a busy node: no silence verdict yet
    assert "never answered" in p.check(121.0).why


def test_illegal_transitions_raise():
    p = primary()
    p.heard(101.0)
    p.moving(101.0, "leaves")
    with pytest.raises(IllegalSuccessionTransition):
        p._to(State.SERVING, 102.0, "back")


def test_restarts_bound_losses_not_hand_overs():
    assert may_promote(why_lost=False, attempt=9, restarts=3)
    assert may_promote(why_lost=True, attempt=2, restarts=3)
    assert not may_promote(why_lost=True, attempt=3, restarts=3)


# --- the journal as the lease ----------------------------------------------------------------
START = {"kind": "start", "job_id": 7, "world_size": 2, "ranks_per_node": 1, "batch_host": "train1",
         "rank_node": {"0": "train1", "1": "train2"}}


def test_a_successors_claim_demotes_the_old_controller_before_it_acts(tmp_path):
    path = tmp_path / "journal.jsonl"
    old = Journal(path, key=KEY, attempt=0)
    old.write(1.0, [START])
    old.write(2.0, [epoch(1)])
    assert old.held()
    new = Journal(path, key=KEY, seq=journal.read(path, KEY).seq, attempt=1)
    new.claim(3.0)                                     # the successor's first act
    assert not old.held()                              # the cheap check before acting on anything
    with pytest.raises(Superseded):
        old.write(4.0, [epoch(2)])  # refused before writing
    new.write(5.0, [epoch(3)])
    assert new.held()
    j = journal.read(path, KEY)
    assert j.durable().epoch == 3 and j.restarts == 1 and j.stale == 0


def test_a_write_racing_the_claim_is_caught_by_the_read_back(tmp_path):
    """The old controller checked `held()`, then the claim landed, then its write: its bytes are not
    where it expected them, so it raises before acting; replay ignores that record."""
    path = tmp_path / "journal.jsonl"
    old = Journal(path, key=KEY, attempt=0)
    old.write(1.0, [START])
    new = Journal(path, key=KEY, seq=journal.read(path, KEY).seq, attempt=1)
    new.claim(2.0)
    old.held = lambda: True                             # the check ran just before the claim landed
    with pytest.raises(Superseded, match="before this write"):
        old.write(3.0, [epoch(9)])
    lines = path.read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["a"] == 0             # the demoted write is in the file ...
    j = fold(lines)
    assert j.durable().epoch == 0 and j.stale == 1               # ... and ignored on replay


def test_records_before_the_claim_count_and_old_journals_without_attempts_still_fold(tmp_path):
    lines = [json.dumps({"v": 1, "seq": 1, "t": 1.0, **START}) + "\n",        # no "a": an older writer
             json.dumps({"v": 1, "seq": 2, "t": 2.0, "a": 0, "kind": "view", "epoch": 4}) + "\n",
             json.dumps({"v": 1, "seq": 3, "t": 3.0, "a": 2, "kind": "restart", "attempt": 2}) + "\n",
             json.dumps({"v": 1, "seq": 4, "t": 3.5, "a": 0, "kind": "view", "epoch": 5}) + "\n",  # demoted
             json.dumps({"v": 1, "seq": 5, "t": 4.0, "a": 2, "kind": "view", "epoch": 6}) + "\n"]
    j = fold(lines)
    assert j.durable().epoch == 6 and j.restarts == 2 and j.stale == 1
    assert fold(lines[:4]).durable().epoch == 4
