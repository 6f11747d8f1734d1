"""Whether a benchmark may call a migrated run bit-exact (pure: two jobs' records in, fields out).

A comparison with an uninterrupted reference says something only when both jobs trained every
step they were asked for and the migration (or recovery) under test happened. Otherwise
`bit_exact`, `losses_equal` and `digest_equal` are None and `exactness_unknown` says why: a
False would blame the migration for a job that never ran, a True would vouch for a migration
that never happened. Seen (issue 36): both jobs exited 1 at their start in a reused --work
directory, the benchmark read the raw.json an earlier run had left there, and its JSON said
`bit_exact: true`.

A job's record is the raw dict `single_host_jobs.run_controller` writes (rc, error, t_start,
metrics, status, final), with `exit` added by `single_host_jobs.launch` (the process's exit code,
whether it was killed, when it was launched); a reference reused with --ref has no `exit`.
"""
from __future__ import annotations

PLANNED, RECOVERY = "planned", "recovery"


def job_incomplete(name: str, raw: dict | None, steps: int) -> str | None:
    """Why job `name`'s record cannot stand for a run of `steps` steps (None: it can)."""
    if not raw:
        return f"{name}: no record (the job did not run or wrote nothing)"
    ex = raw.get("exit") or {}
    if ex.get("refused"):
        return f"{name}: not run: {ex['refused']}"
    if ex.get("killed"):
        return f"{name}: killed before it ended ({ex['killed']})"
    if ex.get("rc") not in (None, 0):
        return f"{name}: exited with {ex['rc']}"
    if ex.get("launched_t") is not None and (raw.get("t_start") is None or raw["t_start"] < ex["launched_t"]):
        return f"{name}: its record is not from this launch (an earlier run's, left in the same directory)"
    if raw.get("error"):
        return f"{name}: its controller raised: {str(raw['error']).strip().splitlines()[-1][:300]}"
    if raw.get("rc") != 0:
        return f"{name}: its controller ended with {raw.get('rc')}"
    final = raw.get("final") or {}
    if not final.get("digest"):
        return f"{name}: no final digest"
    if final.get("steps") != steps:
        return f"{name}: trained {final.get('steps')} of {steps} steps"
    return None


def not_moved(raw: dict, kind: str) -> str | None:
    """Why the migration (`PLANNED`) or recovery (`RECOVERY`) under test did not happen in `raw`'s
    job (None: it did, and completed)."""
    migrations = [m for m in ((raw.get("status") or {}).get("migrations") or [])
                  if bool(m.get("recovery")) == (kind == RECOVERY)]
    if not migrations:
        return f"no {kind} migration happened"
    m = migrations[0]
    if m.get("state") != "done" or m.get("switch_step") is None:
        return f"the {kind} migration did not complete (state {m.get('state')}, switch step {m.get('switch_step')})"
    return None


def _losses(raw: dict) -> dict:
    """step -> per-rank losses; where a step was redone after a rollback, its last record."""
    return {r["step"]: r.get("losses") for r in raw.get("metrics") or [] if "step" in r}


def judge(ref: dict | None, run: dict | None, *, steps: int, kind: str, skip_missing: bool = False) -> dict:
    """The exactness fields of a benchmark's metrics. `skip_missing`: a rank's missing loss (None:
    the killed rank's last step) does not count as a difference."""
    unknown = [why for why in (job_incomplete("reference", ref, steps), job_incomplete(kind, run, steps)) if why]
    if run and not unknown:
        moved = not_moved(run, kind)
        if moved:
            unknown.append(moved)
    fields = {"bit_exact": None, "losses_equal": None, "digest_equal": None, "rank_digests_equal": None,
              "first_differing_steps": [], "steps_compared": 0, "exactness_unknown": "; ".join(unknown) or None}
    if unknown:
        return fields
    want, got = _losses(ref), _losses(run)
    differ = sorted(k for k in want if k not in got or got[k] is None or len(got[k]) != len(want[k]) or any(
        a != b and not (skip_missing and a is None) for a, b in zip(got[k], want[k])))
    differ += sorted(k for k in got if k not in want)
    rf, mf = ref["final"], run["final"]
    losses_equal = bool(want) and not differ
    digest_equal = rf["digest"] == mf.get("digest")
    fields.update(losses_equal=losses_equal, digest_equal=digest_equal, bit_exact=losses_equal and digest_equal,
                  rank_digests_equal=[a == b for a, b in zip(rf.get("rank_digests") or [], mf.get("rank_digests") or [])],
                  first_differing_steps=differ[:5], steps_compared=len(want))
    return fields


def complaint(fields: dict) -> str | None:
    """The error line a result carries for these fields (None when bit-exact)."""
    if fields["bit_exact"]:
        return None
    if fields["bit_exact"] is None:
        return f"exactness unknown: {fields['exactness_unknown']}"
    return (f"not bit-exact: losses_equal={fields['losses_equal']} (first differing steps "
            f"{fields['first_differing_steps']}), digest_equal={fields['digest_equal']}")
