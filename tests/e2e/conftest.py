"""Fixtures for end-to-end tests against the embedded, real Slurm cluster.

`slurm_cluster` starts it once per session with `trainmover.cluster.up()`
(4 training + 2 standby nodes; it installs the Debian packages on a bare
machine) and leaves it running afterwards, so that the next session starts in
about 0.1 s. The tests use their own cluster, state in $TM_E2E_CLUSTER_DIR or
/var/tmp/trainmover-cluster-e2e, apart from the default one that demos use
(tests take it down and need every node free). Stop it with
`python -m trainmover.cluster down --dir /var/tmp/trainmover-cluster-e2e`.

$TM_E2E_SLURM names a Slurm release for these clusters (`make test` runs the
Slurm contract, the drain migration and the SPANK tests once more on each
release the host does not have; the clusters then run from Debian root
filesystems, state in <the directory above>-<release>). Unset: the host's Slurm.
$TM_E2E_INSIDE_ROOT=1: this session runs inside the cluster's root filesystem (the pyslurm
contract: test_slurm_contract.py), where the cluster is only attached to, never started.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from trainmover.errors import SlurmError
from trainmover.slurm import CliSlurm, JobInfo, commands

TEST_JOB_PREFIX = "tm-e2e-"
E2E_SLURM = os.environ.get("TM_E2E_SLURM") or None
_SUFFIX = f"-{E2E_SLURM}" if E2E_SLURM else ""
E2E_DIR = (os.environ.get("TM_E2E_CLUSTER_DIR") or "/var/tmp/trainmover-cluster-e2e") + _SUFFIX
DRAIN_PREFIX = "tm-e2e"
INSIDE_ROOT = os.environ.get("TM_E2E_INSIDE_ROOT") == "1"


def pytest_report_header(config):
    return f"e2e clusters: Slurm {E2E_SLURM or 'of the host'}, state in {E2E_DIR}"


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.geteuid() != 0:
        pytest.skip("the embedded Slurm cluster needs root (private munged, slurmd in namespaces)")
    from trainmover import cluster

    info = cluster.attach(E2E_DIR) if INSIDE_ROOT else cluster.up(nodes=4, standby=2, state_dir=E2E_DIR, slurm=E2E_SLURM)
    client = CliSlurm(slurm_conf=str(info.slurm_conf))
    _clean(client, info.slurm_conf)
    print(f"\ne2e cluster on {info.slurm}")
    yield info
    _clean(client, info.slurm_conf)


def _clean(client: CliSlurm, slurm_conf) -> None:
    """Cancel leftover test jobs and donors; resume nodes drained by tests."""
    env = {**os.environ, "SLURM_CONF": str(slurm_conf)}
    out = commands.run(["squeue", "-h", "-o", "%i|%j"], timeout=10, env=env).stdout
    ids = [line.split("|")[0] for line in out.splitlines()
           if "|" in line and line.split("|", 1)[1].startswith((TEST_JOB_PREFIX, "trainmover-donor-"))]
    if ids:
        commands.run(["scancel", *ids], timeout=10, env=env, check=False)
    for name, node in client.nodes().items():
        if "DRAIN" in node.flags and node.reason.startswith(DRAIN_PREFIX):
            client.resume(name)


def job_ended(client: CliSlurm, job_id: int) -> bool:
    """Whether the job left RUNNING/PENDING/COMPLETING/CONFIGURING."""
    try:
        return client.job(job_id).state not in ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING")
    except SlurmError as exc:  # ended long enough ago (MinJobAge) that slurmctld forgot it
        if "Invalid job id" in str(exc):
            return True
        raise


def resume_drained(client: CliSlurm, reason: str) -> None:
    """Resume every node drained with exactly `reason` (a module's own drains)."""
    for name, node in client.nodes().items():
        if "DRAIN" in node.flags and node.reason == reason:
            client.resume(name)


def own_cluster(nodes: int, standby: int, state_dir: str, drain_reason: str, keepers: int = 2) -> Iterator[tuple]:
    """Body of a module-scoped fixture for a module that runs a cluster of its own size in its
    own state directory (its ports apart): yields (ClusterInfo, CliSlurm); nodes the module
    drained are resumed before and after."""
    if os.geteuid() != 0:
        pytest.skip("the embedded Slurm cluster needs root (private munged, slurmd in namespaces)")
    from trainmover import cluster

    info = cluster.up(nodes=nodes, standby=standby, state_dir=f"{state_dir}{_SUFFIX}", slurm=E2E_SLURM,
                      keepers=keepers)
    client = CliSlurm(slurm_conf=str(info.slurm_conf))
    resume_drained(client, drain_reason)
    yield info, client
    resume_drained(client, drain_reason)


@pytest.fixture
def slurm_client(slurm_cluster) -> CliSlurm:
    return CliSlurm(slurm_conf=str(slurm_cluster.slurm_conf))


@pytest.fixture
def slurm_env(slurm_cluster) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(slurm_cluster.slurm_conf)}


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0, interval: float = 0.2,
             explain: Callable[[], str] | None = None) -> None:
    """Poll `check` until true; on timeout fail with `explain()` (what the system looked like),
    so a failure on a loaded CI machine can be diagnosed from its output alone."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            detail = ""
            if explain is not None:
                try:
                    detail = "\n" + explain()
                except Exception as exc:  # noqa: BLE001 - the timeout is the failure; this only explains it
                    detail = f"\n(could not explain: {exc})"
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{detail}")
        time.sleep(interval)


@pytest.fixture
def submit(slurm_client, slurm_env, tmp_path) -> Iterator[Callable[..., JobInfo]]:
    """submit(script_text, nodes=2) -> JobInfo of the RUNNING job; cancelled at teardown."""
    jobs: list[int] = []

    def _submit(script: str, *, nodes: int = 2, name: str = "job", extra: tuple[str, ...] = (),
                wait_running: bool = True) -> JobInfo:
        path = Path(tmp_path) / f"{name}.sh"
        path.write_text(script)
        path.chmod(0o755)
        out = commands.run(
            ["sbatch", "--parsable", f"--nodes={nodes}", f"--job-name={TEST_JOB_PREFIX}{name}",
             f"--output={tmp_path}/{name}.%j.out", f"--chdir={tmp_path}", *extra, str(path)],
            timeout=15, env=slurm_env).stdout
        job_id = int(out.strip().split(";")[0])
        jobs.append(job_id)
        if wait_running:
            wait_for(f"job {job_id} to run", lambda: slurm_client.job(job_id).running, timeout=30)
        return slurm_client.job(job_id)

    yield _submit
    if jobs:
        commands.run(["scancel", *map(str, jobs)], timeout=10, env=slurm_env, check=False)
        wait_for("test jobs to end",
                 lambda: all(slurm_client.job(j).state not in ("RUNNING", "PENDING", "COMPLETING") for j in jobs),
                 timeout=30)
