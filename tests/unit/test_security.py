"""What another user on the same nodes, filesystem and network can try against a job, one check
each (docs/security.md): the run directory and its files, records sealed with the job's key, the
rendezvous store, the control channel before authentication, root's health check, Slurm output
and the environment a launched step gets. tests/e2e/test_hostile_user.py tries them for real."""
from __future__ import annotations

import datetime
import json
import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainmover.controller.steps import step_environment
from trainmover.errors import ProtocolError, SlurmError
from trainmover.healthcheck import Finding, Options, checks, run
from trainmover.protocol import channel, endpoint, files
from trainmover.protocol import checkpoint_layout
from trainmover.protocol.messages import make, typed
from trainmover.protocol.store import AuthStore, ForgedValue, open_value, seal
from trainmover.slurm import argv as build
from trainmover.slurm import commands, parse

KEY = b"k" * 32
OTHER_UID = 65534  # nobody: "another user" where the test runs as root

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root")


# --- the run directory -------------------------------------------------------------------------

def test_a_new_run_directory_is_private(tmp_path):
    d = files.private_dir(tmp_path / "runs" / "7")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and d.stat().st_uid == os.geteuid()


def test_an_own_readable_run_directory_is_tightened(tmp_path):
    d = tmp_path / "runs" / "7"
    d.mkdir(parents=True, mode=0o755)
    d.chmod(0o755)
    files.private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_a_run_directory_writable_by_others_is_refused(tmp_path):
    d = tmp_path / "runs" / "7"
    d.mkdir(parents=True)
    d.chmod(0o777)
    with pytest.raises(files.UnsafePath, match="writable by group or others"):
        files.private_dir(d)


@as_root
def test_a_run_directory_planted_by_another_user_is_refused(tmp_path):
    d = tmp_path / "runs" / "7"
    d.mkdir(parents=True, mode=0o700)
    os.chown(d, OTHER_UID, OTHER_UID)
    with pytest.raises(files.UnsafePath, match=f"belongs to uid {OTHER_UID}"):
        files.private_dir(d)


@as_root
def test_a_runs_directory_someone_else_controls_is_refused(tmp_path):
    (tmp_path / "runs").mkdir()
    os.chown(tmp_path / "runs", OTHER_UID, OTHER_UID)
    with pytest.raises(files.UnsafePath, match="belongs to uid"):
        files.private_dir(tmp_path / "runs" / "7")


def test_a_link_in_place_of_the_run_directory_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "7").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(files.UnsafePath, match="symbolic link"):
        files.private_dir(tmp_path / "runs" / "7")


def test_files_are_0600_and_no_planted_link_is_followed(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "umask", os.umask)  # restored by monkeypatch
    victim = tmp_path / "victim"
    victim.write_text("mine")
    # the old fixed temporary name, and the target itself, as links to a file of the job's user
    (tmp_path / ".status.json.tmp").symlink_to(victim)
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    files.write_atomic(tmp_path / "status.json", '{"a": 1}')
    assert victim.read_text() == "mine"
    assert stat.S_IMODE((tmp_path / "status.json").stat().st_mode) == 0o600
    with pytest.raises(OSError):
        files.open_append(tmp_path / "metrics.jsonl")
    assert victim.read_text() == "mine"
    with files.open_append(tmp_path / "timeline.jsonl") as f:
        f.write("x\n")
    assert stat.S_IMODE((tmp_path / "timeline.jsonl").stat().st_mode) == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp") and p.name != ".status.json.tmp"]


