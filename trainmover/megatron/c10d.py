"""The one place that touches torch.distributed's private registry (torch 2.11 and 2.13).

Megatron calls `torch.distributed.*(..., group=g)` and `get_rank()` / `get_world_size()`.
Those work only for groups c10d knows: it maps a group object to its global ranks
(`_world.pg_group_ranks`) and needs a default group. Our groups are SwappableGroups built
by the runtime, not by `new_group`, so they are entered here by hand: the world group
becomes the default group and every group gets its rank map. The dictionaries written are
the ones `new_group` itself fills, present with the same meaning in torch 2.11 and 2.13;
`_register_pg_in_world` (2.13 only) is deliberately not used.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_registered: list = []


def install(world, groups, backend: str) -> None:
    """Make `world` the default group and register `groups` (SwappableGroups, world among
    them). Replaces what a previous call installed (a standby rebinding to its rank)."""
    uninstall()
    c10d._update_default_pg(world)
    for g in {id(g): g for g in groups}.values():
        register(g, backend)


def register(g, backend: str) -> None:
    """Enter one SwappableGroup `g` in c10d's registry (a group made after `install`)."""
    if g in _registered:
        return
    c10d._world.pg_map[g] = (backend, dist.HashStore())  # c10d wants a store per group; ours build their own backends
    c10d._world.pg_names[g] = f"tm:{g.group_name_}"
    c10d._world.pg_group_ranks[g] = {glob: i for i, glob in enumerate(g.global_ranks)}
    c10d._world.pg_backend_config[g] = backend
    c10d._world.pg_to_tag[g] = f"ptd:tm:{g.group_name_}"
    c10d._world.tags_to_pg.setdefault(c10d._world.pg_to_tag[g], []).append(g)
    _registered.append(g)


def uninstall() -> None:
    for g in _registered:
        for table in (c10d._world.pg_map, c10d._world.pg_names, c10d._world.pg_group_ranks,
                      c10d._world.pg_backend_config):
            table.pop(g, None)
        tag = c10d._world.pg_to_tag.pop(g, None)
        if tag is not None:
            c10d._world.tags_to_pg.pop(tag, None)
    _registered.clear()
    if c10d._world.default_pg is not None:
        c10d._update_default_pg(None)
