"""The standby side: shadow iterations answered from the live job's recordings.

A standby replays the oldest recording version first (normally version 1, which starts at
the workload's construction: the standby then computes the very losses the live rank did),
then every newer version the live rank records after a change of shapes (`rewarm`): those
start from a live state the standby does not have, so their collectives, shapes and dtypes
are checked and the code paths warmed, but losses are not compared.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from trainmover.errors import MigrationError
from trainmover.groups.swappable import SandboxBackend, SwappableGroup
from trainmover.sandbox import recording

log = logging.getLogger("trainmover.sandbox")

POLL_S = 0.2  # interval of the standby's look for a recording file


def newer(base: Path, version: int) -> int | None:
    """The latest complete version of `base` after `version`, if any."""
    found = [v for v in recording.versions(base) if v > version]
    return found[-1] if found else None


def _iterations(rec: recording.Replay, step: Callable[[int], float]) -> list[tuple[int, float, float]]:
    """(training step, recorded loss, shadow loss) of each recorded iteration."""
    out = []
    for it in range(rec.iterations):
        rec.begin(it)
        out.append((rec.step_of(it), rec.loss(it), step(rec.step_of(it))))
    return out


def _report(rec: recording.Replay, steps, compared: bool) -> dict:
    pairs = [(a, b) for _, a, b in steps]
    return {"replay": "done", "rank": rec.rank, "version": rec.version, "iterations": len(pairs),
            "first_step": steps[0][0], "last_step": steps[-1][0],
            "recorded_losses": [a for a, _ in pairs], "shadow_losses": [b for _, b in pairs],
            "losses_compared": compared, "loss_equal": all(a == b for a, b in pairs) if compared else None,
            # sends (pipeline p2p): the shadow step's data against the digests of the live one's
            "sends_checked": rec.sends if compared else 0,
            "sends_equal": (not rec.sends_differ) if compared and rec.sends else None,
            "sends_differ": rec.sends_differ[:5] if compared else []}


def combine(roles: list[dict], memory: dict) -> dict:
    """One standby report from its roles' replays (oldest first): the last role's fields (the
    role it keeps built), every role's report under `roles`, equality over all roles, and the
    device memory it keeps once warm against the highest peak of a role's shadow steps."""
    last = roles[-1]
    peaks = [r["peak_bytes"] for r in roles if r.get("peak_bytes") is not None]
    out = {**last, "roles": roles,
           "loss_equal": None if any(r["loss_equal"] is None for r in roles) else all(r["loss_equal"] for r in roles),
           "sends_equal": None if all(r["sends_equal"] is None for r in roles) else
           all(r["sends_equal"] is not False for r in roles)}
    if peaks and memory:  # allocator bytes against allocator bytes; reserved (with its rounding) beside
        out.update(kept_bytes=memory.get("alloc_bytes"), kept_reserved_bytes=memory.get("reserved_bytes"),
                   role_peak_bytes=max(peaks), kept_below_peak=memory.get("alloc_bytes", 0) < max(peaks))
    return out


