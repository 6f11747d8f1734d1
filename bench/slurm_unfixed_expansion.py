"""A job's whole life on SchedMD's Slurm 25.11.7 as shipped, whose slurmctld crashes at every job
expansion (issue 40; docs/slurm-bug-report.md), with permit_job_expansion ON as a site may have it:

    flock /tmp/tm-e2e.lock .venv/bin/python bench/slurm_unfixed_expansion.py [--control]

* the product: an uninterrupted reference job, then the same job with one in-job standby
  (TM_INJOB_STANDBYS=1, one more node at submit) and TM_STANDBYS=1; rank 1's node is drained.
  Recorded: the pool mode and grow's refusal the job states (log and status.json), the migration
  onto the in-job standby, the drained node released, the job's end and its digest against the
  reference, and slurmctld's pid and liveness before, during and after (same pid, `scontrol ping`
  up, no crash line in its log).
* `--control` (negative control, last: it takes slurmctld down): root declares the release fixed
  (etc/trainmover-expansion-fix naming 25.11.7, which it is not) and a job with a reservation
  standby and no in-job one is submitted: TrainMover now grows the job, and the record says
  whether slurmctld survived that. Expected: it does not, which is what the refusal prevents.
  The declaration is removed and the cluster stopped afterwards.

The cluster is built with `--slurm 25.11 --slurm-unfixed` (cluster/releases.unfixed; the first
run builds its root filesystem, minutes). Writes bench/results/slurm-unfixed-25.11.7-<time>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402
from bench.polling import read_jsonl, wait  # noqa: E402
from trainmover import cluster  # noqa: E402
from trainmover.cluster.procs import read_pid  # noqa: E402
from trainmover.cluster.users import JOB_USER, host_account  # noqa: E402
from trainmover.controller.succession.keeper import sbatch_args  # noqa: E402
from trainmover.slurm import commands  # noqa: E402
from trainmover.slurm.client import CliSlurm  # noqa: E402

STATE_DIR = "/var/tmp/trainmover-cluster-unfixed"
JOBS_DIR = "/var/tmp/trainmover-bench-unfixed-jobs"  # JOB_USER's submit directories
REASON = "trainmover-bench unfixed"
TEMPLATE = ROOT / "sbatch_templates" / "demo_gpt_cpu.sbatch"  # 3 training nodes + its keeper
TRAIN = 3
STEPS = 300
CRASH_WORDS = ("segmentation fault", "sigsegv", "fatal", "core dumped", "assert")


def user_workdir(name: str) -> Path:
    """A submit directory of JOB_USER's (0700), as a user's own."""
    acct = host_account(JOB_USER)
    d = Path(JOBS_DIR) / f"{name}-{time.strftime('%H%M%S')}"
    d.mkdir(parents=True, exist_ok=True)
    os.chown(d, acct.uid, acct.gid)
    d.chmod(0o700)
    return d


def submit(env, name: str, nodes: int, **tm_env) -> tuple[int, Path]:
    workdir = user_workdir(name)
    job_env = {**env, **{k: str(v) for k, v in tm_env.items()}}
    out = commands.run(["sbatch", "--parsable", f"--chdir={workdir}", f"--job-name=tm-bench-{name}",
                        *sbatch_args(nodes), str(TEMPLATE)], timeout=15, env=job_env, user=JOB_USER).stdout
    job = int(out.split(";")[0])
    return job, workdir


def status(workdir: Path, job: int) -> dict:
    try:
        return json.loads((workdir / "runs" / str(job) / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def state(slurm: CliSlurm, job: int) -> str:
    try:
        return slurm.job(job).state
    except Exception:  # noqa: BLE001 - gone from slurmctld's memory, or slurmctld down
        return "UNKNOWN"


def ended(slurm: CliSlurm, job: int) -> str:
    s = state(slurm, job)
    return s if s not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") else ""


def slurm_out(workdir: Path, job: int) -> str:
    p = workdir / f"slurm-{job}.out"
    return p.read_text(errors="replace") if p.exists() else ""


def final(workdir: Path, job: int) -> dict:
    try:
        return json.loads((workdir / "runs" / str(job) / "final.json").read_text())
    except (OSError, ValueError):
        return {}


class Ctld:
    """slurmctld's pid (its pid file) and whether it answers, sampled; its log's crash lines."""

    def __init__(self, state_dir: Path):
        self.pid_file = state_dir / "run" / "slurmctld.pid"
        self.log = state_dir / "log" / "slurmctld.log"
        self.log_from = self.log.stat().st_size if self.log.exists() else 0
        self.samples: list[dict] = []

    def sample(self, env, when: str) -> dict:
        pid = read_pid(self.pid_file)
        alive = bool(pid) and Path(f"/proc/{pid}").exists()
        ping = commands.run(["scontrol", "ping"], timeout=10, env=env, check=False)
        up = ping.returncode == 0 and "UP" in ping.stdout
        self.samples.append({"when": when, "t": round(time.time(), 3), "pid": pid, "alive": alive, "ping_up": up})
        return self.samples[-1]

    def crash_lines(self) -> list[str]:
        text = self.log.read_text(errors="replace")[self.log_from:] if self.log.exists() else ""
        return [x for x in text.splitlines() if any(w in x.lower() for w in CRASH_WORDS)][-20:]


def product(env, slurm: CliSlurm, ctld: Ctld, pace: float) -> dict:
    """The reference and the in-job-standby job with a drain; what each said and did."""
    out: dict = {}
    ref, ref_dir = submit(env, "reference", TRAIN, TM_STANDBYS=0)
    wait("the reference job to end", lambda: ended(slurm, ref), 600, 1.0)
    out["reference"] = {"job": ref, "state": ended(slurm, ref), "digest": final(ref_dir, ref).get("digest")}
    ctld.sample(env, "after the reference")
    job, wd = submit(env, "injob", TRAIN + 1, TM_STANDBYS=1, TM_INJOB_STANDBYS=1, TM_POLL_S=1,
                     TM_INJECT=f"pace:{pace}")
    out["job"] = {"job": job}
    wait("the in-job standby warm", lambda: any(s["state"] == "ready" for s in status(wd, job).get("standbys", [])),
         300, 0.5)
    st = status(wd, job)
    out["job"]["at_start"] = {"capabilities": st.get("capabilities"), "standby_pool": st.get("standby_pool"),
                              "standbys": [s["node"] for s in st.get("standbys", [])]}
    ctld.sample(env, "in-job standby ready")
    metrics = read_jsonl(wd / "runs" / str(job) / "metrics.jsonl")
    leaver = metrics[-1]["nodes"][1]
    t_drain = time.time()
    commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={REASON}"], timeout=10, env=env)
    wait("the migration done", lambda: [m["state"] for m in status(wd, job).get("migrations", [])] == ["done"],
         120, 0.2)
    m = status(wd, job)["migrations"][0]
    out["job"]["migration"] = {"leaver": m["leaver"], "joiner": m["joiner"], "trigger": m["trigger"],
                               "downtime_s": m.get("downtime_s"), "drain_to_done_s": round(time.time() - t_drain, 2)}
    ctld.sample(env, "after the migration")
    wait("the in-job job to end", lambda: ended(slurm, job), 600, 1.0)
    ctld.sample(env, "after the job's end")
    text = slurm_out(wd, job)
    st = status(wd, job)
    job_info = slurm.job(job)
    out["job"].update({
        "state": ended(slurm, job), "restart_count": job_info.restart_count,
        "leaver_released": leaver not in job_info.nodes,
        "digest": final(wd, job).get("digest"),
        "log_lines": [x for x in text.splitlines() if "standby mode" in x or "grow" in x.lower()][:8],
        "status_capabilities_at_end": st.get("capabilities"),
    })
    out["digest_equal"] = (out["reference"]["state"] == out["job"]["state"] == "COMPLETED"
                           and out["reference"]["digest"] is not None
                           and out["reference"]["digest"] == out["job"]["digest"]) if out["reference"]["digest"] else None
    return out


def control(env, info, slurm: CliSlurm, ctld: Ctld) -> dict:
    """The refusal overridden by a false declaration: the job grows; did slurmctld live?"""
    declaration = Path(info.slurm_conf).parent / "trainmover-expansion-fix"
    declaration.write_text("# FALSE, for the negative control of bench/slurm_unfixed_expansion.py\n"
                           f"{info.slurm_version}\n")
    declaration.chmod(0o644)
    out: dict = {"declared": info.slurm_version}
    try:
        job, wd = submit(env, "control", TRAIN, TM_STANDBYS=1, TM_POLL_S=1)
        out["job"] = job
        t0 = time.time()

        def grown_or_down():
            s = ctld.sample(env, "control: waiting")
            if not (s["alive"] and s["ping_up"]):
                return "slurmctld down"
            return "grown" if any(x["state"] == "ready" for x in status(wd, job).get("standbys", [])) else ""
        try:
            out["outcome"] = wait("the reservation standby to join, or slurmctld to go", grown_or_down, 300, 1.0)
        except TimeoutError as exc:
            out["outcome"] = f"neither: {exc}"
        out["seconds"] = round(time.time() - t0, 1)
        out["capabilities"] = status(wd, job).get("capabilities")
        out["slurmctld_after"] = ctld.sample(env, "control: end")
        out["crash_lines"] = ctld.crash_lines()
    finally:
        declaration.unlink(missing_ok=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--control", action="store_true", help="then grow under a false declaration (takes slurmctld down)")
    ap.add_argument("--pace", type=float, default=0.17, help="seconds each step sleeps (the job outlasts the drain)")
    args = ap.parse_args()
    t0 = time.time()
    info = cluster.up(nodes=TRAIN + 1, standby=1, keepers=1, state_dir=STATE_DIR, slurm="25.11", unfixed=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    env.update(SLURM_CONF=str(info.slurm_conf), TM_STEPS=str(STEPS), OMP_NUM_THREADS="1", TM_PYTHON=sys.executable,
               PYTHONPATH=str(ROOT))
    slurm = CliSlurm(slurm_conf=str(info.slurm_conf))
    for name, node in slurm.nodes().items():
        if "DRAIN" in node.flags:
            slurm.resume(name)
    ctld = Ctld(Path(STATE_DIR))
    ctld.sample(env, "cluster up")
    conf = Path(info.slurm_conf).read_text()
    result_trials: dict = {"cluster_up_s": round(time.time() - t0, 1)}
    error = ""
    try:
        result_trials["product"] = product(env, slurm, ctld, args.pace)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - written with what was seen so far
        error = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"stopped: {error}", flush=True)
    finally:
        for name, node in slurm.nodes().items():
            if "DRAIN" in node.flags and node.reason == REASON:
                slurm.resume(name)
    survived = [s for s in ctld.samples]
    pids = {s["pid"] for s in survived}
    result_trials["slurmctld_through_the_job"] = {
        "samples": survived, "one_pid": len(pids) == 1 and None not in pids,
        "always_up": all(s["alive"] and s["ping_up"] for s in survived), "crash_lines": ctld.crash_lines()}
    if args.control and not error:
        result_trials["control"] = control(env, info, slurm, ctld)
    if args.control:
        cluster.down(state_dir=STATE_DIR)
    p = result_trials.get("product", {})
    job = p.get("job", {})
    cap = (job.get("at_start") or {}).get("capabilities") or {}
    ctl = result_trials.get("control") or {}
    result = {
        "scenario": "slurm-unfixed-expansion", "machine": "cpu-local-cluster", "gpus": "none",
        "cpu": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        **results_io.provenance(__file__),
        "settings": {"slurm": info.slurm, "slurm_version": info.slurm_version, "build": "25.11.7 unfixed (--slurm-unfixed)",
                     "permit_job_expansion": "permit_job_expansion" in conf, "jobs_run_as": JOB_USER,
                     "steps": STEPS, "pace_s": args.pace, "training_nodes": TRAIN, "in_job_standbys": 1,
                     "reservation_standbys": 1},
        "complete": not error, "error": error,
        "metrics": {
            "slurmctld_up_through_the_job": result_trials["slurmctld_through_the_job"]["always_up"]
            and result_trials["slurmctld_through_the_job"]["one_pid"],
            "pool_mode": (cap.get("pool_mode") or {}).get("mode"),
            "grow": cap.get("grow"), "grow_refused_why": (cap.get("why") or {}).get("grow"),
            "job_state": job.get("state"), "migrated_to_in_job_standby":
                (job.get("migration") or {}).get("joiner") in ((job.get("at_start") or {}).get("standbys") or []),
            "drained_node_released": job.get("leaver_released"),
            "downtime_s": (job.get("migration") or {}).get("downtime_s"),
            "digest_equal": p.get("digest_equal"),
            "control_outcome": ctl.get("outcome"),
        },
        "trials": result_trials,
    }
    results_io.write(results_io.stamped("slurm-unfixed-25.11.7"), result)


if __name__ == "__main__":
    main()
