"""`trainmover demo [--slurm V]`: the whole story on the embedded cluster, in about two minutes.

Starts the local Slurm cluster (the host's Slurm, or release V from a Debian root
filesystem when the host does not have it: trainmover/cluster/rootfs.py), submits `sbatch_templates/demo_gpt_cpu.sbatch`, drains one
of the job's nodes once training is under way, and prints the migration: the rank's new
node, the drained node leaving the job, per-phase times and the downtime. With `--verify` it
then lets the job finish, runs it again with no drain and compares every step's losses and
the final state digest (bit-exact, or exit 1). Every wait has a deadline; on failure it says
what it waited for and where the logs are.

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
from trainmover.cluster import rootdirs
from trainmover.errors import TrainMoverError
from trainmover.protocol import files
from trainmover.slurm import commands
from trainmover.slurm.client import CliSlurm

ROOT = Path(__file__).resolve().parents[1]
REASON = "trainmover-demo maintenance"  # only nodes drained with this reason are resumed by a later demo
# how the controller saw the drain (status.json's node_watch.drains_seen), in words
PATHS = {"node-reader": "the cluster's node-state reader (one RPC a second for every job: docs/admin.md)",
         "poll": "the job's own node poll (TM_POLL_S; the cluster runs no node-state reader)",
         "drain notice": "a drain notice (trainmover drain or the health check)"}
DEMO_DIR = Path("/var/tmp/trainmover-demo")  # the submit directories of JOB_USER's demo jobs


def _submit_dir(user: str) -> Path:
    """A fresh directory of `user`'s (0700) under DEMO_DIR (0755, root's)."""
    from trainmover.cluster.users import host_account
    acct = host_account(user)
    if acct is None:
        raise TrainMoverError(f"demo: the cluster's user {user} is missing (`trainmover cluster up` creates it)")
    rootdirs.own_dir(DEMO_DIR, mode=0o755)  # root's, or refused (a link or another user's: planted)
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


def _read(path: Path) -> str:
    """A file of the demo user's job, as root reads it: never through a link, never blocking on a
    FIFO, a regular file of bounded size only (protocol/files.py); undecodable bytes replaced."""
    return files.read_limited(path, 256 << 20).decode(errors="replace")


def _last(path: Path) -> dict | None:
    try:
        lines = _read(path).splitlines()
    except FileNotFoundError:
        return None
    return json.loads(lines[-1]) if lines else None


def _rows(run: Path) -> dict[int, list]:
    """Each logged step's losses (every rank's) from a run's metrics.jsonl."""
    path = run / "metrics.jsonl"
    return {r["step"]: r["losses"] for r in map(json.loads, _read(path).splitlines())} if path.exists() else {}


def _final(slurm: CliSlurm, job_id: int, run: Path, out: Path, timeout: float) -> dict:
    """The job's final.json once it finished; an error naming its state if it ended without one."""
    def done():
        if (run / "final.json").exists():
            return json.loads(_read(run / "final.json"))
        state = slurm.job(job_id).state
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            tail = "\n".join(_read(out).splitlines()[-15:]) if out.exists() else "(no output)"
            raise TrainMoverError(f"demo: job {job_id} ended {state} without final.json; {out}:\n{tail}")
        return None
    return _wait(f"job {job_id} to finish", done, timeout, 1.0)


def verify(slurm: CliSlurm, env: dict, user: str | None, workdir: Path, job_id: int, steps: int) -> bool:
    """`--verify`: let the job finish, run the same job again with no drain, and compare every
    step's losses and the final state digest. Prints the verdict; True when bit-exact."""
    run = workdir / "runs" / str(job_id)
    timeout = 120 + steps * 0.5  # the CPU demo runs ~10 steps a second; generous for a loaded host
    final = _final(slurm, job_id, run, workdir / f"slurm-{job_id}.out", timeout)
    ref_dir = _submit_dir(user) if user else workdir
    ref_id = _sbatch(env, ref_dir, user)
    print(f"[demo] job {job_id} finished at step {final['steps']}; the reference, job {ref_id}, runs the same with no drain")
    ref_run = ref_dir / "runs" / str(ref_id)
    ref = _final(slurm, ref_id, ref_run, ref_dir / f"slurm-{ref_id}.out", timeout)
    got, want = _rows(run), _rows(ref_run)
    differ = [s for s in sorted(want) if got.get(s) != want[s]]
    if sorted(got) != sorted(want) or differ or final["digest"] != ref["digest"]:
        print(f"[demo] NOT BIT-EXACT: steps logged {len(got)} vs {len(want)}, losses differ at steps {differ[:5]}, "
              f"digest {final['digest'][:12]} vs {ref['digest'][:12]}")
        return False
    print(f"[demo] BIT-EXACT: all {len(want)} steps' losses of every rank and the final state digest "
          f"({final['digest'][:12]}) equal the uninterrupted run's")
    return True


