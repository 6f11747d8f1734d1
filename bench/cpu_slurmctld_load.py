"""Load on slurmctld (issue 30): RPCs a TrainMover job costs in steady state, and how fast a drain
reaches it, on the embedded cluster.

    flock /tmp/tm-e2e.lock .venv/bin/python bench/cpu_slurmctld_load.py --slurm 24.11 [--window 60] [--drains 10]

* steady state: `sdiag` counts every RPC slurmctld served, by message type and by user. The jobs
  are JOB_USER's (tmuser; the rate limit's subject), so their RPCs are that user's count, apart
  from root's (slurmd; the health check, which slurmd runs on idle nodes only, so root's count
  changes with the number of busy nodes). Windows with no job, 1 and then 5 demo jobs (each:
  keeper node, one training node, one warm standby, steps paced to 0.2 s). RPCs per job per
  minute = the user's RPCs / jobs / minutes.
* the per-cluster node-state reader (`trainmover node-reader`, root, every 2 s): a third window
  with the 5 jobs reading its table instead of polling (its RPCs counted in, shared by the jobs).
* drains, one job, first with the reader (scontrol drains, found through its table), then
  without: `scontrol update State=DRAIN` of its training node (found by the node poll,
  TM_POLL_S) and the health check as slurmd runs it (etc/healthcheck.sh, a fault injected
  through its hook; it drains and writes the drain notice) alternate; for each, the time from
  the drain to the controller's decision (the migration's `requested` time in status.json,
  the controller's clock, same host), each drain at a random moment (uniform over 10 s after the
  job is ready again). The drained node is resumed once the migration is done.

Writes bench/results/cpu-slurmctld-load-<time>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402
from bench.polling import wait  # noqa: E402
from trainmover import cluster  # noqa: E402
from trainmover.cluster.users import JOB_USER, host_account  # noqa: E402
from trainmover.controller.succession.keeper import sbatch_args  # noqa: E402
from trainmover.slurm import commands  # noqa: E402
from trainmover.slurm.client import CliSlurm  # noqa: E402

REASON = "trainmover-bench load"
STATE_DIR = "/var/tmp/trainmover-cluster-load"
JOBS_DIR = "/var/tmp/trainmover-bench-load-jobs"  # JOB_USER's submit directories
_RPC = re.compile(r"^\s+(\S+)\s+\(\s*\d+\)\s+count:(\d+)\s+ave_time:(\d+)")


def parse_sdiag(text: str) -> dict[str, dict[str, int]]:
    """`sdiag` -> {"by_type": {RPC: count}, "by_user": {user: count}, "ave_us": {RPC: slurmctld's
    mean microseconds}}."""
    out: dict[str, dict[str, int]] = {"by_type": {}, "by_user": {}, "ave_us": {}}
    section = None
    for line in text.splitlines():
        if line.startswith("Remote Procedure Call statistics by message type"):
            section = "by_type"
        elif line.startswith("Remote Procedure Call statistics by user"):
            section = "by_user"
        elif line and not line[0].isspace():
            section = None
        elif section and (m := _RPC.match(line)):
            out[section][m.group(1)] = int(m.group(2))
            if section == "by_type":
                out["ave_us"][m.group(1)] = int(m.group(3))
    return out


def window(env, seconds: float) -> dict[str, dict[str, int]]:
    """RPCs slurmctld served in the next `seconds` (sdiag -r resets its counters; root only)."""
    commands.run(["sdiag", "-r"], timeout=10, env=env)
    time.sleep(seconds)
    return parse_sdiag(commands.run(["sdiag"], timeout=10, env=env).stdout)


def command_costs(env, node: str, node_query: Path, repeats: int = 10) -> dict:
    """RPCs of one call of each node or job query, by type: each run `repeats` times in a row
    between two sdiag reads (types seen fewer than `repeats` times are the cluster's own)."""
    job = commands.run(["squeue", "-h", "-o", "%i"], timeout=10, env=env).stdout.split()
    argvs = {"scontrol -o show node": ["scontrol", "-o", "show", "node", node],
             "sinfo -n": ["sinfo", "-h", "-N", "-n", node, "-o", "%N %T"]}
    if node_query.exists():
        argvs["tm_nodes"] = [str(node_query), node]
    if job:
        argvs["scontrol -o show job"] = ["scontrol", "-o", "show", "job", job[0]]
        argvs["squeue -j"] = ["squeue", "-h", "-j", job[0], "-o", "%T"]
    out = {}
    for name, argv in argvs.items():
        commands.run(["sdiag", "-r"], timeout=10, env=env)
        for _ in range(repeats):
            commands.run(argv, timeout=10, env=env)
        seen = parse_sdiag(commands.run(["sdiag"], timeout=10, env=env).stdout)
        out[name] = {k: round(v / repeats, 2) for k, v in seen["by_type"].items() if v >= repeats}
    return out


def status(run: Path) -> dict:
    try:
        return json.loads((run / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def user_workdir(name: str) -> Path:
    """A submit directory of JOB_USER's (0700), as a user's own."""
    acct = host_account(JOB_USER)
    d = Path(JOBS_DIR) / name
    d.mkdir(parents=True, exist_ok=True)
    os.chown(d, acct.uid, acct.gid)
    d.chmod(0o700)
    return d


def submit(env, name: str) -> tuple[int, Path]:
    """One demo job of JOB_USER's (sdiag then counts its RPCs apart from root's health checks)."""
    workdir = user_workdir(f"{name}-{time.strftime('%H%M%S')}")
    job = int(commands.run(["sbatch", "--parsable", f"--chdir={workdir}", f"--job-name=tm-bench-{name}",
                            *sbatch_args(1), str(ROOT / "sbatch_templates/demo_gpt_cpu.sbatch")],
                           timeout=15, env=env, user=JOB_USER).stdout.split(";")[0])
    return job, workdir / "runs" / str(job)


def warm(run: Path) -> bool:
    s = status(run)
    return (any(x["state"] == "ready" for x in s.get("standbys", []))
            and not any(m["state"] != "done" for m in s.get("migrations", [])))


def per_job_minute(seen: dict, n: int, seconds: float) -> dict:
    """The jobs' user's RPCs (sdiag by user) per job per minute; the window's RPCs by type beside
    them (root's too: slurmd, the health check, which runs on idle nodes and so varies)."""
    mine = seen["by_user"].get(JOB_USER, 0)
    return {"rpcs_per_job_per_min": round(mine / n / (seconds / 60), 2), "user_rpcs": mine,
            "window_by_type": seen["by_type"], "window_by_user": seen["by_user"], "window_ave_us": seen["ave_us"]}


def drain_once(kind: str, env, info, slurm: CliSlurm, run: Path, k: int, rng: random.Random) -> dict:
    """Drain the job's training node (scontrol, or the health check); time to `requested`."""
    # A random moment: right after the standby is warm is right after a node poll (the poll saw
    # the resumed spare idle and took it), which would flatter the poll's detection time.
    time.sleep(rng.uniform(0, 10.0))
    s = status(run)
    node = next(n["name"] for n in s["nodes"] if n["role"] == "train")
    if kind in ("scontrol", "scontrol+reader"):
        t_drain = time.time()
        commands.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={REASON}"], timeout=10, env=env)
        extra = {}
    else:
        hook = Path(info.healthcheck_state) / f"inject-fault-{node}"
        hook.write_text("XID 79 (injected by bench/cpu_slurmctld_load.py)\n")
        t_start = time.time()
        proc = subprocess.run(["/usr/bin/env", "-i", f"SLURMD_NODENAME={node}",
                               str(Path(info.slurm_conf).parent / "healthcheck.sh")],
                              capture_output=True, text=True, timeout=15, cwd="/")
        hook.unlink()
        if proc.returncode != 1:
            raise RuntimeError(f"health check of {node} did not drain it: {proc.stdout}{proc.stderr}")
        notice = json.loads((Path(info.slurm_conf).parent / "trainmover-drains" / node).read_text())
        t_drain = notice["at"]  # right after scontrol drained the node
        extra = {"healthcheck_run_s": round(time.time() - t_start, 3)}
    m = wait(f"migration {k} of {node} to be requested",
             lambda: len(status(run).get("migrations", [])) >= k and status(run)["migrations"][k - 1], 60, 0.05)
    detect = m["phases"]["requested"] - t_drain
    wait(f"migration {k} to finish", lambda: status(run)["migrations"][k - 1]["state"] == "done", 180, 0.5)
    slurm.resume(node)
    wait("a warm standby again", lambda: warm(run), 180, 0.5)
    return {"kind": kind, "node": node, "drain_to_requested_s": round(detect, 3), "trigger": m["trigger"], **extra}


def start_reader(env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainmover.cli", "node-reader", "--interval", "2"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slurm", default=None, help="Slurm release of the cluster (default: the host's)")
    ap.add_argument("--window", type=float, default=60.0, help="seconds of each sdiag window")
    ap.add_argument("--jobs", type=int, default=5)
    ap.add_argument("--drains", type=int, default=10, help="drains of each kind")
    ap.add_argument("--stagger", type=float, default=15.0, help="seconds between the job starts")
    ap.add_argument("--reader-drains", type=int, default=5, help="scontrol drains with the per-cluster reader")
    ap.add_argument("--pace", type=float, default=0.2, help="seconds each step sleeps (CPU for 5 jobs on 2 cores)")
    args = ap.parse_args()
    # the cluster's own node reader off: the windows without one measure each job's poll
    info = cluster.up(nodes=args.jobs, standby=args.jobs, keepers=args.jobs, state_dir=STATE_DIR, slurm=args.slurm,
                      node_reader=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    env.update(SLURM_CONF=str(info.slurm_conf), TM_STEPS="100000", TM_INJECT=f"pace:{args.pace}", OMP_NUM_THREADS="1",
               TM_PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    rng = random.Random(30)
    slurm = CliSlurm(slurm_conf=str(info.slurm_conf))
    for name, node in slurm.nodes().items():
        if "DRAIN" in node.flags:
            slurm.resume(name)
    node_query = Path(info.slurm_conf).parent / "tm_nodes"
    log = Path(info.slurm_conf).parents[1] / "log" / "slurmctld.log"
    log_from = log.stat().st_size if log.exists() else 0
    jobs: list[tuple[int, Path]] = []
    result_trials: dict = {}
    drains: list = result_trials.setdefault("drains", [])
    error = ""
    try:
        idle = window(env, args.window)
        commands.run(["sdiag", "-r"], timeout=10, env=env)
        t_submit = time.time()
        jobs.append(submit(env, "1"))
        wait("job 1's standby to be warm", lambda: warm(jobs[0][1]), 300, 1.0)
        start = parse_sdiag(commands.run(["sdiag"], timeout=10, env=env).stdout)
        result_trials["startup_1_job"] = {"user_rpcs": start["by_user"].get(JOB_USER, 0),
                                          "seconds_to_warm_standby": round(time.time() - t_submit, 1),
                                          "window_by_type": start["by_type"]}
        one = window(env, args.window)
        result_trials["steady_1_job"] = per_job_minute(one, 1, args.window)
        for i in range(2, args.jobs + 1):
            # apart: four starts in the same second overdrew the user's bucket on 24.11 (a throttled
            # Slurm call held a controller's loop past its keeper's 3 s probe and the job ended)
            time.sleep(args.stagger)
            jobs.append(submit(env, str(i)))
        wait(f"{args.jobs} jobs with warm standbys", lambda: all(warm(r) for _, r in jobs), 600, 1.0)
        many = window(env, args.window)
        result_trials[f"steady_{args.jobs}_jobs"] = per_job_minute(many, args.jobs, args.window)
        result_trials["rpcs_per_command"] = command_costs(env, "spare1", node_query)
        print(json.dumps(result_trials["rpcs_per_command"]), flush=True)
        result_trials["idle_window"] = idle
        reader = start_reader(env)  # the per-cluster node-state reader (root), interval 2 s
        try:
            wait("the reader's first table", lambda: (Path(info.slurm_conf).parent / "trainmover-drains" /
                                                      ".node-states.json").exists(), 30, 0.2)
            shared = window(env, args.window)
            result_trials[f"steady_{args.jobs}_jobs_reader"] = per_job_minute(shared, args.jobs, args.window)
            result_trials[f"steady_{args.jobs}_jobs_reader"]["reader_rpcs_per_min_whole_cluster"] = round(
                (shared["by_type"].get("REQUEST_NODE_INFO", 0)) / (args.window / 60), 2)
            commands.run(["scancel", *[str(j) for j, _ in jobs[1:]]], timeout=10, env=env)
            for k in range(1, args.reader_drains + 1):
                drains.append(drain_once("scontrol+reader", env, info, slurm, jobs[0][1], len(drains) + 1, rng))
                print(drains[-1], flush=True)
        finally:
            reader.terminate()
            reader.wait(10)
        for k in range(1, 2 * args.drains + 1):
            drains.append(drain_once("scontrol" if k % 2 else "healthcheck", env, info, slurm, jobs[0][1],
                                     len(drains) + 1, rng))
            print(drains[-1], flush=True)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - a wait timed out, or stopped (SIGINT): the trials done so far are written
        error = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"stopped: {error}", flush=True)
    finally:
        if jobs:
            commands.run(["scancel", *[str(j) for j, _ in jobs]], timeout=10, env=env, check=False)
        for name, node in slurm.nodes().items():
            if "DRAIN" in node.flags and (node.reason == REASON or node.reason.startswith("trainmover: healthcheck inject")):
                slurm.resume(name)
    text = log.read_text(errors="replace")[log_from:] if log.exists() else ""
    limited = [x for x in text.splitlines() if "rate limit exceeded" in x.lower()]

    def med(kind):
        xs = [d["drain_to_requested_s"] for d in result_trials["drains"] if d["kind"] == kind]
        if not xs:
            return {"median_s": None, "max_s": None, "n": 0}
        return {"median_s": round(statistics.median(xs), 3), "max_s": max(xs), "n": len(xs)}

    def rate(name):
        return (result_trials.get(name) or {}).get("rpcs_per_job_per_min")

    result = {
        "scenario": "slurmctld-load", "machine": "cpu-local-cluster",
        "gpus": "none", "cpu": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        **results_io.provenance(__file__),
        "settings": {"workload": "gpt_demo tiny", "ranks_per_job": 1, "standbys_per_job": 1, "backend": "gloo",
                     "pace_s": args.pace, "slurm": info.slurm, "window_s": args.window,
                     "node_query": "tm_nodes" if node_query.exists() else "scontrol",
                     "poll_s": 10.0, "jobs_run_as": JOB_USER, "rate_limit": "rl_enable defaults" if "rl_enable" in
                     Path(info.slurm_conf).read_text() else "off"},
        "complete": not error, "error": error,
        "metrics": {"rpcs_per_job_per_min_1_job": rate("steady_1_job"),
                    "startup_rpcs_1_job": (result_trials.get("startup_1_job") or {}).get("user_rpcs"),
                    f"rpcs_per_job_per_min_{args.jobs}_jobs": rate(f"steady_{args.jobs}_jobs"),
                    "scontrol_drain_to_requested": med("scontrol"),
                    "healthcheck_drain_to_requested": med("healthcheck"),
                    "scontrol_drain_to_requested_with_reader": med("scontrol+reader"),
                    f"rpcs_per_job_per_min_{args.jobs}_jobs_with_reader": rate(f"steady_{args.jobs}_jobs_reader"),
                    "slurmctld_rate_limit_exceeded_lines": len(limited)},
        "trials": result_trials,
    }
    results_io.write(results_io.stamped("cpu-slurmctld-load"), result)


if __name__ == "__main__":
    main()
