"""The controller moves: planned hand-over and loss, on the CPU local cluster (docs/admin.md,
"No special node").

    flock /tmp/tm-e2e.lock .venv/bin/python bench/cpu_controller_move.py [--repeats 3] \
        [--cluster-dir /var/tmp/trainmover-cluster-e2e]

One demo job (sbatch_templates/demo_gpt_cpu.sbatch: keeper node + 3 training nodes, one standby),
trained long enough for every trial, then cancelled. Per repeat, with a warm standby and a warm
successor controller in place:

* **planned**: the controller's node is drained. Measured: the old controller's hand-over (its
  timeline `controller_hand_over`) to the successor serving (its `controller_resumed`: journal
  claimed and read, endpoint written, about to run its loop), and the drain to the node out of
  the job (polled in Slurm every 0.1 s). The node is resumed afterwards (back to the pool).
* **killed**: the controller process SIGKILLed (its pid from controller.json; every node of this
  cluster is on this host). Measured: the kill to the successor serving.
* **frozen**: the controller process SIGSTOPped (it answers nothing, its sockets stay open).
  Measured: the stop to the successor serving (the keeper's silence deadline is most of it).
* **killed_after_move**: the controller's node drained, and the new controller SIGKILLed the
  moment it serves (the successor started at the move is still importing). Measured: that kill
  to the next one serving. With `--successors 2` (TM_CONTROLLER_SUCCESSORS) a second warm one
  takes it; with 1 it waits for the importing one.

Writes bench/results/cpu-controller-move-<time>.json (shared/reference/bench-results.md).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402
from bench.cpu_checkpoint_restart import machine  # noqa: E402
from bench.cpu_slurmctld_load import user_workdir  # noqa: E402
from bench.polling import read_jsonl, wait  # noqa: E402
from trainmover.cluster.users import JOB_USER  # noqa: E402
from trainmover import cluster  # noqa: E402
from trainmover.slurm import commands  # noqa: E402
from trainmover.slurm.client import CliSlurm  # noqa: E402

REASON = "trainmover-bench controller move"
TEMPLATE = ROOT / "sbatch_templates" / "demo_gpt_cpu.sbatch"


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):  # not written yet, or being replaced
        return {}


class Job:
    def __init__(self, env: dict, workdir: Path, slurm: CliSlurm):
        self.env, self.slurm = env, slurm
        # the job is an ordinary user's (its submit directory theirs, 0700); draining is the admin's (root)
        out = commands.run(["sbatch", "--parsable", "--job-name=tm-bench-ctlmove", f"--chdir={workdir}",
                            str(TEMPLATE)], timeout=15, env=env, user=JOB_USER).stdout
        self.id = int(out.strip().split(";")[0])
        self.run = workdir / "runs" / str(self.id)
        self.out = workdir / f"slurm-{self.id}.out"

    def controller(self) -> dict:
        return read_json(self.run / "controller.json")

    def resumed(self, attempt: int) -> dict | None:
        """The timeline's `controller_resumed` of that attempt (the successor serving)."""
        return next((e for e in read_jsonl(self.run / "timeline.jsonl")
                     if e["event"] == "controller_resumed" and e["attempt"] == attempt), None)

    def warm_successors(self) -> int:
        """Successors warm: controllers that reported their imports done less those that took over."""
        text = self.out.read_text() if self.out.exists() else ""
        return len(re.findall(r"warm \(imports done\)", text)) - len(re.findall(
            r"trainmover\.supervisor warm successor on \S+ takes over", text))

    def missing(self) -> str:
        """What the next trial still waits for ('' when nothing): a warm standby, the warm
        successors, a controller that resumed, no migration under way."""
        st = read_json(self.run / "status.json")
        why = []
        if not any(s["state"] == "ready" for s in st.get("standbys", [])):
            why.append(f"no ready standby ({[(s.get('node'), s.get('state')) for s in st.get('standbys', [])]})")
        if self.warm_successors() < self.successors:
            why.append(f"{self.warm_successors()} of {self.successors} warm successors")
        if st.get("controller", {}).get("resuming", True):
            why.append("the controller is resuming")
        busy = [m["state"] for m in st.get("migrations", []) if m["state"] not in ("done", "aborted", "failed")]
        if busy:
            why.append(f"migrations under way: {busy}")
        return "; ".join(why)

    def ready(self) -> bool:
        return not self.missing()

    def step(self) -> int:
        return (read_jsonl(self.run / "metrics.jsonl") or [{}])[-1].get("step", 0)


