"""Straggler policy with synthetic per-rank compute timings (no processes, no clock)."""
import random

import pytest

from trainmover.controller.policy.straggler import Decision, StragglerConfig, StragglerInputError, decide
from trainmover.errors import ConfigError

RANK_NODE = {r: f"n{r // 2}" for r in range(8)}     # 4 nodes, 2 ranks each


def _windows(k, base=1.0, noise=0.0, slow=None, seed=0, spike_at=None):
    """k windows; `slow` = {rank: factor}; `spike_at` = (window, rank, factor) once."""
    rnd = random.Random(seed)
    out = []
    for i in range(k):
        w = {r: base * (1 + rnd.uniform(-noise, noise)) for r in RANK_NODE}
        for r, f in (slow or {}).items():
            w[r] *= f
        if spike_at and spike_at[0] == i:
            w[spike_at[1]] *= spike_at[2]
        out.append(w)
    return out


def test_twenty_percent_slower_node_is_identified_after_k_windows():
    cfg = StragglerConfig(threshold=0.10, min_windows=3)
    ws = _windows(5, noise=0.03, slow={5: 1.2}, seed=1)
    assert decide(ws[:2], RANK_NODE, cfg).action == "none"          # not yet K windows
    d = decide(ws[:3], RANK_NODE, cfg)
    assert (d.action, d.target) == ("evict", "n2")
    ev = d.stragglers[0]
    assert ev.slowest_rank == 5 and ev.ranks == (4, 5) and len(ev.ratios) == 3
    assert all(1.1 < x < 1.3 for x in ev.ratios)
    assert "n2" in d.reason and "slower" in d.reason


def test_report_only_per_config():
    d = decide(_windows(3, slow={0: 1.2, 1: 1.2}), RANK_NODE, StragglerConfig(action="report"))
    assert (d.action, d.target) == ("report", "n0")


def test_noise_does_not_trigger():
    cfg = StragglerConfig()
    for seed in range(50):
        d = decide(_windows(10, noise=0.04, seed=seed), RANK_NODE, cfg)
        assert d.action == "none" and d.target is None, d.reason


def test_one_off_spike_does_not_trigger():
    ws = _windows(6, noise=0.02, spike_at=(4, 3, 2.0))
    for end in range(1, 7):
        assert decide(ws[:end], RANK_NODE).action == "none"


def test_recovered_node_is_no_longer_a_straggler():
    ws = _windows(3, slow={2: 1.3}) + _windows(1)
    assert decide(ws[:3], RANK_NODE).target == "n1"
    assert decide(ws, RANK_NODE).action == "none"


def test_a_named_node_stays_named_through_one_noisy_window_then_clears():
    """Hysteresis: once named, a node is cleared only when it is not slow in any recent window."""
    cfg = StragglerConfig(threshold=0.10, min_windows=3, action="report")
    slow, fast = _windows(4, slow={2: 1.2}), _windows(3)
    noisy = slow[:3] + [fast[0]]               # the latest window happens to look normal
    assert decide(noisy, RANK_NODE, cfg).target is None                  # without history: cleared
    kept = decide(noisy, RANK_NODE, cfg, reported="n1")
    assert (kept.action, kept.target) == ("report", "n1") and len(kept.stragglers[0].ratios) == 3
    assert decide(slow[:3] + fast, RANK_NODE, cfg, reported="n1").action == "none"   # recovered
    assert decide(_windows(3), RANK_NODE, cfg, reported="n9").action == "none"      # left the job
    assert decide(_windows(3, slow={2: 1.2}), RANK_NODE, cfg, reported="n0").target == "n1"  # new evidence wins


def test_two_stragglers_worst_first_and_ties_by_name():
    d = decide(_windows(3, slow={0: 1.3, 7: 1.2}), RANK_NODE)
    # 4 nodes at 1.3, 1.0, 1.0, 1.2: the median (1.1) is pulled up; only n0 is > 10% above it.
    assert [e.node for e in d.stragglers] == ["n0"]
    rank_node = {r: f"n{r}" for r in range(8)}                        # 8 nodes of one rank
    d = decide(_windows(3, slow={0: 1.3, 7: 1.2}), rank_node)
    assert [e.node for e in d.stragglers] == ["n0", "n7"] and d.target == "n0"
    d = decide(_windows(3, slow={6: 1.25, 2: 1.25}), rank_node)
    assert d.target == "n2" and [e.node for e in d.stragglers] == ["n2", "n6"]


@pytest.mark.parametrize("windows, rank_node, words", [
    ([], RANK_NODE, "no timing windows"),
    ([{}], RANK_NODE, "window 0 is empty"),
    ([{0: 1.0, 1: 1.0, 2: 1.0}, {0: 1.0, 1: 1.0}], {0: "a", 1: "b", 2: "c"}, r"window 1 .*missing \[2\]"),
    ([{0: 1.0, 1: 0.0, 2: 1.0}], {0: "a", 1: "b", 2: "c"}, "rank 1 has compute time 0.0"),
    ([{0: 1.0, 1: float("nan"), 2: 1.0}], {0: "a", 1: "b", 2: "c"}, "rank 1"),
    ([{0: 1.0, 1: 1.0, 2: 1.0}], {0: "a", 1: "b"}, r"ranks \[2\] have timings but no node"),
    ([{0: 1.0, 1: 1.0, 2: 1.0}], {0: "a", 1: "b", 2: "b"}, "at least 3 nodes"),
])
def test_bad_input_is_a_clear_error(windows, rank_node, words):
    with pytest.raises(StragglerInputError, match=words):
        decide(windows, rank_node)


@pytest.mark.parametrize("kw, words", [
    (dict(threshold=0), "threshold"), (dict(min_windows=0), "min_windows"), (dict(action="kill"), "action"),
])
def test_bad_config_is_a_clear_error(kw, words):
    with pytest.raises(ConfigError, match=words):
        StragglerConfig(**kw)


def test_decision_is_pure():
    ws = _windows(4, slow={5: 1.2})
    before = [dict(w) for w in ws]
    a, b = decide(ws, RANK_NODE), decide(ws, RANK_NODE)
    assert a == b and isinstance(a, Decision) and ws == before
