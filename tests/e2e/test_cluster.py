"""The embedded cluster and the Slurm client against real slurmctld/slurmd.

Run: .venv/bin/python -m pytest tests/e2e/test_cluster.py -q   (root; ~25 s on 2 cores once the
packages are installed). The tests' own cluster is left running at the end (see conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import E2E_SLURM
from trainmover import cluster
from trainmover.errors import SlurmError
from trainmover.slurm import BatchHostRelease, NoStandbyAvailable, commands

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]

RESV = "trainmover_standby"
REPO = Path(__file__).resolve().parents[2]
SLEEP = "#!/bin/bash\nsleep 600\n"
DRAIN_PREFIX = "tm-e2e"  # conftest resumes nodes drained with this reason prefix


def wait_for(what, check, timeout=30.0, interval=0.2):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def test_up_is_idempotent(slurm_cluster):
    t = time.monotonic()
    again = cluster.up(nodes=4, standby=2, state_dir=slurm_cluster.state_dir)
    assert again.already_running and time.monotonic() - t < 5
    st = cluster.status(slurm_cluster.state_dir)
    assert st["running"] and st["reservation"] == RESV
    assert all(d["up"] for d in st["daemons"].values())
    assert set(st["nodes"]) == {"train1", "train2", "train3", "train4", "spare1", "spare2", "keep1", "keep2"}


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its parent (this process, which started it) has not reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_node_state_reader_runs_as_a_site_runs_it_and_goes_with_no_node_reader(slurm_cluster):
    """cluster up starts the per-cluster node-state reader (root, every second: its table
    fresh); up --no-node-reader stops it and the table goes stale; up again starts it."""
    from trainmover.slurm import node_states
    table = Path(slurm_cluster.slurm_conf).parent / "trainmover-drains" / node_states.FILE

    def fresh(within: float) -> bool:
        return table.exists() and time.time() - json.loads(table.read_text())["at"] < within

    pid = cluster.status(slurm_cluster.state_dir)["node_reader"]["pid"]
    assert pid and fresh(3.0) and table.stat().st_uid == 0 and not table.stat().st_mode & 0o022
    assert set(json.loads(table.read_text())["nodes"]) >= {"train1", "spare1", "keep1"}
    try:
        cluster.up(nodes=4, standby=2, state_dir=slurm_cluster.state_dir, node_reader=False)
        assert cluster.status(slurm_cluster.state_dir)["node_reader"] == {"wanted": False, "pid": None}
        assert _gone(pid)
        time.sleep(2.5)
        assert not fresh(2.0)  # nobody writes it now: the jobs poll for themselves
    finally:
        cluster.up(nodes=4, standby=2, state_dir=slurm_cluster.state_dir)
    assert cluster.status(slurm_cluster.state_dir)["node_reader"]["pid"] not in (None, pid) and fresh(3.0)


def test_env_lines_work_in_a_shell(slurm_cluster):
    script = ('eval "$("$PY" -m trainmover.cluster env --dir "$DIR")"; '
              'sinfo -h -N -o "%N %P"; scontrol show hostnames "train[1-2]"')
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable, "DIR": str(slurm_cluster.state_dir),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "spare1 train" in proc.stdout and "train4 train" in proc.stdout and "train2" in proc.stdout


def test_ordinary_jobs_never_land_on_spares(slurm_client, slurm_env, submit):
    """Spares are reserved; keeper nodes are weighted last (an ordinary job takes one only when
    every training node is busy)."""
    jobs = [submit("#!/bin/bash\nhostname\nsleep 600\n", nodes=1, name=f"plain{i}", wait_running=False)
            for i in range(7)]
    ids = [j.job_id for j in jobs]
    wait_for("6 jobs to run", lambda: sum(slurm_client.job(j).running for j in ids) == 6, timeout=30)
    time.sleep(1.0)  # give the scheduler a pass in which it could (wrongly) use a spare
    states = {j: slurm_client.job(j) for j in ids}
    used = sorted(n for j in states.values() for n in j.nodes)
    assert used == ["keep1", "keep2", "train1", "train2", "train3", "train4"]
    first4 = sorted(n for j in ids[:4] for n in states[j].nodes)
    assert first4 == ["train1", "train2", "train3", "train4"]  # training nodes first
    pending = [j for j in states.values() if j.state == "PENDING"]
    assert len(pending) == 1 and pending[0].reason in ("Resources", "Priority")
    assert all(n.idle for n in slurm_client.nodes(["spare1", "spare2"]).values())
    # a job that asks for more nodes than the pool outside the reservation can never start
    big = submit(SLEEP, nodes=7, name="toobig", wait_running=False)
    time.sleep(1.0)
    assert slurm_client.job(big.job_id).state == "PENDING"


def test_grow_step_drain_shrink(slurm_client, submit, tmp_path):
    job = submit(SLEEP, nodes=2, name="grow")
    # never a spare (they are reserved); a keeper node only while the previous test's jobs still
    # complete on the training nodes (keepers are weighted last, not excluded)
    assert len(job.nodes) == 2 and not any(n.startswith("spare") for n in job.nodes), job.nodes
    t = time.monotonic()
    spare = slurm_client.grow(job.job_id, reservation=RESV, timeout=10)
    grow_s = time.monotonic() - t
    assert spare in ("spare1", "spare2")
    grown = slurm_client.job(job.job_id)
    assert spare in grown.nodes and grown.num_nodes == 3 and grown.running and grown.restart_count == 0

    # a step on the node added after the batch script started
    argv = slurm_client.step_argv(job.job_id, spare, ["bash", "-c", 'echo "$(hostname) $TM_X"'],
                                  env_overrides={"TM_X": "a,b"})
    out = subprocess.run(argv, env=slurm_client.step_env(grown), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [spare, "a,b"]

    # drain the non-batch training node, then release it: it ends drained
    victim = next(n for n in job.nodes if n != job.batch_host)
    slurm_client.drain(victim, f"{DRAIN_PREFIX} planned move")
    node = slurm_client.nodes([victim])[victim]
    assert node.draining and node.reason == f"{DRAIN_PREFIX} planned move"
    assert slurm_client.job(job.job_id).running
    t = time.monotonic()
    released = slurm_client.shrink(job.job_id, keep=[job.batch_host, spare])
    shrink_s = time.monotonic() - t
    assert released == [victim]
    after = slurm_client.job(job.job_id)
    assert set(after.nodes) == {job.batch_host, spare} and after.running and after.restart_count == 0
    wait_for(f"{victim} to be drained", lambda: slurm_client.nodes([victim])[victim].drained, timeout=15)
    slurm_client.resume(victim)
    wait_for(f"{victim} back in service", lambda: slurm_client.nodes([victim])[victim].idle, timeout=15)
    print(f"\ngrow {grow_s:.2f}s, shrink {shrink_s:.2f}s")


def test_step_from_inside_the_batch_script_after_grow(slurm_client, submit, tmp_path):
    """The batch script's environment still describes the job before it grew; a step
    launched from inside it with step_argv + step_env runs on the new node."""
    script = f"""#!{sys.executable}
