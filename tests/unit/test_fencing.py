"""A fenced node never goes back into service undrained (trainmover/controller/fencing.py):
drained, it may leave the job; not drained (no right, or the drain failed), it is held."""
from __future__ import annotations

from trainmover.controller.fencing import DRAINED, HELD, FencedNodes
from trainmover.controller.policy.actions import LaunchStandby, ReleaseNode


def test_without_the_right_to_drain_a_fenced_node_is_held_and_its_release_withheld():
    f = FencedNodes(may_drain=False, why_not="tmuser is not root")
    assert f.fence("train2", "stuck") is False  # no drain is tried
    kept, held = f.route([ReleaseNode("train2"), ReleaseNode("train3"), LaunchStandby("spare1")])
    assert kept == [ReleaseNode("train3"), LaunchStandby("spare1")]
    assert held == [("train2", "drain refused: tmuser is not root: kept in the job, out of training, until the job ends")]
    assert f.held_nodes() == ["train2"]
    assert f.status() == [{"node": "train2", "reason": "stuck", "state": HELD, "held": "drain refused: tmuser is not root"}]


def test_a_release_waits_for_the_drain_and_follows_it_when_drained():
    f = FencedNodes()
    assert f.fence("train2", "stuck") is True
    kept, held = f.route([ReleaseNode("train2")])
    assert (kept, held) == ([], [])              # drain still pending: not released yet
    assert f.drained("train2", "") == ([ReleaseNode("train2")], [])
    assert f.status()[0]["state"] == DRAINED
    assert f.route([ReleaseNode("train2")]) == ([ReleaseNode("train2")], [])


def test_a_failed_drain_holds_the_node_whose_release_was_due():
    f = FencedNodes()
    f.fence("train2", "stuck")
    f.route([ReleaseNode("train2")])
    actions, held = f.drained("train2", "slurm_update error: Invalid user id")
    assert actions == [] and held == [("train2", "drain refused: slurm_update error: Invalid user id")]
    assert f.held_nodes() == ["train2"]
    assert f.drained("train2", "") == ([], [])   # a late result changes nothing


def test_a_failed_drain_before_any_release_holds_the_node_later():
    f = FencedNodes()
    f.fence("spare1", "standby silent")
    assert f.drained("spare1", "Invalid user id") == ([], [])
    kept, held = f.route([ReleaseNode("spare1")])
    assert kept == [] and held[0][0] == "spare1"


def test_a_resumed_controller_holds_fenced_nodes_still_in_the_job():
    f = FencedNodes(may_drain=False, why_not="x")
    f.restore(["train2"], "fenced")
    assert f.held_nodes() == ["train2"] and f.route([ReleaseNode("train2")])[0] == []
