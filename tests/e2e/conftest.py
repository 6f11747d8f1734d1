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

Jobs run as the cluster's ordinary user JOB_USER (trainmover/cluster/users.py), as on a
production cluster: `user_dir()` makes a submit directory of theirs (0700 under /var/tmp),
`as_user()` runs a Slurm command as them through the choke point (`runuser`), and the
`job_user` fixture checks that they can run the checkout's interpreter. Admin steps (drains,
resumes, killing a node's processes) stay root's, as an admin's would.
$TM_E2E_INSIDE_ROOT=1: this session runs inside the cluster's root filesystem (the pyslurm
contract: test_slurm_contract.py), where the cluster is only attached to, never started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

from trainmover.cluster.users import JOB_USER, OTHER_USER, host_account
from trainmover.errors import SlurmError
from trainmover.slurm import CliSlurm, JobInfo, commands

__all__ = ["JOB_USER", "OTHER_USER", "user_dir", "as_user", "job_process_uids", "assert_runs_as_user"]

TEST_JOB_PREFIX = "tm-e2e-"
E2E_SLURM = os.environ.get("TM_E2E_SLURM") or None
_SUFFIX = f"-{E2E_SLURM}" if E2E_SLURM else ""
E2E_DIR = (os.environ.get("TM_E2E_CLUSTER_DIR") or "/var/tmp/trainmover-cluster-e2e") + _SUFFIX
DRAIN_PREFIX = "tm-e2e"
# Submit directories of the users' test jobs: root's directory (0755), one 0700 directory per
# job owned by its user, so that no other user reads or writes a job's files.
USER_JOBS_DIR = Path(os.environ.get("TM_E2E_JOBS_DIR") or "/var/tmp/trainmover-e2e-jobs")
ROOT = Path(__file__).resolve().parents[2]
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
    # An earlier session cut short leaves jobs completing on their nodes: the tests start once
    # every node is free (seen: a node still completing at the start made `cluster up` restart).
    wait_for("the cluster's nodes free of earlier jobs", lambda: not any(n.busy for n in client.nodes().values()),
             timeout=120, interval=1.0)
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
    resume_drained_by(client, (DRAIN_PREFIX,))


def resume_drained_by(client: CliSlurm, prefixes: tuple[str, ...]) -> None:
    """Resume every node drained with a reason that starts with one of `prefixes`."""
    for name, node in client.nodes().items():
        if "DRAIN" in node.flags and node.reason.startswith(prefixes):
            client.resume(name)


# The reason the cluster's Epilog (slurm_plugin/epilog.sh) drains a node a job held after fencing it
EPILOG_DRAIN = "trainmover: healthcheck fenced: job "


@pytest.fixture(autouse=True)
def _held_nodes_back(request):
    """A node a job held after fencing it (its user may not drain) is drained by the Epilog at the
    job's end, which may come after its test ended: each test on the shared cluster starts with
    such nodes back in service, as an admin would put them after a look."""
    if "slurm_cluster" in request.fixturenames:
        resume_drained_by(request.getfixturevalue("slurm_client"), (EPILOG_DRAIN,))
    yield


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


def own_cluster(nodes: int, standby: int, state_dir: str, drain_reason: str, keepers: int = 2,
                job_expansion: bool = True, node_reader: bool = True) -> Iterator[tuple]:
    """Body of a module-scoped fixture for a module that runs a cluster of its own size in its
    own state directory (its ports apart): yields (ClusterInfo, CliSlurm); nodes the module
    drained are resumed before and after, and the cluster is stopped after the module: left up,
    its idle nodes' health checks (slurmd runs healthcheck.sh on each every 30 s) took 6.8 CPU
    seconds a minute (13 nodes, measured) from the 2 cores of the modules after it, to the end of
    `make test`. The next session starts it again. `job_expansion` False: its slurm.conf lacks
    permit_job_expansion, as Slurm ships it (`cluster up --no-job-expansion`). `node_reader` False:
    no per-cluster node-state reader (`--no-node-reader`): each job polls for itself."""
    if os.geteuid() != 0:
        pytest.skip("the embedded Slurm cluster needs root (private munged, slurmd in namespaces)")
    from trainmover import cluster

    info = cluster.up(nodes=nodes, standby=standby, state_dir=f"{state_dir}{_SUFFIX}", slurm=E2E_SLURM,
                      keepers=keepers, job_expansion=job_expansion, node_reader=node_reader)
    client = CliSlurm(slurm_conf=str(info.slurm_conf))
    resume_drained(client, drain_reason)
    yield info, client
    resume_drained(client, drain_reason)
    cluster.down(state_dir=f"{state_dir}{_SUFFIX}")


