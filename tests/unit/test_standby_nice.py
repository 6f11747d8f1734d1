"""Only a standby's warm-up is niced, in a thread of its own (runtime/roles/standby.py): the thread
that joins and trains keeps the job's priority, which an unprivileged process could not take
back (lowering niceness needs CAP_SYS_NICE)."""
from __future__ import annotations

import os
import threading

import pytest

from trainmover.runtime.roles.standby import niced, thread_nice


def test_the_work_runs_niced_in_its_own_thread_and_the_caller_keeps_its_priority():
    before = thread_nice()
    seen = {}

    def warm_up(x):
        seen["tid"] = threading.get_native_id()
        seen["nice"] = thread_nice()
        child = threading.Thread(target=lambda: seen.setdefault("child", thread_nice()))
        child.start()
        child.join()
        return x, "done"

    assert niced(10, warm_up, 7) == (7, "done", min(before + 10, 19))
    assert seen["tid"] != threading.get_native_id()
    assert seen["nice"] == min(before + 10, 19) and seen["child"] == seen["nice"]  # its threads inherit it
    assert thread_nice() == before  # the training thread: never niced, nothing to take back


def test_no_nice_runs_at_the_callers_priority_and_errors_reach_the_caller():
    assert niced(0, lambda: None) == (None, thread_nice())

    def boom():
        raise RuntimeError("warm-up failed")

    with pytest.raises(RuntimeError, match="warm-up failed"):
        niced(5, boom)


def _as_ordinary_user_after_niced() -> None:
    """Child process body: drop to nobody, nice a warm-up, check the main thread is at 0."""
    os.setgid(65534)
    os.setuid(65534)
    assert thread_nice() == 0
    assert niced(10, thread_nice)[0] == 10
    assert thread_nice() == 0
    with pytest.raises(PermissionError):  # what the old whole-process nice could not undo
        os.setpriority(os.PRIO_PROCESS, 0, 10)
        os.setpriority(os.PRIO_PROCESS, 0, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become an unprivileged user")
def test_an_unprivileged_joiner_trains_at_nice_0():
    if thread_nice() != 0:
        pytest.skip("the test process itself runs niced")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _as_ordinary_user_after_niced()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
