"""Load on slurmctld (issue 30): the drain-notice push path's trust rules, the one-RPC node
query, and the controller's standby-pool gate. Pure logic and files; no Slurm."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from trainmover.controller.node_watch import NodeWatch, PoolWatch, notice_watcher
from trainmover.errors import SlurmError
from trainmover.healthcheck import notify
from trainmover.slurm import CliSlurm, commands, drain_notice
from trainmover.slurm.client import node_query_program
from trainmover.slurm.model import NodeInfo

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="notices are root's: the tests chown files")
NOBODY = 65534


def _dir(tmp_path):
    d = tmp_path / "drains"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    return d


@needs_root
def test_notice_reaches_a_watcher_of_that_node_only_once(tmp_path):
    d = _dir(tmp_path)
    drain_notice.publish(d, "train1", "trainmover: gpu xid 79", 100.0)  # before the watcher: old news
    w = drain_notice.Watcher(d)
    assert w.fresh(["train1", "train2"]) == []
    path = drain_notice.publish(d, "train2", "trainmover: gpu xid 79", 101.0)
    assert json.loads(path.read_text()) == {"node": "train2", "reason": "trainmover: gpu xid 79", "at": 101.0}
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert w.fresh(["train3"]) == []           # not ours: seen, never reported
    assert w.fresh(["train1", "train2"]) == []  # ...nor later
    drain_notice.publish(d, "train1", "again", 102.0)
    assert w.fresh(["train1", "train2"]) == ["train1"]
    assert w.fresh(["train1", "train2"]) == []
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no temporary file left


@needs_root
def test_watcher_ignores_what_a_user_could_write(tmp_path):
    d = _dir(tmp_path)
    w = drain_notice.Watcher(d)
    (d / "train1").write_text("{}")
    os.chown(d / "train1", NOBODY, NOBODY)       # a user's file (as if a user could write there)
    (d / "train2").write_text("{}")
    (d / "train2").chmod(0o666)                  # root's but writable by anyone
    os.symlink(d / "train2", d / "train3")       # a link
    assert w.fresh(["train1", "train2", "train3"]) == []
    os.chown(d, NOBODY, NOBODY)                  # the directory itself a user's: nothing in it counts
    (d / "train4").write_text("{}")
    assert w.fresh(["train4"]) == [] and "not root's alone" in w.refused


@needs_root
def test_root_refuses_a_directory_a_user_could_write(tmp_path):
    d = _dir(tmp_path)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match="only root"):
        drain_notice.publish(d, "train1", "r", 1.0)
    good = tmp_path / "good"
    good.mkdir(mode=0o755)
    link = tmp_path / "link"
    os.symlink(good, link)
    with pytest.raises(OSError):  # O_NOFOLLOW: a link in place of the directory is not followed
        drain_notice.publish(link, "train1", "r", 1.0)
    with pytest.raises(ValueError, match="not a node name"):
        drain_notice.publish(good, "../etc", "r", 1.0)
    assert list(good.iterdir()) == []
    # the health check reports, never fails, when its notice cannot be written
    assert "drain notice for train1 not written" in notify.announce(d, "train1", "r")[0]
    assert notify.announce(None, "train1", "r") == []


def test_notice_directory_setting(tmp_path):
    conf = tmp_path / "etc" / "slurm.conf"
    conf.parent.mkdir()
    assert drain_notice.default_dir(str(conf)) is None and notice_watcher("auto", str(conf)) is None
    (conf.parent / drain_notice.DIR_NAME).mkdir()
    assert drain_notice.default_dir(str(conf)) == conf.parent / drain_notice.DIR_NAME
    assert notice_watcher("off", str(conf)) is None
    assert notice_watcher("auto", str(conf)).directory == conf.parent / drain_notice.DIR_NAME


# --- the node query --------------------------------------------------------------------------------

def _line(name, state):
    return f"NodeName={name} Arch=x86_64 NodeAddr=127.0.0.1 State={state} Reason=r [root@2026-01-01T00:00:00]\n"


def test_node_query_program_replaces_scontrol(tmp_path):
    conf = tmp_path / "slurm.conf"
    assert node_query_program("auto", str(conf)) is None  # not installed: scontrol
    prog = tmp_path / "tm_nodes"
    prog.write_text("#!/bin/sh\n")
    prog.chmod(0o755)
    assert node_query_program("auto", str(conf)) == str(prog)
    assert node_query_program("off", str(conf)) is None and node_query_program("/x/q", None) == "/x/q"
    seen = []

    def runner(argv, timeout, env):
        seen.append(argv)
        if argv[0] == str(prog):
            out = "".join(_line(n, "ALLOCATED+DRAIN") for n in argv[1:] if n != "ghost")
            return subprocess.CompletedProcess(argv, 2 if "ghost" in argv else 0,
                                               out + ("Node ghost not found\n" if "ghost" in argv else ""), "")
        return subprocess.CompletedProcess(argv, 0, _line("a", "IDLE"), "")

    client = CliSlurm(slurm_conf=str(conf), node_query="auto")
    with commands.intercept(runner):
        got = client.nodes(["a", "b"])
        assert seen[-1] == [str(prog), "a", "b"] and got["b"].draining
        with pytest.raises(SlurmError, match=r"\['ghost'\]"):
            client.nodes(["a", "ghost"])
        client.nodes()  # every node (the per-cluster reader): the program without names
        assert seen[-1] == [str(prog)]
        CliSlurm(slurm_conf=str(conf), node_query="off").nodes(["a"])
        assert seen[-1][:4] == ["scontrol", "-o", "show", "node"]


# --- the standby pool gate -------------------------------------------------------------------------

class _Slurm:
    def __init__(self):
        self.asked = 0

    def reservation_nodes(self, name):
        self.asked += 1
        return ["spare1", "spare2"]


def _info(name, state):
    return NodeInfo(name, "127.0.0.1", state)


def test_pool_gate_asks_slurm_only_when_a_spare_was_idle():
    slurm = _Slurm()
    pool = PoolWatch(slurm, "trainmover_standby")
    assert pool.none_idle() == ""  # not seen yet: ask
    assert pool.nodes() == ["spare1", "spare2"] and pool.nodes() == ["spare1", "spare2"] and slurm.asked == 1
    pool.saw({"spare1": _info("spare1", "ALLOCATED"), "spare2": _info("spare2", "IDLE+DRAIN")})
    assert "no idle node in reservation trainmover_standby" in pool.none_idle()
    pool.saw({"spare1": _info("spare1", "IDLE+RESERVED"), "spare2": _info("spare2", "ALLOCATED")})
    assert pool.none_idle() == ""
    pool.asked()  # after a request: the reservation is read again at the next poll
    assert pool.nodes() == ["spare1", "spare2"] and slurm.asked == 2


@needs_root
def test_trainmover_drain_drains_then_writes_the_notice(tmp_path, capsys):
    from trainmover.cli import main
    d = _dir(tmp_path)
    seen = []

    def runner(argv, timeout, env):
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    watcher = drain_notice.Watcher(d)
    with commands.intercept(runner):
        assert main(["drain", "train2", "--reason", "bad fan", "--notices", str(d)]) == 0
    assert seen == [["scontrol", "update", "NodeName=train2", "State=DRAIN", "Reason=bad fan"]]
    assert watcher.fresh(["train2"]) == ["train2"] and "its jobs were told" in capsys.readouterr().out
    os.chown(d, NOBODY, NOBODY)  # a directory root must not write into: drained all the same, said so
    with commands.intercept(runner):
        assert main(["drain", "train3", "--reason", "x", "--notices", str(d)]) == 0
    assert "drain notice not written" in capsys.readouterr().err and not (d / "train3").exists()


# --- the per-cluster node-state reader -------------------------------------------------------------

@needs_root
def test_shared_node_states_fresh_stale_and_untrusted(tmp_path):
    from trainmover.slurm import node_states

    class Reader:
        calls = 0

        def nodes(self, names=None):
            Reader.calls += 1
            return {"train1": _info("train1", "ALLOCATED+DRAIN"), "spare1": _info("spare1", "IDLE")}

    d = _dir(tmp_path)
    shared = node_states.Shared(d)
    assert shared.read(100.0) is None  # no reader: the controller polls itself
    clock = iter([100.0, 100.1])
    node_states.serve(Reader(), d, 2.0, clock=lambda: next(clock), sleep=lambda s: None, rounds=1)
    at, table = shared.read(101.0)
    assert Reader.calls == 1 and at == 100.0 and table["train1"].draining and table["spare1"].idle
    assert shared.read(100.0 + 3 * 2.0 + 0.1) is None  # three intervals without a new table: stale
    assert not (d / drain_notice.DIR_NAME).exists() and drain_notice.Watcher(d).fresh(["train1"]) == []
    (d / node_states.FILE).chmod(0o666)  # writable by others: not trusted
    assert shared.read(101.0) is None


class _Cluster(_Slurm):
    """nodes() as Slurm would answer, counting the calls (each one RPC with tm_nodes)."""

    def __init__(self):
        super().__init__()
        self.state = {"train1": "ALLOCATED", "train2": "ALLOCATED", "spare1": "ALLOCATED", "spare2": "ALLOCATED"}
        self.queries: list[list[str]] = []

    def nodes(self, names=None):
        self.queries.append(list(names))
        return {n: _info(n, self.state[n]) for n in names}


@needs_root
def test_node_watch_polls_every_poll_s_and_hears_a_notice_at_once(tmp_path):
    d = _dir(tmp_path)
    slurm = _Cluster()
    watch = NodeWatch(slurm, reservation="r", poll_s=10.0, notices=str(d), slurm_conf=None)
    mine, ranks = ["train1", "train2"], ["train1", "train2"]
    assert set(watch.turn(0.0, mine, ranks)) == {"train1", "train2"}  # first poll: the job's nodes
    assert slurm.queries == [["train1", "train2", "spare1", "spare2"]]  # ...and the reservation's, one call
    assert "no idle node" in watch.pool.none_idle()
    for t in (0.2, 2.0, 4.9):
        assert watch.turn(t, mine, ranks) == {}  # nothing between polls: no query
    assert len(slurm.queries) == 1
    slurm.state["train2"] = "ALLOCATED+DRAIN"
    drain_notice.publish(d, "train2", "trainmover: healthcheck gpu", 5.0)
    got = watch.turn(5.05, mine, ranks)
    assert got["train2"].draining and slurm.queries[-1] == ["train2"]  # the notice, confirmed by one query
    assert watch.status()["drains_seen"] == {"train2": {"via": "drain notice", "at": 5.05}}
    assert watch.status()["source"] == "poll"
    assert watch.turn(5.2, mine, ranks) == {}  # an old notice is not news again
    slurm.state["spare1"] = "IDLE"
    watch.turn(10.0, mine, ranks)
    assert watch.pool.none_idle() == "" and len(slurm.queries) == 3
    # a notice whose node Slurm says is fine: the states go to the policy, which sees no drain
    drain_notice.publish(d, "train1", "forged?", 12.0)
    assert not watch.turn(12.1, mine, ranks)["train1"].draining
    assert set(watch.status()["drains_seen"]) == {"train2"}  # a forged notice is no drain seen
    # polls keep to their grid: a turn 0.15 s late does not push the next one back
    watch.turn(20.15, mine, ranks)
    assert watch.next_poll == 30.0 and watch.turn(29.9, mine, ranks) == {} and watch.turn(30.0, mine, ranks)


@needs_root
def test_node_watch_takes_the_readers_table_instead_of_polling(tmp_path):
    from trainmover.slurm import node_states
    d = _dir(tmp_path)
    slurm = _Cluster()
    watch = NodeWatch(slurm, reservation="r", poll_s=10.0, notices=str(d), slurm_conf=None)
    everything = {n: _info(n, s) for n, s in slurm.state.items()}
    node_states.write(d, everything, 100.0, 2.0)
    assert set(watch.turn(100.5, ["train1"], ["train1"])) == {"train1"} and slurm.queries == []
    assert watch.turn(101.0, ["train1"], ["train1"]) == {}  # the same table: nothing new
    everything["train1"] = _info("train1", "ALLOCATED+DRAIN")
    node_states.write(d, everything, 102.0, 2.0)
    assert watch.turn(102.1, ["train1"], ["train1"])["train1"].draining and slurm.queries == []
    assert watch.status() == {"source": "node-reader", "poll_s": 10.0,
                              "drains_seen": {"train1": {"via": "node-reader", "at": 102.1}}}
    everything["train1"] = _info("train1", "ALLOCATED")  # resumed: the next drain is a new one
    node_states.write(d, everything, 103.0, 2.0)
    watch.turn(103.1, ["train1"], ["train1"])
    assert watch.status()["drains_seen"] == {}
    everything["train1"] = _info("train1", "ALLOCATED+DRAIN")
    node_states.write(d, everything, 104.0, 2.0)
    watch.turn(104.1, ["train1"], ["train1"])
    slurm.state["train1"] = "ALLOCATED+DRAIN"  # as Slurm says it too
    # the reader stopped: its table goes stale and the job polls for itself
    assert set(watch.turn(104.0 + 3 * 2.0 + 0.5, ["train1"], ["train1"])) == {"train1"}
    assert watch.status()["source"] == "poll"
    assert watch.status()["drains_seen"] == {"train1": {"via": "node-reader", "at": 104.1}}  # first seen there
    assert slurm.queries == [["train1", "spare1", "spare2"]]


class _NoReservation:
    def reservation_nodes(self, name):
        raise SlurmError(f"reservation {name} not found")


def test_pool_gate_without_a_readable_reservation_never_gates():
    pool = PoolWatch(_NoReservation(), "r")
    assert pool.nodes() == [] and pool.none_idle() == ""
