"""Control messages between the controller, workers, standby agents and the CLI.

Every message is a JSON object with a `type`; `validate` checks it against the schema
below and rejects anything else, so a malformed or unexpected message is an error with a
clear text, never a half-understood command.
"""
from __future__ import annotations

from typing import Any, TypeAlias

from trainmover.errors import ProtocolError

Message: TypeAlias = dict[str, Any]  # a validated message: its `type` and the fields SCHEMA gives it
FieldType: TypeAlias = "type | tuple[type, ...]"

_INT, _FLOAT, _STR, _LIST, _DICT, _BOOL = int, (int, float), str, list, dict, bool

# type -> {field: expected python type(s)}; every field is required, extra fields are refused.
SCHEMA: dict[str, dict[str, FieldType]] = {
    # worker / agent -> controller
    "hello": {"role": _STR, "node": _STR, "ranks": _LIST, "pid": _INT},
    # one per standby process (`local`: its index on the node); the node is ready once all are
    "ready": {"node": _STR, "local": _INT, "warmup_s": _FLOAT, "shadow_steps": _INT, "detail": _DICT},
    "recorded": {"rank": _INT, "iterations": _INT, "bytes": _INT, "overhead_s": _FLOAT, "step_s": _LIST,
                 "version": _INT, "detail": _DICT},
    "warming": {"node": _STR, "version": _INT, "rank": _INT},  # a ready standby re-warms on a newer recording of that rank
    "step": {"rank": _INT, "step": _INT, "loss": _FLOAT, "step_s": _FLOAT, "compute_s": _FLOAT, "t": _FLOAT},
    # the cases of `foresee` `tag` whose groups this process built (`role` worker: rank `rank`;
    # standby: its process `local`, `rank` unused)
    "foreseen": {"tag": _STR, "role": _STR, "rank": _INT, "local": _INT, "cases": _LIST, "detail": _DICT},
    "prepared": {"epoch": _INT, "rank": _INT, "groups": _LIST, "seconds": _FLOAT, "detail": _DICT},
    "prepare_failed": {"epoch": _INT, "rank": _INT, "error": _STR},
    "switched": {"epoch": _INT, "rank": _INT, "role": _STR, "step": _INT, "t": _FLOAT, "detail": _DICT},
    "finished": {"rank": _INT, "step": _INT, "digest": _STR, "loss": _FLOAT},
    # a process ends on an error: `user` when the workload's own code raised it (`phase`: the
    # call, e.g. train_step, build), which ends the job (a user error is not a lost node);
    # `step`: steps complete when it raised; `traceback`: bounded (runtime/usercode.py)
    "failed": {"rank": _INT, "phase": _STR, "error": _STR, "step": _INT, "user": _BOOL, "traceback": _STR},
    # a rank whose collective failed (or was revoked) stopped at a step boundary: `step` steps
    # are complete in its state, whose digest it sends; it waits for a `recover`. `holds`: what
    # the tiers can use (controller/policy/tiers.py): `replicas` (its replica group's ranks), `own`
    # (snapshot steps of itself), `held` (rank -> snapshot steps it holds of that rank)
    "stalled": {"rank": _INT, "step": _INT, "digest": _STR, "error": _STR, "role": _STR, "holds": _DICT},
    # a one-node job's standby holds these complete, verified snapshot steps of `rank` (runtime/holding.py)
    "snapshot_held": {"node": _STR, "rank": _INT, "steps": _LIST, "detail": _DICT},
    # a rank's snapshot of `step` is complete (copy times, bytes, where it went): runtime/protection.py
    "snapshot_taken": {"rank": _INT, "step": _INT, "detail": _DICT},
    # a rank's checkpoint file of `step` is in place (runtime/checkpoint.py)
    "checkpointed": {"rank": _INT, "step": _INT, "digest": _STR, "bytes": _INT, "seconds": _FLOAT},
    # after reconnecting to a restarted controller (right after `hello`): where this process is.
    # `step` steps complete; `pending` the epoch it holds prepared or preparing (0: none);
    # `switched` the epoch of its last switch (0: none); `state` training, stalled, finished, left
    # (worker) or starting, ready, warming, joining (standby)
    "resync": {"node": _STR, "ranks": _LIST, "role": _STR, "step": _INT, "pending": _INT, "switched": _INT,
               "state": _STR},
    # every TM_HEARTBEAT_S from a thread of its own (runtime/heartbeat.py), so that a frozen or
    # cut-off process is found by its silence, and a stuck one by what it and its peers report:
    # `step` steps complete; `issued` collectives issued per group since the group's last swap;
    # `waiting` the age in seconds of the oldest collective in flight per group (gloo only);
    # `cpu_s` the CPU time of the training thread (a rank computing is slow, not dead)
    "beat": {"ranks": _LIST, "step": _INT, "issued": _DICT, "waiting": _DICT, "cpu_s": _FLOAT},
    # the job's keeper (controller/succession/keeper.py) -> controller: after its hello, the steps it runs
    # (node -> role); then each step's end
    "steps": {"running": _DICT},
    "step_exit": {"node": _STR, "role": _STR, "code": _INT},
    # controller -> keeper: run one step (`argv` of its srun, its environment, its log file)
    "launch": {"node": _STR, "role": _STR, "argv": _LIST, "env": _DICT, "log": _STR},
    # controller -> keeper: its last word before it exits MOVED (its node leaves): promote now
    "moving": {"reason": _STR},
    # controller -> keeper: it lives (every 0.25 s, from a thread of its own)
    "alive": {},
    # controller -> worker / agent
    # a one-node job's snapshots of `wards` (its ranks) go to standby `holder` ("": to nobody),
    # over links built under the store prefix `prefix` (controller/policy/holder.py)
    "hold": {"holder": _STR, "wards": _LIST, "prefix": _STR},
    "prepare": {"epoch": _INT, "leavers": _LIST, "joiner_node": _STR, "assign": _DICT, "options": _DICT},
    "abort": {"epoch": _INT, "reason": _STR},
    # this process was judged dead and replaced: it must exit at once, writing nothing
    "fenced": {"reason": _STR},
    # the controller ends on purpose: do not wait for it to come back
    "bye": {"reason": _STR},
    # unexpected failure: fail every collective of groups holding `failed` ranks, now
    "revoke": {"epoch": _INT, "failed": _LIST, "reason": _STR},
    # the way back: new groups without `failed`, every rank resumes at `step`. `tier` says from
    # where: replica (state of `step` from `source` to `needers`: the standby taking each failed
    # rank, and ranks that had not completed `step`), snapshot (every rank rolls back to its own
    # snapshot of `step`; `holders`: failed rank -> the rank sending it its copy, or JOINER when
    # the standby taking it holds the copy itself) or checkpoint
    # (every rank loads its file of `step`)
    "recover": {"epoch": _INT, "failed": _LIST, "step": _INT, "source": _INT, "needers": _LIST, "assign": _DICT,
                "tier": _STR, "holders": _DICT, "foreseen": _STR},
    # (`foreseen`: the tag of groups built ahead for this very loss, by every member, to be taken
    # instead of new ones: controller/policy/foresight.py; "": none)
    # while a standby is ready: build ahead the groups each case's loss would need, the standby
    # taking the case's ranks (its local i the i-th); `sources`: per case, the rank whose transfer
    # pair to the standby is built too (a replica's likely source); empty `cases`: drop them all
    "foresee": {"tag": _STR, "standby": _STR, "cases": _LIST, "sources": _LIST},
    # to the standby chosen to take `failed` ranks (`assign`: its local index -> rank, as the
    # `recover` to come will say), before the plan: it binds itself and builds its groups now
    "anticipate": {"epoch": _INT, "failed": _LIST, "assign": _DICT},
    # CLI -> controller, and replies
    "migrate": {"node": _STR},
    "status": {},
    "reply": {"ok": _BOOL, "message": _STR, "data": _DICT},
}

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


def _tname(typ: FieldType) -> str:
    if isinstance(typ, tuple):
        return "/".join(t.__name__ for t in typ)
    return typ.__name__
