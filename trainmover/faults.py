"""Fault injection, for tests, benchmarks and demos: where and when a failure happens is data.

`TM_INJECT` is a comma-separated list of faults (`INJECTIONS` documents each). The product
reaches them through one hook, `Injector.at(point, **context)`, called at a few named points:

    point            context                      faults that can fire there
    step             rank, step, pure_s, cpu      die, slow, freeze, hang, pace
    user             what, rank, step             raise (inside the guard of the workload's own code)
    phase1           who (rank or "joiner"), epoch die-in-phase1
    warmup           -                             die-in-warmup (the controller picks the standby)
    copy             -                             die-in-copy
    joiner-copy      -                             die-in-copy:joiner
    leaver-state     -                             skip-optimizer-state
    transfer-send    -                             corrupt-transfer
    snapshot-send    -                             corrupt-snapshot
    rollback         -                             no-rollback
    controller       at ("preparing", "prepare")   controller-die

A fault that acts on the process (kill, freeze, slow down) acts inside `at`; one that spoils
data makes `at` return True and the caller spoils it (the caller knows the data). Rank and step
faults apply only to the process launched for that rank (`role` "worker"): a standby that later
takes the rank over runs on a healthy node.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from trainmover.errors import ConfigError

log = logging.getLogger("trainmover.faults")

INJECTIONS = {
    "skip-optimizer-state": "the leaver leaves its optimizer state out of the copy (negative control)",
    "corrupt-transfer": "the leaver flips bytes of one tensor on the wire (checksum test)",
    "pace:<seconds>": "every process that trains (any rank, any role) sleeps <seconds> per step: a longer job with the same bits, so a test on a loaded machine has a wide window (not a fault)",
    "slow:<rank>:<fraction>": "the worker launched for <rank> sleeps <fraction> of its compute time each step (a straggling node)",
    "die-in-copy": "the leaver of a planned migration kills itself (SIGKILL) as the joiner starts to wait for its state",
    "die-in-copy:joiner": "the joiner of a planned migration kills itself (SIGKILL) as it starts to receive the leaver's state (the leaver's send then fails)",
    "die:<rank>:<step>": "the worker launched for <rank> kills itself (SIGKILL) as it begins step <step>: an unexpected failure mid-run",
    "raise:<rank>:<step>[:<error>]": "the workload's code raises inside train_step of step <step> on the worker launched for <rank>, as the user's code would (a user error, not a lost node); <step> 'build': as the workload is built; <error> shape (default: a real shape-mismatch RuntimeError), oom (torch.OutOfMemoryError) or value (ValueError)",
    "freeze:<rank>:<step>": "the worker launched for <rank> stops itself (SIGSTOP) as it begins step <step>: a frozen process whose sockets stay open",
    "hang:<rank>:<step>": "the training thread of the worker launched for <rank> blocks for good as it begins step <step>, the rest of the process alive (a hung kernel or collective)",
    "die-in-phase1:<rank>:<epoch>": "the worker process holding <rank> kills itself (SIGKILL) as it starts Phase 1 of migration epoch <epoch> (a stayer or the leaver lost while the replacement groups are built)",
    "die-in-phase1:joiner:<epoch>": "the standby joining migration epoch <epoch> kills itself (SIGKILL) as it starts Phase 1",
    "die-in-warmup:<n>": "the <n>-th standby agent the controller launches (1 = the first) kills itself (SIGKILL) as its warm-up begins",
    "controller-die:preparing": "the first controller kills itself (SIGKILL) once a migration's prepare is journaled, before it is sent",
    "controller-die:prepare": "the first controller kills itself (SIGKILL) right after it sent a migration's prepare",
    "corrupt-snapshot": "each rank flips bytes of its first snapshot copy on the wire (checksum test: it is sent again)",
    "no-rollback": "in a snapshot or checkpoint recovery the live ranks keep their state instead of loading that of the step rolled back to (negative control)",
}

# faults without arguments, and the point where each fires
_PLAIN = {"skip-optimizer-state": "leaver-state", "corrupt-transfer": "transfer-send", "die-in-copy": "copy",
          "die-in-copy:joiner": "joiner-copy",
          "corrupt-snapshot": "snapshot-send", "no-rollback": "rollback"}
_RANK_STEP = ("die", "freeze", "hang")
RAISE_ERRORS = ("shape", "oom", "value")  # raise:<rank>:<step>[:<error>]
BUILD = -1  # raise:<rank>:build, as the workload is built (Fault.at)


@dataclass(frozen=True)
class Fault:
    kind: str                  # the name before the first ':' (or the whole plain name)
    who: int | str | None = None   # a rank, "joiner", or None
    at: int | None = None      # step, epoch or launch count
    value: float | None = None  # slow: the fraction
    text: str = ""             # as written in TM_INJECT
    error: str = ""            # raise: which error (RAISE_ERRORS)


def _int(item: str, text: str, form: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"TM_INJECT: {item!r} is not {form}") from None


def parse_one(item: str, launched: bool = False) -> Fault:
    """One TM_INJECT item -> Fault, or a ConfigError that quotes it and says the expected form.
    `launched`: as a launched process sees it (`for_launch`), where plain `die-in-warmup` marks
    the one standby the controller chose."""
    if launched and item == "die-in-warmup":
        return Fault("die-in-warmup", text=item)
    if item in _PLAIN or item.startswith("controller-die:"):
        if item.startswith("controller-die:") and item not in INJECTIONS:
            raise ConfigError(f"TM_INJECT: {item!r}: known controller faults: "
                              f"{sorted(i for i in INJECTIONS if i.startswith('controller-die:'))}")
        kind, _, where = item.partition(":")
        return Fault(kind, who=where or None, text=item)
    kind, _, rest = item.partition(":")
    parts = rest.split(":") if rest else []
    if kind == "raise":
        form = "raise:<rank>:<step or build>[:shape|oom|value]"
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in RAISE_ERRORS):
            raise ConfigError(f"TM_INJECT: {item!r} is not {form}")
        rank = _int(item, parts[0], form)
        step = BUILD if parts[1] == "build" else _int(item, parts[1], form)
        if rank < 0 or step < BUILD:
            raise ConfigError(f"TM_INJECT: {item!r}: rank must be >= 0 and step >= 0 (or build)")
        return Fault(kind, who=rank, at=step, text=item, error=parts[2] if len(parts) == 3 else "shape")
    if kind in _RANK_STEP or kind == "slow":
        what = "fraction" if kind == "slow" else "step"
        form = f"{kind}:<rank>:<{what}>"
        if len(parts) != 2:
            raise ConfigError(f"TM_INJECT: {item!r} is not {form}")
        rank = _int(item, parts[0], form)
        if kind == "slow":
            try:
                fraction = float(parts[1])
            except ValueError:
                raise ConfigError(f"TM_INJECT: {item!r} is not {form}") from None
            if rank < 0 or not 0 < fraction < 10:
                raise ConfigError(f"TM_INJECT: {item!r}: rank must be >= 0 and fraction in (0, 10)")
            return Fault(kind, who=rank, value=fraction, text=item)
        step = _int(item, parts[1], form)
        if rank < 0 or step < 0:
            raise ConfigError(f"TM_INJECT: {item!r}: rank must be >= 0 and step >= 0")
        return Fault(kind, who=rank, at=step, text=item)
    if kind == "pace":
        try:
            seconds = float(parts[0]) if len(parts) == 1 else -1.0
        except ValueError:
            seconds = -1.0
        if not 0 < seconds <= 10:
            raise ConfigError(f"TM_INJECT: {item!r} is not pace:<seconds> with 0 < seconds <= 10")
        return Fault(kind, value=seconds, text=item)
    if kind == "die-in-phase1":
        form = "die-in-phase1:<rank or joiner>:<epoch>"
        if len(parts) != 2:
            raise ConfigError(f"TM_INJECT: {item!r} is not {form}")
        who: int | str = parts[0] if parts[0] == "joiner" else _int(item, parts[0], form)
        epoch = _int(item, parts[1], form)
        if (isinstance(who, int) and who < 0) or epoch < 1:
            raise ConfigError(f"TM_INJECT: {item!r}: rank must be >= 0 and epoch >= 1")
        return Fault(kind, who=who, at=epoch, text=item)
    if kind == "die-in-warmup" and parts:
        n = _int(item, parts[0], "die-in-warmup:<n>")
        if len(parts) != 1 or n < 1:
            raise ConfigError(f"TM_INJECT: {item!r}: expected die-in-warmup:<n> with n >= 1 "
                              "(the first standby launched is 1)")
        return Fault("die-in-warmup", at=n, text=item)
    raise ConfigError(f"TM_INJECT: unknown injection {item!r}; known: {sorted(INJECTIONS)}")


def parse(items, launched: bool = False) -> tuple[Fault, ...]:
    return tuple(parse_one(i, launched) for i in items)


def for_launch(items, role: str, standby_launch: int, first_controller: bool) -> tuple[str, ...]:
    """TM_INJECT as one launched process sees it: `die-in-warmup:<n>` becomes `die-in-warmup` for
    the n-th standby the first controller launches, and nothing for any other process."""
    chosen = {f.at for f in parse(items) if f.kind == "die-in-warmup" and f.at is not None}
    out = tuple(i for i in items if not i.startswith("die-in-warmup"))
    if role == "standby" and first_controller and standby_launch in chosen:
        out += ("die-in-warmup",)
    return out


class Injector:
    """The one hook through which the product reaches injected faults (module docstring)."""

    def __init__(self, items, role: str, first_controller: bool = True):
        self.faults = parse(items, launched=role != "controller")
        self.role = role  # the role the process was launched with: worker, standby or controller
        self.first_controller = first_controller

    def __bool__(self) -> bool:
        return bool(self.faults)

    def at(self, point: str, **ctx) -> bool:
        """Fire what is due at `point`; True when a data-spoiling fault applies there."""
        if not self.faults:
            return False
        if point == "step":
            return self._step(**ctx)
        if point == "user":
            return self._user(**ctx)
        if point == "phase1":
            if any(f.kind == "die-in-phase1" and (f.who, f.at) == (ctx["who"], ctx["epoch"]) for f in self.faults):
                _kill(f"{ctx['who']} dies in phase 1 of epoch {ctx['epoch']}")
            return False
        if point == "controller":
            if self.first_controller and any(f.kind == "controller-die" and f.who == ctx["at"] for f in self.faults):
                _kill(f"controller dies at {ctx['at']}")
            return False
        hit = any(_PLAIN.get(f.text) == point or (point == "warmup" and f.text == "die-in-warmup")
                  for f in self.faults)
        if hit and point in ("copy", "joiner-copy", "warmup"):
            _kill(f"dies at {point}")
        if hit:
            log.warning("injected: %s", point)
        return hit

    def _step(self, rank: int, step: int, pure_s: float = 0.0, cpu: bool = True) -> bool:
        for f in self.faults:
            if f.kind == "pace":  # whoever holds the rank: the job keeps its length through a move
                time.sleep(f.value)
        if self.role != "worker":
            return False
        for f in self.faults:
            if f.who != rank:
                continue
            if f.kind == "slow":  # this process computes (1 + fraction) times as long
                _burn(f.value * pure_s, cpu=cpu)
            elif f.at == step and f.kind == "die":  # no goodbye, no report
                _kill(f"rank {rank} dies at step {step}")
            elif f.at == step and f.kind == "freeze":
                log.error("injected: rank %d freezes (SIGSTOP) at step %d", rank, step)
                logging.shutdown()
                os.kill(os.getpid(), signal.SIGSTOP)
            elif f.at == step and f.kind == "hang":
                log.error("injected: rank %d's training thread hangs at step %d", rank, step)
                threading.Event().wait()  # for good: only the process's other threads live on
        return False


    def _user(self, what: str, rank: int | None, step: int | None) -> bool:
        """Inside the guard of the workload's own code: raise as that code would."""
        if self.role != "worker" or rank is None:
            return False
        at = BUILD if what == "build" else step if what == "train_step" else None
        for f in self.faults:
            if f.kind == "raise" and f.who == rank and at is not None and f.at == at:
                log.error("injected: rank %d's workload raises (%s) in %s", rank, f.error, what)
                _raise_user_error(f.error, rank, what)
        return False


def _raise_user_error(error: str, rank: int, what: str) -> None:
    """The errors a user's code raises: a real shape mismatch, an out-of-memory, a ValueError."""
    import torch
    if error == "oom":
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 20.00 GiB (injected on rank {rank} "
                                     f"in {what})")
    if error == "value":
        raise ValueError(f"injected: rank {rank}'s workload rejects its batch in {what}")
    torch.ones(2, 3) @ torch.ones(4, 5)  # RuntimeError: mat1 and mat2 shapes cannot be multiplied


def _kill(what: str) -> None:
    log.error("injected: %s (SIGKILL)", what)
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)


def _burn(seconds: float, cpu: bool) -> None:
    """Injected slowness: on CPU nodes burn CPU (a slow node spends more cycles), else sleep."""
    if not cpu:
        time.sleep(seconds)
        return
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
