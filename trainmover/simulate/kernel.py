"""The Monte-Carlo kernel (numba): one job over a horizon of wall-clock hours, many trials.

Event model, per trial:
* the job trains; the next interruption comes after Exp(rate) hours of training (or exactly
  1/rate hours with `fixed_interarrival`, for closed-form tests). Interruptions that would fall
  inside a downtime are not drawn (the job is already stopped), so ETTR = 1/(1 + rate*D) for a
  fixed downtime D;
* an interruption is planned with probability `planned_fraction`;
* a checkpoint is written every `ckpt_h` of training time (its write cost is not modelled); an
  unplanned event that rolls back loses the training time since the last checkpoint; a planned
  one checkpoints just before stopping and loses nothing;
* mode CKPT: downtime `restart_h`, unplanned events roll back;
  mode ELASTIC: downtime `elastic_h`, rolls back only with `elastic_rollback`;
  mode TRAINMOVER: a free standby takes the node (downtime `tm_planned_h` / `tm_unplanned_h`,
  no rollback: state from the leaver or a data-parallel replica) and its slot is warm again
  `replenish_h` later; with no free standby the event is a checkpoint-restart.

Random numbers: a splitmix64-seeded xorshift64* stream per trial (seed + trial), so results do
not depend on the number of threads, and every mode sees the same stream for the same trial
(common random numbers: TrainMover with 0 standbys reproduces checkpoint-restart exactly).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

CKPT, ELASTIC, TRAINMOVER = 0, 1, 2
MODES = {"checkpoint-restart": CKPT, "elastic": ELASTIC, "trainmover": TRAINMOVER}

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


@njit(cache=True, inline="always")
def _splitmix(x):
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
    z = x
    z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
    z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
    return z ^ (z >> np.uint64(31))


@njit(cache=True, inline="always")
def _next(s):
    """xorshift64*: advance state s (a 1-element uint64 array); return a uniform in (0, 1)."""
    x = s[0]
    x ^= x >> np.uint64(12)
    x ^= (x << np.uint64(25)) & _MASK
    x ^= x >> np.uint64(27)
    s[0] = x
    r = (x * np.uint64(0x2545F4914F6CDD1D)) & _MASK
    return ((r >> np.uint64(11)) + 0.5) * (1.0 / 9007199254740992.0)


@njit(cache=True)
def _one_trial(seed, horizon_h, rate, planned_fraction, mode, restart_h, elastic_h, elastic_rollback,
               tm_planned_h, tm_unplanned_h, standbys, replenish_h, ckpt_h, fixed_interarrival, out):
    s = np.empty(1, dtype=np.uint64)
    s[0] = _splitmix(np.uint64(seed))
    if s[0] == 0:
        s[0] = np.uint64(1)
    ready = np.zeros(max(standbys, 1))       # time at which each standby slot is warm
    t = 0.0
    productive = 0.0
    since_ckpt = 0.0
    events = 0
    fallbacks = 0
    lost = 0.0
    while True:
        if rate <= 0.0:
            productive += horizon_h - t
            break
        if fixed_interarrival:
            dt = 1.0 / rate
        else:
            dt = -np.log(_next(s)) / rate
        if t + dt >= horizon_h:
            productive += horizon_h - t
            break
        t += dt
        productive += dt
        since_ckpt = (since_ckpt + dt) % ckpt_h
        events += 1
        planned = _next(s) < planned_fraction
        down = restart_h
        rollback = not planned
        if mode == ELASTIC:
            down = elastic_h
            rollback = (not planned) and elastic_rollback
        elif mode == TRAINMOVER:
            slot = -1
            for k in range(standbys):
                if ready[k] <= t:
                    slot = k
                    break
            if slot >= 0:
                ready[slot] = t + replenish_h
                down = tm_planned_h if planned else tm_unplanned_h
                rollback = False
            else:
                fallbacks += 1
        if rollback:
            productive -= since_ckpt
            lost += since_ckpt
        since_ckpt = 0.0
        t += down
        if t >= horizon_h:
            break
    out[0] = productive / horizon_h
    out[1] = events
    out[2] = fallbacks
    out[3] = lost


@njit(parallel=True, cache=True)
def run_trials(trials, seed, horizon_h, rate, planned_fraction, mode, restart_h, elastic_h, elastic_rollback,
               tm_planned_h, tm_unplanned_h, standbys, replenish_h, ckpt_h, fixed_interarrival):
    """(trials, 4) array: ETTR, events, fallbacks to checkpoint-restart, hours of progress lost."""
    res = np.empty((trials, 4))
    for i in prange(trials):
        _one_trial(seed * 1000003 + i, horizon_h, rate, planned_fraction, mode, restart_h, elastic_h,
                   elastic_rollback, tm_planned_h, tm_unplanned_h, standbys, replenish_h, ckpt_h,
                   fixed_interarrival, res[i])
    return res
