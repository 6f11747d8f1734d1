"""The control plane at scale (issue 38): the boundary agreement the stub nodes serve
(runtime/stub_vote.py's Tally), the stub workload's options, and the launch of one stub process
per node (controller/executor.py's rank_program), and the controller's open-files limit."""
from __future__ import annotations

import resource
import threading

import pytest

from trainmover.controller.executor import rank_program
from trainmover.controller.process import raise_open_files_limit
from trainmover.errors import ConfigError
from trainmover.runtime.stub_vote import Tally, VoteClient, VoteRoot
from trainmover.workloads import registry


def replies(out, member):
    return [r for m, r in out if m == member]


def started(n: int = 2) -> Tally:
    t = Tally(n)
    for m in "ab"[:n]:
        t.join(m)
    return t


def test_no_step_is_decided_before_every_training_node_joined():
    t = Tally(2)
    t.join("a")
    assert t.vote("a", 1, 0, False, 0) == []
    assert t.join("b") == [("b", {"op": "gen", "gen": 0})]
    out = t.vote("b", 1, 0, False, 0)
    assert replies(out, "a") == replies(out, "b") == [{"op": "agreed", "step": 1, "epoch": 0}]


def test_a_switch_needs_every_vote_and_the_leaver_leaves_the_vote():
    t = started()
    t.vote("a", 1, 3, True, 0)
    out = t.vote("b", 1, 0, False, 0)  # b not prepared yet: MIN is 0, nobody switches
    assert {r["epoch"] for _, r in out} == {0} and t.members == {"a", "b"}
    t.observe("j", 3)
    t.vote("a", 2, 3, True, 0)
    out = t.vote("b", 2, 3, False, 0)
    assert replies(out, "j") == [{"op": "agreed", "step": 2, "epoch": 3}, {"op": "gen", "gen": 0}]
    assert t.members == {"b", "j"}
    assert t.gone("a") == []  # the leaver's exit is no failure


def test_a_vanished_member_fails_the_step_everywhere_and_old_votes_fail():
    t = Tally(3)
    for m in "abc":
        t.join(m)
    t.vote("a", 5, 0, False, 0)
    out = t.gone("c")
    assert sorted(m for m, _ in out) == ["a", "b"] and all(r == {"op": "failed", "gen": 1} for _, r in out)
    assert t.vote("b", 5, 0, False, 0) == [("b", {"op": "failed", "gen": 1})]  # had not voted yet: stalls too
    t.join("s")  # the standby that took c's ranks
    t.vote("a", 5, 0, False, 1)
    t.vote("b", 5, 0, False, 1)
    out = t.vote("s", 5, 0, False, 1)
    assert sorted(m for m, _ in out) == ["a", "b", "s"]


def test_a_late_vote_for_a_decided_step_gets_the_decision():
    t = started()
    t.vote("a", 1, 0, False, 0)
    t.vote("b", 1, 0, False, 0)
    t.join("s")
    assert t.vote("s", 1, 0, False, 0) == [("s", {"op": "agreed", "step": 1, "epoch": 0})]


def test_root_and_clients_over_tcp():
    root = VoteRoot("127.0.0.1", 2)
    a, b = VoteClient(root.address), VoteClient(root.address)
    a.join_as_member()
    b.join_as_member()
    got = {}
    th = threading.Thread(target=lambda: got.setdefault("a", a.agree(1, 4, False)))
    th.start()
    got["b"] = b.agree(1, 2, False)
    th.join(5)
    assert got == {"a": 2, "b": 2}


def test_stub_workload_and_its_launch():
    assert rank_program("stub", 8) == ("trainmover.runtime.stub_node", 1)
    assert rank_program("gpt_demo", 8) == ("trainmover.runtime.worker", 8)
    assert registry.load("stub", {"step_s": "0.5"}).step_s == 0.5
    assert registry.load("stub", {}).replica_group() == "world"
    with pytest.raises(ConfigError, match="step_s"):
        registry.load("stub", {"step_s": "0"})


def test_the_controller_raises_its_open_files_limit_to_the_hard_limit():
    """1,024 ranks' connections passed the common soft limit of 1,024 (EMFILE in accept)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        now = raise_open_files_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == now >= min(hard, 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
