"""The control plane at scale (issue 38): one job of N training nodes x 8 stub ranks on the
embedded cluster, driven by the real controller, keeper and policy.

    flock /tmp/tm-e2e.lock sh -c 'python -m trainmover.cli cluster up --nodes 128 --standby 2 --dir D &&
        python bench/cpu_control_plane_scale.py --dir D --sizes 16 128; python -m trainmover.cli cluster down --dir D'

The ranks are stub ranks (runtime/stub_node.py: one process per node plays its 8 ranks, each
with its own control connection; a step is a sleep of --step-s; no torch), so that 1,024
ranks fit a 2-core machine. Per size, one job of JOB_USER's (the rate limit's subject):

* start: sbatch -> the first step every rank reported (metrics.jsonl's first row, rank time);
  the user's RPCs meanwhile (sdiag by user; sdiag -r before the submit);
* steady state: --window s: the user's RPCs per minute, the CPU seconds per minute of the
  job's TrainMover processes (controller, keeper, the keeper's sruns; /proc utime+stime), and
  the growth of status.json, journal.jsonl, timeline.jsonl, metrics.jsonl per step;
* a drain (scontrol, root) of a training node (never train1, whose process serves the stub
  vote, nor the controller's node) -> the joiner's switch; control time = drain -> every rank
  prepared, plus the leaver's switch -> the joiner's `joined` (the wait for the step boundary
  in between is the workload's: up to two stub steps, as on real ranks); the user's RPCs then;
* a SIGKILL of one node's stub process (its 8 ranks: one process plays them) -> the recovery's
  `switched` (every rank resumed): the control time is all of it (the job is paused).
slurmctld's log is read for "rate limit exceeded" lines. Writes bench/results/cpu-control-plane-scale-<time>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402
from bench.cpu_slurmctld_load import parse_sdiag, status, user_workdir  # noqa: E402
from bench.polling import read_jsonl, wait  # noqa: E402
from trainmover.cluster.users import JOB_USER  # noqa: E402
from trainmover.controller.succession.keeper import sbatch_args  # noqa: E402
from trainmover.errors import SlurmError  # noqa: E402
from trainmover.slurm import commands  # noqa: E402
from trainmover.slurm.client import CliSlurm  # noqa: E402

REASON = "trainmover-bench scale"
RANKS_PER_NODE = 8
LOG = Path()  # slurmctld's log (main sets it)
FILES = ("status.json", "journal.jsonl", "timeline.jsonl", "metrics.jsonl")


def sdiag(env) -> dict:
    return parse_sdiag(commands.run(["sdiag"], timeout=10, env=env).stdout)


def user_rpcs(env) -> int:
    return sdiag(env)["by_user"].get(JOB_USER, 0)


def job_procs(job: int) -> dict[int, tuple[str, str]]:
    """pid -> (node, what) of the job's processes on this host: controller, keeper, srun, stub."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(x.split("=", 1) for x in (d / "environ").read_text().split("\0") if "=" in x)
            argv = (d / "cmdline").read_text().split("\0")
        except OSError:
            continue
        if env.get("SLURM_JOB_ID") != str(job):
            continue
        node, line = env.get("SLURMD_NODENAME", "?"), " ".join(argv)
        if "stub_node" in line:
            what = "stub"
        elif Path(argv[0]).name == "srun":
            what = "srun"
        elif "trainmover" in line:
            what = "keeper" if node.startswith("keep") else "controller"
        else:
            continue
        out[int(d.name)] = (node, what)
    return out


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_what(job: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for pid, (_, what) in job_procs(job).items():
        out[what] = out.get(what, 0.0) + cpu_s(pid)
    return out


def memory(job: int) -> dict:
    """RSS (MB) per kind of process, and the controller's threads (one per rank connection)."""
    out: dict = {"rss_mb": {}, "controller_threads": 0}
    for pid, (_, what) in job_procs(job).items():
        try:
            st = dict(x.split(":", 1) for x in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in x)
        except OSError:
            continue
        if "VmRSS" not in st:  # exiting (a zombie has no memory): seen as a fenced node's stub ended
            continue
        out["rss_mb"][what] = round(out["rss_mb"].get(what, 0) + int(st["VmRSS"].split()[0]) / 1024, 1)
        if what == "controller":
            out["controller_threads"] = max(out["controller_threads"], int(st["Threads"]))
    return out


def sizes(run: Path) -> dict[str, int]:
    return {f: (run / f).stat().st_size if (run / f).exists() else 0 for f in FILES}


def last_step(run: Path) -> int:
    try:
        with open(run / "metrics.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 400_000))
            lines = f.read().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, IndexError):
        return 0


def events(run: Path, migration: int) -> dict[str, float]:
    return {e["event"]: e["t"] for e in read_jsonl(run / "timeline.jsonl") if e.get("migration") == migration}


def warm(run: Path) -> bool:
    s = status(run)
    return (any(x["state"] == "ready" for x in s.get("standbys", []))
            and not any(m["state"] != "done" for m in s.get("migrations", [])))


def victim(run: Path, skip: set[str]) -> str:
    """A training node that is neither train1 (the stub vote's root) nor the controller's."""
    nodes = [n["name"] for n in status(run)["nodes"] if n["role"] == "train"]
    return next(n for n in reversed(nodes) if n not in skip)


def controller_node(job: int) -> str:
    return next((node for node, what in job_procs(job).values() if what == "controller"), "")


def one_size(env, slurm: CliSlurm, n: int, args) -> dict:
    # the machine is shared: its load beside each phase (a 2-core host at load 20 stretches every time)
    out: dict = {"nodes": n, "ranks": n * RANKS_PER_NODE, "loadavg": {"before": os.getloadavg()}}
    commands.run(["sdiag", "-r"], timeout=10, env=env)
    workdir = user_workdir(f"scale{n}-{time.strftime('%H%M%S')}")
    t_submit = time.time()
    job = int(commands.run(["sbatch", "--parsable", f"--chdir={workdir}", f"--job-name=tm-scale-{n}",
                            *sbatch_args(n), str(ROOT / "sbatch_templates/demo_gpt_cpu.sbatch")],
                           timeout=30, env=env, user=JOB_USER).stdout.split(";")[0])
    run = workdir / "runs" / str(job)
    out["job"] = job
    try:
        first = wait("every rank's first step", lambda: read_jsonl(run / "metrics.jsonl")[:1], args.start_timeout, 0.5)
        out["start_s"] = round(first[0]["t"] - t_submit, 2)
        out["loadavg"]["start"] = os.getloadavg()
        out["start_user_rpcs"] = user_rpcs(env)
        wait("a warm standby", lambda: warm(run), 300, 0.5)
        out["start_to_warm_standby_s"] = round(time.time() - t_submit, 2)
        # steady state
        commands.run(["sdiag", "-r"], timeout=10, env=env)
        c0, f0, s0, t0 = cpu_by_what(job), sizes(run), last_step(run), time.monotonic()
        time.sleep(args.window)
        c1, f1, s1, t1 = cpu_by_what(job), sizes(run), last_step(run), time.monotonic()
        minutes = (t1 - t0) / 60
        out["loadavg"]["steady"] = os.getloadavg()
        seen = sdiag(env)
        out["steady"] = {
            "window_s": round(t1 - t0, 1), "steps": s1 - s0,
            "user_rpcs_per_min": round(seen["by_user"].get(JOB_USER, 0) / minutes, 2),
            "rpcs_by_type": seen["by_type"],
            "cpu_s_per_min": {k: round((c1.get(k, 0) - c0.get(k, 0)) / minutes, 2) for k in c1},
            "bytes_per_step": {f: round((f1[f] - f0[f]) / max(1, s1 - s0), 1) for f in FILES},
            "bytes_at_end": f1, "step_at_end": s1, **memory(job)}
        out["steady"]["bytes_after_10000_steps_extrapolated"] = {
            f: int(f1[f] + (10000 - s1) * out["steady"]["bytes_per_step"][f]) if f != "status.json" else f1[f]
            for f in FILES}
        print(json.dumps(out), flush=True)
        skip = {"train1", controller_node(job)}
        # a drain
        node = victim(run, skip)
        commands.run(["sdiag", "-r"], timeout=10, env=env)
        t_drain = time.time()
        commands.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={REASON}"], timeout=10, env=env)
        wait("the migration", lambda: status(run).get("migrations") and status(run)["migrations"][0]["state"] == "done",
             180, 0.2)
        rpcs = user_rpcs(env)
        out["loadavg"]["drain"] = os.getloadavg()
        ev = events(run, 1)
        out["drain"] = {"node": node, "drain_to_requested_s": round(ev["requested"] - t_drain, 3),
                        "drain_to_all_prepared_s": round(ev["prepared"] - t_drain, 3),
                        "leaver_switched_to_joined_s": round(ev["joined"] - ev["leaver_switched"], 3),
                        "drain_to_joined_s": round(ev["joined"] - t_drain, 3),
                        "user_rpcs": rpcs, "seconds": round(time.time() - t_drain, 1)}
        out["drain"]["control_s"] = round(out["drain"]["drain_to_all_prepared_s"]
                                          + out["drain"]["leaver_switched_to_joined_s"], 3)
        print(json.dumps(out["drain"]), flush=True)
        slurm.resume(node)
        wait("a warm standby again", lambda: warm(run), 300, 0.5)
        # a SIGKILL of one node's ranks
        node = victim(run, skip | {out["drain"]["node"]})
        pid = next(p for p, (nd, what) in job_procs(job).items() if nd == node and what == "stub")
        commands.run(["sdiag", "-r"], timeout=10, env=env)
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        wait("the recovery", lambda: len(status(run).get("migrations", [])) >= 2
             and status(run)["migrations"][1]["state"] in ("done", "failed"), 180, 0.2)
        m = status(run)["migrations"][1]
        out["loadavg"]["sigkill"] = os.getloadavg()
        ev = events(run, 2)
        out["sigkill"] = {"node": node, "state": m["state"], "kill_to_detected_s": round(ev["detected"] - t_kill, 3),
                          "kill_to_resumed_s": round(ev["switched"] - t_kill, 3) if "switched" in ev else None,
                          "tier": (m.get("state_source") or {}).get("tier"), "user_rpcs": user_rpcs(env)}
        print(json.dumps(out["sigkill"]), flush=True)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - what was measured so far is kept, with why it stopped
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"{n} nodes stopped: {out['error']}", flush=True)
    finally:
        # scancel signals every srun of the keeper's, and each asks slurmctld to cancel its step as
        # the job's user: 129 sruns drew 445 "rate limit exceeded" there (128-node run). Counted apart.
        out["log_at_cancel"] = LOG.stat().st_size if LOG.exists() else 0
        try:  # a slurmctld too slow to answer here (host load 80+) must not lose what was measured
            commands.run(["scancel", str(job)], timeout=10, env=env, check=False)
            wait("the job's end", lambda: not commands.run(["squeue", "-h", "-j", str(job)], timeout=10, env=env,
                                                            check=False).stdout.strip(), 120, 1.0)
            for name, info in slurm.nodes().items():
                if "DRAIN" in info.flags or "FAIL" in info.state.upper() or "DOWN" in info.state.upper():
                    slurm.resume(name)
        except (SlurmError, TimeoutError) as exc:
            out["teardown_error"] = str(exc)[:500]
    out["files_at_end"] = sizes(run)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="the embedded cluster's state directory (cluster up --dir)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--heartbeat-s", type=float, default=0.0,
                    help="TM_HEARTBEAT_S (its timeout 6x it; 0: the defaults, 0.5 s and 3 s)")
    args = ap.parse_args()
    conf = Path(args.dir) / "etc" / "slurm.conf"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    env.update(SLURM_CONF=str(conf), TM_WORKLOAD="stub", TM_WORKLOAD_OPTIONS=f"step_s={args.step_s}",
               TM_RANKS_PER_NODE=str(RANKS_PER_NODE), TM_STEPS="1000000", TM_RECORD_ITERATIONS="0",
               TM_SNAPSHOT_EVERY="0", OMP_NUM_THREADS="1", TM_PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    if args.heartbeat_s:
        env.update(TM_HEARTBEAT_S=str(args.heartbeat_s), TM_HEARTBEAT_TIMEOUT_S=str(6 * args.heartbeat_s))
    slurm = CliSlurm(slurm_conf=str(conf))
    global LOG
    LOG = log = Path(args.dir) / "log" / "slurmctld.log"
    results, error = [], ""
    for n in args.sizes:
        log_from = log.stat().st_size if log.exists() else 0
        r = one_size(env, slurm, n, args)
        error = error or (f"{n} nodes: {r['error']}" if "error" in r else "")
        text = log.read_bytes()[log_from:].decode(errors="replace") if log.exists() else ""
        cut = r.get("log_at_cancel", log_from + len(text)) - log_from
        r["rate_limit_exceeded_lines"] = text[:cut].lower().count("rate limit exceeded")
        r["rate_limit_exceeded_lines_at_scancel"] = text[cut:].lower().count("rate limit exceeded")
        results.append(r)
    result = {"scenario": "control-plane-scale", "machine": results_io.machine() or "cpu-local-cluster",
              "gpus": "none", "cpu": f"{os.cpu_count()} cores",
              **results_io.provenance(__file__),
              "settings": {"ranks_per_node": RANKS_PER_NODE, "step_s": args.step_s, "window_s": args.window,
                           "heartbeat_s": args.heartbeat_s or 0.5,
                           "ranks": "stub (runtime/stub_node.py)", "jobs_run_as": JOB_USER,
                           "rate_limit": "rl_enable defaults" if "rl_enable" in conf.read_text() else "off"},
              "complete": not error, "error": error,
              "metrics": {str(r["nodes"]): {k: r.get(k) for k in ("start_s", "start_user_rpcs", "drain", "sigkill",
                                                                   "rate_limit_exceeded_lines",
                                                                   "rate_limit_exceeded_lines_at_scancel")}
                          | {"steady": {k: (r.get("steady") or {}).get(k) for k in (
                              "user_rpcs_per_min", "cpu_s_per_min", "bytes_per_step")}} for r in results},
              "trials": results}
    results_io.write(results_io.stamped("cpu-control-plane-scale"), result)


if __name__ == "__main__":
    main()
