"""The health check as the node's Epilog (--fence-record): a node the ending job held after
fencing it is drained, with the job and its user in the reason; nothing else a user writes
drains anything (healthcheck/fence_record.py)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_healthcheck import FakeSlurm
from trainmover.healthcheck import cli, fence_record
from trainmover.healthcheck.fence_record import JobEnd, Untrusted, held_here, read_status
from trainmover.healthcheck.run import Options, run

UID = os.getuid()


def record(node="n1", state="held", reason="rank 3 silent for 30s"):
    return {"fenced_nodes": [{"node": "n9", "reason": "other", "state": "drained"},
                             {"node": node, "reason": reason, "state": state, "held": "drain refused: ..."}]}


def job_dir(tmp_path, body, job=7):
    d = tmp_path / "runs" / str(job)
    d.mkdir(parents=True)
    (d / "status.json").write_text(json.dumps(body))
    return JobEnd(job, UID, str(tmp_path))


def test_only_a_held_entry_for_this_very_node_counts():
    assert held_here(record(), "n1") == "rank 3 silent for 30s"
    assert held_here(record(), "n2") is None                 # another node's entry
    assert held_here(record(state="drained"), "n1") is None   # drained already by the job
    for junk in ([], {"fenced_nodes": "n1"}, {"fenced_nodes": [["n1", "held"]]}, None):
        assert held_here(junk, "n1") is None


def test_the_record_is_read_only_as_the_job_users_plain_files(tmp_path):
    end = job_dir(tmp_path, record())
    assert read_status(end) == record()  # control
    with pytest.raises(Untrusted, match="owner uid"):
        read_status(JobEnd(7, UID + 1, str(tmp_path)))  # not the job's user's
    assert read_status(JobEnd(8, UID, str(tmp_path))) is None  # another job: nothing there


def test_a_link_or_fifo_anywhere_below_the_work_dir_is_refused(tmp_path):
    other = tmp_path / "elsewhere"
    job_dir(other, record())
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "runs").symlink_to(other / "runs")  # runs/ swapped for a link
    with pytest.raises(Untrusted, match="runs"):
        read_status(JobEnd(7, UID, str(tmp_path / "a")))
    (tmp_path / "b" / "runs" / "7").mkdir(parents=True)
    (tmp_path / "b" / "runs" / "7" / "status.json").symlink_to(other / "runs" / "7" / "status.json")
    with pytest.raises(Untrusted, match="status.json"):
        read_status(JobEnd(7, UID, str(tmp_path / "b")))
    (tmp_path / "c" / "runs" / "7").mkdir(parents=True)
    os.mkfifo(tmp_path / "c" / "runs" / "7" / "status.json")  # would block a reader without O_NONBLOCK
    with pytest.raises(Untrusted, match="not a plain file"):
        read_status(JobEnd(7, UID, str(tmp_path / "c")))


def test_the_epilog_drains_a_held_node_with_the_job_and_user_in_the_reason(tmp_path):
    end = job_dir(tmp_path / "work", record(reason="rank 3 silent\x1b[2J for 30s"))
    client = FakeSlurm()
    extra = [(fence_record.NAME, lambda: fence_record.findings(end, "n1"))]
    report = run(Options(node="n1", state_dir=tmp_path, gpu=False), client, extra=extra)
    assert report.drained and client.drained == [
        ("n1", f"trainmover: healthcheck fenced: job 7 (uid {UID}) held this node after fencing it: "
               "rank 3 silent?[2J for 30s")]


@pytest.mark.parametrize("body, uid", [(record(state="drained"), UID), (record(node="n2"), UID), (record(), UID + 1)])
def test_controls_nothing_is_drained_unless_the_job_held_this_node_in_its_own_file(tmp_path, body, uid):
    job_dir(tmp_path / "work", body)
    end = JobEnd(7, uid, str(tmp_path / "work"))
    client = FakeSlurm()
    report = run(Options(node="n1", state_dir=tmp_path, gpu=False), client,
                 extra=[(fence_record.NAME, lambda: fence_record.findings(end, "n1"))])
    assert report.healthy and not report.drained and client.drained == []


def test_the_job_comes_from_slurms_environment_and_nothing_else():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_UID": "1001", "SLURM_JOB_WORK_DIR": "/home/u"}
    assert JobEnd.from_env(env) == JobEnd(7, 1001, "/home/u")
    with pytest.raises(ValueError, match="SLURM_JOB_WORK_DIR unset"):
        JobEnd.from_env({**env, "SLURM_JOB_WORK_DIR": ""})
    with pytest.raises(ValueError, match="malformed"):
        JobEnd.from_env({**env, "SLURM_JOB_ID": "7/../8"})
    with pytest.raises(ValueError, match="malformed"):
        JobEnd.from_env({**env, "SLURM_JOB_WORK_DIR": "rel"})


def test_the_cli_refuses_fence_record_outside_an_epilog(monkeypatch, capsys):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    for k in ("SLURM_JOB_ID", "SLURM_JOB_UID", "SLURM_JOB_WORK_DIR"):
        monkeypatch.delenv(k, raising=False)
    assert cli.main(p.parse_args(["--node", "n1", "--no-gpu", "--fence-record"])) == 2
    assert "not run as an Epilog" in capsys.readouterr().err


# --- through slurm_plugin/healthcheck.sh, as slurmd runs the Epilog (root) ----------------------
from tests.unit.test_healthcheck_script import installed, pytestmark as script_mark  # noqa: E402,F401


@pytest.mark.parametrize("state, rc", [("held", 1), ("drained", 0)])
def test_the_installed_script_passes_the_ending_job_through(installed, tmp_path, state, rc):  # noqa: F811
    """healthcheck.sh runs Python in a clean environment: as the Epilog it must hand over the
    job's id, uid and working directory, and only those. Control: a node the job drained itself
    is healthy (--no-drain: the verdict is printed, Slurm not asked)."""
    if script_mark.args[0]:
        pytest.skip(script_mark.kwargs["reason"])
    runs = subprocess.run([sys.executable, "-I", "-c", "import trainmover; print(trainmover.__path__[0])"],
                          capture_output=True, text=True, cwd="/").stdout.strip()
    if Path(runs).resolve() != Path(fence_record.__file__).resolve().parents[1]:
        pytest.skip(f"healthcheck.sh runs the installed trainmover (python -I: {runs}), not this checkout's")
    work = tmp_path / "work"
    job_dir(work, record(state=state))
    p = installed("--no-drain", "--no-gpu", "--fence-record",
                  extra_env=["SLURM_JOB_ID=7", f"SLURM_JOB_UID={UID}", f"SLURM_JOB_WORK_DIR={work}", "HF_TOKEN=x"])
    assert p.returncode == rc, p.stdout + p.stderr
    assert ("fenced: job 7 (uid" in p.stdout) == (state == "held"), p.stdout


def run_epilog(installed, work):  # noqa: F811
    shutil.copy(Path(fence_record.__file__).resolve().parents[2] / "slurm_plugin" / "epilog.sh", installed.bindir)
    return subprocess.run(["/usr/bin/env", "-i", "SLURMD_NODENAME=n1", "SLURM_JOB_ID=7", f"SLURM_JOB_UID={UID}",
                           f"SLURM_JOB_WORK_DIR={work}", str(installed.bindir / "epilog.sh")],
                          capture_output=True, text=True, timeout=20, cwd="/")


@pytest.mark.parametrize("marked, state", [(True, "held"), (True, "drained"), (False, "held")])
def test_the_epilog_checks_only_a_node_its_job_marked_held_and_keeps_the_checks_reason(
        installed, tmp_path, marked, state):  # noqa: F811
    """slurm_plugin/epilog.sh as slurmd runs it (Epilog= takes no arguments, so the site file
    gives --no-drain here): without the job's mark for this node (runs/<job>/held-<node>.json,
    the controller's) it starts no Python, so other jobs' ends cost nothing; with it, the
    record (status.json alone) is judged. It exits 0 whatever the check found: a non-zero
    Epilog would make slurmctld replace the check's reason by "Epilog error"."""
    if script_mark.args[0]:
        pytest.skip(script_mark.kwargs["reason"])
    installed.env.write_text(installed.env.read_text().replace("--no-straggler", "--no-straggler --no-drain --no-gpu"))
    work = tmp_path / "work"
    job_dir(work, record(state=state))
    if marked:
        (work / "runs" / "7" / "held-n1.json").write_text("{}")
    (work / "runs" / "7" / "held-n2.json").write_text("{}")  # another node's mark: not this one's
    p = run_epilog(installed, work)
    assert p.returncode == 0, p.stdout + p.stderr
    assert ("fenced: job 7 (uid" in p.stdout) == (marked and state == "held"), p.stdout
    assert ("n1:" in p.stdout) == marked, p.stdout  # the check ran, or did not start at all


def test_an_epilog_whose_check_cannot_run_lets_the_node_go_back_and_says_so(installed, tmp_path):  # noqa: F811
    """A misconfigured check (no interpreter where healthcheck.env says) must not drain every node
    at every job's end: the Epilog exits 0 and slurmd's log gets why."""
    if script_mark.args[0]:
        pytest.skip(script_mark.kwargs["reason"])
    installed.env.write_text(f"TRAINMOVER_PYTHON={tmp_path}/no-such-python\n")
    work = tmp_path / "work"
    job_dir(work, record())
    (work / "runs" / "7" / "held-n1.json").write_text("{}")
    p = run_epilog(installed, work)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no Python interpreter" in p.stderr and "the health check did not run (exit 2)" in p.stderr, p.stderr
