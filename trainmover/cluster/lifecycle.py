"""Start, stop and inspect the embedded Slurm cluster (munged, MariaDB and slurmdbd where
the Slurm release needs accounting, slurmctld and one slurmd per node, all private to
one state directory), running the host's Slurm or another release's from a Debian root
filesystem (rootfs.py). The daemons themselves: daemons.py."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shlex
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainmover import config
from trainmover.cluster import daemons, install, netblock, plugin, rootdirs, rootfs, spec as specmod, users
from trainmover.cluster import node_reader as state_reader  # `node_reader` is up()'s argument
from trainmover.cluster.daemons import STEP_TIMEOUT
from trainmover.cluster.procs import ClusterError, find_pids, flocked, running_pid, tail, terminate, wait_until
from trainmover.cluster.releases import release
from trainmover.cluster.spec import ClusterSpec, Ports
from trainmover.errors import DeadlineExceeded, SlurmError

DEFAULT_DIR = "/var/tmp/trainmover-cluster"
# Wrappers in <state dir>/bin for a shell (`eval "$(trainmover cluster env)"`) when the
# cluster's Slurm lives in a root filesystem.
CLIENT_COMMANDS = ("sinfo", "squeue", "scontrol", "sbatch", "srun", "salloc", "scancel", "sacct", "sstat")


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
    slurm_version: str = ""
    slurm_root: Optional[Path] = None     # the Debian root filesystem it runs in; None: the host's Slurm
    spank_plugin: Optional[Path] = None   # the SPANK plugin plugstack.conf loads (None: not built)

    @property
    def slurm(self) -> str:
        """'Slurm 24.11.5 (root filesystem /var/cache/trainmover/rootfs/24.11)' or 'Slurm 22.05.8 (host)'."""
        return f"Slurm {self.slurm_version} ({'root filesystem ' + str(self.slurm_root) if self.slurm_root else 'host'})"

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.slurm_conf)}

    @property
    def healthcheck_state(self) -> Path:
        """Where slurmd's own health-check runs keep their state (test hook inject-fault-<node>)."""
        return self.state_dir / "healthcheck"


def resolve_dir(state_dir: Optional[os.PathLike | str] = None, slurm: Optional[str] = None) -> Path:
    """The state directory: the argument, else $TM_CLUSTER_DIR, else /var/tmp/trainmover-cluster
    (/var/tmp/trainmover-cluster-<release> when a Slurm release is named).

    With a release named, $TM_CLUSTER_DIR counts only when its cluster runs that release (or
    none yet): `eval "$(trainmover cluster env)"` after `make demo` exports the default
    cluster's directory, and `trainmover demo --slurm 25.11` then runs beside that cluster,
    in 25.11's own directory, rather than stop at it."""
    default = f"{DEFAULT_DIR}-{release(slurm).version}" if slurm else DEFAULT_DIR
    if state_dir is None and config.setting("TM_CLUSTER_DIR"):
        state_dir = Path(config.setting("TM_CLUSTER_DIR")).expanduser().absolute()
        other = _load_spec(state_dir) if slurm else None
        if other is not None and other.slurm != release(slurm).version:
            _log(f"$TM_CLUSTER_DIR {state_dir} holds a Slurm {other.slurm} cluster; Slurm {release(slurm).version} "
                 f"runs beside it, in {default}")
            state_dir = default
    return Path(state_dir if state_dir is not None else default).expanduser().absolute()


def _log(msg: str) -> None:
    print(f"trainmover cluster: {msg}", file=sys.stderr, flush=True)


def _locked(state_dir: Path, timeout: float = 120.0):
    """The state directory's lock; the directory made root's (0700; _write_files opens it to
    0755 for the users' jobs) or refused when someone else could have made or can change it."""
    rootdirs.own_dir(state_dir)
    return flocked(state_dir / ".lock", timeout, "another `trainmover cluster` command holds it")


