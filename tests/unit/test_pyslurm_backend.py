"""The pyslurm backend's pure parts: pyslurm's objects read into the same NodeInfo/JobInfo as
the CLI's (the contract test compares both on a real 25.11 cluster), the backend chosen by
TM_SLURM_BACKEND, and a clear error where pyslurm cannot load."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import threading
import time
from types import SimpleNamespace

import pytest

from trainmover.config import Config
from trainmover.errors import ConfigError, SlurmError
from trainmover.slurm import CliSlurm, client
from trainmover.slurm.pyslurm_backend import PySlurm, _job, _node
from trainmover.slurm.pyslurm_server import job_info, node_info


def _wire(info):
    """As the pyslurm process sends a NodeInfo/JobInfo: its fields through JSON."""
    return json.loads(json.dumps(dataclasses.asdict(info)))


def test_pyslurm_node_and_job_read_as_the_cli_reads_them():
    n = _node(_wire(node_info(SimpleNamespace(name="train2", address="10.7.0.3", state="IDLE+DRAIN", reason="maintenance",
                              active_features=["tm_keeper"]))))
    assert (n.name, n.addr, n.base_state, n.flags, n.reason, n.features) == \
        ("train2", "10.7.0.3", "IDLE", frozenset({"DRAIN"}), "maintenance", ("tm_keeper",))
    assert n.drained and not n.idle
    bare = _node(_wire(node_info(SimpleNamespace(name="spare1", address=None, state="idle", reason=None,
                                                 active_features=[]))))
    assert bare.addr == "spare1" and bare.idle and bare.reason == ""
    j = _job(_wire(job_info(SimpleNamespace(id=25110007, state="RUNNING", allocated_nodes="spare1,train[1-2]", batch_host="train1",
                             requeue_count=0, working_directory="/w", partition="debug", num_nodes=3,
                             name="tm-e2e-contract", state_reason=None))))
    assert j.nodes == ("spare1", "train1", "train2") and j.running and j.nodelist == "spare1,train[1-2]"
    assert (j.batch_host, j.restart_count, j.num_nodes, j.reason) == ("train1", 0, 3, "")
    pending = _job(_wire(job_info(SimpleNamespace(id=1, state="PENDING", allocated_nodes=None, batch_host=None, requeue_count=None,
                                   working_directory=None, partition=None, num_nodes=None, name=None,
                                   state_reason="Resources"))))
    assert pending.nodes == () and pending.reason == "Resources" and not pending.running


def test_backend_by_name_and_by_tm_slurm_backend():
    assert isinstance(client("cli"), CliSlurm)
    assert Config.from_env({}).slurm_backend == "cli"
    assert Config.from_env({"TM_SLURM_BACKEND": "pyslurm"}).slurm_backend == "pyslurm"
    with pytest.raises(ConfigError, match="TM_SLURM_BACKEND='rest': expected cli or pyslurm"):
        Config.from_env({"TM_SLURM_BACKEND": "rest"})
    with pytest.raises(SlurmError, match="unknown Slurm backend 'rest'"):
        client("rest")


def test_pyslurm_that_cannot_load_here_is_a_slurm_error_naming_the_fix():
    """Without Slurm 25.11 on the host, pyslurm is absent, or built for the 25.11 root's newer C
    library (`make pyslurm`): either way the backend says what to do."""
    from trainmover.cluster import rootfs
    if (rootfs.host_version() or "").startswith("25.11") and importlib.util.find_spec("pyslurm"):
        pytest.skip("this host runs Slurm 25.11 and has pyslurm: it loads here")
    with pytest.raises(SlurmError, match="make pyslurm"):
        client("pyslurm")


# A stand-in for pyslurm (pure logic: the pipe, its deadline and restart, the GIL kept free),
# on PYTHONPATH for the pyslurm process only. Its RPCs hold the GIL as pyslurm 25.11.2's do
# (time.sleep releases it; a C loop does not, so the "RPC" spins in C through a regex).
FAKE_PYSLURM = """
import re, time
class RPCError(Exception):
    pass
def slurm_init(conf):
    pass
def _rpc():
    # catastrophic backtracking: ~1 s in C holding the GIL (as a pyslurm RPC waits on slurmctld)
    re.match(r'(a+)+b', 'a' * 25)
class _N:
    def __init__(self, name, state):
        self.name, self.address, self.state, self.reason, self.active_features = name, None, state, None, []
class Nodes:
    @staticmethod
    def load():
        return {n: _N(n, "IDLE") for n in ("train1", "train2")}
class Job:
    def __init__(self, id):
        self.id = id
    @staticmethod
    def load(id):
        if id == 2:
            _rpc()
        if id == 3:
            time.sleep(3600)
        if id == 4:
            raise RPCError("Invalid job id specified")
        return type("J", (), dict(id=id, state="RUNNING", allocated_nodes="train[1-2]", batch_host="train1",
                                  requeue_count=0, working_directory="/w", partition="debug", num_nodes=2,
                                  name="x", state_reason=None))()
"""


@pytest.fixture
def fake_pyslurm(tmp_path, monkeypatch):
    (tmp_path / "pyslurm.py").write_text(FAKE_PYSLURM)
    repo = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{repo}")
    return tmp_path


def _longest_pause(call) -> tuple[float, float]:
    """(how long `call` took, the longest pause a 10 ms ticking thread of this process saw)."""
    ticks, stop = [], threading.Event()
    t = threading.Thread(target=lambda: [ticks.append(time.monotonic()) or time.sleep(0.01)
                                         for _ in iter(stop.is_set, True)])
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    call()
    took = time.monotonic() - t0
    stop.set()
    t.join()
    return took, max(b - a for a, b in zip(ticks, ticks[1:]))


def test_pyslurm_calls_run_in_their_own_process_and_keep_the_callers_threads_running(fake_pyslurm):
    c = PySlurm(timeout=30)
    try:
        assert sorted(c.nodes()) == ["train1", "train2"] and c.job(1).nodes == ("train1", "train2")
        took, pause = _longest_pause(lambda: c.job(2))  # an RPC holding the GIL in the pyslurm process
        assert took > 0.3 and pause < took / 2, (took, pause)
        with pytest.raises(SlurmError, match="pyslurm load job 4: Invalid job id specified"):
            c.job(4)
        assert c.job(5).job_id == 5  # an RPC error leaves the process serving
    finally:
        c.close()
    # the negative control: the same call made in this process stops its threads throughout
    spec = importlib.util.spec_from_file_location("fake_pyslurm_here", fake_pyslurm / "pyslurm.py")
    here = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(here)
    took, pause = _longest_pause(lambda: here.Job.load(2))
    assert pause > took * 0.8, (took, pause)


def test_a_pyslurm_call_past_its_deadline_is_an_error_and_the_next_call_starts_afresh(fake_pyslurm):
    c = PySlurm(timeout=1.5)
    try:
        first = c._proc.pid
        t0 = time.monotonic()
        with pytest.raises(SlurmError, match="pyslurm load job 3: no answer within 1.5s"):
            c.job(3)
        assert time.monotonic() - t0 < 5
        assert c.job(1).job_id == 1 and c._proc.pid != first
    finally:
        c.close()