def _sbatch(env: dict, workdir: Path, user: str | None) -> int:
    out = commands.run(["sbatch", "--parsable", f"--chdir={workdir}", str(ROOT / "sbatch_templates" / "demo_gpt_cpu.sbatch")],
                       timeout=15, env=env, user=user).stdout
    return int(out.strip().split(";")[0])


def main(steps: int = 1500, workdir: Path | None = None, slurm: str | None = None, check: bool = False) -> int:
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
    job_id = _sbatch(env, workdir, user)
    run = workdir / "runs" / str(job_id)
    print(f"[demo] submitted job {job_id} as {user or 'you'}; outputs in {run}")
    metrics = run / "metrics.jsonl"

    def training(step: int) -> bool:
        if (_last(metrics) or {}).get("step", 0) >= step:
            return True
        job = slurm.job(job_id)
        if job.state not in ("PENDING", "CONFIGURING", "RUNNING"):
            out = workdir / f"slurm-{job_id}.out"
            tail = "\n".join(_read(out).splitlines()[-15:]) if out.exists() else "(no output)"
            raise TrainMoverError(f"demo: job {job_id} ended {job.state} before step {step}; {out}:\n{tail}")
        return False

    _wait("training to log step 100", lambda: training(100), 120)
    _wait("a warm standby", lambda: any(s["state"] == "ready" for s in
                                        json.loads(_read(run / "status.json"))["standbys"]), 60)
    row = _last(metrics)
    leaver = row["nodes"][1]
    print(f"[demo] step {row['step']}, loss {row['loss']:.3f}, ranks on {row['nodes']}; a standby is warm")
    print(f"[demo] scontrol update nodename={leaver} state=drain reason='{REASON}'")
    drained_at = time.time()
    commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={REASON}"], timeout=10, env=env)
    t0 = time.monotonic()
    row = _wait(f"rank 1 to leave {leaver}", lambda: (r := _last(metrics)) and r["nodes"][1] != leaver and r, 30, 0.1)
    print(f"[demo] {time.monotonic() - t0:.1f}s later rank 1 trains on {row['nodes'][1]} (step {row['step']})")
    _wait(f"{leaver} to be released", lambda: leaver not in slurm.job(job_id).nodes, 60)
    node = _wait(f"{leaver} to reach drained", lambda: (n := slurm.nodes([leaver])[leaver]).drained and n, 60)
    job = slurm.job(job_id)
    print(f"[demo] {leaver} left the job and is {node.state} ({node.reason!r}); job {job_id} is {job.state} "
          f"on {','.join(job.nodes)}, RestartCnt={job.restart_count}")
    # done: the release's time is written with the migration's last phase (the downtime before it)
    status = _wait("the migration to be recorded done", lambda: (s := json.loads(_read(run / "status.json")))
                   and s["migrations"] and s["migrations"][0]["state"] == "done"
                   and s["migrations"][0]["downtime_s"] is not None and s, 60)
    m = status["migrations"][0]
    seen = ((status.get("node_watch") or {}).get("drains_seen") or {}).get(leaver)
    if seen:  # the controller's clock; the embedded cluster's nodes share this host's
        print(f"[demo] the drain was seen {seen['at'] - drained_at:.2f}s after the scontrol, through "
              + PATHS.get(seen["via"], seen["via"]))
    d = {k: (f"{v:.3f}s" if isinstance(v, (int, float)) else "-") for k, v in m["durations"].items()}
    print(f"[demo] migration {m['leaver']} -> {m['joiner']} [{m['trigger']}]: phase 1 {d.get('phase1_s', '-')} "
          f"(training continued), switch {d.get('switch_s', '-')}, release {d.get('release_s', '-')}")
    print(f"[demo] DOWNTIME {m['downtime_s']:.3f}s (pause seen by the stayers, minus one normal step) "
          f"on Slurm {info.slurm_version}")
    if check:
        slurm.resume(leaver)  # the reference needs as many nodes as the job had
        return 0 if verify(slurm, env, user, workdir, job_id, steps) else 1
    print(f"[demo] job {job_id} trains on to step {steps}; `trainmover status --job {job_id}` shows it, "
          f"`scontrol update nodename={leaver} state=resume` returns the node"
          + (f" (with the Slurm commands on PATH: eval \"$(trainmover cluster env --dir {info.state_dir})\")"
             if info.slurm_root else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