# --- spec persistence ----------------------------------------------------------

def _spec_path(state_dir: Path) -> Path:
    return state_dir / "cluster.json"


def _load_spec(state_dir: Path) -> Optional[ClusterSpec]:
    """The cluster.json of `state_dir`, believed only when root wrote it (rootdirs: the directory
    and the file root's, neither writable by others, no link): its `root` names the file system
    the daemons run chrooted in, as root. None where there is none."""
    if not os.path.lexists(state_dir):
        return None
    rootdirs.check_dir(state_dir)
    try:
        return ClusterSpec.from_json(rootdirs.read_own(_spec_path(state_dir)))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as exc:
        raise ClusterError(f"{_spec_path(state_dir)} is unreadable ({exc}); remove {state_dir} to start afresh")


def _save_spec(spec: ClusterSpec) -> None:
    """cluster.json, 0600: it holds the accounting database's password (slurmdbd.conf's too)."""
    rootdirs.write_own(_spec_path(spec.state_dir), spec.to_json())


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


# --- starting ----------------------------------------------------------------------

def _write_files(spec: ClusterSpec, old: Optional[ClusterSpec]) -> None:
    for d in (spec.etc, spec.run, spec.run / "munge", spec.log, spec.spool, spec.ctld_state,
              *(spec.spool / f"slurmd-{n}" for n in spec.all_nodes)):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(spec.state_dir, 0o755)
    os.chmod(spec.etc, 0o755)  # root's alone: a controller believes the expansion-fix declaration only so
    os.chmod(spec.run / "munge", 0o755)
    if old is not None and old.layout_key() != spec.layout_key():
        _log(f"node layout, Slurm release or address block changed ({old.nodes}+{old.standby} nodes, Slurm "
             f"{old.slurm}, 127.0.{old.net}.0/24 -> {spec.nodes}+{spec.standby}, Slurm {spec.slurm}, "
             f"127.0.{spec.net}.0/24); clearing slurmctld and slurmd state")
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
    _write_slurm_access(spec)
    if spec.accounting:
        rootdirs.write_own(spec.slurmdbd_conf, specmod.render_slurmdbd_conf(spec))
    try:
        system_hosts = Path("/etc/hosts").read_text()
    except FileNotFoundError:
        raise ClusterError("/etc/hosts is missing: each node bind-mounts its own hosts file over it, "
                           "so it must exist (e.g. `printf '127.0.0.1 localhost\\n' > /etc/hosts`)")
    spec.hosts_file.write_text(specmod.render_hosts(spec, system_hosts))
    spec.hosts_file.chmod(0o644)
    plugin.install(spec, _log)
    plugin.install_healthcheck(spec.etc, spec.slurm_conf, spec.healthcheck_state, sys.executable)
    _save_spec(spec)


