"""The pyslurm backend's pure parts: pyslurm's objects read into the same NodeInfo/JobInfo as
the CLI's (the contract test compares both on a real 25.11 cluster), the backend chosen by
TM_SLURM_BACKEND, and a clear error where pyslurm cannot load."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from trainmover.config import Config
from trainmover.errors import ConfigError, SlurmError
from trainmover.slurm import CliSlurm, client
from trainmover.slurm.pyslurm_backend import _job, _node


def test_pyslurm_node_and_job_read_as_the_cli_reads_them():
    n = _node(SimpleNamespace(name="train2", address="10.7.0.3", state="IDLE+DRAIN", reason="maintenance",
                              active_features=["tm_keeper"]))
    assert (n.name, n.addr, n.base_state, n.flags, n.reason, n.features) == \
        ("train2", "10.7.0.3", "IDLE", frozenset({"DRAIN"}), "maintenance", ("tm_keeper",))
    assert n.drained and not n.idle
    bare = _node(SimpleNamespace(name="spare1", address=None, state="idle", reason=None, active_features=[]))
    assert bare.addr == "spare1" and bare.idle and bare.reason == ""
    j = _job(SimpleNamespace(id=25110007, state="RUNNING", allocated_nodes="spare1,train[1-2]", batch_host="train1",
                             requeue_count=0, working_directory="/w", partition="debug", num_nodes=3,
                             name="tm-e2e-contract", state_reason=None))
    assert j.nodes == ("spare1", "train1", "train2") and j.running and j.nodelist == "spare1,train[1-2]"
    assert (j.batch_host, j.restart_count, j.num_nodes, j.reason) == ("train1", 0, 3, "")
    pending = _job(SimpleNamespace(id=1, state="PENDING", allocated_nodes=None, batch_host=None, requeue_count=None,
                                   working_directory=None, partition=None, num_nodes=None, name=None,
                                   state_reason="Resources"))
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
