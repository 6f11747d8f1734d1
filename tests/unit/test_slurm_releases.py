"""Output of Slurm 24.11 and 26.05 read by the same parsers as 22.05's
(tests/unit/test_slurm_parse.py): recorded from the embedded cluster on each release
(`trainmover cluster up --slurm 24.11|26.05`: Debian 13 and unstable root filesystems)
with a 2-node job grown by one spare (salloc --dependency=expand + merge) and train2
drained. To re-record: run the command named above a recording against such a cluster.
No Slurm here; tests/e2e/test_slurm_contract.py runs the real thing on each release.
"""

from __future__ import annotations

import pytest

from trainmover.slurm import parse


# salloc --no-shell --dependency=expand:J ... --nodes=1 --immediate=5   (Slurm 24.11)
SALLOC_2411 = (
    'salloc: Granted job allocation 24110003\n'
    'salloc: Nodes spare1 are ready for job\n'
)

# the same asking for 2 nodes with none free, --immediate=2
SALLOC_FAIL_2411 = (
    'salloc: Pending job allocation 24110004\n'
    'salloc: job 24110004 queued and waiting for resources\n'
    'salloc: error: Unable to allocate resources: Connection timed out\n'
)

# scontrol -o show node train2,spare1,spare2
NODES_2411 = (
    'NodeName=train2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=4 CPUEfctv=4 CPUTot=4 CPULoad=6.71 '
    'AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.1.12 NodeHostName=train2 '
    'Port=16950 Version=24.11.5 OS=Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=2048 '
    'AllocMem=0 FreeMem=13878 Sockets=4 Boards=1 State=ALLOCATED+DRAIN ThreadsPerCore=1 TmpDisk=0 '
    'Weight=1 Owner=N/A MCS_label=N/A Partitions=train  BootTime=2026-11-24T08:34:25 '
    'SlurmdStartTime=2026-11-24T10:01:44 LastBusyTime=2026-11-24T10:01:44 ResumeAfterTime=None '
    'CfgTRES=cpu=4,mem=2G,billing=4 AllocTRES=cpu=4 CurrentWatts=0 AveWatts=0  Reason=tm-e2e rec [x] '
    '[root@2026-11-24T10:01:54]\n'
    'NodeName=spare1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=4 CPUEfctv=4 CPUTot=4 CPULoad=6.71 '
    'AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.1.15 NodeHostName=spare1 '
    'Port=16953 Version=24.11.5 OS=Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=2048 '
    'AllocMem=0 FreeMem=13874 Sockets=4 Boards=1 State=ALLOCATED+RESERVED ThreadsPerCore=1 TmpDisk=0 '
    'Weight=100 Owner=N/A MCS_label=N/A Partitions=train  BootTime=2026-11-24T08:34:24 '
    'SlurmdStartTime=2026-11-24T10:01:44 LastBusyTime=2026-11-24T10:01:54 ResumeAfterTime=None '
    'CfgTRES=cpu=4,mem=2G,billing=4 AllocTRES=cpu=4 CurrentWatts=0 AveWatts=0  '
    'ReservationName=trainmover_standby\n'
    'NodeName=spare2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=6.76 '
    'AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.1.16 NodeHostName=spare2 '
    'Port=16954 Version=24.11.5 OS=Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=2048 '
    'AllocMem=0 FreeMem=13874 Sockets=4 Boards=1 State=IDLE+RESERVED ThreadsPerCore=1 TmpDisk=0 '
    'Weight=100 Owner=N/A MCS_label=N/A Partitions=train  BootTime=2026-11-24T08:34:24 '
    'SlurmdStartTime=2026-11-24T10:01:44 LastBusyTime=2026-11-24T10:01:44 ResumeAfterTime=None '
    'CfgTRES=cpu=4,mem=2G,billing=4 AllocTRES= CurrentWatts=0 AveWatts=0  Reason=Not responding '
    '[root@2026-11-24T09:46:35] ReservationName=trainmover_standby\n'
)

