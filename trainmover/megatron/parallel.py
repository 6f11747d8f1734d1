"""Megatron's `parallel_state` on the runtime's SwappableGroups.

`initialize_model_parallel` is run as shipped, except that each group it asks for is the
SwappableGroup of that rank set (built by the runtime from `layout.group_specs`), not a new
one. So every reference Megatron hands out (parallel_state globals, DDP, optimizer, p2p)
is a stable wrapper, and a migration swaps backends inside them: nothing is re-pointed.
"""
from __future__ import annotations

from unittest import mock

import torch.distributed as dist
from megatron.core import parallel_state

from trainmover.errors import ConfigError
from trainmover.megatron import c10d
from trainmover.megatron.layout import Layout, group_specs


def initialize(layout: Layout, rank: int, groups: dict, backend: str) -> None:
    """Point torch.distributed and parallel_state at `groups` (this rank's SwappableGroups,
    by name; must include every rank set of `layout` containing `rank`)."""
    # Only the layout's own groups: the runtime adds groups of its own (its per-step control
    # group spans every rank, as Megatron's pipeline or data-parallel group may), and traffic
    # Megatron sends there would bypass the recorder and, on GPUs, run over gloo.
    own = {spec.name for spec in group_specs(layout)}
    by_ranks = {tuple(g.global_ranks): g for name, g in groups.items() if name in own}
    c10d.install(groups["world"], list(groups.values()), backend)

    def create_group(ranks=None, timeout=None, backend=None, pg_options=None,
                     use_local_synchronization=False, group_desc=None):
        ranks = tuple(sorted(ranks))
        if rank not in ranks:
            return dist.GroupMember.NON_GROUP_MEMBER
        if ranks not in by_ranks:
            raise ConfigError(f"Megatron asks for group {group_desc} with ranks {list(ranks)}, which "
                              "trainmover.megatron.layout does not build (an unsupported Megatron option?)")
        return by_ranks[ranks]

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    with mock.patch.object(parallel_state, "create_group", create_group):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            create_gloo_process_groups=False)