def test_reading_a_file_someone_else_controls_never_blocks_nor_follows(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(OSError, match="not a regular file"):
        files.read_limited(fifo, 100)
    assert time.monotonic() - t0 < 1
    (tmp_path / "big").write_bytes(b"x" * 200)
    with pytest.raises(OSError, match="more than 100"):
        files.read_limited(tmp_path / "big", 100)
    (tmp_path / "link").symlink_to(tmp_path / "big")
    with pytest.raises(OSError):
        files.read_limited(tmp_path / "link", 1000)
    assert files.read_limited(tmp_path / "big", 1000) == b"x" * 200
    with pytest.raises(OSError, match="belongs to uid"):
        files.read_limited(tmp_path / "big", 1000, owner=os.geteuid() + 1)


def test_the_secret_is_refused_if_others_can_read_it(tmp_path):
    path = tmp_path / "secret"
    key = channel.write_secret(str(path))
    assert channel.read_secret(str(path)) == key
    path.chmod(0o640)
    with pytest.raises(ProtocolError, match="group or others"):
        channel.read_secret(str(path))
    path.unlink()
    (tmp_path / "theirs").write_text("00" * 32)
    path.symlink_to(tmp_path / "theirs")
    with pytest.raises(ProtocolError):
        channel.read_secret(str(path))


# --- records sealed with the job's key ----------------------------------------------------------

def test_a_sealed_record_detects_any_change_and_another_purpose():
    rec = files.seal(KEY, "a", {"host": "10.0.0.1", "port": 5})
    assert files.unseal(KEY, "a", rec) == {"host": "10.0.0.1", "port": 5}
    with pytest.raises(ProtocolError, match="MAC does not match"):
        files.unseal(KEY, "a", {**rec, "port": 6})
    with pytest.raises(ProtocolError, match="MAC does not match"):
        files.unseal(KEY, "b", rec)
    with pytest.raises(ProtocolError, match="MAC does not match"):
        files.unseal(b"x" * 32, "a", rec)
    with pytest.raises(ProtocolError, match="no MAC"):
        files.unseal(KEY, "a", {"host": "10.0.0.1", "port": 5})


def test_a_controller_json_not_sealed_with_the_key_is_ignored(tmp_path):
    ep = endpoint.Endpoint("10.0.0.1", 7000, "10.0.0.1", 7001, "train1", 0)
    endpoint.write(tmp_path, ep, KEY, job_id=3)
    assert endpoint.read(tmp_path / endpoint.NAME, KEY) == ep
    assert endpoint.read(tmp_path / endpoint.NAME, b"x" * 32) is None
    forged = json.loads((tmp_path / endpoint.NAME).read_text())
    forged["store_host"] = "10.6.6.6"  # a store the attacker runs
    (tmp_path / endpoint.NAME).write_text(json.dumps(forged))
    assert endpoint.read(tmp_path / endpoint.NAME, KEY) is None


def test_a_checkpoint_manifest_is_sealed(tmp_path):
    checkpoint_layout.step_dir(tmp_path, 10).mkdir()
    checkpoint_layout.write_manifest(tmp_path, 10, {0: "ab"}, KEY)
    assert checkpoint_layout.read_manifest(tmp_path, 10, KEY)["digests"] == {"0": "ab"}
    assert checkpoint_layout.complete(tmp_path, b"x" * 32) == []


# --- the rendezvous store ------------------------------------------------------------------------

@pytest.fixture
def tcp_store():
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10), master_listen_fd=sock.detach(), use_libuv=False)

    def client(timeout_s: float = 10.0):
        return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    yield master, client


def test_a_value_is_bound_to_its_key_name():
    raw = seal(KEY, "tm/e1/go/r0", b"1")
    assert open_value(KEY, "tm/e1/go/r0", raw) == b"1"
    with pytest.raises(ForgedValue):
        open_value(KEY, "tm/e1/cancel/r0", raw)  # a genuine value moved to another key
    with pytest.raises(ForgedValue):
        open_value(b"x" * 32, "tm/e1/go/r0", raw)


def test_a_forged_cancel_key_is_not_seen_and_a_genuine_one_is(tcp_store):
    master, client = tcp_store
    store = AuthStore(client(), KEY)
    master.set("tm/e1/xfer/r0/cancel", b"1")  # someone without the key
    assert not store.check(["tm/e1/xfer/r0/cancel"])
    store.set("tm/e1/xfer/r0/cancel", "1")
    assert store.check(["tm/e1/xfer/r0/cancel"]) and store.get("tm/e1/xfer/r0/cancel") == b"1"


def test_a_read_waits_past_a_forged_value_for_the_genuine_one(tcp_store):
    master, client = tcp_store
    store = AuthStore(client(), KEY)
    master.set("verdict", b"0")  # forged: "OK"
    writer = AuthStore(client(), KEY)
    threading.Timer(0.3, lambda: writer.set("verdict", "2")).start()
    t0 = time.monotonic()
    store.wait(["verdict"], datetime.timedelta(seconds=5))
    assert store.get("verdict") == b"2" and time.monotonic() - t0 >= 0.25 and store.forged >= 1


