"""Where a vanished rank's state comes from: the choice among recovery tiers (pure).

Inputs: the tiers in order of preference (`TM_RECOVERY_TIERS`), the lost ranks, every live
rank's `stalled` report (steps complete, state digest, and in `holds`: its replica group's
ranks, the snapshot steps it holds of itself and of others) and the steps of the complete
checkpoints. Output: a `Choice`, or a `Stop` whose message names what each tier lacked.

* replica: every live rank's replica group holds every lost rank (a replica of the whole
  job, e.g. plain DDP); the state of the newest step S any live rank completed comes from one
  of them; nobody rolls back.
* snapshot: the newest step S that every live rank holds of itself and whose copy of each
  lost rank a live rank, or the joiner itself, holds (a one-node job's standby holds them:
  controller/policy/holder.py); every rank rolls back to S. With no live rank at all (one worker) the
  joiner's copies decide alone.
* checkpoint: the newest complete checkpoint; every rank rolls back to it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from trainmover.protocol.messages import JOINER  # noqa: F401 - `holders`: the joiner holds the copy itself


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
            out["holders"] = {str(r): ("joiner" if h == JOINER else h) for r, h in sorted(self.holders.items())}
        return out


@dataclass(frozen=True)
class Stop:
    message: str


def _holds(report: dict) -> dict:
    return report.get("holds") or {}


def _newest(reports: dict[int, dict], completed: int | None) -> int:
    """The most steps any rank completed: live ranks' reports, and what the controller saw."""
    return max([s["step"] for s in reports.values()] + ([completed] if completed is not None else []), default=0)


def _replica(lost: tuple[int, ...], reports: dict[int, dict]) -> Choice | Stop | str:
    if not reports:
        return "no live rank: nobody holds a replica"
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


def _snapshot(lost: tuple[int, ...], reports: dict[int, dict], joiner: dict[int, list[int]],
              completed: int | None) -> Choice | str:
    own = [set(_holds(s).get("own", ())) for s in reports.values()]
    # no live rank: nobody rolls back, any step the joiner holds of every lost rank will do
    common = set.intersection(*own) if own else {x for r in lost for x in joiner.get(r, ())}
    newest = _newest(reports, completed)
    for step in sorted(common, reverse=True):
        holders = {}
        for r in lost:
            if step in joiner.get(r, ()):  # preferred: its own copy, nothing on the wire
                holders[r] = JOINER
                continue
            having = [s["rank"] for s in reports.values() if step in _holds(s).get("held", {}).get(str(r), ())]
            if having:
                holders[r] = min(having)
        if len(holders) == len(lost):
            return Choice("snapshot", step, max(0, newest - step), holders=holders)
    held = {str(r): sorted({x for s in reports.values() for x in _holds(s).get("held", {}).get(str(r), ())}
                           | set(joiner.get(r, ()))) for r in lost}
    return (f"no step held by every live rank for itself and by a live rank or the joiner for each lost rank "
            f"(held by all live ranks: {sorted(common) if own else 'no live rank'}; copies of the lost ranks "
            f"held: {held})")


def _checkpoint(reports: dict[int, dict], checkpoints: list[int], completed: int | None) -> Choice | str:
    if not checkpoints:
        return "no complete checkpoint"
    step = max(checkpoints)
    return Choice("checkpoint", step, max(0, _newest(reports, completed) - step))


def choose(tiers: tuple[str, ...], lost: tuple[int, ...], reports: dict[int, dict],
           checkpoints: list[int], joiner: dict[int, list[int]] | None = None,
           completed: int | None = None) -> Choice | Stop:
    """The first tier of `tiers` that can restore every lost rank. `reports`: live rank ->
    its `stalled` report (every live rank must have one; none when no rank is left);
    `checkpoints`: complete steps; `joiner`: lost rank -> snapshot steps the joiner itself
    holds of it; `completed`: the most steps the controller saw any rank complete."""
    joiner = joiner or {}
    why = {}
    for tier in tiers:
        if tier == "replica":
            got = _replica(lost, reports)
        elif tier == "snapshot":
            got = _snapshot(lost, reports, joiner, completed)
        elif tier == "checkpoint":
            got = _checkpoint(reports, checkpoints, completed)
        else:
            raise ValueError(f"unknown recovery tier {tier!r}")
        if not isinstance(got, str):
            return got
        why[tier] = got
    left_out = [t for t in ("replica", "snapshot", "checkpoint") if t not in tiers]
    return Stop(f"no recovery tier can restore rank(s) {list(lost)}: "
                + "; ".join(f"{t}: {w}" for t, w in why.items())
                + (f"; not tried (TM_RECOVERY_TIERS): {', '.join(left_out)}" if left_out else ""))


def snapshots_needed(tiers: tuple[str, ...], replica_ranks: tuple[int, ...] | None, world_size: int,
                     ranks_per_node: int = 1) -> bool:
    """Whether periodic snapshots can ever be used: not when the replica tier comes first and
    the workload's replica group spans the job (plain DDP) over more than one node, since then
    every lost node leaves a live replica and a snapshot would only cost host memory and step
    time. A replica group within one node (a one-node job) dies with the node: snapshots then.
    `replica_ranks`: the ranks of the workload's replica group (None: it has none)."""
    if "snapshot" not in tiers:
        return False
    spans_nodes = replica_ranks is not None and len({r // ranks_per_node for r in replica_ranks}) > 1
    return not (tiers[0] == "replica" and replica_ranks is not None and len(replica_ranks) == world_size
                and spans_nodes)

