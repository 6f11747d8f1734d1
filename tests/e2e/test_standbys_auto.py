"""TM_STANDBYS=auto on the real local Slurm cluster: the demo job, with the site's rates in a
site file (TM_SITE_CONFIG), picks its pool size at start, says so in status.json and in
`trainmover status`, and keeps that size when a drained node's ranks take the standby.

Short: 300 steps, paced to last ~12 s (pace:0.04 leaves the bits unchanged), one drain, seen
within TM_POLL_S (1 s here: with the default 10 s it took pace:0.1).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from tests.e2e.conftest import as_user, user_dir, wait_for
from tests.e2e.test_migration import DRAIN_REASON, Run, TEMPLATE, TEST_JOB_PREFIX, job_ended, leaver_of, start_training
from trainmover.slurm import commands

pytestmark = pytest.mark.slurm

ROOT = TEMPLATE.parents[1]


@pytest.fixture
def auto_run(slurm_cluster, job_user):
    # The site file is the admin's (root's, 0644, in a root directory the job's user can read);
    # the job is the ordinary user's, submitted from a directory of theirs.
    site = Path(tempfile.mkdtemp(prefix="site-", dir=user_dir("auto").parent))
    site.chmod(0o755)
    (site / "site.toml").write_text("node_mtbf_h = 8000\nreplenish_h = 1.0\nmin_standbys = 1\nmax_standbys = 2\n")
    (site / "site.toml").chmod(0o644)
    workdir = user_dir("auto")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    env.update({"SLURM_CONF": str(slurm_cluster.slurm_conf), "TM_PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
                "TM_STEPS": "300", "TM_INJECT": "pace:0.04", "TM_STANDBYS": "auto", "TM_POLL_S": "1",
                "TM_SITE_CONFIG": str(site / "site.toml")})
    out = as_user(["sbatch", "--parsable", f"--job-name={TEST_JOB_PREFIX}auto", f"--chdir={workdir}", str(TEMPLATE)],
                  env).stdout
    run = Run(int(out.strip().split(";")[0]), workdir, env)
    yield run
    commands.run(["scancel", str(run.job_id)], timeout=10, env=env, check=False)
    from trainmover.slurm.client import CliSlurm
    client = CliSlurm(slurm_conf=str(slurm_cluster.slurm_conf))
    wait_for("the auto job to end", lambda: job_ended(client, run.job_id), timeout=60, interval=1.0)
    for name, node in client.nodes().items():
        if "DRAIN" in node.flags and node.reason == DRAIN_REASON:
            client.resume(name)


def test_auto_pool_size_is_chosen_shown_and_kept(auto_run, slurm_client):
    run = auto_run
    start_training(run, slurm_client, min_step=20)
    choice = run.status()["standby_pool"]["choice"]
    # 3 training nodes x 8 GPUs: a standby gains far less than its node; the site's minimum holds.
    assert (choice["setting"], choice["standbys"], choice["best"], choice["gpus"]) == ("auto", 1, 0, 24), choice
    assert choice["site"]["node_mtbf_h"] == 8000 and choice["site"]["source"].endswith("site.toml")
    assert "best size 0, clamped to the site's 1..2" in choice["why"]
    assert run.status()["standby_pool"]["wanted"] == 1
    text = run.cli("status", "--job", str(run.job_id))
    assert text.returncode == 0 and "standby pool: 1 (auto): 3 nodes x 8 GPUs = 24 GPUs" in text.stdout, text
    print("\n" + next(line for line in text.stdout.splitlines() if "standby pool:" in line))
    wait_for("a warm standby", lambda: any(s["state"] == "ready" for s in run.status()["standbys"]), timeout=60)
    leaver = leaver_of(run)
    commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={DRAIN_REASON}"],
                 timeout=10, env=run.env)
    wait_for("the drain's migration", lambda: [m["state"] for m in run.status()["migrations"]] == ["done"], timeout=60,
             explain=run.explain)
    joiner = run.status()["migrations"][0]["joiner"]
    # The pool is kept at the chosen size: another standby is taken in the used one's place.
    pools = []
    wait_for("the pool refilled", lambda: pools.append([s["node"] for s in run.status()["standbys"]]) or
             (pools[-1] and joiner not in pools[-1]), timeout=60, interval=0.5, explain=run.explain)
    assert len(pools[-1]) == 1, pools   # one, as chosen: not more
    assert run.wait_done(slurm_client, timeout=240) == "COMPLETED", run.slurm_out()[-3000:]
    assert run.final()["steps"] == 300
