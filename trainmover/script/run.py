"""One run of the user's script, in a thread of its own, driven step by step by the runtime.

Why a thread: the script owns its loop, the runtime owns the step boundary (vote, protection,
switch). The script runs in this thread and *parks* at points the runtime must act on: the
first `tm.loop` iteration (`entry`: set-up done), each `tm.step()` (`boundary`), the warm
iterations of a re-entry (`warm`, `reentered`), its end (`ended`). The runtime's thread resumes
it; exactly one of the two runs at any time, so the script needs no locking and the runtime's
`Workload` protocol (build, train_step, state_dict, load_state_dict) is served as for a class.

A run is never rewound: a state to be loaded (a joiner, a rollback) starts a fresh run that
re-enters the loop at the saved position (loops.py); the old one is ended by raising `EndRun`
at its park point, which unwinds the script (its `finally` blocks run) and frees its objects.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import runpy
import sys
import threading
from dataclasses import dataclass

from trainmover.errors import TrainMoverError

log = logging.getLogger("trainmover.script")

_current: "ScriptRun | None" = None  # the run whose thread is running the script (one per process)


def current() -> "ScriptRun | None":
    """The run this script is part of; None when it runs under plain torchrun or python."""
    return _current


class EndRun(BaseException):
    """Raised in the script at a park point: the run is abandoned (a fresh run replaces it).
    A BaseException, so that the script's `except Exception` does not swallow it."""


class ScriptEnded(TrainMoverError):
    """The script returned: its loop is over (the runtime then reports the rank finished)."""


@dataclass
class Event:
    kind: str            # entry, boundary, warm, reentered, ended
    value: object = None  # boundary: the step's loss (float or None)


class ScriptRun:
    """The script at `path` with arguments `argv`, run once in its thread (module docstring).
    `nest` is the run's loop nest (loops.py), `tracked` its tracked objects (tracked.py);
    `device` the CUDA device index the thread must use (None on CPU)."""

    def __init__(self, path: str, argv: list[str], nest, tracked, device: int | None, world):
        self.path, self.argv, self.nest, self.tracked, self.device, self.world = path, list(argv), nest, tracked, device, world
        nest.run = self
        self.owner = None    # an integration whose framework runs the loop (owner.py), else the nest's tm.loop
        self.reentry: dict | None = None  # the state a fresh run re-enters at (None: a fresh start)
        self.mode = "sandbox"  # live, sandbox (a standby, a checker's joiner) or warm (re-entry): see is_live
        self.warm_more = True  # the driver's answer to a `warm` park
        self._to_run, self._to_driver = threading.Semaphore(0), threading.Semaphore(0)
        self._event: Event | BaseException | None = None
        self._command = "go"
        self.native_id: int | None = None
        self.findings: dict[str, None] = {}  # what inspect() found, in order
        self.inspect_all = False  # the checker inspects every boundary (a counter shows once an epoch has passed)
        self.numbers: list[dict] = []
        self.loop_values: list[set] = []
        self.thread = threading.Thread(target=self._main, name="tm-script", daemon=True)

    # -- the driver's side (the runtime's thread) --
    def start(self, mode: str) -> Event:
        self.mode = mode
        with quiet(mode != "live"):
            self.thread.start()
            return self._wait()

    def resume(self, mode: str | None = None) -> Event:
        if not self.thread.is_alive():
            raise TrainMoverError("the script's run has already ended")
        if mode is not None:
            self.mode = mode
        self._command = "go"
        with quiet(self.mode != "live"):
            self._to_run.release()
            return self._wait()

    def end(self, timeout_s: float = 60.0) -> None:
        """Abandon the run: EndRun at its park point unwinds the script."""
        if not self.thread.is_alive():
            return
        self._command = "end"
        with quiet(True):
            self._to_run.release()
            self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.warning("an abandoned run of the script did not unwind within %.0fs (left running)", timeout_s)

    def _wait(self) -> Event:
        self._to_driver.acquire()
        event, self._event = self._event, None
        if isinstance(event, BaseException):
            raise event
        return event

    INSPECT_BOUNDARIES = 6  # boundaries whose frame is inspected for state nobody tracks (inspect.py)

    def inspect(self, frame, counters: dict) -> None:
        """At the first boundaries: what the loop's frame uses that the state does not carry
        (findings for the checker and the job's log; inspect.py)."""
        if self.nest.boundaries > self.INSPECT_BOUNDARIES and not self.inspect_all:
            return
        from trainmover.script import inspect
        module = frame.f_globals if frame.f_globals.get("__name__") == "__main__" else {}
        variables = {**module, **frame.f_locals}
        iters = [lvl.it for lvl in self.nest.stack]
        for finding in inspect.untracked(variables, self.tracked, iters):
            self.findings.setdefault(finding, None)
        self.numbers = self.numbers[-3:] + [{k: v for k, v in frame.f_locals.items() if isinstance(v, (int, float))}]
        self.loop_values = self.loop_values[-3:] + [{v for lvl in self.nest.stack for v in lvl.values()}]
        for finding in inspect.moving_counters(self.numbers, set(counters), self.loop_values):
            self.findings.setdefault(finding, None)

    # -- the script's side (this run's thread) --
    def park(self, kind: str, value=None) -> None:
        self._event = Event(kind, value)
        self._to_driver.release()
        self._to_run.acquire()
        if self._command == "end":
            raise EndRun()

    def _main(self) -> None:
        global _current
        _current = self
        self.native_id = threading.get_native_id()
        if self.device is not None:
            import torch
            torch.cuda.set_device(self.device)
        script_dir = os.path.dirname(self.path)
        if script_dir not in sys.path:
            sys.path.insert(0, script_dir)  # as `python script.py` does: the script's own modules import
        sys.argv = [self.path, *self.argv]
        try:
            runpy.run_path(self.path, run_name="__main__")
            self._event = Event("ended")
        except EndRun:
            self._event = Event("ended", "abandoned")
        except SystemExit as exc:  # sys.exit(0) ends a script as returning does
            self._event = Event("ended") if exc.code in (0, None) else exc
        except BaseException as exc:  # noqa: BLE001 - the script's error, raised again in the driver
            self._event = exc
        finally:
            if _current is self:
                _current = None
            self._to_driver.release()


class _StandbyOutput(io.TextIOBase):
    """Where a standby's (and a re-entry's warm) output goes: the process's log, each line
    marked, never the job's output as if a live rank had printed it."""

    def __init__(self, name: str):
        self.name, self.buf = name, ""

    def write(self, text: str) -> int:
        self.buf += text
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            log.info("[not live, %s] %s", self.name, line)
        return len(text)


@contextlib.contextmanager
def quiet(yes: bool):
    """While a run is not live, its prints go to the log (module docstring of __init__)."""
    if not yes:
        yield
        return
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _StandbyOutput("stdout"), _StandbyOutput("stderr")
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
