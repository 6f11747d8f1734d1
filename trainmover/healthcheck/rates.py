"""Link error counters judged by rate. Pure: readings, the kept bases and `now` come in; rates
with their evidence and the bases to keep go out.

Why rates: NVLink replay/recovery/CRC and PCIe replay counters are cumulative since the driver
loaded, and they creep up on healthy links (a healthy H200 read 196 and 104 on two links right
after a 14.6 GB NVLink transfer). A sum compared with a fixed number drains healthy nodes;
DCGM's health watches judge CRC errors by rate instead (shared/reference/gpu-machines.md,
docs/admin.md: thresholds and their sources).

How: per GPU, link and counter kind the state keeps a *base*: a reading and its time. The rate
is (now - base) / max(elapsed, window): a burst seen by two runs a second apart is spread over
at least one window (no false drain from runs close together), while a fault that keeps
counting is caught within one window however often the check runs, because the base stays put
until a whole window has passed. A counter below the base or the last reading was reset
(driver reload, reboot): it becomes the new base, with a note, never a fault.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from trainmover.healthcheck.readings import COUNTER_KINDS, Counters, link_label

DEFAULT_WINDOW_S = 60.0
# errors per second above which a link fails (docs/admin.md says where each comes from)
DEFAULT_THRESHOLDS_PER_S: Mapping[str, float] = {
    "crc_flit": 100.0,       # DCGM: CRC errors matter at 100+/s (DCGM_LIMIT_MAX_NVLINK_CRC_ERROR)
    "crc_data": 100.0,       # the same DCGM limit covers both CRC counters
    "replay": 100.0,         # a replay answers a CRC-failed flit: same scale as CRC
    "recovery": 1.0 / 60,    # a link retraining: more than one a minute is a flapping link
    "pcie_replay": 8.0 / 60,  # DCGM: 8 PCIe replays a minute is the most RM recommends
}


@dataclass(frozen=True)
class RatePolicy:
    per_s: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS_PER_S))
    window_s: float = DEFAULT_WINDOW_S

    def __post_init__(self) -> None:
        unknown = set(self.per_s) - set(COUNTER_KINDS)
        if unknown:
            raise ValueError(f"unknown counter kind(s) {sorted(unknown)}; known: {', '.join(COUNTER_KINDS)}")
        if self.window_s <= 0 or any(v < 0 for v in self.per_s.values()):
            raise ValueError("the rate window must be > 0 and thresholds >= 0")

    def with_thresholds(self, overrides: Mapping[str, float]) -> "RatePolicy":
        return RatePolicy({**self.per_s, **overrides}, self.window_s)


@dataclass(frozen=True)
class Base:
    value: int    # the reading rates are measured from
    since: float  # its time (epoch seconds)
    last: int     # the latest reading (a counter below it was reset)


LinkBases = Mapping[str, Mapping[str, Base]]  # link -> kind -> Base


@dataclass(frozen=True)
class Rate:
    """Evidence: one counter that moved, its rate and the threshold it is judged against."""
    link: str
    counter: str
    delta: int
    seconds: float     # the time the delta is spread over (at least one window)
    per_s: float
    threshold: Optional[float]

    @property
    def exceeded(self) -> bool:
        return self.threshold is not None and self.per_s > self.threshold

    def text(self) -> str:
        limit = f"threshold {self.threshold:.3g}/s" if self.threshold is not None else "no threshold"
        return (f"{link_label(self.link)} {self.counter}: +{self.delta} in {self.seconds:.0f}s = "
                f"{self.per_s:.3g}/s ({limit})")

    def evidence(self) -> dict:
        return {"link": self.link, "counter": self.counter, "delta": self.delta,
                "seconds": round(self.seconds, 3), "per_s": self.per_s, "threshold_per_s": self.threshold}


@dataclass(frozen=True)
class CounterVerdict:
    rates: tuple[Rate, ...]           # every counter that rose since its base (exceeded ones fail)
    bases: dict[str, dict[str, Base]]  # what to keep for the next run
    gone: tuple[str, ...]             # links with a base that this reading lacks (inactive now; bases kept)
    notes: tuple[str, ...]

    @property
    def faults(self) -> tuple[Rate, ...]:
        return tuple(r for r in self.rates if r.exceeded)


def judge_counters(bases: Optional[LinkBases], counters: Counters, now: float, policy: RatePolicy,
                   who: str = "GPU") -> CounterVerdict:
    """Judge one GPU's counters against its bases (None: nothing kept, this run is the baseline)."""
    new: dict[str, dict[str, Base]] = {}
    rates: list[Rate] = []
    notes: list[str] = []
    resets: list[str] = []
    for link, kinds in sorted(counters.items()):
        for kind, value in sorted(kinds.items()):
            value = int(value)
            base = (bases or {}).get(link, {}).get(kind)
            fresh = Base(value, now, value)
            if base is None:
                new.setdefault(link, {})[kind] = fresh  # first reading of it: the baseline
                continue
            if value < base.value or value < base.last or now < base.since:
                resets.append(f"{link_label(link)} {kind} {base.last}->{value}")
                new.setdefault(link, {})[kind] = fresh
                continue
            elapsed = now - base.since
            delta = value - base.value
            if delta > 0:
                seconds = max(elapsed, policy.window_s)
                rates.append(Rate(link, kind, delta, seconds, delta / seconds, policy.per_s.get(kind)))
            # keep the base until a whole window has passed, so a fault that keeps counting is
            # measured over the window even when runs come every few seconds
            new.setdefault(link, {})[kind] = fresh if elapsed >= policy.window_s else Base(base.value, base.since, value)
    if resets:
        notes.append(f"{who}: counter reset (driver reload?): new baseline for " + ", ".join(resets[:6])
                     + (f" (+{len(resets) - 6} more)" if len(resets) > 6 else ""))
    gone = tuple(sorted(set(bases or {}) - set(counters)))
    for link in gone:  # an inactive (or sleeping) link keeps its base: judged again when it is back
        new[link] = dict(bases[link])
    return CounterVerdict(tuple(rates), new, gone, tuple(notes))
