"""Where the job's controller is: `controller.json` on the job's shared run directory.

A controller can move (its node drained or lost: docs/admin.md, "No special node"): each one
that takes over binds its control socket and rendezvous store on its own node and writes this
file (temp + rename). A rank that lost its controller reads it on every reconnection attempt,
so it finds the successor wherever it is; the launch spec's address holds until the first move.

The file is sealed with the job's key (protocol/files.py): a process that moves its channel and
rendezvous store by what it says must know the job's controller wrote it.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from trainmover.protocol import files
from trainmover.errors import ProtocolError

log = logging.getLogger(__name__)

NAME = "controller.json"


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    store_host: str
    store_port: int
    node: str = ""
    attempt: int = 0

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def store(self) -> tuple[str, int]:
        return self.store_host, self.store_port


_PURPOSE = "trainmover controller endpoint"


def write(root: Path, ep: Endpoint, key: bytes, **extra: object) -> None:
    record = files.seal(key, _PURPOSE, {**asdict(ep), **extra})
    files.write_atomic(Path(root) / NAME, json.dumps(record, indent=1, sort_keys=True) + "\n")


def read(path: str | Path, key: bytes) -> Endpoint | None:
    """The endpoint the file names, or None (missing, half-copied by a slow filesystem, or not
    sealed with the job's `key`): the caller keeps what it knew."""
    try:
        d = files.unseal(key, _PURPOSE, json.loads(files.read_limited(Path(path), 64 << 10)))
        return Endpoint(str(d["host"]), int(d["port"]), str(d["store_host"]), int(d["store_port"]),
                        str(d.get("node", "")), int(d.get("attempt", 0)))
    except ProtocolError as exc:
        log.warning("%s ignored: %s", path, exc)
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mtime(path: str | Path) -> int | None:
    """The file's modification time (ns), None when missing: cheap news that a successor wrote it."""
    try:
        return os.stat(path).st_mtime_ns if path else None
    except OSError:
        return None
