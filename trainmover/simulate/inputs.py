"""Named inputs of the ETTR simulator, each with its source, and the fits derived from them.

Pure arithmetic: no numba, no I/O. Times are in hours unless a name ends in `_s`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from trainmover.errors import ConfigError

GPUS_PER_NODE = 8

# --- Failure rates -----------------------------------------------------------------------------
# Job MTTF at two scales (TrainMover paper, citing Meta: ~7.9 h at 1K GPUs, ~2.7 h at 16K GPUs;
# the 16K point is Llama 3's 466 interruptions in 54 days on 16,384 H100s: 54*24/466 = 2.78 h).
MTTF_1K_H = 7.9
MTTF_16K_H = 2.7
N_1K, N_16K = 1024, 16384
# Llama 3: 466 interruptions in 54 days, 419 unexpected -> 47 planned (10.1%).
LLAMA3_INTERRUPTIONS, LLAMA3_UNEXPECTED = 466, 419
PLANNED_FRACTION = (LLAMA3_INTERRUPTIONS - LLAMA3_UNEXPECTED) / LLAMA3_INTERRUPTIONS

RATE_FITS = ("affine", "per-gpu-1k", "per-gpu-16k")


def event_rate_per_h(gpus: int, fit: str = "affine") -> float:
    """Interruptions per hour of a job on `gpus` GPUs.

    * ``per-gpu-1k``: job MTTF proportional to 1/N through the 1K point (per-GPU rate
      1/(7.9 h * 1024)). It predicts 0.49 h at 16K, 5.5x more failures than measured there.
    * ``per-gpu-16k``: 1/N through the 16K point (Llama 3). It predicts 43 h at 1K, 5.5x fewer.
    * ``affine`` (default): rate = c + k*N through both points; c (a per-job rate that does not
      grow with N: software, storage, network-wide events) = 0.110/h, k = 1.59e-5 per GPU-hour
      (node MTTF ~7,900 h). It is the simplest form that matches both published points.
    """
    if fit == "per-gpu-1k":
        return gpus / (MTTF_1K_H * N_1K)
    if fit == "per-gpu-16k":
        return gpus / (MTTF_16K_H * N_16K)
    if fit == "affine":
        k = (1 / MTTF_16K_H - 1 / MTTF_1K_H) / (N_16K - N_1K)
        c = 1 / MTTF_1K_H - k * N_1K
        return c + k * gpus
    raise ConfigError(f"unknown rate fit {fit!r}; choose one of {', '.join(RATE_FITS)}")


# --- Checkpoint-restart -----------------------------------------------------------------------
# Megatron-LM restart time by scale (TrainMover paper, Table: 32..1024 GPUs) and ~6.5 min at 8,192
# GPUs (paper, section 2). Interpolated linearly in log2(N); below 32 GPUs held at 80 s; above 8K
# extrapolated with the last slope (30 s per doubling): 16K 420 s, 32K 450 s, 128K 510 s.
RESTART_TABLE_S = ((32, 80.0), (128, 190.0), (256, 230.0), (512, 260.0), (1024, 300.0), (8192, 390.0))

# Phase shares of a restart (design doc, 8K GPUs), mid-points of the published ranges.
SHARE_STOP = 0.08
SHARE_RESCHEDULE = 0.23
SHARE_CKPT_LOAD = 0.255      # 24-27%
SHARE_COMMUNICATOR = 0.155   # 14-17%
SHARE_WARMUP = 0.225         # 17-28%
# An elastic -1/+1 system (Oobleck, Parcae, ReCycle) skips stop and reschedule but still loads a
# checkpoint, builds communicators and warms up: 63.5% of a restart.
ELASTIC_SHARE = SHARE_CKPT_LOAD + SHARE_COMMUNICATOR + SHARE_WARMUP


def restart_s(gpus: int) -> float:
    """Checkpoint-restart downtime (stop .. first fast iteration) for a job on `gpus` GPUs, seconds."""
    x = math.log2(max(gpus, 1))
    pts = [(math.log2(n), s) for n, s in RESTART_TABLE_S]
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) / (x1 - x0) * (x - x1)


# --- TrainMover downtimes ---------------------------------------------------------------------
# Paper (1,024-GPU testbed; nearly flat in scale): the largest scale's numbers are used at every N.
PAPER_PLANNED_S = 16.6
PAPER_UNPLANNED_S = 21.1
# Ours: bench/results/gpu-planned-1b-gpu1.json (4x H200, 1.2B model, metrics.planned_downtime_s),
# bench/results/cpu-planned-20261121-105518.json (CPU demo, metrics.planned_downtime_s), and the
# unexpected failures (SIGKILL of a worker to the first completed step, state from a replica):
# bench/results/gpu-failure-1b-gpu1-20261121.json and bench/results/cpu-failure-20261121-140921.json
# (metrics.unexpected_downtime_s).
GPU_MEASURED_PLANNED_S = 0.160988
CPU_MEASURED_PLANNED_S = 0.036371
GPU_MEASURED_UNPLANNED_S = 2.673
CPU_MEASURED_UNPLANNED_S = 0.1956
TM_PROFILES = {
    "paper": (PAPER_PLANNED_S, PAPER_UNPLANNED_S),
    "gpu-measured": (GPU_MEASURED_PLANNED_S, GPU_MEASURED_UNPLANNED_S),
    "cpu-measured": (CPU_MEASURED_PLANNED_S, CPU_MEASURED_UNPLANNED_S),
}

# --- Assumptions without a published source (flags change them) -------------------------------
DEFAULT_CHECKPOINT_INTERVAL_H = 0.5   # a checkpoint every 30 min of training
DEFAULT_REPLENISH_H = 1.0             # a used standby slot is warm again 1 h later


@dataclass(frozen=True)
class Scenario:
    """Every input of one simulation, validated. Times in hours unless `_s`."""
    gpus: int
    years: float = 1.0
    trials: int = 1000
    standbys: int = 1
    rate_fit: str = "affine"
    planned_fraction: float = PLANNED_FRACTION
    checkpoint_interval_h: float = DEFAULT_CHECKPOINT_INTERVAL_H
    replenish_h: float = DEFAULT_REPLENISH_H
    tm_profile: str = "paper"
    tm_planned_s: float | None = None     # overrides the profile
    tm_unplanned_s: float | None = None   # overrides the profile
    elastic_rollback: bool = False        # elastic restores from a checkpoint and loses progress
    seed: int = 1

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ConfigError(msg)
        need(isinstance(self.gpus, int) and self.gpus >= GPUS_PER_NODE and self.gpus % GPUS_PER_NODE == 0,
             f"--gpus must be a positive multiple of {GPUS_PER_NODE} (GPUs per node), got {self.gpus!r}")
        need(self.years > 0 and math.isfinite(self.years), f"--years must be > 0, got {self.years!r}")
        need(isinstance(self.trials, int) and self.trials >= 1, f"--trials must be >= 1, got {self.trials!r}")
        need(isinstance(self.standbys, int) and 0 <= self.standbys <= 64, f"--standbys must be 0..64, got {self.standbys!r}")
        need(self.rate_fit in RATE_FITS, f"unknown rate fit {self.rate_fit!r}; choose one of {', '.join(RATE_FITS)}")
        need(0.0 <= self.planned_fraction <= 1.0, f"planned fraction must be in [0, 1], got {self.planned_fraction!r}")
        need(self.checkpoint_interval_h > 0, f"--checkpoint-interval-min must be > 0, got {self.checkpoint_interval_h * 60!r}")
        need(self.replenish_h >= 0, f"--replenish-h must be >= 0, got {self.replenish_h!r}")
        need(self.tm_profile in TM_PROFILES, f"unknown TrainMover profile {self.tm_profile!r}; choose one of {', '.join(TM_PROFILES)}")
        for name in ("tm_planned_s", "tm_unplanned_s"):
            v = getattr(self, name)
            need(v is None or v >= 0, f"--{name.replace('_', '-')} must be >= 0, got {v!r}")

    @property
    def horizon_h(self) -> float:
        return self.years * 365.0 * 24.0

    @property
    def rate_per_h(self) -> float:
        return event_rate_per_h(self.gpus, self.rate_fit)

    @property
    def restart_s(self) -> float:
        return restart_s(self.gpus)

    @property
    def elastic_s(self) -> float:
        return ELASTIC_SHARE * self.restart_s

    @property
    def tm_downtimes_s(self) -> tuple[float, float]:
        planned, unplanned = TM_PROFILES[self.tm_profile]
        return (planned if self.tm_planned_s is None else self.tm_planned_s,
                unplanned if self.tm_unplanned_s is None else self.tm_unplanned_s)