def _write_slurm_access(spec: ClusterSpec) -> None:
    """cgroup.conf where the release needs one; the declaration of a slurmctld built with the
    job-expansion fix, where it was; for a root filesystem, the exec file that commands.run
    follows to run Slurm commands there, and wrappers for a shell."""
    cgroup = specmod.render_cgroup_conf(spec)
    if cgroup is None:
        spec.cgroup_conf.unlink(missing_ok=True)
    else:
        spec.cgroup_conf.write_text(cgroup)
    # A Slurm built here with the job-expansion fix says so where a job's controller looks
    # (slurm/expansion_fix.py); its root filesystem's marker is what was built.
    marker = rootfs.built(Path(spec.root)) if spec.root else None
    fix = specmod.render_expansion_fix(spec.slurm_version, ((marker or {}).get("source_build") or {}).get("fixes", []))
    if fix is None:
        spec.expansion_fix_file.unlink(missing_ok=True)
    else:
        spec.expansion_fix_file.write_text(fix)
        spec.expansion_fix_file.chmod(0o644)
    if not spec.root:
        spec.exec_file.unlink(missing_ok=True)
        shutil.rmtree(spec.bin, ignore_errors=True)
        return
    prefix = daemons.program(spec, [])
    tmp = spec.exec_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"slurm": spec.slurm_version, "root": spec.root, "prefix": [str(a) for a in prefix],
                               "root_id": rootfs.root_id(Path(spec.root))}, indent=1) + "\n")
    tmp.replace(spec.exec_file)
    spec.bin.mkdir(exist_ok=True)
    host_root = "{}:{}".format(*rootfs.root_id(Path("/")))
    for name in CLIENT_COMMANDS:
        real = rootfs.which_in(Path(spec.root), name) or f"/usr/bin/{name}"
        wrapper = spec.bin / name
        # The state directory is visible inside root filesystems too, and job steps inherit
        # the submitter's PATH: anywhere but on the host the wrapper runs the program itself.
        wrapper.write_text(f"#!/bin/sh\n# {name} of {spec.describe_slurm()} (generated by trainmover.cluster)\n"
                           f"[ \"$(stat -c %d:%i /)\" = {host_root} ] || exec {real} \"$@\"\n"
                           f"exec {shlex.join(str(a) for a in prefix)} {real} \"$@\"\n")
        wrapper.chmod(0o755)


def node_states(spec: ClusterSpec) -> dict[str, str]:
    """node -> sinfo's long state (idle, allocated, drained, ...)."""
    proc = daemons.slurm(spec, "sinfo", "-h", "-N", "-o", "%N|%T")
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


def _reservation_users(spec: ClusterSpec) -> Optional[set[str]]:
    """The users the standby reservation admits, or None when it does not exist."""
    proc = daemons.slurm(spec, "scontrol", "-o", "show", "reservation", specmod.RESERVATION, check=False)
    if proc.returncode != 0 or f"ReservationName={specmod.RESERVATION}" not in proc.stdout:
        return None
    field = next((f for f in proc.stdout.split() if f.startswith("Users=")), "Users=")
    return set(field.split("=", 1)[1].split(","))


def _reservation_exists(spec: ClusterSpec) -> bool:
    return _reservation_users(spec) is not None


def _ensure_reservation(spec: ClusterSpec) -> None:
    """The standby reservation, admitting RESERVATION_USERS (a cluster started before the
    cluster had ordinary users gets them added)."""
    if spec.standby == 0:
        return
    have = _reservation_users(spec)
    if have is None:
        daemons.slurm(spec, "scontrol", "create", "reservation", *specmod.reservation_args(spec))
    elif have != set(specmod.RESERVATION_USERS):
        daemons.slurm(spec, "scontrol", "update", f"ReservationName={specmod.RESERVATION}",
                      f"Users={','.join(specmod.RESERVATION_USERS)}")
        _log(f"reservation {specmod.RESERVATION}: Users={','.join(specmod.RESERVATION_USERS)}")


