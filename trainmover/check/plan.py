"""How long the check trains and where it migrates: pure arithmetic.

State left out of `state_dict` shows only once the runs' histories make it differ and a step
depends on it. The joiner's history before it loads the state is its shadow steps (S); the
reference's is the steps before the switch (AT). An omitted counter whose effect repeats every
P steps (StepLR's step_size, a reshuffle every epoch) looks the same in both runs only when P
divides AT - S. So the joiner pads its shadow steps until AT - S is a prime larger than the
compared steps: then no period that fits in the compared steps divides it. AT is large enough
for that (at least the compared steps plus the most shadow steps a joiner may need), which also
means that an epoch of up to that many steps has ended before the switch: a data-order
generator left out of the state has drawn more in the reference than in the joiner, and the
next epoch within the compared steps shows it.

A second history comes free: at the end each reference rank restores the state it kept after
ROLLBACK steps and replays up to the end, as the snapshot and checkpoint tiers redo steps. Its
distance END - ROLLBACK is another prime larger than the compared steps, so a counter that
moves once per epoch (whose distance in epochs is not under our control) gets a second chance;
the first replayed step is a step run twice from the same (seed, rank, state).
A third: fresh instances in the reference processes, each given the state after one of a few
early steps R (2, 3, 5, 8, 13, ...: consecutive ones less than twice apart), as a restart from a
checkpoint builds them, each compared for the next compared steps. A fresh instance has counted
no epoch; the state after R steps holds floor(R / E) epochs of an E-step epoch, and some R falls
in [E, 2E): a distance of one epoch, which no period divides. That catches a counter that moves
once per epoch (a per-epoch StepLR), whose distance in the other two checks we cannot choose.
Limits (documented with --steps): an effect whose period exceeds the compared steps, or that
first appears later than that, is not seen.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_AT = 11      # at least a few epochs of a tiny data set before the switch
MAX_STEADY = 12  # most shadow steps before a joiner is steady: twice (build, rebind) TM_SHADOW_STEPS' default


def is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def next_prime(n: int) -> int:
    while not is_prime(n):
        n += 1
    return n


@dataclass(frozen=True)
class Plan:
    at: int          # the switch: the joiner gets the state after this many steps
    compare: int     # steps compared after it
    rollback: int    # the reference's replay restores the state after this many steps

    restarts: tuple[int, ...] = ()  # fresh instances get the state after these many steps

    @property
    def end(self) -> int:
        """Steps of the uninterrupted run."""
        return self.at + self.compare


def plan(steps: int) -> Plan:
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    at = next_prime(max(steps, MIN_AT) + MAX_STEADY + 2)
    end = at + steps
    rollback = max(r for r in range(1, 2 * at // 3 + 1) if is_prime(end - r) or r == 1)
    return Plan(at=at, compare=steps, rollback=rollback, restarts=restart_points(at))


def restart_points(at: int) -> tuple[int, ...]:
    """2, 3, 5, 8, 13, ... up to `at`: each less than twice the one before, so every epoch
    length E <= at has a point in [E, 2E)."""
    points, a, b = [], 2, 3
    while a <= at:
        points.append(a)
        a, b = b, a + b
    return tuple(points)


def shadow_total(at: int, steady: int, compare: int) -> int:
    """How many shadow steps a joiner runs in all, given that it was steady after `steady`:
    the fewest >= steady that leave a prime difference `at - total` larger than `compare` (see
    the module doc), or `steady` when there is none."""
    for total in range(steady, at - compare):
        if is_prime(at - total):
            return total
    return steady
