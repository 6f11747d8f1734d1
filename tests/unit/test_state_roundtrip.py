"""Every field of the policy's durable state survives a journal round trip (controller/durable/state.py,
controller/durable/codec.py, controller/durable/journal.py). The sample state is generated from the fields'
types, every field set to a value other than its default, so a field added to the state later
is covered without editing this test; a field of a type the journal cannot keep fails here."""
from __future__ import annotations

import dataclasses
import enum
import typing

import pytest

from trainmover.controller.durable import codec, journal
from trainmover.controller.durable.journal import Journal
from trainmover.controller.durable.state import PolicyState
from trainmover.controller.durable.view import JobView, StandbyState

KEY = b"k" * 32  # the job's key: the journal and the outcome are sealed with it

START = {"kind": "start", "job_id": 7, "world_size": 3, "ranks_per_node": 1, "batch_host": "train1",
         "rank_node": {"0": "train1", "1": "train2", "2": "train3"}}


def sample(tp, default=dataclasses.MISSING, seed=1):
    """A value of type `tp` other than `default` (and other than the type's empty value)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        (inner,) = [a for a in args if a is not type(None)]
        return sample(inner, default, seed)
    if dataclasses.is_dataclass(tp):
        types = codec.field_types(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        values = {n: sample(t, _default(fields[n]), seed + i) for i, (n, t) in enumerate(types.items())}
        obj = tp(**{n: v for n, v in values.items() if fields[n].init})
        for n, v in values.items():
            setattr(obj, n, v)
        return obj
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        members = [m for m in tp if m != default]
        return members[seed % len(members)]
    if origin is list:
        return [sample(args[0], seed=seed), sample(args[0], seed=seed + 1)]
    if origin in (set, frozenset):
        return origin({sample(args[0], seed=seed), sample(args[0], seed=seed + 1)})
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return (sample(args[0], seed=seed), sample(args[0], seed=seed + 1))
        return tuple(sample(a, seed=seed + i) for i, a in enumerate(args))
    if origin is dict:
        return {sample(args[0], seed=seed): sample(args[1], seed=seed)}
    if tp is dict:
        return {"k": [seed, "v", {"n": None}]}
    if tp is list:
        return [seed, "v"]
    if tp is bool:
        return not default if isinstance(default, bool) else True
    if tp is int:
        return 1000 + seed if default != 1000 + seed else 2000 + seed
    if tp is float:
        return 0.5 + seed
    if tp is str:
        return f"s{seed}"
    raise TypeError(f"no sample for {tp}: teach sample() the new type (and codec.decode)")


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def full_state() -> PolicyState:
    state = sample(PolicyState)
    for f in codec.durable_fields(PolicyState):  # the generator did its job: nothing left at its default
        assert getattr(state, f.name) != _default(f), f.name
    for m in state.migrations:
        assert m.times and m.leaver_ranks and m.source, "nested dataclasses are filled too"
    return state


def through_the_journal(tmp_path, state: PolicyState) -> PolicyState:
    """`state` written as the executor writes it (start, then the state's diff from what the
    start record implies), read back by the successor's replay."""
    path = tmp_path / "journal.jsonl"
    w = Journal(path, key=KEY)
    w.write(1.0, [START])
    seed = journal.read(path, KEY).encoded
    w.write(2.0, journal.diff(seed, codec.encode(state)))
    w.close()
    return journal.read(path, KEY).durable()


def test_every_durable_field_survives_a_journal_round_trip(tmp_path):
    state = full_state()
    back = through_the_journal(tmp_path, state)
    assert back == state
    for f in codec.durable_fields(PolicyState):  # field by field, for a message that names it
        assert getattr(back, f.name) == getattr(state, f.name), f.name


def test_a_second_diff_on_top_of_the_first_lands_too(tmp_path):
    """The executor writes a diff after each decision: one that drops and changes entries."""
    path = tmp_path / "journal.jsonl"
    w = Journal(path, key=KEY)
    w.write(1.0, [START])
    first = full_state()
    w.write(2.0, journal.diff(journal.read(path, KEY).encoded, codec.encode(first)))
    second = full_state()
    second.view.standbys.clear()
    second.migrations[1].note = "changed"
    second.migrations.append(dataclasses.replace(second.migrations[0], id=3))
    second.epoch += 1
    w.write(3.0, journal.diff(codec.encode(first), codec.encode(second)))
    w.close()
    assert journal.read(path, KEY).durable() == second


