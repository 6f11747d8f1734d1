"""Warm vs cold joiner with a compiled model, on one GPU host (issue 4), in one run:

    python bench/gpu_warm_joiner.py --preset 125m --out DIR          # on the GPU machine
    python bench/gpu_warm_joiner.py --device cpu --preset tiny       # dry run of the plumbing

GPUs-1 data-parallel workers and 1 standby (2 GPUs suffice), gpt_demo with torch.compile
under DDP, the real controller, policy and runtime (`SingleHostAllocation`: each GPU is a
"node" with its own compile caches). Two jobs, each a child process with a deadline:

* cold: the standby is cold (TM_STANDBY_WARMUP=cold: no recording, no replay; after the
  shadow steps DDP needs it drops all compiled code and its compile caches), so the joiner
  compiles at its first real step. Its CUDA context and allocator stay warm: the cold number
  is a lower bound; the job's own first step (fresh processes) is reported beside it.
* warm: rank 0 records 3 iterations from step TM_RECORD_FROM_STEP (after its own compile);
  the standby replays them (compiling), runs shadow steps and reports ready; after a steady
  window the last worker is migrated to it.

Measured: (a) the joiner's first real step over a steady step, warm and cold (target <= 1.2
warm); (b) the stayers' throughput from the start of the recording until the standby is
ready, over the steady window after it (target >= 0.99); (c) the recording's size and its
cost in step time (from the recorder's own report and from the job's step times).
Writes <out>/<scenario>.json (shared/reference/bench-results.md) even when a job fails or
runs out of time: `complete` and `errors` say what is missing. Exit code 0 only if complete.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402

from bench import single_host_jobs as jobs  # noqa: E402
from bench.gpu_planned_migration import GPU_ENV  # noqa: E402  (also sets them in os.environ)

MAX_STEPS = 1_000_000  # a job is stopped by the benchmark once measured (see _stop), or by its deadline
TARGETS = {"first_step_ratio_max": 1.2, "stayer_throughput_ratio_min": 0.99}


# --- one job (runs in a child process: a hung job can be killed, its files stay) -------------
def run_job(spec: dict) -> int:
    ctl, run, raw = jobs.new_job(spec, ROOT)

    t = raw["trigger"]

    def act(status: dict, step: int) -> bool:
        """Migrate the leaver once the standby is ready and a steady window has passed; stop
        the job `after_steps` steps after the switch (the numbers are in by then)."""
        if ("t" not in t and "ready_t" in t and step >= t["ready_step"] + spec["steady_steps"]
                and step >= spec["min_step"]):
            jobs.request_migration(t, run, spec["leaver"], step)
        migrations = status.get("migrations") or []
        switch = migrations[0]["switch_step"] if migrations else None
        if switch is not None and step >= switch + spec["after_steps"]:
            t["stopped_at_step"] = step
            _stop(ctl)
            return True
        return False

    def give_up() -> str:
        return f"no switch and {spec['after_steps']} steps after it within {spec['deadline_s']:.0f}s"

    threading.Thread(target=jobs.watch_job, args=(spec, run, t, act, 0.05, give_up, lambda: _stop(ctl)),
                     daemon=True).start()
    return jobs.run_controller(ctl, run, raw, Path(spec["workdir"]) / "raw.json")


def _stop(ctl) -> None:
    """End the job once measured: training would otherwise run to a step count that must be
    guessed before the standby's warm-up time is known. The controller's loop ends on its
    outcome; the workers (which keep training without a controller) are then terminated."""
    ctl.outcome = (True, "benchmark: measurements taken, job stopped")
    time.sleep(2.0)
    for proc in list(getattr(ctl, "steps", {}).values()):
        if proc.poll() is None:
            proc.terminate()


# --- what one job says ------------------------------------------------------------------------
def summarize(raw: dict, spec: dict) -> dict:
    """Per-job numbers; raises ValueError naming what is missing."""
    rows = {r["step"]: r for r in raw.get("metrics", [])}  # row k: k steps done
    trig = raw.get("trigger", {})
    if "ready_t" not in trig:
        raise ValueError("the standby never reported ready")
    migrations = raw.get("status", {}).get("migrations", [])
    if not migrations or migrations[0]["switch_step"] is None:
        raise ValueError(f"no switch happened (migrations: {[m['state'] for m in migrations]})")
    m = migrations[0]
    s = m["switch_step"]
    joiner_rank = m["leaver_ranks"][0]
    # steady window: after the standby is ready, before the migration request
    hi = trig.get("step", s)
    lo = max(trig["ready_step"], hi - spec["steady_steps"])
    steady = [rows[k]["step_s"] for k in range(lo + 1, hi + 1) if k in rows]
    if len(steady) < 5:
        raise ValueError(f"steady window has {len(steady)} steps")
    steady_step_s = statistics.median(steady)
    steady_period = (rows[hi]["t"] - rows[lo]["t"]) / (hi - lo) if lo in rows and hi in rows and hi > lo else None
    first = rows.get(s + 1, {}).get("step_s_ranks", [None] * (joiner_rank + 1))[joiner_rank]
    if first is None:
        raise ValueError(f"no step after the switch (step {s}) was reported")
    out = {"steady_step_s": steady_step_s, "steady_period_s": steady_period, "steady_steps": len(steady),
           "joiner_first_step_s": first, "first_step_ratio": first / steady_step_s, "switch_step": s,
           "joiner_second_step_s": rows.get(s + 2, {}).get("step_s_ranks", [None] * (joiner_rank + 1))[joiner_rank],
           "pause_s": (rows[s + 1]["t"] - rows[s]["t"]) if s in rows and s + 1 in rows else None,
           "standby": trig.get("standby"), "migration_state": m["state"],
           # fresh processes' first step (CUDA context, compile, allocator): what a joiner pays
           # with nothing warm; the cold standby's number lies between this and a warm one
           "job_first_step_s": rows.get(1, {}).get("step_s")}
    rec_from = spec["config"].get("record_from_step", 0)
    if spec["config"].get("record_iterations"):
        # (b) from the first recorded step until the standby is ready: recording, writing, replay
        ready = trig["ready_step"]
        if rec_from in rows and ready > rec_from and steady_period:
            window = (trig["ready_t"] - rows[rec_from]["t"]) / (ready - rec_from)
            out.update(warm_window_s=trig["ready_t"] - rows[rec_from]["t"], warm_window_steps=ready - rec_from,
                       warm_window_period_s=window, stayer_throughput_ratio=steady_period / window)
        # (c) the recorded steps and the steps while the file was written, from the job's own rows
        rec = (raw.get("status", {}).get("recordings") or {}).get("0") or {}
        out["recording"] = rec
        rec_steps = [rows[k]["step_s"] for k in range(rec_from + 1, rec_from + 1 + spec["config"]["record_iterations"])
                     if k in rows]
        if rec_steps:
            out["recording_step_ratio_job"] = statistics.median(rec_steps) / steady_step_s
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the same flow")
    ap.add_argument("--gpus", type=int, default=None, help="GPU 'nodes' to use (default: all; cpu: 2)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--work", default=None, help="scratch directory of the jobs (recordings are GBs on GPUs; "
                    "default: a new one under /tmp); their logs and run files are copied to <out>/<scenario>-logs")
    ap.add_argument("--machine", default=results_io.machine())
    ap.add_argument("--no-compile", action="store_true", help="plain eager model (compile is the subject)")
    ap.add_argument("--record-from", type=int, default=20, help="first recorded step (past the worker's compile)")
    ap.add_argument("--steady-steps", type=int, default=60, help="steady steps between 'ready' and the migration")
    ap.add_argument("--cold-migrate-at", type=int, default=30, help="cold job: earliest step of the migration")
    ap.add_argument("--after-steps", type=int, default=30, help="steps after the switch before a job is stopped")
    ap.add_argument("--deadline-s", type=float, default=560.0, help="whole run, both jobs")
    ap.add_argument("--jobs", nargs="+", choices=("warm", "cold"), default=["warm", "cold"],
                    help="which jobs to run (warm alone with --record-from 0: the shadow losses are compared "
                         "with the recorded ones, on this device)")
    ap.add_argument("--standby-nice", type=int, default=10, help="TM_STANDBY_NICE of the jobs (0: not niced)")
    ap.add_argument("--side-by-side", action="store_true",
                    help="run the warm and the cold job at once, on GPUs [0, gpus) and [gpus, 2*gpus) of the host "
                         "(needs 2*gpus GPUs): half the wall time; each job still has its own GPUs")
    ap.add_argument("--standby-compile-threads", type=int, default=4,
                    help="TM_STANDBY_COMPILE_THREADS of the jobs (0: torch's default, one per CPU of its share)")
    args = jobs.parse_args(ap, run_job)

    t_begin = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch
    gpus = args.gpus or (torch.cuda.device_count() if args.device == "cuda" else 2)
    scenario = (f"warm-joiner-{'gpu' if args.device == 'cuda' else 'cpu-dryrun'}-{args.preset}"
                + ("-record-from0" if args.record_from == 0 else ""))
    path = out / f"{scenario}.json"
    result = {
        "scenario": scenario,
        "machine": results_io.ran_on(args.machine, jobs.gpu_names()) if args.device == "cuda" else "cpu-local",
        "gpus": jobs.gpu_names() if args.device == "cuda" else "none",
        **results_io.provenance(__file__),
        "settings": {"preset": args.preset, "compile": not args.no_compile, "workers": gpus - 1, "standbys": 1,
                     "jobs": args.jobs,
                     "record_iterations": 3, "record_from_step": args.record_from, "torch": torch.__version__,
                     "standby_nice": args.standby_nice, "standby_compile_threads": args.standby_compile_threads,
                     "env": GPU_ENV, "targets": TARGETS},
        "metrics": {}, "jobs": {}, "errors": [], "complete": False,
    }

    def save():
        result["wall_s"] = round(time.monotonic() - t_begin, 1)
        results_io.write(path, result)

    if gpus < 2:
        result["errors"].append(f"needs at least 2 GPUs (1 worker + 1 standby), found {gpus}")
        save()
        return 1
    leaver = f"gpu{gpus - 2}"  # the last worker; with 2 GPUs the only one (it also records)
    base = {"model": args.preset, "device": args.device, "backend": "nccl" if args.device == "cuda" else "gloo",
            "standbys": 1, "poll_s": 0.5, "group_timeout_s": 300, "switch_timeout_s": 300, "phase1_timeout_s": 300,
            "release_timeout_s": 60, "shadow_steps": 6, "straggler": "off",
            "workload_options": "" if args.no_compile else "compile=true",
            # the standby's warm-up on a host it shares with the worker (issue 21): niced, few compile workers
            "standby_nice": args.standby_nice, "standby_compile_threads": args.standby_compile_threads,
            # a one-worker job would take snapshots (no replica survives it): not what is measured here
            "snapshot_every": 0}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = Path(args.work or f"/tmp/tm-warm-joiner-{stamp}")
    specs = {
        "cold": {"name": "cold", "gpus": gpus, "leaver": leaver, "steady_steps": 20, "min_step": args.cold_migrate_at,
                 "after_steps": args.after_steps, "workdir": str(work / "cold"),
                 "config": {**base, "steps": MAX_STEPS, "record_iterations": 0, "standby_warmup": "cold"}},
        "warm": {"name": "warm", "gpus": gpus, "leaver": leaver, "steady_steps": args.steady_steps,
                 "min_step": args.record_from + 3, "after_steps": args.after_steps,
                 "workdir": str(work / "warm"),
                 "config": {**base, "steps": MAX_STEPS, "record_iterations": 3, "record_from_step": args.record_from,
                            "standby_warmup": "shadow"}},
    }
    summaries = {}
    taken = jobs.reused(work, [j for j in ("warm", "cold") if j in args.jobs])
    if taken:  # an earlier run's files would be read as this run's
        result["errors"] += [f"refused: {why}" for why in taken]
        save()
        return 2
    names = [j for j in ("warm", "cold") if j in args.jobs]  # the subject first: a hung cold job cannot starve it
    side = args.side_by_side and len(names) == 2
    if side:
        host = torch.cuda.device_count() if args.device == "cuda" else 2 * gpus
        if host < 2 * gpus:
            result["errors"].append(f"--side-by-side needs {2 * gpus} GPUs, the host has {host}")
            save()
            return 1
        result["settings"]["side_by_side"] = True
        specs["cold"].update(first_gpu=gpus, host_gpus=2 * gpus, leaver=f"gpu{2 * gpus - 2}")  # its nodes: gpu<gpus>...
        specs["warm"].update(first_gpu=0, host_gpus=2 * gpus)
        launched: dict = {}

        def start(name: str) -> None:
            spec = specs[name]
            spec["deadline_s"] = args.deadline_s - (time.monotonic() - t_begin) - 5
            launched[name] = jobs.launch(__file__, spec, spec["deadline_s"])

        threads = [threading.Thread(target=start, args=(n,), daemon=True) for n in names]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    for name in names:
        spec = specs[name]
        if side:
            raw, error = launched[name]
        else:
            left = args.deadline_s - (time.monotonic() - t_begin) - 5
            if name == "warm" and "cold" in args.jobs:
                left = min(left, 0.6 * args.deadline_s)
            if left < 30:
                result["errors"].append(f"{name}: not run, {left:.0f}s of the deadline left")
                continue
            spec["deadline_s"] = left
            raw, error = jobs.launch(__file__, spec, left)
        jobs.keep_logs(Path(spec["workdir"]), out / f"{scenario}-logs" / name)
        if error:
            result["errors"].append(error)
        result["jobs"][name] = {"steps_done": (raw.get("metrics") or [{}])[-1].get("step"), "rc": raw.get("rc"),
                                "wall_s": round(raw["t_end"] - raw["t_start"], 1) if raw.get("t_end") else None,
                                "workdir": spec["workdir"], "trigger": raw.get("trigger")}
        try:
            summaries[name] = summarize(raw, spec)
            result["jobs"][name]["summary"] = summaries[name]
        except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
            result["errors"].append(f"{name}: {exc}")
        print(f"[{name}] done: {json.dumps(summaries.get(name, {}).get('first_step_ratio'))} first-step ratio, "
              f"errors so far {result['errors']}", flush=True)
        save()

    warm, cold = summaries.get("warm", {}), summaries.get("cold", {})
    rec = warm.get("recording") or {}
    detail = rec.get("detail") or {}
    metrics = {
        "first_step_ratio": warm.get("first_step_ratio"),
        "cold_first_step_ratio": cold.get("first_step_ratio"),
        "joiner_first_step_s": warm.get("joiner_first_step_s"),
        "cold_joiner_first_step_s": cold.get("joiner_first_step_s"),
        "fresh_process_first_step_s": warm.get("job_first_step_s") or cold.get("job_first_step_s"),
        "steady_step_s": warm.get("steady_step_s"), "cold_steady_step_s": cold.get("steady_step_s"),
        "stayer_throughput_ratio": warm.get("stayer_throughput_ratio"),
        "warm_window_s": warm.get("warm_window_s"), "warm_window_steps": warm.get("warm_window_steps"),
        "standby_warmup_s": (warm.get("standby") or {}).get("warmup_s"),
        "standby_limits": ((warm.get("standby") or {}).get("shadow") or {}).get("limits"),
        "standby_loss_equal": ((warm.get("standby") or {}).get("shadow") or {}).get("loss_equal"),
        "standby_replay": ((warm.get("standby") or {}).get("shadow") or {}).get("replay"),
        "recording_bytes": rec.get("bytes"),
        "recording_overhead_s": rec.get("overhead_s"),  # extra step time of recorded + writing steps
        "recording_step_ratio": detail.get("step_ratio_recording"),
        "recording_step_ratio_job": warm.get("recording_step_ratio_job"),
        "recording_host_s": detail.get("host_s"), "recording_writer_s": detail.get("writer_s"),
        "recording_pinned_bytes": detail.get("pinned_bytes"),
        "recording_writing_steps": len(detail.get("writing_step_s") or []) if detail else None,
    }
    metrics["first_step_target_met"] = (metrics["first_step_ratio"] is not None
                                        and metrics["first_step_ratio"] <= TARGETS["first_step_ratio_max"])
    metrics["stayer_throughput_target_met"] = (metrics["stayer_throughput_ratio"] is not None and
                                               metrics["stayer_throughput_ratio"] >= TARGETS["stayer_throughput_ratio_min"])
    result["metrics"] = metrics
    # from step 0 the recorded steps are the job's first (compiling): no steady window before them
    wanted = ["first_step_ratio", "recording_bytes"] + (["stayer_throughput_ratio"] if args.record_from else [])
    wanted += ["cold_first_step_ratio"] if "cold" in args.jobs else []
    wanted += ["standby_loss_equal"] if args.record_from == 0 else []
    result["complete"] = not result["errors"] and all(metrics[k] is not None for k in wanted)
    save()
    return 0 if result["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
