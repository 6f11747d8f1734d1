"""How long the check trains and where it migrates: pure arithmetic.

State left out of `state_dict` shows only once the runs' histories make it differ and a step
depends on it. The joiner's history before it loads the state is its shadow steps; the
reference's is the steps before the switch. So:
  * the switch comes after AT steps, a prime >= the compared steps: an omitted counter whose
    effect repeats every P steps (StepLR's step_size, an epoch) looks the same in both runs
    only when P divides the difference of the histories, and we make that difference prime;
  * AT >= the compared steps also means that an epoch of up to that many steps has ended
    before the switch, so a data-order generator omitted from the state has drawn more in the
    reference than in the joiner, and the next epoch within the compared steps shows it.
A second history comes free: at the end each reference rank restores the state it kept after
ROLLBACK steps (about two thirds of AT, a prime) and replays up to the end, as the snapshot and
checkpoint tiers redo steps. Its history differs from the saved state's by END - ROLLBACK
steps, another distance than the joiner's, so a period that hides in one shows in the other;
its first replayed step is a step run twice from the same (seed, rank, state).
Limits (documented with --steps): an effect whose period exceeds the compared steps, or that
first appears later than that, is not seen.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_AT = 11  # at least a few epochs of a tiny data set before the switch


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

    @property
    def end(self) -> int:
        """Steps of the uninterrupted run."""
        return self.at + self.compare


def plan(steps: int) -> Plan:
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    at = next_prime(max(steps, MIN_AT))
    rollback = max(p for p in range(2, 2 * at // 3 + 1) if is_prime(p))
    return Plan(at=at, compare=steps, rollback=rollback)


def shadow_total(at: int, steady: int) -> int:
    """How many shadow steps a joiner runs in all, given that it was steady after `steady`:
    the fewest >= steady that leave a prime difference `at - total` (see the module doc), or
    `steady` when none below `at` does."""
    for total in range(steady, at - 1):
        if is_prime(at - total):
            return total
    return steady
