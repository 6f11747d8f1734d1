"""slurm/job_env.py: every SLURM_* variable read in one place, with one rule for a missing or
malformed value (issue 39: "one job-environment object reads SLURM_*")."""
from __future__ import annotations

import pytest

from trainmover.errors import ConfigError
from trainmover.slurm.job_env import JobEnv


def test_a_steps_environment_is_read_whole():
    env = {"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n3", "SLURM_JOB_NODELIST": "keep1,n[1-3]",
           "SLURM_JOB_PARTITION": "train", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_RESTART_COUNT": "2"}
    here = JobEnv.read(env)
    assert here == JobEnv(42, "n3", "keep1,n[1-3]", "train", 5, 8, 1, 2)
    assert here.in_job and here.require_job("x") == 42
    assert here.allocation() == ("keep1", "n1", "n2", "n3")


def test_outside_a_job_nothing_is_made_up_and_who_needs_a_job_says_so():
    here = JobEnv.read({})
    assert here == JobEnv() and not here.in_job and here.allocation() == () and here.local_id == 0
    with pytest.raises(ConfigError, match=r"trainmover controller runs inside a Slurm job \(SLURM_JOB_ID is not set\)"):
        here.require_job("trainmover controller")


@pytest.mark.parametrize("name", ["SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_RESTART_COUNT"])
def test_a_malformed_number_is_a_clear_error_naming_the_variable(name):
    with pytest.raises(ConfigError, match=f"{name}='x1' is not a number"):
        JobEnv.read({name: "x1"})
    assert JobEnv.read({name: "7"})  # the control: a number is read


def test_the_trainer_and_the_keeper_read_through_it():
    """The baseline trainer's rank and world, the keeper's first look at its allocation."""
    from trainmover.baseline.trainer import TrainerConfig
    from trainmover.controller.succession.keeper import start_reading
    cfg = TrainerConfig.parse(["--run-dir", "/tmp/x", "--addr", "127.0.0.1"],
                              {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "9"})
    assert (cfg.rank, cfg.world, cfg.generation) == (1, 2, "9.0")
    with pytest.raises(ConfigError, match="give --rank and --world"):
        TrainerConfig.parse(["--run-dir", "/tmp/x", "--addr", "127.0.0.1"], {})

    class Slurm:
        def nodes(self, names):
            return {n: None for n in names}
    job, infos = start_reading(Slurm(), 9, "keep1", {"SLURM_JOB_NODELIST": "keep1,n[1-2]",
                                                    "SLURM_JOB_PARTITION": "p"}, "/w")
    assert job.nodes == ("keep1", "n1", "n2") and job.partition == "p" and set(infos) == set(job.nodes)