def user_dir(name: str, user: str = JOB_USER) -> Path:
    """A fresh submit directory owned by `user`, mode 0700, under USER_JOBS_DIR."""
    acct = host_account(user)
    assert acct is not None, f"user {user} missing: the e2e cluster's up() creates it"
    USER_JOBS_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(USER_JOBS_DIR, 0o755)
    d = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=USER_JOBS_DIR))
    os.chown(d, acct.uid, acct.gid)
    os.chmod(d, 0o700)
    return d


def as_user(argv: list[str], env: dict, *, user: str = JOB_USER, timeout: float = 15,
            check: bool = True) -> subprocess.CompletedProcess:
    """A Slurm command (`sbatch`, `scancel`, `squeue`...) run as `user`, through the choke point."""
    return commands.run(argv, timeout=timeout, env=env, check=check, user=user)


def job_process_uids(job_id: int) -> dict[int, tuple[int, str]]:
    """pid -> (real uid, program) of every process on this machine running for job `job_id`
    (its environment names the job: batch script, controller, srun, ranks, standbys; Slurm's
    own slurmstepd is not one). Every node of the embedded cluster is a process tree here."""
    want = f"SLURM_JOB_ID={job_id}".encode()
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if want not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            status = Path(f"/proc/{entry}/status").read_text().splitlines()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status if ":" in line)
        out[int(entry)] = (int(fields["Uid"].split()[0]), fields["Name"].strip())
    return out


def assert_runs_as_user(job_id: int, env: dict, user: str = JOB_USER) -> None:
    """Slurm says the job is `user`'s and none of its processes runs as root."""
    owner = commands.run(["squeue", "-h", "-j", str(job_id), "-o", "%u"], timeout=10, env=env).stdout.strip()
    assert owner == user, f"job {job_id} belongs to {owner!r}, not {user}"
    procs = job_process_uids(job_id)
    assert procs, f"no process of job {job_id} found"
    root = {pid: name for pid, (uid, name) in procs.items() if uid == 0}
    assert not root, f"processes of {user}'s job {job_id} run as root: {root}"


@pytest.fixture(scope="session")
def job_user(slurm_cluster) -> str:
    """JOB_USER, once it is known to run the interpreter the jobs use (TM_PYTHON: the
    checkout's root-owned .venv, whose base interpreter must be reachable by others)."""
    proc = subprocess.run(["runuser", "-u", JOB_USER, "--", sys.executable, "-c", "import torch, trainmover"],
                          capture_output=True, text=True, timeout=120, cwd="/", env={**os.environ, "PYTHONPATH": str(ROOT)})
    # earlier sessions' submit directories (an hour old: none of a running session's)
    for old in USER_JOBS_DIR.glob("*-*") if USER_JOBS_DIR.is_dir() else []:
        if time.time() - old.stat().st_mtime > 3600:
            shutil.rmtree(old, ignore_errors=True)
    if proc.returncode != 0:
        pytest.fail(f"{JOB_USER} cannot run {sys.executable} (real {os.path.realpath(sys.executable)}): "
                    f"{proc.stderr.strip()[-500:]}; every directory on the way must be searchable by others "
                    "(scripts/setup.sh does `chmod o+x` on them)")
    return JOB_USER


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


def explain_cluster(client: CliSlurm, job_ids: Iterable[int] = ()) -> str:
    """What the scheduler saw: each job's state and pending reason, each node's state, flags,
    features' kind and drain reason (a wait for jobs to start that times out says why)."""
    lines = []
    for job_id in job_ids:
        try:
            job = client.job(job_id)
            lines.append(f"job {job_id}: {job.state} reason={job.reason or '-'} nodes={job.nodelist or '-'}")
        except SlurmError as exc:
            lines.append(f"job {job_id}: {exc}")
    for name, node in sorted(client.nodes().items()):
        lines.append(f"node {name}: {node.base_state} flags={','.join(sorted(node.flags)) or '-'} "
                     f"reason={node.reason or '-'}")
    return "\n".join(lines)


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


@pytest.fixture(scope="session")
def session_runs() -> dict:
    """Jobs that several modules compare with (the demo's uninterrupted reference), by name: run
    once per session. Not a module-level dict of the module that defines such a fixture: that
    module is imported twice (as pytest's test module and as `tests.e2e.…` by the modules that
    import its fixtures), each copy with its own dict."""
    return {}