def test_a_forged_value_alone_times_out_the_wait_and_get(tcp_store):
    master, client = tcp_store
    store = AuthStore(client(timeout_s=0.5), KEY)
    master.set("manifest", b"evil")
    with pytest.raises(dist.DistStoreError, match="manifest"):
        store.wait(["manifest"], datetime.timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError, match="no genuine value"):
        store.get("manifest")


def test_compare_set_on_genuine_values_only(tcp_store):
    master, client = tcp_store
    store = AuthStore(client(), KEY)
    master.set("k", b"forged")
    assert store.compare_set("k", "", "a") == b"a"          # a forged value counts as none
    assert store.compare_set("k", "b", "c") == b"a"         # not what is held: unchanged
    assert store.compare_set("k", "a", "c") == b"c"
    with pytest.raises(NotImplementedError):
        store.add("n", 1)


def _gloo_member(rank, port, out):
    inner = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    from trainmover.groups.swappable import gloo_group
    pg = gloo_group(AuthStore(inner, KEY), "tm/g/", rank, 2, host="127.0.0.1", timeout=datetime.timedelta(seconds=10))
    t = torch.tensor([float(rank + 1)])
    pg.allreduce([t]).wait()
    out[rank] = t.item()


def test_gloo_builds_its_group_through_the_authenticated_store(tcp_store):
    """gloo's own address keys go through AuthStore: a group still forms (and raw keys another
    user planted under the group's prefix are not what it reads)."""
    master, _ = tcp_store
    port = master.port
    keys = ("tm/g//0/0", "tm/g//0/1")  # gloo's address keys under the group's prefix
    for k in keys:
        master.set(k, b"127.0.0.1:1")  # planted before the members write theirs
    out: dict = {}
    threads = [threading.Thread(target=_gloo_member, args=(r, port, out)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: 3.0, 1: 3.0}
    for k in keys:  # gloo's keys hold values tagged with the job's key
        assert open_value(KEY, k, master.get(k))


# --- the control channel before authentication --------------------------------------------------

@pytest.fixture
def server():
    srv = channel.Server("127.0.0.1", KEY, handshake_timeout=1.0, max_pending=8)
    yield srv
    srv.close()


def hello():
    return make("hello", role="worker", node="train1", ranks=[0], pid=1)


def test_a_slow_connection_is_dropped_at_the_handshake_deadline(server):
    s = socket.create_connection(server.address)
    s.recv(16)
    t0 = time.monotonic()
    s.settimeout(5)
    for _ in range(20):  # one byte at a time, never a whole handshake
        try:
            s.sendall(b"x")
        except OSError:
            break
        time.sleep(0.1)
        if time.monotonic() - t0 > 3:
            break
    assert s.recv(10) == b""  # closed by the server
    assert time.monotonic() - t0 < 2.5


def test_a_flood_of_idle_connections_does_not_lock_out_a_real_peer(server):
    idle = [socket.create_connection(server.address) for _ in range(100)]
    try:
        deadline = time.monotonic() + 5
        while server.evicted < 90 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.pending <= 8 and server.evicted >= 90
        conn = channel.connect(server.address, KEY, hello(), timeout=5)
        assert server.inbox.get(timeout=5)[1]["type"] == "hello"
        conn.close()
    finally:
        for s in idle:
            s.close()


def test_a_large_first_frame_is_refused_before_it_is_read(server):
    s = socket.create_connection(server.address)
    s.recv(16)
    s.sendall(b"n" * 16 + struct.pack(">I", channel.HELLO_MAX + 1))
    s.settimeout(3)
    assert s.recv(10) == b""
    assert server.rejected == 1 and server.inbox.empty()


def test_the_accept_loop_survives_any_error(server, monkeypatch):
    real = server._admit
    calls = []

    def broken(sock):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("can't start new thread")
        return real(sock)
    monkeypatch.setattr(server, "_admit", broken)
    s = socket.create_connection(server.address)
    s.settimeout(3)
    assert s.recv(16) == b""  # that one was dropped...
    conn = channel.connect(server.address, KEY, hello(), timeout=5)  # ...and the next is served
    assert server.inbox.get(timeout=5)[1]["type"] == "hello"
    conn.close()


def test_a_short_read_is_a_protocol_error_not_a_crash():
    a, b = socket.socketpair()
    framer = channel._Framer(a, KEY, b"s" * 32, is_server=False)
    b.sendall(b"\x00\x00")  # 2 bytes of a 4-byte header, then EOF
    b.close()
    with pytest.raises(ProtocolError, match="closed after 2 of 4 bytes"):
        framer.recv()


def test_the_clients_nonce_is_in_the_mac():
    """A server's frames recorded on one connection cannot be replayed to a client of another
    connection with the same challenge: each client's own nonce is in every MAC."""
    a1, b1 = socket.socketpair()
    server_side = channel._Framer(a1, KEY, b"c" * 16 + b"1" * 16, is_server=True)
    server_side.send(make("bye", reason="x"))
    recorded = b1.recv(4096)
    a2, b2 = socket.socketpair()
    client_other = channel._Framer(b2, KEY, b"c" * 16 + b"2" * 16, is_server=False)
    a2.sendall(recorded)
    with pytest.raises(ProtocolError, match="authentication failed"):
        client_other.recv()


# --- root's health check --------------------------------------------------------------------------

def test_job_files_that_are_odd_are_skipped_never_raised(tmp_path):
    def status_path(job):
        d = tmp_path / "runs" / str(job)
        d.mkdir(parents=True)
        return d / "status.json"
    status_path(1).write_text("[1]")
    os.mkfifo(status_path(2))
    status_path(3).symlink_to("/etc/hostname")
    status_path(4).write_text("{not json")
    status_path(5).write_text(json.dumps({"job_id": 5, "straggler": "not a dict"}))
    status_path(6).write_text(json.dumps({"job_id": 6, "straggler": {"mode": "report", "target": "n1"}}))
    t0 = time.monotonic()
    statuses = checks.read_statuses([(j, str(tmp_path)) for j in range(1, 7)])
    assert time.monotonic() - t0 < 1
    assert [s["job_id"] for s in statuses] == [5, 6]
    (finding,) = checks.straggler_findings("n1", statuses)
    assert not finding.ok


class _NoSlurm:
    def __getattr__(self, name):
        raise AssertionError(f"Slurm called: {name}")


def test_an_error_or_timeout_reading_job_data_is_skipped_not_a_fault(tmp_path, monkeypatch):
    import importlib
    hc_run = importlib.import_module("trainmover.healthcheck.run")
    opts = Options(node="n1", state_dir=tmp_path, disk_paths=(str(tmp_path),), gpu=False, min_free_gb=0,
                   straggler=True, deadline_s=0.3)
    monkeypatch.setattr(hc_run, "_straggler_checks", lambda o: time.sleep(3) or [])  # a hung mount
    report = run(opts, _NoSlurm())
    assert report.healthy and not report.drained
    (f,) = [f for f in report.findings if f.check == "straggler"]
    assert f.skipped and "did not finish" in f.detail

    def broken(o):
        raise ValueError("bad JSON somewhere")
    monkeypatch.setattr(hc_run, "_straggler_checks", broken)
    report = run(opts, _NoSlurm())
    assert report.healthy and not report.drained


def test_as_root_the_straggler_verdicts_are_read_only_when_asked(monkeypatch):
    import argparse
    from trainmover.healthcheck import cli as hc_cli
    seen = {}
    monkeypatch.setattr(hc_cli, "run", lambda opts, **_: seen.setdefault("opts", opts) and
                        type("R", (), {"healthy": True, "findings": [], "notes": [], "gpu_source": "",
                                       "drained": False, "action": type("A", (), {"reason": "healthy"})(),
                                       "seconds": 0.0})())
    for euid, argv, want in ((0, [], False), (0, ["--straggler"], True), (1000, [], True),
                             (1000, ["--no-straggler"], False)):
        monkeypatch.setattr(os, "geteuid", lambda e=euid: e)
        p = argparse.ArgumentParser()
        hc_cli.add_arguments(p)
        seen.clear()
        hc_cli.main(p.parse_args(["--node", "n1", "--no-gpu", *argv]))
        assert seen["opts"].straggler is want, (euid, argv)


def test_slurm_exec_json_is_used_only_when_trusted(tmp_path):
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o755)
    (etc / commands.EXEC_FILE).write_text(json.dumps({"slurm": "x", "prefix": ["/bin/evil"], "root_id": [0, 0]}))
    env = {"SLURM_CONF": str(etc / "slurm.conf")}
    (etc / commands.EXEC_FILE).chmod(0o666)
    with pytest.raises(SlurmError, match="not used: it belongs to uid .* or is writable"):
        commands.exec_prefix(env)
    (etc / commands.EXEC_FILE).chmod(0o644)
    etc.chmod(0o777)
    with pytest.raises(SlurmError, match="not used"):
        commands.exec_prefix(env)
    etc.chmod(0o755)
    assert commands.exec_prefix(env) == ["/bin/evil"]


