"""Five TrainMover jobs of one ordinary user side by side under slurmctld's per-user RPC rate
limit (`SlurmctldParameters=rl_enable` at its defaults: the embedded cluster sets it on Slurm
23.02 and later; run this on 24.11 and 26.05 with TM_E2E_SLURM): every job runs, moves on a
drain (two told by a drain notice from `trainmover drain`, two found by their node poll after a
plain `scontrol` drain), one recovers from a killed rank, every job completes, and slurmctld's
log shows no rate-limit message (docs/admin.md, "Load on slurmctld").

Root is exempt from the limit, so the jobs are JOB_USER's. Tiny model, few paced steps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import (E2E_SLURM, JOB_USER, TEST_JOB_PREFIX, as_user, job_ended, own_cluster, resume_drained,
                                user_dir, wait_for)
from trainmover.cluster.users import host_account
from trainmover.controller.succession.keeper import sbatch_args
from trainmover.errors import SlurmError
from trainmover.slurm import commands

def _release() -> tuple[int, int]:
    from trainmover.cluster.rootfs import host_version
    version = E2E_SLURM or host_version() or "0.0"
    return tuple(int(x) for x in version.split(".")[:2])


# before the 16-node cluster starts: a release without the rate limit has nothing to show here
pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(_release() < (23, 2), reason="Slurm before 23.02 has no RPC rate limit (rl_enable)")]

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "sbatch_templates" / "demo_gpt_cpu.sbatch"
STATE_DIR = "/var/tmp/trainmover-cluster-e2e-load"
DRAIN_REASON = "tm-e2e load"
STEPS = 800  # paced at 0.1 s: the jobs outlast five standbys' warm-up on a loaded machine
JOBS = 5
# A job's start costs its user about 25 RPCs (keeper, controller, taking the standby, its steps:
# bench/cpu_slurmctld_load.py, startup_rpcs_1_job); five at once would overdraw the bucket (30
# tokens, 2 a second), so the user starts them a little apart, as docs/admin.md advises.
STAGGER_S = 15.0


@pytest.fixture(scope="module")
def load_cluster():
    # one keeper per job; four one-rank jobs and one of two ranks (its replica recovers the
    # killed rank); one standby each
    # no node-state reader: the test measures each job's own poll against the user's rate limit
    yield from own_cluster(JOBS + 1, JOBS, STATE_DIR, DRAIN_REASON, keepers=JOBS, node_reader=False)


class Job:
    def __init__(self, job_id: int, work: Path, env: dict):
        self.job_id, self.dir, self.env = job_id, work / "runs" / str(job_id), env

    def status(self) -> dict:
        try:
            return json.loads((self.dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def warm(self) -> bool:
        return any(s["state"] == "ready" for s in self.status().get("standbys", []))

    def train_node(self, rank: int = 0) -> str:
        return next(n["name"] for n in self.status()["nodes"] if n["role"] == "train" and rank in n["ranks"])


def test_five_jobs_of_one_user_stay_within_the_rate_limit(load_cluster):
    info, client = load_cluster
    assert "SlurmctldParameters=rl_enable" in Path(info.slurm_conf).read_text().splitlines()
    log = Path(info.slurm_conf).parents[1] / "log" / "slurmctld.log"
    log_from = log.stat().st_size
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    env.update(SLURM_CONF=str(info.slurm_conf), TM_PYTHON=sys.executable, PYTHONPATH=str(ROOT),
               TM_STEPS=str(STEPS), TM_INJECT="pace:0.1")
    jobs: list[Job] = []
    try:
        for i in range(JOBS):
            work = user_dir(f"load{i}")
            ranks = 2 if i == JOBS - 1 else 1
            job_env = dict(env, TM_INJECT="pace:0.1,die:1:120") if ranks == 2 else env
            out = as_user(["sbatch", "--parsable", f"--job-name={TEST_JOB_PREFIX}load{i}", f"--chdir={work}",
                           *sbatch_args(ranks), str(TEMPLATE)], job_env).stdout
            jobs.append(Job(int(out.strip().split(";")[0]), work, job_env))
            time.sleep(STAGGER_S)
        # each of the first four drained once its standby is warm: two told at once (root's
        # `trainmover drain` writes the notice), two found by their node poll alone
        drained: dict[int, str] = {}

        def drain_warm() -> bool:
            for i, j in enumerate(jobs[:4]):
                if j.job_id in drained or not j.warm():
                    continue
                node = drained[j.job_id] = j.train_node()
                if i < 2:
                    cli = subprocess.run([sys.executable, "-m", "trainmover.cli", "drain", node,
                                          f"--reason={DRAIN_REASON}"], capture_output=True, text=True, timeout=60,
                                         env=env)
                    assert "its jobs were told through" in cli.stdout, cli.stdout + cli.stderr
                else:
                    commands.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={DRAIN_REASON}"],
                                 timeout=10, env=env)
            return len(drained) == 4

        wait_for("four jobs with a warm standby, each then drained", drain_warm, timeout=300, interval=1.0,
                 explain=lambda: "\n".join(f"{j.job_id}: {j.status().get('standbys')}" for j in jobs))
        for j in jobs:
            wait_for(f"job {j.job_id} to complete", lambda: job_ended(client, j.job_id), timeout=300, interval=2.0,
                     explain=lambda: json.dumps(j.status().get("migrations"))[-2000:])
        for j in jobs:
            s = j.status()
            assert s.get("outcome", {}).get("ok"), (j.job_id, s.get("outcome"))
            done = [m for m in s["migrations"] if m["state"] == "done"]
            if j is jobs[-1]:
                assert any(m["recovery"] and m["trigger"] == "failure" for m in done), s["migrations"]
            else:
                assert any(m["trigger"] == "drain" and m["leaver"] == drained[j.job_id] for m in done), s["migrations"]
            assert s["finished"]
        owners = {commands.run(["scontrol", "-o", "show", "job", str(j.job_id)], timeout=10,
                               env=env).stdout.split("UserId=")[1].split("(")[0] for j in jobs}
        assert owners == {JOB_USER}
    finally:
        if jobs:
            commands.run(["scancel", *[str(j.job_id) for j in jobs]], timeout=10, env=env, check=False)
            for j in jobs:  # and any standby request a job left behind
                commands.run(["scancel", f"--name=trainmover-donor-{j.job_id}"], timeout=10, env=env, check=False)
        resume_drained(client, DRAIN_REASON)
    said = log.read_text(errors="replace")[log_from:]
    limited = [x for x in said.splitlines() if "rate limit exceeded" in x.lower()]
    assert not limited, limited[:5]
    # negative control: the same user's burst of queries is throttled, and the log says so
    uid = host_account(JOB_USER).uid
    log_from = log.stat().st_size
    def throttled() -> bool:
        return f"rate limit exceeded by uid {uid}" in log.read_text(errors="replace")[log_from:].lower()

    for _ in range(60):  # the bucket holds 30 tokens
        try:
            as_user(["squeue", "-h", "-u", JOB_USER], env, check=False)
        except SlurmError:  # a throttled client backs off and may run past its timeout
            pass
        if throttled():
            break
    wait_for("slurmctld to log the throttled burst", throttled, timeout=30)
