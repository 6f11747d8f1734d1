"""The job's swappable groups as torch.distributed's own world, for a script (script mode).

A script written for torchrun calls `dist.get_rank()`, builds `DDP(model)` and a
`DistributedSampler(ds)` on the default group, and may call `dist.all_reduce(t)`,
`dist.barrier()` or `dist.new_group(ranks)`. Here the runtime's `world` group (a
SwappableGroup, whose backend a migration replaces underneath) becomes the default group,
every group is entered in c10d's registry, the variables torchrun sets are set, and
`dist.new_group` makes a group the runtime builds and swaps like its own.
"""
from __future__ import annotations

import os
import sys

import torch.distributed as dist

from trainmover.errors import ConfigError
from trainmover.megatron import c10d
from trainmover.groups.swappable import SwappableGroup
from trainmover.slurm.job_env import JobEnv

_made: list = []  # the ranks of each group the script made, in order (the same on every rank and run)
_original_destroy = dist.destroy_process_group


def prepare(ctx) -> None:
    """Before a run of the script: the default group and the torchrun variables of `ctx`'s rank."""
    _reset_frameworks()
    groups = ctx.groups
    world = groups["world"]
    c10d.install(world, list(groups.values()), "nccl" if ctx.options.get("device") == "cuda" else "gloo")
    master_addr, master_port = ctx.master
    os.environ.update({"RANK": str(ctx.rank), "WORLD_SIZE": str(ctx.world_size), "LOCAL_RANK": str(ctx.local_rank),
                       "LOCAL_WORLD_SIZE": str(ctx.local_world_size), "MASTER_ADDR": str(master_addr),
                       "MASTER_PORT": str(master_port), "GROUP_RANK": str(ctx.rank // max(ctx.local_world_size, 1)),
                       # torchrun's too: frameworks read it as "launched by torchrun, the processes exist"
                       # (Lightning's TorchElasticEnvironment, ahead of its SLURMEnvironment)
                       "TORCHELASTIC_RUN_ID": str(JobEnv.read().job_id or "trainmover")})
    _made.clear()
    dist.new_group = lambda ranks=None, *args, **kwargs: _new_group(ctx, ranks, kwargs)
    dist.destroy_process_group = _destroy
    dist.broadcast_object_list, dist.all_gather_object = _broadcast_object_list, _all_gather_object


def _destroy(group=None) -> None:
    """`dist.destroy_process_group()` in a script (at its end, or Megatron's
    destroy_model_parallel): the job's groups are the runtime's, which outlive any one run of
    the script and are released by the runtime; a group of another kind is destroyed as usual."""
    if group is None or isinstance(group, SwappableGroup) or group is dist.GroupMember.NON_GROUP_MEMBER:
        return
    _original_destroy(group)


# Object collectives while the run is not live (a standby's or a re-entry's set-up): the sandbox
# answers a tensor broadcast by leaving the buffer as it is, but a rank other than the source
# unpickles that buffer (garbage). There each rank sees its own objects instead, as if it were
# the source: a framework's `broadcast(obj)` (Lightning's log_dir, paths) returns the rank's own.
_original_broadcast_object_list, _original_all_gather_object = dist.broadcast_object_list, dist.all_gather_object


def _not_live() -> bool:
    from trainmover.script.run import current
    run = current()
    return run is not None and run.mode != "live"


def _broadcast_object_list(object_list, src=None, group=None, device=None, **kwargs):
    if not _not_live():
        return _original_broadcast_object_list(object_list, src, group=group, device=device, **kwargs)
    # Not live: the collectives still run (a standby replaying the live rank's recording must issue
    # the same sequence: size, then data), but each rank keeps its own objects.
    own = list(object_list)
    try:
        _original_broadcast_object_list(object_list, src, group=group, device=device, **kwargs)
    except Exception:  # noqa: BLE001 - the sandbox's answer may not unpickle; the rank's own objects stand
        pass
    object_list[:] = own
    return None


def _all_gather_object(object_list, obj, group=None):
    if not _not_live():
        return _original_all_gather_object(object_list, obj, group=group)
    try:  # the same sequence of collectives as a live rank's (see _broadcast_object_list)
        _original_all_gather_object(object_list, obj, group=group)
    except Exception:  # noqa: BLE001
        pass
    object_list[:] = [obj] * len(object_list)
    return None


def _new_group(ctx, ranks, kwargs):
    """`dist.new_group(ranks)` in a script: the k-th call of a run is the runtime's group
    `script{k}` (built with the others at launch, swapped at every migration), made by the
    runtime's hook on first use; a rank outside it gets torch's NON_GROUP_MEMBER."""
    ranks = tuple(range(ctx.world_size)) if ranks is None else tuple(sorted(int(r) for r in ranks))
    if not ranks or ranks[-1] >= ctx.world_size:
        raise ConfigError(f"dist.new_group({list(ranks)}): ranks must lie in 0..{ctx.world_size - 1}")
    name = f"script{len(_made)}"
    _made.append(ranks)
    if ctx.new_group is None:
        raise ConfigError(f"dist.new_group({list(ranks)}) is not supported here (no runtime hook to build it): "
                          "use the default group")
    group = ctx.new_group(name, ranks)
    if group is None:
        return dist.GroupMember.NON_GROUP_MEMBER
    c10d.register(group, "nccl" if ctx.options.get("device") == "cuda" else "gloo")
    return group


def _reset_frameworks() -> None:
    """A fresh run of the script sets up again what a process sets up once: Megatron's
    parallel_state refuses a second initialize_model_parallel while its globals are set."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
