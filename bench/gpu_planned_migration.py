"""Planned migration (or, with --fault kill, an unexpected failure) on one GPU host: 3 data-parallel workers + 1 standby, NCCL through
cuda/libtmdelta, the real controller, policy and runtime (no Slurm on the GPU machines:
`SingleHostAllocation` stands in for the allocation; Slurm's own cost is measured on the
local cluster by bench/cpu_planned_migration.py).

    python bench/gpu_planned_migration.py --preset 1b --steps 60 --migrate-at 25 --out DIR
    python bench/gpu_planned_migration.py --preset 1b --fault kill ...   (SIGKILL of rank 1's worker)

Runs, in one go: plain NCCL send/recv bandwidth (torch.distributed, the reference for the
state copy), an uninterrupted run, and a run where rank 1's GPU is migrated to the standby
by `trainmover migrate`. Writes <out>/gpu-planned-<preset>.json in the format of
shared/reference/bench-results.md.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402
from bench.polling import read_jsonl  # noqa: E402

GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
           # connect every peer during (non-blocking) init, i.e. in Phase 1, not at the first collective
           "NCCL_RUNTIME_CONNECT": "0"}
os.environ.update(GPU_ENV)

P2P = r'''
import os, sys, time, torch, torch.distributed as dist
rank = int(sys.argv[1]); torch.cuda.set_device(rank)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
n = 2 << 30
x = torch.empty(n, dtype=torch.uint8, device="cuda")
for i in range(6):
    torch.cuda.synchronize(); dist.barrier(); t0 = time.perf_counter()
    (dist.send if rank == 0 else dist.recv)(x, 1 - rank)
    torch.cuda.synchronize(); dt = time.perf_counter() - t0
    if rank == 1 and i > 0: print("GBPS", n / dt / 1e9, flush=True)
dist.destroy_process_group()
'''


def p2p_bandwidth() -> float:
    procs = [subprocess.Popen([sys.executable, "-c", P2P, str(r)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ}) for r in (0, 1)]
    out = procs[1].communicate(timeout=180)[0]
    procs[0].wait(timeout=60)
    rates = [float(line.split()[1]) for line in out.splitlines() if line.startswith("GBPS")]
    return statistics.median(rates)


def run_job(name: str, out: Path, args, migrate: bool) -> dict:
    from trainmover.config import Config
    from trainmover.control import channel
    from trainmover.control.messages import make
    from trainmover.controller.main import Controller
    from trainmover.controller.single_host import SingleHostAllocation

    workdir = out / name
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = Config(steps=args.steps, model=args.preset, device=args.device, backend="nccl" if args.device == "cuda" else "gloo",
                 standbys=1, poll_s=0.5,
                 group_timeout_s=180, switch_timeout_s=180, phase1_timeout_s=180, shadow_steps=6,
                 # Recorded collectives (issue 4) stay off here: this bench measures the switch;
                 # bench/gpu_warm_joiner.py measures recording, replay and the joiner's first step.
                 record_iterations=0,
                 run_dir=str(workdir / "run"))
    alloc = SingleHostAllocation(gpus=args.gpus, train=args.gpus - 1, work_dir=str(workdir))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ctl = Controller(cfg, job_id=1, slurm=alloc, environ=env)
    run = Path(cfg.run_dir)
    trigger = {}

    def migrate_when_ready():
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            rows = read_jsonl(run / "metrics.jsonl")
            status = json.loads((run / "status.json").read_text()) if (run / "status.json").exists() else {}
            if rows and rows[-1]["step"] >= args.migrate_at and any(s["state"] == "ready" for s in status.get("standbys", [])):
                where = json.loads((run / "controller.json").read_text())
                trigger["t"] = time.time()
                if getattr(args, "fault", "migrate") == "kill":  # `env` execs the worker: this pid is the training process
                    ctl.steps[args.leaver].send_signal(signal.SIGKILL)
                    trigger["reply"] = f"SIGKILL to the worker on {args.leaver}"
                    return
                reply = channel.request((where["host"], where["port"]), channel.read_secret(str(run / "secret")),
                                        make("migrate", node=args.leaver))
                trigger["reply"] = reply["message"]
                return
            time.sleep(0.05)

    if migrate:
        threading.Thread(target=migrate_when_ready, daemon=True).start()
    t0 = time.time()
    rc = ctl.run()
    return {"rc": rc, "wall_s": time.time() - t0, "metrics": read_jsonl(run / "metrics.jsonl"),
            "timeline": read_jsonl(run / "timeline.jsonl"), "status": json.loads((run / "status.json").read_text()),
            "final": json.loads((run / "final.json").read_text()) if (run / "final.json").exists() else None,
            "trigger": trigger}


def summarize(ref: dict, mig: dict, p2p: float) -> dict:
    if not mig["status"]["migrations"]:
        raise SystemExit("no migration happened (was the standby ready before training ended?)")
    m = mig["status"]["migrations"][0]
    if m["state"] != "done" or m["switch_step"] is None or m["downtime_s"] is None:
        raise SystemExit(f"the migration did not complete before training ended (state {m['state']}, switch step "
                         f"{m['switch_step']}): use more --steps or an earlier --migrate-at")
    tl = mig["timeline"]
    s = m["switch_step"]
    rows = {r["step"]: r for r in mig["metrics"]}
    steady = [rows[k + 1]["t"] - rows[k]["t"] for k in range(max(2, s - 20), s - 5) if k in rows and k + 1 in rows]
    prep_t0, prep_t1 = m["phases"]["preparing"], m["phases"].get("switching", m["phases"]["preparing"])
    during = [rows[k + 1]["t"] - rows[k]["t"] for k in rows if k + 1 in rows and prep_t0 <= rows[k]["t"] and rows[k + 1]["t"] <= prep_t1]
    stayers = [e["detail"] for e in tl if e["event"] == "rank_prepared" and e.get("role") == "stayer"]
    alloc_growth = [e["after"]["alloc_bytes"] - e["before"]["alloc_bytes"] for e in stayers if e.get("before")]
    reserved_growth = [e["after"]["reserved_bytes"] - e["before"]["reserved_bytes"] for e in stayers if e.get("before")]
    device_growth = [e["after"]["device_used_bytes"] - e["before"]["device_used_bytes"] for e in stayers if e.get("before")]
    switched = [e["detail"] for e in tl if e["event"] == "stayer_switched"]
    joined = next(e for e in tl if e["event"] == "joined")["detail"]
    leaver = next((e["detail"] for e in tl if e["event"] == "leaver_switched"), {})
    ref_losses = {r["step"]: r["losses"] for r in ref["metrics"]}
    mig_losses = {r["step"]: r["losses"] for r in mig["metrics"]}
    differ = [k for k in ref_losses if ref_losses[k] != mig_losses.get(k)]
    joiner_rank = m["leaver_ranks"][0]  # the joiner holds the leaver's rank
    joiner_first = rows.get(s + 1, {}).get("step_s_ranks", [None] * (joiner_rank + 1))[joiner_rank]
    around = {k: rows[k].get("step_s_ranks") for k in range(s - 1, s + 4) if k in rows}
    steady_step_s = statistics.median(r["step_s"] for r in mig["metrics"][5:s])
    return {
        "planned_downtime_s": m["downtime_s"],
        "detect_s": round(m["phases"]["requested"] - mig["trigger"]["t"], 4) if mig["trigger"] else None,
        "phase1_s": m["durations"]["phase1_s"], "switch_s": m["durations"]["switch_s"],
        "release_s": m["durations"]["release_s"],
        "stayer_throughput_ratio": (statistics.median(steady) / statistics.median(during)) if during and steady else None,
        "steps_during_phase1": len(during),
        "stayer_extra_alloc_bytes": max(alloc_growth) if alloc_growth else None,
        "stayer_extra_reserved_bytes": max(reserved_growth) if reserved_growth else None,
        "stayer_device_mem_growth_bytes": max(device_growth) if device_growth else None,
        # Each side times its grouped NCCL call from posting to completion; the side that posts
        # first also waits for the other to post, so the later poster's (shorter) time is the
        # transfer itself. Both are kept.
        "state_bytes": joined["bytes"], "state_copy_s": min(joined["copy_s"], leaver.get("copy_s") or joined["copy_s"]),
        "state_copy_s_joiner": joined["copy_s"], "state_copy_s_leaver": leaver.get("copy_s"),
        "state_copy_GBps": joined["bytes"] / min(joined["copy_s"], leaver.get("copy_s") or joined["copy_s"]) / 1e9,
        "leaver_send_s": leaver.get("send_s"), "joiner_recv_s": joined["recv_s"], "joiner_apply_s": joined["apply_s"],
        "p2p_GBps": p2p,
        "comm_inits_per_stayer": [e["comms_created"] - e["comms_created_before"] for e in switched],
        "first_step_ratio": joiner_first / steady_step_s if joiner_first else None,
        "steady_step_s": steady_step_s,
        "step_s_per_rank_around_switch": around,
        "losses_equal": not differ, "first_differing_steps": differ[:5],
        "digest_equal": bool(ref["final"] and mig["final"] and ref["final"]["digest"] == mig["final"]["digest"]),
    }


def summarize_failure(ref: dict, run: dict, p2p: float | None) -> dict:
    """Fault (the kill) to the first step every rank completed afterwards, and exactness."""
    rec = [m for m in run["status"]["migrations"] if m["recovery"]]
    if not rec or rec[0]["state"] != "done":
        raise SystemExit(f"no completed recovery: {run['status']['migrations']}")
    m = rec[0]
    ev = {e["event"]: e for e in run["timeline"] if e.get("migration") == m["id"]}
    rows = {r["step"]: r for r in run["metrics"]}
    resume = m["switch_step"]
    t_kill = run["trigger"]["t"]
    ref_losses = {r["step"]: r["losses"] for r in ref["metrics"]}
    got = {r["step"]: r["losses"] for r in run["metrics"]}
    differ = [k for k in ref_losses if got.get(k) is None or any(
        a is not None and a != b for a, b in zip(got[k], ref_losses[k]))]
    joined = ev["joined"]["detail"]
    steady_step_s = statistics.median(r["step_s"] for r in run["metrics"][5:resume])
    return {
        "unexpected_downtime_s": round(rows[resume + 1]["t"] - t_kill, 4),
        "detect_s": round(ev["detected"]["t"] - t_kill, 4),
        "plan_s": round(ev["recover"]["t"] - ev["detected"]["t"], 4),
        "rebuild_s": round(ev["switched"]["t"] - ev["recover"]["t"], 4),
        "joiner_rebind_s": joined.get("rebind_s"), "joiner_build_s": joined.get("build_s"),
        "state_bytes": joined.get("recv_bytes"), "state_copy_s": joined.get("recv_s"),
        "state_source": m["state_source"], "resume_step": resume, "steady_step_s": steady_step_s,
        "policy_downtime_s": m["downtime_s"], "p2p_GBps": p2p,
        "losses_equal_except_lost": not differ, "first_differing_steps": differ[:5],
        "digest_equal": bool(ref["final"] and run["final"] and ref["final"]["digest"] == run["final"]["digest"]),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--migrate-at", type=int, default=25)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--machine", default=os.environ.get("TM_BENCH_MACHINE", "unknown"))
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the same flow over gloo")
    ap.add_argument("--leaver", default="gpu1", help="the GPU 'node' to migrate (gpu0 runs the controller: it stays allocated)")
    ap.add_argument("--fault", choices=("migrate", "kill"), default="migrate",
                    help="migrate: a planned migration; kill: SIGKILL of the leaver's worker (unexpected failure)")
    args = ap.parse_args()
    import torch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p2p = p2p_bandwidth() if args.device == "cuda" else None
    print(f"p2p {p2p} GB/s", flush=True)
    ref = run_job(f"ref-{args.preset}-{args.leaver}", out / "work", args, migrate=False)
    print(f"reference: rc={ref['rc']} {ref['wall_s']:.1f}s", flush=True)
    mig = run_job(f"{args.fault}-{args.preset}-{args.leaver}", out / "work", args, migrate=True)
    print(f"migration: rc={mig['rc']} {mig['wall_s']:.1f}s trigger={mig['trigger']}", flush=True)
    metrics = summarize(ref, mig, p2p) if args.fault == "migrate" else summarize_failure(ref, mig, p2p)
    from trainmover.workloads.gpt_demo import PRESETS, GPT
    layers, d, heads, seq, batch, vocab = PRESETS[args.preset]
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(layers, d, heads, seq, vocab).parameters())
    result = {
        "scenario": f"{'planned' if args.fault == 'migrate' else 'unexpected-failure'}-gpu-{args.preset}",
        "machine": args.machine, "leaver": args.leaver,
        "gpus": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if args.device == "cuda" else "none",
        "commit": results_io.commit(),
        "command": " ".join(["python", "bench/gpu_planned_migration.py", *sys.argv[1:]]),
        "when": results_io.now(),
        "settings": {"model_params": params, "preset": args.preset, "dtype": "bf16 autocast, fp32 master + AdamW",
                     "workers": args.gpus - 1, "standbys": 1, "steps": args.steps, "migrate_at": args.migrate_at,
                     "torch": torch.__version__,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None,
                     "env": GPU_ENV},
        "metrics": metrics,
        "migrations": mig["status"]["migrations"],
    }
    kind = "planned" if args.fault == "migrate" else "failure"
    path = out / f"gpu-{kind}-{args.preset}-{args.leaver}.json"
    results_io.write(path, result)


if __name__ == "__main__":
    main()
