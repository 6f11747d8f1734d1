"""A site's failure rates and standby settings: defaults, the admin's file, and `Job` inputs.

The admin sets them in a TOML file (default /etc/trainmover/site.toml, `TM_SITE_CONFIG` to
point elsewhere; docs/admin.md). Every key is optional; an unknown key or a bad value is an
error. Without a file, the published rates of `trainmover simulate` (simulate/inputs.py: the
affine fit through 7.9 h at 1K GPUs and 2.7 h at 16K) and its assumptions are used.

    node_mtbf_h = 7900          # hours between interruptions of one node (omit: the published fit)
    job_rate_per_h = 0.0        # interruptions per hour of any job, whatever its size (with node_mtbf_h)
    planned_fraction = 0.101    # share of interruptions that are planned (drains, maintenance)
    gpus_per_node = 8
    replenish_h = 1.0           # a used standby is warm again this much later (take a node, warm up)
    repair_h = 24.0             # a node that left is back in the reservation this much later
    checkpoint_interval_min = 30
    tm_profile = "paper"        # TrainMover downtimes: paper, gpu-measured, cpu-measured
    min_standbys = 1            # TM_STANDBYS=auto never picks fewer (0 lets a small job run without)
    max_standbys = 8            # ... nor more

The file steers how many nodes a job holds, so it is read only when nothing another user
could write it: a regular file (no symlink), owned by root or by the reading user, not
writable by group or others, in a directory with the same rule (healthcheck/state.py's rule).
"""
from __future__ import annotations

import math
import os
import stat
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from trainmover.errors import ConfigError
from trainmover.simulate.inputs import (DEFAULT_CHECKPOINT_INTERVAL_H, DEFAULT_REPLENISH_H, GPUS_PER_NODE, PLANNED_FRACTION,
                                        TM_PROFILES, event_rate_per_h, restart_s)
from trainmover.standbys.model import Job

DEFAULT_SITE_FILE = "/etc/trainmover/site.toml"
DEFAULT_REPAIR_H = 24.0   # assumption: a failed node repaired (or replaced by the admin) within a day
MAX_FILE_BYTES = 1 << 16


@dataclass(frozen=True)
class SiteRates:
    node_mtbf_h: float | None = None     # None: the published affine fit (simulate/inputs.py)
    job_rate_per_h: float = 0.0
    planned_fraction: float = PLANNED_FRACTION
    gpus_per_node: int = GPUS_PER_NODE
    replenish_h: float = DEFAULT_REPLENISH_H
    repair_h: float = DEFAULT_REPAIR_H
    checkpoint_interval_min: float = DEFAULT_CHECKPOINT_INTERVAL_H * 60
    tm_profile: str = "paper"
    min_standbys: int = 1
    max_standbys: int = 8
    source: str = "built-in defaults"

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ConfigError(f"{self.source}: {msg}")
        need(self.node_mtbf_h is None or (self.node_mtbf_h > 0 and math.isfinite(self.node_mtbf_h)),
             f"node_mtbf_h must be > 0, got {self.node_mtbf_h!r}")
        need(self.job_rate_per_h >= 0 and math.isfinite(self.job_rate_per_h), f"job_rate_per_h must be >= 0, got {self.job_rate_per_h!r}")
        need(0.0 <= self.planned_fraction <= 1.0, f"planned_fraction must be in [0, 1], got {self.planned_fraction!r}")
        need(isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1, f"gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")
        need(self.replenish_h >= 0 and self.repair_h >= 0, "replenish_h and repair_h must be >= 0")
        need(self.checkpoint_interval_min > 0, f"checkpoint_interval_min must be > 0, got {self.checkpoint_interval_min!r}")
        need(self.tm_profile in TM_PROFILES, f"tm_profile {self.tm_profile!r}: choose one of {', '.join(TM_PROFILES)}")
        need(isinstance(self.min_standbys, int) and isinstance(self.max_standbys, int)
             and 0 <= self.min_standbys <= self.max_standbys <= 64,
             f"need 0 <= min_standbys <= max_standbys <= 64, got {self.min_standbys!r}, {self.max_standbys!r}")

    def rate_per_h(self, gpus: int) -> float:
        if self.node_mtbf_h is None:
            return event_rate_per_h(gpus, "affine")
        return gpus / self.gpus_per_node / self.node_mtbf_h + self.job_rate_per_h

    def describe(self) -> str:
        if self.node_mtbf_h is None:
            rates = "published rates (affine fit: 7.9 h job MTTF at 1K GPUs, 2.7 h at 16K)"
        else:
            rates = f"node MTBF {hours(self.node_mtbf_h)}" + (f" + {self.job_rate_per_h:g}/h per job" if self.job_rate_per_h else "")
        return (f"{rates}, {self.planned_fraction:.1%} planned, standby warm again after {hours(self.replenish_h)} "
                f"(from {self.source})")

    def job(self, gpus: int) -> Job:
        planned_s, unplanned_s = TM_PROFILES[self.tm_profile]
        return Job(gpus, self.gpus_per_node, self.rate_per_h(gpus), self.planned_fraction, restart_s(gpus),
                   planned_s, unplanned_s, self.checkpoint_interval_min / 60.0, self.replenish_h)

    def to_json(self) -> dict:
        return asdict(self)


def hours(h: float) -> str:
    """A duration in hours, readable from seconds to years: 4.2 s, 12.5 min, 1.59 h, 7,900 h."""
    if h < 1 / 60:
        return f"{h * 3600:.1f} s"
    if h < 1:
        return f"{h * 60:.1f} min"
    return f"{h:,.2f} h" if h < 100 else f"{h:,.0f} h"


_KEYS = {f.name: f for f in fields(SiteRates) if f.name != "source"}


def from_mapping(data: dict, source: str, base: SiteRates | None = None) -> SiteRates:
    """Values of a site file (or of the command line) over `base`; unknown keys are errors."""
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
    values = {}
    for key, v in data.items():
        want = _KEYS[key].type
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ConfigError(f"{source}: {key} = {v!r} is not a {want}")
        if "int" in str(want) and "float" not in str(want) and not isinstance(v, int):
            raise ConfigError(f"{source}: {key} = {v!r} must be an integer")
        if "float" in str(want) and not isinstance(v, (int, float)):
            raise ConfigError(f"{source}: {key} = {v!r} must be a number")
        if "str" in str(want) and not isinstance(v, str):
            raise ConfigError(f"{source}: {key} = {v!r} must be a string")
        values[key] = float(v) if "float" in str(want) else v
    return replace(base or SiteRates(), **values, source=source)


def _untrusted(path: Path, st: os.stat_result) -> str | None:
    if st.st_uid not in (0, os.geteuid()):
        return f"it belongs to uid {st.st_uid} (only root's or yours is read)"
    if st.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def load(path: str | None) -> SiteRates:
    """The site's rates: the file at `path` when it exists (a clear error when it is there but
    not trusted or malformed), else the built-in defaults."""
    path = Path(path or DEFAULT_SITE_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return SiteRates()
    except OSError as exc:
        raise ConfigError(f"site configuration {path}: not opened ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        why = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else _untrusted(path, st)
        if not why:
            parent = _untrusted(path.parent, os.stat(path.parent))
            why = parent and f"its directory {path.parent}: {parent}"
        if why:
            raise ConfigError(f"site configuration {path} is not trusted: {why}")
        raw = os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"site configuration {path} is over {MAX_FILE_BYTES} bytes")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"site configuration {path}: {exc}") from None
    return from_mapping(data, str(path))
