"""Planned migration and unexpected failure (SIGKILL) on one GPU host: GPUs-1 data-parallel
workers + 1 standby (2 GPUs: 1 worker + 1 standby), gpt_demo, NCCL through cuda/libtmdelta,
the real controller, policy and runtime (`SingleHostAllocation` stands in for Slurm's
allocation; Slurm's own cost is measured on the local cluster by bench/cpu_planned_migration.py).

    python bench/gpu_planned_migration.py --preset 1b --gpus 2 --fault both --out DIR
    python bench/gpu_planned_migration.py --preset 1b --gpus 4 --leaver gpu1 --fault migrate ...
    python bench/gpu_planned_migration.py --device cpu --preset tiny --gpus 2 --fault both   # dry run (gloo)

Jobs, each a child process with a deadline (what it wrote is kept when it has to be killed):
* ref: uninterrupted (`--ref-only`: only this one, e.g. on `--first-gpu 1` beside another
  benchmark's reference; `--ref RAW`: reuse such a run instead of running one);
* migrate: once the standby is warm and `--migrate-at` steps are done, `migrate` of the leaver;
* kill: the leaver's worker gets SIGKILL. With stayers its state comes from a replica (plain
  DDP); with one worker there is no replica and no other training node: the standby holds the
  worker's snapshots (runtime/protection/holding.py), so the kill waits until the standby holds one and
  half a snapshot interval has passed, and the job rolls back to that snapshot.

With one worker there is no stayer: the migration's pause is measured on the joiner's side
(the end of its first step against the end of the leaver's last, minus a steady step; see
controller/policy/core.py `_downtime`), and the job's own rows give the same number.
Writes <out>/gpu-planned-<preset>-<leaver>.json and gpu-failure-<preset>-<leaver>.json
(cpu-dryrun-... on the CPU) in the format of shared/reference/bench-results.md, `complete` and
`errors` saying what is missing. Exactness (`bit_exact`, `losses_equal`, `digest_equal`) is said
only when both jobs ran every step and the migration (recovery) happened, else None with
`exactness_unknown` (bench/exactness.py). Each job's directory under --work must be new (exit 2
otherwise), and a job whose pace says its steps cannot end within its share of --deadline-s is
stopped at once and says what it would need. Exit code 0 only if every JSON is complete.
"""
from __future__ import annotations

import argparse
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

from bench import exactness, results_io  # noqa: E402
from bench import single_host_jobs as jobs  # noqa: E402
from trainmover import config  # noqa: E402
from bench.cpu_planned_migration import gantt  # noqa: E402

GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
           # connect every peer during (non-blocking) init, i.e. in Phase 1, not at the first collective
           "NCCL_RUNTIME_CONNECT": "0"}
# TM_BENCH_NCCL_RUNTIME_CONNECT: an experiment's other choice (1: connect at first use), recorded in settings.env
GPU_ENV["NCCL_RUNTIME_CONNECT"] = config.setting("TM_BENCH_NCCL_RUNTIME_CONNECT")
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


