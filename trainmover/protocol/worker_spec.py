"""What the controller tells a worker or standby agent at launch (env `TM_WORKER_SPEC`): part of
the contract between controller and runtime (this package).

Most fields are the job's configuration as a rank needs it: they have the name of a `Config`
field, take its default from there (the one place a default lives) and are copied from the
job's `Config` by `WorkerSpec.from_config`, which is how the controller builds every spec. The
JSON (`to_env`/`from_env`) is `asdict` of the dataclass: a field missing from it gets the
default, so a spec written by hand (tests) needs only the launch fields."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from trainmover import config
from trainmover.config import Config
from trainmover.errors import ConfigError

ENV = "TM_WORKER_SPEC"
_CONFIG = {f.name: f for f in fields(Config)}


def _default(name: str) -> Any:
    """Config's default of its field `name`."""
    f = _CONFIG[name]
    assert f.default is not MISSING, f"Config.{name} has no plain default"
    return f.default


def _from_config(name: str) -> Any:
    """A spec field that `from_config` copies from the job's Config field of the same name."""
    return field(default=_default(name), metadata={"config": True})


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
    workload: str = _from_config("workload")
    workload_options: dict[str, Any] = field(default_factory=dict)  # Config.workload_kwargs(): what the constructor gets
    seed: int = _from_config("seed")
    steps: int = _from_config("steps")
    group_timeout_s: float = _from_config("group_timeout_s")        # deadline of every collective and rendezvous
    switch_timeout_s: float = _from_config("switch_timeout_s")      # joiner: longest wait for the leaver's state
    recovery_timeout_s: float = _from_config("recovery_timeout_s")  # a stalled rank's longest wait for the recovery plan
    reconnect_timeout_s: float = _from_config("reconnect_timeout_s")  # controller lost: how long to try its successor
    heartbeat_s: float = _from_config("heartbeat_s")  # a beat to the controller this often (runtime/heartbeat.py; 0: none)
    controller_file: str = ""       # controller.json on the run dir: where the controller is after a move
    shadow_steps: int = _from_config("shadow_steps")  # most shadow steps to reach a steady collective sequence
    inject: tuple[str, ...] = _default("inject")  # fault injection as this process sees it (faults.for_launch)
    record_iterations: int = _from_config("record_iterations")  # iterations the role ranks record (0: none)
    recording_dir: str = ""         # the job's HDF5 recordings, on its shared directory (see Workload.standby_roles)
    record_from_step: int = _from_config("record_from_step")  # first recorded step (0: from construction on)
    record_versions: int = _from_config("record_versions")    # most recordings (new collective shapes: a new one)
    standby_warmup: str = _from_config("standby_warmup")      # shadow, or cold (benchmark baseline)
    standby_nice: int = _from_config("standby_nice")          # a standby's niceness while it warms up (runtime/standby.py)
    standby_compile_threads: int = _from_config("standby_compile_threads")  # torch.compile workers (0: torch's default)
    snapshot_every: int = _from_config("snapshot_every")      # steps between in-memory snapshots (0: off), runtime/snapshot.py
    checkpoint_every: int = _from_config("checkpoint_every")  # steps between checkpoints (0: off), runtime/checkpoint.py
    checkpoint_dir: str = ""        # on the job's shared directory
    ranks_per_node: int = _from_config("ranks_per_node")  # a snapshot's holder is the same local index on the next node
    device: str = _from_config("device")    # cpu, cuda or auto: resolved on the node, which knows its GPUs
    backend: str = _from_config("backend")  # gloo, nccl or auto

    @classmethod
    def from_config(cls, cfg: Config, *, inject: tuple[str, ...], **launch: Any) -> "WorkerSpec":
        """The spec of one launch: every field marked `config` has `cfg`'s value unless `launch`
        gives the controller's own (e.g. snapshot_every, 0 where no snapshot could be used),
        workload_options is `cfg.workload_kwargs()`; `launch` gives the rest (role, ranks,
        addresses, files) and `inject` this launch's fault injections (faults.for_launch)."""
        copied = {f.name: getattr(cfg, f.name) for f in fields(cls) if f.metadata.get("config")}
        return cls(**{**copied, "workload_options": cfg.workload_kwargs(), "inject": tuple(inject), **launch})

    def resolved(self) -> tuple[str, str]:
        """(device, backend) on this node."""
        import torch
        device = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        backend = self.backend if self.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
        return device, backend

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "WorkerSpec":
        raw = config.setting(ENV, environ)
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
