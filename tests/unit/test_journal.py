"""The controller's journal and a restarted controller's resolution of what was in flight.
Pure: records folded in memory, a fake clock, the policy driven with messages; no processes."""
import json

import pytest

from tests.unit.test_policy import Node, new_policy, ready_standby, sends
from trainmover.config import Config
from trainmover.controller.durable import journal
from trainmover.controller.durable.journal import Journal, JournalError, fold
from trainmover.controller.durable.migration import Phase
from trainmover.controller.policy.actions import Finish, Record, ReleaseNode
from trainmover.controller.succession.supervisor import restart_decision
from trainmover.protocol.messages import make

from trainmover.protocol import files

KEY = b"k" * 32  # the job's key: the journal and the outcome are sealed with it


class Writer:
    """The executor's journaling, in memory: diff of the durable view after each decision."""

    def __init__(self, p):
        self.p, self.lines, self.seq = p, [], 0
        self.durable = p.durable()
        self.lines.append(self._line({"kind": "start", "job_id": 7, "world_size": 3, "ranks_per_node": 1,
                                      "batch_host": "train1",
                                      "rank_node": {str(r): n for r, n in p.view.rank_node.items()}}))

    def _line(self, rec):
        self.seq += 1
        return json.dumps({"v": journal.VERSION, "seq": self.seq, "t": 0.0, **rec}) + "\n"

    def __call__(self, actions=None):
        now = self.p.durable()
        self.lines += [self._line(r) for r in journal.diff(self.durable, now)]
        self.durable = now
        return actions


def preparing(tmp_path=None):
    """A job with a migration of train2 -> spare1 whose prepare was just decided (epoch 1)."""
    p = new_policy()
    w = Writer(p)
    w(ready_standby(p))
    w(p.on_nodes(10.0, {"train2": Node("ALLOCATED+DRAIN")}))
    return p, w


def resync(node, ranks, role="worker", step=50, pending=0, switched=0, state="training"):
    return make("resync", node=node, ranks=ranks, role=role, step=step, pending=pending, switched=switched, state=state)


def restarted(w, now=20.0, **cfg):
    """A successor's resume: the journal as it left it, ending in the successor's claim."""
    return restarted_from(w.lines, now, **cfg)


def restarted_from(lines, now=20.0, **cfg):
    p = new_policy(**cfg)
    claim = '{"v": 2, "seq": 999, "t": %s, "a": 1, "kind": "restart", "attempt": 1}\n' % now
    acts = p.resume(now, fold(lines + [claim]), metrics_through=45)
    return p, acts


# --- the journal itself -------------------------------------------------------------------
def test_replay_rebuilds_the_view_and_the_migration_in_flight():
    p, w = preparing()
    j = fold(w.lines)
    assert j.world_size == 3 and j.rank_node == {0: "train1", 1: "train2", 2: "train3"}
    state = j.durable()
    assert {n: s.state for n, s in state.view.standbys.items()} == {"spare1": "joining"} and state.epoch == 1
    (m,) = state.migrations
    assert (m.phase, m.epoch, m.leaver, m.joiner) == (Phase.PREPARING, 1, "train2", "spare1")
    assert state == p.state  # every durable field as the policy holds it


def test_straggler_evictions_survive_a_controller_restart():
    """status shows them, and the eviction cooldown counts from them, after the controller moved."""
    p = new_policy(straggler="evict")
    w = Writer(p)
    w(ready_standby(p))
    p.straggler["evicted"].append({"node": "train2", "t": 5.0, "verdict": "train2 is 30.0% slower"})
    w()
    q, _ = restarted(w, straggler="evict")
    assert q.status()["straggler"]["evicted"] == [{"node": "train2", "t": 5.0, "verdict": "train2 is 30.0% slower"}]


