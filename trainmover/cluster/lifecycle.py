"""Start, stop and inspect the embedded Slurm cluster (munged, MariaDB, slurmdbd,
slurmctld and one slurmd per node, all private to one state directory)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import secrets
import shlex
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from trainmover.cluster import install, plugin, spec as specmod
from trainmover.cluster.procs import (
    ClusterError, find_pids, run_cmd, running_pid, tail, terminate, wait_until,
)
from trainmover.cluster.spec import ClusterSpec, Ports
from trainmover.errors import DeadlineExceeded, SlurmError
from trainmover.slurm import commands

DEFAULT_DIR = "/var/tmp/trainmover-cluster"
STEP_TIMEOUT = 60.0      # one daemon to become ready
QUERY_TIMEOUT = 10.0     # one scontrol/sinfo call
NODEEXEC = Path(__file__).with_name("nodeexec.py")


@dataclass(frozen=True)
class ClusterInfo:
    state_dir: Path
    slurm_conf: Path
    train_nodes: tuple[str, ...]
    standby_nodes: tuple[str, ...]
    partition: str
    reservation: str
    addresses: dict
    already_running: bool
    installed_packages: bool
    seconds: float

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.slurm_conf)}

    @property
    def healthcheck_state(self) -> Path:
        """Where slurmd's own health-check runs keep their state (test hook inject-fault-<node>)."""
        return self.state_dir / "healthcheck"


def resolve_dir(state_dir: Optional[os.PathLike | str] = None) -> Path:
    """The state directory: the argument, else $TM_CLUSTER_DIR, else /var/tmp/trainmover-cluster."""
    d = state_dir if state_dir is not None else os.environ.get("TM_CLUSTER_DIR") or DEFAULT_DIR
    return Path(d).expanduser().absolute()


def _log(msg: str) -> None:
    print(f"trainmover cluster: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(state_dir: Path, timeout: float = 120.0) -> Iterator[None]:
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / ".lock", "w") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ClusterError(f"another `trainmover cluster` command holds {state_dir}/.lock")
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- spec persistence ----------------------------------------------------------

def _spec_path(state_dir: Path) -> Path:
    return state_dir / "cluster.json"


def _load_spec(state_dir: Path) -> Optional[ClusterSpec]:
    try:
        return ClusterSpec.from_json(_spec_path(state_dir).read_text())
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as exc:
        raise ClusterError(f"{_spec_path(state_dir)} is unreadable ({exc}); remove {state_dir} to start afresh")


