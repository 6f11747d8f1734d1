"""Whole-node planned migration on the CPU local cluster: two ranks per node, TP2 inside it.

    .venv/bin/python bench/cpu_whole_node_migration.py [--repeats 1] [--steps 200] [--cluster-dir D]

sbatch_templates/megatron_gpt.sbatch on 2 nodes x 2 ranks (TP2 x PP2: each node holds one
pipeline stage's TP pair) plus one 2-process standby node. First an uninterrupted reference
job, then per repeat a job whose second node (ranks 2 and 3) is drained once step `--at-step`
is done and the standby node is warm: both ranks move at once, each into its slot. Records
the downtime as the controller computes it (the stayers' pause: last step before the switch
to the first after, minus one steady step), phase times, the state each moved rank received,
and whether every step's losses and every rank's final parameter+optimizer digest equal the
reference's. Jobs run one at a time. Writes bench/results/cpu-whole-node-<time>.json
(shared/reference/bench-results.md).
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
from bench.cpu_checkpoint_restart import machine  # noqa: E402
from bench.cpu_planned_migration import gantt  # noqa: E402
from bench.polling import read_jsonl, wait  # noqa: E402
from trainmover import cluster  # noqa: E402
from trainmover.controller.succession.keeper import sbatch_args  # noqa: E402
from trainmover.slurm import commands  # noqa: E402
from trainmover.slurm.client import CliSlurm  # noqa: E402

REASON = "trainmover-bench whole node"
LAYOUT = {"TM_TP": "2", "TM_PP": "2", "TM_DP": "1", "TM_RANKS_PER_NODE": "2"}
MOVED = (2, 3)  # the second node's ranks: pipeline stage 1, its TP pair
DONE = ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING")


def status(run: Path) -> dict:
    try:
        return json.loads((run / "status.json").read_text())
    except (FileNotFoundError, ValueError):  # not written yet, or being replaced
        return {}


def submit(env: dict, workdir: Path, name: str, **extra) -> tuple[int, Path]:
    job_env = {**env, **LAYOUT, **{k: str(v) for k, v in extra.items()}}
    out = commands.run(["sbatch", "--parsable", *sbatch_args(2), f"--job-name=tm-bench-{name}", f"--chdir={workdir}",
                        str(ROOT / "sbatch_templates/megatron_gpt.sbatch")], timeout=15, env=job_env).stdout
    job = int(out.strip().split(";")[0])
    return job, workdir / "runs" / str(job)


def finish(env: dict, slurm: CliSlurm, job: int, run: Path, timeout: float) -> tuple[dict, str]:
    """Wait for the job to end; its final.json (the controller's, after every rank finished)
    and a note on how Slurm ended it. Slurm sometimes requeues a resized job ("Batch JobId=N
    missing from batch node", docs/megatron.md); when that happened after its training
    finished, the requeued copy is cancelled, the finished run's results stand, and the note
    says so."""
    def over():
        x = slurm.job(job)
        return x if x.state not in DONE or x.restart_count > 0 else None
    j = wait(f"job {job} to end", over, timeout, 1.0)
    note = "" if j.state == "COMPLETED" else f"Slurm: {j.state}, restart_count {j.restart_count}"
    if j.restart_count > 0:
        commands.run(["scancel", str(job)], timeout=10, env=env, check=False)
        wait(f"job {job} cancelled", lambda: slurm.job(job).state not in DONE, 60, 1.0)
        note += " (requeued by Slurm after training finished; the requeued copy was cancelled)"
    final = run / "final.json"
    if not final.exists() or json.loads(final.read_text())["steps"] != int(env["TM_STEPS"]):
        raise RuntimeError(f"job {job} did not finish training ({note or j.state}); see {run}")
    return json.loads(final.read_text()), note


def trial(env, slurm: CliSlurm, workdir: Path, at_step: int, ref: dict, timeout: float) -> dict:
    job, run = submit(env, workdir, "whole-node", TM_STANDBYS=1, TM_STANDBY_RETRY_S=3600)
    wait(f"step {at_step} and a warm standby node", lambda: (read_jsonl(run / "metrics.jsonl") or [{}])[-1].get(
        "step", 0) >= at_step and any(s["state"] == "ready" for s in status(run).get("standbys", [])), timeout, 0.2)
    nodes = read_jsonl(run / "metrics.jsonl")[-1]["nodes"]
    leaver = nodes[MOVED[0]]
    assert all(nodes[r] == leaver for r in MOVED) and nodes[0] != leaver, nodes
    t_drain = time.time()
    commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={REASON}"], timeout=10, env=env)
    row = wait("both ranks to move", lambda: (r := (read_jsonl(run / "metrics.jsonl") or [{}])[-1]).get("nodes") and all(
        r["nodes"][k] != leaver for k in MOVED) and r, 60, 0.05)
    moved_s = time.time() - t_drain
    final, slurm_note = finish(env, slurm, job, run, timeout)
    slurm.resume(leaver)
    st = status(run)
    (m,) = st["migrations"]
    rows = read_jsonl(run / "metrics.jsonl")
    by_step = {x["step"]: x for x in rows}
    before = [x for x in rows if x["step"] <= m["switch_step"]][-30:]
    steady = statistics.median(b["t"] - a["t"] for a, b in zip(before, before[1:]))
    ref_losses = {x["step"]: x["losses"] for x in ref["metrics"]}
    transfers = m["transfers"]
    return {"job_id": job, "leaver": m["leaver"], "joiner": m["joiner"], "ranks_moved": m["leaver_ranks"],
            "state": m["state"], "downtime_s": m["downtime_s"],
            "detect_s": round(m["phases"]["requested"] - t_drain, 4), "drain_to_moved_s": round(moved_s, 3),
            "phase1_s": m["durations"]["phase1_s"], "switch_s": m["durations"]["switch_s"],
            "release_s": m["durations"]["release_s"], "switch_step": m["switch_step"],
            "first_step_after": row["step"], "steady_step_s": round(steady, 6),
            "state_bytes": sum(t["bytes"] for t in transfers.values()),
            "state_bytes_per_rank": {r: t["bytes"] for r, t in transfers.items()},
            "recv_s_per_rank": {r: t["recv_s"] for r, t in transfers.items()},
            "losses_equal": {x["step"]: x["losses"] for x in rows} == ref_losses,
            "digest_equal": final["rank_digests"] == ref["final"]["rank_digests"],
            "rank_digests_equal": [a == b for a, b in zip(final["rank_digests"], ref["final"]["rank_digests"])],
            "slurm_note": slurm_note, "gantt": gantt(m, by_step, t_drain), "migration": m}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--at-step", type=int, default=40, help="drain once this step is done (and the standby is warm)")
    ap.add_argument("--cluster-dir", default=None, help="embedded cluster state (default $TM_CLUSTER_DIR or "
                                                        "/var/tmp/trainmover-cluster)")
    ap.add_argument("--nodes", type=int, default=4, help="training nodes of that cluster (a job takes 2)")
    ap.add_argument("--standby", type=int, default=2, help="standby nodes of that cluster (a job takes 1)")
    ap.add_argument("--timeout", type=float, default=300, help="longest a job may take, start included")
    args = ap.parse_args()
    info = cluster.up(nodes=args.nodes, standby=args.standby, state_dir=args.cluster_dir)
    slurm = CliSlurm(slurm_conf=str(info.slurm_conf))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    env.update(SLURM_CONF=str(info.slurm_conf), TM_STEPS=str(args.steps), TM_PYTHON=sys.executable,
               PYTHONPATH=str(ROOT))
    workdir = ROOT / "runs" / "bench-whole-node"
    workdir.mkdir(parents=True, exist_ok=True)
    job, run = submit(env, workdir, "whole-node-ref", TM_STANDBYS=0)
    ref = {"final": finish(env, slurm, job, run, args.timeout)[0]}
    ref["metrics"] = read_jsonl(run / "metrics.jsonl")
    try:
        trials = [trial(env, slurm, workdir, args.at_step, ref, args.timeout) for _ in range(args.repeats)]
    finally:  # a failed trial leaves no node of the cluster drained
        for name, node in slurm.nodes().items():
            if "DRAIN" in node.flags and node.reason == REASON:
                slurm.resume(name)
    downs = [t["downtime_s"] for t in trials]
    result = {
        "scenario": "planned-cpu-megatron-whole-node-tp2", **machine(),
        "machine": "cpu-local (2 cores, every node on one host)",
        **results_io.provenance(__file__),
        "settings": {"workload": "megatron_gpt tiny (fp32, DDP optimizer)", "layout": "TP2 x PP2 x DP1",
                     "ranks_per_node": 2, "training_nodes": 2, "standby_nodes": 1, "moved": "node of ranks 2, 3",
                     "backend": "gloo", "steps": args.steps, "drain_at_step": args.at_step,
                     "reference_job": job, "slurm": "22.05.8 embedded, one machine"},
        "metrics": {"planned_downtime_s": statistics.median(downs), "planned_downtime_s_all": downs,
                    "ranks_moved": len(MOVED),
                    "detect_s": statistics.median(t["detect_s"] for t in trials),
                    "drain_to_moved_s": statistics.median(t["drain_to_moved_s"] for t in trials),
                    "phase1_s": statistics.median(t["phase1_s"] for t in trials),
                    "switch_s": statistics.median(t["switch_s"] for t in trials),
                    "state_bytes": trials[0]["state_bytes"],
                    "state_bytes_per_rank": trials[0]["state_bytes_per_rank"],
                    "steady_step_s": statistics.median(t["steady_step_s"] for t in trials),
                    "losses_equal": all(t["losses_equal"] for t in trials),
                    "digest_equal": all(t["digest_equal"] for t in trials)},
        "trials": trials,
    }
    results_io.write(results_io.stamped("cpu-whole-node"), result)


if __name__ == "__main__":
    main()
