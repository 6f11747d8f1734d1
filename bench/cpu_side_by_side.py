"""TrainMover vs checkpoint-restart, same run, same machine, on the CPU local Slurm cluster.

    .venv/bin/python bench/cpu_side_by_side.py [--ranks 3] [--repeats 3]

In one invocation, on one embedded cluster (its own state dir, never the test cluster), for
each repeat: TrainMover's planned migration of rank 1's node (bench/cpu_planned_migration.py),
the baseline's planned stop-and-restart and the baseline's unexpected node failure
(bench/cpu_checkpoint_restart.py), interleaved so that machine noise hits all alike; then
gloo send/recv of the state's size between two node addresses, the reference for the state
copy. Writes bench/results/cpu-side-by-side-<time>.json: medians, every trial, per-phase
timelines of both (the report draws them as a Gantt chart).

TrainMover's unexpected failure: `trainmover_failure_trial` (SIGKILL of rank 1's worker,
bench/cpu_unexpected_failure.py), timed from the kill to the first completed step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cpu_planned_migration as tm_bench  # noqa: E402
from bench import results_io  # noqa: E402
from bench.cpu_checkpoint_restart import (CLUSTER_DIR, DETECT_NOTE, GONE, baseline_trial, cluster_env,  # noqa: E402
                                          machine, restore_nodes, summary)
from trainmover.baseline.slurm_ops import SlurmOps  # noqa: E402

P2P = r'''
import datetime, os, sys, time, torch, torch.distributed as dist
rank, n, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
addr = ["127.0.1.11", "127.0.1.12"][rank]  # two node addresses: the path leaver -> joiner takes
store = dist.TCPStore("127.0.1.11", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
opts = dist.ProcessGroupGloo._Options(); opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
pg = dist.ProcessGroupGloo(store, rank, 2, opts)
x = torch.empty(n, dtype=torch.uint8)
for i in range(8):
    pg.barrier().wait(); t0 = time.perf_counter()
    (pg.send([x], 1, 0) if rank == 0 else pg.recv([x], 0, 0)).wait()
    dt = time.perf_counter() - t0
    if rank == 1 and i > 0: print("GBPS", n / dt / 1e9, flush=True)
'''


def gloo_p2p_GBps(nbytes: int) -> float:
    """Plain gloo send/recv of `nbytes` between two processes on two node addresses."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.1.11", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", P2P, str(r), str(nbytes), str(port)], stdout=subprocess.PIPE,
                              text=True, env=env) for r in (0, 1)]
    out = procs[1].communicate(timeout=120)[0]
    procs[0].wait(timeout=60)
    rates = [float(x.split()[1]) for x in out.splitlines() if x.startswith("GBPS")]
    if not rates:
        raise RuntimeError("gloo p2p measurement printed nothing")
    return statistics.median(rates)


def trainmover_failure_trial(ops, slurm, workdir: Path, *, ranks: int, env: dict, at_step: int) -> dict:
    """TrainMover's unexpected failure (bench/cpu_unexpected_failure.py): rank 1's worker is
    killed with SIGKILL; downtime runs from the kill to the first step every rank completed
    after the warm standby took the rank with a replica's state."""
    from bench import cpu_unexpected_failure
    return cpu_unexpected_failure.one(env, workdir, nodes=ranks, at_step=at_step)