@pytest.mark.parametrize("name", [f.name for f in codec.durable_fields(PolicyState)])
def test_the_comparison_catches_a_field_the_journal_would_lose(tmp_path, name):
    """Negative control: a journal that left one field out (as the hand-written list before
    did with whatever a mixin added) reads back a state that is not equal."""
    state = full_state()
    tree = codec.encode(state)
    del tree[name]
    lost = codec.decode(PolicyState, tree) if name != "view" else None
    if lost is None:  # the view has no default: losing it is an error, which is caught too
        with pytest.raises(codec.DecodeError):
            codec.decode(PolicyState, tree)
        return
    assert lost != state


def test_a_nested_field_lost_is_caught_too():
    state = full_state()
    tree = codec.encode(state)
    del tree["migrations"][0]["note"]
    assert codec.decode(PolicyState, tree) != state
    tree = codec.encode(state)
    next(iter(tree["view"]["standbys"].values()))["state"] = "starting" if \
        next(iter(state.view.standbys.values())).state != "starting" else "ready"
    assert codec.decode(PolicyState, tree) != state


def test_a_transient_field_is_left_out_and_says_why():
    """What is not journaled is declared so, with its reason; it is not compared."""
    for cls in (PolicyState, JobView, *{type(m) for m in full_state().migrations},
                *{type(s) for s in full_state().view.standbys.values()}):
        for f in dataclasses.fields(cls):
            if f.compare is False:
                assert f.metadata.get("transient"), f"{cls.__name__}.{f.name}: not compared but not marked transient"
            if f.metadata.get("transient"):
                assert f.name not in codec.encode(sample(cls)), f"{cls.__name__}.{f.name} is journaled"


def test_a_snapshot_is_equal_exactly_when_the_encoding_is_and_later_changes_do_not_reach_it():
    """The executor compares snapshots after every decision and encodes only when they differ:
    the comparison must see every change the encoding would, and only those."""
    state = full_state()
    snap = codec.snapshot(state)
    assert snap == state and snap is not state and codec.encode(snap) == codec.encode(state)
    changes = [lambda s: s.view.rank_node.update({0: "elsewhere"}), lambda s: s.view.released.append("x"),
               lambda s: setattr(next(iter(s.view.standbys.values())), "state", next(
                   x for x in StandbyState if x != next(iter(s.view.standbys.values())).state)),
               lambda s: s.migrations[0].times.update(done=9.0), lambda s: setattr(s.migrations[1], "note", "n"),
               lambda s: s.migrations[0].source.update(deep={"k": 1}), lambda s: s.fenced_pids.add(("n", 1)),
               lambda s: s.evicted[0].update(t=99.0), lambda s: s.standbys_lost.append({}),
               lambda s: setattr(s, "holder_seq", s.holder_seq + 1)]
    for change in changes:
        live = codec.snapshot(state)  # a live state of its own, changed after the snapshot
        before = codec.snapshot(live)
        change(live)
        assert before != live and codec.encode(before) != codec.encode(live)
        assert journal.diff(before, codec.snapshot(live)) and not journal.diff(before, codec.snapshot(before))
    live = codec.snapshot(state)
    before = codec.snapshot(live)
    next(iter(live.view.standbys.values())).warm.add(3)  # transient: neither compared nor journaled
    live.migrations[0].prepared.add((0, "stayer"))
    assert before == live and journal.diff(before, codec.snapshot(live)) == []


def test_a_type_the_journal_cannot_keep_is_an_error_when_writing():
    @dataclasses.dataclass
    class Odd:
        when: object = dataclasses.field(default_factory=lambda: 1j)

    with pytest.raises(TypeError, match="complex cannot be journaled"):
        codec.encode(Odd())


def test_the_start_record_implies_the_state_a_new_policy_starts_from(tmp_path):
    """The executor's first diff is against the policy's state before any decision; replay
    starts from the start record: the two must be the same, or a field set at construction
    would never be journaled."""
    from trainmover.config import Config
    from trainmover.controller.policy.core import Policy
    view = JobView(7, 3, 1, "train1", {0: "train1", 1: "train2", 2: "train3"})
    for cfg in (Config(), Config(standbys=3, straggler="evict", snapshot_every=7)):
        path = tmp_path / f"j{cfg.standbys}.jsonl"
        w = Journal(path, key=KEY)
        w.write(1.0, [START])
        w.close()
        fresh = Policy(cfg, JobView(**{f.name: getattr(view, f.name) for f in dataclasses.fields(view)}))
        assert journal.read(path, KEY).encoded == codec.encode(fresh.durable())
