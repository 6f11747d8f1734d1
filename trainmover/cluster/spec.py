"""What the embedded cluster looks like: names, addresses, ports, paths and the
generated config files. Pure: no processes, no clock; rendering is tested
against golden text in tests/unit/test_slurm_cluster_conf.py.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from trainmover.cluster.releases import RELEASES, Release
from trainmover.cluster.source import JOB_EXPANSION_NULL_LICENSES
from trainmover.cluster.users import JOB_USER
from trainmover.slurm.model import KEEPER_FEATURE, TRAIN_FEATURE  # what the keeper and templates ask for

PARTITION = "train"
KEEPERS = 2                   # keeper nodes: one per TrainMover job running at the same time
RESERVATION = "trainmover_standby"
# Who may take the standbys: root (admins' tools) and the cluster's ordinary job user
# (trainmover/cluster/users.py); a site names its own users or accounts (docs/admin.md).
RESERVATION_USERS = ("root", JOB_USER)
CLUSTER_NAME = "trainmover"
# First host byte of the node addresses in the cluster's 127.0.N.0/24 (netblock.py). Debian
# maps the machine's own hostname to 127.0.1.1, so the nodes start further up.
FIRST_ADDR = 11
MAX_NODES = 240
# Preferred ports, away from a real site's Slurm (6817-6819) and MariaDB (3306);
# the next free port is used when one is taken.
DEFAULT_PORTS = {"slurmctld": 16817, "slurmdbd": 16819, "mariadb": 16306, "slurmd": 16901}
CPUS_PER_NODE = 4
MEMORY_PER_NODE_MB = 2048
BATCH_START_TIMEOUT_S = 3600  # see render_slurm_conf
HEALTHCHECK_INTERVAL_S = 30  # a run costs ~0.1 s of CPU: cheap even with every node on one host


@dataclass(frozen=True)
class Ports:
    slurmctld: int
    slurmdbd: int
    mariadb: int
    slurmd_base: int  # node i (0-based, train nodes first) listens on slurmd_base + i


@dataclass(frozen=True)
class ClusterSpec:
    """One embedded cluster: `nodes` training nodes and `standby` spare nodes, running
    Slurm release `slurm` (full version `slurm_version`) from the host, or from the Debian
    root filesystem `root` (trainmover/cluster/rootfs.py) when that is set."""

    state_dir: Path
    nodes: int
    standby: int
    ports: Ports
    db_password: str
    cpus: int = CPUS_PER_NODE
    memory_mb: int = MEMORY_PER_NODE_MB
    slurm: str = "22.05"     # clusters started before releases were recorded ran Debian 12's
    slurm_version: str = ""
    root: str = ""
    net: int = 1             # node addresses in 127.0.<net>.0/24 (netblock.py)
    keepers: int = 2         # keeper nodes (feature tm_keeper): a job's batch script runs on one (docs/admin.md)
    # False: slurm.conf without permit_job_expansion, as Slurm ships it (a site's stock
    # slurm.conf: TrainMover must run there, and say that no standby can join by expansion)
    job_expansion: bool = True
    # True: the release built from source without TrainMover's fixes (releases.unfixed), so that
    # tests can show TrainMover never makes the call that crashes the unfixed slurmctld
    unfixed: bool = False
    # True: `cluster up` runs the per-cluster node-state reader as a site would
    # (cluster/node_reader.py); False for the tests and benchmarks that measure each job's own poll
    node_reader: bool = True

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.standby < 0:
            raise ValueError(f"need nodes >= 1 and standby >= 0, got nodes={self.nodes} standby={self.standby}")
        if self.nodes + self.standby > MAX_NODES:
            raise ValueError(f"at most {MAX_NODES} nodes in all, got {self.nodes + self.standby}")
        if not 1 <= self.net <= 254:
            raise ValueError(f"net must be 1..254 (127.0.<net>.0/24), got {self.net}")
        if self.slurm not in RELEASES:
            raise ValueError(f"unsupported Slurm release {self.slurm!r} (supported: {', '.join(RELEASES)})")

    @property
    def release(self) -> Release:
        return RELEASES[self.slurm]

    @property
    def accounting(self) -> bool:
        return self.release.accounting

    def describe_slurm(self) -> str:
        """'Slurm 24.11.5 (Debian trixie root filesystem /var/cache/...)' or 'Slurm 22.05.8 (host)'."""
        where = f"Debian {self.release.suite} root filesystem {self.root}" if self.root else "host"
        return (f"Slurm {self.slurm_version or self.slurm} ({where}"
                + (", built without TrainMover's fixes" if self.unfixed else "")
                + (", no permit_job_expansion" if not self.job_expansion else "") + ")")

    # --- names and addresses -------------------------------------------------
    @property
    def train_nodes(self) -> list[str]:
        return [f"train{i}" for i in range(1, self.nodes + 1)]

    @property
    def spare_nodes(self) -> list[str]:
        return [f"spare{i}" for i in range(1, self.standby + 1)]

    @property
    def keeper_nodes(self) -> list[str]:
        return [f"keep{i}" for i in range(1, self.keepers + 1)]

    @property
    def all_nodes(self) -> list[str]:
        return self.train_nodes + self.spare_nodes + self.keeper_nodes

    def addr(self, node: str) -> str:
        return f"127.0.{self.net}.{FIRST_ADDR + self.all_nodes.index(node)}"

    def slurmd_port(self, node: str) -> int:
        return self.ports.slurmd_base + self.all_nodes.index(node)

    @property
    def keeper_expr(self) -> str:
        if not self.keepers:
            return ""
        return f"keep[1-{self.keepers}]" if self.keepers > 1 else "keep1"

    @property
    def train_expr(self) -> str:
        return f"train[1-{self.nodes}]" if self.nodes > 1 else "train1"

    @property
    def spare_expr(self) -> str:
        return f"spare[1-{self.standby}]" if self.standby > 1 else "spare1"

    # --- paths -----------------------------------------------------------------
    @property
    def etc(self) -> Path:
        return self.state_dir / "etc"

    @property
    def run(self) -> Path:
        return self.state_dir / "run"

    @property
    def log(self) -> Path:
        return self.state_dir / "log"

    @property
    def spool(self) -> Path:
        return self.state_dir / "spool"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def healthcheck_program(self) -> Path:
        return self.etc / "healthcheck.sh"

    @property
    def epilog_program(self) -> Path:
        return self.etc / "epilog.sh"

    @property
    def healthcheck_state(self) -> Path:
        """The health check's state directory (kernel-log cursor, test hook inject-fault-<node>);
        ClusterInfo.healthcheck_state says the same to callers."""
        return self.state_dir / "healthcheck"

    @property
    def expansion_fix_file(self) -> Path:
        """The admin's declaration of a slurmctld fixed for the job-expansion crash, where a
        job's controller looks for it (slurm/expansion_fix.py: beside slurm.conf)."""
        return self.etc / "trainmover-expansion-fix"

    @property
    def cgroup_conf(self) -> Path:
        return self.etc / "cgroup.conf"

    @property
    def exec_file(self) -> Path:
        """How to run this cluster's Slurm programs (trainmover/slurm/commands.py reads it)."""
        return self.etc / "slurm-exec.json"

    @property
    def bin(self) -> Path:
        """Wrappers that run the root filesystem's Slurm commands from a shell (`cluster env`)."""
        return self.state_dir / "bin"

    @property
    def slurmdbd_conf(self) -> Path:
        return self.etc / "slurmdbd.conf"

    @property
    def hosts_file(self) -> Path:
        return self.etc / "hosts"

    @property
    def munge_key(self) -> Path:
        return self.etc / "munge.key"

    @property
    def munge_socket(self) -> Path:
        return self.run / "munge" / "munge.socket.2"

    @property
    def db_dir(self) -> Path:
        return self.state_dir / "mariadb"

    @property
    def db_socket(self) -> Path:
        return self.run / "mariadb.sock"

    @property
    def ctld_state(self) -> Path:
        return self.spool / "slurmctld"

    def pid_file(self, daemon: str) -> Path:
        return self.run / f"{daemon}.pid"

    def log_file(self, daemon: str) -> Path:
        return self.log / f"{daemon}.log"

    # --- persistence -------------------------------------------------------------
    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["state_dir"] = str(self.state_dir)
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "ClusterSpec":
        d = json.loads(text)
        d["state_dir"] = Path(d["state_dir"])
        d["ports"] = Ports(**d["ports"])
        return cls(**d)

    def layout_key(self) -> tuple:
        """What slurmctld's saved state depends on: a change means a fresh state (a
        different Slurm release may not read another's state files)."""
        return (self.nodes, self.standby, self.cpus, self.memory_mb, self.slurm, self.net, self.keepers)