def up(nodes: int = 4, standby: int = 2, state_dir=None, slurm: Optional[str] = None,
       rootfs_cache=None, force_root: bool = False, keepers: int = specmod.KEEPERS,
       job_expansion: bool = True, unfixed: bool = False, node_reader: bool = True) -> ClusterInfo:
    """Start the embedded cluster and wait until every node is idle and the standby
    reservation exists. Idempotent: with the cluster already running it only reports it.

    `slurm`: the Slurm release ('22.05', '24.11', '26.05'): the host's when the host has it
    (Debian packages installed when missing), else a Debian root filesystem built once in
    `rootfs_cache` (default $TM_ROOTFS_CACHE or /var/cache/trainmover/rootfs); `force_root`
    takes the root filesystem even for the host's release. None: the release a cluster in
    `state_dir` ran, else the host's. Raises ClusterError naming the daemon that failed,
    with the tail of its log, or the supported versions for an unsupported one. `keepers`: keeper
    nodes (a TrainMover job's batch script runs on one: one per job running at once).
    `job_expansion` False: slurm.conf without permit_job_expansion (a running cluster's is
    rewritten and reconfigured). `unfixed`: `slurm` (25.11) built without TrainMover's fixes to
    its source, from a root filesystem of its own (releases.unfixed). `node_reader` False: no
    per-cluster node-state reader (cluster/node_reader.py; each job polls for itself)."""
    t0 = time.monotonic()
    if slurm is not None:
        release(slurm)  # an unsupported version fails before anything else
    state_dir = resolve_dir(state_dir, slurm)
    with _locked(state_dir):
        old = _load_spec(state_dir)
        if rootfs_cache is None and slurm is None and old is not None and old.root:
            rootfs_cache = Path(old.root).parent  # the cluster's own, unless told otherwise
        cache = rootfs.resolve_cache(rootfs_cache)
        running = daemons.running(old) if old else {}
        live = {k: v for k, v in running.items() if v is not None}
        if old and live and (old.nodes, old.standby, old.keepers) != (nodes, standby, keepers):
            raise ClusterError(
                f"the cluster in {state_dir} runs with {old.nodes} training + {old.standby} standby + {old.keepers} "
                f"keeper nodes, not {nodes} + {standby} + {keepers}; run `trainmover cluster down` first")
        if old and live and not _same_slurm(old, slurm, force_root, unfixed):
            raise ClusterError(f"the cluster in {state_dir} runs {old.describe_slurm()}, not Slurm {slurm}; "
                               f"run `trainmover cluster down --dir {state_dir}` first, or use another --dir")
        slurmd = next((pid for name, pid in live.items() if name.startswith("slurmd:")), None)
        hidden = rootfs.unseen(slurmd, rootfs.binds(state_dir)) if old and old.root and slurmd else []
        if hidden:
            _log(f"the cluster in {state_dir} was started from another checkout or interpreter ({', '.join(hidden)} "
                 "not visible on its nodes): restarting it")
            _stop(old)
            running, live = {}, {}
        if old and live and old.job_expansion != job_expansion:  # slurm.conf changes; the daemons stay
            old = dataclasses.replace(old, job_expansion=job_expansion)
            _spec_path(state_dir).write_text(old.to_json())
        if old and live and old.node_reader != node_reader:  # the reader starts or stops; the daemons stay
            old = dataclasses.replace(old, node_reader=node_reader)
            _spec_path(state_dir).write_text(old.to_json())
        if old and len(live) == len(running) and daemons.ctld_up(old) and _all_nodes_ready(old) \
                and (old.standby == 0 or _reservation_exists(old)):
            users.ensure(Path(old.root) if old.root else None, _log)
            _save_spec(old)  # 0600 again where an older version left it readable by all
            _ensure_reservation(old)
            _write_slurm_access(old)
            plugin.install(old, _log)  # sbatch/srun/slurmstepd read plugstack.conf at every call
            _refresh_conf(old)
            state_reader.ensure(old, _log)
            _log(f"already running in {state_dir} ({old.nodes} training + {old.standby} standby nodes, "
                 f"{old.describe_slurm()})")
            return _info(old, already=True, installed=False, t0=t0)
        taken = _ports_taken(old, running) if live else []
        if taken:
            _log(f"ports {taken} of its stopped daemons are in use by other processes now; "
                 "stopping the rest and starting the whole cluster on free ports")
            _stop(old)
            running, live = {}, {}
        if live:
            spec = old  # partly running: keep its ports and Slurm, start what is missing
            installed = False
        else:
            wanted = slurm if slurm is not None else (old.slurm if old else None)
            forced = force_root or (slurm is None and old is not None and bool(old.root))
            rel, full, root, installed = rootfs.locate(wanted, cache=cache, log=_log, force_root=forced,
                                                       unfixed=unfixed)
            spec = ClusterSpec(
                state_dir=state_dir, nodes=nodes, standby=standby,
                ports=_pick_ports(nodes + standby + keepers, old.ports if old else None),
                db_password=old.db_password if old else secrets.token_hex(16),
                slurm=rel, slurm_version=full, root=root,
                net=netblock.claim(state_dir, preferred=old.net if old else None), keepers=keepers,
                job_expansion=job_expansion, unfixed=unfixed, node_reader=node_reader,
            )
        _log(f"{spec.describe_slurm()}")
        # before slurmctld starts: it resolves the reservation's Users= and slurmd the jobs' uids
        users.ensure(Path(spec.root) if spec.root else None, _log)
        _write_files(spec, old)
        _start_all(spec, running)
        state_reader.ensure(spec, _log)
        return _info(spec, already=False, installed=installed, t0=t0)