# scontrol -o show job J
JOB_2411 = (
    'JobId=24110002 JobName=tm-e2e-rec UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 Nice=0 '
    'Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 '
    'BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:01 TimeLimit=UNLIMITED TimeMin=N/A '
    'SubmitTime=2026-11-24T10:01:53 EligibleTime=2026-11-24T10:01:53 AccrueTime=2026-11-24T10:01:53 '
    'ResizeTime=2026-11-24T10:01:54 StartTime=2026-11-24T10:01:53 EndTime=Unknown Deadline=N/A '
    'SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-24T10:01:53 Scheduler=Main Partition=train '
    'AllocNode:Sid=localhost:3198 ReqNodeList=(null) ExcNodeList=(null) NodeList=spare1,train[1-2] '
    'BatchHost=train1 NumNodes=3 NumCPUs=12 NumTasks=3 CPUs/Task=1 ReqB:S:C:T=0:0:*:* '
    'ReqTRES=cpu=12,node=3,billing=12 AllocTRES=cpu=12,node=3,billing=12 Socks/Node=* '
    'NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) '
    'DelayBoot=00:00:00 OverSubscribe=NO Contiguous=0 Licenses=(null) Network=(null) Command=(null) '
    'WorkDir=/tmp StdErr=/tmp/slurm-24110002.out StdIn=/dev/null StdOut=/tmp/slurm-24110002.out \n'
)

# scontrol -o show reservation trainmover_standby
RESV_2411 = (
    'ReservationName=trainmover_standby StartTime=2026-11-24T09:27:40 EndTime=2027-11-24T09:27:40 '
    'Duration=365-00:00:00 Nodes=spare[1-2] NodeCnt=2 CoreCnt=8 Features=(null) PartitionName=(null) '
    'Flags=IGNORE_JOBS,SPEC_NODES TRES=cpu=8 Users=root Groups=(null) Accounts=(null) Licenses=(null) '
    'State=ACTIVE BurstBuffer=(null) MaxStartDelay=(null)\n'
)


# salloc --no-shell --dependency=expand:J ... --nodes=1 --immediate=5   (Slurm 26.05)
SALLOC_2605 = (
    'salloc: Granted job allocation 26050026\n'
    'salloc: Nodes spare1 are ready for job\n'
)

# the same asking for 2 nodes with none free, --immediate=2
SALLOC_FAIL_2605 = (
    'salloc: Pending job allocation 26050027\n'
    'salloc: job 26050027 queued and waiting for resources\n'
    'salloc: error: Unable to allocate resources: Connection timed out\n'
)

# scontrol -o show node train2,spare1,spare2
NODES_2605 = (
    'NodeName=train2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=4 CPUEfctv=4 CPUTot=4 CPULoad=6.67 '
    'AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.1.12 NodeHostName=train2 '
    'Port=16920 Version=26.05.5 OS=Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=2048 '
    'AllocMem=0 FreeMem=14304 Sockets=4 Boards=1 State=ALLOCATED+DRAIN ThreadsPerCore=1 TmpDisk=0 '
    'Weight=1 Owner=N/A MCS_label=N/A Partitions=train  BootTime=2026-11-24T08:34:25 '
    'SlurmdStartTime=2026-11-24T10:00:23 LastBusyTime=2026-11-24T10:00:26 ResumeAfterTime=None '
    'SuspendTime=INFINITE CfgTRES=cpu=4,mem=2G,billing=4 AllocTRES=cpu=4 CurrentWatts=0 AveWatts=0 '
    'Reason=tm-e2e rec [x] [root@2026-11-24T10:01:57]\n'
    'NodeName=spare1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=4 CPUEfctv=4 CPUTot=4 CPULoad=6.67 '
    'AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.1.15 NodeHostName=spare1 '
    'Port=16923 Version=26.05.5 OS=Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=2048 '
    'AllocMem=0 FreeMem=14304 Sockets=4 Boards=1 State=ALLOCATED+RESERVED ThreadsPerCore=1 TmpDisk=0 '
    'Weight=100 Owner=N/A MCS_label=N/A Partitions=train  BootTime=2026-11-24T08:34:24 '
    'SlurmdStartTime=2026-11-24T10:00:23 LastBusyTime=2026-11-24T10:01:57 ResumeAfterTime=None '
    'SuspendTime=INFINITE CfgTRES=cpu=4,mem=2G,billing=4 AllocTRES=cpu=4 CurrentWatts=0 AveWatts=0 '
    'ReservationName=trainmover_standby\n'
    'NodeName=spare2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=6.67 '
    'AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.1.16 NodeHostName=spare2 '
    'Port=16924 Version=26.05.5 OS=Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=2048 '
    'AllocMem=0 FreeMem=14304 Sockets=4 Boards=1 State=IDLE+RESERVED ThreadsPerCore=1 TmpDisk=0 '
    'Weight=100 Owner=N/A MCS_label=N/A Partitions=train  BootTime=2026-11-24T08:34:24 '
    'SlurmdStartTime=2026-11-24T10:00:23 LastBusyTime=2026-11-24T10:00:23 ResumeAfterTime=None '
    'SuspendTime=INFINITE CfgTRES=cpu=4,mem=2G,billing=4 AllocTRES= CurrentWatts=0 AveWatts=0 '
    'ReservationName=trainmover_standby\n'
)

