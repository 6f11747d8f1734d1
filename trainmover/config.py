"""One validated configuration for a TrainMover job, read in one place.

Sources, later wins: defaults, `TM_*` environment variables (what a user sets in an sbatch
script), command-line options of `trainmover controller`. An unknown `TM_*` variable is an
error (a typo must not silently fall back to a default); so is a malformed value.

Every `TM_*` variable the code reads is declared here: the job's configuration (`Config`, one
field each), and in a group of their own the variables of TrainMover's own processes, tools,
debugging and tests (`VARIABLES`), which modules read only through `setting()`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields

from trainmover import faults
from trainmover.errors import ConfigError
from trainmover.faults import INJECTIONS

TIERS = ("replica", "snapshot", "checkpoint")  # where a vanished rank's state may come from


def parse_tiers(raw: str) -> tuple[str, ...]:
    """`TM_RECOVERY_TIERS`: `replica,snapshot,checkpoint` (a subset, in order of preference)."""
    tiers = tuple(t.strip() for t in raw.split(",") if t.strip())
    if not tiers or len(set(tiers)) != len(tiers) or set(tiers) - set(TIERS):
        raise ConfigError(f"TM_RECOVERY_TIERS={raw!r}: expected distinct names among {', '.join(TIERS)}")
    return tiers


def parse_options(raw: str) -> dict:
    """`TM_WORKLOAD_OPTIONS`: `key=value,...` -> dict; true/false become bools, numbers numbers.
    The workload's constructor validates the keys (an unknown one is a TypeError there)."""
    out = {}
    for item in (x.strip() for x in raw.split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ConfigError(f"TM_WORKLOAD_OPTIONS: {item!r} is not key=value")
        out[key.strip()] = _scalar(value.strip())
    if "preset" in out:
        raise ConfigError("TM_WORKLOAD_OPTIONS: set the preset with TM_MODEL")
    return out


def _scalar(value: str):
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


@dataclass(frozen=True)
class Variable:
    """A `TM_*` variable that is not part of a job's configuration."""
    env: str
    group: str    # process: set by TrainMover for its own processes; tool; debug; test
    default: str  # what `setting` returns when the variable is unset or empty
    doc: str


VARIABLES = (
    Variable("TM_WORKER_SPEC", "process", "", "the spec the controller hands a rank process (JSON, protocol/worker_spec.py); set by the controller"),
    Variable("TM_PYTHON", "process", "", "the interpreter the sbatch templates run (default $SLURM_SUBMIT_DIR/.venv/bin/python); read by the templates"),
    Variable("TM_LOG_LEVEL", "process", "INFO", "log level of TrainMover's processes (a logging level name: DEBUG, INFO, WARNING, ...)"),
    Variable("TM_NCCL_LIB", "tool", "", "path of the communicator library (default cuda/build/libtmdelta.so)"),
    Variable("TM_CLUSTER_DIR", "tool", "", "state directory of `trainmover cluster` (default /var/tmp/trainmover-cluster)"),
    Variable("TM_ROOTFS_CACHE", "tool", "", "root filesystem cache of the Slurm release clusters (default /var/cache/trainmover/rootfs)"),
    Variable("TM_SLURM_SOURCE", "tool", "", "the Slurm source tarball, or a directory holding it, for releases built from source"),
    Variable("TM_SLURM_UNFIXED", "tool", "", "1: `trainmover cluster up/build --slurm 25.11` builds and runs Slurm without TrainMover's fixes to its source (its slurmctld crashes at every job expansion; cluster/source.py), in a root filesystem of its own: for tests that show no job expansion is made there"),
    Variable("TM_BENCH_MACHINE", "tool", "unknown", "bench/: the machine named in a result's JSON"),
    Variable("TM_COMMIT", "tool", "", "bench/: the commit named in a result's JSON (default: git rev-parse HEAD)"),
    Variable("TM_BENCH_NCCL_RUNTIME_CONNECT", "tool", "0", "bench/gpu_planned_migration.py: NCCL_RUNTIME_CONNECT for "
             "its jobs (0: every peer connected at init, in Phase 1; 1: at first use, an experiment)"),
    Variable("TM_BENCH_INSIDE_ROOT", "tool", "", "bench/slurm_poll.py: set in its re-execution inside a release's root filesystem"),
    Variable("TM_TRACE_COLLECTIVES", "debug", "", "1: print every collective a group forwards (mismatched sequences between ranks)"),
    Variable("TM_TRACE_SWITCH", "debug", "", "1: log the timings of the two steps after a switch"),
    Variable("TM_TEST_GPU", "test", "", "tests: 1 runs the GPU session (tests/conftest.py: pytest tests -m gpu)"),
    Variable("TM_RECORD_GOLDEN", "test", "", "tests/unit/test_templates.py: 1 re-records the sbatch golden files"),
    Variable("TM_E2E_CLUSTER_DIR", "test", "", "tests/e2e: the shared cluster's state directory (default /var/tmp/trainmover-cluster-e2e)"),
    Variable("TM_E2E_JOBS_DIR", "test", "", "tests/e2e: where jobs submitted as the ordinary user run (default /var/tmp/trainmover-e2e-jobs)"),
    Variable("TM_E2E_MEGATRON_CLUSTER_DIR", "test", "", "tests/e2e/test_megatron_slurm.py: its cluster's state directory"),
    Variable("TM_E2E_WHOLE_NODE_CLUSTER_DIR", "test", "", "tests/e2e/test_megatron_whole_node.py: its cluster's state directory"),
    Variable("TM_E2E_SLURM", "test", "", "tests/e2e: run against this Slurm release's cluster (the Slurm matrix)"),
    Variable("TM_E2E_INSIDE_ROOT", "test", "", "tests/e2e: set inside a release's root filesystem (pyslurm's contract cases)"),
)
_VARIABLES = {v.env: v for v in VARIABLES}


def setting(env: str, environ=None) -> str:
    """The value of a declared `VARIABLES` entry: the environment's (read now, so a test may
    set it), else its default. A name not declared raises KeyError: the code reads no `TM_*`
    variable that `Config.from_env` would refuse as unknown."""
    var = _VARIABLES[env]
    environ = os.environ if environ is None else environ
    return environ.get(env) or var.default


SCRIPT_PREFIX = "script:"  # TM_WORKLOAD=script:PATH: the user's own training script (trainmover/script)


def script_argv(raw: str) -> list[str]:
    """TM_SCRIPT_ARGS: a JSON list of strings (the script's argv after its path)."""
    try:
        argv = json.loads(raw or "[]")
    except ValueError as exc:
        raise ConfigError(f"TM_SCRIPT_ARGS={raw!r}: not JSON ({exc}); expected a list of strings") from None
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ConfigError(f"TM_SCRIPT_ARGS={raw!r}: expected a JSON list of strings")
    return argv


@dataclass(frozen=True)
class Config:
    steps: int = field(default=1500, metadata={"env": "TM_STEPS", "doc": "training steps (about a minute of the CPU demo)"})
    workload: str = field(default="gpt_demo", metadata={"env": "TM_WORKLOAD", "doc": "registry name or module:Class"})
    model: str = field(default="", metadata={"env": "TM_MODEL", "doc": "model preset, passed as `preset` to a workload whose constructor takes one (unset: the workload's default; tiny for gpt_demo and megatron_gpt)"})
    device: str = field(default="auto", metadata={"env": "TM_DEVICE", "doc": "cpu, cuda, or auto (cuda when the node has a GPU)"})
    backend: str = field(default="auto", metadata={"env": "TM_BACKEND", "doc": "gloo, nccl, or auto (nccl on cuda)"})
    seed: int = field(default=1234, metadata={"env": "TM_SEED", "doc": "seed of weights, data and dropout"})
    tp: int = field(default=0, metadata={"env": "TM_TP", "doc": "Megatron tensor-parallel size (0: the workload takes no layout)"})
    pp: int = field(default=0, metadata={"env": "TM_PP", "doc": "Megatron pipeline-parallel size; TP x PP x DP must equal nodes x ranks per node"})
    dp: int = field(default=0, metadata={"env": "TM_DP", "doc": "Megatron data-parallel size"})
    distributed_optimizer: int = field(default=0, metadata={"env": "TM_DISTRIBUTED_OPTIMIZER", "doc": "Megatron: 1 shards the optimizer state over DP (0: off)"})
    ranks_per_node: int = field(default=1, metadata={"env": "TM_RANKS_PER_NODE", "doc": "worker processes per node"})
    standbys: int | str = field(default=1, metadata={"env": "TM_STANDBYS", "doc": "warm standby nodes kept in the job, or auto: the controller picks the number at start from the job's size and the site's failure rates (TM_SITE_CONFIG; docs/simulator.md) and status says why"})
    injob_standbys: int = field(default=0, metadata={"env": "TM_INJOB_STANDBYS", "doc": "standby nodes the job brings in its own allocation (ask for this many more nodes at submit): the last N training nodes of the allocation, in the controller's order of nodes, run standby agents from the start instead of ranks; no job expansion is needed (a drained node leaves by a shrink). Refilled from the reservation only where grow is possible; the pool is kept at max(TM_STANDBYS, N) there (docs/admin.md)"})
    site_config: str = field(default="/etc/trainmover/site.toml", metadata={"env": "TM_SITE_CONFIG", "doc": "the admin's site file: failure rates and standby bounds for TM_STANDBYS=auto and `trainmover plan` (read only if root's or yours and not writable by others; missing: the published rates)"})
    reservation: str = field(default="trainmover_standby", metadata={"env": "TM_RESERVATION", "doc": "Slurm reservation holding the standby nodes"})
    poll_s: float = field(default=10.0, metadata={"env": "TM_POLL_S", "doc": "interval of node-state polls of slurmctld: one RPC each with tm_nodes, two with scontrol (docs/admin.md, \"Load on slurmctld\"); a drain by TrainMover's health check or `trainmover drain` reaches the job at once through its drain notice"})
    node_query: str = field(default="auto", metadata={"env": "TM_NODE_QUERY", "doc": "the program that reads node states in one RPC (slurm_plugin/tm_nodes.c); auto: tm_nodes beside slurm.conf if there; off: scontrol (two RPCs)"})
    drain_notices: str = field(default="auto", metadata={"env": "TM_DRAIN_NOTICES", "doc": "root-owned directory of drain notices the controller watches (slurm/drain_notice.py); auto: trainmover-drains beside slurm.conf if there; off: none"})
    slurm_expansion_fix: str = field(default="auto", metadata={"env": "TM_SLURM_EXPANSION_FIX", "doc": "where the site's admin declares the Slurm releases whose slurmctld carries the fix for the job-expansion crash (SIGSEGV in _valid_license_job_expansion(); 25.11.0-25.11.7, 26.05.0-26.05.4: slurm/expansion_safety.py): auto: the file trainmover-expansion-fix beside slurm.conf; a path; off: none. Read only if root's alone (docs/admin.md); on a release known to crash, or not checked, a job takes no standby by expansion unless it lists that release"})
    phase1_timeout_s: float = field(default=60.0, metadata={"env": "TM_PHASE1_TIMEOUT_S", "doc": "deadline of Phase 1; past it the migration is aborted, the job unchanged"})
    group_timeout_s: float = field(default=60.0, metadata={"env": "TM_GROUP_TIMEOUT_S", "doc": "deadline of every collective and rendezvous"})
    switch_timeout_s: float = field(default=60.0, metadata={"env": "TM_SWITCH_TIMEOUT_S", "doc": "joiner's longest wait for the leaver's state"})
    recovery_timeout_s: float = field(default=120.0, metadata={"env": "TM_RECOVERY_TIMEOUT_S", "doc": "after a rank vanished: longest pause for a standby and the new groups before the job stops"})
    standby_wait_s: float = field(default=10.0, metadata={"env": "TM_STANDBY_WAIT_S", "doc": "one attempt to take a standby from the reservation"})
    standby_losses: int = field(default=3, metadata={"env": "TM_STANDBY_LOSSES", "doc": "standbys that may die (before or while joining) in one job; after that many no more are taken and a drain waits, the job running on its node"})
    standby_retry_s: float = field(default=5.0, metadata={"env": "TM_STANDBY_RETRY_S", "doc": "pause between attempts when none is free"})
    release_timeout_s: float = field(default=60.0, metadata={"env": "TM_RELEASE_TIMEOUT_S", "doc": "longest wait for the leaver's step to end before its node is released"})
    record_iterations: int = field(default=3, metadata={"env": "TM_RECORD_ITERATIONS", "doc": "iterations whose collectives are recorded for standbys' shadow steps, by one rank of each role a standby may take (Workload.standby_roles; 0: none)"})
    record_from_step: int = field(default=0, metadata={"env": "TM_RECORD_FROM_STEP", "doc": "first recorded step (0: from the workload's construction on; later: a steady step, past compile and warm-up)"})
    record_versions: int = field(default=4, metadata={"env": "TM_RECORD_VERSIONS", "doc": "most recordings per job: the recording rank records again when a step's collectives change shape"})
    shadow_steps: int = field(default=6, metadata={"env": "TM_SHADOW_STEPS", "doc": "most shadow steps a standby runs to warm up"})
    standby_warmup: str = field(default="shadow", metadata={"env": "TM_STANDBY_WARMUP", "doc": "shadow (replay + shadow steps, compiled) or cold (a benchmark baseline: no replay; the shadow steps DDP needs, then all compiled code and caches dropped)"})
    standby_nice: int = field(default=10, metadata={"env": "TM_STANDBY_NICE", "doc": "niceness of a standby's warm-up thread (0: none; the threads it starts inherit it), so that live ranks on a shared host keep their CPU; the thread that joins and trains is never niced (an unprivileged process could not lower it back)"})
    standby_compile_threads: int = field(default=4, metadata={"env": "TM_STANDBY_COMPILE_THREADS", "doc": "torch.compile worker processes of a standby (0: torch's default, one per CPU): fewer keep a shared host's CPUs for the live ranks, at the cost of a longer warm-up"})
    script_args: str = field(default="[]", metadata={"env": "TM_SCRIPT_ARGS", "doc": "script mode (TM_WORKLOAD=script:PATH, set by `trainmover run`): the script's own arguments, a JSON list of strings"})
    workload_options: str = field(default="", metadata={"env": "TM_WORKLOAD_OPTIONS", "doc": "key=value,... passed to the workload's constructor, checked against its keyword arguments at start (gpt_demo: compile=true, lr=...)"})
    check_workload: int = field(default=0, metadata={"env": "TM_CHECK_WORKLOAD", "doc": "1: before any rank starts, run `trainmover check-workload` in the batch step on the batch node's CPUs (2 ranks over gloo; 4 processes, each importing torch, and about 3 x TM_CHECK_STEPS + 60 steps: docs/workloads.md); on a failure the job stops with the checker's message"})
    check_steps: int = field(default=24, metadata={"env": "TM_CHECK_STEPS", "doc": "steps the check compares after its migration (docs/workloads.md: what it can see); raise it to at least an epoch and an LR-schedule period, in steps"})
    straggler: str = field(default="report", metadata={"env": "TM_STRAGGLER", "doc": "off, report (verdict in status) or evict (migrate the slow node)"})
    straggler_threshold: float = field(default=0.10, metadata={"env": "TM_STRAGGLER_THRESHOLD", "doc": "slow: compute time this much above the median of the nodes"})
    straggler_windows: int = field(default=3, metadata={"env": "TM_STRAGGLER_WINDOWS", "doc": "consecutive slow windows before a verdict"})
    straggler_window_steps: int = field(default=20, metadata={"env": "TM_STRAGGLER_WINDOW_STEPS", "doc": "steps per timing window"})
    straggler_cooldown_s: float = field(default=300.0, metadata={"env": "TM_STRAGGLER_COOLDOWN_S", "doc": "after a straggler eviction, later verdicts are only reported for this long"})
    rebalance_every_steps: int = field(default=0, metadata={"env": "TM_REBALANCE_EVERY_STEPS", "doc": "move one node to a warm standby every N steps (0: never)"})
    snapshot_every: int = field(default=50, metadata={"env": "TM_SNAPSHOT_EVERY", "doc": "every N steps each rank keeps a copy of its full state in host memory and sends one to a rank on the next node (0: off). 50: on the CPU demo a snapshot costs 0.029 s, about one step, 2.4% of the step time spread over 50 steps, and a rollback redoes at most 49 steps (about 1.2 s there); raise it where the state copy is expensive next to a step"})
    checkpoint_every: int = field(default=0, metadata={"env": "TM_CHECKPOINT_EVERY", "doc": "every N steps each rank writes its full state to <run dir>/checkpoints (HDF5, off the training thread); 2 kept (0: off)"})
    foresee_nodes: int = field(default=0, metadata={"env": "TM_FORESEE_NODES", "doc": "unexpected failures: while a standby is ready and the job has 2..N training nodes, every rank and that standby build, ahead, the groups each node's loss would need (the standby in its ranks' places), so that a recovery builds no group after the fault (docs/recovery.md, \"Groups foreseen\"). Cost: each live rank holds N-1 extra sets of its groups (NCCL: one communicator each, about 1 GB of device memory per world communicator on H200), the standby N sets. 0: off"})
    recovery_tiers: str = field(default="replica,snapshot,checkpoint", metadata={"env": "TM_RECOVERY_TIERS", "doc": "where a vanished rank's state may come from, in order of preference: replica, snapshot, checkpoint (comma-separated subset)"})
    controller_restarts: int = field(default=3, metadata={"env": "TM_CONTROLLER_RESTARTS", "doc": "times the controller is restarted from its journal after it died (0: never)"})
    controller_successors: int = field(default=1, metadata={"env": "TM_CONTROLLER_SUCCESSORS", "doc": "warm successor controllers kept on other nodes of the job (0-3); 2 also covers a second loss right after a move, while the first replacement still imports"})
    controller_deadline_s: float = field(default=2.0, metadata={"env": "TM_CONTROLLER_DEADLINE_S", "doc": "the keeper takes a controller silent this long for lost and promotes its warm successor (it beats every 0.25 s); a lost controller is replaced within about this plus 1 s"})
    reconnect_timeout_s: float = field(default=60.0, metadata={"env": "TM_RECONNECT_TIMEOUT_S", "doc": "after the controller died: how long ranks try to reach its successor, and it waits for them"})
    heartbeat_s: float = field(default=0.5, metadata={"env": "TM_HEARTBEAT_S", "doc": "every process sends a heartbeat this often, from a thread of its own (runtime/heartbeat.py)"})
    heartbeat_timeout_s: float = field(default=3.0, metadata={"env": "TM_HEARTBEAT_TIMEOUT_S", "doc": "a process not heard from for this long is judged dead (frozen, cut off), fenced and replaced; see docs/recovery.md for the trade-off"})
    progress_timeout_s: float = field(default=5.0, metadata={"env": "TM_PROGRESS_TIMEOUT_S", "doc": "no step completed for max(this, TM_PROGRESS_STEPS x the median step): a rank the others wait on whose training thread idles is judged stuck"})
    progress_steps: float = field(default=10.0, metadata={"env": "TM_PROGRESS_STEPS", "doc": "see TM_PROGRESS_TIMEOUT_S: the stuck deadline in typical steps"})
    inject: tuple[str, ...] = field(default=(), metadata={"env": "TM_INJECT", "doc": "comma-separated fault injections: " + ", ".join(INJECTIONS)})
    slurm_backend: str = field(default="cli", metadata={"env": "TM_SLURM_BACKEND", "doc": "how the controller talks to Slurm: cli (scontrol, squeue, salloc, srun) or pyslurm (the Slurm C API, in a process of the controller's own, for job and node reads and updates, the CLI for the rest; needs pyslurm built against the cluster's Slurm: `make pyslurm`, Slurm 25.11; see docs/admin.md)"})
    run_dir: str = field(default="", metadata={"env": "TM_RUN_DIR", "doc": "output directory (default: <submit dir>/runs/<job id>)"})

    def __post_init__(self):
        checks = [
            (self.steps > 0, "TM_STEPS must be > 0"),
            (self.ranks_per_node > 0, "TM_RANKS_PER_NODE must be > 0"),
            (self.standbys == "auto" or (type(self.standbys) is int and self.standbys >= 0),
             f"TM_STANDBYS={self.standbys!r}: expected auto or an integer >= 0"),
            (type(self.injob_standbys) is int and self.injob_standbys >= 0, "TM_INJOB_STANDBYS must be an integer >= 0"),
            (self.standby_losses >= 0, "TM_STANDBY_LOSSES must be >= 0"),
            (self.poll_s > 0, "TM_POLL_S must be > 0"),
            (self.controller_restarts >= 0, "TM_CONTROLLER_RESTARTS must be >= 0"),
            (0 <= self.controller_successors <= 3, "TM_CONTROLLER_SUCCESSORS must be 0-3"),
            (self.controller_deadline_s >= 0.5, "TM_CONTROLLER_DEADLINE_S must be >= 0.5 (the controller beats every 0.25 s)"),
            (min(self.reconnect_timeout_s, self.phase1_timeout_s, self.group_timeout_s, self.switch_timeout_s, self.standby_wait_s, self.recovery_timeout_s,
                 self.standby_retry_s, self.release_timeout_s) > 0, "timeouts must be > 0"),
            (self.record_iterations >= 0, "TM_RECORD_ITERATIONS must be >= 0"),
            (0 < self.heartbeat_s and 2 * self.heartbeat_s <= self.heartbeat_timeout_s,
             "TM_HEARTBEAT_S must be > 0 and at most half of TM_HEARTBEAT_TIMEOUT_S (one late beat is no silence)"),
            (self.progress_timeout_s > 0 and self.progress_steps > 0, "TM_PROGRESS_TIMEOUT_S and TM_PROGRESS_STEPS must be > 0"),
            (self.shadow_steps >= 2, "TM_SHADOW_STEPS must be >= 2 (steadiness needs two steps to compare)"),
            (bool(self.reservation), "TM_RESERVATION must not be empty"),
            (bool(self.slurm_expansion_fix), "TM_SLURM_EXPANSION_FIX must not be empty (auto, a path, or off)"),
            (self.slurm_backend in ("cli", "pyslurm"), f"TM_SLURM_BACKEND={self.slurm_backend!r}: expected cli or pyslurm"),
            (self.device in ("auto", "cpu", "cuda"), f"TM_DEVICE={self.device!r}: expected auto, cpu or cuda"),
            (self.backend in ("auto", "gloo", "nccl"), f"TM_BACKEND={self.backend!r}: expected auto, gloo or nccl"),
            (not (self.device == "cpu" and self.backend == "nccl"), "TM_BACKEND=nccl needs TM_DEVICE=cuda"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        layout = (self.tp, self.pp, self.dp)
        if min(layout) < 0 or (any(layout) and not all(layout)):
            raise ConfigError(f"TM_TP, TM_PP, TM_DP = {layout}: set all three (>= 1) or none")
        if self.check_workload not in (0, 1) or self.check_steps < 1:
            raise ConfigError("TM_CHECK_WORKLOAD must be 0 or 1 and TM_CHECK_STEPS >= 1")
        if self.distributed_optimizer not in (0, 1):
            raise ConfigError("TM_DISTRIBUTED_OPTIMIZER must be 0 or 1")
        if self.distributed_optimizer and not self.tp:
            raise ConfigError("TM_DISTRIBUTED_OPTIMIZER needs a Megatron layout (TM_TP, TM_PP, TM_DP)")
        if self.record_from_step < 0 or self.record_versions < 1:
            raise ConfigError("TM_RECORD_FROM_STEP must be >= 0 and TM_RECORD_VERSIONS >= 1")
        if self.standby_warmup not in ("shadow", "cold"):
            raise ConfigError(f"TM_STANDBY_WARMUP={self.standby_warmup!r}: expected shadow or cold")
        parse_options(self.workload_options)
        if not 0 <= self.standby_nice <= 19 or self.standby_compile_threads < 0:
            raise ConfigError("TM_STANDBY_NICE must be in 0..19 and TM_STANDBY_COMPILE_THREADS >= 0")
        if self.snapshot_every < 0 or self.checkpoint_every < 0:
            raise ConfigError("TM_SNAPSHOT_EVERY and TM_CHECKPOINT_EVERY must be >= 0 (0: off)")
        parse_tiers(self.recovery_tiers)
        if self.rebalance_every_steps < 0:
            raise ConfigError("TM_REBALANCE_EVERY_STEPS must be >= 0")
        if self.straggler not in ("off", "report", "evict"):
            raise ConfigError(f"TM_STRAGGLER={self.straggler!r}: expected off, report or evict")
        if not (0 < self.straggler_threshold < 10 and self.straggler_windows >= 1 and self.straggler_window_steps >= 1
                and self.straggler_cooldown_s >= 0):
            raise ConfigError("TM_STRAGGLER_THRESHOLD must be in (0, 10); TM_STRAGGLER_WINDOWS and "
                              "TM_STRAGGLER_WINDOW_STEPS >= 1; TM_STRAGGLER_COOLDOWN_S >= 0")
        faults.parse(self.inject)  # ConfigError naming a malformed or unknown item

    def workload_kwargs(self) -> dict:
        """What the workload's constructor gets: only what the user set, i.e. the model preset
        when TM_MODEL is set, the parallel layout when one is set, and TM_WORKLOAD_OPTIONS.
        `workloads.registry.load` checks them against the constructor's keyword arguments."""
        if self.workload.startswith(SCRIPT_PREFIX):  # a script takes its own arguments, nothing else
            return {"argv": script_argv(self.script_args)}
        kwargs: dict = {"preset": self.model} if self.model else {}
        if self.tp:
            kwargs.update(tp=self.tp, pp=self.pp, dp=self.dp, distributed_optimizer=bool(self.distributed_optimizer))
        return {**kwargs, **parse_options(self.workload_options)}

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "Config":
        environ = os.environ if environ is None else environ
        by_env = {f.metadata["env"]: f for f in fields(cls)}
        unknown = sorted(k for k in environ if k.startswith("TM_") and k not in by_env and k not in _VARIABLES)
        if unknown:
            raise ConfigError(f"unknown TrainMover variable(s) {unknown}; known: {sorted(by_env)}")
        values = {}
        for env, f in by_env.items():
            if env in environ:
                values[f.name] = _parse(f, environ[env])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse(f, raw: str):
    env = f.metadata["env"]
    try:
        if f.name == "standbys" and raw.strip().lower() == "auto":
            return "auto"
        if f.type in ("int", int, "int | str"):
            return int(raw)
        if f.type in ("float", float):
            return float(raw)
        if f.name == "inject":
            return tuple(x.strip() for x in raw.split(",") if x.strip())
        return raw
    except ValueError:
        raise ConfigError(f"{env}={raw!r}: expected " + ("auto or an integer" if f.name == "standbys" else f.type)) from None


def describe() -> str:
    """The documentation table of every variable (used by `trainmover config --help`): the job's
    configuration, then the variables of TrainMover's processes, tools, debugging and tests."""
    rows = [f"{f.metadata['env']:<22} {str(f.default):<20} {f.metadata['doc']}" for f in fields(Config)]
    rows += ["", "Not part of a job's configuration:"]
    rows += [f"{v.env:<22} {v.group:<20} {v.doc}" for v in VARIABLES]
    return "\n".join(rows)
