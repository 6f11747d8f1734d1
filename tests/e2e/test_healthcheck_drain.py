"""The health check as slurmd runs it (HealthCheckProgram: only SLURMD_NODENAME in the
environment) against the real local cluster: a fault injected on one node of a running
demo job drains that node with a 'trainmover:' reason, and the job moves the node's rank
to a standby without being requeued (trigger 'healthcheck' in status.json)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import TEST_JOB_PREFIX, wait_for
from trainmover.slurm import commands

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "sbatch_templates" / "demo_gpt_cpu.sbatch"
STEPS = 400


@pytest.fixture
def healthcheck(slurm_cluster, tmp_path):
    """run(node) -> CompletedProcess of slurm_plugin/healthcheck.sh run like slurmd runs it;
    the site settings in healthcheck.env next to the script (as an admin installs it)."""
    bindir = tmp_path / "slurm_plugin"
    bindir.mkdir()
    shutil.copy(ROOT / "slurm_plugin" / "healthcheck.sh", bindir)
    state = tmp_path / "hc-state"
    state.mkdir()
    (bindir / "healthcheck.env").write_text(
        f"SLURM_CONF={slurm_cluster.slurm_conf}\nTRAINMOVER_PYTHON={sys.executable}\n"
        f"TRAINMOVER_HEALTHCHECK_ARGS='--state-dir {state}'\n")

    def run(node: str) -> subprocess.CompletedProcess:
        return subprocess.run(["/usr/bin/env", "-i", f"SLURMD_NODENAME={node}", str(bindir / "healthcheck.sh")],
                              capture_output=True, text=True, timeout=15, cwd="/")
    run.state = state
    return run


def test_healthy_node_is_left_alone(healthcheck, slurm_client):
    t0 = time.monotonic()
    proc = healthcheck("train4")
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "train4: healthy" in proc.stdout and "gpu: skipped" in proc.stdout
    assert took < 10
    assert "DRAIN" not in slurm_client.nodes(["train4"])["train4"].flags


def test_slurmd_runs_the_installed_check_itself_and_drains_a_faulty_node(slurm_cluster, slurm_client):
    """The embedded cluster's slurm.conf has the admin guide's lines (HealthCheckProgram with
    healthcheck.env beside the script): slurmd runs the check on its own, cycling over the
    nodes every HealthCheckInterval, and drains the node whose check fails."""
    from trainmover.cluster.spec import HEALTHCHECK_INTERVAL_S
    node = slurm_cluster.train_nodes[-1]
    hook = slurm_cluster.healthcheck_state / f"inject-fault-{node}"
    hook.write_text("XID 48 (injected for slurmd's own run)\n")
    t0 = time.monotonic()
    try:
        wait_for(f"slurmd's health check to drain {node}",
                 lambda: slurm_client.nodes([node])[node].reason.startswith("trainmover: healthcheck inject: XID 48"),
                 timeout=2 * HEALTHCHECK_INTERVAL_S + 30, interval=1.0)
        assert "DRAIN" in slurm_client.nodes([node])[node].flags
        print(f"\nslurmd drained {node} {time.monotonic() - t0:.1f}s after the fault appeared "
              f"(HealthCheckInterval={HEALTHCHECK_INTERVAL_S})")
    finally:
        hook.unlink(missing_ok=True)
        info = slurm_client.nodes([node])[node]
        if "DRAIN" in info.flags and info.reason.startswith("trainmover:"):
            slurm_client.resume(node)


def test_injected_fault_drains_the_node_and_the_job_migrates(healthcheck, slurm_cluster, slurm_client, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    env.update(SLURM_CONF=str(slurm_cluster.slurm_conf), TM_PYTHON=sys.executable, PYTHONPATH=str(ROOT),
               TM_STEPS=str(STEPS))
    workdir = tmp_path / "work"
    workdir.mkdir()
    out = commands.run(["sbatch", "--parsable", f"--job-name={TEST_JOB_PREFIX}healthcheck", f"--chdir={workdir}",
                        str(TEMPLATE)], timeout=15, env=env).stdout
    job_id = int(out.strip().split(";")[0])
    run_dir = workdir / "runs" / str(job_id)
    leaver = None

    def metrics() -> list[dict]:
        try:
            return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        except FileNotFoundError:
            return []

    def status() -> dict:
        try:
            return json.loads((run_dir / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    try:
        wait_for("training to reach step 40", lambda: (metrics() or [{"step": 0}])[-1]["step"] >= 40, timeout=90)
        wait_for("a warm standby", lambda: any(s.get("warmup_s") is not None for s in status().get("standbys", [])),
                 timeout=60)
        leaver = metrics()[-1]["nodes"][1]  # rank 1: never the batch host
        (healthcheck.state / f"inject-fault-{leaver}").write_text("XID 79 (injected by the e2e test)\n")
        t0 = time.monotonic()
        proc = healthcheck(leaver)
        assert time.monotonic() - t0 < 10
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"{leaver}: drained: trainmover: healthcheck inject: XID 79" in proc.stdout, proc.stdout
        node = slurm_client.nodes([leaver])[leaver]
        assert "DRAIN" in node.flags and node.reason.startswith("trainmover: healthcheck inject: XID 79")
        again = healthcheck(leaver)  # a second run (slurmd repeats it) changes nothing
        assert again.returncode == 1 and "already drained by TrainMover" in again.stdout
        wait_for("rank 1 to leave the faulty node", lambda: metrics()[-1]["nodes"][1] != leaver, timeout=30,
                 interval=0.2)
        wait_for("the job to end", lambda: slurm_client.job(job_id).state not in
                 ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING"), timeout=150, interval=1.0)
        job = slurm_client.job(job_id)
        assert job.state == "COMPLETED" and job.restart_count == 0
        (m,) = status()["migrations"]
        assert (m["leaver"], m["trigger"], m["state"]) == (leaver, "healthcheck", "done")
        assert m["joiner"].startswith("spare")
        assert json.loads((run_dir / "final.json").read_text())["steps"] == STEPS
        assert slurm_client.nodes([leaver])[leaver].drained
    finally:
        commands.run(["scancel", str(job_id)], timeout=10, env=env, check=False)
        if leaver is not None:
            wait_for("the job to end", lambda: slurm_client.job(job_id).state not in ("RUNNING", "COMPLETING"),
                     timeout=30)
            info = slurm_client.nodes([leaver])[leaver]
            if "DRAIN" in info.flags and info.reason.startswith("trainmover:"):
                slurm_client.resume(leaver)
