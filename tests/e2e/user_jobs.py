"""What the modules that submit a training script through a template repeat
(test_script_mode.py, test_trainers.py, test_example_cnn.py): the environment their jobs get,
their module-scoped submitters and those fixtures' teardown, and the three runs each trainer
makes - a drain moves rank 1 bit-exactly, a SIGKILLed rank is recovered bit-exactly from the
snapshot tier, and the negative control (the optimizer state left out of the copy) differs.
What stays a module's own - its script and arguments, its STEPS and timeouts, how it compares a
run with the reference (its Trainer's files, a saved model) - comes in as parameters."""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.conftest import (TEST_JOB_PREFIX, as_user, assert_runs_as_user, job_ended, resume_drained, user_dir,
                                wait_for)
from tests.e2e.test_failures import may_miss, recoveries
from tests.e2e.test_migration import Run
from trainmover.controller.succession.keeper import sbatch_args
from trainmover.slurm import commands

ROOT = Path(__file__).resolve().parents[2]


def job_env(slurm_cluster, pythonpath: str = str(ROOT), keep: tuple[str, ...] = ("TM_SLURM_BACKEND",)) -> dict:
    """This process's environment for a module's jobs: no TM_ setting of the caller's (but `keep`),
    the cluster's slurm.conf, this interpreter, `pythonpath`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_") or k in keep}
    env.update(SLURM_CONF=str(slurm_cluster.slurm_conf), TM_PYTHON=sys.executable, PYTHONPATH=pythonpath)
    return env


def end_module_jobs(slurm_cluster, env: dict, runs: list[Run], drain_reason: str) -> None:
    """A module-scoped submitter's teardown: cancel the module's jobs, wait until each has ended
    (not merely been cancelled), resume the nodes the module drained (`drain_reason`)."""
    commands.run(["scancel", *[str(r.job_id) for r in runs]], timeout=10, env=env, check=False)
    from trainmover.slurm.client import CliSlurm
    client = CliSlurm(slurm_conf=str(slurm_cluster.slurm_conf))
    wait_for("this module's jobs to end", lambda: all(job_ended(client, r.job_id) for r in runs), timeout=60,
             interval=1.0)
    resume_drained(client, drain_reason)


def user_script_jobs(slurm_cluster, template: Path, job: dict, drain_reason: str,
                     script_args: Callable[[Path], list[str]]) -> Iterator[Callable[..., Run]]:
    """Body of a module-scoped fixture: yields submit(name, **env) -> Run, which submits
    `template` on 2 training nodes as JOB_USER, from a fresh submit directory of theirs, with
    `job` and `env` (TM_ settings) on top of job_env()'s; `script_args(workdir)`: the template's
    arguments (the script and its options). The module's jobs are ended at teardown."""
    env = job_env(slurm_cluster)
    runs: list[Run] = []

    def submit(name: str, **tm_env) -> Run:
        workdir = user_dir(name)
        env_of_job = {**env, **job, **{k: str(v) for k, v in tm_env.items()}}
        out = as_user(["sbatch", "--parsable", *sbatch_args(2), f"--job-name={TEST_JOB_PREFIX}{name}",
                       f"--chdir={workdir}", str(template), *script_args(workdir)], env_of_job).stdout
        run = Run(int(out.strip().split(";")[0]), workdir, env_of_job)
        runs.append(run)
        return run

    yield submit
    end_module_jobs(slurm_cluster, env, runs, drain_reason)


def losses(run: Run) -> dict[int, list]:
    """step -> every rank's loss, from the job's metrics."""
    return {m["step"]: m["losses"] for m in run.metrics()}


