"""Silent failures end to end on the real local Slurm cluster: a process or a node that stops
without closing anything is found by its silence (or by the others waiting on it), fenced and
replaced by the warm standby, with default settings.

Each recovered run is compared bit for bit (per-step losses, final parameter+optimizer digest)
with an uninterrupted run of the same template; the bound on fault -> first completed step is
the issue's (10 s with default settings).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import wait_for
from tests.e2e.test_failures import may_miss, recoveries
from tests.e2e.test_migration import (  # noqa: F401 - fixtures shared with the planned-migration tests
    assert_same_training, demo, leaver_of, reference, resume_drained_nodes, start_training)
from trainmover.cluster import netfault
from trainmover.cluster.procs import step_pid

pytestmark = pytest.mark.slurm

BOUND_S = 10.0


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def warm(run):
    wait_for("a warm standby", lambda: any(s["state"] == "ready" for s in run.status()["standbys"]), timeout=60)


def recovered(run, slurm_client, node: str, fault_at: float) -> dict:
    """The run recovered from the loss of `node` and completed: the recovery, checked."""
    wait_for("the recovery to finish", lambda: any(m["state"] == "done" for m in recoveries(run)), timeout=90,
             interval=0.5)
    assert run.wait_done(slurm_client) == "COMPLETED", run.slurm_out()[-3000:]
    (m,) = recoveries(run)
    assert m["leaver"] == node and m["trigger"] == "failure" and m["state_source"]["tier"] == "replica"
    job = slurm_client.job(run.job_id)
    # JOB_USER may not drain: the fenced node stays in the job (docs/recovery.md) unless Slurm
    # itself took it out (a node lost whole goes DOWN); a drained one leaves it
    held = held_fenced(run, node)
    gone = node not in job.nodes or slurm_client.nodes([node])[node].base_state == "DOWN"
    assert job.restart_count == 0 and (gone or held), (job.nodes, run.status()["fenced_nodes"])
    first_after = min(x["t"] for x in run.metrics() if x["step"] == m["switch_step"] + 1)
    m["fault_to_step_s"] = first_after - fault_at
    return m


def assert_exact(run, reference, m):
    assert_same_training(run, reference, *may_miss(m))


def warm_job(demo, slurm_client, name: str):
    """A demo job past step 60 with its standby warm: (run, the node of rank 1, its worker's pid)."""
    # paced (a sleep per step, the same bits): on an idle CI machine the unpaced job ran its 300
    # steps before a partition was even detected (2026-11-28)
    run = demo(name, TM_INJECT="pace:0.1")
    start_training(run, slurm_client, min_step=60)
    warm(run)
    node = leaver_of(run)
    return run, node, step_pid(run.job_id, node)


def fenced(run) -> list[dict]:
    return run.status()["liveness"]["fenced"]


def held_fenced(run, node: str) -> bool:
    """Whether status says `node` was fenced and is held in the job, its drain refused."""
    f = next((x for x in run.status()["fenced_nodes"] if x["node"] == node), None)
    return f is not None and f["state"] == "held" and f["held"].startswith("drain refused")


def resume(slurm_client, node: str) -> None:
    """Put a node fenced by TrainMover back into service if it was drained ('trainmover: ...',
    by the job or, for a node the job held, by the Epilog at the job's end: waited for)."""
    try:
        wait_for(f"{node} to finish its last job", lambda: not slurm_client.nodes([node])[node].busy, timeout=30)
    except AssertionError:
        pass  # still the job's (a test that failed early): the session's clean-up resumes it
    info = slurm_client.nodes([node])[node]
    if "DRAIN" in info.flags or info.base_state == "DOWN":
        slurm_client.resume(node)


def test_a_frozen_worker_is_fenced_replaced_and_its_resumption_changes_nothing(demo, reference, slurm_client):
    """kill -STOP of a worker: its sockets stay open and its slurmd answers. Its heartbeat stops:
    it is judged dead within TM_HEARTBEAT_TIMEOUT_S, its step killed (SIGKILL reaches a stopped
    process), its rank rebuilt on the standby. Resumed with SIGCONT after its replacement, it
    changes nothing: it is gone, or it exits without a word counted.

    The job is JOB_USER's, who may not drain: the fenced node is held in the job, out of
    training, never back in service while the job runs (Slurm shows it allocated, not idle)."""
    run, node, pid = warm_job(demo, slurm_client, "freeze")
    try:
        assert run.status()["capabilities"]["drain"] is False  # said at start, with why
        assert "drain: no" in run.slurm_out() and "held in the job" in run.slurm_out()
        frozen_at = time.time()
        os.kill(pid, signal.SIGSTOP)
        wait_for("the recovery to start", lambda: recoveries(run), timeout=30, interval=0.2)
        if alive(pid):  # resumed once its replacement is decided (its step may not be killed yet)
            os.kill(pid, signal.SIGCONT)
        wait_for("the recovery to finish", lambda: any(m["state"] == "done" for m in recoveries(run)), timeout=90,
                 interval=0.5)
        # while the job runs: held, not drained, still the job's (allocated), in no other job
        wait_for(f"{node} held", lambda: held_fenced(run, node), timeout=15, explain=run.explain)
        info = slurm_client.nodes([node])[node]
        assert not info.drained and "DRAIN" not in info.flags, info
        assert info.base_state in ("ALLOCATED", "MIXED"), info
        assert node in slurm_client.job(run.job_id).nodes
        assert "stays in the job" in run.slurm_out() or "held in the job" in run.slurm_out()
        others = [n for n in slurm_client.job(run.job_id).nodes if n != node]
        m = recovered(run, slurm_client, node, frozen_at)
        # at the job's end slurmd's Epilog (slurm_plugin/epilog.sh, installed as docs/admin.md
        # says) drains the node the job held, naming the job and its user; control: the job's
        # other nodes go back into service
        why = f"trainmover: healthcheck fenced: job {run.job_id} (uid "
        wait_for(f"the Epilog to drain {node}", lambda: slurm_client.nodes([node])[node].reason.startswith(why),
                 timeout=30, explain=lambda: str(slurm_client.nodes([node])[node]))
        assert "DRAIN" in slurm_client.nodes([node])[node].flags
        assert not any("DRAIN" in i.flags for i in slurm_client.nodes(others).values()), others
        wait_for("the frozen process to be gone", lambda: not alive(pid), timeout=30)
        assert_exact(run, reference, m)
        (f,) = fenced(run)
        assert f["node"] == node and f["ranks"] == [1] and "no heartbeat" in f["why"], f
        assert not any(x["nodes"][1] == node for x in run.metrics() if x["step"] > m["switch_step"])
        print(f"\nfrozen rank 1 on {node}: fault to first completed step {m['fault_to_step_s']:.2f}s")
        assert m["fault_to_step_s"] <= BOUND_S
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        resume(slurm_client, node)


def test_a_partitioned_node_is_cut_out_and_replaced(demo, reference, slurm_client, slurm_cluster):
    """Every packet from and to a worker's node dropped (its processes run on, nothing closes):
    its silence names it; it is fenced (its connection refused for good) and replaced. After the
    partition heals, the cut-off process is refused and exits without a word counted."""
    run, node, pid = warm_job(demo, slurm_client, "partition")
    try:
        with netfault.partition(slurm_cluster, node):
            cut_at = time.time()
            m = recovered(run, slurm_client, node, cut_at)
        assert_exact(run, reference, m)
        (f,) = fenced(run)
        assert f["node"] == node and "no heartbeat" in f["why"], f
        # healed: the cut-off process finds its controller gone, or is refused as fenced; it exits
        wait_for("the cut-off process to end", lambda: not alive(pid), timeout=90, interval=1.0)
        assert run.final()["digest"] == reference.final()["digest"]
        print(f"\npartitioned {node}: fault to first completed step {m['fault_to_step_s']:.2f}s")
        assert m["fault_to_step_s"] <= BOUND_S
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        wait_for(f"{node} to answer again", lambda: not slurm_client.nodes([node])[node].unresponsive, timeout=120,
                 interval=1.0)
        resume(slurm_client, node)


def test_a_hung_training_thread_is_found_by_who_waits_on_whom(demo, reference, slurm_client):
    """TM_INJECT=hang:1:200: rank 1's training thread blocks for good, 200 steps complete, while
    its process, heartbeat included, lives on (a hung kernel). The others wait on it: it is
    judged stuck, killed and replaced."""
    run = demo("hang", TM_INJECT="hang:1:200")
    start_training(run, slurm_client, min_step=60)
    node = leaver_of(run)
    try:
        wait_for("the recovery to start", lambda: recoveries(run), timeout=60, interval=0.2)
        m = recovered(run, slurm_client, node, time.time())
        assert_exact(run, reference, m)
        (f,) = fenced(run)
        assert f["ranks"] == [1] and "stuck" in f["why"] and "group" in f["why"], f
        assert m["switch_step"] == 200
        hung_at = max(x["t"] for x in run.metrics() if x["step"] == 200)  # rank 1 hangs right after it
        first_after = min(x["t"] for x in run.metrics() if x["step"] == 201)
        print(f"\nhung rank 1: last step before {hung_at:.2f}, first after {first_after - hung_at:.2f}s later")
        assert first_after - hung_at <= BOUND_S
    finally:
        resume(slurm_client, node)


def test_a_rank_three_times_slower_is_not_declared_dead(demo, reference, slurm_client):
    """TM_INJECT=slow:1:2.0: rank 1 computes 3x as long every step. Alive and progressing: never
    fenced, never recovered (the straggler policy reports it); the run equals the reference."""
    run = demo("slow3x", TM_INJECT="slow:1:2.0", TM_STRAGGLER="report")
    assert run.wait_done(slurm_client, timeout=300) == "COMPLETED", run.slurm_out()[-3000:]
    status = run.status()
    assert status["liveness"]["fenced"] == [] and not recoveries(run), status["migrations"]
    assert_same_training(run, reference)


def test_a_node_lost_whole_slurmd_and_all_is_recovered(demo, reference, slurm_client, slurm_cluster):
    """A worker's node dies whole: its slurmd and every process on it SIGKILLed at once."""
    from trainmover import cluster
    run = demo("node-lost")
    start_training(run, slurm_client, min_step=60)
    warm(run)
    node = leaver_of(run)
    try:
        lost_at = time.time()
        netfault.kill_node(slurm_cluster, node)
        m = recovered(run, slurm_client, node, lost_at)
        assert_exact(run, reference, m)
        print(f"\nnode {node} lost: fault to first completed step {m['fault_to_step_s']:.2f}s")
        assert m["fault_to_step_s"] <= BOUND_S
    finally:
        cluster.up(nodes=4, standby=2, state_dir=slurm_cluster.state_dir)  # starts its slurmd again
        wait_for(f"{node} to answer again", lambda: not slurm_client.nodes([node])[node].unresponsive, timeout=120,
                 interval=1.0)
        resume(slurm_client, node)
