"""One owner of a rank process's moving parts: the roles read the rank, groups, completed steps,
the Phase 1 in flight, the epoch and the step reports through RankContext and hand the process a
change (runtime/changes.py); only the process (`worker.Agent.apply`) writes them."""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainmover.runtime import changes
from trainmover.runtime.worker import Agent

ROOT = Path(__file__).resolve().parents[2] / "trainmover" / "runtime"
OWNER = ROOT / "worker.py"


def context_writes(source: str, where: str = "<src>") -> list[str]:
    """`ctx.<field> = ...` / `self.ctx.<field> += ...` (any assignment through a name or
    attribute called `ctx`): 'line: target' for each."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in (x for tgt in targets for x in ast.walk(tgt)):
            if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store) and (
                    (isinstance(t.value, ast.Name) and t.value.id == "ctx")
                    or (isinstance(t.value, ast.Attribute) and t.value.attr == "ctx")):
                found.append(f"{node.lineno}: {ast.unparse(t)}")
    return found


def test_no_role_writes_a_field_of_its_process():
    writes = {str(p.relative_to(ROOT)): w for p in sorted(ROOT.rglob("*.py")) if p != OWNER
              for w in [context_writes(p.read_text(), str(p))] if w}
    assert writes == {}, f"fields of RankContext written outside the process: {writes}"
    # the control: the search finds each form of write
    assert context_writes("self.ctx.rank = 1\nctx.pending = None\nself.ctx.trace_steps -= 1\n"
                          "self.ctx.completed: int = 3\n(a, self.ctx.groups) = 1, 2\n") == [
        "1: self.ctx.rank", "2: ctx.pending", "3: self.ctx.trace_steps", "4: self.ctx.completed",
        "5: self.ctx.groups"]
    assert context_writes("self.ctx.apply(x)\nprep.epoch = 3\nself.ctx.pending.plan = None\n") == []


def process(**fields):
    """Agent's fields without a process behind them: apply is all that is exercised."""
    base = dict(rank=None, groups={}, completed=0, pending=None, joining=0, switched_epoch=0,
                step_reports=deque([{"step": s} for s in range(1, 9)], maxlen=16), trace_steps=0)
    p = SimpleNamespace(**{**base, **fields})
    p.apply = lambda change: Agent.apply(p, change)
    return p


def test_a_switch_ends_the_phase_1_in_flight_and_a_rollback_drops_the_reports_it_redoes():
    prep = SimpleNamespace(epoch=4)
    p = process(pending=prep, switched_epoch=2)
    p.apply(changes.Switched(4))
    assert p.pending is None and p.switched_epoch == 4 and len(p.step_reports) == 8
    p.apply(changes.Switched(5, redo_after=6))
    assert [r["step"] for r in p.step_reports] == [1, 2, 3, 4, 5, 6] and p.step_reports.maxlen == 16


def test_an_abort_drops_only_its_own_epochs_phase_1():
    prep = SimpleNamespace(epoch=7)
    p = process(pending=prep)
    p.apply(changes.DropPhase1(6))  # an older epoch's abort: the one in flight stays
    assert p.pending is prep
    p.apply(changes.DropPhase1(7))
    assert p.pending is None


def test_the_other_changes_and_what_is_no_change():
    p = process(trace_steps=1)
    groups = {"world": object()}
    for c in (changes.TakeRank(3), changes.UseGroups(groups), changes.Completed(12), changes.Joining(9),
              changes.BeginPhase1(prep := SimpleNamespace(epoch=9)), changes.StepTraced(), changes.StepTraced()):
        p.apply(c)
    assert (p.rank, p.groups, p.completed, p.joining, p.pending, p.trace_steps) == (3, groups, 12, 9, prep, 0)
    with pytest.raises(TypeError, match="not a rank change"):
        p.apply(("rank", 4))
