"""Where the job's controller is: `controller.json` on the job's shared run directory.

A controller can move (its node drained or lost: docs/admin.md, "No special node"): each one
that takes over binds its control socket and rendezvous store on its own node and writes this
file (temp + rename). A rank that lost its controller reads it on every reconnection attempt,
so it finds the successor wherever it is; the launch spec's address holds until the first move.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

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


def write(root: Path, ep: Endpoint, **extra) -> None:
    path = Path(root) / NAME
    tmp = path.with_name(f".{NAME}.tmp")
    tmp.write_text(json.dumps({**asdict(ep), **extra}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file


def read(path: str | Path) -> Endpoint | None:
    """The endpoint the file names, or None (missing, half-copied by a slow filesystem, or not
    ours): the caller keeps what it knew."""
    try:
        d = json.loads(Path(path).read_text())
        return Endpoint(str(d["host"]), int(d["port"]), str(d["store_host"]), int(d["store_port"]),
                        str(d.get("node", "")), int(d.get("attempt", 0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mtime(path: str | Path) -> int | None:
    """The file's modification time (ns), None when missing: cheap news that a successor wrote it."""
    try:
        return os.stat(path).st_mtime_ns if path else None
    except OSError:
        return None