# --- one job (a child process: a hung job can be killed, its files stay) ----------------------
def run_job(spec: dict) -> int:
    ctl, run, raw = jobs.new_job(spec, ROOT)

    t = raw["trigger"]

    def act(status: dict, step: int) -> bool:
        """Migrate or kill the leaver once the standby is ready and `migrate_at` steps are done."""
        if "ready_t" not in t or step < spec["migrate_at"]:
            return False
        if jobs.too_late(t, spec, step, spec["fault"]):
            return True
        if spec["fault"] == "migrate":
            jobs.request_migration(t, run, spec["leaver"], step)
            return True
        return _kill_now(t, status, step, spec)

    def give_up() -> str:
        return f"no {spec['fault']} within {spec['deadline_s']:.0f}s (standby ready: {'ready_t' in t})"

    def _kill_now(t: dict, status: dict, step: int, spec: dict) -> bool:
        """SIGKILL the leaver's worker once the state it will need exists: with one worker a
        snapshot held by the standby, then half an interval later (a failure between two). It
        also waits (until 70% of the steps) for a snapshot taken before the one it will resume
        from: the cost of a protected step is measured on those (the resume step's own
        intervals hold the recovery)."""
        if spec["workers"] == 1:
            snaps = (status.get("protection") or {}).get("snapshots") or {}
            held = [s for s in snaps.get("held", {}).get("0") or [] if s > 0]
            if spec.get("kill_when") == "first-held":
                # right after the first version is held (on the standby's GPU where it could):
                # the recovery must come from that version, before any host version exists
                if not held or step < min(held) + 5:
                    return False
            elif not held or step < max(held) + spec["every"] // 2:
                return False
            earlier = [x["step"] for x in snaps.get("taken", {}).get("0") or [] if x["step"] < max(held)]
            if not earlier and step < 0.7 * spec["steps"] and spec.get("kill_when") != "first-held":
                return False
            t["held_at_kill"] = held
            t["held_detail_at_kill"] = ((status.get("protection") or {}).get("snapshots") or {}).get("held_detail")
        t["t"], t["step"] = time.time(), step
        # `taskset` and `env` exec the worker: this pid is the training process itself
        sig = getattr(signal, f"SIG{spec.get('signal', 'KILL')}")  # STOP: frozen, sockets open (heartbeats)
        ctl.launcher.get(spec["leaver"]).send_signal(sig)
        t["reply"] = f"{sig.name} to the worker on {spec['leaver']} after step {step}"
        return True

    if spec["fault"] != "none":
        threading.Thread(target=jobs.watch_job, args=(spec, run, t, act, 0.02, give_up), daemon=True).start()
    return jobs.run_controller(ctl, run, raw, Path(spec["workdir"]) / "raw.json")