def test_a_torn_last_line_is_dropped_a_corrupt_middle_line_is_an_error():
    p, w = preparing()
    torn = w.lines + ['{"v": 1, "seq": 99, "kind": "migra']
    j = fold(torn)
    assert j.torn_tail and j.records == len(w.lines)
    bad = w.lines[:2] + ['{"v": 1, "kind": \n'] + w.lines[2:]
    with pytest.raises(JournalError, match="line 3 is corrupt"):
        fold(bad)


def test_records_are_validated():
    with pytest.raises(JournalError, match=r"version 3, this controller reads versions \[1, 2\]"):
        fold(['{"v": 3, "kind": "start"}\n'])
    with pytest.raises(JournalError, match="unknown kind 'view'"):  # a version 1 kind in a version 2 record
        fold(['{"v": 2, "kind": "view", "epoch": 3}\n'])
    with pytest.raises(JournalError, match=r"line 2 \(state\): state operation set \['nope', 'x'\] does not apply"):
        fold([json.dumps({"v": 2, **START}) + "\n",
              '{"v": 2, "kind": "state", "ops": [["set", ["nope", "x"], 1]]}\n'])
    with pytest.raises(JournalError, match=r"state does not decode: state.epoch: 'x' is not int"):
        fold([json.dumps({"v": 2, **START}) + "\n", '{"v": 2, "kind": "state", "ops": [["set", ["epoch"], "x"]]}\n'])
    with pytest.raises(JournalError, match="unknown kind"):
        fold(['{"v": 1, "kind": "teleport"}\n'])
    with pytest.raises(JournalError, match="'epoch' missing or malformed"):
        fold(['{"v": 1, "kind": "migration", "m": {"id": 1, "leaver": "a", "leaver_ranks": [1], "trigger": "drain",'
              ' "requested_at": 1.0, "joiner": "", "phase": "requested", "times": {}}}\n'])
    with pytest.raises(JournalError, match="no start record"):
        fold(['{"v": 1, "kind": "restart", "attempt": 1}\n'])


START = {"kind": "start", "job_id": 7, "world_size": 3, "ranks_per_node": 1, "batch_host": "train1",
         "rank_node": {"0": "train1", "1": "train2", "2": "train3"}}


def test_a_version_1_journal_of_the_previous_controller_still_loads():
    """A job started by a controller that wrote version 1 records (`view`, `migration`: the
    part of the state it picked) is taken over by this one; what they say lands in the state."""
    m = {"id": 1, "leaver": "train2", "leaver_ranks": [1], "trigger": "drain", "requested_at": 10.0, "epoch": 1,
         "joiner": "spare1", "phase": "preparing", "times": {"requested": 10.0, "preparing": 10.0},
         "switch_step": None, "downtime_s": None, "leaver_exited": False, "note": "", "recovery": False, "source": {}}
    recs = [START, {"kind": "launch", "node": "train1", "role": "worker", "ranks": [0], "pid": 5},
            {"kind": "view", "standbys": {"spare1": "joining"}, "epoch": 1, "fenced": [["train3", 9]],
             "evicted": [{"node": "train9", "t": 1.0, "verdict": "slow"}], "ranks": {"1": "spare1"},
             "released": ["train0"]},
            {"kind": "migration", "m": m}]
    j = fold([json.dumps({"v": 1, "seq": i + 1, "t": 0.0, **r}) + "\n" for i, r in enumerate(recs)])
    state = j.durable()
    assert state.view.rank_node == {0: "train1", 1: "spare1", 2: "train3"} and state.view.released == ["train0"]
    assert state.view.standbys["spare1"].state == "joining" and state.epoch == 1
    assert state.fenced_pids == {("train3", 9)} and state.evicted[0]["node"] == "train9"
    (mig,) = state.migrations
    assert (mig.phase, mig.joiner, mig.trigger, mig.times) == (Phase.PREPARING, "spare1", "drain", m["times"])
    p, _ = restarted_from([json.dumps({"v": 1, "seq": i + 1, "t": 0.0, **r}) + "\n" for i, r in enumerate(recs)])
    assert p.migrations[0].phase is Phase.PREPARING and p.view.standbys["spare1"].state == "joining"


