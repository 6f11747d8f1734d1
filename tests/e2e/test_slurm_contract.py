"""The contract of trainmover.slurm.SlurmClient, run against every backend that is
available, on the real local cluster, and by `make test` on every Slurm release the
embedded cluster supports (22.05, 24.11, 25.11, 26.05: $TM_E2E_SLURM, see conftest.py).

The CLI backend always runs. pyslurm (25.11.2, built by `make pyslurm` against Slurm 25.11)
runs where this process can load it: its library needs the C library of the 25.11 root
filesystem, so on a cluster in a root the pyslurm cases run inside that root, where the
cluster's jobs and controllers run (test_pyslurm_contract_inside_root starts them there:
this module again, TM_E2E_INSIDE_ROOT=1, pyslurm's cases only)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import INSIDE_ROOT, wait_for

from trainmover.errors import SlurmError
from trainmover.slurm import BatchHostRelease, SlurmClient, UnknownNodes, client, commands

pytestmark = pytest.mark.slurm

RESERVATION = "trainmover_standby"
REASON = "tm-e2e contract"
SCRIPT = "#!/bin/sh\nsleep 300\n"
CONTRACT_TESTS = 4  # the tests below that take `backend`


def _pyslurm_loads() -> tuple[bool, str]:
    """Whether this process can load pyslurm (installed, and its libslurm loads here)."""
    if importlib.util.find_spec("pyslurm") is None:
        return False, "pyslurm is not installed (`make pyslurm`: pyslurm 25.11.2 against Slurm 25.11)"
    try:
        from trainmover.slurm.pyslurm_backend import PySlurm
        PySlurm().close()  # its pyslurm process loads the library, or says why not
    except (SlurmError, OSError, ImportError) as exc:
        return False, f"pyslurm does not load in this process: {exc}"
    return True, ""


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        backends = ["pyslurm"] if INSIDE_ROOT else ["cli"] + (["pyslurm"] if _pyslurm_loads()[0] else [])
        metafunc.parametrize("backend", backends, indirect=True)


@pytest.fixture
def backend(request, slurm_cluster) -> SlurmClient:
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


def test_pyslurm_contract_inside_root(slurm_cluster, tmp_path):
    """pyslurm's cases where a root filesystem cluster's controller runs: inside the root,
    this module again with the venv's interpreter (bind-mounted there, as for jobs)."""
    if INSIDE_ROOT:
        pytest.skip("this is the run inside the root")
    root = slurm_cluster.slurm_root
    if root is None:
        pytest.skip("the cluster runs the host's Slurm: the pyslurm cases ran (or not) in this session")
    if importlib.util.find_spec("pyslurm") is None:
        pytest.skip(f"pyslurm is not installed; `make pyslurm` builds pyslurm 25.11.2 against Slurm 25.11 "
                    f"(this cluster runs Slurm {slurm_cluster.slurm_version})")
    if not slurm_cluster.slurm_version.startswith("25.11"):
        pytest.skip(f"pyslurm 25.11 needs Slurm 25.11; this cluster runs Slurm {slurm_cluster.slurm_version}")
    from trainmover.cluster import rootfs

    here = Path(__file__).resolve()
    checkout = here.parents[2]
    argv = [*rootfs.launcher(root, rootfs.binds(slurm_cluster.state_dir), chdir=str(checkout)),
            sys.executable, "-m", "pytest", str(here), "-k", "not inside_root", "-q", "-ra",
            "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'inside'}"]
    env = {**os.environ, "TM_E2E_INSIDE_ROOT": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=checkout)
    out = proc.stdout + proc.stderr
    print(out[-4000:])
    assert proc.returncode == 0, f"pyslurm contract inside {root} failed (exit {proc.returncode}):\n{out[-4000:]}"
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) == CONTRACT_TESTS and "skipped" not in out, out[-2000:]