def attach(state_dir) -> ClusterInfo:
    """The running cluster in `state_dir`, read only: starts, builds and installs nothing.
    For a process inside the cluster's root filesystem (tests of the pyslurm backend run
    there), which cannot start nodes: `up` from the host first."""
    spec = _load_spec(resolve_dir(state_dir))
    if spec is None:
        raise ClusterError(f"no cluster in {state_dir}: `trainmover cluster up` first")
    return _info(spec, already=True, installed=False, t0=time.monotonic())


def _same_slurm(old: ClusterSpec, slurm: Optional[str], force_root: bool, unfixed: bool = False) -> bool:
    """Whether a running cluster `old` is what `up(slurm=..., force_root=..., unfixed=...)` asks for."""
    if slurm is None:  # whatever runs, unless an unfixed Slurm was asked for
        return old.unfixed or not unfixed
    return old.slurm == release(slurm).version and (bool(old.root) or not force_root) and old.unfixed == unfixed


def _refresh_conf(spec: ClusterSpec) -> None:
    """A running cluster whose slurm.conf this version renders differently (an upgrade):
    rewrite it and have every daemon re-read it."""
    plugin.install_healthcheck(spec.etc, spec.slurm_conf, spec.healthcheck_state, sys.executable)
    text = specmod.render_slurm_conf(spec)
    if spec.slurm_conf.read_text() == text:
        return
    spec.slurm_conf.write_text(text)
    daemons.slurm(spec, "scontrol", "reconfigure")
    _log("slurm.conf changed: rewritten, daemons reconfigured")


def _start_all(spec: ClusterSpec, running: dict[str, Optional[int]]) -> None:
    def need(name: str) -> bool:
        return running.get(name) is None

    pid_files = {n: f for n, _, f in daemons.table(spec)}
    for name, start in daemons.STARTERS.items():
        if name in pid_files and need(name):
            pid_files[name].unlink(missing_ok=True)  # stale: the daemon is not running
            t = time.monotonic()
            try:
                start(spec)
            except (ClusterError, DeadlineExceeded) as exc:
                raise daemons.failure(spec, name, str(exc).splitlines()[0]) from exc
            _log(f"{name} up ({time.monotonic() - t:.1f}s)")
    t = time.monotonic()
    for node in spec.all_nodes:
        if need(f"slurmd:{node}"):
            pid_files[f"slurmd:{node}"].unlink(missing_ok=True)
            try:
                daemons.start_slurmd(spec, node)
            except ClusterError as exc:
                raise daemons.failure(spec, f"slurmd:{node}", str(exc).splitlines()[0]) from exc

    def not_ready() -> str:
        try:
            states = node_states(spec)
        except SlurmError as exc:
            return str(exc)
        dead = [n for n in spec.all_nodes if daemons.running(spec)[f"slurmd:{n}"] is None]
        msg = f"node states: {states}"
        if dead:
            log = daemons.log_for(spec, "slurmd:" + dead[0])
            msg += f"\nslurmd not running for {dead}; last lines of {log}:\n{tail(log)}"
        return msg

    def ready() -> bool:
        if _all_nodes_ready(spec):
            return True
        for node in spec.all_nodes:  # fail at once when a slurmd died after starting
            daemons.alive(spec, f"slurmd:{node}")
        return False

    try:
        wait_until("all nodes to register (idle)", ready, timeout=STEP_TIMEOUT, interval=0.2, on_timeout=not_ready)
    except DeadlineExceeded as exc:
        raise ClusterError(f"slurmd: {exc}") from exc
    except ClusterError as exc:
        raise daemons.failure(spec, str(exc).split(" ", 1)[0], str(exc)) from exc
    _log(f"{len(spec.all_nodes)} slurmd up ({time.monotonic() - t:.1f}s)")
    try:
        _ensure_reservation(spec)
        wait_until(f"reservation {specmod.RESERVATION}", lambda: _reservation_exists(spec), timeout=STEP_TIMEOUT)
    except (SlurmError, DeadlineExceeded) as exc:
        raise daemons.failure(spec, "slurmctld", f"cannot create reservation {specmod.RESERVATION}: {exc}") from exc