def test_the_writer_fsyncs_appends_and_cuts_a_torn_tail(tmp_path):
    path = tmp_path / "journal.jsonl"
    p, w = preparing()
    sealed = [json.dumps(files.seal(KEY, journal.PURPOSE, json.loads(line))) + "\n" for line in w.lines]
    path.write_text("".join(sealed) + '{"v": 1, "ki')
    jn = Journal(path, key=KEY, seq=fold(path.read_text().splitlines(keepends=True), key=KEY).seq)
    jn.write(1.0, [{"kind": "restart", "attempt": 1}])
    jn.close()
    j = journal.read(path, KEY)
    assert not j.torn_tail and j.restarts == 1 and j.seq == len(w.lines) + 1


# --- resolution of a migration in flight ----------------------------------------------------
def test_switched_while_the_controller_was_down_is_completed():
    _, w = preparing()
    p, acts = restarted(w)
    assert any(isinstance(a, Record) and a.payload["event"] == "controller_resumed" for a in acts)
    assert p.status()["controller"] == {"restarts": 1, "resuming": True}
    assert p.on_tick(21.0) == []  # nothing is decided before the ranks have said where they are
    p.on_message(21.0, "train1", resync("train1", [0], switched=1))
    p.on_message(21.0, "train3", resync("train3", [2], switched=1))
    acts = p.on_message(21.1, "spare1", resync("spare1", [1], switched=1))  # the joiner holds rank 1
    m = p.migrations[0]
    assert p.resuming is None and m.phase is Phase.SWITCHING
    assert any(isinstance(a, Record) and a.payload.get("resolution") == "completed" for a in acts)
    for rank, node, role in ((0, "train1", "stayer"), (2, "train3", "stayer"), (1, "spare1", "joiner")):
        acts = p.on_message(21.2, node, {"type": "switched", "epoch": 1, "rank": rank, "role": role, "step": 50,
                                         "t": 21.2, "detail": {}})
    assert m.phase is Phase.RELEASING and p.view.rank_node[1] == "spare1"
    assert p.on_step_exit(22.0, "train2", 0) == [ReleaseNode("train2")]  # the adopted leaver step ended
    # a re-sent message changes nothing
    assert p.on_message(22.1, "train1", {"type": "switched", "epoch": 1, "rank": 0, "role": "stayer", "step": 50,
                                         "t": 21.2, "detail": {}}) == []


def test_nobody_prepared_the_epoch_so_it_is_aborted_and_asked_again():
    _, w = preparing()  # the controller died after journaling the prepare, before sending it
    p, _ = restarted(w)
    p.on_message(21.0, "train1", resync("train1", [0]))
    p.on_message(21.0, "train2", resync("train2", [1]))
    p.on_message(21.0, "train3", resync("train3", [2]))
    acts = p.on_message(21.1, "spare1", resync("spare1", [], role="standby", state="ready"))
    (abort,) = sends(acts, "abort")
    assert abort.msg["epoch"] == 1 and "spare1" in abort.nodes
    first, again = p.migrations
    assert first.phase is Phase.ABORTED and "before the switch of epoch 1" in first.note
    # the joiner never saw epoch 1 and is warm: the retry starts at once, with a new epoch
    (to_stayers, to_joiner) = sends(acts, "prepare")
    assert again.phase is Phase.PREPARING and again.epoch == 2 and to_joiner.msg["assign"] == {"0": 1}


def test_a_joiner_that_reconnects_after_the_abort_still_holding_its_epoch_is_told_again():
    """The abort went out while the joiner was cut off (it reconnects to the successor a moment
    later): its resync names the aborted epoch, and it gets the abort again, else it would wait
    for the leaver up to the group timeout and the retry would find no ready standby."""
    _, w = preparing()
    p, _ = restarted(w)
    p.on_message(21.0, "train1", resync("train1", [0]))
    p.on_message(21.0, "train2", resync("train2", [1]))
    acts = p.on_message(21.0, "train3", resync("train3", [2]))
    acts += p.on_tick(40.0)  # the joiner is late past the window: resolved without it, aborted
    first = p.migrations[0]
    assert first.phase is Phase.ABORTED
    acts = p.on_message(40.1, "spare1", resync("spare1", [], role="standby", pending=1, state="joining"))
    (abort,) = sends(acts, "abort")
    assert abort.nodes == ("spare1",) and abort.msg["epoch"] == 1
    # a process with nothing pending, or holding an epoch still in flight, is not told anything
    assert not sends(p.on_message(40.2, "train1", resync("train1", [0])), "abort")


