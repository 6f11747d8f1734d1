"""Parsing of Slurm 22.05 output and building of command lines, with recorded
outputs and an intercepted command runner: no Slurm, no processes.

The recorded lines below were taken from the embedded cluster
(`python -m trainmover.cluster up`, Slurm 22.05.8 on Debian 12). To re-record
one, run the command named above it against that cluster and paste its output.
"""

from __future__ import annotations

import subprocess

import pytest

from trainmover.errors import SlurmError
from trainmover.slurm import BatchHostRelease, CliSlurm, JobInfo, NodeInfo, NoStandbyAvailable, UnknownNodes
from trainmover.slurm import argv as build
from trainmover.slurm import commands, parse

# scontrol -o show node train1,train2,spare1   (train1 allocated and draining, train2 drained)
NODES_TEXT = (
    "NodeName=train1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=4 CPUEfctv=4 CPUTot=4 CPULoad=0.43 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.1.11 NodeHostName=train1 "
    "Port=16907 Version=22.05.8 OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=2048 "
    "AllocMem=0 FreeMem=22946 Sockets=4 Boards=1 State=ALLOCATED+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 "
    "Owner=N/A MCS_label=N/A Partitions=train  BootTime=2026-11-21T10:17:11 SlurmdStartTime=2026-11-21T10:29:55 "
    "LastBusyTime=2026-11-21T10:29:55 CfgTRES=cpu=4,mem=2G,billing=4 AllocTRES=cpu=4 CapWatts=n/a CurrentWatts=0 "
    "AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s Reason=xid 79 on gpu0 "
    "[root@2026-11-21T10:30:11]\n"
    "NodeName=train2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=0.26 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.1.12 NodeHostName=train2 "
    "Port=16902 Version=22.05.8 OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=2048 AllocMem=0 "
    "FreeMem=22447 Sockets=4 Boards=1 State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A "
    "MCS_label=N/A Partitions=train  BootTime=2026-11-21T10:17:11 SlurmdStartTime=2026-11-21T10:26:20 "
    "LastBusyTime=2026-11-21T10:27:50 CfgTRES=cpu=4,mem=2G,billing=4 AllocTRES= CapWatts=n/a CurrentWatts=0 "
    "AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s Reason=tm test [root@2026-11-21T10:27:50]\n"
    "NodeName=spare1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=0.21 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.1.15 NodeHostName=spare1 "
    "Port=16905 Version=22.05.8 OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=2048 AllocMem=0 "
    "FreeMem=22882 Sockets=4 Boards=1 State=IDLE+RESERVED ThreadsPerCore=1 TmpDisk=0 Weight=100 Owner=N/A "
    "MCS_label=N/A Partitions=train  BootTime=2026-11-21T10:17:11 SlurmdStartTime=2026-11-21T10:26:20 "
    "LastBusyTime=2026-11-21T10:26:20 CfgTRES=cpu=4,mem=2G,billing=4 AllocTRES= CapWatts=n/a CurrentWatts=0 "
    "AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s\n"
)

# scontrol -o show job 9   (a 2-node job grown by two spares)
JOB_TEXT = (
    "JobId=9 JobName=job2.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901750 Nice=0 "
    "Account=root QOS=normal JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
    "Reboot=0 ExitCode=0:0 RunTime=00:01:02 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-11-21T10:26:48 "
    "EligibleTime=2026-11-21T10:26:48 AccrueTime=2026-11-21T10:26:48 ResizeTime=2026-11-21T10:28:10 "
    "StartTime=2026-11-21T10:27:01 EndTime=Unknown Deadline=N/A SuspendTime=None SecsPreSuspend=0 "
    "LastSchedEval=2026-11-21T10:27:01 Scheduler=Main Partition=train AllocNode:Sid=localhost:2287 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=spare[1-2],train[3-4] BatchHost=train3 NumNodes=4 "
    "NumCPUs=16 NumTasks=4 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=16,node=4,billing=16 Socks/Node=* "
    "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) "
    "DelayBoot=00:00:00 OverSubscribe=NO Contiguous=0 Licenses=(null) Network=(null) Command=/tmp/jt/job2.sh "
    "WorkDir=/tmp/jt StdErr=/tmp/jt/out2.9 StdIn=/dev/null StdOut=/tmp/jt/out2.9 Power= \n"
)