def serving_after(job: Job, attempt: int, timeout: float) -> dict:
    wait(f"controller attempt {attempt + 1} serving", lambda: job.resumed(attempt + 1), timeout, 0.05)
    return job.resumed(attempt + 1)


def planned(job: Job, timeout: float) -> dict:
    ctl = job.controller()
    node, attempt = ctl["node"], ctl["attempt"]
    t_drain = time.time()
    if job.drain_with == "trainmover":  # an admin's drain: the job is told at once (drain notice)
        commands.run([sys.executable, "-m", "trainmover.cli", "drain", node, f"--reason={REASON}"], timeout=60,
                     env=job.env)
    else:  # a plain drain: found by the job's node poll (TM_POLL_S, 10 s)
        commands.run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={REASON}"], timeout=10,
                     env=job.env)
    wait(f"{node} to leave the job", lambda: node not in job.slurm.job(job.id).nodes, timeout, 0.1)
    out_s = time.time() - t_drain
    serving = serving_after(job, attempt, timeout)
    hand = [e for e in read_jsonl(job.run / "timeline.jsonl")
            if e["event"] == "controller_hand_over" and e["attempt"] == attempt][-1]
    job.slurm.resume(node)  # back to the pool, for the next trials
    return {"node": node, "to": job.controller()["node"], "attempt": attempt + 1,
            "drain_to_hand_over_s": round(hand["t"] - t_drain, 3),
            "hand_over_to_serving_s": round(serving["t"] - hand["t"], 3), "drain_to_node_out_s": round(out_s, 3)}


def killed_after_move(job: Job, timeout: float) -> dict:
    moved = planned(job, timeout)
    ctl = job.controller()
    assert ctl["attempt"] == moved["attempt"], (ctl, moved)
    t_stop = time.time()
    os.kill(int(ctl["pid"]), signal.SIGKILL)
    serving = serving_after(job, ctl["attempt"], timeout)
    return {"moved": moved, "node": ctl["node"], "to": job.controller()["node"], "attempt": ctl["attempt"] + 1,
            "stopped_to_serving_s": round(serving["t"] - t_stop, 3)}


def lost(job: Job, how: str, timeout: float) -> dict:
    ctl = job.controller()
    node, attempt, pid = ctl["node"], ctl["attempt"], int(ctl["pid"])
    t_stop = time.time()
    os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    serving = serving_after(job, attempt, timeout)
    if how == "frozen":
        # The hung process is the host's to clean up (an admin, or Slurm ending its step): left
        # stopped, its step could not end in time and slurmd drained the node ("Kill task failed").
        os.kill(pid, signal.SIGKILL)
    return {"node": node, "to": job.controller()["node"], "attempt": attempt + 1, "how": how,
            "stopped_to_serving_s": round(serving["t"] - t_stop, 3)}


