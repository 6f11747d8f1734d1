"""What journaling the policy's whole durable state costs per decision (controller/durable/state.py,
controller/durable/codec.py): the executor encodes the state and diffs it against the last after every
message it handles (controller/executor.py `_journal_decisions`), so this runs at the message rate.

Most decisions change nothing durable (a step report): then the cost is a typed snapshot and
its comparison with the last (`unchanged`); a decision that changes it also encodes both and
diffs them (`changed`). Compared, on the same machine in the same run, with the hand-picked dict
it replaced (main's `Resuming.durable()` before issue 26, re-stated here as `hand_list`).

    python bench/cpu_journal_state.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import results_io  # noqa: E402
from trainmover.controller.durable import codec, journal  # noqa: E402
from trainmover.controller.durable.migration import Migration  # noqa: E402
from trainmover.controller.durable.state import PolicyState  # noqa: E402
from trainmover.controller.durable.view import JobView, Standby  # noqa: E402


def state(ranks: int, migrations: int, per_node: int = 8) -> PolicyState:
    view = JobView(7, ranks, per_node, "n0", {r: f"n{r // per_node}" for r in range(ranks)},
                   {f"s{i}": Standby(f"s{i}") for i in range(4)})
    st = PolicyState(view)
    for i in range(migrations):
        m = Migration(i + 1, f"n{i % (ranks // per_node)}", tuple(range(per_node)), "drain", 1.0)
        m.times.update(preparing=2.0, switching=3.0, releasing=4.0, done=5.0)
        st.migrations.append(m)
    return st


def hand_list(st: PolicyState) -> dict:
    """The durable view main journaled before (controller/policy/takeover.py `durable`, to_record)."""
    v = st.view
    return {"rank_node": dict(v.rank_node), "standbys": {n: s.state for n, s in v.standbys.items()},
            "released": list(v.released), "epoch": st.epoch, "fenced": sorted([n, p] for n, p in st.fenced_pids),
            "evicted": [dict(e) for e in st.evicted],
            "migrations": {m.id: {"id": m.id, "leaver": m.leaver, "leaver_ranks": list(m.leaver_ranks),
                                  "trigger": m.trigger, "requested_at": m.requested_at, "epoch": m.epoch,
                                  "joiner": m.joiner, "phase": m.phase.value, "times": dict(m.times),
                                  "switch_step": m.switch_step, "downtime_s": m.downtime_s,
                                  "leaver_exited": m.leaver_exited, "note": m.note, "recovery": m.recovery,
                                  "source": dict(m.source)} for m in st.migrations}}


def per_call_us(fn, number: int, repeat: int) -> float:
    return round(min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--number", type=int, default=200)
    args = ap.parse_args()
    metrics = {}
    for ranks, migrations in ((64, 5), (64, 50), (1024, 5), (1024, 50)):
        st = state(ranks, migrations)
        snap, encoded, old = codec.snapshot(st), codec.encode(st), hand_list(st)
        unchanged_us = per_call_us(lambda: journal.diff(snap, codec.snapshot(st)), args.number, args.repeat)
        changed_us = per_call_us(lambda: journal.diff(encoded, codec.encode(st)) + [codec.encode(st)],
                                 args.number, args.repeat)  # a change: both sides encoded, then diffed
        old_us = per_call_us(lambda: old == hand_list(st), args.number, args.repeat)
        metrics[f"r{ranks}_m{migrations}"] = {"unchanged_snapshot_compare_us": unchanged_us,
                                              "changed_encode_diff_us": changed_us, "hand_list_compare_us": old_us}
    result = {
        "scenario": "journal-state-per-decision", "machine": "cpu-local",
        "gpus": "none", "cpu": platform.processor() or platform.machine(), "load": list(os.getloadavg()),
        **results_io.provenance(__file__),
        "settings": {"ranks_per_node": 8, "standbys": 4, "number": args.number, "repeat": args.repeat,
                     "note": "per decision: the executor encodes and diffs after every message it handles"},
        "metrics": metrics,
    }
    results_io.write(results_io.stamped("cpu-journal-state"), result)


if __name__ == "__main__":
    main()
