"""No special node, end to end on the real local Slurm cluster: the demo template's batch script
runs on a keeper node (controller/succession/keeper.py), the controller on a training node; every training
node, the controller's included, can leave the job like any other.

Each run is compared bit for bit (per-step losses, final digest) with an uninterrupted run of the
same template.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.e2e.conftest import TEST_JOB_PREFIX, job_ended, wait_for
from tests.e2e.test_failures import recoveries
from tests.e2e.test_migration import (  # noqa: F401 - fixtures shared with the planned-migration tests
    DRAIN_REASON, assert_same_training, demo, reference, resume_drained_nodes, start_training)
from trainmover.cluster import netfault
from trainmover.cluster.procs import ClusterError, step_pid
from trainmover.slurm import commands

pytestmark = pytest.mark.slurm


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def controller_node(run) -> str:
    return json.loads((run.dir / "controller.json").read_text())["node"]


def warm(run):
    wait_for("a warm standby", lambda: any(s["state"] == "ready" for s in run.status()["standbys"]), timeout=90)


def test_the_batch_script_runs_on_the_keeper_and_the_controller_on_a_training_node(demo, slurm_client):
    run = demo("layout")
    start_training(run, slurm_client, min_step=20)
    job = slurm_client.job(run.job_id)
    keeper = job.batch_host
    assert "tm_keeper" in slurm_client.nodes([keeper])[keeper].features
    ranks_on = set(run.metrics()[-1]["nodes"])
    assert keeper not in ranks_on and controller_node(run) in ranks_on
    assert run.wait_done(slurm_client) == "COMPLETED", run.slurm_out()[-3000:]


def test_the_controllers_node_drained_leaves_the_job_like_any_other(demo, reference, slurm_client):
    """Drain the node that runs the controller (and rank 0): its rank moves to the standby, the
    controller hands over to its warm successor on another node, and the node leaves the job and
    ends `drained` within 30 s. Right after the move the new controller is SIGKILLed: the next
    warm successor takes over and the job still ends bit-exact."""
    run = demo("drain-controller")
    start_training(run, slurm_client, min_step=60)
    warm(run)
    node = controller_node(run)
    assert node in run.metrics()[-1]["nodes"]
    commands.run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={DRAIN_REASON}"],
                 timeout=10, env=run.env)
    drained_at = time.monotonic()
    wait_for(f"{node} to leave the job", lambda: node not in slurm_client.job(run.job_id).nodes, timeout=30,
             interval=0.5)
    left_after = time.monotonic() - drained_at
    info = slurm_client.nodes([node])[node]
    assert "DRAIN" in info.flags and not info.busy, info.state  # drained: idle, no job left on it
    moved = json.loads((run.dir / "controller.json").read_text())
    assert moved["node"] != node and moved["attempt"] == 1
    # A failure right after the move: the new controller dies (every node is on this host).
    os.kill(int(moved["pid"]), signal.SIGKILL)
    wait_for("the next successor to take over", lambda: json.loads(
        (run.dir / "controller.json").read_text())["attempt"] == 2, timeout=60, interval=0.2)
    assert controller_node(run) not in (node, moved["node"])
    assert run.wait_done(slurm_client) == "COMPLETED", run.slurm_out()[-3000:]
    job = slurm_client.job(run.job_id)
    assert job.restart_count == 0 and node not in job.nodes
    (m,) = run.status()["migrations"]
    assert m["leaver"] == node and m["state"] == "done"
    assert run.status()["controller"]["restarts"] == 2  # the hand-over, then the loss
    assert_same_training(run, reference)
    print(f"\n{node} (controller and rank 0) drained: out of the job after {left_after:.1f}s, "
          f"downtime {m['downtime_s']}s; the new controller killed right after, replaced")


def test_the_controllers_node_lost_whole_the_controller_comes_back_elsewhere(demo, reference, slurm_client,
                                                                             slurm_cluster):
    """The controller's node dies whole (its slurmd and every process on it, rank 0 included):
    training goes on; the keeper resumes the controller on another node from its journal, which
    recovers the lost rank on the standby; the job completes bit-exactly."""
    from trainmover import cluster
    run = demo("kill-controller")
    start_training(run, slurm_client, min_step=60)
    warm(run)
    node = controller_node(run)
    try:
        netfault.kill_node(slurm_cluster, node)
        wait_for("a controller on another node", lambda: controller_node(run) != node, timeout=120, interval=0.5)
        wait_for("the recovery to finish", lambda: any(m["state"] == "done" for m in recoveries(run)), timeout=120,
                 interval=1.0)
        assert run.wait_done(slurm_client, timeout=300) == "COMPLETED", run.slurm_out()[-3000:]
        (m,) = recoveries(run)
        assert m["leaver"] == node and m["state_source"]["tier"] == "replica"
        assert run.status()["controller"]["restarts"] >= 1
        job = slurm_client.job(run.job_id)
        assert job.restart_count == 0 and node not in job.nodes
        # Step S's loss is missing for rank 0 (it died with its node) and for a rank that was still
        # inside step S when the node died (a lagger: it received step S's state from a replica
        # instead of computing it), never elsewhere; every other loss and the digest are equal.
        (recover,) = [e for e in jsonl(run.dir / "timeline.jsonl") if e["event"] == "recover"]
        s = m["switch_step"]
        ref = {x["step"]: x["losses"] for x in reference.metrics()}
        got = {x["step"]: x["losses"] for x in run.metrics()}
        assert sorted(got) == sorted(ref), "every step logged exactly once"
        missing = {(r, step) for step, losses in got.items() for r, x in enumerate(losses) if x is None}
        assert missing <= {(r, s) for r in [0, *recover["laggers"]]}, sorted(missing)[:5]
        for r, step in missing:
            got[step][r] = ref[step][r]
        assert got == ref, [step for step in ref if ref[step] != got[step]][:5]
        assert run.final()["digest"] == reference.final()["digest"]
    finally:
        cluster.up(nodes=4, standby=2, state_dir=slurm_cluster.state_dir)  # starts its slurmd again
        wait_for(f"{node} to answer again", lambda: not slurm_client.nodes([node])[node].unresponsive, timeout=120,
                 interval=1.0)
        info = slurm_client.nodes([node])[node]
        if "DRAIN" in info.flags or info.base_state == "DOWN":
            slurm_client.resume(node)


def test_scancel_of_the_job_stops_every_part(demo, slurm_client, slurm_env):
    """`scancel <job>` stops the keeper, the controller, every worker and standby and any donor
    allocation: nothing of the job is left in squeue nor running on a node."""
    run = demo("scancel", TM_STEPS=100000)
    start_training(run, slurm_client, min_step=40)
    warm(run)
    nodes = slurm_client.job(run.job_id).nodes
    commands.run(["scancel", str(run.job_id)], timeout=10, env=slurm_env)
    wait_for("the job to end", lambda: job_ended(slurm_client, run.job_id), timeout=60, interval=0.5)

    def left() -> list[str]:
        out = commands.run(["squeue", "-h", "-o", "%i|%j"], timeout=10, env=slurm_env).stdout.splitlines()
        return [line for line in out if line.split("|")[0] == str(run.job_id)
                or line.endswith(f"trainmover-donor-{run.job_id}")]

    def processes() -> list[str]:
        found = []
        for node in nodes:
            try:
                found.append(f"{node}:{step_pid(run.job_id, node)}")
            except ClusterError:
                pass
        return found
    wait_for("nothing of the job left", lambda: not left() and not processes(), timeout=60, interval=1.0)
    assert not any(line.split("|")[1].startswith(TEST_JOB_PREFIX + "scancel") for line in left())
