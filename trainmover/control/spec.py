"""What the controller tells a worker or standby agent at launch (env `TM_WORKER_SPEC`): part of
the contract between controller and runtime (this package)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from trainmover.errors import ConfigError

ENV = "TM_WORKER_SPEC"


@dataclass(frozen=True)
class WorkerSpec:
    role: str                       # "worker" or "standby"
    ranks: tuple[int, ...]          # global ranks of this node (worker); () for a standby
    world_size: int
    node: str
    node_addr: str                  # this node's address, from Slurm
    controller: tuple[str, int]
    store: tuple[str, int]
    secret_file: str
    workload: str
    workload_options: dict = field(default_factory=dict)
    seed: int = 1234
    steps: int = 100
    group_timeout_s: float = 60.0   # deadline of every collective and rendezvous
    switch_timeout_s: float = 60.0  # joiner: longest wait for the leaver's state
    recovery_timeout_s: float = 120.0  # a stalled rank's longest wait for the controller's recovery plan
    reconnect_timeout_s: float = 60.0  # controller lost: how long to try reaching its successor
    heartbeat_s: float = 0.5        # a beat to the controller this often (runtime/heartbeat.py; 0: none)
    controller_file: str = ""       # controller.json on the run dir: where the controller is after a move
    shadow_steps: int = 6          # most shadow steps to reach a steady collective sequence
    inject: tuple[str, ...] = ()    # fault injection, see trainmover.faults (as this process sees it: faults.for_launch)
    record_iterations: int = 3      # iterations whose collectives the role ranks record (0: none)
    recording_dir: str = ""         # the job's HDF5 recordings, on its shared directory (see Workload.standby_roles)
    record_from_step: int = 0       # first recorded step (0: from the workload's construction on)
    record_versions: int = 4        # most recordings (a change of collective shapes starts a new one)
    standby_warmup: str = "shadow"  # shadow, or cold (benchmark baseline: no replay; compiled code dropped after the shadow steps)
    standby_nice: int = 0           # a standby's niceness while it warms up and waits (runtime/standby.py)
    standby_compile_threads: int = 0  # a standby's torch.compile workers (0: torch's default)
    snapshot_every: int = 0         # steps between in-memory snapshots (0: off), see runtime/snapshot.py
    checkpoint_every: int = 0       # steps between checkpoints (0: off), see runtime/checkpoint.py
    checkpoint_dir: str = ""        # on the job's shared directory
    ranks_per_node: int = 1         # a snapshot's holder is the same local index on the next node
    device: str = "auto"            # cpu, cuda or auto: resolved on the node, which knows its GPUs
    backend: str = "auto"           # gloo, nccl or auto

    def resolved(self) -> tuple[str, str]:
        """(device, backend) on this node."""
        import torch
        device = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        backend = self.backend if self.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
        return device, backend

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ=os.environ) -> "WorkerSpec":
        raw = environ.get(ENV)
        if not raw:
            raise ConfigError(f"{ENV} is not set: workers are started by the TrainMover controller")
        try:
            d = json.loads(raw)
            d["ranks"] = tuple(d["ranks"])
            d["controller"] = tuple(d["controller"])
            d["store"] = tuple(d["store"])
            d["inject"] = tuple(d.get("inject", ()))
            return cls(**d)
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"{ENV} is malformed: {exc}") from exc

    def my_rank(self, local_index: int) -> int | None:
        return self.ranks[local_index] if self.ranks else None