def _port_free(port: int, host: str = "") -> bool:
    """Nobody listens on `port` (connections in TIME_WAIT do not count: the daemons
    bind with SO_REUSEADDR too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _pick_ports(n_nodes: int, previous: Optional[Ports]) -> Ports:
    taken: set[int] = set()

    def pick(start: int, count: int = 1) -> int:
        port = start
        while port + count < 65535:
            block = range(port, port + count)
            if not taken.intersection(block) and all(_port_free(p) for p in block):
                taken.update(block)
                return port
            port += 1
        raise ClusterError(f"no {count} free consecutive TCP ports from {start}")

    prev = dataclasses.asdict(previous) if previous else {}
    d = specmod.DEFAULT_PORTS
    return Ports(
        slurmctld=pick(prev.get("slurmctld", d["slurmctld"])),
        slurmdbd=pick(prev.get("slurmdbd", d["slurmdbd"])),
        mariadb=pick(prev.get("mariadb", d["mariadb"])),
        slurmd_base=pick(prev.get("slurmd_base", d["slurmd"]), n_nodes),
    )


# --- daemon table ----------------------------------------------------------------

def _env(spec: ClusterSpec) -> dict[str, str]:
    return {
        "PATH": install._SEARCH,
        "SLURM_CONF": str(spec.slurm_conf),
        "TM_CLUSTER_DIR": str(spec.state_dir),
        "LANG": "C.UTF-8",
    }


def _daemons(spec: ClusterSpec) -> list[tuple[str, str, Path]]:
    """(name, program, pid file) in start order."""
    out = [
        ("munged", "munged", spec.pid_file("munged")),
        ("mariadbd", "mariadbd", spec.pid_file("mariadbd")),
        ("slurmdbd", "slurmdbd", spec.pid_file("slurmdbd")),
        ("slurmctld", "slurmctld", spec.pid_file("slurmctld")),
    ]
    out += [(f"slurmd:{n}", "slurmd", spec.run / f"slurmd-{n}.pid") for n in spec.all_nodes]
    return out


def _log_for(spec: ClusterSpec, name: str) -> Path:
    if name.startswith("slurmd:"):
        return spec.log / f"slurmd-{name.split(':', 1)[1]}.log"
    return spec.log_file(name)


def _running(spec: ClusterSpec) -> dict[str, Optional[int]]:
    marker = str(spec.state_dir)
    return {name: running_pid(pid, prog, marker) for name, prog, pid in _daemons(spec)}


def _fail(spec: ClusterSpec, name: str, why: str) -> ClusterError:
    log = _log_for(spec, name)
    return ClusterError(f"{name} failed: {why}\n--- last lines of {log} ---\n{tail(log)}")


def _slurm(spec: ClusterSpec, *argv: str, check: bool = True, timeout: float = QUERY_TIMEOUT):
    return commands.run(list(argv), timeout=timeout, env=_env(spec), check=check)


# --- starting ----------------------------------------------------------------------

def _write_files(spec: ClusterSpec, old: Optional[ClusterSpec]) -> None:
    for d in (spec.etc, spec.run, spec.run / "munge", spec.log, spec.spool, spec.ctld_state,
              *(spec.spool / f"slurmd-{n}" for n in spec.all_nodes)):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(spec.state_dir, 0o755)
    os.chmod(spec.run / "munge", 0o755)
    if old is not None and old.layout_key() != spec.layout_key():
        _log(f"node layout changed ({old.nodes}+{old.standby} -> {spec.nodes}+{spec.standby}); "
             "clearing slurmctld and slurmd state")
        shutil.rmtree(spec.ctld_state, ignore_errors=True)
        for p in spec.spool.glob("slurmd-*"):
            shutil.rmtree(p, ignore_errors=True)
        spec.ctld_state.mkdir(parents=True, exist_ok=True)
        for n in spec.all_nodes:
            (spec.spool / f"slurmd-{n}").mkdir(parents=True, exist_ok=True)
    if not spec.munge_key.exists():
        spec.munge_key.write_bytes(secrets.token_bytes(1024))
    os.chmod(spec.munge_key, 0o400)
    spec.slurm_conf.write_text(specmod.render_slurm_conf(spec))
    plugin.install(spec.etc, _log)
    plugin.install_healthcheck(spec.etc, spec.slurm_conf, spec.healthcheck_state, sys.executable)
    spec.slurmdbd_conf.write_text(specmod.render_slurmdbd_conf(spec))
    os.chmod(spec.slurmdbd_conf, 0o600)
    try:
        system_hosts = Path("/etc/hosts").read_text()
    except FileNotFoundError:
        raise ClusterError("/etc/hosts is missing: each node bind-mounts its own hosts file over it, "
                           "so it must exist (e.g. `printf '127.0.0.1 localhost\\n' > /etc/hosts`)")
    spec.hosts_file.write_text(specmod.render_hosts(spec, system_hosts))
    spec.hosts_file.chmod(0o644)
    _spec_path(spec.state_dir).write_text(spec.to_json())


def _start_munged(spec: ClusterSpec) -> None:
    sock = spec.munge_socket
    run_cmd(
        [install.which("munged"), f"--socket={sock}", f"--key-file={spec.munge_key}",
         f"--pid-file={spec.pid_file('munged')}", f"--log-file={spec.log_file('munged')}",
         f"--seed-file={spec.run / 'munge' / 'munged.seed'}"],
        timeout=STEP_TIMEOUT, env=_env(spec), what="munged",
    )
    wait_until("munged socket", lambda: sock.exists() and _running(spec)["munged"] is not None,
               timeout=STEP_TIMEOUT, on_timeout=lambda: tail(spec.log_file("munged")))


def _db_ping(spec: ClusterSpec) -> bool:
    proc = run_cmd([install.which("mariadb-admin") or "mariadb-admin", "--no-defaults",
                    f"--socket={spec.db_socket}", "-uroot", "ping"],
                   timeout=QUERY_TIMEOUT, check=False)
    return proc.returncode == 0


def _start_mariadb(spec: ClusterSpec) -> None:
    data = spec.db_dir
    if not (data / "mysql").is_dir():
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir(parents=True)
        run_cmd([install.which("mariadb-install-db"), "--no-defaults", f"--datadir={data}", "--user=root",
                 "--auth-root-authentication-method=socket", "--skip-test-db"],
                timeout=120, env=_env(spec), what="mariadb-install-db")
    log = spec.log_file("mariadbd")
    run_cmd(
        [install.which("setsid"), "-f", install.which("mariadbd"), "--no-defaults", f"--datadir={data}",
         f"--socket={spec.db_socket}", f"--port={spec.ports.mariadb}", "--bind-address=127.0.0.1",
         f"--pid-file={spec.pid_file('mariadbd')}", f"--log-error={log}", "--user=root",
         "--skip-name-resolve", "--innodb-buffer-pool-size=128M", "--innodb-lock-wait-timeout=900",
         "--max-allowed-packet=16M"],
        timeout=STEP_TIMEOUT, env=_env(spec), what="mariadbd",
    )
    wait_until("MariaDB to answer", lambda: _db_ping(spec), timeout=STEP_TIMEOUT,
               on_timeout=lambda: tail(log))
    pw = spec.db_password
    sql = "".join(
        f"CREATE USER IF NOT EXISTS 'slurm'@'{h}' IDENTIFIED BY '{pw}'; "
        f"ALTER USER 'slurm'@'{h}' IDENTIFIED BY '{pw}'; "
        f"GRANT ALL ON slurm_acct_db.* TO 'slurm'@'{h}'; "
        for h in ("127.0.0.1", "localhost")
    )
    run_cmd([install.which("mariadb"), "--no-defaults", f"--socket={spec.db_socket}", "-uroot"],
            stdin=sql, timeout=QUERY_TIMEOUT * 3, what="MariaDB user setup")


def _tcp_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _start_slurmdbd(spec: ClusterSpec) -> None:
    run_cmd(_as_host(spec, "localhost", [install.which("slurmdbd")]), timeout=STEP_TIMEOUT, env=_env(spec),
            what="slurmdbd")

    def ready() -> bool:
        if _tcp_open(spec.ports.slurmdbd):
            return True
        _alive(spec, "slurmdbd")
        return False

    wait_until("slurmdbd to listen", ready, timeout=STEP_TIMEOUT)


def _ctld_up(spec: ClusterSpec) -> bool:
    try:
        proc = _slurm(spec, "scontrol", "ping", check=False, timeout=5)
    except SlurmError:
        return False
    return proc.returncode == 0 and "UP" in proc.stdout


def _alive(spec: ClusterSpec, name: str) -> None:
    """Fail at once, not at the deadline, when a daemon died while we wait for it."""
    pid_file = dict((n, f) for n, _, f in _daemons(spec))[name]
    if pid_file.exists() and _running(spec).get(name) is None:
        raise ClusterError(f"{name} exited during start-up")


def _start_slurmctld(spec: ClusterSpec) -> None:
    run_cmd(_as_host(spec, "localhost", [install.which("slurmctld"), "-f", spec.slurm_conf]),
            timeout=STEP_TIMEOUT, env=_env(spec), what="slurmctld")

    def ready() -> bool:
        if _ctld_up(spec):
            return True
        _alive(spec, "slurmctld")
        return False

    wait_until("slurmctld to answer `scontrol ping`", ready, timeout=STEP_TIMEOUT)


def _as_host(spec: ClusterSpec, hostname: str, argv: list) -> list:
    """`argv` run in its own UTS and mount namespaces as host `hostname`, with the
    cluster's hosts file as /etc/hosts (see nodeexec.py)."""
    return [install.which("unshare"), "--uts", "--mount", "--propagation", "private",
            sys.executable, NODEEXEC, "--hostname", hostname, "--hosts", spec.hosts_file, "--", *argv]