def test_every_rank_holds_the_epoch_but_the_store_moved_so_it_is_aborted_and_asked_again():
    """A successor on another node serves a new rendezvous store: the Phase 1 in flight builds
    through the old one, which ended with the old controller, and cannot finish."""
    _, w = preparing()
    p, _ = restarted(w)
    p.store_moved = True
    for rank, node in ((0, "train1"), (1, "train2"), (2, "train3")):
        p.on_message(21.0, node, resync(node, [rank], pending=1))
    acts = p.on_message(21.0, "spare1", resync("spare1", [], role="standby", pending=1, state="joining"))
    (abort,) = sends(acts, "abort")
    first, again = p.migrations[:2]
    assert first.phase is Phase.ABORTED and "store moved" in first.note and again.leaver == first.leaver


def test_every_rank_still_holds_the_epoch_so_it_goes_on():
    _, w = preparing()
    p, _ = restarted(w)
    for rank, node in ((0, "train1"), (1, "train2"), (2, "train3")):
        p.on_message(21.0, node, resync(node, [rank], pending=1))
    acts = p.on_message(21.0, "spare1", resync("spare1", [], role="standby", pending=1, state="joining"))
    assert not sends(acts, "abort") and p.migrations[0].phase is Phase.PREPARING
    for rank, node in ((0, "train1"), (2, "train3"), (1, "train2"), (1, "spare1")):
        p.on_message(21.2, node, {"type": "prepared", "epoch": 1, "rank": rank, "groups": ["world"],
                                  "seconds": 0.1, "detail": {}})
    assert p.migrations[0].phase is Phase.SWITCHING


def test_a_rank_that_never_reconnects_stops_the_job_at_the_deadline():
    _, w = preparing()
    p, _ = restarted(w, reconnect_timeout_s=30.0)
    p.on_message(21.0, "train1", resync("train1", [0]))
    assert p.on_tick(49.0) == []
    (stop,) = p.on_tick(51.0)
    assert isinstance(stop, Finish) and not stop.ok and "ranks [1, 2] did not reconnect within 30s" in stop.message


def test_step_reports_already_logged_are_skipped_after_a_restart():
    _, w = preparing()
    p, _ = restarted(w)
    step = {"type": "step", "rank": 0, "step": 45, "loss": 1.0, "step_s": 0.1, "compute_s": 0.05, "t": 1.0}
    assert p.on_message(21.0, "train1", step) == [] and 45 not in p.rows
    p.on_message(21.0, "train1", {**step, "step": 46})
    assert 46 in p.rows


def test_a_recovery_in_flight_is_not_resumed():
    p = new_policy()
    w = Writer(p)
    w(ready_standby(p))
    w(p.on_peer_gone(10.0, "train2"))
    p2, acts = restarted(w)
    (stop,) = [a for a in acts if isinstance(a, Finish)]
    assert not stop.ok and "recovery in flight is not resumed" in stop.message


# --- the supervisor ----------------------------------------------------------------------------
@pytest.mark.parametrize("code, restarts, again", [(0, 0, False), (1, 0, False), (2, 0, False), (-9, 0, True),
                                                   (70, 2, True), (-9, 3, False)])
def test_restart_decision(code, restarts, again):
    assert restart_decision(code, restarts, 3, stopping=False)[0] is again
    assert restart_decision(-15, 0, 3, stopping=True) == (False, "the job is being stopped")


