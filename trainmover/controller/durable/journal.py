"""The controller's journal: its decisions, durable before they are acted upon.

`runs/<job id>/journal.jsonl` on the job's shared directory (where a restarted controller,
on whichever node, finds it). Append-only JSON lines, one fsync per decision, each record
versioned and checked on replay:

    {"v": 1, "seq": 7, "t": 1732.5, "kind": "migration", "m": {...}}

kinds:
  start      the job's initial layout (world size, ranks per node, batch host, rank -> node)
  launch     a Slurm step the controller started (node, role, ranks, pid of its srun)
  state      what changed of the policy's durable state (controller/durable/state.py) since the last
             record: operations on its encoding (controller/durable/codec.py), ["set", path, value] and
             ["drop", path]. Every field of that state is kept, by construction
  restart    a controller took over (attempt number): its *claim*. Every record carries its
             writer's attempt (`a`); once a claim is in the journal, records of a lower attempt
             after it are a demoted controller's and are ignored on replay (see `Journal`)
  end        the controller ended the job on purpose (ok, message): written first at its shutdown,
             so that no keeper or supervisor starts a controller again (`ended`)

Version 1 journals (written before the state record existed: `view` and `migration` records
with a hand-picked part of the state) are still read: their records are turned into state
operations (`_v1_ops`), so that a job started by an older controller can be taken over.

Every record is sealed with the job's key (`files.seal`, purpose "journal": a `mac` field):
`read` and `ended` refuse a record that is not, so a journal another user wrote (or changed) is
never replayed nor believed to say the job ended (docs/security.md). `fold` without a key (the
standby-pool history's statistics) does not check.

Replay folds the records into a `Replayed` value (pure), the durable state included. A torn last line (the controller
died inside a write) is dropped with a warning; any other bad line is a `JournalError`:
a journal that lies in its middle must not be guessed around.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from trainmover.controller.durable import codec
from trainmover.controller.durable.state import PolicyState
from trainmover.controller.durable.view import JobView
from trainmover.errors import ProtocolError, TrainMoverError
from trainmover.protocol import files

log = logging.getLogger("trainmover.journal")

VERSION = 2
PURPOSE = "journal"  # the seal's label (protocol/files.py)
READS = {1, 2}  # version 1: see _v1_ops
KINDS = {1: {"start", "launch", "view", "migration", "restart", "end"},
         2: {"start", "launch", "state", "restart", "end"}}
_REQUIRED = {
    "start": {"job_id": int, "world_size": int, "ranks_per_node": int, "batch_host": str, "rank_node": dict},
    "launch": {"node": str, "role": str, "ranks": list, "pid": int},
    "state": {"ops": list},
    "view": {},
    "migration": {"m": dict},
    "restart": {"attempt": int},
    "end": {"message": str},
}
_MIGRATION_FIELDS = {"id": int, "leaver": str, "leaver_ranks": list, "trigger": str, "requested_at": (int, float),
                     "epoch": int, "joiner": str, "phase": str, "times": dict}


class JournalError(TrainMoverError):
    pass


@dataclass
class Replayed:
    """What the journal last recorded: the job's layout, the policy's durable state, its steps."""
    job_id: int = 0
    world_size: int = 0
    ranks_per_node: int = 0
    batch_host: str = ""
    encoded: dict = field(default_factory=dict)  # the policy's durable state, encoded (controller/durable/codec.py)
    steps: dict[str, dict] = field(default_factory=dict)       # node -> last launch record
    restarts: int = 0
    ended: dict | None = None  # {"ok", "message"} once a controller ended the job on purpose
    records: int = 0
    seq: int = 0              # the last record's sequence number
    torn_tail: bool = False
    stale: int = 0            # records a demoted controller wrote after a successor's claim (ignored)

    def durable(self) -> PolicyState:
        """The policy's durable state as recorded (a fresh value on each call)."""
        try:
            return codec.decode(PolicyState, self.encoded)
        except codec.DecodeError as exc:
            raise JournalError(f"the journal's state does not decode: {exc}") from None

    @property
    def rank_node(self) -> dict[int, str]:
        return self.durable().view.rank_node


