"""SlurmClient through pyslurm (the Slurm C API in-process) where pyslurm has the call,
and through the command line (CliSlurm) where it has none.

pyslurm 25.11 needs Slurm 25.11's libslurmfull: `make pyslurm` builds it against the
25.11 root filesystem (docs/admin.md). The embedded cluster's jobs run inside that root,
so a controller there imports it; a process outside the root cannot load that library
(its C library is newer than the host's) and gets a SlurmError from `PySlurm()`.

| method                  | how                                                          |
|-------------------------|--------------------------------------------------------------|
| nodes                   | pyslurm `Nodes.load()`: node and partition RPCs, filtered here |
| job                     | pyslurm `Job.load(id)`                                       |
| hostnames               | pyslurm `nodelist_from_range_str` (libslurm's hostlist, no RPC) |
| reservation_nodes, free_standbys | pyslurm `Reservation.load(name)`, then nodes()      |
| drain, resume           | pyslurm `Node.modify(Node(state=..., reason=...))`           |
| shrink                  | pyslurm `Job.modify(JobSubmitDescription(required_nodes=...))` (what `scontrol update NodeList=` sends) |
| grow                    | CLI: `salloc` for the donor (pyslurm has no interactive allocation), then the job reads and updates above |
| jobs_on, kill_steps, cancel_donors | CLI: `squeue`, `scancel` (pyslurm's job list has no per-node filter in one RPC; signals to steps are rare) |
| step_argv, step_env     | CLI: `srun` command lines (a step is a process the caller starts) |

Deadlines: an in-process call is bounded by libslurm itself (slurm.conf's MessageTimeout,
10 s by default, per RPC); the CLI calls by `timeout` as in CliSlurm. libslurm keeps
global state (its configuration, errno), so calls are serialised by one lock and one
process uses one slurm.conf.
"""
from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from typing import Optional

from trainmover.errors import SlurmError
from trainmover.slurm import parse
from trainmover.slurm.client import CliSlurm
from trainmover.slurm.model import JobInfo, NodeInfo, UnknownNodes

__all__ = ["PySlurm", "load"]

_init_lock = threading.Lock()
_inited: Optional[str] = None  # the slurm.conf libslurm was initialised with


def load(slurm_conf: Optional[str]):
    """The pyslurm module, its libslurm initialised with `slurm_conf` (None: $SLURM_CONF or
    Slurm's default). SlurmError when pyslurm is missing or cannot load its library."""
    global _inited
    # pyslurm's import calls slurm_init() with the environment's SLURM_CONF; ours is passed.
    os.environ.setdefault("PYSLURM_DISABLE_AUTO_INIT", "1")
    flags = sys.getdlopenflags()  # pyslurm's import sets RTLD_DEEPBIND for every later extension
    try:
        import pyslurm
    except ImportError as exc:
        raise SlurmError(f"the pyslurm backend needs pyslurm built against this Slurm (`make pyslurm`, "
                         f"docs/admin.md): {exc}") from None
    finally:
        sys.setdlopenflags(flags)
    conf = slurm_conf or os.environ.get("SLURM_CONF") or ""
    if conf and not os.path.isfile(conf):  # libslurm would exit the process (fatal()) on it
        raise SlurmError(f"pyslurm: slurm.conf {conf} does not exist")
    with _init_lock:
        if _inited != conf:
            if _inited is not None:
                pyslurm.slurm_fini()
            pyslurm.slurm_init(conf or None)
            _inited = conf
    return pyslurm


class PySlurm(CliSlurm):
    """SlurmClient with pyslurm's in-process calls (see the module's table); the rest is
    CliSlurm's. Same arguments as CliSlurm."""

    def __init__(self, *, slurm_conf: Optional[str] = None, **kwargs):
        super().__init__(slurm_conf=slurm_conf, **kwargs)
        self._ps = load(slurm_conf)
        self._lock = threading.Lock()

    def _call(self, what: str, fn, *args):
        """One pyslurm call; its RPCError as a SlurmError naming what failed."""
        with self._lock:
            try:
                return fn(*args)
            except self._ps.RPCError as exc:
                raise SlurmError(f"pyslurm {what}: {exc}") from None

    # --- queries ------------------------------------------------------------------
    def nodes(self, names: Optional[Sequence[str]] = None) -> dict[str, NodeInfo]:
        names = list(names) if names is not None else None
        if names == []:
            return {}
        found = {n.name: _node(n) for n in self._call("load nodes", self._ps.Nodes.load).values()}
        if names is None:
            return found
        missing = [n for n in names if n not in found]
        if missing:
            raise UnknownNodes(f"Slurm does not know node(s) {missing}")
        return {n: found[n] for n in names}

    def job(self, job_id: int) -> JobInfo:
        return _job(self._call(f"load job {job_id}", self._ps.Job.load, int(job_id)))

    def hostnames(self, nodelist_expr: str) -> list[str]:
        if not nodelist_expr.strip():
            return []
        from pyslurm.utils.helpers import nodelist_from_range_str
        out = self._call(f"expand {nodelist_expr!r}", nodelist_from_range_str, nodelist_expr)
        if not out:
            raise SlurmError(f"invalid node list expression {nodelist_expr!r}")
        return list(out)

    def reservation_nodes(self, reservation: str) -> list[str]:
        res = self._call(f"load reservation {reservation}", self._ps.Reservation.load, reservation)
        return self.hostnames(res.nodes or "")

    # --- changes --------------------------------------------------------------------
    def drain(self, node: str, reason: str) -> None:
        self._call(f"drain {node}", self._ps.Node(node).modify, self._ps.Node(state="DRAIN", reason=reason))

    def resume(self, node: str) -> None:
        """As CliSlurm.resume: a node already in service is left as is."""
        try:
            self._call(f"resume {node}", self._ps.Node(node).modify, self._ps.Node(state="RESUME"))
            return
        except SlurmError as exc:
            err = exc
        info = self.nodes([node])[node]
        if "DRAIN" in info.flags or info.base_state == "DOWN":
            raise SlurmError(f"could not resume {node} ({info.state}): {err}")

    def _set_nodes(self, job_id: int, keep: list[str]) -> None:
        """In-process: the job's required nodes set to `keep` (CliSlurm.shrink checks around it)."""
        changes = self._ps.JobSubmitDescription(required_nodes=list(keep))
        self._call(f"shrink job {job_id} to {keep}", self._ps.Job(int(job_id)).modify, changes)


def _node(n) -> NodeInfo:
    return NodeInfo(name=n.name, addr=n.address or n.name, state=(n.state or "UNKNOWN").upper(),
                    reason=n.reason or "", features=tuple(n.active_features or ()))


def _job(j) -> JobInfo:
    nodelist = j.allocated_nodes or ""
    return JobInfo(job_id=int(j.id), state=j.state or "UNKNOWN", nodes=tuple(parse.expand_hostlist(nodelist)),
                   batch_host=j.batch_host or "", restart_count=int(j.requeue_count or 0),
                   work_dir=j.working_directory or "", partition=j.partition or "", num_nodes=int(j.num_nodes or 0),
                   nodelist=nodelist, name=j.name or "", reason=j.state_reason or "")

