"""When a framework runs the loop: the hooks an integration (Lightning, Hugging Face) uses.

Script mode's `tm.loop` wraps the script's own loops (loops.py). A `Trainer.fit(...)` loop is
not the script's: the framework iterates its loaders and calls the optimizer. An integration
(trainmover/integrations) plugs the same run (run.py) into the framework's hooks instead:

* `attach(owner)` when the framework starts training: the run's state is now the owner's
  (`owner.state()` at a boundary), and the state to re-enter at is returned (None on a fresh
  start). The owner feeds it to the framework's own resume path and puts the data where it was.
* `entry()` once set-up is done (a fresh start only), `boundary(loss)` after each optimizer
  step, once everything that step changes is changed: the runtime votes, takes the state or
  switches there, exactly as at `tm.step()`.
* On a re-entry, `warm()` after each warm iteration the owner runs in the sandbox (it returns
  whether the driver wants another), then `reentered()` once the warm iterations' effects are
  undone and the run stands where the state was taken; the run goes live when it resumes.

Under plain torchrun (no run) every call does nothing and `attach` returns None, so the same
integration object works unchanged there.
"""
from __future__ import annotations

from typing import Protocol

from trainmover.errors import ConfigError
from trainmover.script.run import current


class LoopOwner(Protocol):
    """What an integration gives the run: its name and the state at a boundary."""

    name: str

    def state(self) -> dict:
        """At a boundary: {"model": {...}, "optimizer": {...}, name: {...}}: tensors, numbers,
        strings, None and dicts/lists of them (the transfer's encoding). "model" and
        "optimizer" are what the job's digest covers."""


def attach(owner: LoopOwner) -> dict | None:
    """Make `owner` the run's loop owner; the state to re-enter at (its own part), or None."""
    run = current()
    if run is None:
        return None
    if run.owner is not None and run.owner is not owner:
        raise ConfigError(f"a second loop owner ({owner.name}) in one run of the script (already: {run.owner.name}): "
                          "one Trainer.fit per script under TrainMover")
    if run.nest.stack:
        raise ConfigError(f"{owner.name}'s loop runs inside tm.loop(...): use one or the other")
    run.owner = owner
    state = run.reentry
    if state is None:
        return None
    if state.get("owner") != owner.name or owner.name not in state:
        raise ConfigError(f"the state to load was taken by {state.get('owner') or 'tm.loop'}, not by {owner.name}: "
                          "the script must be the same on every rank and in every run")
    return state


def live() -> bool:
    run = current()
    return run is None or run.mode == "live"


def entry() -> None:
    run = current()
    if run is not None and run.reentry is None and not run.nest.entered:
        run.nest.entered = True
        run.park("entry")


def boundary(loss=None) -> None:
    run = current()
    if run is None:
        return
    if run.mode == "warm":
        raise ConfigError("a step boundary during a re-entry's warm iterations: the integration must undo them first")
    run.nest.boundaries += 1
    run.park("boundary", None if loss is None else float(loss.item() if hasattr(loss, "item") else loss))


def warm() -> bool:
    """After a warm iteration (the run is in `warm` mode from the first one on)."""
    run = current()
    if run is None:
        return False
    run.mode = "warm"
    run.park("warm")
    return run.warm_more


def reentered() -> None:
    run = current()
    if run is not None:
        run.park("reentered")
