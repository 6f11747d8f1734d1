"""Pure: the records of a checkpoint-restart (batch starts, per-rank events, rank 0's steps,
and the times the driver saw) -> milestones, the phase breakdown and the downtime.

No clock and no files here: the benchmark reads the records and passes them in, tests pass
fixtures. Every milestone of a restarted job is the *latest* rank's (the job waits for its
slowest rank); phases are the spans between consecutive milestones, so they add up to the
whole interruption.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

# Milestones of the new generation, in the order a restart passes them, and the phase that
# ends at each one.
RESTART = [
    ("batch_started", "reschedule (Slurm: pending -> batch script runs)"),
    ("process_start", "launch (srun, python starts)"),
    ("torch_imported", "imports"),
    ("cuda_context", "CUDA context"),
    ("communicators_ready", "communicators (rendezvous + first collective)"),
    ("model_built", "model build (DDP wrapper included; it imports torch._dynamo, ~1.1 s of CPU per process)"),
    ("checkpoint_loaded", "checkpoint load"),
    ("first_step_done", "warm-up: first step"),
]


class RecordsError(ValueError):
    """The records do not describe one complete stop-and-restart."""


@dataclass(frozen=True)
class Restart:
    scenario: str                 # planned | failure
    t_event: float                # drain / fault, wall clock
    old_gen: str
    new_gen: str
    milestones: list              # (name, wall time), in order
    phases: list                  # {"phase", "start_s", "end_s", "seconds"}, relative to t_event
    downtime_s: float
    steady_step_s: float
    last_step_before: int
    resumed_from_step: int
    lost_steps: int
    regained_s: float | None      # event -> the step reached before the event is reached again

    def to_json(self) -> dict:
        return {"scenario": self.scenario, "old_gen": self.old_gen, "new_gen": self.new_gen,
                "milestones": {k: round(t - self.t_event, 6) for k, t in self.milestones},
                "phases": self.phases, "downtime_s": round(self.downtime_s, 6),
                "steady_step_s": round(self.steady_step_s, 6), "last_step_before": self.last_step_before,
                "resumed_from_step": self.resumed_from_step, "lost_steps": self.lost_steps,
                "regained_s": None if self.regained_s is None else round(self.regained_s, 6)}


def _latest(events: list[dict], gen: str, name: str) -> float | None:
    ts = [e["t"] for e in events if e.get("gen") == gen and e["event"] == name]
    return max(ts) if ts else None


def analyse(scenario: str, t_event: float, batches: list[dict], events: list[dict], metrics: list[dict],
            driver: dict[str, float], labels: dict[str, str] | None = None) -> Restart:
    """`driver`: times the benchmark itself saw: `job_left` (the old job left RUNNING) and
    `resubmitted` (sbatch of the new job returned). `labels`: phase names by milestone, for
    launchers other than Slurm (the GPU host's bench starts processes itself).

    planned: downtime = first step of the new job - last step of the old one - one steady step
             (the definition of TrainMover's planned_downtime_s); the checkpoint taken at the
             stop is part of it.
    failure: downtime = first step of the new job - the fault (unexpected_downtime_s); the
             steps since the last checkpoint are lost and counted in `lost_steps` and
             `regained_s`."""
    if scenario not in ("planned", "failure"):
        raise ValueError(f"scenario must be planned or failure, not {scenario!r}")
    gens = list(dict.fromkeys(m["gen"] for m in metrics))
    if len(gens) < 2:
        raise RecordsError(f"steps of {len(gens)} generation(s) found; a restart needs two ({gens})")
    old, new = gens[-2], gens[-1]
    old_rows = [m for m in metrics if m["gen"] == old]
    new_rows = [m for m in metrics if m["gen"] == new]
    if scenario == "failure":
        old_rows = [m for m in old_rows if m["t"] <= t_event]
    if not old_rows or not new_rows:
        raise RecordsError(f"no steps of generation {old!r} before the event or of {new!r} after it")
    last = old_rows[-1]
    intervals = [b["t"] - a["t"] for a, b in zip(old_rows[-31:], old_rows[-30:])]
    steady = statistics.median(intervals) if intervals else 0.0
    first = new_rows[0]
    resumed = first["step"] - 1
    miles: list[tuple[str, float]] = []
    if scenario == "planned":
        stop = [e for e in events if e.get("gen") == old and e["event"] == "checkpoint_saved" and e.get("reason") == "stop"]
        if not stop:
            raise RecordsError(f"generation {old!r} has no checkpoint taken at the stop")
        miles.append(("last_step_done", last["t"]))
        miles.append(("checkpoint_saved", max(e["t"] for e in stop)))
    else:
        miles.append(("fault", t_event))
    phase_of = {"checkpoint_saved": "checkpoint save (training stopped)", "resubmitted": "resubmit (driver sees it, sbatch)",
                "job_left": ("stop (processes end, job leaves RUNNING)" if scenario == "planned"
                             else "detect + stop (Slurm kills the job)")}
    for key in ("job_left", "resubmitted"):
        if driver.get(key) is not None:
            miles.append((key, driver[key]))
    batch = [b["t"] for b in batches if b.get("gen") == new]
    if batch:
        miles.append(("batch_started", max(batch)))
    for name, _ in RESTART[1:-1]:
        t = _latest(events, new, name)
        if t is not None:
            miles.append((name, t))
    miles.append(("first_step_done", first["t"]))
    for (a, ta), (b, tb) in zip(miles, miles[1:]):
        if tb < ta - 1e-3:
            raise RecordsError(f"milestone {b} ({tb:.3f}) precedes {a} ({ta:.3f})")
    names = dict(RESTART) | phase_of | (labels or {})
    phases = [{"phase": names[b], "milestone": b, "start_s": round(ta - t_event, 6), "end_s": round(tb - t_event, 6),
               "seconds": round(tb - ta, 6)} for (_, ta), (b, tb) in zip(miles, miles[1:])]
    if scenario == "planned":
        downtime = first["t"] - last["t"] - steady
    else:
        downtime = first["t"] - t_event
    regained = next((m["t"] - t_event for m in new_rows if m["step"] >= last["step"]), None)
    return Restart(scenario, t_event, old, new, miles, phases, downtime, steady, last["step"], resumed,
                   max(0, last["step"] - resumed), regained)
