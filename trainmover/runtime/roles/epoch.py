"""A planned migration's epoch as the ranks share it: the leaver's keys in the job's store, read
by its joiner (`go`: the state is on its way; `cancel`: it never will be; `layout`: the
leaver's collective layout), and the abort that drops the epoch on a rank.

Both roles that may drop a planned migration use it: the switch (switch.py) on the
controller's `abort`, and the recovery (roles/recovery.py), which voids the epoch in flight on an
unexpected failure. It lives apart from both so that neither imports the other.
"""
from __future__ import annotations

import logging

from trainmover.protocol.messages import AbortMsg, MoveRole
from trainmover.runtime.changes import DropPhase1
from trainmover.runtime.context import RankContext
from trainmover.runtime.phase1 import xfer_prefix

log = logging.getLogger("trainmover.worker")


def go_key(epoch: int, leaver: int) -> str:
    return xfer_prefix(epoch, leaver) + "go"


def cancel_key(epoch: int, leaver: int) -> str:
    return xfer_prefix(epoch, leaver) + "cancel"


def layout_key(epoch: int, leaver: int) -> str:
    return xfer_prefix(epoch, leaver) + "layout"


def abort(ctx: RankContext, msg: AbortMsg) -> None:
    """The controller aborted epoch `msg.epoch` (or this rank voided it: an unexpected
    failure): the planned migration in flight, if it is that one, is dropped."""
    prep = ctx.pending
    if prep and prep.epoch == msg.epoch:
        ctx.apply(DropPhase1(prep.epoch))
        if prep.role == MoveRole.LEAVER:
            # Once the leaver stops offering this epoch the MIN can never equal it again:
            # tell the joiner, which waits on exactly this key.
            ctx.store.set(cancel_key(prep.epoch, prep.rank), "1")
        log.info("epoch %d aborted: %s", prep.epoch, msg.reason)