# scontrol -o show job 19   (pending)
PENDING_TEXT = (
    "JobId=19 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901741 Nice=0 Account=root "
    "QOS=normal JobState=PENDING Reason=Resources Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 "
    "ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-11-21T10:30:10 "
    "EligibleTime=2026-11-21T10:30:10 AccrueTime=2026-11-21T10:30:10 StartTime=Unknown EndTime=Unknown "
    "Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-21T10:30:10 Scheduler=Main "
    "Partition=train AllocNode:Sid=localhost:2287 ReqNodeList=(null) ExcNodeList=(null) NodeList= NumNodes=4-4 "
    "NumCPUs=4 NumTasks=4 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=4,mem=8G,node=4,billing=4 Socks/Node=* "
    "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) "
    "DelayBoot=00:00:00 OverSubscribe=NO Contiguous=0 Licenses=(null) Network=(null) Command=(null) "
    "WorkDir=/tmp/jt StdErr=/tmp/jt/slurm-19.out StdIn=/dev/null StdOut=/tmp/jt/slurm-19.out Power= \n"
)

# scontrol -o show reservation
RESV_TEXT = (
    "ReservationName=trainmover_standby StartTime=2026-11-21T10:26:20 EndTime=2027-11-21T10:26:20 "
    "Duration=365-00:00:00 Nodes=spare[1-2] NodeCnt=2 CoreCnt=8 Features=(null) PartitionName=(null) "
    "Flags=IGNORE_JOBS,SPEC_NODES TRES=cpu=8 Users=root Groups=(null) Accounts=(null) Licenses=(null) "
    "State=ACTIVE BurstBuffer=(null) Watts=n/a MaxStartDelay=(null)\n"
)

# --- text parsing ---------------------------------------------------------------------

def test_parse_kv_keeps_values_with_spaces():
    kv = parse.parse_kv(NODES_TEXT.splitlines()[0])
    assert kv["OS"] == "Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0"
    assert kv["Reason"] == "xid 79 on gpu0 [root@2026-11-21T10:30:11]"
    assert kv["CfgTRES"] == "cpu=4,mem=2G,billing=4"
    kv = parse.parse_kv(JOB_TEXT)
    assert kv["ReqB:S:C:T"] == "0:0:*:*" and kv["CPUs/Task"] == "1" and kv["Power"] == ""


def test_parse_nodes_text():
    nodes = parse.parse_nodes_text(NODES_TEXT)
    assert list(nodes) == ["train1", "train2", "spare1"]
    t1, t2, s1 = nodes["train1"], nodes["train2"], nodes["spare1"]
    assert t1 == NodeInfo("train1", "127.0.1.11", "ALLOCATED+DRAIN", "xid 79 on gpu0")
    assert t1.draining and not t1.drained and t1.busy and not t1.idle
    assert t2.drained and not t2.draining and t2.reason == "tm test" and not t2.idle
    assert s1.idle and s1.reserved and not s1.drained and s1.flags == {"RESERVED"}


@pytest.mark.parametrize("state, draining, drained, down, idle", [
    ("IDLE", False, False, False, True),
    ("MIXED+DRAIN", True, False, False, False),
    ("COMPLETING+DRAIN", True, False, False, False),
    ("IDLE+DRAIN", False, True, False, False),
    ("DOWN+DRAIN", False, True, True, False),
    ("DOWN+NOT_RESPONDING", False, False, True, False),
    ("IDLE+NOT_RESPONDING", False, False, True, False),
    ("IDLE+RESERVED", False, False, False, True),
    # released from a job, its epilog still running: the scheduler will not place a job there yet
    ("IDLE+COMPLETING+RESERVED", False, False, False, False),
])
def test_node_state_properties(state, draining, drained, down, idle):
    n = NodeInfo("n", "127.0.0.1", state)
    assert (n.draining, n.drained, n.down, n.idle) == (draining, drained, down, idle)


def test_parse_job_text_running_resized():
    job = parse.parse_job_text(JOB_TEXT)
    assert job == JobInfo(
        job_id=9, state="RUNNING", nodes=("spare1", "spare2", "train3", "train4"), batch_host="train3",
        restart_count=0, work_dir="/tmp/jt", partition="train", num_nodes=4,
        nodelist="spare[1-2],train[3-4]", name="job2.sh", reason="", user_id=0,
    )
    assert job.running


