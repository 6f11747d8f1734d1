"""Silent faults of a whole node of the embedded cluster, for tests, benchmarks and demos.

Every node of the embedded cluster is a process tree on this machine: its slurmd and what that
starts (slurmstepd, the job's processes). Two faults a real cluster sees:

* `partition(info, node)`: all traffic to and from the node is dropped, nothing is closed. Its
  processes are put into a net_cls cgroup of their own, and nftables drops every packet those
  processes send (`meta cgroup`) and every packet sent to the node's address: the node is cut
  off as by a dead link, while its processes run on. Undone when the context ends.
* `kill_node(info, node)`: its slurmd and every process on it SIGKILLed at once (power loss).

Needs root, the net_cls cgroup controller and nftables (installed from Debian's packages when
missing). The product never uses this module.
"""
from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Iterator

from trainmover.cluster import install
from trainmover.cluster.procs import ClusterError, read_pid, run_cmd

NET_CLS_ROOT = Path("/run/trainmover-net_cls")
CLASSID_BASE = 0x00100000  # major 0x10: ours; the minor is the node's index + 1


def node_pids(info, node: str) -> list[int]:
    """Every process of the node: its slurmd and all that share its UTS namespace (each slurmd
    of the embedded cluster runs in one of its own, with the node's hostname; slurmstepd and the
    job's processes inherit it, though slurmstepd is not slurmd's child once it daemonizes)."""
    root = read_pid(Path(info.state_dir) / "run" / f"slurmd-{node}.pid")
    if root is None:
        raise ClusterError(f"no slurmd of {node} is running")
    try:
        uts = os.readlink(f"/proc/{root}/ns/uts")
    except OSError as exc:
        raise ClusterError(f"cannot read the namespace of {node}'s slurmd ({root}): {exc}") from exc
    if uts == os.readlink("/proc/self/ns/uts"):
        raise ClusterError(f"{node}'s slurmd shares the machine's UTS namespace: its processes cannot be told apart")
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/uts") == uts:
                    out.append(int(entry))
            except OSError:
                continue
    return out


def kill_node(info, node: str) -> list[int]:
    """SIGKILL the node's slurmd and every process on it, as a power loss would. `cluster.up`
    starts its slurmd again."""
    pids = node_pids(info, node)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _net_cls() -> Path:
    if not (NET_CLS_ROOT / "cgroup.procs").exists():
        NET_CLS_ROOT.mkdir(parents=True, exist_ok=True)
        run_cmd(["mount", "-t", "cgroup", "-o", "net_cls", "net_cls", str(NET_CLS_ROOT)], timeout=10,
                what="mount the net_cls cgroup controller")
    return NET_CLS_ROOT


def _nft(*args: str) -> None:
    run_cmd([install.ensure_program("nft", "nftables"), *args], timeout=10, what="nft " + " ".join(args[:3]))


def _move(pids: list[int], cgroup: Path) -> None:
    for pid in pids:
        try:
            (cgroup / "cgroup.procs").write_text(str(pid))
        except ProcessLookupError:
            pass
        except OSError as exc:
            if exc.errno != 3:  # ESRCH: it ended meanwhile
                raise


@contextlib.contextmanager
def partition(info, node: str) -> Iterator[list[int]]:
    """Drop every packet from and to `node` while the context lasts (module docstring).
    Yields the pids cut off. Processes the node starts meanwhile are cut off too (they
    inherit the cgroup)."""
    if os.geteuid() != 0:
        raise ClusterError("a partition needs root (cgroups and nftables)")
    root = _net_cls()
    index = list(info.addresses).index(node)
    classid = CLASSID_BASE + index + 1
    group = root / f"tm-partition-{node}"
    table = f"tm_partition_{node}"
    group.mkdir(exist_ok=True)
    (group / "net_cls.classid").write_text(str(classid))
    pids = node_pids(info, node)
    try:
        _nft("add", "table", "inet", table)
        _nft("add", "chain", "inet", table, "out", "{ type filter hook output priority 0 ; }")
        _nft("add", "rule", "inet", table, "out", "meta", "cgroup", str(classid), "drop")
        _nft("add", "rule", "inet", table, "out", "ip", "daddr", info.addresses[node], "drop")
        _move(pids, group)  # net_cls re-tags the sockets they already hold
        yield pids
    finally:
        with contextlib.suppress(ClusterError):
            _nft("delete", "table", "inet", table)
        _move([int(p) for p in (group / "cgroup.procs").read_text().split()], root)
        with contextlib.suppress(OSError):
            group.rmdir()
