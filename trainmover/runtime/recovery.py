"""Recovery from an unexpected failure, on the ranks that survived and on the standby.

The controller revokes the groups of a vanished rank (every collective with it fails at once),
collects each live rank's `stalled` report (steps complete, state digest) and sends one plan,
`recover`: the epoch, the failed ranks, the step S to resume from, a `source` rank that has
completed S, and the `needers` (each standby taking a failed rank, and any rank that had not
completed S). Everyone then builds the replacement groups (same delta as a planned migration),
the source sends its state to each needer over a verified transfer pair, and every rank swaps
its groups and resumes at S.

Why this is exact: the workload's model and optimizer are identical on the replicas of its
`replica_group`, and the rest of a step (data, dropout) is a function of (rank, step). A step
that some rank had not completed is redone by it from the state of a rank that had, so no
step is applied twice or skipped.
"""
from __future__ import annotations

import logging
import time

from trainmover.errors import MigrationError
from trainmover.runtime import phase1, transfer
from trainmover.runtime.plan import delta

log = logging.getLogger("trainmover.recovery")


def rebuild(agent, msg: dict, role: str) -> tuple[dict, dict]:
    """Build the replacement backends and run this rank's part of the state copy.
    Returns (new backends by group name, report fields). Deadlines: every rendezvous and
    transfer is bounded by the group timeout the builder was configured with."""
    t0 = time.perf_counter()
    epoch, step, source = msg["epoch"], msg["step"], msg["source"]
    plan = delta(agent.specs, msg["failed"], epoch)
    replica = agent.workload.replica_group()
    if replica is None:
        raise MigrationError(f"workload {agent.spec.workload!r} names no replica group: a vanished rank's "
                             "state can only come from a checkpoint", phase="recover", rank=agent.rank)
    backends = {g.name: agent.build_backend(g.name, plan.prefix(g), g.ranks.index(agent.rank), len(g.ranks))
                for g in plan.groups_to_build(agent.rank)}
    built_s = time.perf_counter() - t0
    report = {"role": role, "build_s": built_s, "groups": sorted(backends), "source": source}
    if agent.rank == source:
        corrupt = "corrupt-transfer" in agent.spec.inject
        for needer in msg["needers"]:
            pair = agent.build_backend("xfer", phase1.xfer_prefix(epoch, needer), 0, 2)
            stats = transfer.send_verified(agent.replica_state(step), pair, dst=1, corrupt=corrupt)
            agent.retire(pair, step)
            report.setdefault("sent", []).append({"to": needer, "bytes": stats.bytes, "seconds": stats.seconds,
                                                  "attempts": stats.attempts})
    elif agent.rank in msg["needers"]:
        pair = agent.build_backend("xfer", phase1.xfer_prefix(epoch, agent.rank), 1, 2)
        state, stats = transfer.recv_verified(pair, src=0, like=agent.replica_state(step))
        if int(state["step"]) != step:
            raise MigrationError(f"source sent the state of step {state['step']}, not {step}", phase="recover",
                                 rank=agent.rank)
        agent.workload.load_state_dict(state["workload"])
        agent.retire(pair, step)
        report.update(recv_bytes=stats.bytes, recv_s=stats.seconds, attempts=stats.attempts)
    report["seconds"] = time.perf_counter() - t0
    log.info("recovery epoch %d: rank %d (%s) ready to resume at step %d in %.3fs", epoch, agent.rank, role, step,
             report["seconds"])
    return backends, report