# --- Slurm output and step environments ------------------------------------------------------------

REAL = ("JobId=9 JobName={name} UserId=tmuser(1001) GroupId=tmuser(1001) MCS_label=N/A Priority=1 Nice=0 "
        "Account=root QOS=normal JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
        "Partition=train AllocNode:Sid=localhost:2287 ReqNodeList=(null) ExcNodeList=(null) "
        "NodeList=train[3-4] BatchHost=train3 NumNodes=2 NumCPUs=8 Features=(null) Command={command} "
        "WorkDir=/home/tmuser/w StdErr=/home/tmuser/w/out StdIn=/dev/null StdOut=/home/tmuser/w/out Power= \n")


def test_an_account_that_imitates_fields_spoofs_none():
    """Account= is the user's pick, printed after UserId= GroupId= MCS_label= and before
    NodeList=: without the check its text's first NodeList= won (negative control below)."""
    spoof = REAL.format(name="x", command="/bin/true").replace("Account=root QOS=",
                                                               "Account=a NodeList=evil[1-2] BatchHost=evil1 QOS=")
    # negative control: the first NodeList= after the run, which the old rule took, is the forged one
    assert spoof.split("MCS_label=", 1)[1].split("NodeList=", 1)[1].startswith("evil[1-2]")
    with pytest.raises(SlurmError, match="Account= is not followed by QOS="):
        parse.parse_job_text(spoof)
    assert parse.parse_job_text(REAL.format(name="x", command="/bin/true")).nodes == ("train3", "train4")