def render_slurm_conf(spec: ClusterSpec) -> str:
    """slurm.conf for the embedded cluster (see docs/admin.md for each setting)."""
    s = spec
    lines = [
        "# Generated by trainmover.cluster; edits are overwritten by `trainmover cluster up`.",
        f"ClusterName={CLUSTER_NAME}",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={s.ports.slurmctld}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "# slurmctld binds the address its hostname resolves to: 'localhost' in its own UTS",
        "# namespace, so 127.0.0.1. Not NoInAddrAny: slurmd and srun would bind their node's",
        "# 127.0.N.x while loopback connections leave from 127.0.0.1, and a step launched from",
        "# inside a job fails ('connect io: Connection refused').",
        "CommunicationParameters=NoCtldInAddrAny",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={s.munge_socket}",
        f"StateSaveLocation={s.ctld_state}",
        f"SlurmdSpoolDir={s.spool}/slurmd-%n",
        f"SlurmctldPidFile={s.pid_file('slurmctld')}",
        f"SlurmdPidFile={s.run}/slurmd-%n.pid",
        f"SlurmctldLogFile={s.log_file('slurmctld')}",
        f"SlurmdLogFile={s.log}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "SlurmdTimeout=30",
        "# slurmctld requeues a running batch job that one node registration leaves out once the",
        "# job has not been seen for BatchStartTimeout (+ MessageTimeout) seconds; with every",
        "# slurmd on one loaded host such a registration happens now and then (most often after",
        "# a job was resized), and 22.05 then requeued healthy TrainMover jobs. A job lost for real",
        "# still ends: its node goes DOWN, or its steps end.",
        f"BatchStartTimeout={BATCH_START_TIMEOUT_S}",
        *([f"# job ids apart from other releases' clusters (runs/<job id> of demos in one checkout)",
           f"FirstJobId={s.release.first_job_id}"] if s.release.first_job_id != 1 else []),
        "InactiveLimit=0",
        "KillWait=5",
        "MinJobAge=300",
        "SchedulerType=sched/backfill",
        "# A job asking for more nodes than its partition has is refused at submit time (\"Node count",
        "# specification invalid\"); 22.05's default (NO) keeps it pending for ever (PartitionNodeLimit).",
        "EnforcePartLimits=ALL",
        "# sched_interval=5: the main scheduling pass every 5 s, not 60: a job whose start at submit",
        "# was missed (seen on the loaded CI machine: the second of two jobs submitted together waited",
        "# for the next pass) starts within seconds while its nodes are free.",
        *_scheduler_lines(s),
        *_accounting_lines(s),
        "JobCompType=jobcomp/none",
        *_rate_limit_lines(s),
        "# The health check, with the lines docs/admin.md gives admins (slurm_plugin/healthcheck.sh",
        "# copied next to its healthcheck.env), but on IDLE nodes only: with every slurmd on one",
        "# host, Slurm 22.05 requeued running jobs ('Batch JobId missing from batch node') in each",
        "# of our runs with the check on allocated nodes. Tests run it on job nodes as slurmd would.",
        f"HealthCheckProgram={s.healthcheck_program}",
        f"HealthCheckInterval={HEALTHCHECK_INTERVAL_S}",
        "HealthCheckNodeState=IDLE,CYCLE",
        "# The Epilog docs/admin.md gives admins: a node a job held after fencing it (its user may not",
        "# drain) goes back drained at the job's end; other jobs' ends do not start Python.",
        f"Epilog={s.epilog_program}",
        "",
    ]
    # Keepers (feature tm_keeper) run a job's batch script and no rank, so that every training
    # node can leave the job (docs/admin.md, "No special node"); weighted last for other jobs.
    for node in s.all_nodes:
        keeper = node in s.keeper_nodes
        weight = 1 if node.startswith("train") else (1000 if keeper else 100)
        lines.append(
            f"NodeName={node} NodeAddr={s.addr(node)} NodeHostname={node} Port={s.slurmd_port(node)} "
            f"CPUs={s.cpus} RealMemory={s.memory_mb} Weight={weight} "
            f"Features={KEEPER_FEATURE if keeper else TRAIN_FEATURE} State=UNKNOWN"
        )
    nodes = ",".join(x for x in (s.train_expr, s.spare_expr if s.standby else "", s.keeper_expr) if x)
    lines += [
        "",
        "# One partition over training, standby and keeper nodes: a job and the donor allocation",
        f"# that grows it must share a partition. The spares are kept out of ordinary use",
        f"# by the reservation {RESERVATION} (created by `trainmover cluster up`).",
        f"PartitionName={PARTITION} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=EXCLUSIVE",
        "",
    ]
    return "\n".join(lines)


