"""The boundary agreement of the scale harness's stub nodes (runtime/stub_node.py), over TCP.

A real rank votes after every step in a MIN all-reduce of 8 bytes over its CONTROL gloo group
(runtime/roles/boundary.py): every rank switches at the same step or none does, and a peer that
vanished fails the collective everywhere, so every rank stalls. The stub nodes load no torch,
so the process playing rank 0 serves the same agreement (`VoteRoot`) and every stub node's
process is a member (`VoteClient`), one vote per node per step (its ranks step together):

* a step is decided once every member voted for it: the MIN of the votes, sent to each member;
* a member whose connection closes without having left (a planned leaver leaves when the switch
  it voted for is decided) fails the step everywhere: every member gets FAILED and a new
  generation, votes of an older generation are answered FAILED (a member that had not voted
  yet stalls too), and the survivors vote on from the step the recovery plan names;
* a joiner observes the epoch it joins and learns the switch step when it is decided (a real
  joiner learns it from the leaver's `go` key in the rendezvous store), then is a member.

Plain JSON lines on the cluster's loopback addresses, unauthenticated: a harness's stand-in for
the group layer, which the controller never sees. Where the root is: `stub-vote.json` in the
run directory. The node playing rank 0 must stay (the harness never drains or kills it).
"""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

FAILED = -1
FILE = "stub-vote.json"
DECIDED_KEPT = 64  # decided steps answered again to a late vote (a member that joined mid-step)


def write_root(run_dir: Path, address: tuple[str, int]) -> None:
    tmp = run_dir / (FILE + ".tmp")
    tmp.write_text(json.dumps(list(address)))
    tmp.replace(run_dir / FILE)


def root_address(run_dir: Path, timeout_s: float) -> tuple[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            host, port = json.loads((run_dir / FILE).read_text())
            return host, int(port)
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no stub vote root in {run_dir} within {timeout_s:.0f}s") from None
            time.sleep(0.1)


def _send(sock: socket.socket, obj: dict) -> None:
    try:
        sock.sendall((json.dumps(obj) + "\n").encode())
    except OSError:
        pass  # a member gone: its reader finds out


class Tally:
    """The root's state, pure (no sockets): who votes, the votes of the open steps, what was
    decided. Every method returns [(member, reply)] to send."""

    def __init__(self, expected: int):
        self.expected = expected   # members before the first decision (the job's training nodes)
        self.started = False
        self.members: set = set()
        self.observers: dict = {}  # member -> epoch it joins at
        self.votes: dict[int, dict] = {}  # step -> member -> (epoch, leaving)
        self.decided: dict[int, int] = {}
        self.gen = 0

    def join(self, m) -> list:
        self.members.add(m)
        self.observers.pop(m, None)
        return [(m, {"op": "gen", "gen": self.gen})]

    def observe(self, m, epoch: int) -> list:
        self.observers[m] = epoch
        return []

    def vote(self, m, step: int, epoch: int, leaving: bool, gen: int) -> list:
        if gen != self.gen:
            return [(m, {"op": "failed", "gen": self.gen})]
        if step in self.decided:
            return [(m, {"op": "agreed", "step": step, "epoch": self.decided[step]})]
        self.votes.setdefault(step, {})[m] = (epoch, leaving)
        return self._decide()

    def gone(self, m) -> list:
        """A member's connection closed: a failure unless it was no member (it left)."""
        self.observers.pop(m, None)
        if m not in self.members:
            return []
        self.members.discard(m)
        self.gen += 1
        self.votes.clear()
        self.decided.clear()
        return [(x, {"op": "failed", "gen": self.gen}) for x in self.members]

    def _decide(self) -> list:
        if not self.started:
            if len(self.members) < self.expected:
                return []
            self.started = True
        out = []
        for step in sorted(self.votes):
            got = self.votes[step]
            if not self.members <= set(got):
                break
            del self.votes[step]
            agreed = min(e for e, _ in got.values())
            self.decided[step] = agreed
            for old in [s for s in self.decided if s <= step - DECIDED_KEPT]:
                del self.decided[old]
            out += [(x, {"op": "agreed", "step": step, "epoch": agreed}) for x in got]
            if agreed:
                self.members -= {x for x, (_, leaving) in got.items() if leaving}
                for x, e in list(self.observers.items()):
                    if e == agreed:
                        out.append((x, {"op": "agreed", "step": step, "epoch": agreed}))
                        out += self.join(x)
        return out


class VoteRoot:
    def __init__(self, host: str, expected: int):
        self.tally = Tally(expected)
        self.lock = threading.Lock()
        self.sock = socket.create_server((host, 0), backlog=1024)
        self.address = self.sock.getsockname()[:2]
        threading.Thread(target=self._accept, name="tm-vote-root", daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("r") as lines:
            for line in lines:
                msg = json.loads(line)
                with self.lock:
                    if msg["op"] == "member":
                        out = self.tally.join(conn)
                    elif msg["op"] == "observe":
                        out = self.tally.observe(conn, msg["epoch"])
                    else:
                        out = self.tally.vote(conn, msg["step"], msg["epoch"], msg["leaving"], msg["gen"])
                    for m, reply in out:
                        _send(m, reply)
        with self.lock:
            for m, reply in self.tally.gone(conn):
                _send(m, reply)


class VoteClient:
    def __init__(self, address: tuple[str, int]):
        self.sock = socket.create_connection(address, timeout=30)
        self.sock.settimeout(None)
        self.buf = b""  # own line buffer: a socket file cannot be read again after a timeout
        self.gen = 0

    def _read(self) -> dict:
        while b"\n" not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                raise SystemExit("the stub vote's root is gone")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def join_as_member(self) -> None:
        _send(self.sock, {"op": "member"})
        while (msg := self._read())["op"] != "gen":
            pass
        self.gen = msg["gen"]

    def agree(self, step: int, epoch: int, leaving: bool) -> int:
        """The MIN of every member's vote for `step`, or FAILED (a member vanished)."""
        _send(self.sock, {"op": "vote", "step": step, "epoch": epoch, "leaving": leaving, "gen": self.gen})
        while True:
            msg = self._read()
            if msg["op"] == "failed":
                if msg["gen"] > self.gen:  # an older failure's second word (broadcast and reply) is no news
                    self.gen = msg["gen"]
                    return FAILED
            elif msg["op"] == "agreed" and msg["step"] == step:
                return int(msg["epoch"])

    def await_switch(self, epoch: int, aborted: Callable[[], bool], poll_s: float = 0.005) -> int | None:
        """A joiner: the step at which `epoch` switched (it is then a member), or None on abort."""
        _send(self.sock, {"op": "observe", "epoch": epoch})
        self.sock.settimeout(poll_s)
        try:
            while True:
                try:
                    msg = self._read()
                except (TimeoutError, socket.timeout):
                    if aborted():
                        return None
                    continue
                if msg["op"] == "agreed" and msg["epoch"] == epoch:
                    while (g := self._read())["op"] != "gen":
                        pass
                    self.gen = g["gen"]
                    return int(msg["step"])
        finally:
            self.sock.settimeout(None)
