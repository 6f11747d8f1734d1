"""`trainmover plan`: ETTR and GPU-hours lost per standby pool size, the best size, and the
reservation for a set of jobs; from the site's rates, a node MTBF, or the cluster's history."""
from __future__ import annotations

import argparse
import json
import math

from trainmover.errors import ConfigError
from trainmover.simulate.inputs import TM_PROFILES
from trainmover.standbys import history, site as site_rates
from trainmover.standbys.model import best_size, pool_table, reservation

RESERVATION_QUANTILE = 0.99


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the site's, else 8)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--node-mtbf-h", type=float, help="hours between interruptions of one node")
    src.add_argument("--from-runs", nargs="+", metavar="DIR",
                     help="rates from the jobs' journals (runs/<job>/journal.jsonl) under these directories")
    src.add_argument("--from-sacct", metavar="SINCE", help="rates from Slurm accounting since this date (NODE_FAIL jobs)")
    p.add_argument("--job-rate-per-h", type=float, help="interruptions per hour of any job, whatever its size")
    p.add_argument("--planned-fraction", type=float, help="share of planned interruptions")
    p.add_argument("--replenish-h", type=float, help="hours until a used standby is warm again")
    p.add_argument("--repair-h", type=float, help="hours until a node that left is back in the reservation")
    p.add_argument("--checkpoint-interval-min", type=float, help="minutes of training between checkpoints")
    p.add_argument("--tm-profile", choices=sorted(TM_PROFILES), help="TrainMover downtimes (see trainmover simulate)")
    p.add_argument("--site", metavar="PATH", help=f"the site file (default {site_rates.DEFAULT_SITE_FILE}; "
                   "missing: the published rates)")
    p.add_argument("--max-standbys", type=int, help="largest pool size in the table (default: past the best size)")
    p.add_argument("--jobs", metavar="LIST", help="the set of jobs for the reservation: GPU counts, NxCOUNT "
                   "for several alike, e.g. 32768,8192x4 (default: this one job)")
    p.add_argument("--monte-carlo", type=int, metavar="TRIALS", default=0,
                   help="also run the simulator's Monte-Carlo (1 year x TRIALS) per pool size, beside the model")
    p.add_argument("--cluster", action="store_true",
                   help="also say where a job's standbys come from on this cluster (asks Slurm: scontrol show config "
                        "and the reservation; TM_RESERVATION, TM_SLURM_EXPANSION_FIX, TM_INJOB_STANDBYS as the job would have "
                        "them: reservation-grow, in-job or none)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of ETTR and GPU-hours lost per pool size (needs matplotlib)")


def parse_jobs(raw: str) -> list[int]:
    out = []
    for item in (x.strip() for x in raw.split(",") if x.strip()):
        n, _, count = item.partition("x")
        try:
            out += [int(n)] * (int(count) if count else 1)
        except ValueError:
            raise ConfigError(f"--jobs: {item!r} is not GPUS or GPUSxCOUNT") from None
    if not out or len(out) > 10000:
        raise ConfigError(f"--jobs {raw!r}: expected 1 to 10000 jobs")
    return out


def rates_from_args(args: argparse.Namespace) -> tuple[site_rates.SiteRates, dict | None]:
    """The site's rates with the command line's over them; and the history they came from."""
    base = site_rates.load(args.site)
    given = {k: getattr(args, k) for k in ("gpus_per_node", "node_mtbf_h", "job_rate_per_h", "planned_fraction",
                                           "replenish_h", "repair_h", "checkpoint_interval_min", "tm_profile")
             if getattr(args, k) is not None}
    past, sources = None, [base.source]
    if args.from_runs or args.from_sacct:
        h = history.from_journals(args.from_runs) if args.from_runs else history.from_sacct(args.from_sacct)
        sources.append(f"the history of {h.source}")
        given.setdefault("node_mtbf_h", h.node_mtbf_h())
        given.setdefault("job_rate_per_h", 0.0)
        if args.from_runs:
            given.setdefault("planned_fraction", h.planned / h.events)
            if h.replenish_h is not None:
                given.setdefault("replenish_h", h.replenish_h)
        past = h.to_json()
    if not given:
        return base, past
    if any(getattr(args, k) is not None for k in given):
        sources.append("the command line")
    return site_rates.from_mapping(given, ", ".join(sources), base), past


