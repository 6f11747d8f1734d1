"""The embedded cluster's daemons: which run (munged, MariaDB and slurmdbd where the
release needs accounting, slurmctld, one slurmd per node), how each is started and
checked, and how any program of the cluster's Slurm is run: from the host, or inside
its Debian root filesystem (trainmover/cluster/rootfs.py)."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path
from typing import Optional

from trainmover.cluster import install, rootfs
from trainmover.cluster.procs import ClusterError, run_cmd, running_pid, tail, wait_until
from trainmover.cluster.spec import ClusterSpec
from trainmover.errors import SlurmError
from trainmover.slurm import commands

STEP_TIMEOUT = 60.0      # one daemon to become ready
QUERY_TIMEOUT = 10.0     # one scontrol/sinfo call


def env(spec: ClusterSpec) -> dict[str, str]:
    return {
        "PATH": install.SEARCH_PATH,
        "SLURM_CONF": str(spec.slurm_conf),
        "TM_CLUSTER_DIR": str(spec.state_dir),
        "LANG": "C.UTF-8",
    }


def program(spec: ClusterSpec, argv: list, *, hostname: Optional[str] = None) -> list:
    """argv that runs `argv[0]` of the cluster's Slurm installation; with `hostname`, as
    that host (own UTS and mount namespaces, the cluster's hosts file as /etc/hosts)."""
    if spec.root:
        root = Path(spec.root)
        argv = [rootfs.which_in(root, str(argv[0])) or argv[0], *argv[1:]] if argv else []
        return rootfs.launcher(root, rootfs.binds(spec.state_dir), hostname=hostname, hosts=spec.hosts_file) + argv
    resolved = [install.which(str(argv[0])) or str(argv[0]), *argv[1:]]
    if hostname is None:
        return resolved
    return [install.which("unshare") or "unshare", "--uts", "--mount", "--propagation", "private",
            sys.executable, "-I", "-S", rootfs.NODEEXEC, "--hostname", hostname, "--hosts", spec.hosts_file,
            "--", *resolved]


def table(spec: ClusterSpec) -> list[tuple[str, str, Path]]:
    """(name, program, pid file) of every daemon, in start order."""
    out = [("munged", "munged", spec.pid_file("munged"))]
    if spec.accounting:
        out += [("mariadbd", "mariadbd", spec.pid_file("mariadbd")), ("slurmdbd", "slurmdbd", spec.pid_file("slurmdbd"))]
    out.append(("slurmctld", "slurmctld", spec.pid_file("slurmctld")))
    out += [(f"slurmd:{n}", "slurmd", spec.run / f"slurmd-{n}.pid") for n in spec.all_nodes]
    return out


def log_for(spec: ClusterSpec, name: str) -> Path:
    if name.startswith("slurmd:"):
        return spec.log / f"slurmd-{name.split(':', 1)[1]}.log"
    return spec.log_file(name)


def running(spec: ClusterSpec) -> dict[str, Optional[int]]:
    marker = str(spec.state_dir)
    return {name: running_pid(pid, prog, marker, spec.root) for name, prog, pid in table(spec)}


def failure(spec: ClusterSpec, name: str, why: str) -> ClusterError:
    log = log_for(spec, name)
    return ClusterError(f"{name} failed: {why}\n--- last lines of {log} ---\n{tail(log)}")


def slurm(spec: ClusterSpec, *argv: str, check: bool = True, timeout: float = QUERY_TIMEOUT):
    """A Slurm client command against this cluster (through commands.run, which finds the
    root filesystem's programs by the SLURM_CONF)."""
    return commands.run(list(argv), timeout=timeout, env=env(spec), check=check)


def alive(spec: ClusterSpec, name: str) -> None:
    """Fail at once, not at the deadline, when a daemon died while we wait for it."""
    pid_file = {n: f for n, _, f in table(spec)}[name]
    if pid_file.exists() and running(spec).get(name) is None:
        raise ClusterError(f"{name} exited during start-up")


def ctld_up(spec: ClusterSpec) -> bool:
    try:
        proc = slurm(spec, "scontrol", "ping", check=False, timeout=5)
    except SlurmError:
        return False
    return proc.returncode == 0 and "UP" in proc.stdout


def _tcp_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


# --- starting each daemon ---------------------------------------------------------------

def start_munged(spec: ClusterSpec) -> None:
    sock = spec.munge_socket
    run_cmd(program(spec, ["munged", f"--socket={sock}", f"--key-file={spec.munge_key}",
                           f"--pid-file={spec.pid_file('munged')}", f"--log-file={spec.log_file('munged')}",
                           f"--seed-file={spec.run / 'munge' / 'munged.seed'}"]),
            timeout=STEP_TIMEOUT, env=env(spec), what="munged")
    wait_until("munged socket", lambda: sock.exists() and running(spec)["munged"] is not None,
               timeout=STEP_TIMEOUT, on_timeout=lambda: tail(spec.log_file("munged")))


def _db_ping(spec: ClusterSpec) -> bool:
    proc = run_cmd(program(spec, ["mariadb-admin", "--no-defaults", f"--socket={spec.db_socket}", "-uroot", "ping"]),
                   timeout=QUERY_TIMEOUT, check=False)
    return proc.returncode == 0


def start_mariadb(spec: ClusterSpec) -> None:
    data = spec.db_dir
    if not (data / "mysql").is_dir():
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir(parents=True)
        run_cmd(program(spec, ["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root",
                               "--auth-root-authentication-method=socket", "--skip-test-db"]),
                timeout=120, env=env(spec), what="mariadb-install-db")
    log = spec.log_file("mariadbd")
    run_cmd(program(spec, [
        "setsid", "-f", "mariadbd", "--no-defaults", f"--datadir={data}",
        f"--socket={spec.db_socket}", f"--port={spec.ports.mariadb}", "--bind-address=127.0.0.1",
        f"--pid-file={spec.pid_file('mariadbd')}", f"--log-error={log}", "--user=root",
        "--skip-name-resolve", "--innodb-buffer-pool-size=128M", "--innodb-lock-wait-timeout=900",
        "--max-allowed-packet=16M"]),
        timeout=STEP_TIMEOUT, env=env(spec), what="mariadbd")
    wait_until("MariaDB to answer", lambda: _db_ping(spec), timeout=STEP_TIMEOUT, on_timeout=lambda: tail(log))
    pw = spec.db_password
    sql = "".join(
        f"CREATE USER IF NOT EXISTS 'slurm'@'{h}' IDENTIFIED BY '{pw}'; "
        f"ALTER USER 'slurm'@'{h}' IDENTIFIED BY '{pw}'; "
        f"GRANT ALL ON slurm_acct_db.* TO 'slurm'@'{h}'; "
        for h in ("127.0.0.1", "localhost")
    )
    run_cmd(program(spec, ["mariadb", "--no-defaults", f"--socket={spec.db_socket}", "-uroot"]),
            stdin=sql, timeout=QUERY_TIMEOUT * 3, what="MariaDB user setup")


def start_slurmdbd(spec: ClusterSpec) -> None:
    run_cmd(program(spec, ["slurmdbd"], hostname="localhost"), timeout=STEP_TIMEOUT, env=env(spec), what="slurmdbd")

    def ready() -> bool:
        if _tcp_open(spec.ports.slurmdbd):
            return True
        alive(spec, "slurmdbd")
        return False

    wait_until("slurmdbd to listen", ready, timeout=STEP_TIMEOUT)


def start_slurmctld(spec: ClusterSpec) -> None:
    run_cmd(program(spec, ["slurmctld", "-f", spec.slurm_conf], hostname="localhost"),
            timeout=STEP_TIMEOUT, env=env(spec), what="slurmctld")

    def ready() -> bool:
        if ctld_up(spec):
            return True
        alive(spec, "slurmctld")
        return False

    wait_until("slurmctld to answer `scontrol ping`", ready, timeout=STEP_TIMEOUT)


def start_slurmd(spec: ClusterSpec, node: str) -> None:
    run_cmd(program(spec, ["slurmd", "-f", spec.slurm_conf, "-N", node], hostname=node),
            timeout=STEP_TIMEOUT, env=env(spec), what=f"slurmd:{node}")


STARTERS = {"munged": start_munged, "mariadbd": start_mariadb, "slurmdbd": start_slurmdbd,
            "slurmctld": start_slurmctld}
