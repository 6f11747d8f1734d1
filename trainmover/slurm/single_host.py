"""A single-host "allocation" for machines without Slurm (the lent GPU machines).

Each GPU is a node (`gpu0`, `gpu1`, ...): a step on a node is the worker process with
`CUDA_VISIBLE_DEVICES` set to that GPU; standbys are the GPUs beyond the training ones.
It implements the part of `SlurmClient` the controller uses, so the real controller,
policy and runtime run unchanged; only Slurm's own commands are absent (their cost is
measured on the local Slurm cluster instead). Used by the GPU benchmarks.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence

from trainmover.slurm.model import BatchHostRelease, JobInfo, NodeInfo, NoStandbyAvailable


class SingleHostAllocation:
    """`gpus` GPUs from `first_gpu` on, the first `train` of them training nodes. `host_gpus`: the
    GPUs of the whole host (default: the last one used), so that two allocations side by side
    (e.g. two one-GPU reference jobs) take different CPUs."""

    def __init__(self, gpus: int, train: int, work_dir: str, job_id: int = 1, first_gpu: int = 0,
                 host_gpus: int | None = None, share_gpu: bool = False, standby_gpu: int | None = None):
        """`share_gpu`: every 'node' runs on the one physical GPU `first_gpu` (a one-GPU machine:
        a worker and its standby side by side; nothing that puts two ranks of one NCCL
        communicator there, such as a planned migration's transfer pair, can run)."""
        if not 0 < train <= gpus:
            raise ValueError(f"need 0 < train ({train}) <= gpus ({gpus})")
        self.share_gpu = share_gpu
        # `standby_gpu`: the physical GPU every standby 'node' runs on, beside a worker (a host
        # with fewer GPUs than workers + standbys; a communicator of that worker and the standby
        # cannot be built there: NCCL refuses two ranks of one comm on one GPU)
        self.standby_gpu = standby_gpu
        self.host_gpus = host_gpus if host_gpus is not None else first_gpu + (1 if share_gpu else gpus)
        if first_gpu < 0 or first_gpu + (1 if share_gpu else gpus) > self.host_gpus:
            raise ValueError(f"GPUs {first_gpu}..{first_gpu + gpus - 1} are not on a host of {self.host_gpus}")
        self.all = [f"gpu{i}" for i in range(first_gpu, first_gpu + gpus)]
        self.in_job = self.all[:train]
        self.train = train
        self.work_dir, self.job_id = work_dir, job_id
        self.drained: set[str] = set()

    def job(self, job_id: int) -> JobInfo:
        return JobInfo(job_id, "RUNNING", tuple(self.in_job), self.in_job[0], 0, self.work_dir, "local",
                       len(self.in_job))

    def nodes(self, names: Sequence[str] | None = None) -> dict[str, NodeInfo]:
        out = {}
        for n in names if names is not None else self.all:
            word = "ALLOCATED" if n in self.in_job else "IDLE"  # Slurm's word for the node
            out[n] = NodeInfo(n, "127.0.0.1", word + ("+DRAIN" if n in self.drained else ""), "")
        return out

    def grow(self, job_id: int, *, reservation: str, partition: str | None = None, timeout: float = 30.0) -> str:
        free = [n for n in self.all if n not in self.in_job and n not in self.drained]
        if not free:
            raise NoStandbyAvailable(f"no free GPU left on this host for job {job_id}")
        self.in_job.append(free[0])
        return free[0]

    def shrink(self, job_id: int, keep: Sequence[str], job: JobInfo | None = None) -> list[str]:
        if self.in_job[0] not in keep:
            raise BatchHostRelease(f"{self.in_job[0]} runs the controller")
        gone = [n for n in self.in_job if n not in keep]
        self.in_job = [n for n in self.in_job if n in keep]
        return gone

    def hostnames(self, nodelist_expr: str) -> list[str]:
        return [n for n in nodelist_expr.split(",") if n]  # its names are plain: gpu0,gpu1

    def drain(self, node: str, reason: str) -> None:
        self.drained.add(node)

    def resume(self, node: str) -> None:
        self.drained.discard(node)

    def capabilities(self, job_id: int, reservation: str, expansion_fix: str = "auto"):
        """Everything: the allocation is this process's own (its "drain" is a set of names; its
        "grow" takes a GPU of this host, no Slurm job expansion)."""
        from trainmover.slurm.rights import Capabilities
        return Capabilities(user=str(os.getuid()), grow=True, shrink=True, drain=True)

    def free_standbys(self, reservation: str) -> list[str]:
        return [n for n in self.reservation_nodes(reservation) if n not in self.drained]

    def reservation_nodes(self, reservation: str) -> list[str]:
        """The host's GPUs outside the job: its "reservation"."""
        return [n for n in self.all if n not in self.in_job]

    def kill_steps(self, job_id: int, node: str, names: Sequence[str] = ()) -> list[str]:
        return []  # no Slurm steps: the controller kills the process it started

    def cancel_donors(self, job_id: int) -> list[int]:
        return []  # grow() takes a GPU at once: no request is ever pending

    def step_argv(self, job_id: int, node: str, argv: Sequence[str], *, ntasks: int = 1,
                  env_overrides: Mapping[str, str] | None = None, name: str = "") -> list[str]:
        if ntasks != 1:
            raise ValueError("single-host allocation: one rank per GPU node")
        gpu = (self.all[0] if self.share_gpu else node).removeprefix("gpu")
        if self.standby_gpu is not None and node not in self.all[:self.train]:
            gpu = str(self.standby_gpu)
        # Each "node" keeps its own compile caches, as a separate machine would: a joiner must
        # not find kernels that a worker compiled on the same host (warm-up would look free).
        caches = os.path.join(self.work_dir, "compile-cache", node)
        extra = [f"TORCHINDUCTOR_CACHE_DIR={caches}/inductor", f"TRITON_CACHE_DIR={caches}/triton",
                 *(f"{k}={v}" for k, v in (env_overrides or {}).items())]
        return [*self._own_cpus(node), "env", f"CUDA_VISIBLE_DEVICES={gpu}", f"SLURMD_NODENAME={node}", *extra,
                *map(str, argv)]

    def _own_cpus(self, node: str) -> list[str]:
        """`taskset` to this node's share of the host's CPUs, as a separate machine has its own:
        a standby compiling its shadow iterations must not take the workers' cores. Shares are
        whole physical cores (hyperthread siblings stay together: a standby on one sibling slows
        a worker on the other). Nothing where taskset is missing or there are fewer cores than
        GPUs."""
        if shutil.which("taskset") is None:
            return []
        cpus = cpu_share(physical_cores(), self.host_gpus, int(node.removeprefix("gpu")))
        return ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []

    def step_env(self, job: JobInfo, base: Mapping[str, str] | None = None) -> dict[str, str]:
        return dict(base if base is not None else os.environ)


def physical_cores(cpus: list[int] | None = None, topology: str = "/sys/devices/system/cpu") -> list[list[int]]:
    """The CPUs this process may use, grouped by physical core (package, core id), in order."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    cores: dict[tuple[int, int], list[int]] = {}
    for c in cpus:
        try:
            with open(f"{topology}/cpu{c}/topology/physical_package_id") as f:
                package = int(f.read())
            with open(f"{topology}/cpu{c}/topology/core_id") as f:
                core = int(f.read())
        except (OSError, ValueError):  # no topology (some VMs): each CPU its own core
            package, core = 0, c
        cores.setdefault((package, core), []).append(c)
    return [cores[k] for k in sorted(cores, key=lambda k: min(cores[k]))]


def cpu_share(cores: list[list[int]], parts: int, index: int) -> list[int]:
    """The CPUs of part `index` of `parts` equal shares of whole cores ([] if a share is empty)."""
    share = len(cores) // parts
    if share < 1 or not 0 <= index < parts:
        return []
    return sorted(c for core in cores[index * share:(index + 1) * share] for c in core)