def _scheduler_lines(s: ClusterSpec) -> list[str]:
    """SchedulerParameters: permit_job_expansion (a standby merged into a running job) unless
    the cluster runs without it, as a stock slurm.conf does (`cluster up --no-job-expansion`)."""
    rest = "batch_sched_delay=0,sched_min_interval=0,default_queue_depth=100,sched_interval=5"
    if not s.job_expansion:
        return ["# No permit_job_expansion (cluster up --no-job-expansion): Slurm's default, a site's stock",
                "# slurm.conf. Jobs cannot grow: TrainMover takes no standby by expansion and says why.",
                f"SchedulerParameters={rest}"]
    return [f"SchedulerParameters=permit_job_expansion,{rest}"]


def _rate_limit_lines(s: ClusterSpec) -> list[str]:
    """Slurm 23.02 and later: slurmctld's per-user RPC rate limit at its defaults (a bucket of 30
    tokens per user, 2 refilled a second), as sites that guard slurmctld run it, so that every
    test shows TrainMover's polling stays within it (docs/admin.md, "Load on slurmctld")."""
    if tuple(int(x) for x in s.slurm.split(".")[:2]) < (23, 2):
        return []
    return ["# per-user RPC rate limit at its defaults (TrainMover must stay within it)",
            "SlurmctldParameters=rl_enable"]


