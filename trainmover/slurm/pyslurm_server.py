"""The process that makes pyslurm's calls for PySlurm (slurm/pyslurm_backend.py).

Why a process of its own: pyslurm 25.11.2 makes its RPCs without releasing the GIL (its
Cython has no `nogil` around slurm_load_node, slurm_load_job, slurm_update_*), so in the
controller every call would stop every Python thread for the RPC's length, heartbeats
included; a slurmctld slow to answer (MessageTimeout, 10 s by default) would have the
controller judged lost. Here a call blocks only this process; the controller waits on a pipe
with a deadline and kills and restarts this process when it is exceeded.

Protocol: one JSON object per line. On start it prints {"ready": true} or {"error": "..."}
and exits 1. Then for each request {"op": ..., args} one reply {"ok": result} or
{"error": "..."}. Its parent is its only peer (stdin/stdout pipes): nothing else can reach
it. NodeInfo and JobInfo travel as their fields.
"""
from __future__ import annotations

import dataclasses
import json
import sys

from trainmover.errors import SlurmError
from trainmover.slurm import parse
from trainmover.slurm.model import JobInfo, NodeInfo


def node_info(n) -> NodeInfo:
    return NodeInfo(name=n.name, addr=n.address or n.name, state=(n.state or "UNKNOWN").upper(),
                    reason=n.reason or "", features=tuple(n.active_features or ()))


def job_info(j) -> JobInfo:
    nodelist = j.allocated_nodes or ""
    return JobInfo(job_id=int(j.id), state=j.state or "UNKNOWN", nodes=tuple(parse.expand_hostlist(nodelist)),
                   batch_host=j.batch_host or "", restart_count=int(j.requeue_count or 0),
                   work_dir=j.working_directory or "", partition=j.partition or "", num_nodes=int(j.num_nodes or 0),
                   nodelist=nodelist, name=j.name or "", reason=_none(j.state_reason))


def _none(reason) -> str:
    """pyslurm says "None" where squeue says nothing (no reason)."""
    return "" if reason in (None, "None") else str(reason)


def load(slurm_conf: str):
    """The pyslurm module, its libslurm initialised with `slurm_conf` ('' : $SLURM_CONF or
    Slurm's default). SlurmError when pyslurm is missing or cannot load its library."""
    import os
    # pyslurm's import calls slurm_init() with the environment's SLURM_CONF; ours is passed.
    os.environ.setdefault("PYSLURM_DISABLE_AUTO_INIT", "1")
    try:
        import pyslurm
    except ImportError as exc:
        raise SlurmError(f"the pyslurm backend needs pyslurm built against this Slurm (`make pyslurm`, "
                         f"docs/admin.md): {exc}") from None
    conf = slurm_conf or os.environ.get("SLURM_CONF") or ""
    if conf and not os.path.isfile(conf):  # libslurm would exit the process (fatal()) on it
        raise SlurmError(f"pyslurm: slurm.conf {conf} does not exist")
    pyslurm.slurm_init(conf or None)
    return pyslurm


class Calls:
    """The requests, each one pyslurm call (or libslurm's hostlist, no RPC)."""

    def __init__(self, ps):
        self.ps = ps

    def nodes(self) -> list[dict]:
        return [dataclasses.asdict(node_info(n)) for n in self.ps.Nodes.load().values()]

    def job(self, job_id: int) -> dict:
        return dataclasses.asdict(job_info(self.ps.Job.load(int(job_id))))

    def hostnames(self, expr: str) -> list[str]:
        from pyslurm.utils.helpers import nodelist_from_range_str
        return list(nodelist_from_range_str(expr) or [])

    def reservation(self, name: str) -> str:
        return self.ps.Reservation.load(name).nodes or ""

    def drain(self, node: str, reason: str) -> None:
        self.ps.Node(node).modify(self.ps.Node(state="DRAIN", reason=reason))

    def resume(self, node: str) -> None:
        self.ps.Node(node).modify(self.ps.Node(state="RESUME"))

    def set_nodes(self, job_id: int, keep: list[str]) -> None:
        """The job's required nodes set to `keep` (what `scontrol update NodeList=` sends)."""
        self.ps.Job(int(job_id)).modify(self.ps.JobSubmitDescription(required_nodes=list(keep)))


def serve(calls: Calls, rx, tx) -> None:
    ops = {"nodes", "job", "hostnames", "reservation", "drain", "resume", "set_nodes"}
    for line in rx:
        try:
            req = json.loads(line)
            op = req.pop("op")
            if op not in ops:
                raise ValueError(f"unknown request {op!r}")
            reply = {"ok": getattr(calls, op)(**req)}
        except calls.ps.RPCError as exc:
            reply = {"error": str(exc) or type(exc).__name__}
        except Exception as exc:  # a bad request or an unexpected pyslurm error: said, the process goes on
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        tx.write(json.dumps(reply) + "\n")
        tx.flush()


def main(argv: list[str]) -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the pipe (a stray print would break the protocol)
    try:
        ps = load(argv[0] if argv else "")
    except SlurmError as exc:
        out.write(json.dumps({"error": str(exc)}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    serve(Calls(ps), sys.stdin, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
