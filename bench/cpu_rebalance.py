"""Scheduled rebalancing on the CPU local cluster: a node moves to a warm standby every N
steps; the run's ETTR is measured, and scaled to the paper's 10-minute interval.

    .venv/bin/python bench/cpu_rebalance.py --every 150 --steps 1200

ETTR = productive time / elapsed time, with productive time = steps x steady step (median
interval of steps away from any switch). On this machine every "node" shares 2 cores, so
a standby warming up after a refill also slows the live ranks: the measured ETTR counts that
too. The 10-minute figure is 1 - (mean pause per migration) / 600 s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402
from trainmover import cluster  # noqa: E402
from trainmover.slurm import commands  # noqa: E402
from trainmover.slurm.client import CliSlurm  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=int, default=150)
    ap.add_argument("--steps", type=int, default=1200)
    args = ap.parse_args()
    info = cluster.up(nodes=4, standby=2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    env.update(SLURM_CONF=str(info.slurm_conf), TM_STEPS=str(args.steps), TM_REBALANCE_EVERY_STEPS=str(args.every))
    slurm = CliSlurm(slurm_conf=str(info.slurm_conf))
    workdir = ROOT / "runs" / "bench"
    workdir.mkdir(parents=True, exist_ok=True)
    job = int(commands.run(["sbatch", "--parsable", f"--chdir={workdir}", "--job-name=tm-rebalance",
                            str(ROOT / "sbatch_templates/demo_gpt_cpu.sbatch")], timeout=15, env=env).stdout.split(";")[0])
    deadline = time.monotonic() + 900
    while slurm.job(job).state in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job} did not finish within 900 s")
        time.sleep(2)
    run = workdir / "runs" / str(job)
    status = json.loads((run / "status.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    migrations = [m for m in status["migrations"] if m["state"] == "done"]
    switches = {m["switch_step"] for m in migrations}
    t = {r["step"]: r["t"] for r in rows}
    quiet = [t[k + 1] - t[k] for k in t if k + 1 in t and k > 10 and all(abs(k - s) > 2 for s in switches)]
    steady = statistics.median(quiet)
    elapsed = t[max(t)] - t[min(t)]
    ettr = (len(t) - 1) * steady / elapsed
    downs = [m["downtime_s"] for m in migrations if m["downtime_s"] is not None]
    result = {
        "scenario": "rebalance-cpu-demo", "machine": "cpu-local-cluster", "gpus": "none",
        **results_io.provenance(__file__),
        "settings": {"steps": args.steps, "rebalance_every_steps": args.every, "workers": 3, "standbys": 1},
        "metrics": {"migrations": len(migrations), "triggers": sorted({m["trigger"] for m in migrations}),
                    "downtime_s_each": downs, "steady_step_s": steady, "elapsed_s": elapsed,
                    "ettr_measured": ettr, "migration_interval_s": args.every * steady,
                    "ettr_at_10min_intervals": 1 - statistics.mean(downs) / 600 if downs else None,
                    "digest": json.loads((run / "final.json").read_text())["digest"]},
    }
    results_io.write(results_io.stamped("cpu-rebalance"), result)


if __name__ == "__main__":
    main()
