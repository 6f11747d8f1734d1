"""Checkpoint-restart baseline on the CPU local cluster, timed phase by phase (issue #9).

    .venv/bin/python bench/cpu_checkpoint_restart.py --scenario planned|failure [--ranks 3] [--repeats 3]

The same workload as TrainMover's demo (gpt_demo tiny, DDP over gloo, one rank per node)
runs as a plain Slurm job (bench/sbatch/baseline_gpt_cpu.sbatch, trainer:
trainmover/baseline/trainer.py). Rank 1's node is then taken away:

* planned: the node is drained and the job gets SIGUSR1 (what an operator or the site's
  automation sends); at the next step boundary every rank saves a checkpoint to the run
  directory (shared storage), then the job ends;
* failure: the node is set DOWN (what slurmctld does when it loses a node; Slurm kills the
  job); the last periodic checkpoint (`--ckpt-every`) is all there is, the steps since are lost.

The driver (this script, standing in for the site's resubmission automation) sees the job
leave RUNNING (polling squeue every 50 ms) and resubmits the same script on the same run
directory; Slurm starts it on healthy nodes, the trainer rendezvouses, builds the model, loads
the checkpoint and runs its first step. `trainmover/baseline/phases.py` turns the records into
phases. Uses its own cluster (--cluster-dir), never the test cluster. Writes
bench/results/cpu-baseline-<scenario>-<time>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402
from bench.polling import read_jsonl, wait  # noqa: E402
from trainmover import cluster  # noqa: E402
from trainmover.baseline import phases  # noqa: E402
from trainmover.baseline.slurm_ops import SlurmOps, left_running  # noqa: E402
from trainmover.slurm.client import CliSlurm  # noqa: E402

SCRIPT = ROOT / "bench" / "sbatch" / "baseline_gpt_cpu.sbatch"
REASON = "trainmover-bench baseline"
CLUSTER_DIR = "/var/tmp/trainmover-cluster-bench"
DETECT_NOTE = ("planned: the driver signals the job right after the drain; failure: the driver sets the node "
               "DOWN itself, so Slurm's detection is instant here (a silent node is declared down only after "
               "SlurmdTimeout: 30 s on this cluster, 300 s by default)")
GONE = {"", "COMPLETED", "CANCELLED", "FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def restore_nodes(slurm: CliSlurm) -> None:
    """Return nodes this benchmark drained or downed to service (and only those)."""
    for name, node in slurm.nodes().items():
        if node.reason.startswith("trainmover-bench") and ("DRAIN" in node.flags or node.base_state == "DOWN"):
            slurm.resume(name)


def cancel_all(ops: SlurmOps) -> list[int]:
    """Cancel every job of the benchmark's own cluster (after a failed trial)."""
    ids = [int(x) for x in ops._run(["squeue", "-h", "-o", "%i"], check=False).stdout.split() if x.isdigit()]
    for j in ids:
        ops.cancel(j)
    return ids


def rank_node(run: Path, gen: str, rank: int, slurm: CliSlurm, job_nodes) -> str:
    """The node rank `rank` of generation `gen` runs on (from the address it reported)."""
    addr = next(e["addr"] for e in read_jsonl(run / "events" / f"r{rank}.jsonl")
                if e["gen"] == gen and e["event"] == "process_start")
    return next(n for n, info in slurm.nodes(list(job_nodes)).items() if info.addr == addr)