def plan(args: argparse.Namespace) -> dict:
    rates, past = rates_from_args(args)
    g = rates.gpus_per_node
    if args.gpus < g or args.gpus % g:
        raise ConfigError(f"--gpus must be a positive multiple of {g} (GPUs per node), got {args.gpus}")
    job = rates.job(args.gpus)
    best = best_size(job)
    top = args.max_standbys if args.max_standbys is not None else max(best + 2, 3)
    if not 0 <= top <= 64:
        raise ConfigError(f"--max-standbys must be in 0..64, got {top}")
    rows = pool_table(job, top)
    jobs = parse_jobs(args.jobs) if args.jobs else [args.gpus]
    if any(n < g or n % g for n in jobs):
        raise ConfigError(f"--jobs: every job's GPUs must be a positive multiple of {g}")
    specs = [rates.job(n) for n in jobs]
    pools = [min(max(best_size(j), rates.min_standbys), rates.max_standbys) for j in specs]
    res = reservation(specs, pools, rates.repair_h, RESERVATION_QUANTILE)
    res["jobs"] = [{"gpus": n, "standbys": k} for n, k in zip(jobs, pools)]
    nxt = rows[best + 1].value_gpus if best + 1 < len(rows) else None
    out = {"inputs": {"gpus": args.gpus, "nodes": job.nodes, "rates": rates.to_json(), "history": past,
                      "event_rate_per_h": job.rate_per_h, "job_mttf_h": 1 / job.rate_per_h if job.rate_per_h else None,
                      "restart_s": job.restart_s, "tm_planned_s": job.tm_planned_s, "tm_unplanned_s": job.tm_unplanned_s},
           "pools": [{**r.__dict__, "total_gpu_hours_per_week": r.total_gpu_hours_per_week} for r in rows],
           "best": {"standbys": best, "next_standby_gpus": nxt, "cost_gpus": g},
           "reservation": res}
    if args.monte_carlo:
        out["monte_carlo"] = monte_carlo(rates, args.gpus, top, args.monte_carlo)
    return out


def monte_carlo(rates: site_rates.SiteRates, gpus: int, top: int, trials: int) -> list[dict]:
    """The simulator's kernel on the same inputs (1 year per trial), for each pool size."""
    from trainmover.simulate.inputs import Scenario
    from trainmover.simulate.kernel import TRAINMOVER
    from trainmover.simulate.model import run_mode   # numba: only when asked
    if rates.gpus_per_node != 8:
        raise ConfigError("--monte-carlo: the simulator models 8 GPUs per node")
    sc = Scenario(gpus=gpus, trials=trials, planned_fraction=rates.planned_fraction, tm_profile=rates.tm_profile,
                  checkpoint_interval_h=rates.checkpoint_interval_min / 60.0, replenish_h=rates.replenish_h)
    out = []
    for k in range(top + 1):
        r = run_mode(sc, TRAINMOVER, standbys=k, rate_per_h=rates.rate_per_h(gpus))
        out.append({"standbys": k, "ettr": float(r[:, 0].mean()), "ettr_stderr": float(r[:, 0].std(ddof=1) / trials ** 0.5)
                    if trials > 1 else 0.0, "blocked": float(r[:, 2].sum() / max(r[:, 1].sum(), 1))})
    return out


