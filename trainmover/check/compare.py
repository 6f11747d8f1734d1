"""The check's verdict from what its processes reported: pure (values in, findings out).

Each process's JSON lines are folded into a `Record`; `findings` compares the joiners with the
uninterrupted references step by step and names the first difference: the step, the ranks
whose loss differed, and the state keys that differed.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

from trainmover.check.fingerprint import differences, explain
from trainmover.check.plan import Plan

OUTSIDE_STATE_HINT = (
    "The state loaded at the switch was identical, so something outside state_dict() decided "
    "this step differently: typically an LR scheduler, a data-order torch.Generator, an epoch or "
    "step counter, or a cache. Put it into state_dict() and restore it in load_state_dict() (a script: name it in tm.track(...)).")
NONDETERMINISM_HINT = (
    "train_step is not a function of (seed, rank, state): an unseeded or time-seeded generator, "
    "a nondeterministic kernel, or data state (position, order, generator) outside state_dict().")


@dataclass
class Record:
    """What one process reported (`replay*`: the reference's rollback and replay)."""
    losses: dict[int, float] = field(default_factory=dict)
    states: dict[int, dict] = field(default_factory=dict)
    replay_losses: dict[int, float] = field(default_factory=dict)
    replay_states: dict[int, dict] = field(default_factory=dict)
    encoding: dict | None = None
    digest: str = ""
    replay_digest: str = ""
    restarts: dict[int, tuple[dict, dict]] = field(default_factory=dict)  # point -> (losses, states)
    collectives: dict[int, dict] = field(default_factory=dict)  # step -> {group: collectives issued in the step}
    shadow: int | None = None
    script: list | None = None  # a script's findings (trainmover/script/inspect.py); None: not a script
    sent: dict | None = None
    phase: str = "starting"
    error: dict | None = None
    done: bool = False

    def add(self, line: dict) -> None:
        kind = line["kind"]
        if kind == "phase":
            self.phase = line["phase"]
        elif kind in ("loss", "replayloss"):
            (self.losses if kind == "loss" else self.replay_losses)[line["step"]] = line["loss"]
        elif kind in ("state", "replaystate"):
            (self.states if kind == "state" else self.replay_states)[line["step"]] = line["fp"]
        elif kind in ("restartloss", "restartstate"):
            losses, states = self.restarts.setdefault(line["r"], ({}, {}))
            if kind == "restartloss":
                losses[line["step"]] = line["loss"]
            else:
                states[line["step"]] = line["fp"]
        elif kind == "collectives":
            self.collectives[line["step"]] = line["counts"]
        elif kind in ("encoding", "sent"):
            setattr(self, kind, line)
        elif kind in ("digest", "replaydigest"):
            setattr(self, "digest" if kind == "digest" else "replay_digest", line["digest"])
        elif kind == "shadow":
            self.shadow = line["steps"]
        elif kind == "script":
            self.script = line["findings"]
        elif kind == "error":
            self.error = line
        elif kind == "done":
            self.done = True


@dataclass(frozen=True)
class Finding:
    check: str       # encoding, migration, collectives, determinism, rollback, restart, script
    ok: bool
    message: str
    step: int | None = None  # the first differing step (1-based, as in metrics.jsonl)


def same_float(a: float, b: float) -> bool:
    """Bit-for-bit (NaN equals a NaN of the same bits; 0.0 differs from -0.0)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return struct.pack("<d", float(a)) == struct.pack("<d", float(b))


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


@dataclass(frozen=True)
class Difference:
    step: int
    losses: list[tuple[int, float | None, float | None]]   # (rank, expected, got)
    state: list[tuple[int, list]]                        # (rank, differences) of ranks whose state differed


def first_difference(start: int, end: int, expected: list[tuple[dict, dict]],
                     got: list[tuple[dict, dict]]) -> Difference | None:
    """The first step in start..end where a rank's loss (steps after `start`) or state after
    the step differs. `expected`/`got`: per rank (losses by step, fingerprints by step)."""
    for step in range(start, end + 1):
        losses = [(r, e[0].get(step), g[0].get(step)) for r, (e, g) in enumerate(zip(expected, got))
                  if step > start and not same_float(e[0].get(step, math.nan), g[0].get(step, -math.inf))]
        state = [(r, d) for r, (e, g) in enumerate(zip(expected, got))
                 if (d := differences(e[1].get(step, {}), g[1].get(step, {})))]
        if losses or state:
            return Difference(step, losses, state)
    return None


def _describe(diff: Difference, mine: str, other: str) -> str:
    parts = []
    if diff.losses:
        parts.append("loss " + ", ".join(f"of rank {r} {e!r} ({mine}) vs {g!r} ({other})" for r, e, g in diff.losses))
    if diff.state:
        r, d = diff.state[0]
        parts.append(f"state of rank {r} after the step: {explain(d, mine, other)}")
    return "; ".join(parts)


def encoding_finding(refs: list[Record]) -> Finding:
    for rank, ref in enumerate(refs):
        enc = ref.encoding or {}
        if not enc.get("ok"):
            why = enc.get("message") or ("decoded state differs: " + explain(
                [tuple(d) for d in enc.get("diffs", [])], "sent", "decoded"))
            return Finding("encoding", False, f"rank {rank}: {why}")
    enc = refs[0].encoding or {}
    return Finding("encoding", True, f"the state survives the transfer's encoding unchanged "
                                     f"({enc.get('tensors', 0)} tensors, {enc.get('bytes', 0)} bytes on rank 0)")


def migration_finding(plan: Plan, refs: list[Record], joins: list[Record]) -> Finding:
    """The first step (the switch itself, then each compared one) where a joiner differs."""
    diff = first_difference(plan.at, plan.end, [(r.losses, r.states) for r in refs],
                            [(j.losses, j.states) for j in joins])
    if diff is not None and diff.step == plan.at:
        r, d = diff.state[0]
        return Finding("migration", False, step=diff.step, message=(
            f"right after the switch (after step {diff.step}) the joiner of rank {r} holds another state than the one "
            f"it was sent: load_state_dict() does not restore {explain(d, 'sent', 'after load')}"))
    if diff is not None:
        return Finding("migration", False, step=diff.step, message=(
            f"first difference at step {diff.step} (the {_ordinal(diff.step - plan.at)} step after the switch after "
            f"step {plan.at}): {_describe(diff, 'uninterrupted', 'migrated')}. {OUTSIDE_STATE_HINT}"))
    for r, (ref, join) in enumerate(zip(refs, joins)):
        if ref.digest != join.digest:
            return Finding("migration", False, step=plan.end, message=(
                f"rank {r}: the final parameter + optimizer digest differs ({ref.digest[:12]} uninterrupted, "
                f"{join.digest[:12]} migrated) though every compared state was equal"))
    return Finding("migration", True, (
        f"a fresh joiner process, warmed up on the sandbox, given the state after step {plan.at}: losses and states "
        f"of steps {plan.at + 1}-{plan.end} and the final digest equal the uninterrupted run's on every rank "
        f"({len(refs)})"))


def collectives_finding(plan: Plan, refs: list[Record], joins: list[Record]) -> list[Finding]:
    """Whether each joiner issued, step by step and group by group, the collectives its
    uninterrupted rank issued. The check's joiners replace every rank at once, so they agree with
    each other even when they differ from the references; in a job a rank taking over joins ranks
    that stay, and a collective one side issues and the other does not leaves both waiting (the
    move stalls, then fails), though the losses here may be equal."""
    compared = range(plan.at + 1, plan.end + 1)
    if not any(j.collectives for j in joins):
        return []  # nothing was counted (a workload without groups the check made)
    for step in compared:
        for rank, (ref, join) in enumerate(zip(refs, joins)):
            want, got = ref.collectives.get(step, {}), join.collectives.get(step, {})
            for name in sorted(set(want) | set(got)):
                if want.get(name, 0) != got.get(name, 0):
                    return [Finding("collectives", False, step=step, message=(
                        f"at step {step} (the {_ordinal(step - plan.at)} after the switch after step {plan.at}) the "
                        f"joiner of rank {rank} issued {got.get(name, 0)} collective(s) in group '{name}' where the "
                        f"uninterrupted rank issued {want.get(name, 0)}: next to ranks that stay (a drain, `trainmover "
                        f"migrate`) each side would wait for a collective the other does not issue and the move would "
                        f"stall. Something the step needs ran while the joiner was loading its state instead."))]
    return [Finding("collectives", True, (
        f"steps {plan.at + 1}-{plan.end}: every joiner issued the collectives its uninterrupted rank issued, group by "
        f"group (a rank taking over next to ranks that stay issues what they expect)"))]


def replay_findings(plan: Plan, refs: list[Record]) -> list[Finding]:
    """Determinism (the first replayed step) and the rollback (the rest of the replay)."""
    start = plan.rollback
    diff = first_difference(start, plan.end, [(r.losses, r.states) for r in refs],
                            [(r.replay_losses, r.replay_states) for r in refs])
    rolled = f"rolled back to the state after step {start} (a copy through load_state_dict, then the RNG, as the " \
             "snapshot and checkpoint tiers restore) and replayed"
    if diff is not None and diff.step == start:
        r, d = diff.state[0]
        bad = Finding("rollback", False, step=start, message=(
            f"{rolled}: right after load_state_dict() rank {r} holds another state than the one it was given: "
            f"load_state_dict() does not restore {explain(d, 'given', 'after load')}"))
        return [Finding("determinism", False, step=start + 1, message="not checked: " + bad.message), bad]
    if diff is not None and diff.step == start + 1:
        hint = NONDETERMINISM_HINT if diff.losses else (
            "The loss was the same, the state after the step was not: state outside state_dict() moved on when "
            "the step first ran (an LR scheduler, a counter), or the update is not deterministic.")
        return [Finding("determinism", False, step=diff.step, message=(
            f"step {diff.step} run twice from the same state gave {_describe(diff, 'first run', 'second run')}. "
            f"{hint}")),
            Finding("rollback", False, step=diff.step, message=f"{rolled}: differs from step {diff.step} on (above)")]
    same_step = Finding("determinism", True, f"step {start + 1} run twice from the same state gave the same loss and "
                                             "state on every rank")
    if diff is not None:
        return [same_step, Finding("rollback", False, step=diff.step, message=(
            f"{rolled}: first difference at step {diff.step}: {_describe(diff, 'first run', 'replay')}. "
            f"{OUTSIDE_STATE_HINT.replace('loaded at the switch', 'restored at the rollback')}"))]
    for r, ref in enumerate(refs):
        if ref.digest != ref.replay_digest:
            return [same_step, Finding("rollback", False, step=plan.end, message=(
                f"rank {r}: {rolled}: the final digest differs though every compared state was equal"))]
    return [same_step, Finding("rollback", True, f"{rolled}: steps {start + 1}-{plan.end} equal the first run's")]


def restart_finding(plan: Plan, refs: list[Record]) -> Finding:
    """Fresh instances given the state after each restart point, against the first run."""
    what = "a fresh instance (as a restart from a checkpoint builds one) given the state after step"
    for r in plan.restarts:
        last = min(r + plan.compare, plan.end)
        diff = first_difference(r, last, [(ref.losses, ref.states) for ref in refs],
                                [ref.restarts.get(r, ({}, {})) for ref in refs])
        if diff is None:
            continue
        if diff.step == r:
            rank, d = diff.state[0]
            return Finding("restart", False, step=r, message=(
                f"{what} {r}: right after load_state_dict() rank {rank} holds another state than the one it was "
                f"given: load_state_dict() does not restore {explain(d, 'given', 'after load')}"))
        return Finding("restart", False, step=diff.step, message=(
            f"{what} {r}: first difference at step {diff.step}: {_describe(diff, 'first run', 'restarted')}. "
            f"{OUTSIDE_STATE_HINT.replace('loaded at the switch', 'loaded at the restart')} (A fresh instance has "
            f"counted no epoch: a per-epoch counter left out shows here.)"))
    points = ", ".join(map(str, plan.restarts))
    return Finding("restart", True, f"{what} {points}: each equal to the first run for up to {plan.compare} steps")


def script_finding(refs: list[Record]) -> list[Finding]:
    """A script's state left out that a compared run may not show (trainmover/script/inspect.py)."""
    if all(r.script is None for r in refs):
        return []
    found = list(dict.fromkeys(f for r in refs for f in (r.script or [])))
    if not found:
        return [Finding("script", True, "the loop's frame uses nothing stateful that tm.track() leaves out")]
    return [Finding("script", False, "; ".join(found))]


def findings(plan: Plan, refs: list[Record], joins: list[Record]) -> list[Finding]:
    return [encoding_finding(refs), migration_finding(plan, refs, joins), *collectives_finding(plan, refs, joins),
            *replay_findings(plan, refs),
            restart_finding(plan, refs), *script_finding(refs)]
