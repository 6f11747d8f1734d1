"""What a training workload provides to the TrainMover runtime.

The runtime owns the loop, the groups and migrations; a workload owns the model. The same
class runs on live ranks and on standbys: a standby builds it against sandboxed groups,
runs shadow steps to warm up, and later receives a live rank's state.
"""
from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainmover.groups.specs import GroupSpec

if TYPE_CHECKING:  # a name only: this module loads no torch (the controller imports it)
    from trainmover.groups.swappable import SwappableGroup


@dataclass
class BuildContext:
    rank: int                      # global rank this process plays (a standby: the rank it rehearses)
    world_size: int
    groups: dict[str, SwappableGroup]
    seed: int
    options: dict[str, Any] = field(default_factory=dict)
    # Call between gradients and the optimizer step: raises if a collective of this step
    # failed. On GPUs an aborted NCCL kernel ends early without an error the host sees, and
    # an optimizer step on its gradients would spoil every replica at once.
    before_update: Callable[[], None] | None = None
    # What a script (trainmover/script) is told as torchrun would tell it, and its groups' hook.
    local_rank: int = 0                    # this process's index on its node (SLURM_LOCALID)
    local_world_size: int = 1              # ranks per node
    master: tuple[str, int] = ("127.0.0.1", 29500)  # MASTER_ADDR/PORT: the job's rendezvous store
    # new_group(name, ranks) -> the group (a SwappableGroup) or None for a non-member: a group a
    # script makes with dist.new_group, built and swapped by the runtime like its own
    new_group: Callable[..., SwappableGroup | None] | None = None


class Workload(abc.ABC):
    """Subclasses must be deterministic given (seed, rank, state): a migration is proven
    lossless by comparing digests with an uninterrupted run. docs/workloads.md says how to
    write one (examples/cnn/cnn.py is complete); `trainmover check-workload module:Class`
    tells whether a migration of it would be exact.

    Options: the constructor's keyword arguments are the options the workload accepts. It gets
    only those the user set (TM_WORKLOAD_OPTIONS; TM_MODEL as `preset`; TM_TP/TM_PP/TM_DP as
    `tp`/`pp`/`dp`); any other is an error at start naming it. Build nothing in the constructor:
    a standby constructs before it knows its rank."""

    def group_specs(self, world_size: int) -> list[GroupSpec]:
        return [GroupSpec("world", tuple(range(world_size)))]

    @abc.abstractmethod
    def build(self, ctx: BuildContext) -> None: ...

    def rebind(self, ctx: BuildContext) -> None:
        """A standby learned which rank it takes: re-point rank-dependent parts (group
        wrappers, data stream) at `ctx` while keeping warm model and optimizer objects.
        The default rebuilds everything, which is correct but cold."""
        self.build(ctx)

    @abc.abstractmethod
    def train_step(self, step: int) -> float:
        """Run iteration `step` (0-based) fully, optimizer step included; return the local loss."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything that decides future steps except the global RNGs and the step number,
        which the runtime adds (groups/rng.py: torch, CUDA, Python `random`, NumPy's global):
        model (buffers such as BatchNorm statistics included), optimizer, LR scheduler, data
        position and epoch order, the state of any generator object of the workload's own
        (`torch.Generator.get_state()`), counters. Key `model` is required, `optimizer`
        expected. Only tensors, numbers, strings, None and dicts/lists/tuples of them: the
        transfer decodes with torch.load(weights_only=True)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output. Copy model tensors in place (DDP holds them); the
        tensors of `state` may already be this workload's own (received in place)."""

    def replica_group(self) -> str | None:
        """The group whose members hold identical model and optimizer state (data parallel
        replicas), if everything else a step uses (data position, dropout RNG) is a function
        of (rank, step). Then a rank that vanished can be rebuilt from any live member of this
        group, and an interrupted step redone exactly. None: no such group (recovery from an
        unexpected failure then needs a checkpoint)."""
        return None

    def standby_roles(self, world_size: int) -> dict[str, int]:
        """The distinct roles a standby may be asked to take, each by a rank that plays it:
        those ranks record their collectives and a standby rehearses every role in turn,
        since it does not know which rank it will replace. Default: every rank does the
        same work (data parallel), one role. A workload with several roles must also drop its
        model in `release` and build it in `rebind` (a standby moves from role to role)."""
        return {"any": 0}

    def release(self) -> None:
        """Drop model and optimizer (a standby moving on to rehearse another role): the next
        `rebind` builds them again. Default: nothing to drop before a rebuild."""

    def shadow_data_step(self) -> int:
        """Step number a standby uses for shadow iterations (any valid one)."""
        return 0

    def collective_layout(self) -> str:
        """How this rank's wrappers lay out their collectives, where it is fixed at run time
        (DDP orders its gradient buckets by its first step's gradient order). A joiner
        whose layout differs from its leaver's would issue collectives that the stayers do
        not match; the migration is refused instead. Empty: nothing to compare."""
        return ""


def load_optimizer_in_place(opt: Any, state: dict[str, Any]) -> None:
    """Load an optimizer state whose tensors may already *be* the optimizer's own (the
    transfer received them in place into a warm standby's buffers). Then only the
    non-tensor parts are set; `Optimizer.load_state_dict` would copy every tensor again,
    doubling the joiner's memory and time at the switch."""
    import torch
    own = opt.state_dict()
    same = (own["state"].keys() == state["state"].keys() and all(
        all(v is own["state"][k].get(n) for n, v in s.items() if isinstance(v, torch.Tensor))
        for k, s in state["state"].items()))
    if not same:
        opt.load_state_dict(state)
        return
    for group, loaded in zip(opt.param_groups, state["param_groups"]):
        group.update({k: v for k, v in loaded.items() if k != "params"})
