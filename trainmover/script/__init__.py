"""Script mode: your own torchrun training script, its loop kept, migrated live.

Five lines in a plain DDP script (docs/scripts.md has the whole diff):

    import trainmover.script as tm
    tm.init("gloo")                                   # instead of dist.init_process_group("gloo")
    tm.track(model=model, optimizer=opt, scheduler=sched)
    for epoch in tm.loop(range(args.epochs)):         # each level of the loop nest
        sampler.set_epoch(epoch)
        for i, (x, y) in tm.enumerate(loader):       # or tm.loop(loader)
            ...; opt.step(); sched.step()
            tm.step(loss)                             # the step boundary, after the optimizer step

Run it with `trainmover run script.py --its-args` in a job (sbatch_templates/torch_script.sbatch).
Under plain `torchrun` (or `python`) the same calls do what torchrun alone would: `init`
initialises the default group, `loop` returns its argument, `track` and `step` do nothing.

Under TrainMover the script runs in a thread of the rank process (trainmover/script/run.py),
driven one step at a time; the world is the job's swappable group (world.py); the tracked
objects and the loop's position are the rank's state (tracked.py, loops.py). A standby runs
the same script in a sandbox; `is_live()` tells the script whether what it does now counts
(a standby's and a re-entry's warm iterations' prints go to the log, not the job's output).
"""
from __future__ import annotations

import builtins
import sys

from trainmover.script.run import current

__all__ = ["init", "track", "loop", "enumerate", "step", "is_live"]


def init(backend: str | None = None, **kwargs) -> None:
    """Make the job's world torch.distributed's default group (in place of
    `dist.init_process_group`). Under plain torchrun: `dist.init_process_group(backend, **kwargs)`."""
    if current() is None:
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group(backend, **kwargs)
    # Under TrainMover the world is installed before each run starts (world.py): nothing to do.


def track(**objects) -> None:
    """Name what decides future steps: `model=`, `optimizer=`, `scheduler=`, `scaler=` (a
    GradScaler), a sampler or loader with a state_dict, the script's own `torch.Generator`,
    `random.Random`, NumPy Generator, or a dict of counters. Any keyword names are fine; a
    model is loaded in place (DDP holds its tensors). May be called more than once."""
    run = current()
    if run is not None:
        run.tracked.add(objects)


def loop(iterable):
    """Wrap one level of the loop nest (epochs, batches): its position is carried, and a rank
    that takes over re-enters here. Under plain torchrun: `iterable` itself."""
    run = current()
    if run is None:
        return iterable
    caller = sys._getframe(1)
    return run.nest.loop(iterable, (caller.f_code, caller.f_lineno))


def enumerate(iterable, start: int = 0):  # noqa: A001 - the builtin's name, on purpose: same use
    """`enumerate(iterable, start)` whose index a rank taking over finds right: use it for
    `for i, batch in enumerate(loader)` (the builtin's count would start again at 0 there)."""
    run = current()
    if run is None:
        return builtins.enumerate(iterable, start)
    caller = sys._getframe(1)
    return run.nest.loop(iterable, (caller.f_code, caller.f_lineno), start=start)


def step(loss=None, **counters) -> None:
    """The step boundary: call it once per optimizer step, after everything that changes the
    tracked state in the iteration. `loss`: this step's loss (a tensor or a number; reported);
    `counters`: the loop's own variables that a rank taking over must find set (e.g.
    `global_step=global_step`), numbers or strings or tensors."""
    run = current()
    if run is None:
        return
    if run.mode == "warm":
        run.park("warm")
        return
    run.nest.boundary(counters)
    run.inspect(sys._getframe(1), counters)
    run.park("boundary", None if loss is None else float(loss.item() if hasattr(loss, "item") else loss))


def is_live() -> bool:
    """True when this process's work counts: a live rank (or plain torchrun). False on a
    standby rehearsing, and during the warm iterations of a rank taking over."""
    run = current()
    return run is None or run.mode == "live"
