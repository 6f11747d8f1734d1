"""`trainmover simulate`: arguments, the table, --json and --plot."""
from __future__ import annotations

import argparse
import json
import time

from trainmover.errors import ConfigError
from trainmover.simulate.inputs import (DEFAULT_CHECKPOINT_INTERVAL_H, DEFAULT_REPLENISH_H, PLANNED_FRACTION,
                                        RATE_FITS, TM_PROFILES, Scenario)

PLOT_GPUS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job (a multiple of 8)")
    p.add_argument("--years", type=float, default=1.0, help="simulated wall-clock time per trial (default 1)")
    p.add_argument("--trials", type=int, default=1000, help="Monte-Carlo trials (default 1000)")
    p.add_argument("--standbys", type=int, default=1, help="pre-warmed standby nodes for TrainMover (default 1)")
    p.add_argument("--rate-fit", choices=RATE_FITS, default="affine",
                   help="how the event rate scales with GPUs (default affine: through 7.9 h at 1K and 2.7 h at 16K)")
    p.add_argument("--planned-fraction", type=float, default=PLANNED_FRACTION,
                   help=f"share of planned interruptions (default {PLANNED_FRACTION:.3f}: Llama 3, 47 of 466)")
    p.add_argument("--checkpoint-interval-min", type=float, default=DEFAULT_CHECKPOINT_INTERVAL_H * 60,
                   help=f"minutes of training between checkpoints (default {DEFAULT_CHECKPOINT_INTERVAL_H * 60:g})")
    p.add_argument("--replenish-h", type=float, default=DEFAULT_REPLENISH_H,
                   help=f"hours until a used standby slot is warm again (default {DEFAULT_REPLENISH_H:g})")
    p.add_argument("--tm-profile", choices=sorted(TM_PROFILES), default="paper",
                   help="TrainMover downtimes: paper (16.6 s / 21.1 s), gpu-measured (0.161 s planned), "
                        "cpu-measured (0.036 s planned); unplanned stays 21.1 s in all")
    p.add_argument("--tm-planned-s", type=float, help="override the planned-migration downtime, seconds")
    p.add_argument("--tm-unplanned-s", type=float, help="override the unexpected-failure downtime, seconds")
    p.add_argument("--elastic-rollback", action="store_true",
                   help="elastic -1/+1 also loses the progress since the last checkpoint on an unplanned event")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of ETTR vs GPUs (1K..128K) for the three models")


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    return Scenario(gpus=args.gpus, years=args.years, trials=args.trials, standbys=args.standbys,
                    rate_fit=args.rate_fit, planned_fraction=args.planned_fraction,
                    checkpoint_interval_h=args.checkpoint_interval_min / 60.0, replenish_h=args.replenish_h,
                    tm_profile=args.tm_profile, tm_planned_s=args.tm_planned_s, tm_unplanned_s=args.tm_unplanned_s,
                    elastic_rollback=args.elastic_rollback, seed=args.seed)


def format_table(result: dict) -> str:
    i = result["inputs"]
    lines = [
        f"{i['gpus']} GPUs, {i['years']:g} y x {i['trials']} trials; job MTTF {i['job_mttf_h']:.2f} h "
        f"({i['rate_fit']} fit), {i['planned_fraction']:.1%} planned, checkpoint every "
        f"{i['checkpoint_interval_h'] * 60:g} min, {i['standbys']} standby(s), replenished after {i['replenish_h']:g} h",
        f"{'model':<20} {'ETTR':>8} {'+-':>7} {'wasted GPU-h/week':>18} {'events/y':>9} {'fallbacks/y':>11}  downtime",
    ]
    for name, m in result["models"].items():
        lines.append(f"{name:<20} {m['ettr']:8.4f} {m['ettr_stderr']:7.4f} {m['wasted_gpu_hours_per_week']:18,.0f} "
                     f"{m['events_per_year']:9.0f} {m['fallbacks_per_year']:11.0f}  {m['downtime']}")
    for v in result["value_of_standby"]:
        lines.append(f"value of standby #{v['standbys']}: {v['training_gpus']:,.0f} +- {v['stderr_gpus']:,.0f} "
                     f"training GPUs (costs {v['cost_gpus']})")
    if "elapsed_s" in result:
        lines.append(f"simulated in {result['elapsed_s']:.2f} s")
    return "\n".join(lines)


def write_plot(curve: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ("checkpoint-restart", "elastic", "trainmover"):
        ax.plot(curve["gpus"], curve[name], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("ETTR")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    sc = scenario_from_args(args)
    from trainmover.simulate.model import ettr_curve, simulate   # imports numba: only when simulating
    t0 = time.perf_counter()
    result = simulate(sc)
    result["elapsed_s"] = time.perf_counter() - t0
    if args.plot:
        try:
            curve = ettr_curve(sc, PLOT_GPUS)
            write_plot(curve, args.plot, f"{sc.standbys} standby(s), {sc.tm_profile} TrainMover downtimes, "
                       f"{sc.trials} trials x {sc.years:g} y, {sc.rate_fit} rate fit")
        except OSError as exc:
            raise ConfigError(f"--plot {args.plot}: cannot write the plot: {exc}") from exc
        result["plot"] = {"path": args.plot, **curve}
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0
