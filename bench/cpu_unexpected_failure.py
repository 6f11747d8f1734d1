"""Unexpected failure on the CPU local cluster: a worker killed with SIGKILL (`--fault kill`),
frozen with SIGSTOP (`freeze`: its sockets stay open) or its node cut off (`partition`: every
packet from and to it dropped, trainmover/cluster/netfault.py), replaced by the
warm standby with its state from a recovery tier (`--tier`): a data-parallel replica (the
default), the in-memory snapshots (`TM_RECOVERY_TIERS=snapshot`) or the checkpoints
(`TM_RECOVERY_TIERS=checkpoint`, snapshots off). Downtime is measured from the kill (the
fault, not its detection) to the first step that every rank completed afterwards; for the
rollback tiers also to the step at which progress is regained (the step killed in, done again).

    .venv/bin/python bench/cpu_unexpected_failure.py --repeats 3 [--steps 600] [--tier snapshot]
        [--every 50] [--fault kill|freeze|partition] [--cluster-dir DIR]

Submits the demo template to the embedded cluster (`trainmover cluster up` first), waits for
training and a warm standby, kills rank 1's worker process from outside, and reads what the
controller wrote. Writes bench/results/cpu-failure[-<fault>][-<tier>]-<time>.json
(shared/reference/bench-results.md).
The rollback tiers also report their step-time cost: the interval of the steps right after a
snapshot or checkpoint (whose copy into host memory runs on the training thread; the exchange
or the write runs beside the following steps) against the median interval.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402
from bench.cpu_planned_migration import last, setup, wait  # noqa: E402
from trainmover.cluster import netfault  # noqa: E402
from trainmover.cluster.procs import step_pid  # noqa: E402
from trainmover.controller.succession.keeper import sbatch_args  # noqa: E402
from trainmover.slurm import commands  # noqa: E402
from trainmover.slurm.client import CliSlurm  # noqa: E402


def events(run: Path) -> dict:
    return {e["event"]: e for e in map(json.loads, (run / "timeline.jsonl").read_text().splitlines())}


TIER_ENV = {"replica": {},
            "snapshot": {"TM_RECOVERY_TIERS": "snapshot"},
            "checkpoint": {"TM_RECOVERY_TIERS": "checkpoint", "TM_SNAPSHOT_EVERY": "0"}}


def protection_cost(rows: list[dict], every: int, upto: int, span: int = 3) -> dict:
    """What each snapshot or checkpoint costs in step time: the excess over the median interval
    of the `span` step intervals from the protected step on (its copy into host memory on the
    training thread, then the exchange or write beside the next steps, on the same cores)."""
    t = {r["step"]: r["t"] for r in rows if r["step"] <= upto}
    gaps = {s: t[s + 1] - t[s] for s in t if s + 1 in t and s > 10}  # past the first steps' warm-up
    steady = statistics.median([g for s, g in gaps.items() if s % every >= span])
    extra = [sum(gaps[s + i] - steady for i in range(span)) for s in gaps if s % every == 0
             and all(s + i in gaps for i in range(span))]
    if not extra:
        return {}
    return {"protected_step_extra_s": round(statistics.median(extra), 5), "steady_step_s": round(steady, 5),
            "amortised_overhead": round(statistics.median(extra) / every / steady, 5), "protected_steps": len(extra)}


FAULTS = {"kill": "SIGKILL of rank 1's worker process",
          "freeze": "SIGSTOP of rank 1's worker process (sockets stay open)",
          "partition": "every packet from and to rank 1's node dropped (nftables, net_cls cgroup)",
          "hang": "rank 1's training thread blocks for good after step 450 (TM_INJECT=hang:1:450), its process alive"}
HANG_STEP = 450


@contextlib.contextmanager
def fault(kind: str, info, pid: int, node: str):
    """Inflict `kind` on rank 1 (process `pid` on `node`) for the body of the context; undone
    after it (a frozen process killed, a partition healed, a fenced node resumed)."""
    try:
        if kind == "hang":  # injected at submission (see one): nothing to do from outside
            yield
            return
        if kind == "partition":
            with netfault.partition(info, node):
                yield
            return
        os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            if kind != "hang":
                os.kill(pid, signal.SIGKILL)
        if kind != "kill":
            slurm = CliSlurm(slurm_conf=str(info.slurm_conf))
            with contextlib.suppress(Exception):
                wait(f"{node} to answer", lambda: not slurm.nodes([node])[node].unresponsive, 120)
                slurm.resume(node)  # fenced: drained "trainmover: ..."


def one(env, workdir: Path, nodes: int = 3, at_step: int = 100, tier: str = "replica", every: int = 50,
        kind: str = "kill", info=None) -> dict:
    """One failure: submit the demo on `nodes` nodes, inflict `kind` on rank 1 once step
    `at_step` is done and a standby is warm, and return the recovery's timings."""
    env = {**env, **TIER_ENV[tier]}
    if kind == "hang":
        env["TM_INJECT"] = f"hang:1:{HANG_STEP}"
    if tier == "snapshot":
        env["TM_SNAPSHOT_EVERY"] = str(every)
    if tier == "checkpoint":
        env["TM_CHECKPOINT_EVERY"] = str(every)
    job = int(commands.run(["sbatch", "--parsable", f"--chdir={workdir}", "--job-name=tm-bench-failure", *sbatch_args(nodes),
                            str(ROOT / "sbatch_templates/demo_gpt_cpu.sbatch")], timeout=15, env=env).stdout.split(";")[0])
    try:
        return _measure(workdir / "runs" / str(job), at_step, tier, every, job, kind, info)
    finally:  # also when a wait timed out: a trial's job never outlives it
        commands.run(["scancel", str(job)], timeout=10, env=env, check=False)


