"""The controller policy's durable state: everything it keeps across a controller takeover, in
one value. The journal (controller/durable/journal.py) writes and reads it whole, field by field from
its types (controller/durable/codec.py), so that a field added here is journaled without more code;
tests/unit/test_state_roundtrip.py proves every field survives a journal round trip.

What a successor need not keep lives outside, in the policy's components, each marked
transient with the reason (caches, measurement windows, timers that must start afresh with
the successor's clock, what the ranks and standbys report again when they reconnect).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from trainmover.controller.durable.migration import Migration
from trainmover.controller.durable.view import JobView


@dataclass
class PolicyState:
    view: JobView                    # the job's layout, its standbys and released nodes
    epoch: int = 0                   # the last migration epoch handed out (a successor never reuses one)
    migrations: list[Migration] = field(default_factory=list)       # every migration and recovery, by id - 1
    fenced_pids: set[tuple[str, int]] = field(default_factory=set)  # (node, pid) judged dead: never heard again
    evicted: list[dict] = field(default_factory=list)      # straggler evictions {node, t, verdict}: the cooldown counts from them
    standbys_lost: list[dict] = field(default_factory=list)  # {node, state, evidence, t}: TM_STANDBY_LOSSES is per job
    holder_seq: int = 0              # snapshot-holder assignments so far: each one's store prefix is new

    @classmethod
    def initial(cls, view: JobView) -> "PolicyState":
        """A job's state before any decision: its layout only. The journal's `start` record
        carries that layout, and replay starts from this (journal.fold), so nothing here may
        depend on anything else."""
        return cls(view)