@dataclass(frozen=True)
class TrainerRuns:
    """One trainer's module: its STEPS, its drain reason, how long its job may take to its end
    (`timeout`) and to reach step 30 and then a warm standby (`standby_timeout`, each), and
    `assert_same(run, reference, *lost)`, its comparison with the uninterrupted run."""
    steps: int
    drain_reason: str
    timeout: float
    standby_timeout: float
    assert_same: Callable[..., None]

    def completes(self, run: Run, slurm_client) -> None:
        assert run.wait_done(slurm_client, timeout=self.timeout) == "COMPLETED", run.slurm_out()[-3000:]

    def standby_ready(self, run: Run) -> None:
        wait_for("step 30", lambda: run.last_step() >= 30, timeout=self.standby_timeout, interval=0.2)
        wait_for("a warm standby", lambda: any(s["state"] == "ready" for s in run.status()["standbys"]),
                 timeout=self.standby_timeout)

    def reference(self, run: Run, slurm_cluster, code_after_ran: str) -> Run:
        """`run`, uninterrupted, completes after every step; the script's code after its training
        ran (`code_after_ran` says so when the saved model is missing)."""
        from trainmover.slurm.client import CliSlurm
        self.completes(run, CliSlurm(slurm_conf=str(slurm_cluster.slurm_conf)))
        assert run.final()["steps"] == self.steps
        assert (run.workdir / "model.pt").exists(), code_after_ran
        return run

    def drain_moves_rank_1(self, run: Run, reference: Run, slurm_client,
                           leaver_leaves: bool = False) -> tuple[dict, float]:
        """A drain of rank 1's node, once a standby is warm, moves rank 1 to it; the job (JOB_USER's,
        no process of it root's) completes after exactly that one migration, well before its end,
        and equals the reference. `leaver_leaves`: also wait for the leaver's node to leave the
        job before its end. Returns the migration and the seconds from the drain to the move."""
        self.standby_ready(run)
        assert_runs_as_user(run.job_id, run.env)  # JOB_USER's job, no process of it root's
        leaver = run.metrics()[-1]["nodes"][1]  # rank 1: never the batch host
        commands.run(["scontrol", "update", f"nodename={leaver}", "state=drain", f"reason={self.drain_reason}"],
                     timeout=10, env=run.env)
        t0 = time.monotonic()
        wait_for("rank 1 on the standby", lambda: run.metrics()[-1]["nodes"][1] != leaver, timeout=30, interval=0.1)
        moved_after = time.monotonic() - t0
        if leaver_leaves:
            wait_for(f"{leaver} out of the job", lambda: leaver not in slurm_client.job(run.job_id).nodes, timeout=60)
        self.completes(run, slurm_client)
        (m,) = run.status()["migrations"]
        assert (m["leaver"], m["trigger"], m["state"]) == (leaver, "drain", "done"), m
        assert m["switch_step"] < self.steps - 10
        self.assert_same(run, reference)
        return m, moved_after

    def recovered_from_snapshot(self, run: Run, reference: Run, slurm_client) -> dict:
        """`run`, whose rank 1 is SIGKILLed at step 130, completes after one recovery from the
        snapshot tier at step 120 and equals the reference (but the losses the kill lost)."""
        self.completes(run, slurm_client)
        (m,) = recoveries(run)
        src = m["state_source"]
        assert m["state"] == "done" and src["tier"] == "snapshot" and src["step"] == 120, src
        self.assert_same(run, reference, *may_miss(m))
        return m

    def differs_without_optimizer_state(self, run: Run, reference: Run, slurm_client) -> dict:
        """The negative control: `run` leaves the optimizer state out of the copy; moved by
        `trainmover migrate` once a standby is warm, it equals the reference up to the switch,
        differs after it and ends with another digest."""
        self.standby_ready(run)
        ok = run.cli("migrate", "--job", str(run.job_id), "--node", run.metrics()[-1]["nodes"][1])
        assert ok.returncode == 0, ok.stdout + ok.stderr
        self.completes(run, slurm_client)
        (m,) = run.status()["migrations"]
        assert m["state"] == "done"
        ref, got = losses(reference), losses(run)
        assert all(got[s] == ref[s] for s in range(1, m["switch_step"] + 1)), "identical before the switch"
        assert any(got[s] != ref[s] for s in range(m["switch_step"] + 1, self.steps + 1)), "diverges after it"
        assert run.final()["digest"] != reference.final()["digest"]
        return m


def assert_same_model(run: Run, reference: Run) -> None:
    """The model the script saved after its training (model.pt in its submit directory) equals the reference's."""
    import torch
    mine, theirs = torch.load(run.workdir / "model.pt"), torch.load(reference.workdir / "model.pt")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