def _info(spec: ClusterSpec, *, already: bool, installed: bool, t0: float) -> ClusterInfo:
    return ClusterInfo(
        state_dir=spec.state_dir, slurm_conf=spec.slurm_conf,
        train_nodes=tuple(spec.train_nodes), standby_nodes=tuple(spec.spare_nodes),
        partition=specmod.PARTITION, reservation=specmod.RESERVATION,
        addresses={n: spec.addr(n) for n in spec.all_nodes},
        already_running=already, installed_packages=installed, seconds=time.monotonic() - t0,
        slurm_version=spec.slurm_version or spec.slurm, slurm_root=Path(spec.root) if spec.root else None,
        spank_plugin=plugin.built_plugin(spec),
    )


# --- stopping ----------------------------------------------------------------------

def _cancel_jobs(spec: ClusterSpec) -> None:
    try:
        ids = daemons.slurm(spec, "squeue", "-h", "-o", "%i").stdout.split()
        if ids:
            daemons.slurm(spec, "scancel", *ids, check=False)
            wait_until("jobs to end", lambda: not daemons.slurm(spec, "squeue", "-h", "-t", "R,CG", "-o", "%i").stdout.split(),
                       timeout=20)
    except (SlurmError, DeadlineExceeded) as exc:
        _log(f"could not cancel all jobs cleanly ({str(exc).splitlines()[0]}); stopping daemons anyway")


def down(state_dir=None, slurm: Optional[str] = None) -> dict:
    """Stop every daemon this state directory started (pid files, checked against
    /proc so that no unrelated process is signalled). Idempotent. Returns
    {daemon: pid} of what it stopped."""
    state_dir = resolve_dir(state_dir, slurm)
    spec = _load_spec(state_dir)
    if spec is None:
        return {}
    with _locked(state_dir):
        return _stop(spec)


def _ports_taken(spec: ClusterSpec, running: dict[str, Optional[int]]) -> list[int]:
    """Ports of `spec`'s stopped daemons that another process listens on now (a cluster
    started while these were down may have taken them)."""
    ports = {"slurmctld": spec.ports.slurmctld, "slurmdbd": spec.ports.slurmdbd, "mariadbd": spec.ports.mariadb,
             **{f"slurmd:{n}": spec.slurmd_port(n) for n in spec.all_nodes}}
    return [ports[name] for name, pid in running.items() if pid is None and name in ports
            and not _port_free(ports[name])]