# --- what the jobs say ------------------------------------------------------------------------
def summarize(mig: dict, p2p: float | None) -> dict:
    """Planned migration: its pause (stayers', or with one worker the joiner's side), Phase 1,
    the state copy, the stayers' throughput and memory during Phase 1 (exactness: `exactness.judge`)."""
    migrations = (mig.get("status") or {}).get("migrations") or []
    if not migrations:
        raise ValueError("no migration happened (was the standby ready before training ended?)")
    m = migrations[0]
    if m["state"] != "done" or m["switch_step"] is None or m["downtime_s"] is None:
        raise ValueError(f"the migration did not complete (state {m['state']}, switch step {m['switch_step']}, "
                         f"downtime {m['downtime_s']}): use more --steps or an earlier --migrate-at")
    tl = mig["timeline"]
    s = m["switch_step"]
    rows = {r["step"]: r for r in mig["metrics"]}
    steady = [rows[k + 1]["t"] - rows[k]["t"] for k in range(max(2, s - 20), s - 5) if k in rows and k + 1 in rows]
    prep_t0, prep_t1 = m["phases"]["preparing"], m["phases"].get("switching", m["phases"]["preparing"])
    during = [rows[k + 1]["t"] - rows[k]["t"] for k in rows if k + 1 in rows and prep_t0 <= rows[k]["t"] and rows[k + 1]["t"] <= prep_t1]
    stayers = [e["detail"] for e in tl if e["event"] == "rank_prepared" and e.get("role") == "stayer"]
    # What Phase 1 left alive on a stayer: the growth of its live tensors' bytes (torch's
    # requested_bytes) between the boundary where it began and the one where it was done. Not
    # memory_allocated: that counts whole cached blocks, up to 1 MiB beyond a large tensor
    # when the block is not split, and the gradients made anew each step land in different
    # blocks, so it moves by such remainders between two boundaries of a steady loop with the
    # same tensors alive (runtime/worker.py `memory`); kept as stayer_extra_alloc_block_bytes.
    tensor_growth = [e["after"]["tensor_bytes"] - e["before"]["tensor_bytes"] for e in stayers
                     if (e.get("before") or {}).get("tensor_bytes") is not None]
    alloc_growth = [e["after"]["alloc_bytes"] - e["before"]["alloc_bytes"] for e in stayers if e.get("before")]
    reserved_growth = [e["after"]["reserved_bytes"] - e["before"]["reserved_bytes"] for e in stayers if e.get("before")]
    device_growth = [e["after"]["device_used_bytes"] - e["before"]["device_used_bytes"] for e in stayers if e.get("before")]
    switched = [e["detail"] for e in tl if e["event"] == "stayer_switched"]
    joined = next(e for e in tl if e["event"] == "joined")["detail"]
    leaver = next((e["detail"] for e in tl if e["event"] == "leaver_switched"), {})
    joiner_rank = m["leaver_ranks"][0]  # the joiner holds the leaver's rank
    joiner_first = rows.get(s + 1, {}).get("step_s_ranks", [None] * (joiner_rank + 1))[joiner_rank]
    around = {k: rows[k].get("step_s_ranks") for k in range(s - 1, s + 4) if k in rows}
    steady_step_s = statistics.median(r["step_s"] for r in mig["metrics"][5:s])
    copy_s = min(joined["copy_s"], leaver.get("copy_s") or joined["copy_s"])
    return {
        "planned_downtime_s": m["downtime_s"],
        # no stayer (one worker): nobody outside the migration sees the pause; it is the leaver's rank's
        "pause_measured_on": "stayers" if stayers else "no stayer: from the leaver's report of the switch step to the start of the joiner's next step (the time no rank trained; first_step_extra_s apart)",
        "pause_from_rows_s": (round(rows[s + 1]["t"] - rows[s]["t"] - steady_step_s, 6)
                              if s in rows and s + 1 in rows else None),
        "detect_s": round(m["phases"]["requested"] - mig["trigger"]["t"], 4) if mig["trigger"].get("t") else None,
        "phase1_s": m["durations"]["phase1_s"], "switch_s": m["durations"]["switch_s"],
        "release_s": m["durations"]["release_s"],
        "stayer_throughput_ratio": (statistics.median(steady) / statistics.median(during)) if during and steady else None,
        "throughput_ratio_is": "stayers'" if stayers else "the leaver's (no stayer)",
        "steps_during_phase1": len(during),
        "stayer_extra_alloc_bytes": max(tensor_growth) if tensor_growth else None,
        "stayer_extra_alloc_block_bytes": max(alloc_growth) if alloc_growth else None,
        "stayer_extra_reserved_bytes": max(reserved_growth) if reserved_growth else None,
        "stayer_device_mem_growth_bytes": max(device_growth) if device_growth else None,
        # Each side times its grouped NCCL call from posting to completion; the side that posts
        # first also waits for the other to post, so the later poster's (shorter) time is the
        # transfer itself. Both are kept.
        "state_bytes": joined["bytes"], "state_copy_s": copy_s,
        "state_copy_s_joiner": joined["copy_s"], "state_copy_s_leaver": leaver.get("copy_s"),
        "state_copy_GBps": joined["bytes"] / copy_s / 1e9 if copy_s else None,
        "leaver_send_s": leaver.get("send_s"), "joiner_recv_s": joined["recv_s"], "joiner_apply_s": joined["apply_s"],
        "joiner_prepare_s": joined.get("prepare_s"),
        # the pause on the joiner's side, in parts (runtime/transfer/plan.py): manifest, copy (device
        # time, CUDA events), the checks' tail after the copy, the verdict's read back, loading
        # into the workload, swapping the groups; then the first step against a steady one
        "pause_parts": joined.get("pause_parts"), "leaver_parts": leaver.get("parts"),
        "plan_made_ahead_s": {"joiner": joined.get("plan_s"), "leaver": leaver.get("plan_s")},
        "first_step_extra_s": (round(joiner_first - steady_step_s, 5) if joiner_first else None),
        "p2p_GBps": p2p,
        "comm_inits_per_stayer": [e["comms_created"] - e["comms_created_before"] for e in switched],
        "first_step_ratio": joiner_first / steady_step_s if joiner_first else None,
        "steady_step_s": steady_step_s,
        "step_s_per_rank_around_switch": around,
        "gantt": gantt(m, rows, mig["trigger"]["t"]) if mig["trigger"].get("t") else None,
    }


