"""Control messages between the controller, workers, standby agents and the CLI.

Every message is a JSON object with a `type`; `validate` checks it against the schema
below and rejects anything else, so a malformed or unexpected message is an error with a
clear text, never a half-understood command.
"""
from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

from trainmover.errors import ProtocolError

Message: TypeAlias = dict[str, Any]  # a validated message: its `type` and the fields SCHEMA gives it
FieldType: TypeAlias = "type | tuple[type, ...]"

# The schema: one frozen dataclass per message type, named for its wire type (`TYPE`) with
# "Msg" after it; every field is required, extra fields are refused. `SCHEMA` (what `validate`
# checks a JSON object against) is derived from these classes, and `typed` turns a validated
# message into its class, so that the code that reads a message is checked by mypy.
# Annotations: int, float (an int is accepted), str, bool, list[...] and dict[...] (checked as
# list / dict here; the element checks are below, in `validate`). `dict[str, Any]`: a free-form
# part (detail, options) of JSON values.


class Msg:
    """A message of the protocol; each subclass is one wire type (`TYPE`)."""
    TYPE: ClassVar[str]

    def __init_subclass__(cls, kind: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.TYPE = kind
        TYPES[kind] = cls


TYPES: dict[str, type[Msg]] = {}


# worker / agent -> controller
@dataclass(frozen=True)
class HelloMsg(Msg, kind="hello"):
    role: str
    node: str
    ranks: list[int]
    pid: int


@dataclass(frozen=True)
class ReadyMsg(Msg, kind="ready"):
    """One per standby process (`local`: its index on the node); the node is ready once all are."""
    node: str
    local: int
    warmup_s: float
    shadow_steps: int
    detail: dict[str, Any]


@dataclass(frozen=True)
class RecordedMsg(Msg, kind="recorded"):
    rank: int
    iterations: int
    bytes: int
    overhead_s: float
    step_s: list[float]
    version: int
    detail: dict[str, Any]


@dataclass(frozen=True)
class WarmingMsg(Msg, kind="warming"):
    """A ready standby re-warms on a newer recording of `rank`."""
    node: str
    version: int
    rank: int


@dataclass(frozen=True)
class StepMsg(Msg, kind="step"):
    rank: int
    step: int
    loss: float
    step_s: float
    compute_s: float
    t: float


@dataclass(frozen=True)
class ForeseenMsg(Msg, kind="foreseen"):
    """The cases of `foresee` `tag` whose groups this process built (`role` worker: rank `rank`;
    standby: its process `local`, `rank` unused): controller/policy/foresight.py."""
    tag: str
    role: str
    rank: int
    local: int
    cases: list[list[int]]
    detail: dict[str, Any]


@dataclass(frozen=True)
class PreparedMsg(Msg, kind="prepared"):
    epoch: int
    rank: int
    groups: list[str]
    seconds: float
    detail: dict[str, Any]


@dataclass(frozen=True)
class PrepareFailedMsg(Msg, kind="prepare_failed"):
    epoch: int
    rank: int
    error: str


@dataclass(frozen=True)
class SwitchedMsg(Msg, kind="switched"):
    epoch: int
    rank: int
    role: str
    step: int
    t: float
    detail: dict[str, Any]


@dataclass(frozen=True)
class FinishedMsg(Msg, kind="finished"):
    rank: int
    step: int
    digest: str
    loss: float


@dataclass(frozen=True)
class FailedMsg(Msg, kind="failed"):
    """A process ends on an error: `user` when the workload's own code raised it (`phase`: the
    call, e.g. train_step, build), which ends the job (a user error is not a lost node);
    `step`: steps complete when it raised; `traceback`: bounded (runtime/usercode.py)."""
    rank: int
    phase: str
    error: str
    step: int
    user: bool
    traceback: str


@dataclass(frozen=True)
class StalledMsg(Msg, kind="stalled"):
    """A rank whose collective failed (or was revoked) stopped at a step boundary: `step` steps
    are complete in its state, whose digest it sends; it waits for a `recover`. `holds`: what
    the tiers can use (controller/policy/tiers.py): `replicas` (its replica group's ranks), `own`
    (snapshot steps of itself), `held` (rank -> snapshot steps it holds of that rank)."""
    rank: int
    step: int
    digest: str
    error: str
    role: str
    holds: dict[str, Any]


@dataclass(frozen=True)
class SnapshotHeldMsg(Msg, kind="snapshot_held"):
    """A one-node job's standby holds these complete, verified snapshot steps of `rank` (runtime/protection/holding.py)."""
    node: str
    rank: int
    steps: list[int]
    detail: dict[str, Any]


@dataclass(frozen=True)
class SnapshotTakenMsg(Msg, kind="snapshot_taken"):
    """A rank's snapshot of `step` is complete (copy times, bytes, where it went): runtime/protection/role.py."""
    rank: int
    step: int
    detail: dict[str, Any]


@dataclass(frozen=True)
class CheckpointedMsg(Msg, kind="checkpointed"):
    """A rank's checkpoint file of `step` is in place (runtime/protection/checkpoint.py)."""
    rank: int
    step: int
    digest: str
    bytes: int
    seconds: float


@dataclass(frozen=True)
class ResyncMsg(Msg, kind="resync"):
    """After reconnecting to a restarted controller (right after `hello`): where this process is.
    `step` steps complete; `pending` the epoch it holds prepared or preparing (0: none);
    `switched` the epoch of its last switch (0: none); `state` training, stalled, finished, left
    (worker) or starting, ready, warming, joining (standby)."""
    node: str
    ranks: list[int]
    role: str
    step: int
    pending: int
    switched: int
    state: str


@dataclass(frozen=True)
class BeatMsg(Msg, kind="beat"):
    """Every TM_HEARTBEAT_S from a thread of its own (runtime/heartbeat.py), so that a frozen or
    cut-off process is found by its silence, and a stuck one by what it and its peers report:
    `step` steps complete; `issued` collectives issued per group since the group's last swap;
    `waiting` the age in seconds of the oldest collective in flight per group (gloo only);
    `cpu_s` the CPU time of the training thread (a rank computing is slow, not dead)."""
    ranks: list[int]
    step: int
    issued: dict[str, int]
    waiting: dict[str, float]
    cpu_s: float


# the job's keeper (controller/succession/keeper.py) -> controller
@dataclass(frozen=True)
class StepsMsg(Msg, kind="steps"):
    """After its hello, the steps it runs (node -> role)."""
    running: dict[str, str]


@dataclass(frozen=True)
class StepExitMsg(Msg, kind="step_exit"):
    """A step of the keeper's ended."""
    node: str
    role: str
    code: int


# controller -> keeper
@dataclass(frozen=True)
class LaunchMsg(Msg, kind="launch"):
    """Run one step (`argv` of its srun, its environment, its log file)."""
    node: str
    role: str
    argv: list[str]
    env: dict[str, str]
    log: str


@dataclass(frozen=True)
class MovingMsg(Msg, kind="moving"):
    """The controller's last word before it exits MOVED (its node leaves): promote now."""
    reason: str


@dataclass(frozen=True)
class AliveMsg(Msg, kind="alive"):
    """The controller lives (every 0.25 s, from a thread of its own)."""


# controller -> worker / agent
@dataclass(frozen=True)
class HoldMsg(Msg, kind="hold"):
    """A one-node job's snapshots of `wards` (its ranks) go to standby `holder` ("": to nobody),
    over links built under the store prefix `prefix` (controller/policy/holder.py)."""
    holder: str
    wards: list[int]
    prefix: str


@dataclass(frozen=True)
class PrepareMsg(Msg, kind="prepare"):
    epoch: int
    leavers: list[int]
    joiner_node: str
    assign: dict[str, int]
    options: dict[str, Any]


@dataclass(frozen=True)
class AbortMsg(Msg, kind="abort"):
    epoch: int
    reason: str


@dataclass(frozen=True)
class FencedMsg(Msg, kind="fenced"):
    """This process was judged dead and replaced: it must exit at once, writing nothing."""
    reason: str


@dataclass(frozen=True)
class ByeMsg(Msg, kind="bye"):
    """The controller ends on purpose: do not wait for it to come back."""
    reason: str


@dataclass(frozen=True)
class RevokeMsg(Msg, kind="revoke"):
    """Unexpected failure: fail every collective of groups holding `failed` ranks, now."""
    epoch: int
    failed: list[int]
    reason: str


@dataclass(frozen=True)
class RecoverMsg(Msg, kind="recover"):
    """The way back: new groups without `failed`, every rank resumes at `step`. `tier` says from
    where: replica (state of `step` from `source` to `needers`: the standby taking each failed
    rank, and ranks that had not completed `step`), snapshot (every rank rolls back to its own
    snapshot of `step`; `holders`: failed rank -> the rank sending it its copy, or JOINER when
    the standby taking it holds the copy itself) or checkpoint (every rank loads its file of
    `step`)."""
    epoch: int
    failed: list[int]
    step: int
    source: int
    needers: list[int]
    assign: dict[str, int]
    tier: str
    holders: dict[str, int]
    foreseen: str  # the tag of the groups every member built ahead for this loss, to be taken ("": none)


@dataclass(frozen=True)
class ForeseeMsg(Msg, kind="foresee"):
    """While a standby is ready: build ahead the groups each case's loss would need, the standby
    taking the case's ranks (its local i the i-th); `sources`: per case, the rank whose transfer
    pair to the standby is built too (a replica's likely source); empty `cases`: drop them all
    (controller/policy/foresight.py, runtime/roles/foresight.py)."""
    tag: str
    standby: str
    cases: list[list[int]]
    sources: list[int]


@dataclass(frozen=True)
class AnticipateMsg(Msg, kind="anticipate"):
    """To the standby chosen to take `failed` ranks (`assign`: its local index -> rank, as the
    `recover` to come will say), before the plan: it binds itself and builds its groups now."""
    epoch: int
    failed: list[int]
    assign: dict[str, int]


# CLI -> controller, and replies
@dataclass(frozen=True)
class MigrateMsg(Msg, kind="migrate"):
    node: str


@dataclass(frozen=True)
class StatusMsg(Msg, kind="status"):
    pass


@dataclass(frozen=True)
class ReplyMsg(Msg, kind="reply"):
    ok: bool
    message: str
    data: dict[str, Any]


_INT, _FLOAT, _STR, _LIST, _DICT, _BOOL = int, (int, float), str, list, dict, bool
_WIRE: dict[object, FieldType] = {int: _INT, float: _FLOAT, str: _STR, bool: _BOOL, list: _LIST, dict: _DICT}


def _wire_types(cls: type) -> dict[str, FieldType]:
    hints = typing.get_type_hints(cls)
    return {f.name: _WIRE[typing.get_origin(hints[f.name]) or hints[f.name]] for f in dataclasses.fields(cls)}


# type -> {field: expected python type(s)}, what `validate` checks: derived from the classes above
SCHEMA: dict[str, dict[str, FieldType]] = {kind: _wire_types(cls) for kind, cls in TYPES.items()}


class MoveRole(enum.StrEnum):
    """A rank's part in a migration (planned or a recovery): the `role` of `switched` and
    `stalled`, a Phase 1's role. A StrEnum: equal to, and written as, its wire string."""
    STAYER = "stayer"
    LEAVER = "leaver"
    JOINER = "joiner"


MAX_RANKS_IN_MESSAGE = 1 << 16
JOINER = -1  # `recover.holders`: the lost rank's copy is held by the standby taking its slot (no transfer)


def validate(msg: object) -> Message:
    if not isinstance(msg, dict):
        raise ProtocolError(f"message must be a JSON object, got {type(msg).__name__}")
    kind = msg.get("type")
    if kind not in SCHEMA:
        raise ProtocolError(f"unknown message type {kind!r}")
    fields = SCHEMA[kind]
    extra = set(msg) - set(fields) - {"type"}
    if extra:
        raise ProtocolError(f"{kind}: unexpected fields {sorted(extra)}")
    for name, typ in fields.items():
        if name not in msg:
            raise ProtocolError(f"{kind}: missing field {name!r}")
        value = msg[name]
        if isinstance(value, bool) and typ is not _BOOL:
            raise ProtocolError(f"{kind}.{name}: expected {_tname(typ)}, got bool")
        if not isinstance(value, typ):
            raise ProtocolError(f"{kind}.{name}: expected {_tname(typ)}, got {type(value).__name__}")
        if isinstance(value, list) and len(value) > MAX_RANKS_IN_MESSAGE:
            raise ProtocolError(f"{kind}.{name}: list too long ({len(value)})")
    for name in ("rank", "epoch", "step", "pending", "switched"):
        if name in msg and msg[name] < 0:
            raise ProtocolError(f"{kind}.{name}: must be >= 0")
    if "ranks" in msg and not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in msg["ranks"]):
        raise ProtocolError(f"{kind}.ranks: must be non-negative integers")
    for name in ("leavers", "failed", "needers"):
        if name in msg and not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in msg[name]):
            raise ProtocolError(f"{kind}.{name}: must be non-negative integers")
    if kind == "launch" and not (all(isinstance(a, str) for a in msg["argv"]) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in msg["env"].items())):
        raise ProtocolError("launch: argv and env must hold strings only")
    if kind == "beat":
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in msg["issued"].values()):
            raise ProtocolError("beat.issued: counts must be non-negative integers")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in msg["waiting"].values()):
            raise ProtocolError("beat.waiting: ages must be non-negative numbers")
    return msg


def make(kind: str, **fields: Any) -> Message:
    return validate({"type": kind, **fields})


def typed(msg: Message) -> Msg:
    """A validated message as its class (e.g. `PrepareMsg`): fields read as attributes, checked
    by mypy where the reader names the class."""
    return TYPES[msg["type"]](**{k: v for k, v in msg.items() if k != "type"})


def wire(m: Msg) -> Message:
    """A message object as the JSON object that crosses the channel (validated). Its fields
    shallowly: `dataclasses.asdict` copies every nested value one by one, and a pure-DP rank's
    `stalled` report names 1,024 replicas: 1,016 such reports, a 128-node recovery's, took 6.9 s
    of CPU that way, 0.05 s this way. Messages are frozen and nothing edits what they hold."""
    fields = dataclasses.fields(m)  # type: ignore[arg-type]  # every Msg is a dataclass
    return validate({"type": m.TYPE, **{f.name: getattr(m, f.name) for f in fields}})


def _tname(typ: FieldType) -> str:
    if isinstance(typ, tuple):
        return "/".join(t.__name__ for t in typ)
    return typ.__name__
