"""A user's script served to the runtime as a `Workload` (script mode).

The runtime calls `build`, `train_step`, `state_dict`, `load_state_dict`, `rebind` exactly as
for a class written for it (docs/workloads.md); here each is a move of the script's run
(run.py): `build` runs the set-up up to the loop, `train_step` one iteration up to `tm.step()`,
`state_dict` reads the tracked objects and the loop's position, `load_state_dict` starts a
fresh run that re-enters the loop where the state was saved (loops.py). Its groups are
sandboxed meanwhile, so the set-up's and warm iterations' collectives (DDP's broadcasts, its
bucket rebuild) never reach the peers.
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from trainmover.errors import ConfigError, TrainMoverError
from trainmover.groups import rng
from trainmover.script import world as script_world
from trainmover.script.loops import Nest, Reentry
from trainmover.script.run import ScriptEnded, ScriptRun
from trainmover.script.tracked import Tracked
from trainmover.workloads.base import BuildContext, Workload

log = logging.getLogger("trainmover.script")

MIN_WARM, MAX_WARM = 2, 8  # warm iterations of a re-entry: until two in a row issue the same collectives


class ScriptWorkload(Workload):
    """`path`: the script; `argv`: its own arguments (as after `python script.py`)."""

    owns_loop = True  # the script's loop decides how many steps there are, not TM_STEPS
    inspect_all = False  # the checker's: inspect every boundary, not only a run's first (run.py)

    def __init__(self, path: str, argv: list[str] | tuple = ()):
        self.path = str(Path(path).resolve())
        if not Path(self.path).is_file():
            raise ConfigError(f"script {path!r} not found (looked at {self.path})")
        self.argv = [str(a) for a in argv]
        self.run: ScriptRun | None = None
        self.ctx: BuildContext | None = None

    # -- the Workload protocol --
    def build(self, ctx: BuildContext) -> None:
        self.ctx = ctx
        self._fresh(None)

    def rebind(self, ctx: BuildContext) -> None:
        self.ctx = ctx
        self._fresh(None)

    def release(self) -> None:
        if self.run is not None:
            self.run.end()
            self.run = None

    def train_step(self, step: int) -> float:
        event = self.run.resume(self._mode())
        if event.kind == "entry":  # a run parked before its loop (after build): on to the first boundary
            event = self.run.resume(self._mode())
        if event.kind == "ended":
            raise ScriptEnded(f"the script ended after {self.run.nest.boundaries} steps of this run")
        if event.kind != "boundary":
            raise TrainMoverError(f"the script stopped at {event.kind!r} where a step boundary was expected")
        return float("nan") if event.value is None else float(event.value)

    def state_dict(self) -> dict:
        run = self._live_run()
        if run.owner is not None:  # a framework runs the loop (owner.py): its state, and what the script tracks
            return merge(run.tracked.state(), run.owner.state(), run.owner.name)
        if run.nest.last is None:
            raise TrainMoverError("no step boundary yet: the state of a script is taken at tm.step()")
        # The random state now is the boundary's (nothing draws between tm.step and here).
        return {**run.tracked.state(), "loop": {**run.nest.last, "rng": rng.capture()}}

    def load_state_dict(self, state: dict) -> None:
        self._fresh(state)

    def findings(self) -> list[str]:
        """What the script's loop uses that the state does not carry (inspect.py): the checker
        fails on any; a job logs them at its first steps."""
        return [] if self.run is None else list(self.run.findings)

    def compute_thread(self) -> int | None:
        """The native id of the thread that runs the script (the heartbeat reports its CPU time)."""
        return None if self.run is None else self.run.native_id

    # -- runs --
    def _mode(self) -> str:
        world = self.ctx.groups.get("world")
        return "sandbox" if world is not None and world.sandboxed else "live"

    def _device_index(self) -> int | None:
        if self.ctx.options.get("device") != "cuda":
            return None
        import torch
        return self.ctx.local_rank % torch.cuda.device_count()

    def _live_run(self) -> ScriptRun:
        if self.run is None:
            raise TrainMoverError("the script has no run: build() first")
        return self.run

    def _fresh(self, state: dict | None) -> None:
        """End the current run and start a new one: parked before its loop (`state` None), or
        re-entered at `state`'s position with `state` loaded (module docstring)."""
        self.release()
        script_world.prepare(self.ctx)
        nest = Nest(Reentry(state["loop"]) if state is not None and "owner" not in state else None)
        self.run = ScriptRun(self.path, self.argv, nest, Tracked(), device=self._device_index(), world=self.ctx)
        self.run.inspect_all = self.inspect_all
        self.run.reentry = state
        with self._sandboxed(state is not None):
            event = self.run.start("sandbox" if state is not None else self._mode())
            if state is None:
                self._expect(event, "entry", "before its first tm.loop(...) iteration")
                return
            event = self._warm(event)
            self._expect(event, "reentered", "where the state was saved")
            self.run.tracked.load(state)
            if "owner" not in state:  # until its next boundary the run stands where the loaded state was taken
                self.run.nest.last = {"levels": state["loop"]["levels"], "counters": state["loop"].get("counters", {})}

    def _warm(self, event):
        """Warm iterations of a re-entry, in the sandbox: until two in a row issue the same
        collectives (DDP rebuilds its buckets in its second), at most MAX_WARM."""
        calls = [g.inner.calls for g in self.ctx.groups.values() if hasattr(g.inner, "calls")]
        previous, n = None, 0
        while event.kind == "warm":
            n += 1
            signature = [tuple(c) for c in calls]
            self.run.warm_more = n < MAX_WARM and not (n >= MIN_WARM and signature == previous)
            for c in calls:
                c.clear()
            previous = signature
            event = self.run.resume()
        return event

    def _expect(self, event, kind: str, where: str) -> None:
        if event.kind == kind:
            return
        self.release()
        if event.kind == "ended":
            raise ConfigError(f"the script {os.path.basename(self.path)} ended without reaching its loop {where}: "
                              "does it iterate tm.loop(...) and call tm.step() (docs/scripts.md), or, where a Trainer runs the "
                              "loop, pass it TrainMover's callback (docs/scripts-trainers.md)?")
        raise ConfigError(f"the script {os.path.basename(self.path)} stopped at {event.kind!r}, not {where}: its "
                          "loops must be the same on every rank and in every run (docs/scripts.md)")

    @contextlib.contextmanager
    def _sandboxed(self, yes: bool):
        """Every group answers locally while a fresh run re-enters (its set-up and warm
        iterations are this rank's alone), then is put back as it was."""
        if not yes:
            yield
            return
        with contextlib.ExitStack() as stack:
            for g in {id(g): g for g in self.ctx.groups.values()}.values():
                stack.enter_context(g.sandbox_for_a_while())
            yield


def merge(tracked: dict, owned: dict, name: str) -> dict:
    """The state of a run whose loop a framework runs: the owner's part (its "model" and
    "optimizer" entries beside the tracked ones, its own under its name) and what tm.track names."""
    out = {part: dict(tracked.get(part, {})) for part in ("model", "optimizer", "objects")}
    for part in ("model", "optimizer"):
        clash = set(out[part]) & set(owned.get(part, {}))
        if clash:
            raise ConfigError(f"tm.track() names {sorted(clash)}, which {name} carries already: use other names")
        out[part].update(owned.get(part, {}))
    out[name] = owned[name]
    out["owner"] = name
    return out
