"""Planned migration of a Megatron-core GPT rank on one GPU host (issue 7), in one run:

    python bench/gpu_megatron_migration.py --preset 1b --gpus 2 --out DIR          # GPU machine, 1 + 1
    python bench/gpu_megatron_migration.py --preset 1b --gpus 4 --layout pp ...    # 3 + 1, PP3
    python bench/gpu_megatron_migration.py --device cpu --preset tiny --gpus 2     # dry run (gloo)

GPUs-1 training "nodes" of one GPU each and 1 standby (2 GPUs: 1 + 1, TP=PP=DP=1; 4 GPUs: 3 + 1),
megatron_gpt in bf16 (Megatron's local layer spec, no TransformerEngine or apex) with `--layout dp`
(DP over the workers with the distributed optimizer, the default) or `--layout pp` (pipeline
stages), through the real controller,
policy and runtime (`SingleHostAllocation`, as bench/gpu_planned_migration.py). Two jobs of
the same number of steps, each a child process with a deadline:

* ref: uninterrupted, its workers alone (`--ref-only --first-gpu 1`: only this one, beside
  another benchmark's reference on GPU 0; `--ref RAW`: reuse it);
* migrate: once the standby is warm and `--migrate-at` steps are done, `migrate` of the
  leaver's GPU; the standby takes its rank (state over NCCL) and training goes on. With one
  worker there is no stayer: the pause is measured on the joiner's side (see
  bench/gpu_planned_migration.py).

Measured (metric names of shared/reference/bench-results.md): planned downtime from the
controller's status (the worst stayer's pause minus a steady step), Phase 1, state bytes and
copy time, and bit-exactness: every step's losses and the final digest of every rank's
parameters + optimizer state (with bf16: the fp32 main params too) equal the reference's, said
only when both jobs ran every step and the migration happened (bench/exactness.py; else None
with the reason). Each job's directory under --work must be new (a reused one is refused), and a
job whose pace says its steps cannot end within its deadline is stopped at once and says so.
Writes <out>/<scenario>.json after every stage, also when a job fails or runs out of time:
`complete` and `errors` say what is missing. Exit code 0 only if complete.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import exactness, results_io  # noqa: E402
from bench.gpu_planned_migration import GPU_ENV, p2p_bandwidth, summarize  # noqa: E402  (sets GPU_ENV)
from bench import single_host_jobs as jobs  # noqa: E402
from bench.single_host_jobs import read_json  # noqa: E402


# --- one job (a child process: a hung job can be killed, its files stay) ----------------------
def run_job(spec: dict) -> int:
    ctl, run, raw = jobs.new_job(spec, ROOT)

    t = raw["trigger"]

    def act(status: dict, step: int) -> bool:
        """`migrate` the leaver once the standby is ready and `migrate_at` steps are done."""
        if "ready_step" not in t or step < spec["migrate_at"]:
            return False
        if not jobs.too_late(t, spec, step, "migrate"):
            jobs.request_migration(t, run, spec["leaver"], step)
        return True

    def give_up() -> str:
        return f"standby not ready with {spec['migrate_at']} steps done within {spec['deadline_s']:.0f}s"

    if spec["migrate"]:
        threading.Thread(target=jobs.watch_job, args=(spec, run, t, act, 0.05, give_up), daemon=True).start()
    return jobs.run_controller(ctl, run, raw, Path(spec["workdir"]) / "raw.json")


def layout(kind: str, workers: int) -> dict:
    """All training GPUs in data parallel (distributed optimizer) or in pipeline stages."""
    return {"tp": 1, "pp": 1, "dp": workers} if kind == "dp" else {"tp": 1, "pp": workers, "dp": 1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="1b", help="megatron_gpt preset (CPU dry run: tiny, or tiny3 with --layout pp)")
    ap.add_argument("--layout", choices=("dp", "pp"), default="dp",
                    help="dp: data parallel over the training GPUs with the distributed optimizer; pp: pipeline stages")
    ap.add_argument("--no-distributed-optimizer", action="store_true", help="dp: plain Megatron DDP optimizer")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the same flow over gloo")
    ap.add_argument("--gpus", type=int, default=2, help="GPU 'nodes': all but one train, one is the standby")
    ap.add_argument("--steps", type=int, default=80, help="steps of each job (the same for both)")
    ap.add_argument("--migrate-at", type=int, default=20, help="earliest step of the migrate request")
    ap.add_argument("--leaver", default=None, help="the GPU 'node' to migrate (default gpu1; with 2 GPUs gpu0)")
    ap.add_argument("--ref-only", action="store_true", help="only the reference job, on --first-gpu (<work>/ref/raw.json)")
    ap.add_argument("--first-gpu", type=int, default=0, help="--ref-only: the GPU it runs on")
    ap.add_argument("--ref", default=None, help="raw.json of a reference run to reuse (same preset, layout, steps)")
    ap.add_argument("--p2p", action="store_true", help="also measure plain NCCL send/recv (needs ~20 s)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--work", default=None, help="scratch directory of the jobs (default: a new one under /tmp); "
                    "their logs and run files are copied to <out>/<scenario>-logs")
    ap.add_argument("--machine", default=results_io.machine())
    ap.add_argument("--deadline-s", type=float, default=420.0, help="the whole run, both jobs")
    ap.add_argument("--record-iterations", type=int, default=3,
                    help="recorded iterations per standby role (0: the standby warms on local answers)")
    args = jobs.parse_args(ap, run_job)

    t_begin = time.monotonic()
    args.leaver = args.leaver or ("gpu0" if args.gpus == 2 else "gpu1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch  # no CUDA context here: it would hold memory on GPU 0, next to a worker

    from trainmover.workloads.megatron_gpt import param_count
    cuda = args.device == "cuda"
    workers = args.gpus - 1
    lay = layout(args.layout, workers)
    # one worker: nothing to shard the optimizer over (DP=1), Megatron's plain optimizer
    dist_opt = args.layout == "dp" and workers > 1 and not args.no_distributed_optimizer
    scenario = (f"planned-{'gpu' if cuda else 'cpu-dryrun'}-megatron-{args.preset}-"
                f"{args.layout}{workers}{'-distopt' if dist_opt else ''}")
    path = out / f"{scenario}.json"
    result = {
        "scenario": scenario, "machine": results_io.ran_on(args.machine, jobs.gpu_names()) if cuda else "cpu-local",
        "gpus": jobs.gpu_names() if cuda else "none", "leaver": args.leaver,
        **results_io.provenance(__file__),
        "settings": {"model_params": None, "preset": args.preset, "workload": "megatron_gpt", **lay,
                     "distributed_optimizer": dist_opt, "dtype": args.dtype, "workers": workers, "standbys": 1,
                     "steps": args.steps, "migrate_at": args.migrate_at, "torch": torch.__version__,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                     "megatron_core": _version("megatron-core"), "env": GPU_ENV},
        "metrics": {}, "jobs": {}, "errors": [], "complete": False,
    }

    def save():
        result["wall_s"] = round(time.monotonic() - t_begin, 1)
        results_io.write(path, result)

    try:
        result["settings"]["model_params"] = param_count(args.preset)
    except KeyError:
        result["errors"].append(f"unknown preset {args.preset!r}")
    if workers < 1:
        result["errors"].append(f"needs at least 2 GPUs (1 training + 1 standby), got {args.gpus}")
    if result["errors"]:
        save()
        return 1
    config = {"workload": "megatron_gpt", "model": args.preset, "device": args.device,
              "backend": "nccl" if cuda else "gloo", **lay, "distributed_optimizer": int(dist_opt),
              "steps": args.steps, "standbys": 1, "poll_s": 0.5, "group_timeout_s": 120, "switch_timeout_s": 120,
              "phase1_timeout_s": 180, "release_timeout_s": 60, "shadow_steps": 6, "straggler": "off",
              # as sbatch_templates/megatron_gpt.sbatch: each pipeline stage kind records, the
              # standby rehearses all of them (0: shadow steps on locally answered groups)
              "record_iterations": args.record_iterations, "workload_options": f"dtype={args.dtype}",
              # a planned migration is measured: no snapshots (a one-worker job would take them: no replica)
              "snapshot_every": 0}
    work = Path(args.work or f"/tmp/tm-megatron-migration-{time.strftime('%Y%m%d-%H%M%S')}")
    names = ("ref",) if args.ref_only else ("migrate",) if args.ref else ("ref", "migrate")
    taken = jobs.reused(work, names)
    if taken:
        result["errors"] += [f"refused: {why}" for why in taken]
        save()
        return 2
    raws = {}
    if args.ref:
        raws["ref"] = read_json(Path(args.ref))
        result["settings"]["reference"] = args.ref
    for name in names:
        left = args.deadline_s - (time.monotonic() - t_begin) - 5
        ref_raw = raws.get("ref") or {}
        needs = (ref_raw.get("exit") or {}).get("needs_s")
        if name == "migrate" and needs:  # the reference's pace could not fit its half: this job needs more
            result["errors"].append(f"migrate: not run: the reference alone needs at least {needs:.0f} s at its "
                                    f"pace; give --deadline-s of at least ~{2 * needs + 30:.0f} or fewer --steps")
            continue
        took = ref_raw["t_end"] - ref_raw["t_start"] if ref_raw.get("t_end") and ref_raw.get("t_start") else 0
        if name == "migrate" and left < took:  # the same steps and a standby's warm-up besides
            result["errors"].append(f"migrate: not run: {left:.0f} s of the deadline left, and the reference "
                                    f"alone took {took:.0f} s; give --deadline-s of at least ~{2 * took + 30:.0f}")
            continue
        # The reference must leave the migrating job at least as much time as it took itself.
        budget = left / 2 if name == "ref" and not args.ref_only else left
        if budget < 20:
            result["errors"].append(f"{name}: not run, {left:.0f}s of the deadline left")
            continue
        ref = name == "ref"  # its workers alone, no standby (possibly beside another benchmark's reference)
        spec = {"name": name, "gpus": workers if ref else args.gpus, "train": workers, "leaver": args.leaver,
                "first_gpu": args.first_gpu if ref else 0, "host_gpus": max(args.gpus, args.first_gpu + workers),
                "migrate": name == "migrate",
                "migrate_at": args.migrate_at, "steps": args.steps, "min_steps_after": 5, "deadline_s": budget,
                "workdir": str(work / name), "config": {**config, **({"standbys": 0} if ref else {})}}
        raw, error = jobs.launch(__file__, spec, budget)
        raws[name] = raw
        jobs.keep_logs(Path(spec["workdir"]), out / f"{scenario}-logs" / name)
        if error:
            result["errors"].append(error)
        rows = raw.get("metrics") or [{}]
        result["jobs"][name] = {"steps_done": rows[-1].get("step"), "rc": raw.get("rc"),
                                "wall_s": round(raw["t_end"] - raw["t_start"], 1) if raw.get("t_end") else None,
                                "workdir": spec["workdir"], "trigger": raw.get("trigger"),
                                "final": raw.get("final"), "exit": raw.get("exit")}
        print(f"[{name}] done: steps {rows[-1].get('step')}, errors so far {result['errors']}", flush=True)
        save()

    if args.ref_only:
        return 0 if exactness.job_incomplete("ref", raws.get("ref"), args.steps) is None else 1
    p2p = None
    if cuda and args.p2p and args.deadline_s - (time.monotonic() - t_begin) > 300:  # its own waits: 180 + 60 s
        try:
            p2p = p2p_bandwidth()
        except Exception as exc:  # noqa: BLE001 - reported in the result
            result["errors"].append(f"p2p bandwidth: {exc!r}")
    ref, mig = raws.get("ref") or {}, raws.get("migrate") or {}
    # bit-exact only when both jobs ran every step and the migration happened
    metrics = exactness.judge(ref, mig, steps=args.steps, kind=exactness.PLANNED)
    try:
        metrics = {**summarize(mig, p2p), **metrics}
    except (SystemExit, Exception) as exc:  # noqa: BLE001 - what is missing goes into `errors`
        result["errors"].append(f"summary: {exc!r}")
    metrics.update(standby_warmup(mig))
    result["metrics"] = metrics
    result["migrations"] = (mig.get("status") or {}).get("migrations")
    if exactness.complaint(metrics):
        result["errors"].append(exactness.complaint(metrics))
    result["complete"] = not result["errors"] and result["metrics"].get("planned_downtime_s") is not None
    save()
    return 0 if result["complete"] else 1


def standby_warmup(raw: dict) -> dict:
    """The migrating job's standby, as it reported ready: the roles it rehearsed on the
    recordings, whether it gave what their ranks gave, and the memory it kept."""
    standby = (raw.get("trigger") or {}).get("standby") or {}
    shadow = standby.get("shadow") or {}
    return {"standby_warmup_s": standby.get("warmup_s"), "standby_replay": shadow.get("replay"),
            "standby_roles": [(r.get("role"), r.get("rank")) for r in shadow.get("roles", [])],
            "standby_loss_equal": shadow.get("loss_equal"), "standby_sends_equal": shadow.get("sends_equal"),
            "standby_sends_checked": sum(r.get("sends_checked", 0) for r in shadow.get("roles", [])),
            "standby_kept_bytes": shadow.get("kept_bytes"), "standby_kept_reserved_bytes": shadow.get("kept_reserved_bytes"),
            "standby_role_peak_bytes": shadow.get("role_peak_bytes"), "standby_kept_below_peak": shadow.get("kept_below_peak")}


def _version(dist_name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