def _stop(spec: ClusterSpec) -> dict:
    """down() with the state directory's lock held."""
    marker = str(spec.state_dir)
    running = daemons.running(spec)
    stopped: dict[str, int] = {}
    reader = state_reader.stop(spec)
    if reader:
        stopped["node-reader"] = reader
    if running.get("slurmctld") and daemons.ctld_up(spec):
        _cancel_jobs(spec)
    progs = {n: p for n, p, _ in daemons.table(spec)}
    slurmds = [(n, pid) for n, pid in running.items() if n.startswith("slurmd:") and pid]
    terminate([p for _, p in slurmds], "slurmd", marker, root=spec.root)
    stopped.update(dict(slurmds))
    # slurmd processes not in a pid file (a crashed start) and leftover step daemons
    for prog in ("slurmd", "slurmstepd"):
        extra = find_pids(prog, marker, spec.root)
        if extra:
            terminate(extra, prog, marker, root=spec.root)
            stopped.update({f"{prog}:{p}": p for p in extra})
    for name in ("slurmctld", "slurmdbd", "mariadbd", "munged"):
        pid = running.get(name)
        if pid:
            terminate([pid], progs[name], marker, timeout=30, root=spec.root)
            stopped[name] = pid
        # and any of ours that no pid file names (a start that failed half way, a pid file
        # overwritten by a later start)
        extra = find_pids(name, marker, spec.root)
        if extra:
            terminate(extra, name, marker, timeout=30, root=spec.root)
            stopped.update({f"{name}:{p}": p for p in extra})
    for name, _, pid_file in daemons.table(spec):
        if pid_file.exists() and running_pid(pid_file, progs[name], marker, spec.root) is None:
            pid_file.unlink(missing_ok=True)
    return stopped


# --- inspecting ----------------------------------------------------------------------

def status(state_dir=None, slurm: Optional[str] = None) -> dict:
    """{'state_dir', 'slurm_conf', 'slurm', 'running', 'daemons': {name: {'pid', 'up'}},
    'nodes': {node: sinfo state}, 'reservation': name or None, ...}."""
    state_dir = resolve_dir(state_dir, slurm)
    spec = _load_spec(state_dir)
    if spec is None:
        return {"state_dir": str(state_dir), "configured": False, "running": False, "daemons": {}, "nodes": {},
                "reservation": None}
    running = daemons.running(spec)
    ctld = running["slurmctld"] is not None and daemons.ctld_up(spec)
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
        "slurm": spec.describe_slurm(),
        "slurm_version": spec.slurm_version or spec.slurm,
        "slurm_root": spec.root or None,
        "running": all(v is not None for v in running.values()) and ctld,
        "daemons": {k: {"pid": v, "up": v is not None} for k, v in running.items()},
        "node_reader": {"wanted": spec.node_reader, "pid": state_reader.running(spec)},
        "nodes": nodes,
        "reservation": resv,
        "train_nodes": spec.train_nodes,
        "standby_nodes": spec.spare_nodes,
        "addresses": {n: spec.addr(n) for n in spec.all_nodes},
    }


def env_lines(state_dir=None, slurm: Optional[str] = None) -> str:
    """Shell lines for `eval "$(trainmover cluster env)"`: SLURM_CONF, and PATH when the
    cluster's Slurm client commands are not on it (for a root filesystem: its wrappers)."""
    state_dir = resolve_dir(state_dir, slurm)
    spec = _load_spec(state_dir)
    conf = spec.slurm_conf if spec else state_dir / "etc" / "slurm.conf"
    lines = [f"export SLURM_CONF={shlex.quote(str(conf))}",
             f"export TM_CLUSTER_DIR={shlex.quote(str(state_dir))}"]
    if spec and spec.root:
        lines.append(f'export PATH={shlex.quote(str(spec.bin))}:"$PATH"  # {spec.describe_slurm()}')
        return "\n".join(lines) + "\n"
    sinfo = install.which("sinfo")
    path_dirs = os.environ.get("PATH", "").split(os.pathsep)
    if sinfo and os.path.dirname(sinfo) not in path_dirs:
        lines.append(f'export PATH={shlex.quote(os.path.dirname(sinfo))}:"$PATH"')
    return "\n".join(lines) + "\n"
