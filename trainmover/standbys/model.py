"""How many warm standbys a job should keep: a closed-form model (pure arithmetic, no numba).

The job's interruptions arrive at `rate_per_h` (per hour of training). Each one takes a free
warm standby if there is one: a migration of `tm_planned_s` / `tm_unplanned_s` with no lost
progress, and the used slot is warm again `replenish_h` later. With none free it is a
checkpoint-restart: `restart_s` plus, when unplanned, the progress since the last checkpoint.
This is the event model of `trainmover simulate` (simulate/kernel.py), solved instead of sampled:

* the pool is an Erlang loss system (M/G/k/k): k slots, each busy `replenish_h` after a use,
  events that find every slot busy are lost to checkpoint-restart. Its blocking probability
  B(k, a), a = arrival rate x replenish time, does not depend on the refill time's distribution;
* the arrival rate is per wall-clock hour: a cycle is a training interval (mean 1/rate) plus the
  event's downtime, whose mean depends on B; a fixed point of the two (a few iterations);
* ETTR = E[training kept per cycle] / E[cycle] (renewal-reward), where an unplanned fallback
  loses E[training interval mod checkpoint interval] (the simulator resets that clock at every
  event: a restart resumes from its checkpoint, a migration loses nothing).

Arrivals are not quite Poisson in wall-clock time (no event during a downtime), so B is a few
percent high where the rate times the restart time is large: tests/unit/test_standby_plan.py
states the agreement with the Monte-Carlo.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

HOURS_PER_WEEK = 168.0


def erlang_b(k: int, a: float) -> float:
    """Probability that all k slots are busy, offered load a (Erlang's recursion; stable)."""
    b = 1.0
    for i in range(1, k + 1):
        b = a * b / (i + a * b)
    return b


def mean_rollback_h(rate_per_h: float, ckpt_h: float) -> float:
    """E[X mod C], X ~ Exp(rate): the training lost by an unplanned restart."""
    x = rate_per_h * ckpt_h
    if x < 1e-9:  # checkpoints far more often than events: half an interval on average
        return ckpt_h / 2.0
    if x > 700:   # events far more often than checkpoints: an interval rarely reaches one
        return 1.0 / rate_per_h
    return 1.0 / rate_per_h - ckpt_h * math.exp(-x) / (1.0 - math.exp(-x))


@dataclass(frozen=True)
class Job:
    """One job's inputs. Times in hours unless `_s`."""
    gpus: int
    gpus_per_node: int
    rate_per_h: float            # interruptions per hour of training
    planned_fraction: float
    restart_s: float             # checkpoint-restart downtime
    tm_planned_s: float
    tm_unplanned_s: float
    checkpoint_interval_h: float
    replenish_h: float           # a used standby slot is warm again this much later

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node


@dataclass(frozen=True)
class PoolResult:
    standbys: int
    ettr: float
    blocked: float                   # share of events with no warm standby (checkpoint-restart)
    events_per_week: float
    lost_gpu_hours_per_week: float   # (1 - ETTR) x the job's GPUs
    standby_gpu_hours_per_week: float
    value_gpus: float                # (ETTR(k) - ETTR(k-1)) x GPUs: what standby k adds, in training GPUs

    @property
    def total_gpu_hours_per_week(self) -> float:
        return self.lost_gpu_hours_per_week + self.standby_gpu_hours_per_week


def ettr(job: Job, k: int) -> tuple[float, float, float]:
    """(ETTR, blocking probability, events per wall-clock hour) with k standbys."""
    lam = job.rate_per_h
    if lam <= 0:
        return 1.0, 0.0, 0.0
    p = job.planned_fraction
    d_tm = (p * job.tm_planned_s + (1 - p) * job.tm_unplanned_s) / 3600.0
    d_r = job.restart_s / 3600.0
    roll = mean_rollback_h(lam, job.checkpoint_interval_h)
    b = 0.0 if k else 1.0
    for _ in range(50):
        cycle = 1.0 / lam + (1 - b) * d_tm + b * d_r
        nb = erlang_b(k, job.replenish_h / cycle)
        if abs(nb - b) < 1e-12:
            break
        b = nb
    cycle = 1.0 / lam + (1 - b) * d_tm + b * d_r
    return (1.0 / lam - b * (1 - p) * roll) / cycle, b, 1.0 / cycle


def pool_table(job: Job, max_standbys: int) -> list[PoolResult]:
    """One row per pool size 0..max_standbys."""
    rows, prev = [], None
    for k in range(max_standbys + 1):
        e, b, per_h = ettr(job, k)
        rows.append(PoolResult(k, e, b, per_h * HOURS_PER_WEEK, (1 - e) * job.gpus * HOURS_PER_WEEK,
                               k * job.gpus_per_node * HOURS_PER_WEEK, 0.0 if prev is None else (e - prev) * job.gpus))
        prev = e
    return rows


def best_size(job: Job, limit: int = 64) -> int:
    """The pool size after which one more standby gains less than it costs: the smallest k with
    value(k+1) < one node's GPUs. ETTR is concave in k here (Erlang B is convex), so no later
    standby pays either."""
    prev = ettr(job, 0)[0]
    for k in range(limit):
        e = ettr(job, k + 1)[0]
        if (e - prev) * job.gpus < job.gpus_per_node:
            return k
        prev = e
    return limit


def poisson_quantile(mean: float, q: float) -> int:
    """Smallest n with P(Poisson(mean) <= n) >= q (normal approximation above a mean of 500,
    where e^-mean underflows)."""
    if mean <= 0:
        return 0
    if mean > 500:
        return math.ceil(mean + statistics.NormalDist().inv_cdf(q) * math.sqrt(mean) - 0.5)
    term = cdf = math.exp(-mean)
    n = 0
    while cdf < q and n < 100000:
        n += 1
        term *= mean / n
        cdf += term
    return n


def reservation(jobs: list[Job], pools: list[int], repair_h: float, q: float = 0.99) -> dict:
    """Nodes to put in the standby reservation for `jobs` keeping `pools` standbys each.

    The jobs hold their standbys out of the reservation (sum of pools). Every interruption also
    takes one more node from it (the refill of a used standby, or the replacement node of a
    restart), and the node that left comes back after `repair_h` (repaired and returned, or
    replaced by the admin): nodes out at once are Poisson with mean (sum of rates) x repair_h
    (an M/G/inf queue), so a spare count at its q-quantile leaves a refill waiting with
    probability at most 1 - q."""
    rate = sum(ettr(j, k)[2] for j, k in zip(jobs, pools))
    out_mean = rate * repair_h
    spare = poisson_quantile(out_mean, q)
    return {"held_standbys": sum(pools), "events_per_h": rate, "nodes_out_mean": out_mean,
            "spare_nodes": spare, "quantile": q, "repair_h": repair_h, "nodes": sum(pools) + spare}