def test_a_spoofing_job_name_spoofs_no_field():
    name = "x NodeList=evil[1-2] BatchHost=evil1 WorkDir=/tmp/a"
    job = parse.parse_job_text(REAL.format(name=name, command="/home/tmuser/w/job.sh"))
    assert job.nodes == ("train3", "train4") and job.batch_host == "train3"
    assert job.work_dir == "/home/tmuser/w" and job.name == name and job.state == "RUNNING"


def test_fields_imitated_in_the_command_are_not_taken_or_are_refused():
    job = parse.parse_job_text(REAL.format(name="n", command="/w/x NodeList=evil1 BatchHost=evil1"))
    assert job.nodes == ("train3", "train4") and job.batch_host == "train3"
    with pytest.raises(SlurmError, match="WorkDir= twice"):
        parse.parse_job_text(REAL.format(name="n", command="/w/x WorkDir=/tmp/a"))
    with pytest.raises(SlurmError, match="field order"):
        parse.parse_job_text(REAL.format(name="x UserId=a(1) GroupId=b(2) MCS_label=N/A NodeList=evil1",
                                         command="/w/j.sh"))


def test_donor_clean_up_touches_only_this_users_jobs():
    assert "--me" in build.jobs_named(build.donor_name(9))


def test_a_launched_step_gets_only_what_it_needs():
    env = {"PATH": "/bin", "SLURM_JOB_ID": "9", "TM_STEPS": "5", "NCCL_DEBUG": "WARN", "HOME": "/h",
           "AWS_SECRET_ACCESS_KEY": "s3cr3t", "GITHUB_TOKEN": "t", "SSH_AUTH_SOCK": "/tmp/agent"}
    assert step_environment(env) == {"PATH": "/bin", "SLURM_JOB_ID": "9", "TM_STEPS": "5", "NCCL_DEBUG": "WARN",
                                     "HOME": "/h"}


