"""The TrainMover SPANK plugin (slurm_plugin/) loaded by the real local cluster through
the plugstack.conf that `trainmover cluster up` writes: the option in --help, a bad value
refused at submit time, the demo template run with `sbatch --trainmover=standbys=auto,...`, and the
plugin's messages in the slurmd log."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import TEST_JOB_PREFIX, wait_for
from trainmover.slurm import commands

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "sbatch_templates" / "demo_gpt_cpu.sbatch"
PLUGIN_DIR = ROOT / "slurm_plugin"


@pytest.fixture(scope="module")
def job_env(slurm_cluster):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    return {**env, "SLURM_CONF": str(slurm_cluster.slurm_conf), "TM_PYTHON": sys.executable,
            "PYTHONPATH": str(ROOT)}


def test_plugstack_points_at_the_built_plugin(slurm_cluster):
    """The plugin built for the cluster's Slurm (in place for the host's; inside the root
    filesystem, against that release's headers, for another release) is the one loaded."""
    so = slurm_cluster.spank_plugin
    expected = PLUGIN_DIR / "trainmover_spank.so" if slurm_cluster.slurm_root is None else \
        Path(slurm_cluster.state_dir) / "spank" / "trainmover_spank.so"
    assert so == expected, slurm_cluster
    conf = (Path(slurm_cluster.state_dir) / "etc" / "plugstack.conf").read_text()
    assert f"optional {so}" in conf.splitlines()
    out = subprocess.run(["nm", "-D", "--defined-only", str(so)],
                         capture_output=True, text=True, timeout=10, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert exported == {"plugin_name", "plugin_type", "plugin_version", "spank_plugin_version",
                        "slurm_spank_init", "slurm_spank_init_post_opt", "slurm_spank_user_init",
                        "slurm_spank_task_exit", "slurm_spank_exit"}


@pytest.mark.parametrize("command", ["sbatch", "salloc", "srun"])
def test_help_lists_the_option(command, job_env):
    out = commands.run([command, "--help"], timeout=10, env=job_env, check=False)
    assert "--trainmover" in out.stdout, out.stdout[-2000:]
    assert "standbys=N" in out.stdout


@pytest.mark.parametrize("value, message", [
    ("bogus", "trainmover: unknown setting 'bogus' in --trainmover"),
    ("standbys=x", "trainmover: standbys=x: expected auto or a number from 0 to 64"),
    ("standbys=65", "trainmover: standbys=65: expected auto or a number from 0 to 64"),
    ("standbys=1,,reservation=r", "trainmover: empty setting in --trainmover=standbys=1,,reservation=r"),
    ("reservation=a/b", "trainmover: reservation=a/b: expected 1-63 characters"),
    ("standbys=1,standbys=2", "trainmover: standbys given twice"),
])
def test_bad_value_fails_at_submit(value, message, job_env, tmp_path):
    proc = commands.run(["sbatch", "--parsable", f"--job-name={TEST_JOB_PREFIX}bad", f"--chdir={tmp_path}",
                         f"--trainmover={value}", "--wrap", "true"], timeout=15, env=job_env, check=False)
    assert proc.returncode != 0 and not proc.stdout.strip(), "no job may be submitted"
    assert message in proc.stderr, proc.stderr


def test_sbatch_trainmover_runs_the_demo(slurm_cluster, slurm_client, job_env, tmp_path):
    env = {**job_env, "TM_STEPS": "80"}
    out = commands.run(["sbatch", "--parsable", f"--job-name={TEST_JOB_PREFIX}spank", f"--chdir={tmp_path}",
                        "--trainmover=standbys=auto,reservation=trainmover_standby", str(TEMPLATE)],
                       timeout=15, env=env).stdout
    job_id = int(out.strip().split(";")[0])
    try:
        wait_for(f"job {job_id} to end", lambda: slurm_client.job(job_id).state not in
                 ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING"), timeout=150, interval=1.0)
    finally:
        commands.run(["scancel", str(job_id)], timeout=10, env=job_env, check=False)
    slurm_out = (tmp_path / f"slurm-{job_id}.out")
    job = slurm_client.job(job_id)
    assert job.state == "COMPLETED", slurm_out.read_text()[-3000:] if slurm_out.exists() else job
    final = json.loads((tmp_path / "runs" / str(job_id) / "final.json").read_text())
    assert final["steps"] == 80
    logs = "\n".join(p.read_text(errors="replace") for p in (Path(slurm_cluster.state_dir) / "log").glob("slurmd-*.log"))
    mine = [line for line in logs.splitlines() if f"trainmover: job {job_id} " in line]
    assert any(f"job {job_id} step batch runs under TrainMover (standbys=auto, reservation=trainmover_standby)" in line
               for line in mine), logs[-3000:]
    choice = json.loads((tmp_path / "runs" / str(job_id) / "status.json").read_text())["standby_pool"]["choice"]
    assert choice["setting"] == "auto" and choice["why"], choice   # TM_STANDBYS=auto reached the controller
    assert any(f"job {job_id} step batch task 0 exited with status 0" in line for line in mine)
    assert any(f"job {job_id} step 0 runs under TrainMover" in line for line in mine), \
        "worker steps launched by the controller inherit the option"
    release = slurm_cluster.slurm_version.rsplit(".", 1)[0]
    assert f"trainmover: plugin loaded in slurmd (built against Slurm {release})" in logs, \
        f"slurmd loaded a plugin built for another Slurm than {slurm_cluster.slurm}"


def test_options_parser_alone(tmp_path):
    """tm_options.c is pure C: built with a tiny driver, without Slurm."""
    driver = tmp_path / "driver.c"
    driver.write_text(r'''
#include <stdio.h>
#include "tm_spank.h"
int main(int argc, char **argv) {
    struct tm_opts o; char err[256];
    for (int i = 1; i < argc; i++) {
        tm_opts_reset(&o);
        if (tm_opts_parse(argv[i][0] == '-' ? NULL : argv[i], &o, err, sizeof err) == 0)
            printf("ok given=%d standbys=%d reservation=%s\n", o.given, o.standbys, o.reservation);
        else
            printf("error %s\n", err);
    }
    return 0;
}
''')
    exe = tmp_path / "driver"
    subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{PLUGIN_DIR}", "-o", str(exe), str(driver),
                    str(PLUGIN_DIR / "tm_options.c")], check=True, timeout=60)
    cases = ["-", "standbys=0", "standbys=64,reservation=my_res.1", "reservation=r,standbys=3", "standbys=",
             "standbys=-1", "reservation=", "x=1", "standbys=99999999999999999999", "standbys=auto,reservation=r",
             "standbys=autox", "standbys=auto,standbys=1"]
    out = subprocess.run([str(exe), *cases], capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()
    assert out == [
        "ok given=1 standbys=-1 reservation=",
        "ok given=1 standbys=0 reservation=",
        "ok given=1 standbys=64 reservation=my_res.1",
        "ok given=1 standbys=3 reservation=r",
        "error standbys=: expected auto or a number from 0 to 64",
        "error standbys=-1: expected auto or a number from 0 to 64",
        "error reservation=: expected 1-63 characters of [A-Za-z0-9_.-]",
        "error unknown setting 'x' in --trainmover (expected a comma list of standbys=N (0-64) or auto, reservation=NAME)",
        "error standbys=99999999999999999999: expected auto or a number from 0 to 64",
        "ok given=1 standbys=-2 reservation=r",
        "error standbys=autox: expected auto or a number from 0 to 64",
        "error standbys given twice in --trainmover",
    ]
