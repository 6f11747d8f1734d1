"""A process's side of groups foreseen: the replacement groups of losses that have not happened,
built in the background while the job trains (controller/policy/foresight.py says why, when and
at what cost).

On `foresee` a live rank builds, for each case (a training node's ranks) it is not lost in, every
group it is a member of, as the group would be with the standby in the case's ranks; and, where
it is the case's named source, a transfer pair to each of the standby's processes. A standby's
process `local` builds, for each case, the groups of the rank it would take (the case's
local-th) and that rank's transfer pair. Each under a store prefix of the tag and the case
alone: nothing the live job or a migration uses is touched.

Deadlock-free and deadline-bound: every process builds its cases in the message's order, and a
case's groups in the job's group order (a subset of one global order: the first unfinished build
always has every member at it); each rendezvous is bounded by the group timeout, so every member
leaves every build. A build that fails (a member lost meanwhile; NCCL refusing two members on
one GPU) skips the rest of its case on this process, which is then not reported: a recovery of
it builds its groups after the fault, as before. The other cases go on. Builds run on a rendezvous client of their own (RankContext.phase1_builder).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from trainmover.groups.specs import GroupSpec
from trainmover.protocol.messages import ForeseeMsg

if TYPE_CHECKING:
    from trainmover.runtime.context import RankContext

log = logging.getLogger("trainmover.foresight")

Case = tuple[int, ...]


def prefix(tag: str, case: Case, name: str) -> str:
    return f"tm/fore/{tag}/c{'-'.join(str(r) for r in case)}/{name}/"


def pair_prefix(tag: str, case: Case, needer: int) -> str:
    return prefix(tag, case, f"xfer/r{needer}")


def plan(specs: list[GroupSpec], msg: ForeseeMsg, rank: int | None, local: int) -> list[tuple[Case, str, str, str, int, int]]:
    """What this process builds for `foresee` `msg`, in build order: (case, key, group name,
    store prefix, group rank, size). `rank`: a live rank's own; None for a standby's process
    `local`. Keys are those a recovery asks for (roles/recovery.py `start_builds`): the group's name,
    `xfer-to-<needer>` on the source, `xfer-in` on the standby."""
    out = []
    for case_, source in zip(msg.cases, msg.sources):
        case = tuple(int(r) for r in case_)
        if rank is None:
            if local >= len(case):
                continue
            me = case[local]
        elif rank in case:
            continue
        else:
            me = rank
        for g in specs:
            if me in g.ranks:
                out.append((case, g.name, g.name, prefix(msg.tag, case, g.name), g.ranks.index(me), len(g.ranks)))
        if rank is None:
            out.append((case, "xfer-in", "xfer", pair_prefix(msg.tag, case, me), 1, 2))
        elif rank == int(source):
            out += [(case, f"xfer-to-{n}", "xfer", pair_prefix(msg.tag, case, n), 0, 2) for n in case]
    return out


class Foreseen:
    """The backends built for the current tag, by case; taken by a recovery, dropped for a new tag."""

    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.tag = ""
        self.sets: dict[Case, dict[str, object]] = {}
        self.complete: set[Case] = set()  # cases whose every backend this process built
        self.sources: dict[Case, int] = {}  # case -> the rank whose transfer pairs to the standby are built
        self.lock = threading.Lock()

    def on_foresee(self, msg: ForeseeMsg, step: int) -> None:
        """Drop the old tag's backends (retired at `step`: none is in use) and start the new tag's."""
        self.drop(step)
        with self.lock:
            self.tag = msg.tag
            self.sources = {tuple(int(r) for r in c): int(s) for c, s in zip(msg.cases, msg.sources)}
        if not msg.tag:
            return
        rank = self.ctx.rank if self.ctx.role == "worker" else None
        todo = plan(self.ctx.specs, msg, rank, self.ctx.local)
        if not todo:
            return
        build = self.ctx.phase1_builder()
        tag = msg.tag

        def run():
            t0, before, comms = time.perf_counter(), self.ctx.memory(), self.ctx.comms_created()
            done: list[Case] = []
            error, failed = "", None
            for i, (case, key, name, pre, grank, size) in enumerate(todo):
                if case == failed:
                    continue
                try:
                    backend = build(name, pre, grank, size)
                except Exception as exc:  # noqa: BLE001 - this case is not built; a recovery of it builds its groups
                    error, failed = f"{type(exc).__name__}: {exc}", case
                    log.warning("foreseen groups of %s: %s of case %s not built: %s", tag, key, list(case), error)
                    continue
                with self.lock:
                    if self.tag != tag:  # dropped meanwhile: a new tag came
                        self.ctx.retire(backend, step)
                        return
                    self.sets.setdefault(case, {})[key] = backend
                    if i + 1 == len(todo) or todo[i + 1][0] != case:
                        self.complete.add(case)
                        done.append(case)
            after = self.ctx.memory()
            detail = {"seconds": round(time.perf_counter() - t0, 4), "backends": sum(len(s) for s in self.sets.values()),
                      "comms": self.ctx.comms_created() - comms, "error": error[:300]}
            if before and after:
                detail["device_bytes"] = after["device_used_bytes"] - before["device_used_bytes"]
            log.info("foreseen groups of %s: cases %s built in %.2fs (%s)", tag, [list(c) for c in done],
                     detail["seconds"], detail)
            self.ctx.send("foreseen", tag=tag, role="worker" if rank is not None else "standby",
                          rank=rank or 0, local=self.ctx.local, cases=[list(c) for c in done], detail=detail)
        threading.Thread(target=run, name=f"tm-foresee-{tag}", daemon=True).start()

    def source(self, case: Case) -> int | None:
        with self.lock:
            return self.sources.get(case)

    def take(self, tag: str, case: Case, key: str):
        """The backend `key` built for `case` under `tag`, or None (not built, or another tag)."""
        with self.lock:
            if not tag or tag != self.tag or case not in self.complete:
                return None
            return self.sets.get(case, {}).pop(key, None)

    def drop(self, step: int) -> None:
        """Retire every backend not taken (after a recovery took its own, or for a new tag)."""
        with self.lock:
            sets, self.sets, self.complete, self.tag, self.sources = self.sets, {}, set(), "", {}
        for backends in sets.values():
            for backend in backends.values():
                comm = getattr(backend, "comm", None)
                if self.ctx.role != "worker" and comm is not None:
                    # a standby trains no step whose boundary would release it (retire): its device
                    # memory goes now (the device sync of the free delays at most its own warm-up)
                    threading.Thread(target=comm.abort, name="tm-foresee-drop", daemon=True).start()
                else:
                    self.ctx.retire(backend, step)
