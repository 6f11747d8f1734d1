"""Where a vanished rank's state comes from: the choice among recovery tiers (pure).

Inputs: the tiers in order of preference (`TM_RECOVERY_TIERS`), the lost ranks, every live
rank's `stalled` report (steps complete, state digest, and in `holds`: its replica group's
ranks, the snapshot steps it holds of itself and of others) and the steps of the complete
checkpoints. Output: a `Choice`, or a `Stop` whose message names what each tier lacked.

* replica: every live rank's replica group holds every lost rank (a replica of the whole
  job, e.g. plain DDP); the state of the newest step S any live rank completed comes from one
  of them; nobody rolls back.
* snapshot: the newest step S that every live rank holds of itself and whose copy of each
  lost rank a live rank holds; every rank rolls back to S.
* checkpoint: the newest complete checkpoint; every rank rolls back to it.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Choice:
    tier: str
    step: int                     # every rank resumes here
    rolled_back: int = 0          # steps past `step` that a live rank had completed (redone)
    source: int = -1              # replica: the rank whose state is sent
    laggers: tuple[int, ...] = () # replica: live ranks behind `step`, which get the state too
    holders: dict[int, int] = field(default_factory=dict)  # snapshot: lost rank -> live rank holding its copy

    def to_json(self) -> dict:
        """What `status` shows as the migration's `state_source`."""
        out = {"tier": self.tier, "step": self.step, "rolled_back_steps": self.rolled_back}
        if self.tier == "replica":
            out.update(rank=self.source, laggers=list(self.laggers))
        if self.tier == "snapshot":
            out["holders"] = {str(r): h for r, h in sorted(self.holders.items())}
        return out


@dataclass(frozen=True)
class Stop:
    message: str


def _holds(report: dict) -> dict:
    return report.get("holds") or {}


def _replica(lost: tuple[int, ...], reports: dict[int, dict]) -> Choice | Stop | str:
    covered = all(set(lost) <= set(_holds(s).get("replicas", ())) for s in reports.values())
    if not covered:
        return "the workload's replica group does not hold every lost rank on every live rank"
    step = max(s["step"] for s in reports.values())
    at_step = [s for s in reports.values() if s["step"] == step]
    digests = {s["digest"] for s in at_step}
    if len(digests) != 1:  # no safe source: spreading one of them could spread a bad state
        return Stop(f"replicas that completed step {step} hold different states ({len(digests)} digests among "
                    f"ranks {sorted(s['rank'] for s in at_step)}): no safe source to recover from")
    laggers = tuple(sorted(s["rank"] for s in reports.values() if s["step"] < step))
    return Choice("replica", step, 0, min(s["rank"] for s in at_step), laggers)


def _snapshot(lost: tuple[int, ...], reports: dict[int, dict]) -> Choice | str:
    own = [set(_holds(s).get("own", ())) for s in reports.values()]
    common = set.intersection(*own) if own else set()
    newest = max(s["step"] for s in reports.values())
    for step in sorted(common, reverse=True):
        holders = {}
        for r in lost:
            having = [s["rank"] for s in reports.values() if step in _holds(s).get("held", {}).get(str(r), ())]
            if having:
                holders[r] = min(having)
        if len(holders) == len(lost):
            return Choice("snapshot", step, newest - step, holders=holders)
    held = {str(r): sorted({x for s in reports.values() for x in _holds(s).get("held", {}).get(str(r), ())})
            for r in lost}
    return (f"no step held by every live rank for itself and by a live rank for each lost rank "
            f"(held by all live ranks: {sorted(common)}; copies of the lost ranks held: {held})")


def _checkpoint(reports: dict[int, dict], checkpoints: list[int]) -> Choice | str:
    if not checkpoints:
        return "no complete checkpoint"
    step = max(checkpoints)
    return Choice("checkpoint", step, max(s["step"] for s in reports.values()) - step)


def choose(tiers: tuple[str, ...], lost: tuple[int, ...], reports: dict[int, dict],
           checkpoints: list[int]) -> Choice | Stop:
    """The first tier of `tiers` that can restore every lost rank. `reports`: live rank ->
    its `stalled` report (every live rank must have one); `checkpoints`: complete steps."""
    if not reports:
        return Stop("no live rank to recover from")
    why = {}
    for tier in tiers:
        if tier == "replica":
            got = _replica(lost, reports)
        elif tier == "snapshot":
            got = _snapshot(lost, reports)
        elif tier == "checkpoint":
            got = _checkpoint(reports, checkpoints)
        else:
            raise ValueError(f"unknown recovery tier {tier!r}")
        if not isinstance(got, str):
            return got
        why[tier] = got
    left_out = [t for t in ("replica", "snapshot", "checkpoint") if t not in tiers]
    return Stop(f"no recovery tier can restore rank(s) {list(lost)}: "
                + "; ".join(f"{t}: {w}" for t, w in why.items())
                + (f"; not tried (TM_RECOVERY_TIERS): {', '.join(left_out)}" if left_out else ""))


def snapshots_needed(tiers: tuple[str, ...], replica_ranks: tuple[int, ...] | None, world_size: int) -> bool:
    """Whether periodic snapshots can ever be used: not when the replica tier comes first and
    the workload's replica group spans the job (plain DDP), since then every lost rank has a
    live replica and a snapshot would only cost host memory and step time. `replica_ranks`:
    the ranks of the workload's replica group (None: it has none)."""
    if "snapshot" not in tiers:
        return False
    return not (tiers[0] == "replica" and replica_ranks is not None and len(replica_ranks) == world_size)