def test_a_requeued_job_whose_training_ended_has_nothing_left_to_do(tmp_path):
    """Slurm can requeue a job after its training ended; the second run ends at once (exit 0)
    only if final.json and status.json say this very job trained every step and ended well."""
    import json

    from trainmover.controller.durable.records import completed_before
    assert completed_before(tmp_path, 7, 500) is None                      # a first run
    (tmp_path / "final.json").write_text(json.dumps({"job_id": 7, "steps": 500, "digest": "x"}))
    (tmp_path / "status.json").write_text(json.dumps({"outcome": {"ok": True, "message": "training finished"}}))
    assert "nothing left to do" in completed_before(tmp_path, 7, 500)
    assert completed_before(tmp_path, 8, 500) is None                      # another job's files
    assert completed_before(tmp_path, 7, 1000) is None                     # more steps asked for now
    (tmp_path / "status.json").write_text(json.dumps({"outcome": {"ok": False, "message": "failed"}}))
    assert completed_before(tmp_path, 7, 500) is None                      # it did not end well


def test_one_nodes_ranks_that_never_come_back_after_a_move_are_recovered_not_the_job_stopped():
    """The controller's home died with the controller (and its rank): the successor waits the
    short window for that node, then treats it as a lost node (revoke, recover) instead of
    stopping the job after TM_RECONNECT_TIMEOUT_S."""
    p = new_policy()
    w = Writer(p)
    w(ready_standby(p))
    q, _ = restarted(w, now=20.0, reconnect_timeout_s=60.0)
    q.on_message(20.5, "spare1", resync("spare1", [], role="standby", state="ready"))
    for rank, node in ((1, "train2"), (2, "train3")):
        q.on_message(21.0, node, resync(node, [rank]))
    assert q.reconnect_window() == 8.0
    assert q.on_tick(27.0) == []
    acts = q.on_tick(28.5)
    (revoke,) = sends(acts, "revoke")
    assert revoke.msg["failed"] == [0] and "did not reconnect" in revoke.msg["reason"]
    assert q.recovery() is not None and q.recovery().leaver == "train1"
    assert not [a for a in acts if isinstance(a, Finish)]


def test_a_release_its_predecessor_left_due_is_done_by_the_successor():
    """A controller whose own node leaves hands over right before releasing it (it would end
    itself): its successor finds the migration RELEASING with the leaver gone and releases."""
    p, w = preparing()
    m = p.migrations[0]
    m.to(Phase.SWITCHING, 12.0)
    m.to(Phase.RELEASING, 12.5)
    m.leaver_exited = True
    w()
    q, acts = restarted(w)
    assert ReleaseNode("train2") in acts


def test_the_standby_history_reads_the_journal_this_controller_writes():
    """standbys/history.py reads past jobs' journals through the same replay: a drain's migration
    (planned) and the pool's refill (spare1 joined, spare2 warm later) from `state` records."""
    from trainmover.standbys import history
    p, w = preparing()
    for rank, node, role in ((0, "train1", "stayer"), (2, "train3", "stayer"), (1, "train2", "leaver"),
                             (1, "spare1", "joiner")):
        w(p.on_message(12.0, node, {"type": "switched", "epoch": 1, "rank": rank, "role": role, "step": 50,
                                    "t": 12.0, "detail": {}}))
    w(p.on_standby_acquired(13.0, "spare2"))
    w(p.on_message(14.0, "spare2", {"type": "ready", "node": "spare2", "local": 0, "warmup_s": 1.0, "shadow_steps": 3, "detail": {}}))
    lines = [json.dumps({**json.loads(line), "t": 60.0 * n}) + "\n" for n, line in enumerate(w.lines)]
    assert any(json.loads(line)["kind"] == "state" for line in lines)
    hours, planned, unplanned, refills = history.journal_exposure(lines)
    assert (planned, unplanned) == (1, 0) and hours == pytest.approx(3 * 60.0 * (len(lines) - 1) / 3600)
    assert len(refills) == 1 and refills[0] > 0