def test_no_credential_reaches_a_step_even_under_an_allowed_prefix():
    """The launch message carries the step's environment in clear to the keeper (issue 37)."""
    from dataclasses import fields

    from trainmover import config
    from trainmover.controller.steps import STEP_ENV_NAMES, STEP_ENV_PREFIXES
    credentials = {"SLURM_JWT": "eyJ", "HF_TOKEN": "hf_x", "HF_HUB_TOKEN": "hf_y", "SLURM_DB_PASSWORD": "p",
                   "TORCH_API_KEY": "k", "NCCL_SECRET": "s", "PYTHON_KEYRING_PASSWD": "p", "CUDA_CREDENTIALS": "c",
                   "hf_token": "lower case too"}
    kept = {"PATH": "/bin", "SLURM_JOB_ID": "9", "HF_HOME": "/h/hf", "TM_STEPS": "5", "NCCL_DEBUG": "WARN"}
    assert step_environment({**kept, **credentials}) == kept
    # Negative control: the allow-list alone (the previous rule) let these through.
    assert [k for k in credentials if k not in STEP_ENV_NAMES and not k.startswith(STEP_ENV_PREFIXES)] == ["hf_token"]
    # Every TrainMover setting still reaches the step.
    settings = [v.env for v in config.VARIABLES] + [f.metadata["env"] for f in fields(config.Config)
                                                     if "env" in f.metadata]
    assert set(step_environment({n: "x" for n in settings})) == set(settings)


# --- the keeper -------------------------------------------------------------------------------------

class _Slurm:
    def __init__(self, work_dir):
        self.work_dir = work_dir

    def job(self, job_id):
        from trainmover.slurm.model import JobInfo
        return JobInfo(job_id=job_id, state="RUNNING", nodes=("keeper1", "train1"), batch_host="keeper1",
                       restart_count=0, work_dir=str(self.work_dir), partition="p", num_nodes=2,
                       nodelist="keeper1,train1", name="j", reason="")


@as_root
def test_the_keeper_refuses_a_run_directory_planted_before_the_job(tmp_path):
    from trainmover.config import Config
    from trainmover.controller.succession.keeper import Keeper
    planted = tmp_path / "runs" / "12"
    planted.mkdir(parents=True)
    os.chown(planted, OTHER_UID, OTHER_UID)
    (planted / "final.json").write_text('{"job_id": 12}')
    with pytest.raises(files.UnsafePath, match="Refusing to use it"):
        Keeper(Config.from_env({}), _Slurm(tmp_path), 12, "keeper1")


def test_the_keeper_reads_the_key_once_and_launches_only_into_the_run_directory(tmp_path, monkeypatch):
    from trainmover.config import Config
    from trainmover.controller.succession import keeper as keeper_mod
    k = keeper_mod.Keeper(Config.from_env({}), _Slurm(tmp_path), 12, "keeper1")
    assert stat.S_IMODE(k.root.stat().st_mode) == 0o700
    key = channel.write_secret(str(k.root / "secret"))
    k.controller = ("train1", None)
    endpoint.write(k.root, endpoint.Endpoint("127.0.0.1", 1, "127.0.0.1", 2, "other-node"), key)
    k._connect()  # the endpoint names another node: nothing to connect to, but the key is read
    assert k.key == key
    (k.root / "secret").unlink()
    channel.write_secret(str(k.root / "secret"))  # replaced on disk: the keeper keeps what it read
    k._connect()
    assert k.key == key
    started = []
    monkeypatch.setattr(keeper_mod, "start_srun", lambda argv, env, log: started.append((argv, env, log)))
    k.steps = {}
    k._launch(typed(make("launch", node="train1", role="worker", argv=["srun", "x"], env={"PATH": "/bin", "TOKEN": "t"},
                   log="/tmp/elsewhere.log")))
    assert started == []  # a log outside the run directory: refused
    k._launch(typed(make("launch", node="train1", role="worker", argv=["srun", "x"], env={"PATH": "/bin", "TOKEN": "t"},
                   log=str(k.root / "worker-train1.log"))))
    assert started == [(["srun", "x"], {"PATH": "/bin"}, k.at / "worker-train1.log")]  # through the held directory