def baseline_trial(ops: SlurmOps, slurm: CliSlurm, workdir: Path, *, ranks: int, scenario: str, steps: int,
                   event_at: int, ckpt_every: int, tag: str, start_timeout: float = 300) -> dict:
    """One stop-and-restart of the baseline job; returns its phases (see module docstring)."""
    restore_nodes(slurm)
    run = workdir / f"baseline-{scenario}-{ranks}r-{tag}"
    args = [str(run), "--steps", str(steps), "--ckpt-every", str(ckpt_every), "--timeout-s", "300"]
    job = ops.submit(str(SCRIPT), args, nodes=ranks, chdir=str(workdir), job_name="tm-baseline")
    metrics = run / "metrics.jsonl"
    wait(f"baseline job {job}: step {event_at}", lambda: (read_jsonl(metrics)[-1:] or [{}])[0].get("step", 0) >= event_at,
         start_timeout)
    gen = read_jsonl(metrics)[-1]["gen"]
    leaver = rank_node(run, gen, 1, slurm, slurm.job(job).nodes)
    t_event = time.time()
    if scenario == "planned":
        slurm.drain(leaver, REASON)
        ops.signal(job, "USR1")
    else:
        ops.node_down(leaver, REASON)
    t_left, state = ops.wait_state(job, left_running, "the job leaving RUNNING", timeout=120)
    # --exclude: with ReturnToService=2 a node set DOWN whose slurmd still answers is back in
    # service within a second; the restarted job must not land on the node it replaces.
    new = ops.submit(str(SCRIPT), args, nodes=ranks, chdir=str(workdir), job_name="tm-baseline", exclude=[leaver])
    t_resub = time.time()
    last_before = max(m["step"] for m in read_jsonl(metrics) if m["gen"] == gen)

    def progressed():
        rows = [m for m in read_jsonl(metrics) if m["gen"] != gen]
        return rows and rows[-1]["step"] >= max(last_before, rows[0]["step"] + 10)
    wait(f"restarted job {new} to pass step {last_before}", progressed, start_timeout)
    ops.cancel(new)
    ops.wait_state(new, lambda s: s in GONE, "the restarted job to end", timeout=60, interval=0.2)
    ops.wait_state(job, lambda s: s in GONE, "the first job to end", timeout=60, interval=0.2)
    restore_nodes(slurm)
    events = [e for p in sorted((run / "events").glob("r*.jsonl")) for e in read_jsonl(p)]
    r = phases.analyse(scenario, t_event, read_jsonl(run / "batch.jsonl"), events, read_jsonl(metrics),
                       {"job_left": t_left, "resubmitted": t_resub})
    saved = [e for e in events if e["event"] == "checkpoint_saved" and e["gen"] == r.old_gen]
    loaded = [e for e in events if e["event"] == "checkpoint_loaded" and e["gen"] == r.new_gen]
    periodic = [e["save_s"] for e in saved if e["reason"] == "periodic"]
    return {"job_id": job, "restart_job_id": new, "ranks": ranks, "leaver": leaver, "state_seen": state,
            **r.to_json(), "checkpoint_bytes": sum(e["bytes"] for e in loaded if e["rank"] == 0) or None,
            "checkpoint_load_read_s": max((e["read_s"] for e in loaded), default=None),
            "periodic_checkpoint_save_s": statistics.median(periodic) if periodic else None,
            "run_dir": str(run.relative_to(ROOT)) if run.is_relative_to(ROOT) else str(run)}


def summary(trials: list[dict], scenario: str) -> dict:
    key = "baseline_downtime_s" if scenario == "planned" else "baseline_unexpected_downtime_s"
    downs = [t["downtime_s"] for t in trials]
    by_phase: dict[str, list[float]] = {}
    for t in trials:
        for p in t["phases"]:
            by_phase.setdefault(p["phase"], []).append(p["seconds"])
    out = {key: statistics.median(downs), f"{key}_all": downs,
           "baseline_phases_s": {k: statistics.median(v) for k, v in by_phase.items()},
           "baseline_steady_step_s": statistics.median(t["steady_step_s"] for t in trials)}
    if scenario == "failure":
        out["baseline_lost_steps_all"] = [t["lost_steps"] for t in trials]
        out["baseline_regained_s"] = statistics.median(t["regained_s"] for t in trials if t["regained_s"] is not None)
    return out


def cluster_env(cluster_dir: str, nodes: int, standby: int):
    info = cluster.up(nodes=nodes, standby=standby, state_dir=cluster_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    env.update(SLURM_CONF=str(info.slurm_conf))
    return info, env, CliSlurm(slurm_conf=str(info.slurm_conf))


def machine() -> dict:
    """Where it ran; the load average says how much else ran there (the CPU machine is shared)."""
    return {"machine": "cpu-local-cluster", "gpus": "none",
            "cpu": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
            "load_avg_1_5_15_min_at_end": [round(x, 2) for x in os.getloadavg()]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=("planned", "failure"), default="planned")
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100000, help="the job's length (it is cancelled after the restart)")
    ap.add_argument("--event-at", type=int, default=125, help="step after which the node is taken away")
    ap.add_argument("--ckpt-every", type=int, default=50, help="periodic checkpoint interval in steps")
    ap.add_argument("--cluster-dir", default=CLUSTER_DIR)
    ap.add_argument("--cluster-nodes", type=int, default=17, help="training nodes of the benchmark cluster (at least ranks + 1: the restarted job needs a healthy node in place of the one taken away)")
    args = ap.parse_args()
    info, env, slurm = cluster_env(args.cluster_dir, args.cluster_nodes, 2)
    ops = SlurmOps(env)
    workdir = ROOT / "runs" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    workdir.mkdir(parents=True, exist_ok=True)
    trials = [baseline_trial(ops, slurm, workdir, ranks=args.ranks, scenario=args.scenario, steps=args.steps,
                             event_at=args.event_at, ckpt_every=args.ckpt_every, tag=str(i)) for i in range(args.repeats)]
    result = {"scenario": f"baseline-{args.scenario}-cpu-demo", **machine(), **results_io.provenance(__file__),
              "settings": {"workload": "gpt_demo tiny", "workers": args.ranks, "backend": "gloo",
                           "ckpt_every": args.ckpt_every, "event_at": args.event_at,
                           "storage": "run directory on the local disk (the cluster's shared filesystem)",
                           "restart": "resubmission of the same batch script; Slurm picks healthy nodes",
                           "detect": DETECT_NOTE,
                           "slurm": "22.05.8 embedded, one machine"},
              "metrics": summary(trials, args.scenario), "trials": trials}
    results_io.write(results_io.stamped(f"cpu-baseline-{args.scenario}"), result)


if __name__ == "__main__":
    main()
