"""The standby pool (controller/policy/standby_pool.py): the one owner of every standby's state, with a
table of transitions, and the one place a ready standby is picked. Pure."""
from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from trainmover.config import Config
from trainmover.controller.durable.state import PolicyState
from trainmover.controller.durable.view import JobView, StandbyState as S
from trainmover.controller.policy.standby_pool import ALLOWED, IllegalStandbyTransition, StandbyPool

ROOT = Path(__file__).resolve().parents[2] / "trainmover"


def pool(**cfg) -> StandbyPool:
    return StandbyPool(Config(**cfg), PolicyState.initial(JobView(7, 2, 1, "n1", {0: "n1", 1: "n2"})))


def at(p: StandbyPool, node: str, state: S) -> None:
    """Bring `node` to `state` through the pool's own methods."""
    p.add(0.0, node)
    if state in (S.READY, S.WARMING, S.JOINING):
        p.mark_ready(1.0, node, 2.0, 3, {})
    if state is S.WARMING:
        p.mark_warming(2.0, node)
    if state is S.JOINING:
        assert p.take_ready() == node
    assert p.get(node).state is state


@pytest.mark.parametrize("old, new", list(itertools.product(S, S)))
def test_every_transition_is_in_the_table_or_refused(old, new):
    p = pool()
    at(p, "s1", old)
    if new in ALLOWED[old]:
        p._to(p.get("s1"), new, 5.0)
        assert p.get("s1").state is new and p.get("s1").since == 5.0
    else:
        with pytest.raises(IllegalStandbyTransition, match=f"s1: {old.value} -> {new.value} is not allowed"):
            p._to(p.get("s1"), new, 5.0)
        assert p.get("s1").state is old


def test_take_ready_is_the_one_pick_first_ready_in_the_given_order():
    p = pool()
    for node, state in (("s3", S.READY), ("s1", S.STARTING), ("s2", S.READY), ("s4", S.WARMING)):
        at(p, node, state)
    assert p.ready_nodes() == ["s2", "s3"]
    assert p.take_ready(lambda ready: sorted(ready, key=lambda n: n != "s3")) == "s3"  # a holder first
    assert p.get("s3").state is S.JOINING
    assert p.take_ready() == "s2" and p.take_ready() is None


def test_an_aborted_join_warms_up_again_and_a_warming_standby_is_not_offered():
    p = pool()
    at(p, "s1", S.JOINING)
    p.get("s1").warm = {0}
    p.mark_starting("s1", "aborted")
    assert p.get("s1").state is S.STARTING and p.get("s1").warm == set()
    at(p, "s2", S.WARMING)
    assert p.take_ready() is None
    p.mark_warming(3.0, "s1")  # only a ready standby re-warms: nothing happens
    assert p.get("s1").state is S.STARTING


def test_a_successor_restores_the_pool_joiners_stay_taken_the_rest_start_over():
    p = pool()
    p.restore(9.0, {"s1": S.READY, "s2": S.JOINING, "s3": S.WARMING})
    assert {n: s.state for n, s in p.standbys.items()} == {"s1": S.STARTING, "s2": S.JOINING, "s3": S.STARTING}
    assert all(s.since == 9.0 for s in p.standbys.values())


def test_losses_are_counted_in_the_durable_state_and_bound_the_pool():
    p = pool(standbys=2, standby_losses=1)
    at(p, "s1", S.READY)
    assert p.maybe_acquire(0.0, done=False)  # one more wanted
    p.acquired()
    p.lost(1.0, "s1", "control connection lost")
    assert p.state.standbys_lost == [{"node": "s1", "state": "ready", "evidence": "control connection lost", "t": 1.0}]
    assert p.exhausted() and "TM_STANDBY_LOSSES=1 reached" in p.note()
    assert p.maybe_acquire(2.0, done=False) == []


def test_no_module_but_the_pool_changes_a_standbys_state():
    """Static: outside standby_pool.py, nothing in trainmover/ assigns `<x>.state` on a value
    that is not its own (`self.state` of a part is its reference to the policy's state, and
    other state machines keep their `self.state`), nor builds a Standby with a state."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.name == "standby_pool.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and el.attr == "state" and not (
                            isinstance(el.value, ast.Name) and el.value.id == "self") and not (
                            # numpy's generator state (script mode restores a script's RNGs)
                            isinstance(el.value, ast.Attribute) and el.value.attr == "bit_generator"):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Standby" and len(node.args) > 1:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} (Standby built with a state)")
    # fencing.py keeps its own per-node state machine (a fenced node's drain): not a standby's;
    # integrations/ set a training framework's own state (the Hugging Face Trainer's TrainerState)
    assert [o for o in offenders if not o.startswith(("controller/fencing.py", "integrations/"))] == []