def format_text(result: dict) -> str:
    i, b, res = result["inputs"], result["best"], result["reservation"]
    r = i["rates"]
    rates = site_rates.SiteRates(**r)
    lines = [f"{i['gpus']:,} GPUs ({i['nodes']:,} nodes x {r['gpus_per_node']}), job MTTF {site_rates.hours(i['job_mttf_h'])}: "
             f"{rates.describe()}",
             f"checkpoint-restart {i['restart_s']:.0f} s + progress since a checkpoint (every {r['checkpoint_interval_min']:g} min); "
             f"TrainMover {i['tm_planned_s']:g} s planned / {i['tm_unplanned_s']:g} s unplanned"]
    if i["history"]:
        h = i["history"]
        lines.append(f"history: {h['planned']} planned + {h['unplanned']} unplanned interruptions in "
                     f"{site_rates.hours(h['node_hours'])} of node time ({h['source']})"
                     + (f"; {h['refills']} standby refill(s), {site_rates.hours(h['replenish_h'])} on average"
                        if h.get("refills") else "")
                     # a count of n events pins a rate to about 1/sqrt(n) (Poisson)
                     + f"; the rate is known to about +-{100 / math.sqrt(h['planned'] + h['unplanned']):.0f}%")
    mc = {m["standbys"]: m for m in result.get("monte_carlo", [])}
    head = f"{'standbys':>8} {'ETTR':>8} {'no standby':>10} {'GPU-h lost/wk':>14} {'standby GPU-h/wk':>16} {'total GPU-h/wk':>14} {'value of this standby':>22}"
    lines.append(head + (f" {'Monte-Carlo ETTR':>18}" if mc else ""))
    for p in result["pools"]:
        value = f"{p['value_gpus']:,.1f} GPUs" if p["standbys"] else "-"
        row = (f"{p['standbys']:>8} {p['ettr']:8.4f} {p['blocked']:10.1%} {p['lost_gpu_hours_per_week']:14,.0f} "
               f"{p['standby_gpu_hours_per_week']:16,.0f} {p['total_gpu_hours_per_week']:14,.0f} {value:>22}")
        if p["standbys"] in mc:
            m = mc[p["standbys"]]
            row += f" {m['ettr']:10.4f} +-{m['ettr_stderr']:.5f}"
        lines.append(row + ("  <- best" if p["standbys"] == b["standbys"] else ""))
    nxt = "" if b["next_standby_gpus"] is None else (f": one more would add {b['next_standby_gpus']:,.1f} training GPUs, "
                                                     f"less than the {b['cost_gpus']} it costs")
    lines.append(f"best pool: {b['standbys']} standby(s){nxt}")
    sizes = {}
    for j in res["jobs"]:
        sizes[(j["gpus"], j["standbys"])] = sizes.get((j["gpus"], j["standbys"]), 0) + 1
    which = ", ".join(f"{n}x {g:,} GPUs ({k} standby(s) each)" for (g, k), n in sizes.items())
    lines.append(f"reservation for {which}, as TM_STANDBYS=auto picks: {res['held_standbys']} held as standbys + {res['spare_nodes']} for refills "
                 f"({res['events_per_h']:.2f} interruptions/h, a node back after {res['repair_h']:g} h: "
                 f"{res['nodes_out_mean']:.1f} out on average, {res['quantile']:.0%} quantile) = {res['nodes']} nodes")
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed: pip install 'trainmover[simulate]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ks = [p["standbys"] for p in result["pools"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
    a1.plot(ks, [p["ettr"] for p in result["pools"]], marker="o", label="model")
    if result.get("monte_carlo"):
        a1.plot(ks, [m["ettr"] for m in result["monte_carlo"]], marker="x", linestyle="--", label="Monte-Carlo")
        a1.legend()
    a1.set_xlabel("standbys")
    a1.set_ylabel("ETTR")
    a2.plot(ks, [p["lost_gpu_hours_per_week"] for p in result["pools"]], marker="o", label="lost to interruptions")
    a2.plot(ks, [p["total_gpu_hours_per_week"] for p in result["pools"]], marker="o", label="+ standbys held")
    a2.axvline(result["best"]["standbys"], color="grey", linestyle=":", label="best")
    a2.set_xlabel("standbys")
    a2.set_ylabel("GPU-hours per week")
    a2.set_yscale("log")
    a2.legend()
    i = result["inputs"]
    fig.suptitle(f"{i['gpus']:,} GPUs, job MTTF {i['job_mttf_h']:.2f} h", fontsize=10)
    for ax in (a1, a2):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise ConfigError(f"--plot {path}: cannot write the plot: {exc}") from None
    finally:
        plt.close(fig)


def standby_mode() -> str:
    """`--cluster`: the standby mode a job submitted from here gets (slurm/submit.py), with this
    environment's reservation, declaration setting and TM_INJOB_STANDBYS (in-job standbys where
    grow is not possible), which the job inherits."""
    from trainmover.config import Config
    from trainmover.slurm.submit import standby_mode as ask
    try:
        cfg = Config.from_env()
    except ConfigError:
        cfg = Config()
    return ask(cfg.reservation, cfg.slurm_expansion_fix, in_job=cfg.injob_standbys)


def main(args: argparse.Namespace) -> int:
    result = plan(args)
    if args.plot:
        write_plot(result, args.plot)
        result["plot"] = args.plot
    if args.cluster:
        result["cluster"] = {"standby_mode": standby_mode()}
    text = format_text(result) + (f"\n{result['cluster']['standby_mode']}" if args.cluster else "")
    print(json.dumps(result, indent=1) if args.json else text)
    return 0
