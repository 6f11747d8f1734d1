"""Groups foreseen: the replacement groups of a loss that has not happened, built ahead (pure).

After an unexpected failure every group is rebuilt with the standby in the lost ranks' places
(runtime/roles/recovery.py). Built after the fault, the new world communicator was most of the
pause: 1.1 s of 2.15 s on 4x H200 (bench/results/issue36, GPT 1.2B 3 DP workers + 1 standby).
Those groups depend only on which node is lost and which standby takes its ranks, and both sets
are small while the job is: so, while a standby is ready and the job has at most
`foresee_nodes` training nodes, the policy asks every rank and that standby to build, in the
background, the groups of each training node's loss (a *case*), each case under a store prefix of
its own (`tm/fore/<tag>/...`), plus a transfer pair between the case's likely replica source
(its lowest live rank: tiers._replica picks the lowest rank of the newest step) and each of the
standby's processes. The ranks report which cases they built (`foreseen`); a recovery whose lost
ranks are a case that every member reported, taken by that standby, names the tag in its plan
(`recover.foreseen`) and every member takes those groups instead of building new ones.

Exactness: a case's groups have the very members, in the very group-rank order, that the groups
built after the fault would have (the standby takes the lost ranks), so every reduction runs in
the uninterrupted job's logical rank order.

Cost (why bounded): each live rank holds one set of its groups per case it is not lost in
(N-1 for N training nodes), the standby one set per case (N); on NCCL each is a communicator
(about 1 GB of device memory for the world group on H200). A new tag is sent whenever the
membership or the chosen standby changes (after a migration or a recovery); the ranks drop the
old sets then. Nothing is sent while a migration or recovery is in flight: its plan may still
name the current tag.
"""
from __future__ import annotations

import logging
from typing import Callable

from trainmover.controller.durable.state import PolicyState
from trainmover.controller.durable.view import StandbyState
from trainmover.controller.policy.actions import Send
from trainmover.controller.policy.standby_pool import StandbyPool
from trainmover.protocol.messages import ForeseenMsg, make

log = logging.getLogger("trainmover.policy")


class Foresight:
    """The policy's part that asks for groups ahead and says, at a recovery, whether they are there."""

    def __init__(self, limit: int, state: PolicyState, pool: StandbyPool, busy: Callable[[], bool],
                 order: Callable[[list[str]], list[str]] = sorted):
        self.limit, self.state, self.pool, self.busy, self.order = limit, state, pool, busy, order
        # Not journaled: a successor controller sends a new tag (its `seq` starts over; the tag
        # also holds the time it was made, so that it never repeats a predecessor's and its
        # rendezvous never meets that one's store keys), and the ranks drop the old sets.
        self.seq = 0
        self.tag = ""
        self.standby = ""
        self.basis: tuple = ()                      # (standby, membership) the tag was made for
        self.cases: list[tuple[int, ...]] = []
        self.built: dict[tuple[int, ...], set[tuple[str, int, int]]] = {}  # case -> (node, local, rank) reporters

    def actions(self, now: float) -> list:
        """A new `foresee` when the membership or the standby changed; none while busy."""
        if self.busy():
            return []
        view = self.state.view
        nodes = tuple(view.train_nodes())
        ready = self.pool.ready_nodes()
        keep = self.pool.get(self.standby)  # a standby re-warming on a newer recording keeps its sets
        if keep is not None and keep.state in (StandbyState.READY, StandbyState.WARMING):
            standby = self.standby
        else:
            standby = self.order(ready)[0] if ready else ""
        want = bool(self.limit) and 1 < len(nodes) <= self.limit and bool(standby)
        basis = (standby, tuple(sorted(view.rank_node.items()))) if want else ()
        if basis == self.basis:
            return []
        old_nodes = nodes + ((self.standby,) if self.standby and self.pool.get(self.standby) is not None else ())
        self.basis, self.built = basis, {}
        if not want:
            if not self.tag:
                return []
            log.info("groups foreseen under %s dropped", self.tag)
            self.tag, self.standby, self.cases = "", "", []
            return [Send(tuple(dict.fromkeys(old_nodes)), make("foresee", tag="", standby="", cases=[], sources=[]))]
        self.seq += 1
        self.tag, self.standby = f"e{self.state.epoch}s{self.seq}t{int(now * 1000)}", standby
        self.cases = [tuple(view.ranks_of(n)) for n in nodes]
        world = range(view.world_size)
        sources = [min(r for r in world if r not in case) for case in self.cases]
        log.info("groups foreseen under %s: standby %s in the place of each of %s", self.tag, standby, list(nodes))
        to = tuple(dict.fromkeys(old_nodes + (standby,)))
        return [Send(to, make("foresee", tag=self.tag, standby=standby, cases=[list(c) for c in self.cases],
                              sources=sources))]

    def on_foreseen(self, node: str, msg: ForeseenMsg) -> list:
        if msg.tag != self.tag or not self.tag:
            return []  # a dropped tag's late report
        rank = msg.rank if msg.role == "worker" else -1
        for case in msg.cases:
            self.built.setdefault(tuple(int(r) for r in case), set()).add((node, msg.local, rank))
        return []

    def usable(self, joiner: str, lost: tuple[int, ...]) -> str:
        """The tag the recovery of `lost` by `joiner` may take its groups from ("": none):
        every live rank and each of the joiner's processes for the case reported it built."""
        case = tuple(lost)
        if not self.tag or joiner != self.standby or case not in self.cases:
            return ""
        got = self.built.get(case, set())
        live = {r for r in range(self.state.view.world_size) if r not in case}
        ranks = {r for _, _, r in got if r >= 0}
        standby = {local for n, local, r in got if r < 0 and n == joiner}
        return self.tag if live <= ranks and set(range(len(case))) <= standby else ""
