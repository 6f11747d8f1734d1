"""Says so when a job's failure names a peer that is none of the job's nodes.

gloo admits into a pair whoever first sends the pair's sequence number (docs/security.md,
"Known limits"): another user on the nodes who takes a pair over makes a collective or a state
copy fail with gloo's "Connection closed by peer [<address>]:<port> ... typically caused by a
remote worker crashing", which reads like the workload's own error. A rank reports that error;
the controller, which knows every node's address, adds what it means before the job ends on it.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

# gloo names a pair's peer as [<address>]:<port> ("Connection closed by peer [a]:p", "Read error
# [a]:p: Connection reset by peer"); its source location is [<path>:<line>], which this never matches
PEER_RE = re.compile(r"\[((?:\d{1,3}\.){3}\d{1,3}|[0-9a-fA-F]*:[0-9a-fA-F:]*)\]:\d+")


def note(message: str, node_addresses: Iterable[str]) -> str:
    """`message`, with a note appended if a peer it names is none of `node_addresses`."""
    ours = set(node_addresses)
    foreign = sorted({m.group(1) for m in PEER_RE.finditer(message)} - ours)
    if not foreign:
        return message
    return (f"{message} [peer {', '.join(foreign)} is none of the job's nodes: a process outside the job "
            "connected to one of its gloo pairs (another user? docs/security.md, Known limits)]")