def tm_summary(trials: list[dict]) -> dict:
    med = lambda key: statistics.median(t[key] for t in trials if t.get(key) is not None)  # noqa: E731
    by_phase: dict[str, list[float]] = {}
    for t in trials:
        for p in t["gantt"]:
            by_phase.setdefault(p["phase"], []).append(p["seconds"])
    copy = [t["state_bytes"] / t["copy_s"] / 1e9 for t in trials if t.get("copy_s")]
    ratio = [t["stayer_throughput_ratio"] for t in trials if t.get("stayer_throughput_ratio")]
    return {"planned_downtime_s": med("downtime_s"), "planned_downtime_s_all": [t["downtime_s"] for t in trials],
            "detect_s": med("detect_s"), "phase1_s": med("phase1_s"), "switch_s": med("switch_s"),
            "release_s": med("release_s"), "drain_to_moved_s": med("drain_to_moved_s"),
            "trainmover_phases_s": {k: statistics.median(v) for k, v in by_phase.items()},
            "stayer_throughput_ratio": statistics.median(ratio) if ratio else None,
            "steps_during_phase1": [t["steps_during_phase1"] for t in trials],
            "state_bytes": trials[0]["state_bytes"],
            "state_copy_GBps": statistics.median(copy) if copy else None,
            "steady_step_s": med("steady_step_s")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--event-at", type=int, default=125, help="step after which the node is taken away")
    ap.add_argument("--ckpt-every", type=int, default=50, help="the baseline's periodic checkpoint interval in steps")
    ap.add_argument("--cluster-dir", default=CLUSTER_DIR)
    ap.add_argument("--cluster-nodes", type=int, default=17)
    args = ap.parse_args()
    info, env, slurm = cluster_env(args.cluster_dir, args.cluster_nodes, 2)
    ops = SlurmOps(env)
    tm_env = {**env, "TM_STEPS": "100000"}  # cancelled after the migration
    workdir = ROOT / "runs" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    workdir.mkdir(parents=True, exist_ok=True)
    tm, planned, failure, tm_failure = [], [], [], []
    for i in range(args.repeats):
        restore_nodes(slurm)
        t = tm_bench.one(tm_env, slurm, workdir, 100000, nodes=args.ranks, at_step=args.event_at)
        ops.wait_state(t["job_id"], lambda s: s in GONE, "the TrainMover job to end", timeout=60, interval=0.2)
        tm.append(t)
        print(f"[{i}] trainmover planned downtime {t['downtime_s']}", flush=True)
        for scenario, bucket in (("planned", planned), ("failure", failure)):
            b = baseline_trial(ops, slurm, workdir, ranks=args.ranks, scenario=scenario, steps=100000,
                               event_at=args.event_at, ckpt_every=args.ckpt_every, tag=str(i))
            bucket.append(b)
            print(f"[{i}] baseline {scenario} downtime {b['downtime_s']}", flush=True)
        restore_nodes(slurm)
        f = trainmover_failure_trial(ops, slurm, workdir, ranks=args.ranks, env=tm_env, at_step=args.event_at)
        tm_failure.append(f)
        print(f"[{i}] trainmover failure downtime {f['downtime_s']}", flush=True)
    restore_nodes(slurm)
    p2p = gloo_p2p_GBps(tm[0]["state_bytes"])
    metrics = {**tm_summary(tm), **summary(planned, "planned"),
               **{k: v for k, v in summary(failure, "failure").items() if k != "baseline_steady_step_s"}}
    metrics["baseline_failure_phases_s"] = summary(failure, "failure")["baseline_phases_s"]
    metrics["baseline_phases_s"] = summary(planned, "planned")["baseline_phases_s"]
    metrics["downtime_ratio"] = metrics["planned_downtime_s"] / metrics["baseline_downtime_s"]
    metrics["p2p_GBps"] = p2p
    metrics["p2p_transport"] = "gloo send/recv between two node addresses, same machine, same size as the state"
    metrics["unexpected_downtime_s"] = (statistics.median(x["downtime_s"] for x in tm_failure) if tm_failure else None)
    metrics["unexpected_note"] = ("" if tm_failure else "TrainMover's unexpected-failure path (issue #6) is not in "
                                  "this commit: not measured")
    result = {"scenario": "side-by-side-cpu-demo", **machine(), **results_io.provenance(__file__),
              "settings": {"workload": "gpt_demo tiny", "workers": args.ranks, "standbys": 1, "backend": "gloo",
                           "event_at": args.event_at, "baseline_ckpt_every": args.ckpt_every,
                           "cluster": f"{args.cluster_nodes} training + 2 standby nodes, {info.state_dir}",
                           "baseline_detect": DETECT_NOTE, "slurm": "22.05.8 embedded, one machine",
                           "repeats": args.repeats},
              "metrics": metrics,
              "trials": {"trainmover_planned": tm, "baseline_planned": planned, "baseline_failure": failure,
                         "trainmover_failure": tm_failure}}
    results_io.write(results_io.stamped("cpu-side-by-side"), result)


if __name__ == "__main__":
    main()
