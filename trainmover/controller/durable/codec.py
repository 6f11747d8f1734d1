"""Typed JSON for the controller's durable state (controller/durable/state.py): a dataclass to JSON
values and back, driven by its fields' types, so that every field is journaled without a
hand-written list of what to keep. Also the diff of two encoded states and its replay.

A field that must not survive a controller takeover is declared with `transient(why, ...)`:
left out of the encoding and out of `==` (the journal round-trip test compares with it), its
reason beside it. Types understood: None, bool, int, float, str, Enum, dataclasses, X | None,
list[X], tuple[X, ...], set[X], dict[K, V] (K: str, int or a str Enum), and bare `dict`/`list`
(JSON values, copied as they are). Anything else is a TypeError when encoding: a field of a
type the journal cannot keep is found by the first test that writes it, not after a takeover.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import json
import types
import typing

T = typing.TypeVar("T")


class DecodeError(ValueError):
    """An encoded state that does not fit its type (names the field's path)."""


def transient(why: str, **kw) -> typing.Any:
    """A dataclass field the journal does not keep; `why` says why it need not survive a takeover."""
    assert why, "say why the field need not survive a controller takeover"
    return dataclasses.field(compare=False, metadata={"transient": why}, **kw)


def durable_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "transient" not in f.metadata]


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def field_types(cls: type) -> dict[str, object]:
    """The durable fields of dataclass `cls` and their (resolved) types."""
    h = _hints(cls)
    return {f.name: h[f.name] for f in durable_fields(cls)}


def _key(k: object) -> str:
    if isinstance(k, enum.Enum):
        return str(k.value)
    if isinstance(k, (str, int)) and not isinstance(k, bool):
        return str(k)
    raise TypeError(f"a JSON object key must be str, int or an Enum, not {type(k).__name__}")


_PLAIN = frozenset({str, int, float, bool, type(None)})


def encode(value: object) -> object:
    """JSON values for `value`, a dataclass (its durable fields, by their declared types) or a
    JSON value. This runs after every decision (the executor diffs the state), so each type's
    encoder is built once from its fields' types, and copies what it can in C (a rank -> node
    map of 1,000 ranks is one dict(zip(...)), not 1,000 calls)."""
    if type(value) in _PLAIN:
        return value
    enc = _encoder(type(value))
    return value if enc is None else enc(value)


