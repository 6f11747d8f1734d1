"""In-job standbys end to end (issue 40, item 1) on a cluster WITHOUT permit_job_expansion, as
Slurm ships it (`cluster up --no-job-expansion`): the job asks for two more nodes at submit and
TM_INJOB_STANDBYS=2; those two run warm standbys from the start; a drain moves rank 1 onto one
bit-exactly and a SIGKILL of rank 2's process recovers it onto the other, each leaver released
by a shrink; a third drain finds none left and waits, the job training on the drained node, said
in the status; the job completes, bit-exact against an uninterrupted run on the same cluster.
Controls: a job that wants standbys and brings none fails at start with the reason; the
reservation's spare never joins. The unit side: tests/unit/test_injob_standbys.py.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import TEST_JOB_PREFIX, as_user, job_ended, own_cluster, user_dir, wait_for
from tests.e2e.test_migration import STEPS, Run, assert_same_training
from trainmover.cluster.procs import step_pid
from trainmover.slurm import commands
from trainmover.slurm.model import KEEPER_FEATURE, TRAIN_FEATURE

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "sbatch_templates" / "demo_gpt_cpu.sbatch"  # 3 training nodes + its keeper
STATE_DIR = os.environ.get("TM_E2E_INJOB_CLUSTER_DIR", "/var/tmp/trainmover-cluster-injob")
DRAIN_REASON = "tm-e2e injob"
TRAIN = 3       # the template's training nodes
IN_JOB = 2      # standbys the job brings
POLL_S = 1      # drains are seen within a second (default 10 s)
PACE = "pace:0.17"  # the same bits, slower: the job outlasts three drains on 2 shared cores


@pytest.fixture(scope="module")
def cluster():
    # 5 training-feature nodes (3 train + 2 in-job standbys), one keeper, one spare in the reservation
    yield from own_cluster(TRAIN + IN_JOB, 1, STATE_DIR, DRAIN_REASON, keepers=1, job_expansion=False)


@pytest.fixture(scope="module")
def demo(cluster):
    info, client = cluster
    runs: list[Run] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_") or k == "TM_SLURM_BACKEND"}
    env.update({"SLURM_CONF": str(info.slurm_conf), "TM_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)})

    def submit(name: str, nodes: int = TRAIN, **tm_env) -> Run:
        workdir = user_dir(name)
        job_env = {**env, "TM_STEPS": str(STEPS), **{k: str(v) for k, v in tm_env.items()}}
        out = as_user(["sbatch", "--parsable", f"--job-name={TEST_JOB_PREFIX}{name}", f"--chdir={workdir}",
                       f"--nodes={nodes + 1}", f"--constraint=[{KEEPER_FEATURE}*1&{TRAIN_FEATURE}*{nodes}]",
                       str(TEMPLATE)], job_env).stdout
        run = Run(int(out.strip().split(";")[0]), workdir, job_env)
        runs.append(run)
        return run

    yield submit
    commands.run(["scancel", *[str(r.job_id) for r in runs]], timeout=10, env=env, check=False)
    wait_for("this module's jobs to end", lambda: all(job_ended(client, r.job_id) for r in runs), timeout=60,
             interval=1.0)


def _drain(run: Run, node: str) -> None:
    commands.run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={DRAIN_REASON}"], timeout=10,
                 env=run.env)


def _moved(run: Run, client, rank: int, leaver: str, joiner: str, count: int, drained: bool = True) -> None:
    wait_for(f"rank {rank} to run on {joiner}", lambda: run.metrics()[-1]["nodes"][rank] == joiner, timeout=60,
             interval=0.2, explain=run.explain)
    wait_for(f"{leaver} released by a shrink" + (" and drained" if drained else ""),
             lambda: leaver not in client.job(run.job_id).nodes and (client.nodes([leaver])[leaver].drained
                                                                    or not drained),
             timeout=30, explain=run.explain)
    wait_for(f"{count} migration(s) done", lambda: [m["state"] for m in run.status()["migrations"]] == ["done"] * count,
             timeout=15, explain=lambda: json.dumps(run.status()["migrations"])[-2000:])


def test_without_job_expansion_standbys_wanted_and_none_brought_fail_at_start(demo, cluster):
    _, client = cluster
    run = demo("nogrow", TM_STANDBYS=1)
    assert run.wait_done(client, timeout=120) == "FAILED"
    assert "cannot take standbys: SchedulerParameters lacks permit_job_expansion" in run.slurm_out()


def test_two_in_job_standbys_take_a_drain_and_a_sigkill_bit_exactly_and_a_third_drain_waits_clearly(demo, cluster):
    _, client = cluster
    # one keeper node: one job at a time; the uninterrupted run first, on the same cluster
    reference = demo("injob-reference", TM_STANDBYS=0)
    assert reference.wait_done(client) == "COMPLETED", reference.slurm_out()[-3000:]
    run = demo("injob", nodes=TRAIN + IN_JOB, TM_STANDBYS=1, TM_INJOB_STANDBYS=IN_JOB, TM_INJECT=PACE,
               TM_POLL_S=POLL_S)
    wait_for(f"job {run.job_id}: training and both in-job standbys warm",
             lambda: run.last_step() >= 20 and len([s for s in run.status()["standbys"] if s["state"] == "ready"]) == 2,
             timeout=180, interval=0.5)
    job = client.job(run.job_id)
    trained = sorted(n for n in job.nodes if TRAIN_FEATURE in client.nodes([n])[n].features)
    status = run.status()
    standbys = sorted(s["node"] for s in status["standbys"])
    assert standbys == trained[-IN_JOB:], (standbys, trained)  # the last N training-feature nodes
    assert set(run.metrics()[-1]["nodes"]) == set(trained[:-IN_JOB])
    assert status["capabilities"]["pool_mode"]["mode"] == "in-job", status["capabilities"]
    assert status["capabilities"]["grow"] is False
    assert status["standby_pool"]["in_job"] == {"brought": IN_JOB, "refill": "no", "left": IN_JOB}
    assert "standby mode: in-job" in run.slurm_out() or "standby mode: in-job" in run.cli("status", "--job",
                                                                                      str(run.job_id)).stdout
    first, second = run.metrics()[-1]["nodes"][1], run.metrics()[-1]["nodes"][2]
    _drain(run, first)
    # the joiner: whichever in-job standby was ready first
    wait_for("the first migration's joiner", lambda: any(m["joiner"] for m in run.status()["migrations"]), timeout=15)
    joiner1 = run.status()["migrations"][0]["joiner"]
    assert joiner1 in standbys
    _moved(run, client, 1, first, joiner1, 1)
    assert run.status()["standby_pool"]["in_job"]["left"] == 1
    # the second: rank 2's process SIGKILLed (no drain): recovered onto the other in-job standby
    wait_for("the other in-job standby ready again after the first move",
             lambda: [s["state"] for s in run.status()["standbys"] if s["node"] != joiner1] == ["ready"], timeout=60)
    os.kill(step_pid(run.job_id, second), signal.SIGKILL)
    (joiner2,) = [n for n in standbys if n != joiner1]
    _moved(run, client, 2, second, joiner2, 2, drained=False)
    recovery = run.status()["migrations"][1]
    assert recovery["recovery"] and recovery["trigger"] == "failure" and recovery["leaver"] == second, recovery
    assert run.status()["standby_pool"]["in_job"]["left"] == 0
    # the third drain: none left, no grow on this cluster: a clear wait, the job training on
    third = run.metrics()[-1]["nodes"][1]  # joiner1 now
    _drain(run, third)
    wait_for("status to say no standby is left", lambda: run.status()["waiting_for_standby"] == [third], timeout=15)
    status = run.status()
    assert "no standby left" in status["message"] and third in status["message"], status["message"]
    steps = run.last_step()
    time.sleep(3)
    assert run.last_step() > steps and run.metrics()[-1]["nodes"][1] == third  # nothing stopped
    assert run.wait_done(client, timeout=300) == "COMPLETED", run.slurm_out()[-3000:]
    after = client.job(run.job_id)
    assert after.restart_count == 0
    assert not any(n.startswith("spare") for n in after.nodes)  # the reservation's spare never joined
    assert "in-job standby(s) left" in run.slurm_out()
    assert [m["state"] for m in run.status()["migrations"]][:2] == ["done", "done"]
    # the killed rank's report of its last step died with it, and a lagger got that step's state
    assert_same_training(run, reference, *[(r, recovery["switch_step"]) for r in
                                           sorted({2, *recovery["state_source"].get("laggers", [])})])
