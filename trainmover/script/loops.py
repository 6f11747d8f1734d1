"""The script's loops, their positions, and re-entering them in a fresh run.

`tm.loop(iterable)` wraps each level of the script's loop nest (epochs, batches). Each level
counts the items it gave and keeps the random state at two moments: when its iterator was made
(`created`: a DataLoader draws its shuffle seed and its workers' base seed then) and when it gave
its latest item (`yielded`). At a boundary (`tm.step`) the nest's positions are part of the
state.

Re-entry (a joiner, a rollback, a restart): a fresh run of the script does its set-up, and as
each level is first iterated, at the same depth as on the rank that saved the state, it is put
where that rank was: the random state of its creation restored, its iterator made (the same
shuffle), the items before the position skipped (a single-process DataLoader skips indices
only; anything else is fetched and dropped: a worker's augmentation draws depend on what it
fetched before), then the saved random state at the item restored. The innermost level then
fetches the next item with the boundary's random state, exactly as the saving rank's next
fetch would, and runs *warm iterations* on a copy of it in the sandbox (DDP's first-iteration
work, torch.compile), after which the tracked objects are loaded and the item is given for
real. The code of an iteration that came after `tm.step()` is not run again, and the code
between an outer level's item and the inner loop (an epoch's head) runs again: it must not
change tracked state in ways the loaded state does not overwrite (docs/scripts.md).
"""
from __future__ import annotations

import copy
import ctypes
import sys

import torch

from trainmover.errors import ConfigError
from trainmover.groups import rng

_EXHAUSTED = object()


def generators_of(iterable) -> list[torch.Generator]:
    """The generators a DataLoader's iterator draws from when it is made, besides the global
    RNG: its own `generator` and its sampler's (the batch sampler's sampler's)."""
    found = []
    for owner in (iterable, getattr(iterable, "sampler", None),
                  getattr(getattr(iterable, "batch_sampler", None), "sampler", None)):
        gen = getattr(owner, "generator", None)
        if isinstance(gen, torch.Generator) and not any(gen is g for g in found):
            found.append(gen)
    return found


def skip(it, n: int) -> None:
    """Advance iterator `it` by `n` items without using them."""
    from torch.utils.data.dataloader import _SingleProcessDataLoaderIter
    if n > 0 and isinstance(it, _SingleProcessDataLoaderIter) and hasattr(it, "_next_index"):
        for _ in range(n):  # indices only: the dataset is not read (no worker whose draws depend on it)
            it._next_index()
        it._num_yielded += n
        return
    for _ in range(n):
        next(it)


def set_frame_locals(frame, values: dict) -> None:
    """Put the loop's own counters (tm.step's keywords) back into the frame that runs the loop."""
    if not values:
        return
    if frame.f_code.co_flags & 0x20 or frame.f_globals is frame.f_locals:  # module level: a dict
        frame.f_locals.update(values)
        return
    names = set(frame.f_code.co_varnames) | set(frame.f_code.co_cellvars) | set(frame.f_code.co_freevars)
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"tm.step(): {unknown} are not variables of {frame.f_code.co_name}() (line "
                          f"{frame.f_lineno}), the function that runs the innermost tm.loop: pass the loop's own "
                          "counters, or keep other values in a tracked dict")
    if sys.version_info >= (3, 13):  # PEP 667: f_locals writes through
        for k, v in values.items():
            frame.f_locals[k] = v
        return
    frame.f_locals.update(values)
    ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))


class Loop:
    """What `tm.loop(iterable)` returns: each `iter()` of it is one pass of that level."""

    def __init__(self, nest: "Nest", iterable, site: tuple, start: int | None = None):
        self.nest, self.iterable, self.site = nest, iterable, site
        self.start = start  # not None: give (index, item) as enumerate(iterable, start) would

    def __iter__(self):
        return self.nest.start(self)

    def __len__(self):
        return len(self.iterable)


class Level:
    """One pass of a `Loop`: its iterator and position."""

    def __init__(self, loop: Loop):
        self.loop, self.pos, self.it = loop, 0, None
        self.created: dict | None = None
        self.yielded: dict | None = None
        self.gens: list = []
        self.pending = None  # re-entry: the item to give for real once warm

    def __iter__(self):
        return self

    def __next__(self):
        item = self.loop.nest.next(self, sys._getframe(1))
        return item if self.loop.start is None else (self.loop.start + self.pos - 1, item)

    def values(self) -> set:
        """What the loop's target variables may hold now: its position, as an index and as the
        item of a range (for the checker's counters, inspect.py)."""
        out = {self.pos - 1, self.pos}
        if self.loop.start is not None:
            out.add(self.loop.start + self.pos - 1)
        if isinstance(self.loop.iterable, range) and 0 < self.pos <= len(self.loop.iterable):
            out.add(self.loop.iterable[self.pos - 1])
        return out

    def record(self) -> dict:
        return {"pos": self.pos, "created": self.created, "yielded": self.yielded, "gens": list(self.gens)}