def _measure(run: Path, at_step: int, tier: str, every: int, job: int, kind: str, info) -> dict:
    wait(f"step {at_step} and a warm standby", lambda: (last(run / "metrics.jsonl") or {}).get("step", 0) >= at_step and any(
        s["state"] == "ready" for s in json.loads((run / "status.json").read_text())["standbys"]), 180)
    victim = last(run / "metrics.jsonl")["nodes"][1]
    pid = step_pid(job, victim)
    with fault(kind, info, pid, victim):
        t_kill = time.time()
        killed_after = last(run / "metrics.jsonl")["step"]  # the last step logged before the fault
        if kind == "hang":  # the fault: rank 1 stops right after completing HANG_STEP
            row = wait(f"step {HANG_STEP}", lambda: next((r for r in map(json.loads, (run / "metrics.jsonl").read_text(
                ).splitlines()) if r["step"] == HANG_STEP), None), 120)
            t_kill, killed_after = row["t"], HANG_STEP
        status = wait("the recovery", lambda: (s := json.loads((run / "status.json").read_text()))
                      and s["migrations"] and s["migrations"][0]["state"] == "done"
                      and s["migrations"][0]["downtime_s"] is not None and s, 120)
    m = status["migrations"][0]
    resume = m["switch_step"]
    rows = list(map(json.loads, (run / "metrics.jsonl").read_text().splitlines()))
    first_after = next(r for r in rows if r["step"] == resume + 1)
    regained = wait(f"step {killed_after + 1} again", lambda: next((
        r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if r["step"] > killed_after and r["t"] > t_kill), None), 120)  # replica: that row may predate the kill
    before = [r for r in rows if r["step"] <= resume][-30:]
    steady = statistics.median(b["t"] - a["t"] for a, b in zip(before, before[1:]))
    try:  # a job cancelled while its controller takes a standby (salloc + merge) was seen to stay COMPLETING
        wait("the standby pool refilled", lambda: not json.loads((run / "status.json").read_text())[
            "standby_pool"]["acquiring"], 60)
    except TimeoutError:
        pass
    ev = events(run)
    joined = ev["joined"]["detail"]
    return {"job_id": job, "victim": victim, "joiner": m["joiner"], "downtime_s": round(first_after["t"] - t_kill, 4),
            "fault_to_first_step_s": round(first_after["t"] - t_kill, 4),
            "detect_s": round(ev["detected"]["t"] - t_kill, 4),
            "plan_s": round(ev["recover"]["t"] - ev["detected"]["t"], 4),
            "rebuild_s": round(ev["switched"]["t"] - ev["recover"]["t"], 4),
            "joiner_rebind_s": joined.get("rebind_s"), "state_bytes": joined.get("recv_bytes"),
            "copy_s": joined.get("recv_s"), "resume_step": resume, "steady_step_s": round(steady, 5),
            "policy_downtime_s": m["downtime_s"], "evidence": ev["detected"].get("evidence"),
            "max_beat_gap_s": status["liveness"]["max_beat_gap_s"],
            "state_source": m["state_source"], "tier": m["state_source"]["tier"],
            "rolled_back_steps": m["state_source"].get("rolled_back_steps", 0),
            "fault_to_progress_regained_s": round(regained["t"] - t_kill, 4),
            "joiner_load_s": joined.get("load_s"),
            "checkpoint_file_bytes": max((f.stat().st_size for f in run.glob("checkpoints/*/rank-*.h5")), default=None),
            **({} if tier == "replica" else protection_cost(rows, every, resume))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--tier", choices=sorted(TIER_ENV), default="replica",
                    help="where the lost rank's state comes from (TM_RECOVERY_TIERS of the job)")
    ap.add_argument("--every", type=int, default=50, help="TM_SNAPSHOT_EVERY or TM_CHECKPOINT_EVERY of the job")
    ap.add_argument("--fault", choices=sorted(FAULTS), default="kill", help="what happens to rank 1")
    ap.add_argument("--cluster-dir", help="state directory of the embedded cluster (default: the demo's)")
    args = ap.parse_args()
    info, env, workdir = setup(args.steps, args.cluster_dir)
    # a rollback tier: killed half way between two snapshots or checkpoints (the mean case), late
    # enough that several protected steps come before it (their step-time cost is measured)
    at_step = 100 if args.tier == "replica" else 300 + args.every // 2
    trials = [one(env, workdir, at_step=at_step, tier=args.tier, every=args.every, kind=args.fault, info=info)
              for _ in range(args.repeats)]
    down = [t["fault_to_first_step_s"] for t in trials]
    med = lambda k: statistics.median(t[k] for t in trials)  # noqa: E731
    name = "".join(f"-{x}" for x in (args.fault, args.tier) if x not in ("kill", "replica"))
    result = {
        "scenario": "unexpected-failure-cpu-demo" + name,
        "machine": "cpu-local-cluster",
        "gpus": "none", "cpu": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        **results_io.provenance(__file__),
        "settings": {"workload": "gpt_demo tiny", "workers": 3, "standbys": 1, "backend": "gloo", "steps": args.steps,
                     "fault": FAULTS[args.fault], "slurm": "22.05.8 embedded, one machine",
                     "tier": args.tier, **({} if args.tier == "replica" else {"every": args.every})},
        "metrics": {"unexpected_downtime_s": statistics.median(down), "unexpected_downtime_s_all": down,
                    "goal_s": 10.0, "detect_s": med("detect_s"), "detect_s_all": [t["detect_s"] for t in trials],
                    "max_beat_gap_s": max(t["max_beat_gap_s"] for t in trials), "plan_s": med("plan_s"),
                    "rebuild_s": med("rebuild_s"), "steady_step_s": med("steady_step_s"),
                    "state_bytes": trials[0]["state_bytes"],
                    **({} if args.tier == "replica" else {
                        "fault_to_progress_regained_s": med("fault_to_progress_regained_s"),
                        "rolled_back_steps_all": [t["rolled_back_steps"] for t in trials],
                        "snapshot_host_bytes_per_rank": 4 * trials[0]["state_bytes"] if args.tier == "snapshot" else None,
                        "checkpoint_file_bytes": trials[0]["checkpoint_file_bytes"],
                        **{k: med(k) for k in ("protected_step_extra_s", "amortised_overhead")
                           if all(k in t for t in trials)}})},
        "trials": trials,
    }
    results_io.write(results_io.stamped("cpu-failure" + name), result)


if __name__ == "__main__":
    main()
