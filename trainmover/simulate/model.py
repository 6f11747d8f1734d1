"""Run the three downtime models for one Scenario and summarise them (a plain dict, JSON-ready)."""
from __future__ import annotations

import math
from dataclasses import asdict, replace

import numpy as np

from trainmover.simulate.inputs import GPUS_PER_NODE, Scenario
from trainmover.simulate.kernel import CKPT, ELASTIC, TRAINMOVER, run_trials

HOURS_PER_WEEK = 168.0


def run_mode(sc: Scenario, mode: int, standbys: int | None = None, fixed_interarrival: bool = False,
             rate_per_h: float | None = None) -> np.ndarray:
    """Raw (trials, 4) results of one mode (see kernel.run_trials)."""
    planned_s, unplanned_s = sc.tm_downtimes_s
    rate = sc.rate_per_h if rate_per_h is None else rate_per_h
    return run_trials(sc.trials, sc.seed, sc.horizon_h, rate, sc.planned_fraction, mode,
                      sc.restart_s / 3600.0, sc.elastic_s / 3600.0, sc.elastic_rollback,
                      planned_s / 3600.0, unplanned_s / 3600.0,
                      sc.standbys if standbys is None else standbys, sc.replenish_h,
                      sc.checkpoint_interval_h, fixed_interarrival)


def _summary(sc: Scenario, res: np.ndarray, downtime: str) -> dict:
    ettr = res[:, 0]
    se = float(ettr.std(ddof=1) / math.sqrt(len(ettr))) if len(ettr) > 1 else 0.0
    mean = float(ettr.mean())
    return {
        "ettr": mean,
        "ettr_stderr": se,
        "wasted_gpu_hours_per_week": (1.0 - mean) * sc.gpus * HOURS_PER_WEEK,
        "events_per_year": float(res[:, 1].mean() / sc.years),
        "fallbacks_per_year": float(res[:, 2].mean() / sc.years),
        "lost_progress_h_per_year": float(res[:, 3].mean() / sc.years),
        "downtime": downtime,
    }


def simulate(sc: Scenario) -> dict:
    """ETTR and wasted GPU-hours of checkpoint-restart, elastic -1/+1 and TrainMover.

    `value_of_standby[k-1]` is (ETTR with k standbys - ETTR with k-1) * gpus, in training GPUs,
    for k = 1..max(standbys, 1); one standby costs GPUS_PER_NODE idle GPUs.
    """
    planned_s, unplanned_s = sc.tm_downtimes_s
    ckpt = run_mode(sc, CKPT)
    elastic = run_mode(sc, ELASTIC)
    by_standbys = {0: ckpt}
    for k in range(1, max(sc.standbys, 1) + 1):
        by_standbys[k] = run_mode(sc, TRAINMOVER, standbys=k)
    tm = by_standbys[sc.standbys]
    models = {
        "checkpoint-restart": _summary(sc, ckpt, f"{sc.restart_s:.0f} s restart + progress since last checkpoint"),
        "elastic": _summary(sc, elastic, f"{sc.elastic_s:.0f} s (checkpoint load + communicators + warm-up)"
                            + (" + progress since last checkpoint" if sc.elastic_rollback else "")),
        "trainmover": _summary(sc, tm, f"{planned_s:g} s planned / {unplanned_s:g} s unplanned with a free standby "
                               f"({sc.standbys}), else checkpoint-restart"),
    }
    models["trainmover"]["standby_gpu_hours_per_week"] = sc.standbys * GPUS_PER_NODE * HOURS_PER_WEEK
    values = []
    for k in range(1, max(sc.standbys, 1) + 1):
        d = by_standbys[k][:, 0] - by_standbys[k - 1][:, 0]   # paired: same random stream per trial
        se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else 0.0
        values.append({"standbys": k, "training_gpus": float(d.mean() * sc.gpus),
                       "stderr_gpus": se * sc.gpus, "cost_gpus": GPUS_PER_NODE})
    inputs = asdict(sc)
    inputs.update({
        "horizon_h": sc.horizon_h,
        "event_rate_per_h": sc.rate_per_h,
        "job_mttf_h": 1.0 / sc.rate_per_h,
        "restart_s": sc.restart_s,
        "elastic_s": sc.elastic_s,
        "tm_planned_s": planned_s,
        "tm_unplanned_s": unplanned_s,
    })
    return {"inputs": inputs, "models": models, "value_of_standby": values}


def ettr_curve(sc: Scenario, gpus_list) -> dict:
    """ETTR of each model at each GPU count (other inputs from `sc`), for the plot."""
    curve = {"gpus": list(gpus_list), "checkpoint-restart": [], "elastic": [], "trainmover": []}
    for n in gpus_list:
        s = replace(sc, gpus=n)
        curve["checkpoint-restart"].append(float(run_mode(s, CKPT)[:, 0].mean()))
        curve["elastic"].append(float(run_mode(s, ELASTIC)[:, 0].mean()))
        curve["trainmover"].append(float(run_mode(s, TRAINMOVER)[:, 0].mean()))
    return curve
