"""Straggler detection: which node is persistently slower than its peers. Pure: values in, verdict out.

Contract (for whoever wires this into the controller):

* Input ``windows``: a sequence, oldest first, of ``{rank: seconds}`` maps. Each value is that
  rank's *own compute time* over one window (e.g. the mean forward+backward time of its steps
  in the window, measured before the gradient all-reduce). Not the step time: in synchronous
  data parallelism every rank's step time equals the slowest rank's, so step times cannot tell
  who is slow. Every window must hold the same ranks, every value finite and > 0.
* Input ``rank_node``: ``{rank: node name}`` for every rank in the windows. At least
  ``MIN_NODES`` (3) distinct nodes, so that a median of peers means something.
* A node's time in a window is the slowest of its ranks (one slow GPU gates the whole node);
  its ratio is that time over the median of all nodes' times in the window.
* A node is *slow* in a window when ratio > 1 + ``threshold``; a *straggler* when it is slow
  in each of the last ``min_windows`` windows (so a one-off spike never triggers, and noise
  below the threshold never does).
* Output: a ``Decision``: ``stragglers`` (every straggler with its evidence, worst first;
  ties broken by node name), ``target`` (the worst one's node, or None) and ``action``:
  ``"evict"`` (migrate the target's ranks to a standby) or ``"report"`` per config, ``"none"``
  when there is no straggler. The caller acts on it; this module has no clock and no I/O, and
  only the last ``min_windows`` windows matter (pass what you have, oldest first).
* Hysteresis: pass the node the previous decision named as ``reported``; it stays the target
  while it is slow in at least one of the last ``min_windows`` windows, so the verdict does
  not flap with noise (it is named in the first place only when slow in all of them).
* Bad input raises ``StragglerInputError`` (a ``ConfigError``) naming what is wrong.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from trainmover.errors import ConfigError

MIN_NODES = 3
ACTIONS = ("evict", "report")


class StragglerInputError(ConfigError):
    """Timings or config that the straggler policy cannot decide on."""


@dataclass(frozen=True)
class StragglerConfig:
    threshold: float = 0.10     # slow: more than 10% above the peers' median
    min_windows: int = 3        # ... in each of the last 3 windows
    action: str = "evict"       # or "report"

    def __post_init__(self):
        if not (isinstance(self.threshold, (int, float)) and 0 < self.threshold < 10):
            raise StragglerInputError(f"straggler threshold must be in (0, 10), got {self.threshold!r}")
        if not (isinstance(self.min_windows, int) and self.min_windows >= 1):
            raise StragglerInputError(f"straggler min_windows must be an int >= 1, got {self.min_windows!r}")
        if self.action not in ACTIONS:
            raise StragglerInputError(f"straggler action must be one of {ACTIONS}, got {self.action!r}")


@dataclass(frozen=True)
class Evidence:
    node: str
    ranks: tuple[int, ...]
    slowest_rank: int             # in the latest window
    ratios: tuple[float, ...]     # node time / median of nodes, per window considered, oldest first
    node_s: tuple[float, ...]
    median_s: tuple[float, ...]

    @property
    def mean_ratio(self) -> float:
        return sum(self.ratios) / len(self.ratios)

    def describe(self) -> str:
        return (f"node {self.node} (ranks {list(self.ranks)}) is {100 * (self.mean_ratio - 1):.1f}% slower than the "
                f"median of its peers over the last {len(self.ratios)} windows "
                f"(ratios {', '.join(f'{r:.3f}' for r in self.ratios)}; slowest rank {self.slowest_rank})")


@dataclass(frozen=True)
class Decision:
    action: str                   # "evict" | "report" | "none"
    target: str | None
    stragglers: tuple[Evidence, ...]
    windows_considered: int

    @property
    def reason(self) -> str:
        if not self.stragglers:
            return f"no node persistently slow over {self.windows_considered} window(s)"
        return self.stragglers[0].describe()


def _validate(windows: Sequence[Mapping[int, float]], rank_node: Mapping[int, str]) -> dict[str, list[int]]:
    if not windows:
        raise StragglerInputError("no timing windows given: need at least one {rank: compute seconds} map")
    ranks = set(windows[0])
    if not ranks:
        raise StragglerInputError("timing window 0 is empty")
    for i, w in enumerate(windows):
        if set(w) != ranks:
            missing, extra = sorted(ranks - set(w)), sorted(set(w) - ranks)
            raise StragglerInputError(f"timing window {i} has different ranks from window 0 "
                                      f"(missing {missing}, extra {extra})")
        for r, v in w.items():
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise StragglerInputError(f"timing window {i}: rank {r} has compute time {v!r}; need a finite value > 0")
    unknown = sorted(ranks - set(rank_node))
    if unknown:
        raise StragglerInputError(f"ranks {unknown} have timings but no node in rank_node")
    nodes: dict[str, list[int]] = {}
    for r in sorted(ranks):
        nodes.setdefault(rank_node[r], []).append(r)
    if len(nodes) < MIN_NODES:
        raise StragglerInputError(f"need timings from at least {MIN_NODES} nodes to compare a node with its peers, "
                                  f"got {len(nodes)} ({', '.join(sorted(nodes))})")
    return nodes


def decide(windows: Sequence[Mapping[int, float]], rank_node: Mapping[int, str],
           config: StragglerConfig = StragglerConfig(), reported: str | None = None) -> Decision:
    """Which node (if any) is persistently slower than its peers, and what to do about it.
    `reported`: the node named by the previous decision, if any (see the hysteresis below)."""
    nodes = _validate(windows, rank_node)
    recent = list(windows)[-config.min_windows:]
    if len(recent) < config.min_windows:
        return Decision("none", None, (), len(recent))
    per_node: dict[str, list[tuple[float, float, int]]] = {n: [] for n in nodes}
    for w in recent:
        node_s = {n: max(w[r] for r in rs) for n, rs in nodes.items()}
        med = statistics.median(node_s.values())
        for n, rs in nodes.items():
            per_node[n].append((node_s[n], med, max(rs, key=lambda r: (w[r], -r))))
    found = []
    for n, rows in per_node.items():
        ratios = tuple(t / m for t, m, _ in rows)
        if all(x > 1.0 + config.threshold for x in ratios):
            found.append(Evidence(node=n, ranks=tuple(nodes[n]), slowest_rank=rows[-1][2], ratios=ratios,
                                  node_s=tuple(t for t, _, _ in rows), median_s=tuple(m for _, m, _ in rows)))
    found.sort(key=lambda e: (-e.mean_ratio, e.node))
    if not found and reported in per_node:
        # Hysteresis: a node already named stays named until it is not slow in any of the
        # last windows. Otherwise one noisy window (on shared cores, say) would clear the
        # verdict that an operator or the health check is about to act on, and it would flap.
        rows = per_node[reported]
        ratios = tuple(t / m for t, m, _ in rows)
        if any(x > 1.0 + config.threshold for x in ratios):
            found = [Evidence(node=reported, ranks=tuple(nodes[reported]), slowest_rank=rows[-1][2], ratios=ratios,
                              node_s=tuple(t for t, _, _ in rows), median_s=tuple(m for _, m, _ in rows))]
    if not found:
        return Decision("none", None, (), len(recent))
    return Decision(config.action, found[0].node, tuple(found), len(recent))
