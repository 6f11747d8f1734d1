"""What the controller tells a worker or standby agent at launch (env `TM_WORKER_SPEC`): part of
the contract between controller and runtime (this package).

The spec holds the job's `Config` whole (`job`), as the controller decided it for this launch
(`from_config`: e.g. snapshot_every 0 where no snapshot could be used, the layout's ranks per
node), beside what only a launch has: the rank's place, the addresses, the files, the faults
this process injects. The JSON (`to_env`/`from_env`) is `asdict` of the dataclass, and
`Config` validates what it reads there as it validates the job's environment."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from trainmover import config
from trainmover.config import Config
from trainmover.errors import ConfigError
from trainmover.protocol import files

ENV = "TM_WORKER_SPEC"
_CONFIG_FIELDS = frozenset(f.name for f in fields(Config))


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
    job: Config = field(default_factory=Config)  # the job's configuration, with the controller's values for this launch
    workload_options: dict[str, Any] = field(default_factory=dict)  # Config.workload_kwargs(): what the constructor gets
    # TM_INJECT as this process sees it (faults.for_launch: e.g. a plain `die-in-warmup` marks
    # the standby the controller chose), not the job's own list, which `job.inject` keeps
    inject: tuple[str, ...] = ()
    controller_file: str = ""       # controller.json on the run dir: where the controller is after a move
    recording_dir: str = ""         # the job's HDF5 recordings, on its shared directory (see Workload.standby_roles)
    checkpoint_dir: str = ""        # on the job's shared directory
    # (device, inode) of the run directory the controller made and holds (files.dir_identity); ()
    # for launches without one. The files above lie in it: `held()` reaches them through it.
    run_dir_id: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, cfg: Config, *, inject: tuple[str, ...], **launch: Any) -> "WorkerSpec":
        """The spec of one launch: `cfg` with the controller's own values among `launch` (those
        named like a Config field, e.g. snapshot_every); workload_options is
        `cfg.workload_kwargs()` unless `launch` gives it; `inject` this launch's fault injections (faults.for_launch); the
        rest of `launch` (role, ranks, addresses, files) are the spec's own fields."""
        own_names = {f.name for f in fields(cls)}  # workload_options: the spec's own (the kwargs), not Config's text
        decided = {k: v for k, v in launch.items() if k in _CONFIG_FIELDS and k not in own_names}
        own = {"workload_options": cfg.workload_kwargs(),
               **{k: v for k, v in launch.items() if k not in decided}}
        job = dataclasses.replace(cfg, **decided) if decided else cfg
        return cls(job=job, inject=tuple(inject), **own)

    def resolved(self) -> tuple[str, str]:
        """(device, backend) on this node."""
        import torch
        device = self.job.device if self.job.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        backend = self.job.backend if self.job.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
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
            d["run_dir_id"] = tuple(d.get("run_dir_id", ()))
            job = dict(d.get("job", {}))
            job["inject"] = tuple(job.get("inject", ()))
            d["job"] = Config(**job)  # validated as the job's own environment is
            return cls(**d)
        except (ConfigError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ConfigError(f"{ENV} is malformed: {exc}") from exc

    def held(self) -> "WorkerSpec":
        """This spec with its files (key, controller.json, recordings, checkpoints) reached through
        the run directory held open (files.held_dir), after checking that it is still the one the
        controller made (`run_dir_id`): a `runs/` another user renamed and replaced since then is
        refused here (files.UnsafePath), before a byte is read or written there; one renamed
        later changes nothing this process reads or writes. Without `run_dir_id`: unchanged."""
        if not self.run_dir_id:
            return self
        root = Path(self.secret_file).parent
        at = files.held_dir(root, identity=self.run_dir_id)

        def through(path: str) -> str:
            if not path or not Path(path).is_relative_to(root):
                return path
            return str(at / Path(path).relative_to(root))

        return dataclasses.replace(self, secret_file=through(self.secret_file),
                                   controller_file=through(self.controller_file),
                                   recording_dir=through(self.recording_dir),
                                   checkpoint_dir=through(self.checkpoint_dir))

    def my_rank(self, local_index: int) -> int | None:
        return self.ranks[local_index] if self.ranks else None
