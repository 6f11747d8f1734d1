"""One owner per migration on the controller: every `Phase` change of a `Migration` is made by the
Planner (controller/policy/planner.py), whatever asked for it (a drain, a recovery, a successor's
takeover, a lost standby, a rank's own error); the others call its named steps."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.test_policy import new_policy
from trainmover.controller.durable.migration import IllegalPhaseTransition, Phase
from trainmover.controller.policy.actions import Record

ROOT = Path(__file__).resolve().parents[2] / "trainmover"
OWNER = ROOT / "controller" / "policy" / "planner.py"


def phase_changes(path: Path) -> list[int]:
    """Lines where `path` calls `<anything>.to(Phase.<X>, ...)`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"
                and node.args and isinstance(node.args[0], ast.Attribute)
                and isinstance(node.args[0].value, ast.Name) and node.args[0].value.id == "Phase"):
            found.append(node.lineno)
    return found


def test_only_the_planner_changes_a_migrations_phase():
    others = {str(p.relative_to(ROOT)): lines for p in sorted(ROOT.rglob("*.py")) if p != OWNER
              for lines in [phase_changes(p)] if lines}
    assert others == {}, f"Phase changes outside the Planner: {others}"
    # the control: the search finds the owner's own (one per phase it moves a migration to)
    assert {ast.unparse(n.args[0]) for n in ast.walk(ast.parse(OWNER.read_text()))
            if isinstance(n, ast.Call) and n.lineno in phase_changes(OWNER)} == {
        f"Phase.{p.name}" for p in (Phase.WAITING_STANDBY, Phase.PREPARING, Phase.SWITCHING, Phase.ABORTED,
                                    Phase.FAILED, Phase.RELEASING, Phase.DONE)}


def test_the_planner_fails_a_migration_once_and_says_why_in_the_timeline():
    p = new_policy()
    m = p.planner.new(10.0, "train2", (1,), "drain")
    out = p.planner.fail(11.0, m, "x" * 400, "the whole evidence")
    assert m.phase is Phase.FAILED and m.note == "x" * 300 and m.times["failed"] == 11.0  # the note is bounded
    assert [(a.stream, a.payload["event"], a.payload["reason"]) for a in out] == [
        ("timeline", "failed", "the whole evidence")]
    with pytest.raises(IllegalPhaseTransition):  # a migration ends once
        p.planner.fail(12.0, m, "again")


def test_a_planned_migration_whose_leaver_dies_first_is_failed_in_the_timeline_too():
    """The leaver of a waiting drain is lost: its drain ends (failed, said in the timeline as every
    other failed migration is) and the recovery takes over; nothing is retried for it."""
    p = new_policy()
    p.start(0.0)
    accepted, _, _ = p.planner.request(1.0, "train2", "drain")
    assert accepted and p.planner.active().phase is Phase.WAITING_STANDBY
    out = p.recovery_part.fault(2.0, "train2", "its connection dropped")
    drain, rec = p.planner.migrations
    assert drain.phase is Phase.FAILED and "lost before it could migrate" in drain.note
    assert rec.recovery and rec.leaver == "train2"
    assert [a.payload["migration"] for a in out if isinstance(a, Record) and a.payload["event"] == "failed"] == [drain.id]
