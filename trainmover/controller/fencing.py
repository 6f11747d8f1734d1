"""Where a fenced node goes (controller/policy/liveness.py judges a process dead; the executor kills
its step and drains its node). A fenced node must never go back into service undrained: a
node released from the job returns to Slurm's pool (or the standby reservation), and the next
job would get a node that hung. So a fenced node leaves the job only once drained; when the
job's user may not drain (slurm/rights.py: not root, SlurmUser or an operator) or the drain
fails, the node is held: it stays in the job, runs nothing, is never a standby, and goes back
to Slurm only when the job ends, drained there where the site runs the health check as its
Epilog (--fence-record: healthcheck/fence_record.py, docs/admin.md).

Pure: the executor reports each fence's drain result and passes its actions through
`route()`, which holds back the release of a node whose drain is pending or refused.

    f = FencedNodes(may_drain=False, why_not="tmuser is not root ...")
    f.fence("train2", "stuck")              # -> False: do not try to drain
    kept, held = f.route([ReleaseNode("train2"), ...])   # the release is withheld; held: [("train2", why)]
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from trainmover.controller.policy.actions import ReleaseNode
from trainmover.controller.slurm_work import Fenced
from trainmover.errors import SlurmError

PENDING, DRAINED, HELD = "drain pending", "drained", "held"


@dataclass
class FencedNode:
    node: str
    reason: str                 # why it was fenced
    state: str = PENDING        # PENDING -> DRAINED | HELD
    held: str = ""              # why it is held ('drain refused: ...')
    release_due: bool = False   # the policy released it while its drain was pending

    def to_status(self) -> dict:
        out = {"node": self.node, "reason": self.reason, "state": self.state}
        if self.state == HELD:
            out["held"] = self.held
        return out


class FencedNodes:
    def __init__(self, may_drain: bool = True, why_not: str = ""):
        self.may_drain, self.why_not = may_drain, why_not
        self.nodes: dict[str, FencedNode] = {}

    def fence(self, node: str, reason: str) -> bool:
        """A process on `node` was judged dead. Returns whether to drain the node (the
        executor then calls drained() with the result); without the right, it is held now."""
        f = self.nodes.get(node)
        if f is not None and f.state == DRAINED:
            return False  # drained already (a second process fenced there)
        if f is None:
            f = self.nodes[node] = FencedNode(node, reason)
        if not self.may_drain:
            f.state, f.held = HELD, f"drain refused: {self.why_not}"
            return False
        f.state = PENDING
        return True

    def drained(self, node: str, error: str) -> tuple[list, list[tuple[str, str]]]:
        """The drain of `node` finished (`error` empty: done). Returns (actions, held): the
        release the policy asked for meanwhile, once drained; else the node held, with why."""
        f = self.nodes.get(node)
        if f is None or f.state != PENDING:
            return [], []
        due, f.release_due = f.release_due, False
        if not error:
            f.state = DRAINED
            return ([ReleaseNode(node)] if due else []), []
        f.state, f.held = HELD, f"drain refused: {error}"
        return [], ([(node, f.held)] if due else [])

    def route(self, actions: list) -> tuple[list, list[tuple[str, str]]]:
        """`actions` without the release of a fenced node that is not drained: (the actions to
        apply, [(node, why it stays in the job)] for held nodes the policy released)."""
        kept, held = [], []
        for a in actions:
            f = self.nodes.get(a.node) if isinstance(a, ReleaseNode) else None
            if f is None or f.state == DRAINED:
                kept.append(a)
            elif f.state == PENDING:
                f.release_due = True
            else:
                held.append((a.node, f"{f.held}: kept in the job, out of training, until the job ends"))
        return kept, held

    def held_nodes(self) -> list[str]:
        return [n for n, f in self.nodes.items() if f.state == HELD]

    def restore(self, nodes: list[str], why: str) -> None:
        """A controller resuming from the journal: fenced nodes still in the job were held."""
        for n in nodes:
            self.nodes.setdefault(n, FencedNode(n, why, HELD, f"held before the controller restarted ({why})"))

    def status(self) -> list[dict]:
        return [f.to_status() for f in self.nodes.values()]


log = logging.getLogger("trainmover.controller")
RANK_STEPS = ("tm-worker", "tm-standby")  # the steps a fence kills: never the controller's own


def kill_and_drain(slurm, job_id: int, proc, node: str, reason: str, drain: bool) -> Fenced:
    """The fence's effects, off the controller's loop: the node's rank steps killed (or `proc`,
    the process the controller started, where there is no Slurm step), then the node drained
    if `drain`. Returns the executor's `Fenced` event."""
    errors = []
    try:
        killed = slurm.kill_steps(job_id, node, names=RANK_STEPS)
        log.info("fenced %s: killed step(s) %s", node, killed)
        if not killed and proc is not None:  # no Slurm step (single host, or it ended): the process itself
            proc.kill()
    except (SlurmError, OSError) as exc:  # a partitioned node: its slurmd cannot be reached
        errors.append(f"kill: {exc}")
    drain_error = ""
    if drain:
        try:
            slurm.drain(node, f"trainmover: {reason}"[:200])
        except SlurmError as exc:
            drain_error = str(exc)[:300]
    return Fenced(node, "; ".join(errors), drain, drain_error)
