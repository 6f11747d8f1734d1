"""Which 127.0.N.0/24 block an embedded cluster's nodes live in: one block per cluster, so
that clusters running at the same time on one machine never share a node address (every
node binds its own address, and netfault.partition() drops all traffic to one node's
address: with a shared block it would cut off every cluster's node at that address).

Claims are symbolic links /var/tmp/trainmover-nets/<N> -> the state directory holding
block N, made under a lock. A claim is stale, and taken over, when that directory's
cluster.json no longer says block N (the cluster was removed or took another block).
A cluster keeps its block across `down`/`up`; the first cluster on a machine gets
127.0.1.0/24, as before blocks were claimed. The registry is root's (rootdirs.own_dir: a
registry another user made first is refused), and a claim counts only for a cluster.json that
root wrote (rootdirs.read_own), never for one a user put where a removed cluster was.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from trainmover.cluster import rootdirs
from trainmover.cluster.procs import ClusterError, flocked

REGISTRY = Path("/var/tmp/trainmover-nets")
BLOCKS = range(1, 255)
LOCK_TIMEOUT_S = 30.0


def _locked(path: Path):
    return flocked(path, LOCK_TIMEOUT_S, "another cluster claims an address block", poll_s=0.1)


def _holds(state_dir: str, block: int) -> bool:
    """Whether the cluster in `state_dir` says it uses `block` (cluster.json's "net"; 1 when
    written before blocks were recorded)."""
    try:
        rootdirs.check_dir(state_dir)
        spec = json.loads(rootdirs.read_own(Path(state_dir) / "cluster.json"))
    except (OSError, ValueError, ClusterError):  # gone, unreadable, or not root's: no claim
        return False
    return isinstance(spec, dict) and spec.get("net", 1) == block


def claim(state_dir: Path, preferred: Optional[int] = None, registry: Path = REGISTRY) -> int:
    """The block for the cluster in `state_dir`: `preferred` (its block so far) when that is
    free or already its own, else the lowest free one. Raises ClusterError when all 254 are held."""
    rootdirs.own_dir(registry)
    me = str(Path(state_dir).absolute())
    order = ([preferred] if preferred in BLOCKS else []) + [n for n in BLOCKS if n != preferred]
    with _locked(registry / ".lock"):
        for n in order:
            link = registry / str(n)
            try:
                owner = os.readlink(link)
            except FileNotFoundError:
                owner = None
            if owner == me:
                return n
            if owner is None or not _holds(owner, n):
                tmp = registry / f".{n}.new"
                tmp.unlink(missing_ok=True)
                os.symlink(me, tmp)
                os.replace(tmp, link)
                return n
    raise ClusterError(f"every 127.0.N.0/24 block (N = 1..254) is held by a cluster (claims in {registry})")
