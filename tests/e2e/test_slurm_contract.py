"""The contract of trainmover.slurm.SlurmClient, run against every backend that is
available, on the real local cluster, and by `make test` on every Slurm release the
embedded cluster supports (22.05, 24.11, 26.05: $TM_E2E_SLURM, see conftest.py). The CLI
backend always runs; pyslurm is skipped (PyPI only has pyslurm 25.11, which requires
Slurm 25.11; Debian ships 22.05, 24.11 and 26.05)."""
from __future__ import annotations

import pytest

from tests.e2e.conftest import wait_for

from trainmover.errors import SlurmError
from trainmover.slurm import BatchHostRelease, SlurmClient, UnknownNodes, client, commands

pytestmark = pytest.mark.slurm

RESERVATION = "trainmover_standby"
REASON = "tm-e2e contract"
SCRIPT = "#!/bin/sh\nsleep 300\n"

PYSLURM_SKIP = ("pyslurm backend not available: PyPI only has pyslurm 25.11, which requires Slurm 25.11 "
                "(this cluster runs Slurm {version}), so it cannot be built here; see docs/admin.md")


@pytest.fixture(params=["cli", "pyslurm"])
def backend(request, slurm_cluster) -> SlurmClient:
    if request.param == "pyslurm":
        try:
            import pyslurm  # noqa: F401
        except ImportError:
            pytest.skip(PYSLURM_SKIP.format(version=slurm_cluster.slurm_version))
        try:
            return client(backend="pyslurm", slurm_conf=str(slurm_cluster.slurm_conf))
        except SlurmError as exc:
            pytest.skip(f"pyslurm imports but trainmover has no pyslurm backend: {exc}")
    c = client(backend=request.param, slurm_conf=str(slurm_cluster.slurm_conf))
    assert isinstance(c, SlurmClient)
    return c


def test_nodes_and_hostnames(backend, slurm_cluster):
    every = backend.nodes()
    cluster_nodes = set(slurm_cluster.train_nodes) | set(slurm_cluster.standby_nodes)
    assert cluster_nodes <= set(every)
    two = backend.nodes(["train1", "spare1"])
    assert set(two) == {"train1", "spare1"} and two["train1"].name == "train1"
    assert backend.nodes([]) == {}
    with pytest.raises(UnknownNodes, match="nosuchnode"):
        backend.nodes(["train1", "nosuchnode"])
    assert backend.hostnames("train[1-3],spare1") == ["train1", "train2", "train3", "spare1"]
    assert backend.hostnames("") == []


def test_drain_and_resume(backend):
    node = "train4"
    backend.drain(node, REASON)
    try:
        info = backend.nodes([node])[node]
        assert "DRAIN" in info.flags and info.reason == REASON
    finally:
        backend.resume(node)
    assert "DRAIN" not in backend.nodes([node])[node].flags
    # Right after a resume 22.05 shows the node IDLE+NOT_RESPONDING for a moment, and a
    # second resume then fails ("Invalid node state specified"): wait until it answers.
    wait_for(f"{node} to respond", lambda: "NOT_RESPONDING" not in backend.nodes([node])[node].flags, timeout=15)
    backend.resume(node)  # resuming a node in service is a no-op, not an error


def test_job_grow_shrink_and_steps(backend, submit, slurm_env):
    job = submit(SCRIPT, nodes=1, name="contract")
    got = backend.job(job.job_id)
    assert got.running and got.restart_count == 0 and got.nodes == (got.batch_host,)
    # A previous test's job may still be completing on a spare: wait (bounded) for one to be free.
    wait_for("a free standby", lambda: backend.free_standbys(RESERVATION), timeout=60)
    free_before = backend.free_standbys(RESERVATION)
    assert free_before and all(n.startswith("spare") for n in free_before)
    new = backend.grow(job.job_id, reservation=RESERVATION, timeout=30)  # salloc waits on a loaded slurmctld
    assert new in free_before
    grown = backend.job(job.job_id)
    assert set(grown.nodes) == {got.batch_host, new} and grown.restart_count == 0
    assert new not in backend.free_standbys(RESERVATION)
    argv = backend.step_argv(job.job_id, new, ["hostname"])
    out = commands.run(argv, timeout=30, env=backend.step_env(grown, slurm_env))
    assert out.stdout.split() == [new]
    with pytest.raises(BatchHostRelease, match=got.batch_host):
        backend.shrink(job.job_id, [new])
    assert backend.shrink(job.job_id, [got.batch_host]) == [new]
    after = backend.job(job.job_id)
    assert after.nodes == (got.batch_host,) and after.running and after.restart_count == 0
    assert backend.shrink(job.job_id, [got.batch_host]) == []


def test_errors_name_what_failed(backend):
    with pytest.raises(SlurmError):
        backend.job(999999999)
