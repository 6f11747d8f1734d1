"""A leaver whose state transfer fails (its joiner lost mid-copy, or the pair broken or taken over
by a process outside the job) stops as a lost rank: the stayers switched at that boundary, so it
cannot go back, and its error must not end the job as the rank's own (roles/switch.py)."""
from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from trainmover.errors import MigrationError
from trainmover.runtime.roles import switch as switch_mod
from trainmover.runtime.roles.switch import Switch


class Killed(BaseException):
    """Stands for the SIGKILL: nothing after it runs."""


def leaver(monkeypatch, send):
    sent, kills, applied = [], [], []
    ctx = SimpleNamespace(full_state=lambda step: {"workload": {}, "step": step}, store=SimpleNamespace(set=lambda k, v: None),
                          faults=SimpleNamespace(at=lambda *a, **k: False), key=b"k" * 32, rank=1,
                          send=lambda kind, **f: sent.append(kind), apply=applied.append,
                          state=SimpleNamespace(to=lambda s: applied.append(s)))
    monkeypatch.setattr(switch_mod.transfer, "send_verified", send)

    def kill(pid, sig):
        kills.append(sig)
        raise Killed

    monkeypatch.setattr(switch_mod.os, "kill", kill)
    prep = SimpleNamespace(epoch=3, rank=1, xfer=object(), plan=None, plan_s=0.0)
    return Switch(ctx, None, None, None), prep, sent, kills


@pytest.mark.parametrize("error", [RuntimeError("Connection closed by peer [127.0.0.9]:41234"),
                                   MigrationError("the joiner asked for the state 3 times", phase="copy", rank=1)])
def test_a_failed_send_stops_the_leaver_as_a_lost_rank_never_as_its_own_error(monkeypatch, caplog, error):
    def send(*a, **k):
        raise error
    s, prep, sent, kills = leaver(monkeypatch, send)
    with pytest.raises(Killed):
        s.leave(prep, 40)
    assert kills == [signal.SIGKILL] and sent == []  # neither `failed` (the job would end) nor `switched`
    assert "sending this leaver's state at step 40 failed" in caplog.text


def test_control_a_send_that_succeeds_switches_and_kills_nothing(monkeypatch):
    stats = SimpleNamespace(seconds=0.1, copy_s=0.05, bytes=8, tensors=1, parts={})
    s, prep, sent, kills = leaver(monkeypatch, lambda *a, **k: stats)
    s.leave(prep, 40)
    assert kills == [] and sent == ["switched"]