import os, subprocess, sys, time
sys.path.insert(0, {str(REPO)!r})
from trainmover.slurm import CliSlurm
go = {str(tmp_path / "go")!r}
while not os.path.exists(go):
    time.sleep(0.1)
node = open(go).read().strip()
c = CliSlurm()
job = c.job(int(os.environ["SLURM_JOB_ID"]))
stale = os.environ["SLURM_JOB_NODELIST"]
env = c.step_env(job, dict(os.environ))
argv = c.step_argv(job.job_id, node, ["bash", "-c", 'echo $(hostname) $SLURM_JOB_NUM_NODES'])
out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=20)
released = ",".join(c.shrink(job.job_id, [n for n in job.nodes if n != node]))  # from inside the job
open({str(tmp_path / "inside.tmp")!r}, "w").write(
    f"{{stale}}|{{released}}|{{out.returncode}}|{{out.stdout.strip()}}|{{out.stderr}}")
os.rename({str(tmp_path / "inside.tmp")!r}, {str(tmp_path / "inside.out")!r})
time.sleep(600)
"""
    job = submit(script, nodes=2, name="inside")
    spare = slurm_client.grow(job.job_id, reservation=RESV, timeout=10)
    (tmp_path / "go.tmp").write_text(spare)
    (tmp_path / "go.tmp").rename(tmp_path / "go")
    result = tmp_path / "inside.out"
    wait_for("the batch script's step", result.exists, timeout=30)
    stale, released, rc, stdout, stderr = result.read_text().split("|", 4)
    assert slurm_client.hostnames(stale) == list(job.nodes)  # the batch env predates the grow
    assert rc == "0", stderr
    assert stdout == f"{spare} 3"
    assert released == spare and slurm_client.job(job.job_id).nodes == job.nodes
    assert not list(tmp_path.glob("slurm_job_*_resize.*"))  # scontrol ran without SLURM_JOBID


def test_repeated_grow_and_shrink(slurm_client, slurm_env, submit):
    job = submit(SLEEP, nodes=2, name="repeat")
    for round_ in range(3):
        spare = slurm_client.grow(job.job_id, reservation=RESV, timeout=10)
        assert spare in slurm_client.job(job.job_id).nodes
        # a step right away, also on a spare released from this job moments ago
        step = subprocess.run(slurm_client.step_argv(job.job_id, spare, ["hostname"]), capture_output=True,
                              text=True, timeout=30, env=slurm_env)
        assert (step.returncode, step.stdout.strip()) == (0, spare), (round_, step.stderr)
        assert slurm_client.shrink(job.job_id, keep=list(job.nodes)) == [spare]
        now = slurm_client.job(job.job_id)
        assert now.nodes == job.nodes and now.running and now.restart_count == 0, (round_, now)
        wait_for(f"{spare} free again", lambda: spare in slurm_client.free_standbys(RESV), timeout=15)


def test_grow_without_free_standby(slurm_client, slurm_env, submit):
    job = submit(SLEEP, nodes=2, name="full")
    got = [slurm_client.grow(job.job_id, reservation=RESV, timeout=10) for _ in range(2)]
    assert sorted(got) == ["spare1", "spare2"] and slurm_client.free_standbys(RESV) == []
    t = time.monotonic()
    with pytest.raises(NoStandbyAvailable) as ei:
        slurm_client.grow(job.job_id, reservation=RESV, timeout=3)
    took = time.monotonic() - t
    assert took < 3 + 5, took
    assert "trainmover_standby" in str(ei.value)
    now = slurm_client.job(job.job_id)
    assert now.running and sorted(now.nodes) == sorted(job.nodes + tuple(got)) and now.restart_count == 0
    donors = commands.run(["squeue", "-h", "--name=trainmover-donor-%d" % job.job_id, "-o", "%i"],
                          timeout=10, env=slurm_env).stdout.split()
    assert donors == []
    slurm_client.shrink(job.job_id, keep=list(job.nodes))


def test_batch_host_cannot_be_released(slurm_client, slurm_env, submit):
    job = submit(SLEEP, nodes=2, name="batchhost")
    other = next(n for n in job.nodes if n != job.batch_host)
    with pytest.raises(BatchHostRelease, match=f"cannot release {job.batch_host}"):
        slurm_client.shrink(job.job_id, keep=[other])
    # what Slurm itself says when asked directly (why the client checks first)
    with pytest.raises(SlurmError, match="Invalid node name specified"):
        commands.run(["scontrol", "update", f"JobId={job.job_id}", f"NodeList={other}"], timeout=10, env=slurm_env)
    assert slurm_client.job(job.job_id).nodes == job.nodes


def test_down_is_idempotent_and_up_restarts(slurm_cluster):
    d = slurm_cluster.state_dir
    stopped = cluster.down(d)
    assert "slurmctld" in stopped and "munged" in stopped
    assert cluster.down(d) == {}
    st = cluster.status(d)
    assert not st["running"] and not any(d["up"] for d in st["daemons"].values())
    t = time.monotonic()
    info = cluster.up(nodes=4, standby=2, state_dir=d)
    assert not info.already_running and time.monotonic() - t < 30
    assert cluster.status(d)["running"]


def test_up_names_the_daemon_that_failed(slurm_cluster, monkeypatch):
    """A broken slurm.conf: up() fails fast, naming slurmctld and showing why."""
    import shutil

    from trainmover.cluster import ClusterError, lifecycle
    from trainmover.cluster import spec as specmod

    good = specmod.render_slurm_conf
    monkeypatch.setattr(specmod, "render_slurm_conf", lambda spec: good(spec) + "NoSuchOption=1\n")
    # not under pytest's tmp_path: munged wants every parent of its socket searchable by all
    d = Path(f"/var/tmp/tm-e2e-broken-{os.getpid()}")
    t = time.monotonic()
    try:
        with pytest.raises(ClusterError) as ei:
            lifecycle.up(nodes=1, standby=1, state_dir=d, slurm=E2E_SLURM)
    finally:
        cluster.down(d)
    assert time.monotonic() - t < 30
    msg = str(ei.value)
    assert msg.startswith("slurmctld failed") and "unrecognized key: NoSuchOption" in msg
    assert "last lines of" in msg
    assert not any(s["up"] for s in cluster.status(d)["daemons"].values())
    shutil.rmtree(d)