def _accounting_lines(s: ClusterSpec) -> list[str]:
    if not s.accounting:
        return [
            f"# No accounting: Slurm {s.slurm} grows and shrinks a job repeatedly without slurmdbd.",
            "AccountingStorageType=accounting_storage/none",
        ]
    return [
        f"# Accounting through slurmdbd: without it Slurm {s.slurm} resizes a job only once",
        "# (later updates fail with 'DB index is being set').",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=127.0.0.1",
        f"AccountingStoragePort={s.ports.slurmdbd}",
        "# the munge socket for talking to slurmdbd (AuthInfo does not apply to it)",
        f"AccountingStoragePass={s.munge_socket}",
    ]


def render_expansion_fix(slurm_version: str, fixes: list[str]) -> str | None:
    """The cluster's declaration that its slurmctld carries the job-expansion fix: for a Slurm
    built from source with source.JOB_EXPANSION_NULL_LICENSES applied (`fixes`: the `why`s its
    root filesystem's marker lists), naming that build's version; None for any other (a
    release the table calls safe needs none, and an unfixed build must not claim one)."""
    if JOB_EXPANSION_NULL_LICENSES.why not in fixes or not slurm_version:
        return None
    return ("# Generated by trainmover.cluster: this cluster's Slurm was built from source with the\n"
            f"# fix '{JOB_EXPANSION_NULL_LICENSES.why}' (cluster/source.py).\n{slurm_version}\n")


def render_cgroup_conf(spec: ClusterSpec) -> str | None:
    """cgroup.conf for releases whose slurmd needs one (see Release.cgroup_disabled); None otherwise."""
    if not spec.release.cgroup_disabled:
        return None
    return ("# Generated by trainmover.cluster. Every node runs on this one host: no cgroup\n"
            "# confinement (proctrack/linuxproc, task/none), and slurmd starts without a cgroup plugin.\n"
            "CgroupPlugin=disabled\n")


def render_slurmdbd_conf(spec: ClusterSpec) -> str:
    s = spec
    return "\n".join(
        [
            "# Generated by trainmover.cluster.",
            f"AuthType=auth/munge",
            f"AuthInfo=socket={s.munge_socket}",
            "DbdHost=localhost",
            "CommunicationParameters=NoInAddrAny",
            "DbdAddr=127.0.0.1",
            f"DbdPort={s.ports.slurmdbd}",
            "SlurmUser=root",
            "DebugLevel=info",
            f"LogFile={s.log_file('slurmdbd')}",
            f"PidFile={s.pid_file('slurmdbd')}",
            "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1",
            f"StoragePort={s.ports.mariadb}",
            "StorageUser=slurm",
            f"StoragePass={s.db_password}",
            "StorageLoc=slurm_acct_db",
            "",
        ]
    )


def reservation_args(spec: ClusterSpec) -> list[str]:
    """`scontrol create reservation` arguments that keep the spares out of ordinary jobs."""
    return [
        f"ReservationName={RESERVATION}",
        f"Nodes={spec.spare_expr}",
        "StartTime=now",
        "Duration=infinite",
        f"Users={','.join(RESERVATION_USERS)}",
        "Flags=IGNORE_JOBS",
    ]


def render_hosts(spec: ClusterSpec, system_hosts: str) -> str:
    """The /etc/hosts each node sees: the system's, minus lines for our addresses, plus every node."""
    ours = {spec.addr(n) for n in spec.all_nodes}
    names = set(spec.all_nodes)
    kept = []
    for line in system_hosts.splitlines():
        fields = line.split("#", 1)[0].split()
        if fields and (fields[0] in ours or names.intersection(fields[1:])):
            continue
        kept.append(line)
    kept.append("# trainmover embedded cluster nodes")
    kept += [f"{spec.addr(n)} {n}" for n in spec.all_nodes]
    return "\n".join(kept) + "\n"
