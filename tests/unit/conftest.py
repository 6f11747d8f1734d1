"""Tests marked `gloo_threads` (gloo groups on threads of the pytest process) run in a forked child.

Why: gloo ends the whole process with std::terminate when a context whose peer is gone is
destroyed, or when an abandoned operation times out in one of its threads. In the pytest
process that would end the entire run without a report (CI saw "Fatal Python error:
Aborted"); in a child it fails only that test, with what the child printed. Bounded: a
child that outlives CHILD_DEADLINE_S is killed and its test fails.
"""
from __future__ import annotations

import json
import os
import select
import signal
import time

import pytest
from _pytest.reports import TestReport
from _pytest.runner import runtestprotocol

CHILD_DEADLINE_S = 600


OWN_PROCESS_CHILD = "PYTEST_OWN_PROCESS_CHILD"  # set in the fresh process: run the test there


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    own = item.get_closest_marker("own_process") is not None and not os.environ.get(OWN_PROCESS_CHILD)
    if not own and item.get_closest_marker("gloo_threads") is None:
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in (_run_fresh(item) if own else _run_forked(item)):
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _run_fresh(item) -> list[TestReport]:
    """The test in a new pytest process (`own_process`). Why: a forked child inherits whatever
    earlier tests left in this worker (threads of torch's compiler, gloo, stores, and the locks
    they held at the fork); the rank-process tests, many threads of real groups in one child,
    crashed there once in CI (SIGSEGV in train_step), never when run alone."""
    import subprocess
    import sys
    env = {**os.environ, OWN_PROCESS_CHILD: "1"}
    argv = [sys.executable, "-m", "pytest", item.nodeid, "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
            "--tb=short", "-rN"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=str(item.config.rootpath), env=env, capture_output=True, text=True,
                              timeout=CHILD_DEADLINE_S)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = -1, f"no result within {CHILD_DEADLINE_S}s\n{exc.stdout or ''}"
    outcome = "passed" if rc == 0 else "failed"
    longrepr = None if rc == 0 else f"the test's own pytest process exited {rc}:\n{out[-6000:]}"
    return [TestReport(item.nodeid, item.location, {}, outcome, longrepr, "call", duration=time.monotonic() - t0)]


def _run_forked(item) -> list[TestReport]:
    hook = item.config.hook
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: setup, call and teardown of this one test, reports back as JSON
        os.close(r)
        code = 0
        try:
            # One intra-op thread: an OpenMP pool the parent started (any earlier test that
            # trained in the pytest process) does not survive the fork, and using it hangs.
            import torch
            torch.set_num_threads(1)
            reports = runtestprotocol(item, log=False, nextitem=None)
            data = [hook.pytest_report_to_serializable(config=item.config, report=rep) for rep in reports]
            with os.fdopen(w, "wb") as f:
                f.write(json.dumps(data).encode())
        except BaseException:  # noqa: BLE001 - whatever happens, never return into pytest's loop
            code = 1
        finally:
            os._exit(code)  # no interpreter teardown: gloo contexts are never destroyed
    os.close(w)
    data, deadline = b"", time.monotonic() + CHILD_DEADLINE_S
    with os.fdopen(r, "rb") as f:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([f], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(f.fileno(), 1 << 16)
            if not chunk:
                break
            data += chunk
    _, status = os.waitpid(pid, 0)
    try:
        reports = [hook.pytest_report_from_serializable(config=item.config, data=d) for d in json.loads(data)]
    except ValueError:
        how = (f"was killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exited with {os.WEXITSTATUS(status)}")
        if time.monotonic() >= deadline:
            how += f" after {CHILD_DEADLINE_S}s (deadline)"
        return [TestReport(item.nodeid, item.location, {}, "failed",
                           f"the forked child running this test {how} before reporting", "call")]
    for rep in reports:  # JSON made a skip's (path, line, reason) a list; --junitxml asserts a tuple
        if rep.skipped and isinstance(rep.longrepr, list):
            rep.longrepr = tuple(rep.longrepr)
    return reports
