"""A token bucket, the shape of slurmctld's own per-user rate limiter (`rl_enable`: 30 tokens,
2 a second), kept by a job for the Slurm work it may put off: taking a standby (salloc, the
merge, the resize) may wait; a drain's detection and a node's release may not
(docs/admin.md, "Load on slurmctld"). Pure: the time is passed in.
"""
from __future__ import annotations


class TokenBucket:
    """`capacity` tokens, refilled at `rate` a second. take() may leave it in debt (a grow
    that asked several times spent more than it was charged up front): the debt is repaid
    from the refill before anything else is allowed."""

    def __init__(self, capacity: float, rate: float, now: float):
        if capacity <= 0 or rate <= 0:
            raise ValueError(f"a token bucket needs capacity > 0 and rate > 0, got {capacity}, {rate}")
        self.capacity, self.rate = float(capacity), float(rate)
        self.tokens, self.at = float(capacity), now

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
            self.at = now

    def wait(self, now: float, cost: float) -> float:
        """Seconds until `cost` tokens are there (0.0: now)."""
        self._refill(now)
        return max(0.0, (min(cost, self.capacity) - self.tokens) / self.rate)

    def take(self, now: float, cost: float) -> None:
        """Spend `cost` tokens (into debt if need be)."""
        self._refill(now)
        self.tokens -= cost


class Paced:
    """Work items let out no faster than a TokenBucket allows, in order, each costing `cost`
    tokens: the keeper's sruns (issue 38). One srun costs its user 2 RPCs (the allocation's
    lookup, REQUEST_HET_JOB_ALLOC_INFO, and REQUEST_JOB_STEP_CREATE); a 128-node job's start
    asked 129 at once, slurmctld answered 1,200 of them "rate limit exceeded" and the sruns'
    back-off held the start for minutes. Pure: the time is passed in."""

    def __init__(self, bucket: TokenBucket, cost: float):
        self.bucket, self.cost = bucket, float(cost)
        self.queued: list = []

    def add(self, item) -> None:
        self.queued.append(item)

    def due(self, now: float) -> list:
        """The items whose tokens are there now, oldest first (their tokens taken)."""
        out = []
        while self.queued and self.bucket.wait(now, self.cost) == 0.0:
            self.bucket.take(now, self.cost)
            out.append(self.queued.pop(0))
        return out