def _copy_json(value: object) -> object:
    """A deep copy of a JSON value (bare `dict`/`list` fields: their contents are not typed)."""
    t = type(value)
    if t in _PLAIN:
        return value
    if t is dict:
        return {_key(k): _copy_json(v) for k, v in value.items()}
    if t is list or t is tuple:
        return [_copy_json(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{t.__name__} cannot be journaled")


_INT_TEXT: list[str] = [str(i) for i in range(1024)]  # str(i), grown on demand: ranks are dict keys


def _int_keys(d: dict) -> list[str]:
    """The int keys of `d` as text. str(int) a thousand times per decision is most of encoding
    a large job's rank -> node map; a table of them is a C-level lookup."""
    if not d:
        return []
    lo, hi = min(d), max(d)
    if lo < 0 or hi > 1 << 20:
        return [str(k) for k in d]
    if hi >= len(_INT_TEXT):
        _INT_TEXT.extend(str(i) for i in range(len(_INT_TEXT), hi + 1))
    return list(map(_INT_TEXT.__getitem__, d))


def _deep(value: object) -> object:
    """A deep copy of a JSON-like value (dicts, lists, tuples of plain values)."""
    t = type(value)
    if t is dict:
        return {k: _deep(v) for k, v in value.items()}
    if t is list:
        return [_deep(v) for v in value]
    if t is tuple:
        return tuple(_deep(v) for v in value)
    return value


def snapshot(value: T) -> T:
    """A copy of dataclass `value` that later changes to it do not reach: its durable fields
    copied by their declared types (a dict of plain values: one dict() call), its transient
    ones shared (they are not compared). Equal to another snapshot exactly when their
    encodings are equal, and far cheaper to make and compare than an encoding: the executor
    takes one after every message (journal.diff encodes only when they differ)."""
    c = _copier(type(value))
    return value if c is None else c(value)


@functools.cache
def _copier(tp: object):
    """The copier of declared type `tp`: a function, or None where a value is immutable."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _PLAIN or (isinstance(tp, type) and issubclass(tp, enum.Enum)):
        return None
    if tp in (dict, list, object, typing.Any):
        return _deep
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        c = _copier(inner)
        return None if c is None else (lambda v: None if v is None else c(v))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        copies = tuple((n, c) for n, t in field_types(tp).items() if (c := _copier(t)) is not None)

        def copy_dataclass(value):
            new = object.__new__(type(value))
            new.__dict__.update(value.__dict__)
            for n, c in copies:
                new.__dict__[n] = c(value.__dict__[n])
            return new
        return copy_dataclass
    if origin is tuple:
        cs = [_copier(a) for a in (args[:1] if args[-1:] == (Ellipsis,) else args)]
        if all(c is None for c in cs):
            return None
        return lambda v: tuple(_deep(x) for x in v)
    if origin in (set, frozenset):
        return origin  # members are hashable: immutable
    if origin is list:
        c = _copier(args[0])
        return list if c is None else (lambda v: [c(x) for x in v])
    if origin is dict:
        c = _copier(args[1])
        return dict if c is None else (lambda d: {k: c(v) for k, v in d.items()})
    raise TypeError(f"type {tp} cannot be journaled")


def _key_encoder(kt: object):
    if kt is str:
        return None
    if kt is int:
        return _int_keys
    if isinstance(kt, type) and issubclass(kt, enum.Enum):
        return lambda d: [str(k.value) for k in d]
    raise TypeError(f"a durable dict key must be str, int or an Enum, not {kt}")


@functools.cache
def _encoder(tp: object):
    """The encoder of declared type `tp`: a function, or None where the value is its own encoding."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _PLAIN:
        return None
    if tp in (dict, list, object, typing.Any):
        return _copy_json
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"only X | None unions can be journaled, not {tp}")
        e = _encoder(inner[0])
        return None if e is None else (lambda v: None if v is None else e(v))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        fields = tuple((n, _encoder(t)) for n, t in field_types(tp).items())

        def enc_dataclass(value) -> dict:
            return {n: getattr(value, n) if e is None else e(getattr(value, n)) for n, e in fields}
        return enc_dataclass
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda v: v.value
    if origin in (list, tuple) and (origin is list or (len(args) == 2 and args[1] is Ellipsis)):
        e = _encoder(args[0])
        return list if e is None else (lambda v: [e(x) for x in v])
    if origin is tuple:
        es = [_encoder(a) for a in args]
        return lambda v: [x if e is None else e(x) for e, x in zip(es, v)]
    if origin in (set, frozenset):
        e = _encoder(args[0])  # sorted: the same set always encodes the same
        return lambda v: sorted((x if e is None else e(x) for x in v), key=lambda y: json.dumps(y, sort_keys=True))
    if origin is dict:
        ke, ve = _key_encoder(args[0]), _encoder(args[1])  # ke: all the keys at once, as text
        if ke is None and ve is None:
            return dict
        if ve is None:
            return lambda d: dict(zip(ke(d), d.values()))
        if ke is None:
            return lambda d: {k: ve(v) for k, v in d.items()}
        return lambda d: dict(zip(ke(d), map(ve, d.values())))
    raise TypeError(f"type {tp} cannot be journaled")


def _expect(data: object, typ: type | tuple, where: str) -> None:
    if not isinstance(data, typ) or (isinstance(data, bool) and typ in (int, float, (int, float))):
        raise DecodeError(f"{where}: {data!r} is not {getattr(typ, '__name__', typ)}")


def decode(tp: object, data: object, where: str = "state") -> typing.Any:
    """The value of type `tp` that `encode` turned into `data`. A durable field missing from
    `data` takes its default (none: an error)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any or tp is object or tp in (dict, list):
        return copy.deepcopy(data)
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"{where}: only X | None unions can be journaled, not {tp}")
        return decode(inner[0], data, where)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        _expect(data, dict, where)
        values, init = {}, {f.name for f in dataclasses.fields(tp) if f.init}
        for name, ftp in field_types(tp).items():
            if name in data:
                values[name] = decode(ftp, data[name], f"{where}.{name}")
        try:
            obj = tp(**{k: v for k, v in values.items() if k in init})
        except TypeError as exc:
            raise DecodeError(f"{where}: {exc}") from None
        for k, v in values.items():  # again after __post_init__, which may derive some of them
            setattr(obj, k, v)
        return obj
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            raise DecodeError(f"{where}: {data!r} is not a {tp.__name__}") from None
    if origin is list:
        _expect(data, list, where)
        return [decode(args[0], x, f"{where}[{i}]") for i, x in enumerate(data)]
    if origin in (set, frozenset):
        _expect(data, list, where)
        return origin(decode(args[0], x, f"{where}[{i}]") for i, x in enumerate(data))
    if origin is tuple:
        _expect(data, list, where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], x, f"{where}[{i}]") for i, x in enumerate(data))
        if len(args) != len(data):
            raise DecodeError(f"{where}: {len(data)} items, not {len(args)}")
        return tuple(decode(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, data)))
    if origin is dict:
        _expect(data, dict, where)
        kt, vt = args
        return {_decode_key(kt, k, where): decode(vt, v, f"{where}[{k!r}]") for k, v in data.items()}
    if tp is float:
        _expect(data, (int, float), where)
        return float(data)
    if tp in (int, str, bool):
        _expect(data, tp, where)
        return data
    if tp is type(None) or tp is None:
        if data is not None:
            raise DecodeError(f"{where}: {data!r} is not None")
        return None
    raise TypeError(f"{where}: type {tp} cannot be journaled")


def _decode_key(kt: object, k: str, where: str) -> object:
    if kt is int:
        try:
            return int(k)
        except ValueError:
            raise DecodeError(f"{where}: key {k!r} is not an int") from None
    return decode(kt, k, where)


def assign(target: object, source: object) -> None:
    """Set every durable field of dataclass `target` to `source`'s, in place: a nested
    dataclass is updated, not replaced (others may hold it), and transient fields are kept."""
    for f in durable_fields(type(target)):
        mine, theirs = getattr(target, f.name), getattr(source, f.name)
        if dataclasses.is_dataclass(mine) and type(mine) is type(theirs):
            assign(mine, theirs)
        else:
            setattr(target, f.name, theirs)


# --- the journal's state records: a diff of two encoded states, and its replay ----------------
def diff(before: object, after: object, path: tuple = ()) -> list[list]:
    """Operations that turn encoded state `before` into `after`: ["set", path, value] and
    ["drop", path] (a dict key). Dicts and lists are diffed entry by entry, so that a change of
    one migration writes that change, not the whole history. Pure."""
    if isinstance(before, dict) and isinstance(after, dict):
        ops: list[list] = [["drop", [*path, k]] for k in before if k not in after]
        for k, v in after.items():
            if k not in before:
                ops.append(["set", [*path, k], v])
            elif before[k] != v:
                ops += diff(before[k], v, (*path, k))
        return ops
    if isinstance(before, list) and isinstance(after, list) and len(after) >= len(before):
        ops = []
        for i, v in enumerate(after):
            if i >= len(before):
                ops.append(["set", [*path, i], v])
            elif before[i] != v:
                ops += diff(before[i], v, (*path, i))
        return ops
    return [] if before == after else [["set", list(path), after]]


def patch(tree: object, ops: list) -> object:
    """`tree` with `ops` (from `diff`) applied; raises DecodeError for an operation that does not
    fit it (a path that is not there). Changes `tree` in place where it can."""
    for op in ops:
        if not isinstance(op, list) or len(op) not in (2, 3) or op[0] not in ("set", "drop") \
                or not isinstance(op[1], list) or (op[0] == "set") != (len(op) == 3):
            raise DecodeError(f"malformed state operation {op!r}")
        kind, path = op[0], op[1]
        if not path:
            if kind == "drop":
                raise DecodeError("cannot drop the whole state")
            tree = copy.deepcopy(op[2])
            continue
        try:
            parent = tree
            for k in path[:-1]:
                parent = parent[k]
            last = path[-1]
            if kind == "drop":
                del parent[last]
            elif isinstance(parent, list):
                if not isinstance(last, int) or not 0 <= last <= len(parent):
                    raise IndexError(last)
                if last == len(parent):
                    parent.append(copy.deepcopy(op[2]))
                else:
                    parent[last] = copy.deepcopy(op[2])
            elif isinstance(parent, dict):
                parent[last] = copy.deepcopy(op[2])
            else:
                raise TypeError(type(parent).__name__)
        except (KeyError, IndexError, TypeError) as exc:
            raise DecodeError(f"state operation {kind} {path} does not apply ({type(exc).__name__}: {exc})") from None
    return tree
