"""The rate logic (rates.py) and the verdict (verdict.py) replayed over counter sequences: a
node's first run, healthy creep after NVLink traffic (the counts that once drained a
healthy H200), a counter reset (driver reload), a reboot, a link that keeps failing, and
every fatal sign. Time is an argument everywhere: no clock, no sleep."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmover.healthcheck.rates import DEFAULT_THRESHOLDS_PER_S, Base, RatePolicy, judge_counters
from trainmover.healthcheck.readings import GpuReading, Incident, NodeReading, XidEvent
from trainmover.healthcheck.verdict import Policy, judge

T0 = 1_800_000_000.0
ROOT = Path(__file__).resolve().parents[2]


def node(counters0, counters1=None, boot="boot-1", **gpu0):
    gpus = [GpuReading(0, "GPU-aaaa", "0000:18:00.0", counters=counters0, **gpu0)]
    if counters1 is not None:
        gpus.append(GpuReading(1, "GPU-bbbb", "0000:2a:00.0", counters=counters1))
    return NodeReading("recorded", tuple(gpus), boot_id=boot)


def replay(sequence, policy=Policy(), prev=None):
    """[(seconds since T0, reading)] -> the verdict of each run, carrying the state along."""
    out = []
    for t, reading in sequence:
        v = judge(prev, reading, T0 + t, policy)
        prev = v.state
        out.append(v)
    return out


def faults(v):
    return [f.detail for f in v.findings if not f.ok and not f.skipped]


# ---- rates.py alone ---------------------------------------------------------------------

def test_first_reading_is_a_baseline_and_nothing_is_judged():
    cv = judge_counters(None, {"nvlink1": {"replay": 196, "crc_flit": 10**9}}, T0, RatePolicy())
    assert cv.rates == () and cv.faults == ()
    assert cv.bases == {"nvlink1": {"crc_flit": Base(10**9, T0, 10**9), "replay": Base(196, T0, 196)}}


def test_rate_is_spread_over_at_least_a_window_and_the_base_stays_until_a_window_has_passed():
    policy = RatePolicy()
    bases = {"nvlink1": {"crc_flit": Base(0, T0, 0)}}
    # 5900 errors 1 s later: 5900 over the 60 s window = 98/s, under 100/s
    cv = judge_counters(bases, {"nvlink1": {"crc_flit": 5900}}, T0 + 1, policy)
    (r,) = cv.rates
    assert (r.delta, r.seconds, r.exceeded) == (5900, 60.0, False) and r.per_s == pytest.approx(98.33, abs=0.01)
    assert cv.bases["nvlink1"]["crc_flit"] == Base(0, T0, 5900), "base kept: the window is not over"
    # the same link keeps counting: 200 more 10 s later is judged from the same base
    cv = judge_counters(cv.bases, {"nvlink1": {"crc_flit": 6100}}, T0 + 11, policy)
    assert cv.faults and cv.faults[0].per_s == pytest.approx(6100 / 60)
    # a whole window later the base moves to the reading
    cv = judge_counters(cv.bases, {"nvlink1": {"crc_flit": 6100}}, T0 + 61, policy)
    assert cv.bases["nvlink1"]["crc_flit"] == Base(6100, T0 + 61, 6100)


def test_a_sustained_fault_is_caught_however_often_the_check_runs():
    """150 CRC errors/s, a run every 2 s: each run alone sees 300, far under 100/s x 60 s,
    but the base stays put, so the rate reaches the threshold within one window."""
    bases, caught_at = {"nvlink3": {"crc_flit": Base(0, T0, 0)}}, None
    for t in range(2, 62, 2):
        cv = judge_counters(bases, {"nvlink3": {"crc_flit": 150 * t}}, T0 + t, RatePolicy())
        bases = cv.bases
        if cv.faults and caught_at is None:
            caught_at = t
    assert caught_at is not None and caught_at <= 60


def test_counter_reset_is_a_new_baseline_not_a_fault():
    bases = {"nvlink1": {"replay": Base(100, T0, 5000)}}
    cv = judge_counters(bases, {"nvlink1": {"replay": 2000}}, T0 + 30, RatePolicy(), who="GPU 0")
    assert cv.rates == () and cv.bases["nvlink1"]["replay"] == Base(2000, T0 + 30, 2000)
    assert cv.notes == ("GPU 0: counter reset (driver reload?): new baseline for NVLink 1 replay 5000->2000",)


def test_a_clock_that_went_back_is_a_new_baseline():
    cv = judge_counters({"pcie": {"pcie_replay": Base(5, T0, 5)}}, {"pcie": {"pcie_replay": 900}}, T0 - 100, RatePolicy())
    assert cv.rates == () and cv.bases["pcie"]["pcie_replay"].since == T0 - 100


def test_policy_rejects_unknown_kinds_and_overrides_merge():
    with pytest.raises(ValueError, match="unknown counter kind"):
        RatePolicy({"crc": 1.0})
    p = RatePolicy().with_thresholds({"replay": 5.0})
    assert p.per_s["replay"] == 5.0 and p.per_s["crc_flit"] == DEFAULT_THRESHOLDS_PER_S["crc_flit"]


# ---- verdict.py over sequences ----------------------------------------------------------------

# 2x H200 as read on the GPU machine: after a 14.6 GB NVLink transfer NVML reported 196
# errors on GPU 0's link 1 and 104 on link 10 (shared/reference/gpu-machines.md), the sum that
# the old check compared with 100. Then transfers every minute add a few more.
HEALTHY_AFTER_TRANSFER = [
    (0, node({"nvlink1": {"replay": 196, "recovery": 0, "crc_flit": 0}, "nvlink10": {"replay": 104},
              "pcie": {"pcie_replay": 0}},
             {"nvlink1": {"replay": 180}, "pcie": {"pcie_replay": 0}})),
    (60, node({"nvlink1": {"replay": 260, "recovery": 0, "crc_flit": 12}, "nvlink10": {"replay": 150},
               "pcie": {"pcie_replay": 1}},
              {"nvlink1": {"replay": 240}, "pcie": {"pcie_replay": 0}})),
    (61, node({"nvlink1": {"replay": 900, "recovery": 0, "crc_flit": 40}, "nvlink10": {"replay": 700},
               "pcie": {"pcie_replay": 1}},
              {"nvlink1": {"replay": 800}, "pcie": {"pcie_replay": 0}})),
    (120, node({"nvlink1": {"replay": 905, "recovery": 0, "crc_flit": 40}, "nvlink10": {"replay": 702},
                "pcie": {"pcie_replay": 2}},
               {"nvlink1": {"replay": 801}, "pcie": {"pcie_replay": 0}})),
]


def test_healthy_creep_after_nvlink_transfers_never_fails():
    runs = replay(HEALTHY_AFTER_TRANSFER)
    assert [faults(v) for v in runs] == [[], [], [], []]
    assert "baseline taken" in runs[0].findings[0].detail, "the first run on a node takes a baseline"
    warnings = [f.detail for f in runs[2].findings if f.warning]
    assert "GPU 0: warning: NVLink 1 replay: +640 in 60s = 10.7/s (threshold 100/s)" in warnings


def test_the_old_false_drain_is_not_one():
    """The old check failed GPU 0 on a first run for 196 + 104 cumulative errors."""
    (v,) = replay(HEALTHY_AFTER_TRANSFER[:1])
    assert faults(v) == [] and all(f.ok for f in v.findings)


def test_a_failing_link_is_caught_with_its_evidence():
    seq = HEALTHY_AFTER_TRANSFER[:2] + [
        (90, node({"nvlink1": {"replay": 260, "recovery": 3, "crc_flit": 12 + 9000}, "nvlink10": {"replay": 150},
                   "pcie": {"pcie_replay": 1}}, {"nvlink1": {"replay": 240}, "pcie": {"pcie_replay": 0}}))]
    v = replay(seq)[-1]
    assert faults(v) == ["GPU 0: NVLink 1 crc_flit: +9000 in 60s = 150/s (threshold 100/s); "
                         "NVLink 1 recovery: +3 in 60s = 0.05/s (threshold 0.0167/s)"]
    ev = {(e["link"], e["counter"]): e for e in v.findings[0].evidence}
    assert ev[("nvlink1", "crc_flit")] == {"gpu": 0, "uuid": "GPU-aaaa", "link": "nvlink1", "counter": "crc_flit",
                                           "delta": 9000, "seconds": 60.0, "per_s": 150.0,
                                           "threshold_per_s": 100.0, "fault": True}


def test_driver_reload_resets_counters_without_a_fault_then_judges_from_the_new_base():
    seq = HEALTHY_AFTER_TRANSFER[:2] + [
        (70, node({"nvlink1": {"replay": 3, "recovery": 0, "crc_flit": 0}, "nvlink10": {"replay": 0},
                   "pcie": {"pcie_replay": 0}}, {"nvlink1": {"replay": 0}, "pcie": {"pcie_replay": 0}})),
        (75, node({"nvlink1": {"replay": 3, "recovery": 0, "crc_flit": 7000}, "nvlink10": {"replay": 0},
                   "pcie": {"pcie_replay": 0}}, {"nvlink1": {"replay": 0}, "pcie": {"pcie_replay": 0}}))]
    runs = replay(seq)
    assert faults(runs[2]) == []
    assert any("counter reset (driver reload?)" in n and "NVLink 1 replay 260->3" in n for n in runs[2].notes)
    assert faults(runs[3]) == ["GPU 0: NVLink 1 crc_flit: +7000 in 60s = 117/s (threshold 100/s)"]


def test_a_reboot_is_a_new_baseline():
    seq = HEALTHY_AFTER_TRANSFER[:1] + [
        (30, node({"nvlink1": {"replay": 10**6, "crc_flit": 10**6}}, {"nvlink1": {"replay": 5}}, boot="boot-2"))]
    v = replay(seq)[-1]
    assert faults(v) == [] and "the node rebooted since the last run: new counter baseline" in v.notes
    gone = replay(HEALTHY_AFTER_TRANSFER[:1] + [(30, node({}, boot="boot-2"))])[-1]
    assert faults(gone) == ["GPU 1 (GPU-bbbb, PCI 0000:2a:00.0) answered at the last run and is missing now: "
                            "fallen off the bus?"], "a GPU that vanished across a reboot is still missing"


def test_thresholds_and_window_are_policy():
    seq = HEALTHY_AFTER_TRANSFER[:3]
    strict = Policy(rates=RatePolicy(window_s=60).with_thresholds({"replay": 5.0}))
    assert faults(replay(seq, strict)[-1])[0].startswith("GPU 0: NVLink 1 replay: +640 in 60s = 10.7/s (threshold 5/s)")


def test_fatal_signs_fail_at_once_even_on_a_first_run():
    for gpu0, text in [({"ecc_uncorrected": 1}, "uncorrectable ECC errors: 1"),
                       ({"remap_failed": True}, "row remapping failed"),
                       ({"retire_pending": True}, "page retirement or row remap pending (GPU reset needed)"),
                       ({"lost": True}, "fallen off the bus (NVML: GPU is lost)"),
                       ({"recovery_action": 2}, "driver asks for a recovery action: node reboot")]:
        (v,) = replay([(0, node({"nvlink1": {"replay": 1}}, **gpu0))])
        assert faults(v) == [f"GPU 0: {text}"], gpu0


def test_a_lost_gpu_keeps_its_bases():
    runs = replay(HEALTHY_AFTER_TRANSFER[:1] + [(10, node({}, lost=True))])
    assert runs[1].state.gpus["GPU-aaaa"].bases == runs[0].state.gpus["GPU-aaaa"].bases


def test_fewer_gpus_than_at_the_last_run_is_a_fault_that_stays():
    one_left = NodeReading("recorded", (GpuReading(0, "GPU-aaaa", counters={}),), boot_id="boot-1")
    runs = replay(HEALTHY_AFTER_TRANSFER[:1] + [(10, one_left), (20, one_left)])
    expected = ["GPU 1 (GPU-bbbb, PCI 0000:2a:00.0) answered at the last run and is missing now: fallen off the bus?"]
    assert faults(runs[1]) == expected and faults(runs[2]) == expected
    driver_gone = NodeReading("nvml", boot_id="boot-1", error="NVML did not initialise (Driver Not Loaded)")
    v = replay([(30, driver_gone)], prev=runs[0].state)[0]
    assert len(faults(v)) == 2 and "(NVML did not initialise (Driver Not Loaded))" in faults(v)[0]


def test_a_swapped_gpu_is_a_new_baseline():
    swapped = NodeReading("recorded", (GpuReading(0, "GPU-aaaa"), GpuReading(1, "GPU-cccc")), boot_id="boot-1")
    v = replay(HEALTHY_AFTER_TRANSFER[:1] + [(10, swapped)])[-1]
    assert faults(v) == [] and any("GPU 1 (GPU-cccc) is new since the last run" in n for n in v.notes)


def test_dcgm_failures_fail_but_its_nvlink_incidents_and_warnings_do_not():
    incidents = (Incident("Memory system", "Failure", "A DBE has occurred"),
                 Incident("NVLINK system", "Failure", "Detected 3 NvLink replay errors"),
                 Incident("PCIe system", "Warning", "PCIe replay rate"))
    (v,) = replay([(0, node({}, incidents=incidents))])
    assert faults(v) == ["GPU 0: DCGM Memory system: Failure: A DBE has occurred"]
    assert len([f for f in v.findings if f.warning]) == 2


def test_live_and_injected_xids_count_even_on_a_first_run():
    r = NodeReading("nvml", (GpuReading(0, "GPU-aaaa"),), (XidEvent(79, "GPU 0", None, "injected"),), "boot-1")
    (v,) = replay([(0, r)])
    assert faults(v) == ["XID 79 on GPU 0 (injected)"]


# ---- sequences the GPU benchmark recorded (bench/results/gpu-healthcheck*.json) ---------------

def _recorded_sequences():
    out = []
    for path in sorted((ROOT / "bench" / "results").glob("gpu-healthcheck*.json")):
        doc = json.loads(path.read_text())
        if doc.get("recorded_readings") and not doc.get("settings", {}).get("dry_run"):
            out.append(pytest.param(doc["recorded_readings"], id=path.name))
    return out


@pytest.mark.parametrize("sequence", _recorded_sequences())
def test_recorded_healthy_gpu_sequences_replay_healthy(sequence):
    from trainmover.healthcheck.readings import reading_from_dict
    runs = replay([(r["time"] - T0, reading_from_dict(r["reading"])) for r in sequence])
    assert [faults(v) for v in runs] == [[] for _ in runs]


def test_drain_p2p_recovery_action_is_only_a_warning():
    (v,) = replay([(0, node({}, recovery_action=3))])
    assert faults(v) == [] and any("driver recovery action 3" in f.detail for f in v.findings if f.warning)


def test_a_link_that_goes_inactive_keeps_its_base_and_is_judged_when_back():
    bases = {"nvlink2": {"crc_flit": Base(0, T0, 0)}, "nvlink3": {"crc_flit": Base(0, T0, 0)}}
    cv = judge_counters(bases, {"nvlink3": {"crc_flit": 0}}, T0 + 10, RatePolicy())
    assert cv.gone == ("nvlink2",) and cv.bases["nvlink2"] == bases["nvlink2"]
    back = judge_counters(cv.bases, {"nvlink2": {"crc_flit": 9000}, "nvlink3": {"crc_flit": 0}}, T0 + 20, RatePolicy())
    assert [r.link for r in back.faults] == ["nvlink2"]
    (v,) = replay([(0, node({"nvlink2": {"replay": 1}}))])
    (w,) = replay([(10, node({}))], prev=v.state)
    assert [f.detail for f in w.findings if f.warning] == ["GPU 0: warning: NVLink 2 is not active now (it was at an earlier run)"]