# scontrol -o show job J
JOB_2605 = (
    'JobId=26050025 JobName=tm-e2e-rec UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 Nice=0 '
    'Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 '
    'BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A '
    'SubmitTime=2026-11-24T10:01:56 EligibleTime=2026-11-24T10:01:56 AccrueTime=2026-11-24T10:01:56 '
    'ResizeTime=2026-11-24T10:01:57 StartTime=2026-11-24T10:01:57 EndTime=Unknown Deadline=N/A '
    'SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-24T10:01:57 Scheduler=Main Partition=train '
    'AllocNode:Sid=localhost:3198 ReqNodeList=(null) ExcNodeList=(null) NodeList=spare1,train[1-2] '
    'BatchHost=train1 NumNodes=3 NumCPUs=12 NumTasks=3 CPUs/Task=1 ReqB:S:C:T=0:0:*:* '
    'ReqTRES=cpu=12,node=3,billing=12 AllocTRES=cpu=12,node=3,billing=12 Socks/Node=* '
    'NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) '
    'DelayBoot=00:00:00 OverSubscribe=NO Exclusive=NODE Contiguous=0 Licenses=(null) '
    'LicensesAlloc=(null) Network=(null) Command=(null) SubmitLine=/usr/bin/sbatch --parsable -N2 '
    '--job-name=tm-e2e-rec --chdir=/tmp --wrap sleep 60 WorkDir=/tmp StdErr= StdIn=/dev/null '
    'StdOut=/tmp/slurm-26050025.out\n'
)

# scontrol -o show reservation trainmover_standby
RESV_2605 = (
    'ReservationName=trainmover_standby StartTime=2026-11-24T09:28:20 EndTime=2027-11-24T09:28:20 '
    'Duration=365-00:00:00 Nodes=spare[1-2] NodeCnt=2 CoreCnt=8 Features=(null) PartitionName=(null) '
    'Flags=IGNORE_JOBS,SPEC_NODES TRES=cpu=8 AllowedPartitions=(null) QOS=(null) Users=root '
    'Groups=(null) Accounts=(null) Licenses=(null) State=ACTIVE BurstBuffer=(null) MaxStartDelay=(null)\n'
)

RELEASES = {
    "24.11": dict(salloc=SALLOC_2411, salloc_fail=SALLOC_FAIL_2411, nodes=NODES_2411, job=JOB_2411, resv=RESV_2411,
                  job_id=24110002, donor=24110003),
    "26.05": dict(salloc=SALLOC_2605, salloc_fail=SALLOC_FAIL_2605, nodes=NODES_2605, job=JOB_2605, resv=RESV_2605,
                  job_id=26050025, donor=26050026),
}


@pytest.fixture(params=sorted(RELEASES))
def rec(request):
    return {"version": request.param, **RELEASES[request.param]}


def test_nodes(rec):
    nodes = parse.parse_nodes_text(rec["nodes"])
    assert list(nodes) == ["train2", "spare1", "spare2"]
    assert nodes["train2"].state == "ALLOCATED+DRAIN" and nodes["train2"].draining
    assert nodes["train2"].reason == "tm-e2e rec [x]"  # Slurm's [user@time] stamp removed, the reason's own kept
    assert nodes["train2"].addr == "127.0.1.12"
    assert nodes["spare1"].busy and nodes["spare1"].reserved and not nodes["spare1"].idle
    assert nodes["spare2"].idle and nodes["spare2"].reserved


