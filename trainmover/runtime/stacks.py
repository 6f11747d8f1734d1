"""A poor man's sampling profiler for the moments after a switch or a recovery (TM_TRACE_SWITCH):
every `every_s` for `for_s`, the innermost frames of each thread of this process are logged, so
that a pause nobody's timer accounts for (issue 36: 0.8 s between a joiner's state copy and its
`switched`, a 2.7 s first step) shows what the process was doing."""
from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

log = logging.getLogger("trainmover.worker")


def sample(for_s: float = 4.0, every_s: float = 0.1, depth: int = 4) -> None:
    """Start sampling in a daemon thread (returns at once)."""
    me = threading.current_thread().ident

    def run():
        names = {}
        end = time.monotonic() + for_s
        while time.monotonic() < end:
            names.update({t.ident: t.name for t in threading.enumerate()})
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident():
                    continue
                where = " < ".join(f"{f.name}@{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                                   for f in reversed(traceback.extract_stack(frame)[-depth:]))
                log.info("stack %.3f %s%s: %s", time.time(), names.get(ident, ident), " (main)" * (ident == me), where)
            time.sleep(every_s)
    threading.Thread(target=run, name="tm-stacks", daemon=True).start()
