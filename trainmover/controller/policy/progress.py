"""The ranks' progress as the controller hears it: step reports, metrics rows, finished ranks,
and the pause a migration caused (pure)."""
from __future__ import annotations

import statistics

from trainmover.controller.durable.migration import Migration
from trainmover.controller.durable.state import PolicyState
from trainmover.controller.policy.actions import Record
from trainmover.protocol.messages import StepMsg


class Progress:
    def __init__(self, state: PolicyState):
        self.state = state
        # Not journaled: the ranks report their steps again to a successor, which skips those
        # metrics.jsonl logged already (metrics_through, read from that file by the executor).
        self.steps: dict[int, list[tuple[int, float, float]]] = {}  # rank -> [(step, t, step_s)], the last 64
        self.rows: dict[int, dict[int, dict]] = {}              # step -> rank -> report, until complete
        self.finished: dict[int, dict] = {}                     # rank -> its 'finished' report
        self.metrics_through = 0     # last step in metrics.jsonl

    def record(self, node: str, msg: StepMsg) -> dict | None:
        """A rank's step report; the row of its step once every rank reported it."""
        rank, step = msg.rank, msg.step
        hist = self.steps.setdefault(rank, [])
        hist.append((step, msg.t, float(msg.step_s or 0.0)))
        del hist[:-64]
        row = self.rows.setdefault(step, {})
        row[rank] = {"loss": msg.loss, "step_s": msg.step_s, "node": node, "t": msg.t}
        if len(row) < self.state.view.world_size:
            return None
        return self.rows.pop(step)

    def typical_step_s(self) -> float:
        """The median recent step interval of one rank (0 before two consecutive steps)."""
        hist = next(iter(self.steps.values()), [])
        gaps = [b[1] - a[1] for a, b in zip(hist[-17:], hist[-16:]) if b[0] == a[0] + 1]
        return statistics.median(gaps) if gaps else 0.0

    def completed(self) -> int | None:
        return max((h[0] for hist in self.steps.values() for h in hist), default=None)

    def metrics_row(self, step: int, row: dict) -> Record:
        """One line of metrics.jsonl. A rank that died before reporting `step` has no loss
        there (None): its process took it along; the others' are kept."""
        ranks = range(self.state.view.world_size)
        got = [row[r] for r in ranks if r in row]
        return Record("metrics", {
            "step": step, "loss": sum(x["loss"] for x in got) / len(got),
            "losses": [row[r]["loss"] if r in row else None for r in ranks], "step_s": max(x["step_s"] for x in got),
            "step_s_ranks": [round(row[r]["step_s"], 6) if r in row else None for r in ranks],
            "nodes": [row[r]["node"] if r in row else None for r in ranks], "t": max(x["t"] for x in got)})

    def flush_rows(self, upto: int) -> list:
        """Rows that can never complete (a recovery resumes after them): written as they are."""
        done = sorted(s for s in self.rows if s <= upto)
        return [self.metrics_row(s, self.rows.pop(s)) for s in done]

    def rewind(self, step: int) -> None:
        """Every rank rolls back to `step`: later steps are redone and logged again."""
        self.rows = {s: row for s, row in self.rows.items() if s <= step}
        self.metrics_through = min(self.metrics_through, step)

    def downtime(self, m: Migration) -> float | None:
        """Pause seen by the stayers: last step before the switch to the first after, minus
        one normal step (median interval before), each rank on its own clock; the worst rank.

        A planned migration with no stayer (a one-node job) has nobody who sees the pause from
        outside: it is then the time no rank trained, from the leaver's report of step s to the
        start of the joiner's step s+1 (its report less its own step time). Not against a median
        step: Phase 1 slows the leaver's last steps and a host-bound step varies by tens of ms,
        which made that difference swing either way (0.0 s once, clamped, on a Megatron job).
        Two processes: one clock on one host, else the clocks' skew adds to it."""
        worst = None
        stayers = [r for r in self.steps if r not in m.leaver_ranks]
        s = m.switch_step
        for rank, hist in self.steps.items():
            if rank in m.leaver_ranks and (stayers or m.recovery):
                continue
            t = {h[0]: h for h in hist}
            if s not in t or s + 1 not in t:
                continue
            if not stayers and not m.recovery:
                gap = t[s + 1][1] - t[s + 1][2] - t[s][1]
            else:
                before = [t[k + 1][1] - t[k][1] for k in range(s - 16, s) if k in t and k + 1 in t]
                if not before:
                    continue
                gap = t[s + 1][1] - t[s][1] - statistics.median(before)
            worst = gap if worst is None else max(worst, gap)
        return None if worst is None else round(max(worst, 0.0), 6)