def replay(specs, base: Path, timeout_s: float, local_only: str,
           build: Callable[[int, dict], object], step: Callable[[int], float],
           settle: Callable[[], int] | None = None) -> tuple[dict, dict]:
    """Rehearse the recorded rank: build its groups (sandboxed, answered from the recording
    except `local_only`), call `build(rank, groups)`, run the recorded iterations with `step`,
    and compare the losses. Returns (groups, report); report["replay"] != "done" says why
    nothing was replayed (the caller then warms up with locally answered collectives).

    A recording that starts after the workload's construction (TM_RECORD_FROM_STEP) was taken
    past the wrappers' one-time collectives (DDP's bucket broadcast in its second step): the
    fresh standby first runs `settle()` (shadow steps answered locally until steady) so that
    its own one-time collectives are behind it before the recorded ones are asked for."""
    ok, why = recording.available()
    if not ok:
        return {}, {"replay": f"unavailable: {why}"}
    base = Path(base)
    deadline = time.monotonic() + timeout_s
    log.info("standby waits for a recording %s", recording.version_path(base, 1))
    while not recording.versions(base):  # written by the live rank during its first recorded iterations
        if time.monotonic() > deadline:
            return {}, {"replay": f"unavailable: no recording at {base.parent} after {timeout_s:.0f}s"}
        time.sleep(POLL_S)
    rec = recording.Replay(recording.version_path(base, recording.versions(base)[0]))
    rank = rec.rank
    log.info("replaying %d recorded iterations of rank %d (version %d)", rec.iterations, rank, rec.version)
    groups = {}
    for g in specs:
        if rank in g.ranks:
            grank = g.ranks.index(rank)
            answers = None if not _recorded(g.name, len(g.ranks), local_only) or not rec.has_init \
                else rec.for_group(g.name)
            groups[g.name] = SwappableGroup(g.name, grank, len(g.ranks), list(g.ranks),
                                            SandboxBackend(grank, len(g.ranks), answers=answers))
    if rec.has_init:
        rec.begin("init")
    build(rank, groups)
    settled = 0
    if not rec.has_init:  # built with local answers; the iterations are answered from the recording
        if settle is None:
            raise MigrationError(f"recording {rec.path.name} starts at step {rec.first_step}, after the workload's "
                                 "construction: replaying it needs settling shadow steps first", phase="warmup")
        settled = settle()
        _answer_from(groups, rec, local_only)
    steps = _iterations(rec, step)
    rec.close()
    _answer_locally(groups)
    return groups, {**_report(rec, steps, compared=rec.has_init), "settle_steps": settled}


def replay_roles(specs, directory: Path, roles: dict[str, int], timeout_s: float, local_only: str,
                 build: Callable[[int, dict], object], step: Callable[[int], float],
                 settle: Callable[[], int] | None = None, *, reset_peak: Callable[[], None] = lambda: None,
                 peak: Callable[[], int | None] = lambda: None) -> tuple[list[dict], dict | None]:
    """`replay` each role's recording in turn (`roles`: name -> the rank that recorded it).
    `build` is called once per role: it must drop the previous role's model first (see
    Workload.release) so that a standby never holds two. Returns (the reports of the roles
    replayed, the report of the first role that could not be, or None)."""
    done = []
    for name, rank in roles.items():
        reset_peak()
        _, report = replay(specs, recording.base_of(directory, rank), timeout_s, local_only, build, step, settle)
        if report["replay"] != "done":
            return done, {**report, "role": name}
        done.append({**report, "role": name, "peak_bytes": peak()})
    return done, None


def rewarm(groups: dict[str, SwappableGroup], path: Path, local_only: str, step: Callable[[int], float]) -> dict:
    """Replay a newer version on an already built standby: its recorded iterations (with the
    new shapes) run through the warm model, so that compiled code and allocator cover them."""
    rec = recording.Replay(path)
    log.info("re-warming on recording version %d (%d iterations from step %d)", rec.version, rec.iterations,
             rec.step_of(0))
    _answer_from(groups, rec, local_only)
    try:
        steps = _iterations(rec, step)
    finally:
        rec.close()
        _answer_locally(groups)
    return _report(rec, steps, compared=False)


def _recorded(name: str, size: int, local_only: str) -> bool:
    """Whether a group's collectives are in the recording (see live.Recorder: not the
    runtime's own group, not groups of one rank, which a sandbox answers exactly)."""
    return name != local_only and size > 1


def _answer_from(groups: dict[str, SwappableGroup], rec: recording.Replay, local_only: str) -> None:
    for name, g in groups.items():
        if _recorded(name, g.size(), local_only):
            g.swap(SandboxBackend(g.rank(), g.size(), answers=rec.for_group(name)))


def _answer_locally(groups: dict[str, SwappableGroup]) -> None:
    for g in groups.values():  # later shadow steps: answered locally
        g.swap(SandboxBackend(g.rank(), g.size()))
