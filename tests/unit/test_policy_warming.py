"""A ready standby that re-warms on a newer recording is not offered to a migration until it
is ready again; a re-warm's report that crosses a prepare does not undo the join."""
from trainmover.controller.durable.migration import Phase
from test_policy import Node, new_policy, ready_standby, sends


def test_a_warming_standby_is_not_taken_until_ready_again():
    p = new_policy()
    ready_standby(p)
    assert p.on_message(5.0, "spare1", {"type": "warming", "node": "spare1", "version": 2, "rank": 1}) == []
    assert p.status()["standbys"][0]["state"] == "warming"
    acts = p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")})
    assert not sends(acts, "prepare") and p.migrations[0].phase is Phase.WAITING_STANDBY
    acts = p.on_message(12.0, "spare1", {"type": "ready", "node": "spare1", "local": 0, "warmup_s": 9.0, "shadow_steps": 2,
                                         "detail": {"replay": "done", "version": 2}})
    assert sends(acts, "prepare") and p.active().joiner == "spare1"
    assert p.status()["standbys"][0]["shadow"]["version"] == 2


def test_a_rewarm_report_crossing_a_prepare_leaves_the_standby_joining():
    p = new_policy()
    ready_standby(p)
    p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")})
    assert p.status()["standbys"][0]["state"] == "joining"
    p.on_message(10.1, "spare1", {"type": "warming", "node": "spare1", "version": 2, "rank": 1})
    p.on_message(10.5, "spare1", {"type": "ready", "node": "spare1", "local": 0, "warmup_s": 9.0, "shadow_steps": 2, "detail": {}})
    assert p.status()["standbys"][0]["state"] == "joining"
