"""`trainmover check-workload`: the pure parts (plan, fingerprints, comparison), then real checks
of the built-in GPT and the example CNN (exact), options refused before any process starts and
a process that hangs. The workloads with one mistake each: test_check_workload_mistakes.py (a
file of its own so that `make test`'s parallel workers run the two halves side by side)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from trainmover.check import compare
from trainmover.check.fingerprint import describe, differences, fingerprint, unplain
from trainmover.check.plan import Plan, is_prime, plan, shadow_total

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cnn"
TIMEOUT_S = 300


# --- pure ----------------------------------------------------------------------------------
def test_plan_leaves_prime_distances_longer_than_the_compared_steps():
    assert plan(24) == Plan(at=41, compare=24, rollback=24, restarts=(2, 3, 5, 8, 13, 21, 34))
    assert plan(1) == Plan(at=29, compare=1, rollback=19, restarts=(2, 3, 5, 8, 13, 21))
    for n in range(1, 80):
        p = plan(n)
        assert is_prime(p.at) and p.at >= n + 12 and p.end == p.at + n and p.rollback < p.at
        assert is_prime(p.end - p.rollback) and p.end - p.rollback > n  # no period <= n divides it
        # every epoch length E <= at has a restart point in [E, 2E): one epoch from a fresh count
        assert all(any(e <= r < 2 * e for r in p.restarts) for e in range(2, p.restarts[-1] + 1))
    with pytest.raises(ValueError):
        plan(0)


def test_shadow_steps_are_padded_to_a_prime_distance_from_the_switch():
    assert shadow_total(29, 10, 12) == 10  # 19 is prime and > 12
    assert shadow_total(29, 7, 12) == 10   # 22, 21, 20 are not
    assert shadow_total(29, 12, 12) == 12  # 17
    assert shadow_total(13, 10, 12) == 10  # nothing fits: as steady
    for compare in (1, 12, 24):
        at = plan(compare).at
        assert all(is_prime(at - shadow_total(at, s, compare)) and at - shadow_total(at, s, compare) > compare
                   for s in range(2, 13))


def test_state_paths_in_words():
    assert describe("/workload/optimizer/state/3/momentum_buffer") == "optimizer state 'momentum_buffer' of param 3"
    assert describe("/workload/optimizer/param_groups/0/lr") == "optimizer param group 0 'lr'"
    assert describe("/workload/scheduler/last_epoch") == "state 'scheduler/last_epoch'"
    assert describe("/workload/model/bn1.running_mean") == "model 'bn1.running_mean'"
    assert describe("/rng/torch") == "the global torch RNG (captured by the runtime)"


def test_differences_put_settings_before_parameters_and_name_missing_keys():
    a = fingerprint({"workload": {"model": {"w": torch.ones(3)}, "optimizer": {"param_groups": [{"lr": 0.1}]},
                                  "scheduler": {"last_epoch": 5}}})
    b = fingerprint({"workload": {"model": {"w": torch.zeros(3)}, "optimizer": {"param_groups": [{"lr": 0.01}]}}})
    paths = [p for p, _, _ in differences(a, b)]
    assert paths == ["/workload/optimizer/param_groups/0/lr", "/workload/scheduler/last_epoch", "/workload/model/w"]
    assert differences(a, b)[1][2] == "(missing)"
    assert differences(a, a) == []


def test_values_the_transfer_cannot_decode_are_named():
    import numpy as np
    assert unplain({"data": {"gen": torch.Generator(), "pos": 3, "order": torch.arange(4), "w": np.float64(1.5),
                             "ok": [1.5, "a", None, True, torch.float32]}}) == [
        "/data/gen (torch._C.Generator)", "/data/w (numpy.float64)"]


def _record(losses: dict, states: dict) -> compare.Record:
    return compare.Record(losses=losses, states=states, digest="d")


def test_the_first_differing_step_and_what_differed():
    p = Plan(at=3, compare=3, rollback=2)
    same = {s: fingerprint({"workload": {"model": {"w": torch.tensor([float(s)])}}}) for s in range(2, 7)}
    other = dict(same)
    other[5] = fingerprint({"workload": {"model": {"w": torch.tensor([9.0])}}})
    ref = _record({4: 1.0, 5: 0.5, 6: 0.25}, same)
    ok = compare.migration_finding(p, [ref, ref], [ref, ref])
    assert ok.ok and "steps 4-6" in ok.message
    bad = compare.migration_finding(p, [ref, ref], [ref, _record({4: 1.0, 5: 0.75, 6: 0.25}, other)])
    assert not bad.ok and bad.step == 5
    assert "first difference at step 5 (the 2nd step after the switch after step 3)" in bad.message
    assert "loss of rank 1 0.5 (uninterrupted) vs 0.75 (migrated)" in bad.message
    assert "model 'w': [5.0] (uninterrupted) vs [9.0] (migrated)" in bad.message
    at_switch = dict(same)
    at_switch[3] = other[5]
    load = compare.migration_finding(p, [ref, ref], [_record(ref.losses, at_switch), ref])
    assert load.step == 3 and "load_state_dict() does not restore model 'w'" in load.message


def test_a_joiner_issuing_other_collectives_than_its_rank_is_named():
    """The check's joiners replace every rank at once and agree with each other; next to ranks
    that stay, a collective one side issues and the other does not stalls a move. Counted per
    step and group against the uninterrupted ranks (the Hugging Face integration once let a
    mid-epoch re-entry make its step's token-count gather in the sandbox)."""
    p = Plan(at=3, compare=3, rollback=2)
    counts = {4: {"world": 3, "dp": 1}, 5: {"world": 3, "dp": 1}, 6: {"world": 3, "dp": 1}}
    ref = compare.Record(collectives=counts)
    (ok,) = compare.collectives_finding(p, [ref, ref], [ref, ref])
    assert ok.ok and ok.check == "collectives" and "steps 4-6" in ok.message
    short = compare.Record(collectives={**counts, 4: {"world": 2, "dp": 1}})
    (bad,) = compare.collectives_finding(p, [ref, ref], [ref, short])
    assert not bad.ok and bad.step == 4
    assert ("at step 4 (the 1st after the switch after step 3) the joiner of rank 1 issued 2 collective(s) in group "
            "'world' where the uninterrupted rank issued 3") in bad.message
    extra = compare.Record(collectives={**counts, 6: {"world": 3, "dp": 1, "tp": 1}})
    assert compare.collectives_finding(p, [ref, ref], [extra, ref])[0].step == 6
    assert compare.collectives_finding(p, [ref], [compare.Record()]) == []  # nothing counted: no finding


def test_bits_not_values_are_compared():
    assert compare.same_float(float("nan"), float("nan")) and not compare.same_float(0.0, -0.0)
    assert not compare.same_float(0.1 + 0.2, 0.3)


# --- real checks ---------------------------------------------------------------------------
@pytest.fixture
def on_path(monkeypatch):
    """The example and the mistaken workloads importable here and in the check's processes."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(EXAMPLE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(ROOT)


def check(name: str, steps: int = 12, **kw):
    from trainmover.check.run import run_check
    report = run_check(name, kw, steps=steps, timeout_s=TIMEOUT_S)
    print(report.text())
    return report


def finding(report, name: str) -> compare.Finding:
    return next(f for f in report.findings if f.check == name)


def test_the_example_cnn_would_migrate_exactly(on_path):
    report = check("cnn:CNN", steps=24)
    assert report.exact, report.text()
    assert report.world == 2 and report.plan.at == 41 and [f.check for f in report.findings] == [
        "encoding", "migration", "collectives", "determinism", "rollback", "restart"]


def test_the_built_in_gpt_would_migrate_exactly(on_path):
    report = check("gpt_demo", steps=8)
    assert report.exact, report.text()


def test_options_are_checked_before_any_process_starts(on_path):
    from trainmover.errors import ConfigError
    with pytest.raises(ConfigError, match=r"does not accept options \['preset'\] \(preset from TM_MODEL\); it accepts: "
                                          r"batch, clip, dropout, gamma, lr, samples, step_size, width"):
        check("cnn:CNN", preset="tiny")


def test_what_the_checks_processes_started_ends_with_the_check(on_path, monkeypatch, tmp_path):
    """Each process of the check runs in a session of its own, killed whole at the end: a child
    it left behind (a DataLoader worker) does not outlive the check. Old code left it running."""
    from trainmover.check.run import run_check
    monkeypatch.setenv("TM_TEST_CHILD_PIDS", str(tmp_path))
    report = run_check("tests.unit.check_workloads:LeavesAChild", {}, steps=4, timeout_s=150)
    assert report.failure == "" and report.exact, report.text()
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert pids, "the workload started its children"

    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"  # a zombie: ended
        except FileNotFoundError:
            return True
    wait_until = time.monotonic() + 10
    while not all(gone(p) for p in pids) and time.monotonic() < wait_until:
        time.sleep(0.1)
    assert all(gone(p) for p in pids), [p for p in pids if not gone(p)]


def test_a_process_that_hangs_is_named_with_where_it_was_at_the_deadline(on_path):
    from trainmover.check.run import run_check
    # The deadline is this test's whole cost (it was 90 s): the four processes need only start
    # and train 5 small steps before rank 1 hangs; the rest of it is waiting.
    report = run_check("tests.unit.check_workloads:HangsOnRank1", {}, steps=4, timeout_s=60)
    assert not report.exact and report.failure.startswith("timed out after 60s; still running: "), report.text()
    assert "reference rank 1 in 'step 6'" in report.failure, report.failure
    # and where in the step: its threads' stacks, the hanging frame among them
    stacks = report.failure[report.failure.index("reference rank 1, its threads:"):]
    assert 'check_workloads.py", line 108 in train_step' in stacks.split("its threads:")[1], report.failure