class Reentry:
    """Where a fresh run re-enters: the saved levels, counters and boundary random state."""

    def __init__(self, loop_state: dict):
        self.levels: list[dict] = list(loop_state.get("levels", []))
        self.counters: dict = dict(loop_state.get("counters", {}))
        self.boundary_rng: dict | None = loop_state.get("rng")
        if not self.levels:
            raise ConfigError("the state holds no loop position: was tm.step() called inside tm.loop(...)?")
        self.after_fetch: dict | None = None
        self.warm_item = None
        self.done = False


class Nest:
    """The loop levels of one run, outermost first, and the latest boundary's record."""

    def __init__(self, reentry: Reentry | None = None):
        self.stack: list[Level] = []
        self.reentry = reentry
        self.run = None  # set by the ScriptRun
        self.entered = False
        self.last: dict | None = None  # the latest boundary: {"levels": [...], "counters": {...}}
        self.boundaries = 0

    def loop(self, iterable, site: tuple, start: int | None = None) -> Loop:
        return Loop(self, iterable, site, start)

    def start(self, loop: Loop) -> Level:
        """A pass of `loop` begins: it replaces a pass of the same loop left on the stack (a
        `break` ends a pass without exhausting it) and everything inside it."""
        sites = [lvl.loop.site for lvl in self.stack]
        if loop.site in sites:
            del self.stack[sites.index(loop.site):]
        level = Level(loop)
        self.stack.append(level)
        return level

    def _pop(self, level: Level) -> None:
        if level in self.stack:
            del self.stack[self.stack.index(level):]

    def next(self, level: Level, frame):
        if level.it is None:
            if self.reentry is None and not self.entered:
                self.entered = True
                self.run.park("entry")  # set-up done, nothing drawn for the loop yet
            return self._begin(level, frame)
        if level.pending is not None:
            return self._after_warm(level, frame)
        try:
            item = next(level.it)
        except StopIteration:
            self._pop(level)
            raise
        level.pos += 1
        level.yielded = rng.capture()
        return item

    def _begin(self, level: Level, frame):
        depth = self.stack.index(level)
        re = self.reentry
        target = re.levels[depth] if re is not None and not re.done and depth < len(re.levels) else None
        if target is not None:
            rng.restore(target["created"])
            for gen, state in zip(generators_of(level.loop.iterable), target["gens"]):
                gen.set_state(state)
        level.created = rng.capture()
        level.gens = [g.get_state() for g in generators_of(level.loop.iterable)]
        level.it = iter(level.loop.iterable)
        if target is None:
            return self.next(level, frame)
        pos = int(target["pos"])
        if depth < len(re.levels) - 1:  # an outer level: to its item, with the random state it had there
            skip(level.it, pos - 1)
            item = next(level.it)
            level.pos, level.yielded = pos, target["yielded"]
            rng.restore(target["yielded"])
            return item
        return self._position_innermost(level, pos, frame)

    def _position_innermost(self, level: Level, pos: int, frame):
        re = self.reentry
        last = None
        if pos > 0:
            skip(level.it, pos - 1)
            last = next(level.it)
        level.pos = pos
        rng.restore(re.boundary_rng)  # the saving rank's next fetch drew from exactly this state
        try:
            level.pending = next(level.it)
        except StopIteration:
            level.pending = _EXHAUSTED
        re.after_fetch = rng.capture()
        re.warm_item = last if level.pending is _EXHAUSTED else level.pending
        if re.warm_item is None:  # an empty pass: nothing to warm on
            self.run.park("reentered")
            return self._after_warm(level, frame)
        self.run.mode = "warm"
        return copy.deepcopy(re.warm_item)

    def _after_warm(self, level: Level, frame):
        """The next item of the innermost re-entered level: another warm copy while the driver
        asks for one, then (after the tracked state is loaded) the real item."""
        re = self.reentry
        if self.run.mode == "warm":
            if self.run.warm_more:
                return copy.deepcopy(re.warm_item)
            self.run.park("reentered")  # the driver loads the tracked state, swaps groups, resumes
        item, level.pending = level.pending, None
        re.done, re.warm_item = True, None
        rng.restore(re.after_fetch)
        if frame is not None:
            set_frame_locals(frame, re.counters)
        if item is _EXHAUSTED:
            self._pop(level)
            raise StopIteration
        level.pos += 1
        level.yielded = rng.capture()
        return item

    def close(self) -> None:
        """The run is over (ended or abandoned): a DataLoader's worker processes stop now, not
        whenever the garbage collector gets to the run (the nest and its run refer to each
        other); a worker left running holds the process's pipes and file descriptors."""
        for level in self.stack:
            shutdown = getattr(level.it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        self.stack.clear()

    def boundary(self, counters: dict) -> dict:
        if not self.stack:
            raise ConfigError("tm.step() was called outside tm.loop(...): wrap the script's loops in tm.loop so "
                              "that a rank that takes over knows where the loop is (docs/scripts.md)")
        self.boundaries += 1
        self.last = {"levels": [lvl.record() for lvl in self.stack], "counters": dict(counters)}
        return self.last
