"""What the controller believes about its job and its standbys: plain values, part of the
policy's durable state (controller/durable/state.py). Fields declared `transient` are not journaled: a
controller that takes over learns them again (each says how)."""
from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from trainmover.controller.durable.codec import transient
from trainmover.errors import ConfigError


class StandbyState(enum.StrEnum):
    """A standby's stance; changed only by controller/policy/standby_pool.py (its table of transitions)."""
    STARTING = "starting"   # launched, or back after an aborted join: its processes warm up
    READY = "ready"         # every process warm: may join a migration or a recovery
    WARMING = "warming"     # re-warming on a newer recording: not offered until ready again
    JOINING = "joining"     # taken by a migration or a recovery


@dataclass
class Standby:
    node: str
    state: StandbyState = StandbyState.STARTING
    # The rest a standby reports again to a controller that takes over (it starts as STARTING
    # there, controller/policy/takeover.py): nothing of it is journaled.
    since: float = transient("when it entered its state: the successor's clock starts afresh", default=0.0)
    warmup_s: float | None = transient("reported again with 'ready'", default=None)
    shadow_steps: int | None = transient("reported again with 'ready'", default=None)
    shadow: dict = transient("replay of recorded collectives (losses, equality): reported again with 'ready'",
                             default_factory=dict)
    warm: set = transient("local indices of its processes that reported 'ready': they report again",
                          default_factory=set)
    held: dict = transient("ward rank -> snapshot steps it holds (controller/policy/holder.py): reported again",
                           default_factory=dict)
    held_detail: dict = transient("its last held version (bytes, seconds): reported again", default_factory=dict)


@dataclass
class JobView:
    """What the controller believes about its job."""
    job_id: int
    world_size: int
    ranks_per_node: int
    batch_host: str
    rank_node: dict[int, str]
    standbys: dict[str, Standby] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    node_state: dict[str, str] = transient("Slurm's word for each node: polled again by a successor",
                                           default_factory=dict)

    def train_nodes(self) -> list[str]:
        return sorted(set(self.rank_node.values()), key=lambda n: min(r for r, m in self.rank_node.items() if m == n))

    def ranks_of(self, node: str) -> tuple[int, ...]:
        return tuple(sorted(r for r, n in self.rank_node.items() if n == node))


def came_back(job_nodes, view, leaving: set[str], keeper: str | None, fenced: set[str]) -> list[str]:
    """Nodes the journal has as released that Slurm lists in the job again, running no rank and
    no standby, neither leaving nor fenced: a grow that a controller made before it died, not
    journaled (a node released earlier, resumed, then taken again as a standby). Left as
    'released', such a node sat in the job unused, a warm successor controller went there, and
    a drain of it was ignored (the controller never handed over: the benchmark's last trial)."""
    busy = set(view.rank_node.values()) | set(view.standbys) | leaving | fenced | {keeper}
    return [n for n in job_nodes if n in view.released and n not in busy]


def split_in_job(nodes: Sequence[str], n: int, *, batch_host: str, features: Mapping[str, Iterable[str]],
                 train_feature: str) -> tuple[list[str], list[str]]:
    """The job's nodes (all but the keeper, in the controller's order: Slurm's) as (training
    nodes, in-job standbys) for TM_INJOB_STANDBYS=`n`: the standbys are the last `n` nodes that
    carry `train_feature` (every node, where none carries it: a cluster without features), never
    the batch host (it runs the batch script, and a shrink cannot release it). At least one
    training node must be left, or this is a ConfigError that says how many nodes to ask for."""
    nodes = list(nodes)
    if n <= 0:
        return nodes, []
    featured = any(train_feature in features.get(x, ()) for x in nodes)
    candidates = [x for x in nodes if x != batch_host and (not featured or train_feature in features.get(x, ()))]
    if n > len(candidates) or len(nodes) - n < 1:
        raise ConfigError(f"TM_INJOB_STANDBYS={n}: the job has {len(nodes)} training node(s) ({len(candidates)} of "
                          f"which could be standbys), too few to keep {n} standby(s) and train on at least one: ask "
                          f"for {n} more node(s) at submit (--nodes), or lower TM_INJOB_STANDBYS")
    standbys = candidates[-n:]
    return [x for x in nodes if x not in standbys], standbys
