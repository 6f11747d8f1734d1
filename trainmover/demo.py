"""`trainmover demo [--slurm V]`: the whole story on the embedded cluster, in about two minutes.

Starts the local Slurm cluster (the host's Slurm, or release V from a Debian root
filesystem when the host does not have it: trainmover/cluster/rootfs.py), submits `sbatch_templates/demo_gpt_cpu.sbatch`, drains one
of the job's nodes once training is under way, and prints the migration: the rank's new
node, the drained node leaving the job, per-phase times and the downtime. Every wait has
a deadline; on failure it says what it waited for and where the logs are.

Run by root (who starts the cluster and drains the node, as an admin would), it submits the
job as the cluster's ordinary user (cluster/users.py: JOB_USER), from a directory of theirs
(0700 under DEMO_DIR): no step of the job runs as root, and its files are that user's alone.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from trainmover import cluster
from trainmover.errors import TrainMoverError
from trainmover.slurm import commands
from trainmover.slurm.client import CliSlurm

ROOT = Path(__file__).resolve().parents[1]
REASON = "trainmover-demo maintenance"  # only nodes drained with this reason are resumed by a later demo
DEMO_DIR = Path("/var/tmp/trainmover-demo")  # the submit directories of JOB_USER's demo jobs


def _submit_dir(user: str) -> Path:
    """A fresh directory of `user`'s (0700) under DEMO_DIR (0755, root's)."""
    from trainmover.cluster.users import host_account
    acct = host_account(user)
    if acct is None:
        raise TrainMoverError(f"demo: the cluster's user {user} is missing (`trainmover cluster up` creates it)")
    DEMO_DIR.mkdir(mode=0o755, exist_ok=True)
    if DEMO_DIR.is_symlink() or DEMO_DIR.stat().st_uid != 0:
        raise TrainMoverError(f"demo: {DEMO_DIR} is not root's own directory; remove it and try again")
    os.chmod(DEMO_DIR, 0o755)
    d = Path(tempfile.mkdtemp(prefix="demo-", dir=DEMO_DIR))
    os.chown(d, acct.uid, acct.gid)
    return d


def _wait(what: str, check, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TrainMoverError(f"demo: timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _last(path: Path) -> dict | None:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    return json.loads(lines[-1]) if lines else None


def main(steps: int = 1500, workdir: Path | None = None, slurm: str | None = None) -> int:
    info = cluster.up(nodes=4, standby=2, slurm=slurm)
    from trainmover.cluster.users import JOB_USER
    user = JOB_USER if os.geteuid() == 0 else None  # root only starts the cluster and drains
    if workdir is None:
        workdir = _submit_dir(user) if user else ROOT
    env = {**os.environ, "SLURM_CONF": str(info.slurm_conf), "TM_STEPS": str(steps),
           "TM_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}  # the checkout's, from any directory
    slurm = CliSlurm(slurm_conf=str(info.slurm_conf))
    for name, node in slurm.nodes().items():  # an earlier demo's drained node: give it back
        if "DRAIN" in node.flags and node.reason == REASON:
            slurm.resume(name)
    print(f"[demo] cluster up on {info.slurm}: training nodes {','.join(info.train_nodes)}, "
          f"standbys {','.join(info.standby_nodes)} (reservation {info.reservation})")
    out = commands.run(["sbatch", "--parsable", f"--chdir={workdir}", str(ROOT / "sbatch_templates" / "demo_gpt_cpu.sbatch")],
                       timeout=15, env=env, user=user).stdout
    job_id = int(out.strip().split(";")[0])
    run = workdir / "runs" / str(job_id)
    print(f"[demo] submitted job {job_id} as {user or 'you'}; outputs in {run}")
    metrics = run / "metrics.jsonl"

    def training(step: int) -> bool:
        if (_last(metrics) or {}).get("step", 0) >= step:
            return True
        job = slurm.job(job_id)
        if job.state not in ("PENDING", "CONFIGURING", "RUNNING"):
            out = workdir / f"slurm-{job_id}.out"
            tail = "\n".join(out.read_text(errors="replace").splitlines()[-15:]) if out.exists() else "(no output)"
            raise TrainMoverError(f"demo: job {job_id} ended {job.state} before step {step}; {out}:\n{tail}")
        return False

    _wait("training to log step 100", lambda: training(100), 120)
    _wait("a warm standby", lambda: any(s["state"] == "ready" for s in
                                        json.loads((run / "status.json").read_text())["standbys"]), 60)
    row = _last(metrics)
    leaver = row["nodes"][1]
    print(f"[demo] step {row['step']}, loss {row['loss']:.3f}, ranks on {row['nodes']}; a standby is warm")
    print(f"[demo] scontrol update nodename={leaver} state=drain reason='{REASON}'")
    commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={REASON}"], timeout=10, env=env)
    t0 = time.monotonic()
    row = _wait(f"rank 1 to leave {leaver}", lambda: (r := _last(metrics)) and r["nodes"][1] != leaver and r, 30, 0.1)
    print(f"[demo] {time.monotonic() - t0:.1f}s later rank 1 trains on {row['nodes'][1]} (step {row['step']})")
    _wait(f"{leaver} to be released", lambda: leaver not in slurm.job(job_id).nodes, 60)
    node = _wait(f"{leaver} to reach drained", lambda: (n := slurm.nodes([leaver])[leaver]).drained and n, 60)
    job = slurm.job(job_id)
    print(f"[demo] {leaver} left the job and is {node.state} ({node.reason!r}); job {job_id} is {job.state} "
          f"on {','.join(job.nodes)}, RestartCnt={job.restart_count}")
    status = _wait("the migration's downtime", lambda: (s := json.loads((run / "status.json").read_text()))
                   and s["migrations"] and s["migrations"][0]["downtime_s"] is not None and s, 60)
    m = status["migrations"][0]
    d = m["durations"]
    print(f"[demo] migration {m['leaver']} -> {m['joiner']} [{m['trigger']}]: phase 1 {d['phase1_s']:.3f}s "
          f"(training continued), switch {d['switch_s']:.3f}s, release {d['release_s']:.3f}s")
    print(f"[demo] DOWNTIME {m['downtime_s']:.3f}s (pause seen by the stayers, minus one normal step) "
          f"on Slurm {info.slurm_version}")
    print(f"[demo] job {job_id} trains on to step {steps}; `trainmover status --job {job_id}` shows it, "
          f"`scontrol update nodename={leaver} state=resume` returns the node"
          + (f" (with the Slurm commands on PATH: eval \"$(trainmover cluster env --dir {info.state_dir})\")"
             if info.slurm_root else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