def protection_cost(rows: list[dict], every: int, before_t: float, taken: list[int], span: int = 3) -> dict:
    """A snapshot's cost in step time: the excess over the median interval of the `span` step
    intervals from each step whose snapshot was taken (`taken`: not those skipped while the one
    before was on its way) on: the copies' issue, the optimizer's wait for them, the exchange's
    CPU work beside the steps. Only rows logged before the failure (`before_t`) are used: after
    the rollback the rows past the resume step are the redone ones, and an interval across the
    resume step would hold the whole recovery."""
    t = {r["step"]: r["t"] for r in rows if r["t"] < before_t}
    gaps = {s: t[s + 1] - t[s] for s in t if s + 1 in t and s > 5}
    plain = [g for s, g in gaps.items() if s % every >= span]
    if not plain:
        return {}
    steady = statistics.median(plain)
    extra = [sum(gaps[s + i] - steady for i in range(span)) for s in taken if all(s + i in gaps for i in range(span))]
    if not extra:
        return {"steady_step_s": round(steady, 5)}
    return {"protected_step_extra_s": round(statistics.median(extra), 5),
            "protected_step_extra_s_all": [round(x, 5) for x in extra], "protected_steps": sorted(taken),
            "steady_step_s": round(steady, 5), "protected_step_ratio": round(1 + statistics.median(extra) / steady, 4),
            "amortised_overhead_at_every": round(statistics.median(extra) / every / steady, 5)}


def summarize_failure(run: dict, p2p: float | None, every: int = 0) -> dict:
    """Fault (the kill) to the first step every rank completed afterwards, its parts, and the
    snapshot tier's cost per protected step where it was used (exactness: `exactness.judge`)."""
    rec = [m for m in (run.get("status") or {}).get("migrations", []) if m["recovery"]]
    if not rec or rec[0]["state"] != "done":
        raise ValueError(f"no completed recovery: {[(m['state'], m.get('note')) for m in rec]}")
    m = rec[0]
    ev = {e["event"]: e for e in run["timeline"] if e.get("migration") == m["id"]}
    rows = {r["step"]: r for r in run["metrics"]}
    resume = m["switch_step"]
    t_kill = run["trigger"]["t"]
    joined = ev["joined"]["detail"]
    first_done = rows[resume + 1]["t"]
    before = [r for r in run["metrics"] if r["step"] <= resume and r["t"] < t_kill]
    steady_step_s = statistics.median(r["step_s"] for r in before[5:]) if len(before) > 6 else None
    out = {
        "unexpected_downtime_s": round(first_done - t_kill, 4),
        "detect_s": round(ev["detected"]["t"] - t_kill, 4),
        "plan_s": round(ev["recover"]["t"] - ev["detected"]["t"], 4),
        "rebuild_s": round(ev["switched"]["t"] - ev["recover"]["t"], 4),
        "first_step_after_s": round(first_done - ev["switched"]["t"], 4),
        "joiner_rebind_s": joined.get("rebind_s"), "joiner_prebound": joined.get("prebound"),
        "joiner_build_s": joined.get("build_s"), "joiner_groups_built_ahead": joined.get("built_ahead"),
        # told at the fault (anticipate): bound and its groups started that long before the plan
        "joiner_anticipated": joined.get("anticipated"),
        "joiner_group_build_s": joined.get("group_build_s"),
        "state_bytes": joined.get("recv_bytes"), "state_copy_s": joined.get("restore_s", joined.get("recv_s")),
        "state_held_by": joined.get("held_by", "sent by a live rank"),
        "restore_GBps": joined.get("restore_GBps"), "restore_from_pinned": joined.get("pinned"),
        "joiner_seconds": joined.get("seconds"),
        "state_source": m["state_source"], "resume_step": resume,
        "killed_after_step": run["trigger"].get("step"), "held_at_kill": run["trigger"].get("held_at_kill"),
        "rolled_back_steps": (m["state_source"] or {}).get("rolled_back_steps", 0),
        "steady_step_s": steady_step_s, "policy_downtime_s": m["downtime_s"], "p2p_GBps": p2p,
        "goal_s": 1.0,  # issue 36: fault -> first step <= 1 s
    }
    out["goal_met"] = out["unexpected_downtime_s"] <= out["goal_s"]
    snap = ((run.get("status") or {}).get("protection") or {}).get("snapshots") or {}
    held = run["trigger"].get("held_detail_at_kill") or snap.get("held_detail") or {}
    first_row = min(run["metrics"], key=lambda r: r["step"]) if run["metrics"] else None
    if held.get("first_held_t") and first_row:
        # from the end of the job's first step to the standby holding a verified version: until
        # then a SIGKILL of the one worker loses the job's progress
        out["protection_ready_s"] = round(held["first_held_t"] - first_row["t"], 3)
        out["protection_first_step"] = first_row["step"]
        out["protection_goal_s"] = 5.0
        out["holder_alloc_s"] = held.get("alloc_s")
        out["holder_pin"] = {k: held.get(k) for k in ("touch_s", "pin_mode", "recv_s", "verify_s")}
    if every and snap:
        taken = [x for v in snap.get("taken", {}).values() for x in v]
        copies = [x["copy_s"] for x in taken if x.get("copy_s")]
        out["snapshot"] = {
            "every": every, "held_detail": run["trigger"].get("held_detail_at_kill") or snap.get("held_detail"),
            "cost_from_rows": protection_cost(run["metrics"], every, t_kill,
                                              [x["step"] for x in taken if x["step"] < resume]),
            "versions": taken,
            "d2h_copy_s": statistics.median(copies) if copies else None,
            "d2h_GBps": (taken[0]["bytes"] / statistics.median(copies) / 1e9) if copies else None,
            "gate_wait_s": [x.get("gate_wait_s") for x in taken],
            "issue_s": [round(x.get("issue_s", 0), 5) for x in taken],
            "to_standby_s": [x.get("send_s") for x in taken if x.get("held_by")],
            "pinned": taken[0].get("pinned") if taken else None,
        }
    return out


