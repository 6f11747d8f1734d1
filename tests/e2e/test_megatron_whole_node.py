"""Whole-node migration: two ranks per node, tensor parallelism inside the node.

sbatch_templates/megatron_gpt.sbatch on 2 nodes with TM_RANKS_PER_NODE=2 and TP2 x PP2:
each node holds one pipeline stage's TP pair (Megatron's rank order puts TP innermost), as
a GPU node holds its TP group. Draining the second node (the first runs the batch script,
which a job cannot release) moves both of its ranks at once to the 2-process standby node,
each into its slot: one migration, one switch. Per-step losses of every rank and the final
parameter + optimizer digests must equal an uninterrupted run's; a copy without the
optimizer state must differ on both moved ranks.

The reference, the moved run and the negative control run side by side (6 + 2 node cluster
of this module's own, state in $TM_E2E_WHOLE_NODE_CLUSTER_DIR or
/var/tmp/trainmover-cluster-wholenode): 2.5 min on 2 shared cores under load, 3.5 min
with the cluster start.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import TEST_JOB_PREFIX, job_ended, own_cluster, resume_drained, wait_for
from tests.e2e.test_megatron_slurm import _assert_same_training, _standby_ready
from tests.e2e.test_migration import Run
from trainmover.controller.succession.keeper import sbatch_args
from trainmover.slurm import commands

pytestmark = pytest.mark.slurm
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "sbatch_templates" / "megatron_gpt.sbatch"
STATE_DIR = os.environ.get("TM_E2E_WHOLE_NODE_CLUSTER_DIR", "/var/tmp/trainmover-cluster-wholenode")
STEPS = 150
# Each drain reaches its job within TM_POLL_S: 1 s here, not the default 10 s, for margin, not
# time: the second drain comes last, once its standby node is warm, and with 120 steps it
# landed at step 96 on 2 cores loaded by other work (the jobs' first step 61 s after their start).
POLL_S = 1
DRAIN_REASON = "tm-e2e whole node"
LAYOUT = {"TM_TP": 2, "TM_PP": 2, "TM_DP": 1, "TM_RANKS_PER_NODE": 2}
MOVED = [2, 3]  # the second node: pipeline stage 1, its TP pair


@pytest.fixture(scope="module")
def cluster():
    yield from own_cluster(6, 2, STATE_DIR, DRAIN_REASON, keepers=3)  # three jobs side by side


def _drain_when_warm(run: Run) -> str:
    """Drain the node of ranks MOVED once a standby node is warm; returns that node."""
    wait_for(f"job {run.job_id}: training and a warm standby node", lambda: run.last_step() >= 5 and _standby_ready(run),
             timeout=150, interval=0.5)
    nodes = run.metrics()[-1]["nodes"]
    leaver = nodes[MOVED[0]]
    assert [nodes[r] for r in MOVED] == [leaver] * len(MOVED) and nodes[0] != leaver, nodes
    commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={DRAIN_REASON}"],
                 timeout=10, env=run.env)
    return leaver


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """Three jobs at once: the uninterrupted reference, a whole-node move and the negative
    control (the move without the optimizer state). Both moves are drained as soon as their
    standby node is warm; returns the Runs once all three have ended."""
    info, client = cluster
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    env.update(SLURM_CONF=str(info.slurm_conf), TM_PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    # After the move the controller wants a standby back and none is free: one attempt, then
    # it waits (TM_STANDBY_RETRY_S), so no standby request is in flight when the job ends.
    kinds = {"reference": {"TM_STANDBYS": 0},
             "moved": {"TM_STANDBYS": 1, "TM_STANDBY_RETRY_S": 3600},
             "negative": {"TM_STANDBYS": 1, "TM_STANDBY_RETRY_S": 3600, "TM_INJECT": "skip-optimizer-state"}}
    out: dict[str, Run] = {}
    for name, extra in kinds.items():
        workdir = tmp_path_factory.mktemp(f"wn-{name}")
        job_env = {**env, "TM_STEPS": str(STEPS), "TM_POLL_S": str(POLL_S),
                   **{k: str(v) for k, v in {**LAYOUT, **extra}.items()}}
        sub = commands.run(["sbatch", "--parsable", *sbatch_args(2), f"--job-name={TEST_JOB_PREFIX}wn-{name}",
                            f"--chdir={workdir}", str(TEMPLATE)], timeout=15, env=job_env).stdout
        out[name] = Run(int(sub.strip().split(";")[0]), workdir, job_env)
    try:
        # All three at once: a job left pending would start later and find the other's
        # spare free after its move, and a job that takes a second standby is the one Slurm
        # has been seen to requeue (docs/megatron.md, Limits).
        wait_for("the three jobs to run side by side (6 free training nodes)",
                 lambda: all(client.job(r.job_id).running for r in out.values()), timeout=60, interval=1.0)
        out["moved"].leaver = _drain_when_warm(out["moved"])
        out["negative"].leaver = _drain_when_warm(out["negative"])
        for run in out.values():
            state = run.wait_done(client, timeout=240)
            assert state == "COMPLETED", f"job {run.job_id} ended {state}:\n{run.slurm_out()[-3000:]}"
            assert run.final()["steps"] == STEPS
        yield out
    finally:
        commands.run(["scancel", *[str(r.job_id) for r in out.values()]], timeout=10, env=env, check=False)
        wait_for("this module's jobs to end", lambda: all(job_ended(client, r.job_id) for r in out.values()),
                 timeout=60, interval=1.0)
        resume_drained(client, DRAIN_REASON)


def test_whole_node_with_tp2_inside_moves_both_ranks_bit_exactly(runs):
    run = runs["moved"]
    (m,) = run.status()["migrations"]
    assert m["state"] == "done" and m["trigger"] == "drain", m
    assert m["leaver"] == run.leaver and m["leaver_ranks"] == MOVED
    joiner = m["joiner"]
    assert joiner.startswith("spare"), joiner
    # one switch for the whole node: both ranks joined at the same step, each into its slot
    assert sorted(m["transfers"]) == [str(r) for r in MOVED]
    assert all(t["bytes"] > 0 for t in m["transfers"].values())
    rows = {x["step"]: x["nodes"] for x in run.metrics()}
    s = m["switch_step"]
    assert [rows[s][r] for r in MOVED] == [run.leaver] * 2 and [rows[s + 1][r] for r in MOVED] == [joiner] * 2
    assert rows[STEPS][:2] == rows[1][:2], "the stayers never moved"
    assert m["downtime_s"] is not None
    lines = [json.loads(x) for x in (run.dir / "timeline.jsonl").read_text().splitlines()]
    assert sorted(x["rank"] for x in lines if x["event"] == "joined") == MOVED
    _assert_same_training(run, runs["reference"], STEPS)


def test_without_optimizer_state_both_moved_ranks_diverge(runs):
    run = runs["negative"]
    (m,) = run.status()["migrations"]
    assert m["state"] == "done" and m["leaver_ranks"] == MOVED, m
    ref, got = runs["reference"].final()["rank_digests"], run.final()["rank_digests"]
    assert all(got[r] != ref[r] for r in MOVED)
    ref_losses = {x["step"]: x["losses"] for x in runs["reference"].metrics()}
    got_losses = {x["step"]: x["losses"] for x in run.metrics()}
    assert all(got_losses[s] == ref_losses[s] for s in range(1, m["switch_step"] + 1)), "identical before the switch"
    assert any(got_losses[s] != ref_losses[s] for s in range(m["switch_step"] + 1, STEPS + 1))
