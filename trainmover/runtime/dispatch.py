"""The one reader of a rank process's inbox: each controller message goes where the process's
state routes it.

A rank process hears the controller in four situations: between training steps, as a ready
standby, as a joiner inside its join, and as a stalled rank waiting for its recovery plan. Each
used to read the queue itself with a rule of its own. Now the agent (worker.py) builds one table,
`(RankState, message type) -> handler`, and every read goes through `Dispatcher`: a message
the current state has no route for is void (a stale `recover` after the rank resumed, a
`prepare` while stalled), counted and logged, never half-handled. Two types never wait in the
queue: `revoke` and `fenced` are acted on by the link's reader thread the moment they arrive
(the training thread may be stuck in a collective); their queued copies are void.

Handlers get the message as its class (`PrepareMsg`, ...: protocol/messages.py). A handler
returns None to go on, or a result that ends the wait it came in: `Started` (a
standby now trains from that step), `Aborted` (the epoch a joiner is in was aborted), `Plan`
(a recovery plan for a stalled rank or a joiner whose leaver died) or `GONE` (the controller is
gone for good: the link queued None).
"""
from __future__ import annotations

import logging
import queue
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from trainmover.protocol.messages import Message, RecoverMsg, typed
from trainmover.runtime.rankstate import RankState, RankStateMachine

log = logging.getLogger("trainmover.worker")

GONE_TYPE = "gone"  # the route key of the controller's end (the link queues None)


@dataclass(frozen=True)
class Started:
    """A standby took a rank (joined, or took a vanished one): it trains from `step`."""
    step: int


@dataclass(frozen=True)
class Aborted:
    """The controller aborted the epoch this joiner is in."""
    epoch: int


@dataclass(frozen=True)
class Plan:
    """A recovery plan (`recover`) for this process."""
    msg: RecoverMsg


class _Gone:
    def __repr__(self) -> str:
        return "GONE"


GONE = _Gone()  # the controller is gone for good

Handler = Callable[[Any], Any]  # takes the message's class (protocol/messages.py), a GONE route None
Routes = Mapping[tuple[RankState, str], Handler]


class Dispatcher:
    """Reads the inbox for every role of one rank process (see the module's doc)."""

    def __init__(self, inbox: queue.Queue[Message | None], state: RankStateMachine, routes: Routes):
        unknown = {kind for _, kind in routes} - ROUTABLE
        if unknown:  # a typo in the table would void a message type for good
            raise ValueError(f"routes for message types no controller sends a rank: {sorted(unknown)}")
        self.queue, self.state, self.routes = inbox, state, dict(routes)
        self.void: Counter[tuple[str, str]] = Counter()  # (state, type) -> messages voided

    def poll(self) -> Any:
        """Handle every queued message now, without waiting; the first result ends it (the
        messages after it stay queued for the next read)."""
        while True:
            try:
                msg = self.queue.get_nowait()
            except queue.Empty:
                return None
            out = self._handle(msg)
            if out is not None:
                return out

    def wait(self, timeout: float) -> Any:
        """Handle messages as they come until one's handler returns a result (returned) or
        `timeout` seconds pass (None)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                msg = self.queue.get(timeout=left)
            except queue.Empty:
                return None
            out = self._handle(msg)
            if out is not None:
                return out

    def _handle(self, msg: Message | None) -> Any:
        kind = GONE_TYPE if msg is None else msg["type"]
        now = self.state.now
        handler = self.routes.get((now, kind))
        if handler is None:
            self.void[(now.value, kind)] += 1
            log.debug("%s while %s: void", kind, now.value)
            return None
        return handler(None if msg is None else typed(msg))  # a GONE route's handler takes None


# what the controller may send a rank process (protocol/messages.py), and the controller's end;
# `bye` ends the link itself (link.py) and never reaches the queue
ROUTABLE = frozenset({"prepare", "abort", "hold", "foresee", "anticipate", "recover", "revoke", "fenced", GONE_TYPE})
