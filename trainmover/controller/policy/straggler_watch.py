"""The ranks' compute times folded into windows for the straggler policy (controller/policy/straggler.py),
and its verdict: whom to evict, if anyone (pure)."""
from __future__ import annotations

import statistics

from trainmover.config import Config
from trainmover.controller.durable.state import PolicyState
from trainmover.controller.policy import straggler


class StragglerWatch:
    def __init__(self, cfg: Config, state: PolicyState):
        self.cfg, self.state = cfg, state
        # Not journaled: the measurement starts afresh with a successor (a window spans the
        # takeover's pause otherwise). The evictions are (state.evicted): the cooldown counts from them.
        self.samples: dict[int, list[float]] = {}             # rank -> compute times of this window
        self.windows: list[dict[int, float]] = []             # oldest first: rank -> median compute time
        self.report: dict = {"mode": cfg.straggler, "verdict": "", "target": None, "windows": 0}

    def status(self) -> dict:
        """The report, with the evictions (the durable list itself: status shows it as it is)."""
        return {**self.report, "evicted": self.state.evicted}

    def on_compute(self, now: float, rank: int, compute_s: float) -> str | None:
        """Fold one rank's compute time in; the node to evict now, if any."""
        if self.cfg.straggler == "off":
            return None
        self.samples.setdefault(rank, []).append(compute_s)
        n = self.cfg.straggler_window_steps
        view = self.state.view
        if len(self.samples) < view.world_size or min(len(v) for v in self.samples.values()) < n:
            return None
        # median, not mean: one rank's spike (a page fault, a neighbour's burst) is not slowness
        self.windows.append({r: statistics.median(v[:n]) for r, v in self.samples.items()})
        del self.windows[:-self.cfg.straggler_windows]
        self.samples = {}
        try:
            decision = straggler.decide(self.windows, view.rank_node, straggler.StragglerConfig(
                self.cfg.straggler_threshold, self.cfg.straggler_windows,
                "evict" if self.cfg.straggler == "evict" else "report"), reported=self.report["target"])
        except straggler.StragglerInputError as exc:  # e.g. fewer than 3 nodes: nothing to compare
            self.report.update(verdict=f"not evaluated: {exc}")
            return None
        self.report.update(verdict=decision.reason, target=decision.target, windows=decision.windows_considered,
                           last_window_s={str(r): round(v, 6) for r, v in sorted(self.windows[-1].items())})
        evicted = self.state.evicted
        if decision.action == "evict" and evicted and now - evicted[-1]["t"] < self.cfg.straggler_cooldown_s:
            # A second slow node so soon after an eviction points at a shared cause (the network,
            # a file system, a neighbour) that moving nodes does not fix, and would use up the
            # standbys one by one: reported, not acted on, until TM_STRAGGLER_COOLDOWN_S has passed.
            self.report["verdict"] = (f"{decision.reason}; not evicted: {now - evicted[-1]['t']:.0f}s after the "
                                      f"eviction of {evicted[-1]['node']} (TM_STRAGGLER_COOLDOWN_S="
                                      f"{self.cfg.straggler_cooldown_s:g})")
            return None
        if decision.action == "evict":
            evicted.append({"node": decision.target, "t": now, "verdict": decision.reason})
            self.windows = []  # the layout changes: measure afresh afterwards
            return decision.target
        return None