# --- the run ---------------------------------------------------------------------------------
def job_config(args, fault: str) -> dict:
    cuda = args.device == "cuda"
    one_worker = args.gpus == 2
    every = args.snapshot_every if (fault == "kill" and one_worker) else 0
    return {"steps": args.steps, "model": args.preset, "device": args.device, "backend": "nccl" if cuda else "gloo",
            "standbys": 1, "poll_s": 0.2, "group_timeout_s": 180, "switch_timeout_s": 180, "phase1_timeout_s": 180,
            "release_timeout_s": 60, "recovery_timeout_s": 120, "shadow_steps": 6, "straggler": "off",
            # Recorded collectives stay off: this bench measures the switch and the recovery;
            # bench/gpu_warm_joiner.py measures recording, replay and the joiner's first step.
            "record_iterations": 0,
            # one worker: no replica survives it, the standby's snapshots are the tier; the
            # reference and the planned job take none (they would only cost step time here)
            "snapshot_every": every, "recovery_tiers": "snapshot" if every else "replica,snapshot,checkpoint",
            # groups foreseen (controller/policy/foresight.py): each loss's groups built before the fault
            "foresee_nodes": args.foresee_nodes}


def spec_of(args, name: str, fault: str, work: Path, deadline_s: float) -> dict:
    ref = fault == "none"
    return {"name": name, "fault": fault, "leaver": args.leaver, "migrate_at": args.migrate_at,
            "steps": args.steps, "min_steps_after": 5, "deadline_s": deadline_s, "every": args.snapshot_every,
            "workers": args.gpus - 1, "workdir": str(work / name),
            # a reference needs no standby: its workers alone, possibly beside another benchmark's
            "gpus": args.gpus - 1 if ref else args.gpus, "train": args.gpus - 1,
            "first_gpu": args.first_gpu if ref else 0, "host_gpus": args.host_gpus, "share_gpu": args.share_gpu,
            "standby_gpu": args.standby_gpu,
            "signal": args.signal, "kill_when": args.kill_when,
            "config": {**job_config(args, fault), **({"standbys": 0} if ref else {})}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--migrate-at", type=int, default=25, help="earliest step of the migration or the kill")
    ap.add_argument("--gpus", type=int, default=2, help="GPU 'nodes': all but one train, one is the standby")
    ap.add_argument("--host-gpus", type=int, default=None, help="GPUs of the host (default: --gpus)")
    ap.add_argument("--fault", choices=("migrate", "kill", "both"), default="both",
                    help="migrate: planned; kill: SIGKILL of the leaver's worker; both: one reference for the two")
    ap.add_argument("--leaver", default=None, help="the GPU 'node' to move (default: gpu1, with 2 GPUs gpu0)")
    ap.add_argument("--snapshot-every", type=int, default=40, help="one worker, kill: TM_SNAPSHOT_EVERY")
    ap.add_argument("--standby-gpu", type=int, default=None,
                    help="the physical GPU of the standby, beside that worker (2 GPUs: 2 workers + 1 standby; "
                         "use with --host-gpus = --gpus so that CPUs are split 3 ways)")
    ap.add_argument("--foresee-nodes", type=int, default=0,
                    help="TM_FORESEE_NODES: build each worker's loss's groups ahead while the standby is ready (0: off)")
    ap.add_argument("--ref-only", action="store_true", help="only the reference job (on --first-gpu), written to "
                    "<work>/ref/raw.json")
    ap.add_argument("--first-gpu", type=int, default=0, help="--ref-only: the GPU it runs on")
    ap.add_argument("--ref", default=None, help="raw.json of a reference run to reuse (same preset and steps)")
    ap.add_argument("--p2p", action="store_true", help="also measure plain NCCL send/recv (~20 s)")
    ap.add_argument("--signal", choices=("KILL", "STOP"), default="KILL",
                    help="--fault kill: SIGKILL (a crash) or SIGSTOP (a frozen process, found by its silent heartbeat)")
    ap.add_argument("--kill-when", choices=("interval", "first-held"), default="interval",
                    help="--fault kill, one worker: half an interval after a held version (default), or 5 steps "
                         "after the first version is held (recovered from it: on the standby's GPU where it could)")
    ap.add_argument("--share-gpu", action="store_true", help="worker and standby on one GPU (a one-GPU machine); "
                                                               "only --fault kill")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--work", default=None, help="scratch directory of the jobs (default: a new one under /tmp)")
    ap.add_argument("--machine", default=results_io.machine())
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the same flow (gloo)")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="the whole run, every job")
    args = jobs.parse_args(ap, run_job)
    t_begin = time.monotonic()
    args.leaver = args.leaver or ("gpu0" if args.gpus == 2 else "gpu1")
    args.host_gpus = args.host_gpus or (1 if args.share_gpu else max(args.gpus, args.first_gpu + 1))
    if args.share_gpu and args.fault != "kill":
        ap.error("--share-gpu runs only --fault kill: a planned migration's transfer pair would put two ranks "
                 "of one NCCL communicator on the one GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or f"/tmp/tm-gpu-migration-{time.strftime('%Y%m%d-%H%M%S')}")
    import torch  # no CUDA context here: it would hold memory on GPU 0, next to a worker
    cuda = args.device == "cuda"

    def left() -> float:
        return args.deadline_s - (time.monotonic() - t_begin) - 5

    def launch(name: str, fault: str, budget: float) -> tuple[dict, list[str]]:
        if budget < 20:
            return {}, [f"{name}: not run, {budget:.0f}s of the deadline left"]
        spec = spec_of(args, name, fault, work, budget)
        raw, error = jobs.launch(__file__, spec, budget)
        jobs.keep_logs(Path(spec["workdir"]), work / "logs" / name)
        rows = raw.get("metrics") or [{}]
        print(f"[{name}] steps {rows[-1].get('step')}, trigger {raw.get('trigger')}, error {error}", flush=True)
        return raw, [error] if error else []

    faults = ["migrate", "kill"] if args.fault == "both" else [args.fault]
    # its own directory: a second kill run beside the first (--kill-when) must not meet its secret
    names = {f: f + ("-first" if f == "kill" and args.kill_when == "first-held" else "") for f in faults}
    taken = jobs.reused(work, ["ref"] if args.ref_only else [*([] if args.ref else ["ref"]), *names.values()])
    if taken:
        print("refused: " + "; ".join(taken), file=sys.stderr)
        return 2
    if args.ref_only:
        raw, _ = launch("ref", "none", left())
        return 0 if exactness.job_incomplete("ref", raw, args.steps) is None else 1
    ref, ref_errors = (jobs.read_json(Path(args.ref)), []) if args.ref else launch("ref", "none", left() / (1 + len(faults)))
    if not (ref or {}).get("final"):
        ref_errors.append(f"reference run incomplete ({args.ref or 'ref'}): no final digest")
    # the reference stopped because its pace could not fit its share: the others need more
    ref_needs = ((ref or {}).get("exit") or {}).get("needs_s")
    p2p = None
    if cuda and args.p2p:
        try:
            p2p = p2p_bandwidth()
        except Exception as exc:  # noqa: BLE001 - reported
            ref_errors.append(f"p2p bandwidth: {exc!r}")
    from trainmover.workloads.gpt_demo import GPT, PRESETS
    layers, d, heads, seq, _, vocab = PRESETS[args.preset]
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(layers, d, heads, seq, vocab).parameters())
    ok = True
    for i, fault in enumerate(faults):
        if ref_needs:
            raw, job_errors = {}, [f"{names[fault]}: not run: the reference alone needs at least {ref_needs:.0f} s "
                                   f"at its pace; with a standby this job needs more: give --deadline-s of at "
                                   f"least ~{ref_needs * (1 + len(faults)):.0f} or fewer --steps"]
        else:
            raw, job_errors = launch(names[fault], fault, left() / (len(faults) - i))
        job_errors = ref_errors + job_errors
        kind = "planned" if fault == "migrate" else "failure"
        # bit-exact only when both jobs ran every step and the migration (recovery) happened
        exact = exactness.judge(ref, raw, steps=args.steps, kind=exactness.PLANNED if fault == "migrate"
                                else exactness.RECOVERY, skip_missing=fault == "kill")  # the dead rank's last loss
        metrics: dict = {}
        try:
            metrics = (summarize(raw, p2p) if fault == "migrate"
                       else summarize_failure(raw, p2p, job_config(args, fault)["snapshot_every"]))
        except (ValueError, KeyError, TypeError, StopIteration, ZeroDivisionError, statistics.StatisticsError) as exc:
            job_errors.append(f"summary: {exc!r}")
        measured = bool(metrics)
        metrics.update(exact)
        if fault == "kill":
            metrics["losses_equal_except_lost"] = exact["losses_equal"]
        if exactness.complaint(exact):
            job_errors.append(exactness.complaint(exact))
        if (raw.get("trigger") or {}).get("error"):
            job_errors.append(raw["trigger"]["error"])
        result = {
            "scenario": f"{'planned' if fault == 'migrate' else 'unexpected-failure'}-{'gpu' if cuda else 'cpu-dryrun'}"
                        f"-{args.preset}",
            "machine": results_io.ran_on(args.machine, jobs.gpu_names()) if cuda else "cpu-local", "leaver": args.leaver,
            "gpus": jobs.gpu_names() if cuda else "none",
            **results_io.provenance(__file__),
            "settings": {"model_params": params, "preset": args.preset, "dtype": "bf16 autocast, fp32 master + AdamW",
                         "workers": args.gpus - 1, "standbys": 1, "steps": args.steps, "migrate_at": args.migrate_at,
                         "fault": f"SIG{args.signal} of the leaver's worker" if fault == "kill" else "trainmover migrate",
                         "config": job_config(args, fault), "reference": args.ref or "run here",
                         "torch": torch.__version__,
                         "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None, "env": GPU_ENV},
            "metrics": metrics, "migrations": (raw.get("status") or {}).get("migrations"),
            "trigger": raw.get("trigger"), "errors": job_errors,
            "complete": not job_errors and measured,
            "wall_s": round(time.monotonic() - t_begin, 1),
        }
        prefix = "gpu" if cuda else "cpu-dryrun"
        sig = "" if fault != "kill" or args.signal == "KILL" else "-freeze"
        sig += "-first" if fault == "kill" and args.kill_when == "first-held" else ""
        results_io.write(out / f"{prefix}-{kind}{sig}-{args.preset}-{args.leaver}.json", result)
        ok = ok and result["complete"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