def _check(n: int, rec: object) -> dict:
    where = f"journal line {n}"
    if not isinstance(rec, dict):
        raise JournalError(f"{where}: not a JSON object")
    v = rec.get("v")
    if v not in READS:
        raise JournalError(f"{where}: version {v!r}, this controller reads versions {sorted(READS)}")
    kind = rec.get("kind")
    if kind not in KINDS[v]:
        raise JournalError(f"{where}: unknown kind {kind!r}")
    for name, typ in _REQUIRED[kind].items():
        if not isinstance(rec.get(name), typ) or isinstance(rec.get(name), bool):
            raise JournalError(f"{where} ({kind}): field {name!r} missing or not {typ.__name__}")
    if kind == "end" and not isinstance(rec.get("ok"), bool):
        raise JournalError(f"{where} (end): field 'ok' missing or not bool")
    if kind == "migration":
        for name, typ in _MIGRATION_FIELDS.items():
            if not isinstance(rec["m"].get(name), typ):
                raise JournalError(f"{where} (migration): field {name!r} missing or malformed")
    return rec


def fold(lines: list[str], on_record=None, key: bytes | None = None) -> Replayed:
    """What `lines` (the journal's text split at newlines) record. Pure. `on_record(rec, state)`,
    if given, sees each record applied and the encoded state after it (standbys/history.py).
    `key`: every record must be sealed with it (a JournalError otherwise)."""
    out = Replayed()
    complete = lines[:-1] if lines and not lines[-1].endswith("\n") else lines
    if len(complete) < len(lines):
        out.torn_tail = True  # the writer died inside its last write: that decision was never acted on
    claim = 0  # the highest attempt that has claimed the journal so far
    for n, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if key is not None:
                rec = files.unseal(key, PURPOSE, rec)
            rec = _check(n, rec)
        except ProtocolError as exc:
            raise JournalError(f"journal line {n}: {exc}: refusing to replay or believe it") from None
        except ValueError as exc:
            raise JournalError(f"journal line {n} is corrupt ({exc}); it is not the last line, so it is not "
                               "a write cut short by a crash: refusing to guess the job's state") from None
        if rec["kind"] == "restart":
            claim = max(claim, rec["attempt"])
        elif int(rec.get("a", claim)) < claim:  # written after a successor's claim: never acted on
            out.stale += 1
            continue
        out.records += 1
        out.seq = int(rec.get("seq", out.seq))
        kind = rec["kind"]
        if kind == "start":
            out.job_id, out.world_size, out.ranks_per_node = rec["job_id"], rec["world_size"], rec["ranks_per_node"]
            out.batch_host = rec["batch_host"]
            view = JobView(out.job_id, out.world_size, out.ranks_per_node, out.batch_host,
                           {int(r): node for r, node in rec["rank_node"].items()})
            out.encoded = codec.encode(PolicyState.initial(view))  # what the policy starts from (state.py)
        elif kind == "launch":
            out.steps[rec["node"]] = rec
        elif kind in ("state", "view", "migration"):
            ops = rec["ops"] if kind == "state" else _v1_ops(rec)
            try:
                out.encoded = codec.patch(out.encoded, ops)
            except codec.DecodeError as exc:
                raise JournalError(f"journal line {n} ({kind}): {exc}") from None
        elif kind == "restart":
            out.restarts = rec["attempt"]
        elif kind == "end":
            out.ended = {"ok": rec["ok"], "message": rec["message"]}
        if on_record is not None:
            on_record(rec, out.encoded)
    if out.records and not out.world_size:
        raise JournalError("journal has no start record: it was not written by a TrainMover controller")
    if out.records:
        out.durable()  # a state that does not decode is an error here, not after a takeover began
    return out


def _v1_ops(rec: dict) -> list[list]:
    """A version 1 `view` or `migration` record as state operations (what it recorded, where
    the state keeps it)."""
    if rec["kind"] == "migration":
        return [["set", ["migrations", int(rec["m"]["id"]) - 1], rec["m"]]]
    ops = [["set", ["view", "rank_node", str(r)], node] for r, node in rec.get("ranks", {}).items()]
    if "standbys" in rec:
        ops.append(["set", ["view", "standbys"], {n: {"node": n, "state": st} for n, st in rec["standbys"].items()}])
    for old, new in (("released", ["view", "released"]), ("epoch", ["epoch"]), ("fenced", ["fenced_pids"]),
                     ("evicted", ["evicted"])):
        if old in rec:
            ops.append(["set", new, rec[old]])
    return ops


def _text(path: Path) -> str:
    """The journal's text, never through a link or a FIFO (protocol/files.py)."""
    return files.read_limited(path, files.RUN_FILE_MAX).decode()