def _start_slurmd(spec: ClusterSpec, node: str) -> None:
    run_cmd(_as_host(spec, node, [install.which("slurmd"), "-f", spec.slurm_conf, "-N", node]),
            timeout=STEP_TIMEOUT, env=_env(spec), what=f"slurmd:{node}")


def node_states(spec: ClusterSpec) -> dict[str, str]:
    """node -> sinfo's long state (idle, allocated, drained, ...)."""
    proc = _slurm(spec, "sinfo", "-h", "-N", "-o", "%N|%T")
    out = {}
    for line in proc.stdout.splitlines():
        if "|" in line:
            name, state = line.split("|", 1)
            out[name.strip()] = state.strip()
    return out


_READY = {"idle", "reserved", "allocated", "mixed", "completing", "draining", "drained", "planned"}


def _all_nodes_ready(spec: ClusterSpec) -> bool:
    try:
        states = node_states(spec)
    except SlurmError:
        return False
    return all(states.get(n, "").rstrip("*~#!%$@^-") in _READY and not states[n].endswith("*")
               for n in spec.all_nodes)


def _reservation_exists(spec: ClusterSpec) -> bool:
    proc = _slurm(spec, "scontrol", "-o", "show", "reservation", specmod.RESERVATION, check=False)
    return proc.returncode == 0 and f"ReservationName={specmod.RESERVATION}" in proc.stdout


