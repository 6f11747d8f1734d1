"""The ETTR simulator against closed-form cases, its input validation and its CLI."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")

from trainmover.cli import main as cli_main
from trainmover.errors import ConfigError
from trainmover.simulate import inputs
from trainmover.simulate.inputs import Scenario
from trainmover.simulate.kernel import CKPT, ELASTIC, TRAINMOVER
from trainmover.simulate.model import run_mode, simulate

REPO = Path(__file__).resolve().parents[2]


def _sc(**kw):
    base = dict(gpus=1024, years=1.0, trials=200, standbys=1, seed=7)
    base.update(kw)
    return Scenario(**base)


def test_no_failures_gives_ettr_one():
    sc = _sc()
    for mode in (CKPT, ELASTIC, TRAINMOVER):
        res = run_mode(sc, mode, rate_per_h=0.0)
        assert np.all(res[:, 0] == 1.0) and np.all(res[:, 1] == 0)


@pytest.mark.parametrize("fixed", [True, False])
def test_fixed_downtime_gives_closed_form_ettr(fixed):
    # Elastic without rollback: every event costs exactly elastic_s. Renewal: ETTR = 1/(1 + rate*D).
    sc = _sc(gpus=8192, trials=300)
    rate, d_h = 0.5, sc.elastic_s / 3600.0
    ettr = run_mode(sc, ELASTIC, fixed_interarrival=fixed, rate_per_h=rate)[:, 0]
    expect = 1.0 / (1.0 + rate * d_h)
    tol = 1e-4 if fixed else 5 * ettr.std(ddof=1) / math.sqrt(len(ettr)) + 1e-5
    assert abs(ettr.mean() - expect) < tol
    assert abs(ettr.mean() - (1.0 - d_h * rate)) < (rate * d_h) ** 2 + tol   # first order: 1 - downtime*rate


def test_expected_number_of_events_is_rate_times_horizon():
    sc = _sc(trials=400, tm_planned_s=0.0, tm_unplanned_s=0.0, standbys=64, replenish_h=0.0)
    rate = 0.3
    events = run_mode(sc, TRAINMOVER, rate_per_h=rate)[:, 1]     # zero downtime: no time is skipped
    expect = rate * sc.horizon_h
    assert abs(events.mean() - expect) < 5 * math.sqrt(expect / len(events))


def test_lost_progress_matches_closed_form():
    # Unplanned only, instant restart: lost per event = E[X mod C], X ~ Exp(rate).
    sc = _sc(planned_fraction=0.0, trials=400, checkpoint_interval_h=0.5)
    rate, c = 0.4, 0.5
    res = run_mode(sc, CKPT, rate_per_h=rate)
    lost_per_event = res[:, 3].sum() / res[:, 1].sum()
    expect = 1 / rate - c * math.exp(-rate * c) / (1 - math.exp(-rate * c))
    assert abs(lost_per_event - expect) < 0.01 * c


def test_trainmover_with_zero_standbys_equals_checkpoint_restart():
    sc = _sc(standbys=0)
    a, b = run_mode(sc, CKPT), run_mode(sc, TRAINMOVER)
    assert np.array_equal(a[:, [0, 1, 3]], b[:, [0, 1, 3]])   # ETTR, events, lost progress
    assert np.all(b[:, 2] == b[:, 1])      # every event fell back


def test_results_do_not_depend_on_thread_count():
    import numba
    sc = _sc(trials=50)
    a = run_mode(sc, TRAINMOVER)
    old = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        b = run_mode(sc, TRAINMOVER)
    finally:
        numba.set_num_threads(old)
    assert np.array_equal(a, b)


def test_ordering_and_standby_value():
    r = simulate(_sc(gpus=32768, trials=100, standbys=2))
    m = r["models"]
    assert m["checkpoint-restart"]["ettr"] < m["elastic"]["ettr"] < 1
    assert m["checkpoint-restart"]["ettr"] < m["trainmover"]["ettr"] < 1
    v = r["value_of_standby"]
    assert [x["standbys"] for x in v] == [1, 2]
    assert v[0]["training_gpus"] > v[1]["training_gpus"] > 0     # diminishing returns
    small = simulate(_sc(gpus=1024, trials=100))["value_of_standby"][0]["training_gpus"]
    assert small < v[0]["training_gpus"] / 10


def test_rate_fits_pass_through_published_points():
    assert inputs.event_rate_per_h(1024, "affine") == pytest.approx(1 / 7.9)
    assert inputs.event_rate_per_h(16384, "affine") == pytest.approx(1 / 2.7)
    assert inputs.event_rate_per_h(1024, "per-gpu-1k") == pytest.approx(1 / 7.9)
    assert inputs.event_rate_per_h(16384, "per-gpu-16k") == pytest.approx(1 / 2.7)
    assert inputs.PLANNED_FRACTION == pytest.approx(47 / 466)


def test_restart_time_table():
    assert inputs.restart_s(1024) == 300 and inputs.restart_s(8192) == 390
    assert inputs.restart_s(16) == 80
    assert inputs.restart_s(32768) == pytest.approx(450)


def test_measured_downtimes_match_bench_results():
    gpu = REPO / "bench/results/gpu-planned-1b-gpu1.json"
    cpu = REPO / "bench/results/cpu-planned-20261121-105518.json"
    if not gpu.exists() or not cpu.exists():
        pytest.skip("bench/results not in this checkout")
    assert json.loads(gpu.read_text())["metrics"]["planned_downtime_s"] == inputs.GPU_MEASURED_PLANNED_S
    assert json.loads(cpu.read_text())["metrics"]["planned_downtime_s"] == inputs.CPU_MEASURED_PLANNED_S
    gpu_f = REPO / "bench/results/gpu-failure-1b-gpu1-20261121.json"
    cpu_f = REPO / "bench/results/cpu-failure-20261121-140921.json"
    assert json.loads(gpu_f.read_text())["metrics"]["unexpected_downtime_s"] == inputs.GPU_MEASURED_UNPLANNED_S
    assert json.loads(cpu_f.read_text())["metrics"]["unexpected_downtime_s"] == inputs.CPU_MEASURED_UNPLANNED_S


@pytest.mark.parametrize("kw, words", [
    (dict(gpus=1004), "multiple of 8"),
    (dict(gpus=0), "multiple of 8"),
    (dict(years=0), "--years"),
    (dict(trials=0), "--trials"),
    (dict(standbys=-1), "--standbys"),
    (dict(rate_fit="cubic"), "rate fit"),
    (dict(planned_fraction=1.5), "planned fraction"),
    (dict(checkpoint_interval_h=0), "--checkpoint-interval-min"),
    (dict(replenish_h=-1), "--replenish-h"),
    (dict(tm_profile="magic"), "profile"),
    (dict(tm_planned_s=-1.0), "--tm-planned-s"),
])
def test_invalid_inputs_are_clear_errors(kw, words):
    with pytest.raises(ConfigError, match=words):
        _sc(**kw)


def test_cli_json_parses(capsys):
    assert cli_main(["simulate", "--gpus", "2048", "--trials", "20", "--standbys", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["models"]) == {"checkpoint-restart", "elastic", "trainmover"}
    assert out["inputs"]["gpus"] == 2048 and len(out["value_of_standby"]) == 2
    assert 0 < out["models"]["trainmover"]["ettr"] <= 1


def test_cli_table_and_plot(capsys, tmp_path):
    png = tmp_path / "ettr.png"
    assert cli_main(["simulate", "--gpus", "1024", "--trials", "5", "--years", "0.1", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "checkpoint-restart" in out and "value of standby #1" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_input_exits_2(capsys):
    assert cli_main(["simulate", "--gpus", "1001", "--trials", "5"]) == 2
    assert "multiple of 8" in capsys.readouterr().err
