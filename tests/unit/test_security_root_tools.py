"""Issue 37, round two, the low findings: what root's tools (`migrate`, `status`, `node-reader`,
`drain`, `demo`, `plan`) do with what another user can plant (docs/security.md). Each test has
its negative control: what the old check let through."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import stat
from pathlib import Path

import pytest

from trainmover import cli, demo
from trainmover.errors import ConfigError
from trainmover.protocol import channel, endpoint, files
from trainmover.slurm import drain_notice, parse
from trainmover.standbys import history

client = importlib.import_module("trainmover.slurm.client")  # the package's `client` is a function
USER, OTHER = 1000, 1001
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="another user's files need root to make")


def _users_run_dir(tmp_path: Path, uid: int) -> tuple[Path, bytes]:
    run = tmp_path / f"runs-{uid}" / "7"
    run.mkdir(parents=True, mode=0o700)
    key = channel.write_secret(str(run / "secret"))
    endpoint.write(run, endpoint.Endpoint("127.0.0.1", 1, "127.0.0.1", 2, "train1"), key)
    for p in (run, run / "secret", run / endpoint.NAME):
        os.chown(p, uid, uid)
    return run, key


@as_root
def test_roots_migrate_takes_only_the_jobs_users_run_directory_and_follows_no_link(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(cli, "_job_uid", lambda job: USER)
    monkeypatch.setattr(channel, "request", lambda addr, key, msg, timeout: asked.append(key) or
                        {"ok": True, "message": "migrating"})
    own, key = _users_run_dir(tmp_path, USER)
    args = argparse.Namespace(job="7", run_dir=str(own), node="train1", timeout=1.0)
    assert cli._migrate(args) == 0 and asked == [key]
    other, other_key = _users_run_dir(tmp_path, OTHER)
    link = tmp_path / "link"
    link.symlink_to(other)
    # negative control: the old read took the key of whoever owns the link's target
    assert channel.read_secret(str(link / "secret")) == other_key
    with pytest.raises(OSError):  # a symbolic link: never followed
        cli._migrate(argparse.Namespace(job="7", run_dir=str(link), node="train1", timeout=1.0))
    with pytest.raises(files.UnsafePath, match="not the job's user's own directory"):  # another user's
        cli._migrate(argparse.Namespace(job="7", run_dir=str(other), node="train1", timeout=1.0))
    assert asked == [key]


def test_the_jobs_uid_is_read_from_slurm():
    line = ("JobId=9 JobName=x UserId=tmuser(1001) GroupId=tmuser(1001) MCS_label=N/A JobState=RUNNING "
            "NodeList=a BatchHost=a NumNodes=1 WorkDir=/w")
    assert parse.parse_job_text(line).user_id == 1001
    assert parse.parse_job_text(line.replace("tmuser(1001)", "tmuser", 1)).user_id == -1


def test_status_prints_a_users_strings_with_control_characters_escaped(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_job_uid", lambda job: os.geteuid())  # the directory's owner: no Slurm here
    evil = "\x1b]0;owned\x07\x1b[2J"
    run = tmp_path / "run"
    run.mkdir()
    (run / "status.json").write_text(json.dumps({
        "job_id": 7, "world_size": 2, "batch_host": "a" + evil, "message": evil,
        "nodes": [{"name": "n" + evil, "role": "train", "ranks": [0], "slurm_state": "ALLOCATED"}],
        "standbys": [], "standby_pool": {"note": evil}, "migrations": [],
        "outcome": {"ok": False, "message": "failed" + evil}}))
    assert cli._status(argparse.Namespace(job="7", run_dir=str(run), json=False)) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b]0;owned\\x07" in out  # shown, escaped
    # negative control: the line as the old code printed it carries the escape sequence
    assert "\x1b" in f"  ! {evil}"


def test_node_reader_runs_tm_nodes_only_if_root_owns_it_and_nobody_else_can_change_it(tmp_path):
    conf = tmp_path / "etc"
    conf.mkdir(mode=0o755)
    prog = conf / client.NODE_QUERY
    prog.write_text("#!/bin/sh\n")
    os.chmod(prog, 0o755)
    slurm_conf = str(conf / "slurm.conf")
    assert client.node_query_program("auto", slurm_conf) == str(prog)
    os.chmod(prog, 0o775)  # group-writable
    assert os.access(prog, os.X_OK)  # negative control: all the old check asked
    assert client.node_query_program("auto", slurm_conf) is None
    os.chmod(prog, 0o755)
    os.rename(prog, tmp_path / "real")
    prog.symlink_to(tmp_path / "real")  # a link, even to a good program
    assert os.access(prog, os.X_OK)
    assert client.node_query_program("auto", slurm_conf) is None
    prog.unlink()
    os.rename(tmp_path / "real", prog)
    os.chmod(conf, 0o777)  # a directory others can write
    assert client.node_query_program("auto", slurm_conf) is None


@as_root
def test_drain_notices_check_every_directory_above_not_only_the_last(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # another user can rename what is in it
    notices = shared / "trainmover-drains"
    notices.mkdir(mode=0o755)
    # negative control: the notice directory itself passes the old check
    assert drain_notice.root_only(os.stat(notices))
    with pytest.raises(PermissionError, match="writable by group or others"):
        drain_notice.publish(notices, "train1", "r", 1.0)
    assert drain_notice.read_root_file(notices, "train1") is None
    watcher = drain_notice.Watcher(notices)
    assert "not root's alone" in watcher.refused
    os.chmod(shared, 0o755)
    drain_notice.publish(notices, "train1", "r", 1.0)
    assert drain_notice.read_root_file(notices, "train1") is not None
    os.chmod(shared, 0o1777)  # sticky (/tmp): others can neither rename nor remove what is in it
    assert drain_notice.read_root_file(notices, "train1") is not None


def test_demo_and_plan_read_no_users_file_through_a_link_or_a_fifo(tmp_path):
    secret = tmp_path / "roots-file"
    secret.write_text('{"step": 1}\n')
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(secret)
    # negative control: the old read went through the link
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    with pytest.raises(OSError):
        demo._last(run / "metrics.jsonl")
    os.mkfifo(run / "status.json")
    with pytest.raises(OSError, match="not a regular file"):  # at once: no writer ever opens it
        demo._read(run / "status.json")
    (run / "journal.jsonl").symlink_to(secret)
    with pytest.raises(ConfigError, match="not a readable journal"):
        history.from_journals([str(run)])
    (run / "journal.jsonl").unlink()
    os.mkfifo(run / "journal.jsonl")
    assert stat.S_ISFIFO(os.lstat(run / "journal.jsonl").st_mode)
    with pytest.raises(ConfigError, match="no journal.jsonl found|not a readable journal"):
        history.from_journals([str(run)])


@as_root
def test_status_reads_only_the_jobs_users_run_directory(tmp_path, monkeypatch, capsys):
    """`trainmover status` after another user renamed `runs/` and put theirs in its place: their
    directory (with a status.json whose outcome says "done") is refused, naming the path and the
    owner; the job's user's own is read. Negative control: the file read by its path alone, as
    status did before, gives the forged outcome."""
    monkeypatch.setattr(cli, "_job_uid", lambda job: USER)
    forged = {"job_id": 7, "world_size": 2, "batch_host": "a", "nodes": [], "standbys": [],
              "standby_pool": {"note": ""}, "migrations": [], "outcome": {"ok": True, "message": "forged: done"}}
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    (theirs / "status.json").write_text(json.dumps(forged))
    for p in (theirs, theirs / "status.json"):
        os.chown(p, OTHER, OTHER)
    assert json.loads(files.read_limited(theirs / "status.json", 1 << 20))["outcome"]["ok"] is True  # control
    with pytest.raises(files.UnsafePath, match=f"{theirs} is not the job's user's own directory \\(uid {OTHER}"):
        cli._status(argparse.Namespace(job="7", run_dir=str(theirs), json=False))
    assert "forged" not in capsys.readouterr().out
    own, _ = _users_run_dir(tmp_path, USER)
    (own / "status.json").write_text(json.dumps({**forged, "outcome": {"ok": True, "message": "the job's own"}}))
    assert cli._status(argparse.Namespace(job="7", run_dir=str(own), json=False)) == 0
    assert "finished: the job's own" in capsys.readouterr().out