def _ensure_reservation(spec: ClusterSpec) -> None:
    if spec.standby == 0 or _reservation_exists(spec):
        return
    _slurm(spec, "scontrol", "create", "reservation", *specmod.reservation_args(spec))


def up(nodes: int = 4, standby: int = 2, state_dir=None) -> ClusterInfo:
    """Start the embedded cluster (installing packages when missing) and wait until
    every node is idle and the standby reservation exists. Idempotent: with the
    cluster already running it only reports it. Raises ClusterError naming the
    daemon that failed, with the tail of its log."""
    t0 = time.monotonic()
    state_dir = resolve_dir(state_dir)
    installed = install.ensure_installed(log=_log)
    with _locked(state_dir):
        old = _load_spec(state_dir)
        running = _running(old) if old else {}
        live = {k: v for k, v in running.items() if v is not None}
        if old and live and (old.nodes, old.standby) != (nodes, standby):
            raise ClusterError(
                f"the cluster in {state_dir} runs with {old.nodes} training + {old.standby} standby nodes, "
                f"not {nodes} + {standby}; run `trainmover cluster down` first")
        if old and len(live) == len(running) and _ctld_up(old) and _all_nodes_ready(old) \
                and (old.standby == 0 or _reservation_exists(old)):
            plugin.install(old.etc, _log)  # sbatch/srun/slurmstepd read plugstack.conf at every call
            _refresh_conf(old)
            _log(f"already running in {state_dir} ({old.nodes} training + {old.standby} standby nodes)")
            return _info(old, already=True, installed=installed, t0=t0)
        if live:
            spec = old  # partly running: keep its ports, start what is missing
        else:
            spec = ClusterSpec(
                state_dir=state_dir, nodes=nodes, standby=standby,
                ports=_pick_ports(nodes + standby, old.ports if old else None),
                db_password=old.db_password if old else secrets.token_hex(16),
            )
        _write_files(spec, old)
        _start_all(spec, running)
        return _info(spec, already=False, installed=installed, t0=t0)


def _refresh_conf(spec: ClusterSpec) -> None:
    """A running cluster whose slurm.conf this version renders differently (an upgrade):
    rewrite it and have every daemon re-read it."""
    plugin.install_healthcheck(spec.etc, spec.slurm_conf, spec.healthcheck_state, sys.executable)
    text = specmod.render_slurm_conf(spec)
    if spec.slurm_conf.read_text() == text:
        return
    spec.slurm_conf.write_text(text)
    _slurm(spec, "scontrol", "reconfigure")
    _log("slurm.conf changed: rewritten, daemons reconfigured")