def read(path: Path, key: bytes) -> Replayed:
    """The journal at `path` (in a held run directory: files.held_dir), every record sealed with `key`."""
    try:
        text = _text(path)
    except FileNotFoundError:
        raise JournalError(f"no journal at {path}: nothing to resume") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise JournalError(f"cannot read the journal at {path}: {exc}") from None
    out = fold(text.splitlines(keepends=True), key=key)
    if out.torn_tail:
        log.warning("journal %s ends in a torn line (a write cut short): ignored", path)
    return out


def ended(path: Path, key: bytes | None) -> dict | None:
    """{"ok", "message"} if a controller ended the job on purpose (its sealed `end` record), else
    None, also where there is no journal (yet), no key (yet) or it cannot be read or is not
    sealed with `key`: then nothing says it ended. For the keeper and the supervisor, which must
    never start a controller after that."""
    if key is None:
        return None
    try:
        return fold(_text(path).splitlines(keepends=True), key=key).ended
    except (OSError, UnicodeDecodeError, TrainMoverError):
        return None


def diff(before: object, after: object) -> list[dict]:
    """Records (without v/seq/t) that turn durable state `before` into `after`: one `state`
    record, or none if nothing changed. Each is a snapshot (Policy.durable, codec.snapshot) or
    its encoding; snapshots are compared first, and encoded only when they differ (most
    decisions change nothing durable: a step report). Pure."""
    if type(before) is type(after) and not isinstance(after, dict) and before == after:
        return []
    ops = codec.diff(before if isinstance(before, dict) else codec.encode(before),
                     after if isinstance(after, dict) else codec.encode(after))
    return [{"kind": "state", "ops": ops}] if ops else []


class Superseded(TrainMoverError):
    """Another controller claimed the journal: this one must stop acting at once."""


class Journal:
    """The writer: append, flush and fsync per decision (a batch of records).

    The journal is also the controllers' lease. Only one controller acts at a time: each writes
    its decisions before acting on them, and a successor's first write is its claim (`claim`).
    A writer knows where the file ends (only it appends while it holds the lease); after each
    append it reads back where its bytes landed. If anything else was appended first (a
    successor's claim), its bytes are not there: it is demoted and raises `Superseded` before
    acting (and replay ignores what it wrote after the claim, `fold`). `held()` is the cheap
    check (one fstat) made before acting on anything not journaled. O_APPEND writes of one
    line are atomic on a local file system and on NFS with one client per file; the read-back
    does not depend on it."""

    def __init__(self, path: Path, *, key: bytes, seq: int = 0, attempt: int = 0):
        self.path = Path(path)
        self.key, self.seq, self.attempt = key, seq, attempt
        files.trim_torn_tail(self.path)  # the next record starts on a line of its own
        # 0600, never through a link (docs/security.md)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self.end = os.fstat(self.fd).st_size

    def held(self) -> bool:
        """Whether nobody else appended since our last write (a successor's claim would have)."""
        return os.fstat(self.fd).st_size == self.end

    def claim(self, now: float) -> None:
        """A successor's first act: its `restart` record, appended whatever the file's end (the
        demoted controller's next write then finds it, `write`)."""
        self.end = os.fstat(self.fd).st_size
        self.write(now, [{"kind": "restart", "attempt": self.attempt}], claiming=True)

    def write(self, now: float, records: list[dict], claiming: bool = False) -> None:
        if not records:
            return
        if not claiming and not self.held():
            raise Superseded(f"{self.path}: another controller claimed the journal")
        lines = []
        for r in records:
            self.seq += 1
            rec = files.seal(self.key, PURPOSE, {"v": VERSION, "seq": self.seq, "t": round(now, 6),
                                                 "a": self.attempt, **r})
            lines.append(json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n")
        data = "".join(lines).encode()
        os.write(self.fd, data)
        os.fsync(self.fd)
        if claiming:
            self.end = os.fstat(self.fd).st_size
            return
        # did our bytes land right after our last write? A fresh open (NFS revalidates on open), no link
        rfd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            landed = os.pread(rfd, len(data), self.end) == data
        finally:
            os.close(rfd)
        if not landed:
            raise Superseded(f"{self.path}: another controller claimed the journal before this write")
        self.end += len(data)

    def close(self) -> None:
        os.close(self.fd)