def test_grown_job(rec):
    job = parse.parse_job_text(rec["job"])
    assert job.job_id == rec["job_id"] and job.running and job.restart_count == 0
    assert job.nodes == ("spare1", "train1", "train2") and job.nodelist == "spare1,train[1-2]"
    assert job.batch_host == "train1" and job.num_nodes == 3 and job.partition == "train"
    assert job.work_dir == "/tmp" and job.name == "tm-e2e-rec"


def test_reservation(rec):
    r = parse.parse_reservation_text(rec["resv"])["trainmover_standby"]
    assert r["Nodes"] == "spare[1-2]" and r["Flags"] == "IGNORE_JOBS,SPEC_NODES" and r["Users"] == "root"


def test_salloc(rec):
    assert parse.salloc_granted(rec["salloc"]) and parse.parse_salloc_job_id(rec["salloc"]) == rec["donor"]
    assert not parse.salloc_granted(rec["salloc_fail"])
    assert parse.parse_salloc_job_id(rec["salloc_fail"]) == rec["donor"] + 1  # withdrawn: CliSlurm cancels it
    assert "Unable to allocate resources: Connection timed out" in rec["salloc_fail"]  # -> NoStandbyAvailable


# --- a cluster whose Slurm lives in a root filesystem: commands.run's exec prefix -------------

def _exec_file(tmp_path, prefix, root_id):
    import json
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\n")
    (tmp_path / "slurm-exec.json").write_text(json.dumps({"slurm": "24.11.5", "prefix": prefix, "root_id": root_id}))
    return {"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"}


def test_run_puts_the_exec_prefix_before_the_command(tmp_path):
    """Outside the root the prefix (here `env TM_X=inside`, standing in for unshare+chroot)
    runs the command; errors and counters name the command, not the prefix."""
    from trainmover.errors import SlurmError
    from trainmover.slurm import commands
    env = _exec_file(tmp_path, ["env", "TM_X=inside"], [0, 0])
    commands.reset_calls()
    assert commands.run(["printenv", "TM_X"], timeout=10, env=env).stdout == "inside\n"
    assert commands.calls() == {"printenv": 1}
    with pytest.raises(SlurmError, match=r"^false exited with status 1: false;"):
        commands.run(["false"], timeout=10, env=env)
    # an argv that already carries the prefix (CliSlurm.step_argv) is not prefixed twice
    assert commands.run(["env", "TM_X=inside", "printenv", "TM_X"], timeout=10, env=env).stdout == "inside\n"


def test_inside_the_root_there_is_no_prefix(tmp_path):
    """A process whose "/" is the root's top directory (a job step) runs the command itself."""
    import os
    from trainmover.slurm import commands
    st = os.stat("/")
    env = _exec_file(tmp_path, ["env", "TM_X=inside"], [st.st_dev, st.st_ino])
    assert commands.exec_prefix(env) == []
    assert commands.run(["printenv", "PATH"], timeout=10, env=env).stdout == "/usr/bin:/bin\n"


def test_step_argv_carries_the_prefix(tmp_path):
    from trainmover.slurm import CliSlurm
    env = _exec_file(tmp_path, ["env", "TM_X=inside"], [0, 0])
    argv = CliSlurm(slurm_conf=env["SLURM_CONF"]).step_argv(5, "spare1", ["hostname"])
    assert argv[:3] == ["env", "TM_X=inside", "srun"] and argv[-1] == "hostname"
    assert CliSlurm(slurm_conf=str(tmp_path / "other" / "slurm.conf")).step_argv(5, "spare1", ["hostname"])[0] == "srun"


def test_an_unreadable_exec_file_is_an_error(tmp_path):
    from trainmover.errors import SlurmError
    from trainmover.slurm import commands
    env = _exec_file(tmp_path, ["env"], [0, 0])
    (tmp_path / "slurm-exec.json").write_text("{not json")
    with pytest.raises(SlurmError, match="slurm-exec.json is unreadable"):
        commands.run(["true"], timeout=10, env=env)