def summary(xs: list[float]) -> dict:
    if not xs:
        return {"median": None, "max": None, "all": []}
    return {"median": round(statistics.median(xs), 3), "max": round(max(xs), 3), "all": xs}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster-dir", default="/var/tmp/trainmover-cluster-ctlmove",
                    help="embedded cluster state of its own (run under /tmp/tm-e2e.lock: one cluster at a time)")
    ap.add_argument("--timeout", type=float, default=120, help="longest one wait may take")
    ap.add_argument("--successors", type=int, default=1, help="TM_CONTROLLER_SUCCESSORS of the job")
    ap.add_argument("--drain-with", choices=("trainmover", "scontrol"), default="trainmover",
                    help="how the controller's node is drained: `trainmover drain` (the job is told at once) "
                         "or a plain `scontrol update` (found by the job's node poll within TM_POLL_S)")
    args = ap.parse_args()
    # Each drain trial moves a rank onto the standby and gives its node back to the partition,
    # not to the standby reservation: a standby per drain trial, or the pool runs dry.
    # A frozen controller's node may be drained by Slurm too ("Kill task failed": its step did not
    # end in time once SIGKILLed after SIGCONT-less SIGSTOP): a standby for that trial as well.
    drains = args.repeats * 3  # planned, killed_after_move, frozen
    info = cluster.up(nodes=4, standby=drains + 1, state_dir=args.cluster_dir)
    slurm = CliSlurm(slurm_conf=str(info.slurm_conf))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    # Many controller moves in one job: TM_CONTROLLER_RESTARTS bounds losses (default 3).
    env.update(SLURM_CONF=str(info.slurm_conf), TM_STEPS="1000000", TM_PYTHON=sys.executable,
               PYTHONPATH=str(ROOT), TM_CONTROLLER_RESTARTS="50", TM_CONTROLLER_SUCCESSORS=str(args.successors))
    # a submit directory of its own: job ids start again at 1 on a new cluster, and a controller
    # refuses a run directory an earlier job of that id left (its secret)
    workdir = user_workdir(f"controller-move-{time.strftime('%Y%m%d-%H%M%S')}")
    job = Job(env, workdir, slurm)
    job.successors, job.drain_with = args.successors, args.drain_with
    trials: dict[str, list] = {"planned": [], "killed": [], "frozen": [], "killed_after_move": []}
    error, trained_on = "", False
    try:
        wait(f"job {job.id} to train", lambda: job.step() >= 20, 180, 0.5)
        for _ in range(args.repeats):
            for kind in trials:
                try:
                    wait("a warm standby and a warm successor", job.ready, 180, 0.2)
                except TimeoutError as exc:
                    raise TimeoutError(f"{exc}: {job.missing()}") from None
                time.sleep(1.0)  # a few steps at the steady state
                trials[kind].append(planned(job, args.timeout) if kind == "planned" else
                                    killed_after_move(job, args.timeout) if kind == "killed_after_move" else
                                    lost(job, kind, args.timeout))
                print(kind, trials[kind][-1], flush=True)
        steps_before = job.step()
        time.sleep(3)
        trained_on = job.step() > steps_before
    except (TimeoutError, AssertionError) as exc:  # written with the trials done so far, and why it stopped
        error = f"{type(exc).__name__}: {exc}"
        print("stopped:", error, flush=True)
    finally:
        commands.run(["scancel", str(job.id)], timeout=10, env=env, check=False)
        wait(f"job {job.id} to end", lambda: slurm.job(job.id).state not in ("RUNNING", "COMPLETING"), 120, 1.0)
        for name, node in slurm.nodes().items():  # leave no node of the cluster drained
            if "DRAIN" in node.flags and node.reason == REASON:
                slurm.resume(name)
    st = read_json(job.run / "status.json")
    result = {
        "scenario": "controller-move-cpu", **machine(),
        "machine": "cpu-local (2 cores, every node on one host)",
        **results_io.provenance(__file__),
        "settings": {"template": "demo_gpt_cpu.sbatch", "training_nodes": 3, "standbys": 1, "repeats": args.repeats,
                     "TM_CONTROLLER_RESTARTS": 50, "controller_deadline_s": 2.0, "job_id": job.id,
                     "TM_CONTROLLER_SUCCESSORS": args.successors, "drain_with": args.drain_with,
                     "job_user": JOB_USER},
        "metrics": {
            "hand_over_to_serving_s": summary([t["hand_over_to_serving_s"] for t in trials["planned"]]),
            "drain_to_node_out_s": summary([t["drain_to_node_out_s"] for t in trials["planned"]]),
            "killed_to_serving_s": summary([t["stopped_to_serving_s"] for t in trials["killed"]]),
            "frozen_to_serving_s": summary([t["stopped_to_serving_s"] for t in trials["frozen"]]),
            "killed_after_move_to_serving_s": summary([t["stopped_to_serving_s"] for t in trials["killed_after_move"]]),
            "trained_on_after_the_last_move": trained_on,
            "complete": not error, "error": error,
            "controller_restarts": st.get("controller", {}).get("restarts"),
            "migrations_done": sum(m["state"] == "done" for m in st.get("migrations", [])),
        },
        "trials": trials,
    }
    results_io.write(results_io.stamped("cpu-controller-move"), result)


if __name__ == "__main__":
    main()
