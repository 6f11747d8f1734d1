"""The workload's own code, called through one guard: its errors are the user's.

`UserWorkload` wraps a workload (trainmover/workloads/base.py) and guards the calls that run
the user's code: `build`, `rebind`, `train_step`, `state_dict`, `load_state_dict`. Anything
they raise (any type: a shape mismatch, `torch.OutOfMemoryError`, a `KeyError`) comes out as a
`UserCodeError` that names the call and keeps the user's traceback, bounded in size.

Why the type does not decide whether a peer is gone: a failed collective also surfaces from the
user's code (DDP's backward waits on it). The training loop asks the groups for that
(`groups.first_failure`, marked where the collective failed) and only then, if no collective
failed, takes the error for what it is: the user's, which ends the job (runtime/worker.py).
Errors of TrainMover's own (a `TrainMoverError`, e.g. the gate before the optimizer step) pass
through unchanged.
"""
from __future__ import annotations

import contextlib
import traceback

from trainmover.errors import TrainMoverError

MAX_TRACEBACK = 8000  # characters of the user's traceback kept (its end: the innermost frames and the error)


class UserCodeError(TrainMoverError):
    """The workload's own code raised. `what`: the call (train_step, build, ...); `error`:
    "Type: message" of the original (its __cause__); `traceback`: its traceback, bounded."""

    def __init__(self, what: str, exc: BaseException):
        self.what = what
        self.error = f"{type(exc).__name__}: {exc}"[:1000]
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:  # the guard's own frames
            tb = tb.tb_next
        self.traceback = bounded("".join(traceback.format_exception(type(exc), exc, tb)))
        super().__init__(f"user code raised in {what}: {self.error}")


def bounded(text: str, limit: int = MAX_TRACEBACK) -> str:
    """`text`, or its last `limit` characters after a line saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"[... {len(text) - limit} characters cut ...]\n" + text[-limit:]


@contextlib.contextmanager
def user_code(what: str):
    """Run the user's code: any exception but TrainMover's own becomes a `UserCodeError`."""
    try:
        yield
    except (TrainMoverError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - the user's code may raise anything
        raise UserCodeError(what, exc) from exc


class UserWorkload:
    """A workload whose user-code calls are guarded (module docstring); everything else is
    the workload's own attribute. `inject(what, **ctx)`: the fault-injection hook, called
    inside the guard, so that an injected error is raised as the user's code would raise it."""

    GUARDED = ("build", "rebind", "train_step", "state_dict", "load_state_dict")

    def __init__(self, inner, inject=lambda what, **ctx: None):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "inject", inject)

    def __getattr__(self, name):
        value = getattr(self.inner, name)
        if name not in self.GUARDED:
            return value

        def guarded(*args, **kwargs):
            with user_code(name):
                self.inject(name, args=args)
                return value(*args, **kwargs)
        guarded.__name__ = name
        return guarded

    def __setattr__(self, name, value):  # e.g. the loop's `trace` hook: the workload's own
        setattr(self.inner, name, value)
