"""The TP x PP x DP layout of a Megatron job and the process groups it implies: pure logic.

Megatron's `initialize_model_parallel` creates one group per rank set it derives from the
layout (tp, pp, dp, tp-pp = model parallel, embedding, ...). The runtime must build each of
those groups as a SwappableGroup *before* Megatron runs, so the same rank sets are derived
here, with Megatron's own `RankGenerator` (its public rank arithmetic, order tp-cp-ep-dp-pp).
Rank sets that several Megatron groups share become one group: a group object serves every
collective of its members in program order, whatever name Megatron gives it.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainmover.errors import ConfigError
from trainmover.groups.specs import GroupSpec

ORDER = "tp-cp-ep-dp-pp"  # Megatron's default rank order
# Rank-set kinds initialize_model_parallel (0.16.1) builds with cp = ep = 1, in its own words.
TOKENS = ("tp", "pp", "dp", "tp-pp", "tp-dp", "cp", "ep")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int

    def __post_init__(self):
        if min(self.tp, self.pp, self.dp) < 1:
            raise ConfigError(f"megatron layout TP={self.tp} PP={self.pp} DP={self.dp}: every size must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def check(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ConfigError(f"megatron layout TP={self.tp} x PP={self.pp} x DP={self.dp} = {self.world_size} "
                              f"ranks, but the job has {world_size} (nodes x ranks per node)")

    def coords(self, rank: int) -> dict[str, int]:
        """tp, dp and pp rank of a global rank (order tp-cp-ep-dp-pp: tp varies fastest)."""
        return {"tp": rank % self.tp, "dp": rank // self.tp % self.dp, "pp": rank // (self.tp * self.dp)}

    def rank_sets(self) -> dict[str, list[tuple[int, ...]]]:
        from megatron.core.parallel_state import RankGenerator
        gen = RankGenerator(tp=self.tp, ep=1, dp=self.dp, pp=self.pp, cp=1, order=ORDER)
        sets = {token: [tuple(sorted(r)) for r in gen.get_ranks(token)] for token in TOKENS}
        # Word embeddings live on the first and last stage, position embeddings on the first.
        sets["embd"] = [tuple(sorted({p[0], p[-1]})) for p in sets["pp"]]
        sets["pos-embd"] = [(p[0],) for p in sets["pp"]]
        sets["world"] = [tuple(range(self.world_size))]
        return sets


def group_specs(layout: Layout) -> list[GroupSpec]:
    """One GroupSpec per distinct rank set, named after the first kind that needs it
    (`tp.0`, `pp.1`, `embd.0`; `world` for all ranks). A pipeline group of several stages is
    marked `p2p` (its stages send to their neighbours), whatever name it took (`world` in a
    PP-only layout)."""
    by_ranks: dict[tuple[int, ...], str] = {}
    sets = layout.rank_sets()
    by_ranks[sets.pop("world")[0]] = "world"
    pipelines = {ranks for ranks in sets["pp"] if len(ranks) > 1}
    for token, rank_sets in sets.items():
        for i, ranks in enumerate(rank_sets):
            by_ranks.setdefault(ranks, f"{token}.{i}")
    return [GroupSpec(name, ranks, p2p=ranks in pipelines) for ranks, name in by_ranks.items()]