def _start_all(spec: ClusterSpec, running: dict[str, Optional[int]]) -> None:
    def need(name: str) -> bool:
        return running.get(name) is None

    steps = [("munged", _start_munged), ("mariadbd", _start_mariadb), ("slurmdbd", _start_slurmdbd),
             ("slurmctld", _start_slurmctld)]
    pid_files = {n: f for n, _, f in _daemons(spec)}
    for name, start in steps:
        if need(name):
            pid_files[name].unlink(missing_ok=True)  # stale: the daemon is not running
            t = time.monotonic()
            try:
                start(spec)
            except (ClusterError, DeadlineExceeded) as exc:
                raise _fail(spec, name, str(exc).splitlines()[0]) from exc
            _log(f"{name} up ({time.monotonic() - t:.1f}s)")
    t = time.monotonic()
    for node in spec.all_nodes:
        if need(f"slurmd:{node}"):
            pid_files[f"slurmd:{node}"].unlink(missing_ok=True)
            try:
                _start_slurmd(spec, node)
            except ClusterError as exc:
                raise _fail(spec, f"slurmd:{node}", str(exc).splitlines()[0]) from exc

    def not_ready() -> str:
        try:
            states = node_states(spec)
        except SlurmError as exc:
            return str(exc)
        dead = [n for n in spec.all_nodes if _running(spec)[f"slurmd:{n}"] is None]
        msg = f"node states: {states}"
        if dead:
            n = dead[0]
            msg += f"\nslurmd not running for {dead}; last lines of {_log_for(spec, 'slurmd:' + n)}:\n" \
                   f"{tail(_log_for(spec, 'slurmd:' + n))}"
        return msg

    def ready() -> bool:
        if _all_nodes_ready(spec):
            return True
        for node in spec.all_nodes:  # fail at once when a slurmd died after starting
            _alive(spec, f"slurmd:{node}")
        return False

    try:
        wait_until("all nodes to register (idle)", ready, timeout=STEP_TIMEOUT, interval=0.2, on_timeout=not_ready)
    except DeadlineExceeded as exc:
        raise ClusterError(f"slurmd: {exc}") from exc
    except ClusterError as exc:
        raise _fail(spec, str(exc).split(" ", 1)[0], str(exc)) from exc
    _log(f"{len(spec.all_nodes)} slurmd up ({time.monotonic() - t:.1f}s)")
    try:
        _ensure_reservation(spec)
        wait_until(f"reservation {specmod.RESERVATION}", lambda: _reservation_exists(spec), timeout=STEP_TIMEOUT)
    except (SlurmError, DeadlineExceeded) as exc:
        raise _fail(spec, "slurmctld", f"cannot create reservation {specmod.RESERVATION}: {exc}") from exc


def _info(spec: ClusterSpec, *, already: bool, installed: bool, t0: float) -> ClusterInfo:
    return ClusterInfo(
        state_dir=spec.state_dir, slurm_conf=spec.slurm_conf,
        train_nodes=tuple(spec.train_nodes), standby_nodes=tuple(spec.spare_nodes),
        partition=specmod.PARTITION, reservation=specmod.RESERVATION,
        addresses={n: spec.addr(n) for n in spec.all_nodes},
        already_running=already, installed_packages=installed, seconds=time.monotonic() - t0,
    )


# --- stopping ----------------------------------------------------------------------

def _cancel_jobs(spec: ClusterSpec) -> None:
    try:
        ids = _slurm(spec, "squeue", "-h", "-o", "%i").stdout.split()
        if ids:
            _slurm(spec, "scancel", *ids, check=False)
            wait_until("jobs to end", lambda: not _slurm(spec, "squeue", "-h", "-t", "R,CG", "-o", "%i").stdout.split(),
                       timeout=20)
    except (SlurmError, DeadlineExceeded) as exc:
        _log(f"could not cancel all jobs cleanly ({str(exc).splitlines()[0]}); stopping daemons anyway")


