"""Downtime against the number of ranks on the CPU local Slurm cluster (issue #9).

    .venv/bin/python bench/cpu_scaling.py [--ranks 4 8 16] [--repeats 3] [--baseline-repeats 1]

For each job size N (one rank per node, as the controller runs today): TrainMover's planned
migration of rank 1's node (bench/cpu_planned_migration.py), and the checkpoint-restart
baseline's planned stop-and-restart (bench/cpu_checkpoint_restart.py), on one embedded
cluster of max(N) + 1 training nodes and 2 standbys (its own state dir). Reports the
least-squares slope of downtime against N (seconds per rank; the same against stayers,
N - 1). Writes bench/results/cpu-scaling-<time>.json.

All ranks share this machine's cores: past a few ranks a step slows down with N, and so
does every restart phase that runs Python on all ranks at once. The slope measures this
machine as much as the method; the JSON keeps the steady step time per N next to it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cpu_planned_migration as tm_bench  # noqa: E402
from bench import results_io  # noqa: E402
from bench.cpu_checkpoint_restart import (CLUSTER_DIR, GONE, baseline_trial, cancel_all, cluster_env,  # noqa: E402
                                          machine, restore_nodes)
from trainmover.errors import TrainMoverError  # noqa: E402
from trainmover.baseline.slurm_ops import SlurmOps  # noqa: E402


def slope(xs: list[float], ys: list[float]) -> dict:
    """Least-squares line y = a + b x: {"slope": b, "intercept": a}; None without two distinct x."""
    if len(set(xs)) < 2:
        return {"slope": None, "intercept": None}
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"slope": b, "intercept": my - b * mx}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--repeats", type=int, default=3, help="TrainMover migrations per job size")
    ap.add_argument("--baseline-repeats", type=int, default=1, help="baseline restarts per job size (0: none)")
    ap.add_argument("--event-at", type=int, default=60, help="step after which the node is taken away")
    ap.add_argument("--cluster-dir", default=CLUSTER_DIR)
    args = ap.parse_args()
    nodes = max(args.ranks) + 1
    info, env, slurm = cluster_env(args.cluster_dir, nodes, 2)
    ops = SlurmOps(env)
    tm_env = {**env, "TM_STEPS": "100000"}  # cancelled after the migration
    workdir = ROOT / "runs" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    workdir.mkdir(parents=True, exist_ok=True)
    tm: dict[int, list] = {n: [] for n in args.ranks}
    base: dict[int, list] = {n: [] for n in args.ranks}
    failed: list[dict] = []
    for n in args.ranks:
        for i in range(args.repeats):
            restore_nodes(slurm)
            try:
                t = tm_bench.one(tm_env, slurm, workdir, 100000, nodes=n, at_step=args.event_at, start_timeout=600)
                ops.wait_state(t["job_id"], lambda s: s in GONE, "the TrainMover job to end", timeout=120, interval=0.2)
            except (TimeoutError, TrainMoverError) as exc:  # kept in the result, not hidden: a trial that failed
                failed.append({"ranks": n, "system": "trainmover", "trial": i, "error": f"{type(exc).__name__}: {exc}",
                               "cancelled": cancel_all(ops)})
                print(f"{n} ranks [{i}] trainmover trial failed: {exc}", flush=True)
                continue
            tm[n].append(t)
            print(f"{n} ranks [{i}] trainmover planned downtime {t['downtime_s']} (step {t['steady_step_s']:.4f}s)",
                  flush=True)
        for i in range(args.baseline_repeats):
            try:
                b = baseline_trial(ops, slurm, workdir, ranks=n, scenario="planned", steps=100000,
                                   event_at=args.event_at, ckpt_every=0, tag=str(i), start_timeout=600)
            except (TimeoutError, TrainMoverError) as exc:
                failed.append({"ranks": n, "system": "baseline", "trial": i, "error": f"{type(exc).__name__}: {exc}",
                               "cancelled": cancel_all(ops)})
                print(f"{n} ranks [{i}] baseline trial failed: {exc}", flush=True)
                continue
            base[n].append(b)
            print(f"{n} ranks [{i}] baseline planned downtime {b['downtime_s']}", flush=True)
    restore_nodes(slurm)
    args.ranks = [n for n in args.ranks if tm[n]]
    med = {n: statistics.median(t["downtime_s"] for t in tm[n]) for n in args.ranks}
    xs = [n for n in args.ranks for _ in tm[n]]
    ys = [t["downtime_s"] for n in args.ranks for t in tm[n]]
    metrics = {
        "ranks": args.ranks,
        "planned_downtime_s_by_ranks": {str(n): med[n] for n in args.ranks},
        "planned_downtime_s_all_by_ranks": {str(n): [t["downtime_s"] for t in tm[n]] for n in args.ranks},
        "planned_downtime_slope_s_per_rank": slope(xs, ys)["slope"],
        "planned_downtime_slope_s_per_rank_of_medians": slope(list(args.ranks), [med[n] for n in args.ranks])["slope"],
        "planned_downtime_intercept_s": slope(xs, ys)["intercept"],
        "steady_step_s_by_ranks": {str(n): statistics.median(t["steady_step_s"] for t in tm[n]) for n in args.ranks},
        "downtime_in_steps_by_ranks": {str(n): med[n] / statistics.median(t["steady_step_s"] for t in tm[n])
                                       for n in args.ranks},
        "phase1_s_by_ranks": {str(n): statistics.median(t["phase1_s"] for t in tm[n]) for n in args.ranks},
    }
    metrics["failed_trials"] = len(failed)
    if args.baseline_repeats and all(base[n] for n in args.ranks):
        bmed = {n: statistics.median(b["downtime_s"] for b in base[n]) for n in args.ranks}
        bx = [n for n in args.ranks for _ in base[n]]
        by = [b["downtime_s"] for n in args.ranks for b in base[n]]
        metrics.update({
            "baseline_downtime_s_by_ranks": {str(n): bmed[n] for n in args.ranks},
            "baseline_downtime_slope_s_per_rank": slope(bx, by)["slope"],
            "downtime_ratio_by_ranks": {str(n): med[n] / bmed[n] for n in args.ranks},
        })
    result = {"scenario": "scaling-cpu-demo", **machine(), **results_io.provenance(__file__),
              "settings": {"workload": "gpt_demo tiny", "ranks_per_node": 1, "standbys": 1, "backend": "gloo",
                           "event_at": args.event_at, "repeats": args.repeats,
                           "baseline_repeats": args.baseline_repeats,
                           "cluster": f"{nodes} training + 2 standby nodes, {info.state_dir}",
                           "slurm": "22.05.8 embedded, one machine"},
              "metrics": metrics,
              "trials": {"trainmover_planned": {str(n): v for n, v in tm.items()},
                         "baseline_planned": {str(n): v for n, v in base.items()}},
              "failed_trials": failed}
    results_io.write(results_io.stamped("cpu-scaling"), result)


if __name__ == "__main__":
    main()
