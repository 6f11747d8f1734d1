"""`trainmover submit`: a job Slurm could never start is refused at once, with the reason and
what the cluster has (the pure explanation; the Slurm calls intercepted)."""
from __future__ import annotations

import subprocess

from trainmover.slurm.submit import explain, submit

SINFO = "train 6\n"
RESV = ("ReservationName=trainmover_standby StartTime=2026-11-24T09:00:00 EndTime=2027-11-24T09:00:00 "
        "Duration=365-00:00:00 Nodes=spare[1-2] NodeCnt=2 CoreCnt=8 Features=(null) PartitionName=(null) "
        "Flags=IGNORE_JOBS,SPEC_NODES Users=root\n")


def test_a_job_that_needs_the_standbys_nodes_is_told_how_many_it_may_have():
    text = explain("allocation failure: Requested node configuration is not available\n", SINFO, RESV)
    assert text.splitlines() == [
        "Slurm says this job could never start here: allocation failure: Requested node configuration is not available",
        "partition train: 6 nodes (spare[1-2] held by reservation trainmover_standby, for standbys), so a job gets "
        "at most 4 training nodes: submit with --nodes=4 or fewer (TrainMover adds its standbys from the "
        "reservation itself)"]


def test_with_keeper_nodes_the_count_and_the_options_leave_them_out_of_training():
    text = explain("allocation failure: Requested node configuration is not available\n", "train 8\n", RESV, keepers=2)
    assert ("partition train: 8 nodes (spare[1-2] held by reservation trainmover_standby, for standbys), "
            "2 keeper node(s), so a job gets at most 4 training nodes: submit with --nodes=5 "
            "--constraint=[tm_keeper*1&tm_train*4] (its keeper node included) or fewer") in text


def test_a_gpu_request_on_a_cpu_cluster():
    text = explain("sbatch: error: Invalid generic resource (gres) specification", SINFO, RESV)
    assert "leave out --gpus-per-node on CPU nodes" in text and "--nodes=" not in text


def _fake(results):
    calls = []

    def run(argv, timeout, env=None, check=True):
        calls.append(argv)
        code, out, err = results.get(" ".join(argv[:2]), (0, "", ""))
        return subprocess.CompletedProcess(argv, code, out, err)
    return run, calls


def test_submits_only_what_slurm_could_place():
    run, calls = _fake({"sbatch --test-only": (1, "", "allocation failure: Requested node configuration is not "
                                                         "available"), "sinfo -h": (0, SINFO, ""),
                        "scontrol -o": (0, RESV, "")})
    code, out, err = submit(["--nodes=5", "job.sbatch"], run=run)
    assert code == 1 and out == "" and "at most 4 training nodes" in err
    assert [c[:2] for c in calls] == [["sbatch", "--test-only"], ["sinfo", "-h"], ["scontrol", "-o"], ["sinfo", "-h"]]
    run, calls = _fake({"sbatch --nodes=4": (0, "Submitted batch job 7\n", "")})
    assert submit(["--nodes=4", "job.sbatch"], run=run) == (0, "Submitted batch job 7\n", "")
    assert calls == [["sbatch", "--test-only", "--nodes=4", "job.sbatch"], ["sbatch", "--nodes=4", "job.sbatch"]]