def down(state_dir=None) -> dict:
    """Stop every daemon this state directory started (pid files, checked against
    /proc so that no unrelated process is signalled). Idempotent. Returns
    {daemon: pid} of what it stopped."""
    state_dir = resolve_dir(state_dir)
    spec = _load_spec(state_dir) if state_dir.exists() else None
    if spec is None:
        return {}
    with _locked(state_dir):
        marker = str(spec.state_dir)
        running = _running(spec)
        stopped: dict[str, int] = {}
        if running.get("slurmctld") and _ctld_up(spec):
            _cancel_jobs(spec)
        order = [n for n, _, _ in _daemons(spec) if n.startswith("slurmd:")] + \
                ["slurmctld", "slurmdbd", "mariadbd", "munged"]
        progs = {n: p for n, p, _ in _daemons(spec)}
        slurmds = [(n, running[n]) for n in order if n.startswith("slurmd:") and running[n]]
        terminate([p for _, p in slurmds], "slurmd", marker)
        stopped.update(dict(slurmds))
        # slurmd processes not in a pid file (a crashed start) and leftover step daemons
        for prog in ("slurmd", "slurmstepd"):
            extra = find_pids(prog, marker)
            if extra:
                terminate(extra, prog, marker)
                stopped.update({f"{prog}:{p}": p for p in extra})
        for name in ("slurmctld", "slurmdbd", "mariadbd", "munged"):
            pid = running.get(name)
            if pid:
                terminate([pid], progs[name], marker, timeout=30)
                stopped[name] = pid
        for name, _, pid_file in _daemons(spec):
            if pid_file.exists() and running_pid(pid_file, progs[name], marker) is None:
                pid_file.unlink(missing_ok=True)
        return stopped


# --- inspecting ----------------------------------------------------------------------

def status(state_dir=None) -> dict:
    """{'state_dir', 'slurm_conf', 'running', 'daemons': {name: {'pid', 'up'}},
    'nodes': {node: sinfo state}, 'reservation': name or None}."""
    state_dir = resolve_dir(state_dir)
    spec = _load_spec(state_dir) if state_dir.exists() else None
    if spec is None:
        return {"state_dir": str(state_dir), "configured": False, "running": False, "daemons": {}, "nodes": {},
                "reservation": None}
    running = _running(spec)
    ctld = running["slurmctld"] is not None and _ctld_up(spec)
    nodes: dict[str, str] = {}
    resv = None
    if ctld:
        try:
            nodes = node_states(spec)
            resv = specmod.RESERVATION if _reservation_exists(spec) else None
        except SlurmError as exc:
            nodes = {"error": str(exc)}
    return {
        "state_dir": str(state_dir),
        "configured": True,
        "slurm_conf": str(spec.slurm_conf),
        "running": all(v is not None for v in running.values()) and ctld,
        "daemons": {k: {"pid": v, "up": v is not None} for k, v in running.items()},
        "nodes": nodes,
        "reservation": resv,
        "train_nodes": spec.train_nodes,
        "standby_nodes": spec.spare_nodes,
        "addresses": {n: spec.addr(n) for n in spec.all_nodes},
    }


def env_lines(state_dir=None) -> str:
    """Shell lines for `eval "$(trainmover cluster env)"`: SLURM_CONF (and PATH when
    the Slurm client commands are not on it)."""
    state_dir = resolve_dir(state_dir)
    spec = _load_spec(state_dir)
    conf = spec.slurm_conf if spec else state_dir / "etc" / "slurm.conf"
    lines = [f"export SLURM_CONF={shlex.quote(str(conf))}",
             f"export TM_CLUSTER_DIR={shlex.quote(str(state_dir))}"]
    sinfo = install.which("sinfo")
    path_dirs = os.environ.get("PATH", "").split(os.pathsep)
    if sinfo and os.path.dirname(sinfo) not in path_dirs:
        lines.append(f'export PATH={shlex.quote(os.path.dirname(sinfo))}:"$PATH"')
    return "\n".join(lines) + "\n"
