"""Checkpoint-restart baseline on one GPU host, and (with --with-trainmover) TrainMover's
planned migration in the same invocation: one JSON with both, their ratio and the phases.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    python bench/gpu_checkpoint_restart.py --preset 1b --gpus 2 --with-trainmover --out DIR
    python bench/gpu_checkpoint_restart.py --device cpu --preset tiny --gpus 2 --with-trainmover   # dry run, no GPU

Workers = GPUs - 1 (one rank per GPU, DDP over NCCL); the last GPU is the replacement (for
TrainMover: the warm standby; for the baseline: where the restarted rank lands). With 2 GPUs:
1 worker + 1 replacement. The three NVLS/multicast variables are set by this script too (the
shared GPU machines need them; see shared/reference/gpu-machines.md).

Baseline (no Slurm on the GPU machines: this script is the launcher, as torchrun's agent is):
* planned: SIGUSR1 to every rank; at the next step boundary each saves its part of a
  checkpoint to --out (local disk), then exits;
* failure: rank 1's process is SIGKILLed (its GPU "fails"); the launcher sees it die (50 ms
  poll) and kills the others; the last periodic checkpoint (--ckpt-every) is all there is;
then new processes start on the healthy GPUs plus the replacement, import torch, create the
CUDA context, build NCCL, build the model, load the checkpoint, run the first step
(trainmover/baseline/trainer.py; phases by trainmover/baseline/phases.py). The workload is
the same gpt_demo preset as bench/gpu_planned_migration.py (no torch.compile in either).
Writes <out>/side-by-side-gpu-<preset>.json (with --with-trainmover) or
<out>/baseline-gpu-<preset>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402
from bench.polling import read_jsonl, wait as _wait  # noqa: E402
from bench.gpu_planned_migration import GPU_ENV  # noqa: E402  (also sets them in os.environ)
from trainmover.baseline import phases  # noqa: E402


# Phase names of a restart driven by this launcher (no Slurm here), by milestone.
LABELS = {
    "planned": {"job_left": "stop (every rank saved and exited)", "resubmitted": "launcher starts new processes",
                "process_start": "launch (python starts)"},
    "failure": {"job_left": "detect (launcher sees the dead rank, 50 ms poll) + kill the others",
                "resubmitted": "launcher starts new processes", "process_start": "launch (python starts)"},
}


def wait(what, check, timeout):
    return _wait(what, check, timeout, interval=0.05)  # the launcher's 50 ms poll (its detection time)


class Generation:
    """One start of the baseline job: a trainer process per device, as a launcher starts them."""

    def __init__(self, run: Path, gen: str, devices: list[int], args, log_dir: Path):
        self.procs: list[subprocess.Popen] = []
        self.t_launch = time.time()
        for rank, dev in enumerate(devices):
            env = {**os.environ, **GPU_ENV, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
            if args.device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = str(dev)
            argv = [sys.executable, "-m", "trainmover.baseline.trainer", "--run-dir", str(run), "--steps", str(args.steps),
                    "--model", args.preset, "--device", args.device, "--ckpt-every", str(args.ckpt_every),
                    "--timeout-s", "600", "--rank", str(rank), "--world", str(len(devices)), "--generation", gen,
                    "--addr", "127.0.0.1", "--local-device", "0"]
            with open(log_dir / f"{gen}-rank{rank}.log", "ab") as out:
                self.procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL))

    def signal(self, sig, ranks=None) -> None:
        for r, p in enumerate(self.procs):
            if (ranks is None or r in ranks) and p.poll() is None:
                p.send_signal(sig)

    def any_dead(self) -> bool:
        return any(p.poll() is not None for p in self.procs)

    def all_dead(self) -> bool:
        return all(p.poll() is not None for p in self.procs)


def baseline_trial(args, out: Path, scenario: str, tag: str) -> dict:
    run = out / "work" / f"baseline-{scenario}-{args.preset}-{tag}"
    run.mkdir(parents=True, exist_ok=True)
    workers = list(range(args.gpus - 1))
    leaver_rank, replacement = 1 if len(workers) > 1 else 0, args.gpus - 1
    g1 = Generation(run, "g1", workers, args, run)
    metrics = run / "metrics.jsonl"
    try:
        wait(f"baseline step {args.event_at}", lambda: (read_jsonl(metrics)[-1:] or [{}])[0].get("step", 0) >= args.event_at
             or g1.any_dead(), args.start_timeout)
        if g1.any_dead():
            raise RuntimeError(f"a baseline rank exited early; see {run}/g1-rank*.log")
        t_event = time.time()
        if scenario == "planned":
            g1.signal(signal.SIGUSR1)
            wait("every rank to save and exit", g1.all_dead, args.stop_timeout)
        else:
            g1.signal(signal.SIGKILL, ranks={leaver_rank})
            wait("the launcher to see the dead rank", g1.any_dead, 60)
            g1.signal(signal.SIGKILL)  # the others hang in NCCL: a launcher kills them
            wait("every rank to be gone", g1.all_dead, 60)
        t_left = time.time()
    finally:
        g1.signal(signal.SIGKILL)
    last_before = max(m["step"] for m in read_jsonl(metrics))
    devices = [d for d in workers if d != workers[leaver_rank]] + [replacement]
    devices.sort()
    g2 = Generation(run, "g2", devices, args, run)
    try:
        def progressed():
            rows = [m for m in read_jsonl(metrics) if m["gen"] == "g2"]
            if g2.any_dead():
                raise RuntimeError(f"a restarted rank exited; see {run}/g2-rank*.log")
            return rows and rows[-1]["step"] >= max(last_before, rows[0]["step"] + 5)
        wait("the restarted job to pass the step before the event", progressed, args.start_timeout)
    finally:
        g2.signal(signal.SIGKILL)
    events = [e for p in sorted((run / "events").glob("r*.jsonl")) for e in read_jsonl(p)]
    r = phases.analyse(scenario, t_event, [], events, read_jsonl(metrics), {"job_left": t_left, "resubmitted": g2.t_launch},
                       LABELS[scenario])
    saved = [e for e in events if e["event"] == "checkpoint_saved" and e["gen"] == "g1"]
    loaded = [e for e in events if e["event"] == "checkpoint_loaded" and e["gen"] == "g2"]
    out_json = {"devices_before": workers, "devices_after": devices, **r.to_json(),
                "checkpoint_bytes": sum(e["bytes"] for e in saved if e["step"] == r.resumed_from_step) or None,
                "checkpoint_save_s": max((e["save_s"] for e in saved if e["step"] == r.resumed_from_step), default=None),
                "checkpoint_load_read_s": max((e["read_s"] for e in loaded), default=None)}
    # the checkpoint of a 1B model is ~15 GB: leave the disk as found
    import shutil
    shutil.rmtree(run / "ckpt", ignore_errors=True)
    return out_json


def phase_medians(trials: list[dict]) -> dict:
    by: dict[str, list[float]] = {}
    for t in trials:
        for p in t["phases"]:
            by.setdefault(p["phase"], []).append(p["seconds"])
    return {k: statistics.median(v) for k, v in by.items()}


def trainmover_side(args, out: Path) -> tuple[dict, list[dict]]:
    """TrainMover's planned migration (and with the failure scenario its SIGKILL), exactly as
    bench/gpu_planned_migration.py runs them (that script, in a child process: one reference
    for both, each job with a deadline); with 2 GPUs one worker and its standby."""
    cuda = args.device == "cuda"
    tm_out = out / "trainmover"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_planned_migration.py"), "--preset", args.preset,
           "--gpus", str(args.gpus), "--steps", str(args.tm_steps), "--migrate-at", str(args.tm_migrate_at),
           "--fault", "both" if "failure" in args.scenarios else "migrate", "--device", args.device,
           "--machine", args.machine, "--out", str(tm_out),
           # a new directory each run: a reused one is refused (its old records would pass for this run's)
           "--work", str(out / "work" / f"trainmover-{time.strftime('%Y%m%d-%H%M%S')}")]
    if cuda:
        cmd.append("--p2p")
    subprocess.run(cmd, timeout=args.start_timeout, check=False)
    leaver = "gpu0" if args.gpus == 2 else "gpu1"
    prefix = "gpu" if cuda else "cpu-dryrun"
    planned = json.loads((tm_out / f"{prefix}-planned-{args.preset}-{leaver}.json").read_text())
    if not planned["complete"]:
        raise SystemExit(f"TrainMover's planned migration incomplete: {planned['errors']}")
    metrics = dict(planned["metrics"])
    chart = metrics.pop("gantt") or []
    metrics["trainmover_phases_s"] = {p["phase"]: p["seconds"] for p in chart}
    trials = [{"downtime_s": metrics["planned_downtime_s"], "gantt": chart, "migration": planned["migrations"][0]}]
    if "failure" in args.scenarios:  # unexpected failure: SIGKILL of the same rank's worker
        failure = json.loads((tm_out / f"{prefix}-failure-{args.preset}-{leaver}.json").read_text())
        metrics["unexpected_downtime_s"] = failure["metrics"].get("unexpected_downtime_s")
        metrics["trainmover_failure"] = failure["metrics"]
        metrics["trainmover_failure_migrations"] = failure["migrations"]
    return metrics, trials


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--gpus", type=int, default=2, help="GPUs of this host: GPUs-1 workers + 1 replacement")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the same flow over gloo")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--scenarios", nargs="+", default=["planned", "failure"], choices=("planned", "failure"))
    ap.add_argument("--steps", type=int, default=100000, help="baseline job length (it is killed after the restart)")
    ap.add_argument("--event-at", type=int, default=15, help="baseline step after which the event happens")
    ap.add_argument("--ckpt-every", type=int, default=10, help="baseline periodic checkpoint interval (failure loses the steps since)")
    ap.add_argument("--with-trainmover", action="store_true", help="also run bench/gpu_planned_migration.py's flow")
    ap.add_argument("--tm-steps", type=int, default=120)
    ap.add_argument("--tm-migrate-at", type=int, default=25)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--stop-timeout", type=float, default=600)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--machine", default=results_io.machine())
    args = ap.parse_args()
    if args.gpus < 2:
        raise SystemExit("--gpus must be >= 2 (workers = GPUs - 1, plus one replacement)")
    import torch
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus} but torch sees {torch.cuda.device_count()} GPU(s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics: dict = {}
    trials: dict = {}
    if args.with_trainmover:
        tm_metrics, tm_trials = trainmover_side(args, out)
        metrics.update(tm_metrics)
        trials["trainmover_planned"] = tm_trials
        print(f"trainmover planned downtime {metrics['planned_downtime_s']}", flush=True)
    for scenario in args.scenarios:
        ts = [baseline_trial(args, out, scenario, str(i)) for i in range(args.repeats)]
        trials[f"baseline_{scenario}"] = ts
        key = "baseline_downtime_s" if scenario == "planned" else "baseline_unexpected_downtime_s"
        metrics[key] = statistics.median(t["downtime_s"] for t in ts)
        metrics[f"{key}_all"] = [t["downtime_s"] for t in ts]
        metrics["baseline_phases_s" if scenario == "planned" else "baseline_failure_phases_s"] = phase_medians(ts)
        if scenario == "failure":
            metrics["baseline_lost_steps_all"] = [t["lost_steps"] for t in ts]
            metrics["baseline_regained_s"] = statistics.median(t["regained_s"] for t in ts if t["regained_s"] is not None)
        else:
            metrics["baseline_checkpoint_bytes"] = ts[0]["checkpoint_bytes"]
        print(f"baseline {scenario} downtime {metrics[key]}", flush=True)
    if metrics.get("planned_downtime_s") and metrics.get("baseline_downtime_s"):
        metrics["downtime_ratio"] = metrics["planned_downtime_s"] / metrics["baseline_downtime_s"]
    metrics.setdefault("unexpected_downtime_s", None)
    metrics["unexpected_note"] = ("" if metrics["unexpected_downtime_s"] is not None else
                                  "TrainMover's unexpected failure not measured in this run (--with-trainmover and "
                                  "the failure scenario run it)")
    if metrics["unexpected_downtime_s"] and metrics.get("baseline_unexpected_downtime_s"):
        metrics["unexpected_downtime_ratio"] = (metrics["unexpected_downtime_s"]
                                                / metrics["baseline_unexpected_downtime_s"])
    from trainmover.workloads.gpt_demo import GPT, PRESETS
    layers, d, heads, seq, batch, vocab = PRESETS[args.preset]
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(layers, d, heads, seq, vocab).parameters())
    name = ("side-by-side" if args.with_trainmover else "baseline") + f"-gpu-{args.preset}"
    result = {
        "scenario": name,
        "gpus": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if args.device == "cuda" else "none",
        "machine": results_io.ran_on(args.machine, f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}")
        if args.device == "cuda" else args.machine,
        **results_io.provenance(__file__),
        "settings": {"model_params": params, "preset": args.preset, "workers": args.gpus - 1, "standbys": 1,
                     "device": args.device, "repeats": args.repeats, "event_at": args.event_at,
                     "ckpt_every": args.ckpt_every, "storage": f"local disk under {out}", "compile": False,
                     "torch": torch.__version__,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None,
                     "env": GPU_ENV,
                     "restart": "launcher kills/signals every rank and starts new processes on the healthy GPUs "
                                "plus the replacement; no Slurm on this host (its stop/reschedule cost is measured "
                                "on the CPU local cluster)"},
        "metrics": metrics, "trials": trials,
    }
    results_io.write(out / f"{name}.json", result)


if __name__ == "__main__":
    main()
