"""Planned migration on the CPU local cluster: downtime and phase times of a drain.

    .venv/bin/python bench/cpu_planned_migration.py --repeats 3 [--steps 600]

Submits the demo template to the embedded cluster (`trainmover cluster up` first), drains
rank 1's node once training runs, and records what `status.json` reports. Writes
bench/results/cpu-planned-<time>.json in the format of shared/reference/bench-results.md.
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
from bench.polling import wait  # noqa: E402
from trainmover import cluster  # noqa: E402
from trainmover.controller.succession.keeper import sbatch_args  # noqa: E402
from trainmover.slurm import commands  # noqa: E402
from trainmover.slurm.client import CliSlurm  # noqa: E402

REASON = "trainmover-bench maintenance"


def last(path: Path):
    try:
        lines = path.read_text().splitlines()
        return json.loads(lines[-1]) if lines else None
    except FileNotFoundError:
        return None


def gantt(m: dict, rows: dict, t0: float) -> list[dict]:
    """The migration's phases relative to the drain (t0), and the stayers' pause: from the end
    of the last step before the switch to the end of the first step after it."""
    p = m["phases"]
    spans = [("detect (drain -> controller decision)", t0, p.get("requested")),
             ("wait for a standby", p.get("waiting_standby"), p.get("preparing")),
             ("phase 1: prepare (training continues)", p.get("preparing"), p.get("switching")),
             ("switch (agree, state copy, swap)", p.get("switching"), p.get("releasing")),
             ("release node (training continues)", p.get("releasing"), p.get("done"))]
    s = m["switch_step"]
    if s in rows and s + 1 in rows:
        spans.append(("stayers: step across the switch (pause + one step)", rows[s]["t"], rows[s + 1]["t"]))
    return [{"phase": name, "start_s": round(a - t0, 6), "end_s": round(b - t0, 6), "seconds": round(b - a, 6)}
            for name, a, b in spans if a is not None and b is not None]


def one(env, slurm, workdir: Path, steps: int, nodes: int = 3, at_step: int = 100, start_timeout: float = 180) -> dict:
    """One planned migration: submit the demo on `nodes` nodes, drain rank 1's node once step
    `at_step` is done and a standby is warm, and return what status.json and metrics show."""
    for name, node in slurm.nodes().items():
        if "DRAIN" in node.flags and node.reason == REASON:
            slurm.resume(name)
    job = int(commands.run(["sbatch", "--parsable", f"--chdir={workdir}", "--job-name=tm-bench", *sbatch_args(nodes),
                            str(ROOT / "sbatch_templates/demo_gpt_cpu.sbatch")], timeout=15, env=env).stdout.split(";")[0])
    run = workdir / "runs" / str(job)
    wait(f"step {at_step} and a warm standby", lambda: (last(run / "metrics.jsonl") or {}).get("step", 0) >= at_step and any(
        s["state"] == "ready" for s in json.loads((run / "status.json").read_text())["standbys"]), start_timeout)
    leaver = last(run / "metrics.jsonl")["nodes"][1]
    t_drain = time.time()
    commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={REASON}"], timeout=10, env=env)
    row = wait("rank 1 to move", lambda: (r := last(run / "metrics.jsonl")) and r["nodes"][1] != leaver and r, 30, 0.05)
    moved_s = time.time() - t_drain
    status = wait("the downtime", lambda: (s := json.loads((run / "status.json").read_text()))
                  and s["migrations"] and s["migrations"][0]["downtime_s"] is not None and s, 60)
    try:  # the release comes after the pause; on a loaded machine it can take long: not fatal here
        status = wait("the release", lambda: (s := json.loads((run / "status.json").read_text()))
                      and s["migrations"][0]["state"] == "done" and s, 90)
    except TimeoutError:
        status = json.loads((run / "status.json").read_text())
    commands.run(["scancel", str(job)], timeout=10, env=env)
    m = status["migrations"][0]
    all_rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps_before = [x for x in all_rows if x["step"] <= m["switch_step"]][-30:]
    intervals = [b["t"] - a["t"] for a, b in zip(steps_before, steps_before[1:])]
    rows = {x["step"]: x for x in all_rows}
    # stayers' steps whose whole interval lies inside Phase 1 (training goes on meanwhile)
    p0, p1 = m["phases"]["preparing"], m["phases"].get("switching", m["phases"]["preparing"])
    during = [rows[k + 1]["t"] - rows[k]["t"] for k in rows if k + 1 in rows and p0 <= rows[k]["t"] and rows[k + 1]["t"] <= p1]
    return {"job_id": job, "ranks": nodes, "leaver": m["leaver"], "joiner": m["joiner"], "downtime_s": m["downtime_s"],
            "detect_s": round(m["phases"]["requested"] - t_drain, 4), "drain_to_moved_s": round(moved_s, 3),
            "phase1_s": m["durations"]["phase1_s"], "switch_s": m["durations"]["switch_s"],
            "release_s": m["durations"]["release_s"], "state_bytes": (m["transfer"] or {}).get("bytes"),
            "recv_s": (m["transfer"] or {}).get("recv_s"), "copy_s": (m["transfer"] or {}).get("copy_s"),
            "steady_step_s": statistics.median(intervals),
            "steps_during_phase1": len(during),
            "stayer_throughput_ratio": statistics.median(intervals) / statistics.median(during) if during else None,
            "first_step_after": row["step"], "gantt": gantt(m, rows, t_drain), "migration": m}

def setup(steps: int, state_dir: str | None = None):
    """The demo cluster up (in `state_dir`; default: the demo's), the submit environment (no
    inherited TM_*) and the work directory."""
    info = cluster.up(nodes=4, standby=2, **({"state_dir": state_dir} if state_dir else {}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    env.update(SLURM_CONF=str(info.slurm_conf), TM_STEPS=str(steps))
    workdir = ROOT / "runs" / "bench"
    workdir.mkdir(parents=True, exist_ok=True)
    return info, env, workdir


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=600)
    args = ap.parse_args()
    info, env, workdir = setup(args.steps)
    slurm = CliSlurm(slurm_conf=str(info.slurm_conf))
    trials = [one(env, slurm, workdir, args.steps) for _ in range(args.repeats)]
    for name, node in slurm.nodes().items():
        if "DRAIN" in node.flags and node.reason == REASON:
            slurm.resume(name)
    downs = [t["downtime_s"] for t in trials]
    result = {
        "scenario": "planned-cpu-demo", "machine": "cpu-local-cluster",
        "gpus": "none", "cpu": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        **results_io.provenance(__file__),
        "settings": {"workload": "gpt_demo tiny", "workers": 3, "standbys": 1, "backend": "gloo", "steps": args.steps,
                     "slurm": "22.05.8 embedded, one machine"},
        "metrics": {"planned_downtime_s": statistics.median(downs), "planned_downtime_s_all": downs,
                    "detect_s": statistics.median(t["detect_s"] for t in trials),
                    "drain_to_moved_s": statistics.median(t["drain_to_moved_s"] for t in trials),
                    "phase1_s": statistics.median(t["phase1_s"] for t in trials),
                    "state_bytes": trials[0]["state_bytes"],
                    "steady_step_s": statistics.median(t["steady_step_s"] for t in trials)},
        "trials": trials,
    }
    results_io.write(results_io.stamped("cpu-planned"), result)


if __name__ == "__main__":
    main()
