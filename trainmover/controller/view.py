"""What the controller believes about its job and its standbys: plain values that the policy
and its parts (recovery, resume, standby loss) read and change."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Standby:
    node: str
    state: str = "starting"       # starting -> ready -> joining; back to ready if a migration aborts;
                                  # ready -> warming -> ready when it re-warms on a newer recording
    since: float = 0.0
    warmup_s: float | None = None
    shadow_steps: int | None = None
    shadow: dict = field(default_factory=dict)   # replay of recorded collectives: losses, equality
    warm: set = field(default_factory=set)       # local indices of its processes that reported 'ready'
    held: dict = field(default_factory=dict)     # ward rank -> snapshot steps it holds (controller/holder.py)
    held_detail: dict = field(default_factory=dict)  # its last version: bytes, seconds


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
    node_state: dict[str, str] = field(default_factory=dict)   # Slurm's word for each node

    def train_nodes(self) -> list[str]:
        return sorted(set(self.rank_node.values()), key=lambda n: min(r for r, m in self.rank_node.items() if m == n))

    def ranks_of(self, node: str) -> tuple[int, ...]:
        return tuple(sorted(r for r, n in self.rank_node.items() if n == node))