def test_parse_job_text_pending_has_no_nodes():
    job = parse.parse_job_text(PENDING_TEXT)
    assert job.state == "PENDING" and job.nodes == () and job.batch_host == "" and job.num_nodes == 4
    assert job.reason == "Resources"


def test_parse_job_text_rejects_garbage():
    with pytest.raises(SlurmError, match="no job"):
        parse.parse_job_text("slurm_load_jobs error: Invalid job id specified\n")


def test_parse_reservation_text():
    r = parse.parse_reservation_text(RESV_TEXT)["trainmover_standby"]
    assert r["Nodes"] == "spare[1-2]" and r["Flags"] == "IGNORE_JOBS,SPEC_NODES" and r["Users"] == "root"


# --- hostlists and salloc -------------------------------------------------------------------

@pytest.mark.parametrize("expr, names", [
    ("train1", ["train1"]),
    ("train[1-3]", ["train1", "train2", "train3"]),
    ("spare1,train[1-2]", ["spare1", "train1", "train2"]),
    ("train[1,3-4]", ["train1", "train3", "train4"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
    ("", []),
    ("(null)", []),
])
def test_expand_hostlist(expr, names):
    assert parse.expand_hostlist(expr) == names


@pytest.mark.parametrize("bad", ["train[1-2", "train1-2]", "train[a-b]"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(SlurmError):
        parse.expand_hostlist(bad)


def test_parse_salloc_job_id():
    assert parse.parse_salloc_job_id("salloc: Granted job allocation 8\n") == 8
    pending = ("salloc: Pending job allocation 14\nsalloc: job 14 queued and waiting for resources\n"
               "salloc: error: Unable to allocate resources: Connection timed out\n")
    assert parse.parse_salloc_job_id(pending) == 14 and not parse.salloc_granted(pending)
    assert parse.parse_salloc_job_id("salloc: error: Invalid partition name specified") is None


# --- command building -------------------------------------------------------------------------

def test_donor_salloc_argv():
    assert build.donor_salloc(9, partition="train", reservation="trainmover_standby", timeout=2.5) == [
        "salloc", "--no-shell", "--dependency=expand:9", "--partition=train", "--reservation=trainmover_standby",
        "--nodes=1", "--exclusive", "--job-name=trainmover-donor-9", "--immediate=3",
    ]


def test_update_argvs():
    assert build.merge_donor(10) == ["scontrol", "--local", "update", "JobId=10", "NumNodes=0"]
    assert build.absorb(9) == ["scontrol", "--local", "update", "JobId=9", "NumNodes=ALL"]
    assert build.set_nodelist(9, ["train3", "spare1"]) == ["scontrol", "--local", "update", "JobId=9", "NodeList=train3,spare1"]
    assert build.drain("train2", "xid 79, gpu 0") == [
        "scontrol", "update", "NodeName=train2", "State=DRAIN", "Reason=xid 79, gpu 0"]
    assert build.resume("train2") == ["scontrol", "update", "NodeName=train2", "State=RESUME"]
    assert build.show_nodes(["a", "b"]) == ["scontrol", "-o", "show", "node", "a,b"]
    with pytest.raises(ValueError):
        build.drain("train2", " ")


def test_step_argv():
    argv = build.step(9, "spare1", ["python", "-m", "w"], ntasks=2, env_overrides={"A": "1,2", "B_C": "x y"})
    assert argv == ["srun", "--jobid=9", "--overlap", "--nodes=1", "--ntasks=2", "--nodelist=spare1",
                    "env", "A=1,2", "B_C=x y", "python", "-m", "w"]
    assert build.step(9, "spare1", ["hostname"])[-2:] == ["--nodelist=spare1", "hostname"]
    with pytest.raises(ValueError):
        build.step(9, "spare1", ["x"], env_overrides={"BAD-NAME": "1"})
    with pytest.raises(ValueError):
        build.step(9, "spare1", ["x"], ntasks=0)


def test_step_env_replaces_stale_allocation_vars():
    job = parse.parse_job_text(JOB_TEXT)
    batch_env = {"SLURM_JOB_NODELIST": "train[3-4]", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
                 "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "9",
                 "SLURM_CPUS_PER_TASK": "2", "HOME": "/root"}
    env = build.step_env(job, batch_env)
    assert env["SLURM_JOB_NODELIST"] == env["SLURM_NODELIST"] == "spare[1-2],train[3-4]"
    assert env["SLURM_NNODES"] == env["SLURM_JOB_NUM_NODES"] == "4"
    assert "SLURM_TASKS_PER_NODE" not in env and "SLURM_NTASKS_PER_NODE" not in env
    assert env["SLURM_JOB_ID"] == "9" and env["SLURM_CPUS_PER_TASK"] == "2" and env["HOME"] == "/root"
    assert batch_env["SLURM_NNODES"] == "2"  # the input is not modified


# --- the choke point -----------------------------------------------------------------------------

class FakeSlurm:
    """A scripted command runner: (argv prefix, (rc, stdout, stderr)) rules, first match wins."""

    def __init__(self, rules):
        self.rules = list(rules)
        self.seen: list[list[str]] = []
        self.envs: list[dict] = []

    def __call__(self, argv, timeout, env):
        self.seen.append(argv)
        self.envs.append(env)
        for prefix, result in self.rules:
            if argv[: len(prefix)] == prefix:
                if isinstance(result, BaseException):
                    raise result
                if callable(result):
                    result = result()
                rc, out, err = result
                return subprocess.CompletedProcess(argv, rc, out, err)
        raise AssertionError(f"unexpected command {argv}")


@pytest.fixture
def fake():
    def install(*rules):
        f = FakeSlurm(rules)
        ctx = commands.intercept(f)
        ctx.__enter__()
        installed.append(ctx)
        return f

    installed = []
    commands.reset_calls()
    yield install
    for ctx in reversed(installed):  # undo in reverse, so the runner before the first one is back
        ctx.__exit__(None, None, None)


def test_run_counts_calls_and_reports_failures(fake):
    fake((["scontrol", "ping"], (0, "UP", "")),
         (["scontrol", "--local", "-o", "show", "job"], (1, "", "slurm_load_jobs error: Invalid job id specified")))
    commands.run(["scontrol", "ping"], timeout=5)
    with pytest.raises(SlurmError) as ei:
        commands.run(["scontrol", "--local", "-o", "show", "job", "7"], timeout=5)
    msg = str(ei.value)
    assert "scontrol exited with status 1" in msg and "Invalid job id specified" in msg and "show job 7" in msg
    assert commands.run(["scontrol", "--local", "-o", "show", "job", "7"], timeout=5, check=False).returncode == 1
    assert commands.calls() == {"scontrol": 3}


def test_run_turns_timeouts_into_slurm_error(fake):
    fake((["sinfo"], subprocess.TimeoutExpired(["sinfo"], 2.0, stderr=b"sinfo: error: slurm_receive_msg")))
    with pytest.raises(SlurmError, match=r"sinfo timed out after 2s.*slurm_receive_msg"):
        commands.run(["sinfo"], timeout=2.0)


def test_run_needs_a_positive_timeout():
    with pytest.raises(ValueError):
        commands.run(["sinfo"], timeout=0)


def test_run_passes_slurm_conf_through(fake, monkeypatch):
    f = fake((["sinfo"], (0, "", "")))
    monkeypatch.setenv("SLURM_CONF", "/x/slurm.conf")
    commands.run(["sinfo"], timeout=1, env={"FOO": "1"})
    assert f.envs[-1]["SLURM_CONF"] == "/x/slurm.conf" and f.envs[-1]["FOO"] == "1"
    commands.run(["sinfo"], timeout=1, env={"SLURM_CONF": "/y.conf"})
    assert f.envs[-1]["SLURM_CONF"] == "/y.conf"


# --- CliSlurm against scripted outputs ------------------------------------------------------------

def _job_line(nodelist: str, num: int, job_id: int = 9, batch: str = "train3") -> str:
    return (JOB_TEXT.replace("NodeList=spare[1-2],train[3-4]", f"NodeList={nodelist}")
            .replace("NumNodes=4", f"NumNodes={num}").replace("JobId=9", f"JobId={job_id}")
            .replace("BatchHost=train3", f"BatchHost={batch}"))


def _spares(state1: str = "IDLE+RESERVED", state2: str = "ALLOCATED+RESERVED") -> str:
    line = NODES_TEXT.splitlines()[2]
    return (line.replace("IDLE+RESERVED", state1) + "\n"
            + line.replace("spare1", "spare2").replace("IDLE+RESERVED", state2) + "\n")


def test_grow_merges_one_donor(fake):
    jobs = iter([_job_line("train[3-4]", 2), _job_line("spare1,train[3-4]", 3)])
    f = fake(
        (["scontrol", "--local", "-o", "show", "job", "9"], lambda: (0, next(jobs), "")),
        (["salloc"], (0, "", "salloc: Granted job allocation 10\n")),
        (["scontrol", "--local", "-o", "show", "job", "10"], (0, _job_line("spare1", 1, job_id=10, batch="spare1"), "")),
        (["scontrol", "--local", "update"], (0, "", "")),
    )
    assert CliSlurm().grow(9, reservation="trainmover_standby", timeout=5) == "spare1"
    assert ["scontrol", "--local", "update", "JobId=10", "NumNodes=0"] in f.seen
    assert ["scontrol", "--local", "update", "JobId=9", "NumNodes=ALL"] in f.seen
    assert [a for a in f.seen if a[0] == "salloc"][0][3] == "--partition=train"  # the job's own partition


def test_grow_given_the_partition_asks_only_salloc_the_merge_and_its_check(fake):
    """Each query is a token of the user's rate-limit bucket: a caller that knows the job's
    partition spares the first read, and salloc's 'Nodes spare1 are ready' the donor's."""
    f = fake(
        (["scontrol", "--local", "-o", "show", "job", "9"], (0, _job_line("spare1,train[3-4]", 3), "")),
        (["salloc"], (0, "", "salloc: Granted job allocation 10\nsalloc: Nodes spare1 are ready for job\n")),
        (["scontrol", "--local", "update"], (0, "", "")),
    )
    assert CliSlurm().grow(9, reservation="trainmover_standby", partition="train", timeout=5) == "spare1"
    assert [a[0] for a in f.seen] == ["salloc", "scontrol", "scontrol", "scontrol"]
    assert not any(a[-1] == "10" and "show" in a for a in f.seen)
    assert parse.salloc_ready_node("salloc: Nodes spare[1-2] are ready for job\n") is None  # a list: ask Slurm
    assert parse.salloc_ready_node("salloc: Granted job allocation 10\n") is None


def test_grow_without_free_standby_withdraws_the_donor(fake):
    f = fake(
        (["scontrol", "--local", "-o", "show", "job", "9"], (0, _job_line("train[3-4]", 2), "")),
        (["salloc"], (1, "", "salloc: Pending job allocation 14\nsalloc: job 14 queued and waiting for resources\n"
                             "salloc: error: Unable to allocate resources: Connection timed out\n")),
        (["squeue"], (0, "14\n", "")),
        (["scancel"], (0, "", "")),
        (["scontrol", "-o", "show", "reservation"], (0, RESV_TEXT, "")),
        (["scontrol", "-o", "show", "node", "spare1,spare2"], (0, _spares("ALLOCATED+RESERVED"), "")),
    )
    # the message says what each reserved node was doing
    with pytest.raises(NoStandbyAvailable, match="no free standby node in reservation trainmover_standby.*"
                       "reserved nodes now: spare1 ALLOCATED\\+RESERVED, spare2 ALLOCATED\\+RESERVED"):
        CliSlurm().grow(9, reservation="trainmover_standby", timeout=3)
    assert ["squeue", "--local", "-h", "--me", "--name=trainmover-donor-9", "-o", "%i"] in f.seen
    assert ["scancel", "14"] in f.seen
    assert not any(a[:3] == ["scontrol", "--local", "update"] for a in f.seen)


def test_grow_asks_again_while_its_deadline_lasts(fake):
    """A donor request that found no node free stays pending until slurmctld's next full
    scheduling pass; grow() withdraws it after DONOR_TRY_S and asks again, within its deadline."""
    timed_out = (1, "", "salloc: Pending job allocation 14\n"
                        "salloc: error: Unable to allocate resources: Connection timed out\n")
    sallocs = iter([timed_out, timed_out, (0, "", "salloc: Granted job allocation 16\n")])
    jobs = iter([_job_line("train[3-4]", 2), _job_line("spare1,train[3-4]", 3)])
    now = [100.0]

    def salloc():
        now[0] += 2.0  # each timed-out request took its 2 s
        return next(sallocs)
    f = fake(
        (["scontrol", "--local", "-o", "show", "job", "9"], lambda: (0, next(jobs), "")),
        (["salloc"], salloc),
        (["squeue"], (0, "14\n", "")),
        (["scancel"], (0, "", "")),
        (["scontrol", "--local", "-o", "show", "job", "16"], (0, _job_line("spare1", 1, job_id=16, batch="spare1"), "")),
        (["scontrol", "--local", "update"], (0, "", "")),
    )
    assert CliSlurm(clock=lambda: now[0]).grow(9, reservation="trainmover_standby", timeout=10) == "spare1"
    tries = [a for a in f.seen if a[0] == "salloc"]
    assert len(tries) == 3 and all("--immediate=2" in a for a in tries)
    assert ["scontrol", "--local", "update", "JobId=16", "NumNodes=0"] in f.seen


def test_grow_other_salloc_failures_are_plain_slurm_errors(fake):
    fake(
        (["scontrol", "--local", "-o", "show", "job", "9"], (0, _job_line("train[3-4]", 2), "")),
        (["salloc"], (1, "", "salloc: error: Invalid reservation name specified\n")),
        (["squeue"], (0, "", "")),
        (["scontrol", "-o", "show", "reservation"], (1, "", "Reservation nope not found\n")),
    )
    with pytest.raises(SlurmError) as ei:
        CliSlurm().grow(9, reservation="nope", timeout=3)
    assert not isinstance(ei.value, NoStandbyAvailable) and "Invalid reservation" in str(ei.value)


def test_shrink_refuses_the_batch_host_without_touching_slurm(fake):
    f = fake((["scontrol", "--local", "-o", "show", "job", "9"], (0, JOB_TEXT, "")))
    with pytest.raises(BatchHostRelease, match="train3"):
        CliSlurm().shrink(9, ["train4", "spare1"])
    assert all(a[:3] != ["scontrol", "--local", "update"] for a in f.seen)


def test_shrink_releases_the_rest(fake):
    jobs = iter([JOB_TEXT, _job_line("spare2,train3", 2)])
    f = fake((["scontrol", "--local", "-o", "show", "job", "9"], lambda: (0, next(jobs), "")),
             (["scontrol", "--local", "update"], (0, "", "")))
    assert CliSlurm().shrink(9, ["train3", "spare2"]) == ["spare1", "train4"]
    assert ["scontrol", "--local", "update", "JobId=9", "NodeList=train3,spare2"] in f.seen


def test_shrink_given_the_callers_record_asks_only_the_update(fake):
    from trainmover.slurm.parse import parse_job_text
    f = fake((["scontrol", "--local", "-o", "show", "job", "9"], (0, _job_line("spare2,train3", 2), "")),
             (["scontrol", "--local", "update"], (0, "", "")))
    assert CliSlurm().shrink(9, ["train3", "spare2"], job=parse_job_text(JOB_TEXT)) == ["spare1", "train4"]
    assert [a[2] for a in f.seen] == ["update"]  # no read before, none after: the caller keeps the record


def test_shrink_without_a_record_reads_the_job_and_checks_the_release(fake):
    jobs = iter([JOB_TEXT, JOB_TEXT])  # Slurm still shows the released nodes afterwards
    fake((["scontrol", "--local", "-o", "show", "job", "9"], lambda: (0, next(jobs), "")),
         (["scontrol", "--local", "update"], (0, "", "")))
    with pytest.raises(SlurmError, match="still holds"):
        CliSlurm().shrink(9, ["train3", "spare2"])


def test_nodes_one_call_and_unknown_names(fake):
    f = fake((["scontrol", "-o", "show", "node", "train1,train2,spare1"], (0, NODES_TEXT, "")),
             (["scontrol", "-o", "show", "node", "train1,nosuch"],
              (1, NODES_TEXT.splitlines()[0] + "\nNode nosuch not found\n", "")))
    c = CliSlurm()
    assert list(c.nodes(["train1", "train2", "spare1"])) == ["train1", "train2", "spare1"]
    assert commands.calls() == {"scontrol": 1}
    with pytest.raises(UnknownNodes, match="nosuch"):
        c.nodes(["train1", "nosuch"])


def test_nodes_single_unknown_and_controller_errors(fake):
    fake((["scontrol", "-o", "show", "node", "nosuch"], (1, "Node nosuch not found\n", "")),
         (["scontrol", "-o", "show", "node", "train1"],
          (1, "", "slurm_load_node error: Unable to contact slurm controller (connect failure)")))
    with pytest.raises(UnknownNodes, match="nosuch"):
        CliSlurm().nodes(["nosuch"])
    with pytest.raises(SlurmError, match="Unable to contact slurm controller") as ei:
        CliSlurm().nodes(["train1"])
    assert not isinstance(ei.value, UnknownNodes)


def test_free_standbys(fake):
    fake((["scontrol", "-o", "show", "reservation"], (0, RESV_TEXT, "")),
         (["scontrol", "-o", "show", "node", "spare1,spare2"], (0, _spares(), "")))
    assert CliSlurm().free_standbys("trainmover_standby") == ["spare1"]


def test_resume_of_a_node_in_service_is_a_no_op(fake):
    fake((["scontrol", "update"], (1, "", "slurm_update error: Invalid node state specified")),
         (["scontrol", "-o", "show", "node"], (0, NODES_TEXT.splitlines()[2], "")))
    CliSlurm().resume("spare1")


def test_slurm_conf_given_to_the_client_reaches_the_command(fake):
    f = fake((["scontrol", "show", "hostnames"], (0, "a1\na2\n", "")))
    assert CliSlurm(slurm_conf="/c/slurm.conf").hostnames("a[1-2]") == ["a1", "a2"]
    assert f.envs[-1]["SLURM_CONF"] == "/c/slurm.conf"


def test_grow_waits_out_the_credential_revocation_of_a_node_it_just_released(fake):
    """A node released from a job and merged back in the same second refuses the
    job's next step ('Job credential revoked'); grow() waits for the next second."""
    jobs = iter([JOB_TEXT, _job_line("spare2,train3,train4", 3),              # shrink: before, after
                 _job_line("spare2,train3,train4", 3), JOB_TEXT])              # grow: before, after
    fake((["scontrol", "--local", "-o", "show", "job", "9"], lambda: (0, next(jobs), "")),
         (["scontrol", "--local", "-o", "show", "job", "10"], (0, _job_line("spare1", 1, job_id=10, batch="spare1"), "")),
         (["salloc"], (0, "", "salloc: Granted job allocation 10\n")),
         (["scontrol", "--local", "update"], (0, "", "")))
    now = [1000.30]
    slept = []
    c = CliSlurm(wall_clock=lambda: now[0], sleep=lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    assert c.shrink(9, ["train3", "train4", "spare2"]) == ["spare1"]
    now[0] = 1000.70
    assert c.grow(9, reservation="trainmover_standby", timeout=5) == "spare1"
    assert slept == [pytest.approx(0.35)] and now[0] >= 1001.0


def test_job_updates_run_without_the_job_environment(fake, monkeypatch):
    """Inside a job, scontrol update would write slurm_job_J_resize.{sh,csh} into the cwd."""
    monkeypatch.setenv("SLURM_JOBID", "9")
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    jobs = iter([JOB_TEXT, _job_line("spare2,train3", 2)])
    f = fake((["scontrol", "--local", "-o", "show", "job", "9"], lambda: (0, next(jobs), "")),
             (["scontrol", "--local", "update"], (0, "", "")))
    CliSlurm().shrink(9, ["train3", "spare2"])
    updates = [e for a, e in zip(f.seen, f.envs) if a[:3] == ["scontrol", "--local", "update"]]
    assert updates and all("SLURM_JOBID" not in e and "SLURM_JOB_ID" not in e for e in updates)
    queries = [e for a, e in zip(f.seen, f.envs) if a[:4] == ["scontrol", "--local", "-o", "show"]]
    assert queries and all(e.get("SLURM_JOBID") == "9" for e in queries)


def test_resume_of_a_node_that_is_just_back_in_service_is_not_an_error(fake):
    """A second resume right after the first: scontrol refuses ("Invalid node state") while
    the node briefly shows IDLE+NOT_RESPONDING; it is in service, so resume() succeeds."""
    back = NODES_TEXT.split("\n")[1].replace("State=IDLE+DRAIN", "State=IDLE+NOT_RESPONDING") + "\n"
    fake((["scontrol", "update"], (1, "", "slurm_update error: Invalid node state specified")),
         (["scontrol", "-o", "show", "node"], (0, back, "")))
    CliSlurm().resume("train2")
    still = NODES_TEXT.split("\n")[1] + "\n"  # IDLE+DRAIN: the resume really failed
    fake((["scontrol", "update"], (1, "", "slurm_update error: Invalid node state specified")),
         (["scontrol", "-o", "show", "node"], (0, still, "")))
    with pytest.raises(SlurmError, match="could not resume train2"):
        CliSlurm().resume("train2")
