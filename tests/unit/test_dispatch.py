"""The rank process's one inbox reader (runtime/dispatch.py): routes by state, voids the rest."""
from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest

from trainmover.protocol.messages import make, typed
from trainmover.runtime.dispatch import GONE, GONE_TYPE, ROUTABLE, Aborted, Dispatcher, Plan, Started
from trainmover.runtime.rankstate import RankState, RankStateMachine

S = RankState


def machine(*path: RankState) -> RankStateMachine:
    m = RankStateMachine(S.STARTING, who="test")
    for st in path:
        m.to(st)
    return m


def test_a_message_goes_where_the_state_routes_it_and_elsewhere_is_void():
    q: queue.Queue = queue.Queue()
    seen: list[tuple[str, str]] = []
    state = machine(S.READY)
    d = Dispatcher(q, state, {(S.READY, "hold"): lambda m: seen.append(("ready", m.TYPE)),
                              (S.TRAINING, "hold"): lambda m: seen.append(("training", m.TYPE))})
    hold = make("hold", holder="", wards=[0], prefix="p")
    q.put(hold)
    q.put(make("prepare", epoch=1, leavers=[0], joiner_node="n", assign={}, options={}))
    assert d.poll() is None and seen == [("ready", "hold")]
    assert d.void == {("ready", "prepare"): 1}  # no route for a prepare here: counted, not handled
    state.to(S.JOINING)
    state.to(S.TRAINING)
    q.put(hold)
    d.poll()
    assert seen == [("ready", "hold"), ("training", "hold")]  # the same type, routed by the state now


def test_the_first_result_ends_a_poll_and_what_follows_stays_queued():
    q: queue.Queue = queue.Queue()
    state = machine(S.READY, S.JOINING)
    d = Dispatcher(q, state, {(S.JOINING, "abort"): lambda m: Aborted(m.epoch) if m.epoch == 3 else None,
                              (S.JOINING, "recover"): Plan})
    q.put(make("abort", epoch=2, reason="another epoch"))   # not the one it joins: nothing
    q.put(make("abort", epoch=3, reason="its epoch"))
    recover = make("recover", epoch=4, failed=[0], step=1, source=1, needers=[0], assign={"0": 0},
                   tier="replica", holders={}, foreseen="")
    q.put(recover)
    assert d.poll() == Aborted(3)
    assert d.poll() == Plan(typed(recover))  # handlers get the message's class (protocol/messages.py)
    assert d.poll() is None


def test_a_wait_ends_at_a_result_or_its_timeout_and_the_controllers_end_is_a_result_where_routed():
    q: queue.Queue = queue.Queue()
    state = machine(S.READY)
    d = Dispatcher(q, state, {(S.READY, GONE_TYPE): lambda _: GONE,
                              (S.READY, "prepare"): lambda m: Started(7)})
    assert d.wait(0.05) is None                       # nothing came: the caller re-warms
    threading.Timer(0.05, q.put, (make("prepare", epoch=1, leavers=[0], joiner_node="n", assign={"0": 0},
                                       options={}),)).start()
    assert d.wait(5) == Started(7)
    q.put(None)
    assert d.wait(5) is GONE
    state.to(S.JOINING)
    state.to(S.TRAINING)
    q.put(None)
    assert d.wait(0.05) is None and d.void[("training", GONE_TYPE)] == 1  # a worker trains on without it


def test_a_route_for_a_type_no_controller_sends_a_rank_is_refused():
    with pytest.raises(ValueError, match="steps"):
        Dispatcher(queue.Queue(), machine(), {(S.READY, "steps"): lambda m: None})


def test_the_agents_table_routes_what_each_waiting_state_must_hear():
    """The agent's one table (worker.Agent.routes): what each place that waits hears, and that
    a stalled rank and a joiner whose leaver died both take the plan."""
    from trainmover.runtime.worker import Agent

    def role(*names):
        return SimpleNamespace(**{n: (lambda n: lambda m: n)(n) for n in names})

    fake = SimpleNamespace(switch=role("on_prepare", "on_abort", "on_join_abort"),
                           protection=role("on_hold", "hold_for"), recovery=role("anticipate", "foresee"),
                           _join=lambda m: "_join", _take_failed_rank=lambda m: "_take_failed_rank",
                           ready_again_after_abort=lambda m: "ready_again_after_abort")
    routes = Agent.routes(fake)  # type: ignore[arg-type]
    by_state: dict[RankState, set[str]] = {}
    for st, kind in routes:
        by_state.setdefault(st, set()).add(kind)
    assert by_state == {S.TRAINING: {"prepare", "abort", "hold", "foresee"},
                        S.READY: {"prepare", "anticipate", "recover", "hold", "foresee", "abort", GONE_TYPE},
                        S.JOINING: {"abort", "recover", GONE_TYPE},
                        S.STALLED: {"recover", GONE_TYPE}}
    # revoke and fenced act on the reader thread (Agent._on_control): never routed from the queue
    assert not any(kind in ("revoke", "fenced") for _, kind in routes) and {"revoke", "fenced"} <= ROUTABLE
    assert routes[(S.TRAINING, "prepare")](None) == "on_prepare" and routes[(S.READY, "prepare")](None) == "_join"
    recover = {"type": "recover"}
    assert routes[(S.STALLED, "recover")](recover) == Plan(recover) == routes[(S.JOINING, "recover")](recover)


def test_no_role_reads_the_inbox_queue_itself():
    """Only the dispatcher takes from the queue the link fills (the link puts, the stub ranks of
    the scale harness are a program of their own): a role that read it would bypass the table."""
    from pathlib import Path

    runtime = Path(__file__).resolve().parents[2] / "trainmover" / "runtime"
    readers = [str(p.relative_to(runtime)) for p in sorted(runtime.rglob("*.py"))
               if p.name not in ("dispatch.py", "link.py", "stub_node.py")
               and any(s in p.read_text().replace("Dispatcher(self.link.inbox", "") for s in
                       ("inbox.get(", "inbox.get_nowait(", "link.inbox"))]
    assert readers == [], readers
    assert "self.inbox.wait(" in (runtime / "worker.py").read_text()  # the control: the standby's wait goes through it
