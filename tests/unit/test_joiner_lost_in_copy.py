"""A joiner lost during the state copy (the stayers already switched to groups with it in the
leaver's slot): the slot is held by a lost process, the leaver's send fails and it stops
(roles/switch.py); the leaver's ranks are recovered from a replica onto another standby, in
whichever order the controller hears of the two losses."""
from __future__ import annotations

import pytest

from tests.unit.test_policy import Node, new_policy, sends, stalled
from trainmover.controller.durable.migration import Phase
from trainmover.controller.policy.actions import ReleaseNode


def switching(p):
    """Two warm standbys; train2 drained; every rank prepared: the migration is switching."""
    p.start(0.0)
    for t, node in ((1.0, "spare1"), (2.0, "spare2")):
        p.on_standby_acquired(t, node)
        p.on_message(t + 0.5, node, {"type": "ready", "node": node, "local": 0, "warmup_s": 2.0, "shadow_steps": 2,
                                     "detail": {}})
    p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")})
    planned = p.active()
    for rank, node in ((0, "train1"), (2, "train3"), (1, "train2"), (1, planned.joiner)):
        p.on_message(10.2, node, {"type": "prepared", "epoch": 1, "rank": rank, "groups": ["world"], "seconds": 0.1,
                                  "detail": {}})
    assert planned.phase is Phase.SWITCHING
    return planned


@pytest.mark.parametrize("joiner_heard_first", [True, False])
def test_the_leavers_ranks_are_recovered_onto_another_standby(joiner_heard_first):
    p = new_policy(standbys=2)
    planned = switching(p)
    first = planned.joiner
    other = "spare2" if first == "spare1" else "spare1"
    losses = [(first, ()), ("train2", (1,))]
    acts = []
    for node, ranks in (losses if joiner_heard_first else losses[::-1]):
        acts += p.on_peer_gone(10.6, node, ranks)
    r = p.recovery()
    assert planned.phase is Phase.FAILED and r is not None and r.leaver == "train2" and r.leaver_ranks == (1,)
    assert ("joiner" in planned.note and "lost during the state copy" in planned.note) == joiner_heard_first
    assert ReleaseNode(first) in acts  # the lost joiner's node goes back to Slurm
    assert set(sends(acts, "revoke")[0].nodes) >= {"train1", "train3"}
    # the other standby takes the rank (anticipated), the dead one never does
    assert r.joiner == other and p.view.rank_node[1] != first
    acts = stalled(p, 10.8, 0, 40) + stalled(p, 10.9, 2, 40)
    to_stayers, to_joiner = sends(acts, "recover")
    assert to_joiner.nodes == (other,) and to_joiner.msg["assign"] == {"0": 1} and to_joiner.msg["tier"] == "replica"
    assert first not in to_stayers.nodes and r.phase is Phase.PREPARING
    assert any(x["node"] == first for x in p.standbys_lost)


def test_control_a_leaver_lost_in_the_copy_with_its_joiner_alive_gives_the_slot_to_that_joiner():
    p = new_policy(standbys=2)
    planned = switching(p)
    p.on_peer_gone(10.6, "train2", (1,))
    r = p.recovery()
    assert r.joiner == planned.joiner and p.view.rank_node[1] == planned.joiner
    assert "leaver lost during the state copy" in planned.note and p.standbys_lost == []
