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
    code, out, err = submit(["--nodes=4", "job.sbatch"], run=run)
    assert (code, out) == (0, "Submitted batch job 7\n") and err.startswith("trainmover: this job's standby mode: ")
    assert calls[:2] == [["sbatch", "--test-only", "--nodes=4", "job.sbatch"], ["sbatch", "--nodes=4", "job.sbatch"]]
    assert [c[:3] for c in calls[2:]] == [["scontrol", "show", "config"], ["scontrol", "-o", "show"]]


CONFIG = "SchedulerParameters     = permit_job_expansion,batch_sched_delay=0\nSLURM_VERSION           = {v}\n"


def _mode(version="24.11.5", params=True, resv=RESV, fix="off", conf_code=0):
    config = CONFIG.format(v=version) if params else f"SchedulerParameters = batch_sched_delay=0\nSLURM_VERSION = {version}\n"
    run, _ = _fake({"scontrol show": (conf_code, config, "slurm_load_ctl_conf error: Unable to contact slurm controller"),
                    "scontrol -o": (0, resv, "")})
    return submit(["job.sbatch"], run=run, fix_setting=fix)[2].strip()


def test_a_submitted_job_is_told_which_standby_mode_it_will_get():
    line = _mode()
    assert line.startswith("trainmover: this job's standby mode: reservation-grow (standbys are taken from "
                           "reservation trainmover_standby, if it admits this job's user (checked when the job starts)")
    crash = _mode("25.11.7")
    assert crash.startswith("trainmover: this job's standby mode: none (Slurm 25.11.7: slurmctld crashes (SIGSEGV")
    assert "TM_INJOB_STANDBYS=N" in crash
    assert "mode: none (SchedulerParameters lacks permit_job_expansion" in _mode(params=False)
    assert "mode: none (reservation trainmover_standby not found" in _mode(resv="")
    # a job that brings standbys (TM_INJOB_STANDBYS=2) on the same clusters: in-job where grow is not possible
    def brought(version="24.11.5", params=True):
        config = CONFIG.format(v=version) if params else f"SchedulerParameters = x\nSLURM_VERSION = {version}\n"
        run, _ = _fake({"scontrol show": (0, config, ""), "scontrol -o": (0, RESV, "")})
        return submit(["job.sbatch"], run=run, fix_setting="off", in_job=2)[2].strip()
    assert brought("25.11.7").startswith("trainmover: this job's standby mode: in-job (Slurm 25.11.7: slurmctld crashes")
    assert "mode: in-job (SchedulerParameters lacks permit_job_expansion" in brought(params=False)
    assert "keeps its 2 standby(s) in its own allocation" in brought(params=False)
    assert "mode: reservation-grow" in brought()  # control: grow possible, so the pool is refilled from there
    assert _mode(conf_code=1) == ("trainmover: standby mode not known: scontrol show config: "
                                  "slurm_load_ctl_conf error: Unable to contact slurm controller")


def test_the_admins_declaration_beside_slurm_conf_is_read_for_submit(tmp_path, monkeypatch):
    import os

    from trainmover.slurm import expansion_fix
    real_read = expansion_fix.read
    monkeypatch.setattr(expansion_fix, "read", lambda path: real_read(path, owners=(os.geteuid(),)))
    os.chmod(tmp_path, 0o755)
    (tmp_path / expansion_fix.FILE_NAME).write_text("25.11.7\n")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    assert "mode: reservation-grow" in _mode("25.11.7", fix="auto")
    assert "mode: none" in _mode("25.11.7", fix="off")   # the control: the same cluster, not read
