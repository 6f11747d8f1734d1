"""bench/exactness.py: a benchmark says bit_exact / digest_equal only when both jobs ran every step
and the migration (or recovery) happened, else None with the reason (issue 36: a JSON said
bit_exact: true for two jobs that had exited 1 at their start, from an earlier run's raw.json);
bench/single_host_jobs.py: a reused job directory is refused, and a job whose pace cannot fit
its deadline is named before the deadline."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import exactness  # noqa: E402
from bench.single_host_jobs import cannot_fit, reused  # noqa: E402

STEPS = 10
LAUNCHED = 1000.0


def job(*, migrations=(), digest="d1", losses=lambda s: [1.0 / s, 2.0 / s], steps=STEPS, **exit_):
    """The record of a job that launched at LAUNCHED, trained `steps` steps and ended well."""
    return {"rc": 0, "error": None, "t_start": LAUNCHED + 1,
            "metrics": [{"step": s, "t": LAUNCHED + s, "losses": losses(s)} for s in range(1, steps + 1)],
            "status": {"migrations": list(migrations)},
            "final": {"steps": steps, "digest": digest, "rank_digests": ["a", "b"]},
            "exit": {"launched_t": LAUNCHED, "rc": 0, "killed": None, **exit_}}


PLANNED = {"id": 1, "recovery": False, "state": "done", "switch_step": 5}
RECOVERED = {"id": 1, "recovery": True, "state": "done", "switch_step": 4}


def judge(ref, run, kind=exactness.PLANNED, **kw):
    return exactness.judge(ref, run, steps=STEPS, kind=kind, **kw)


def test_both_complete_and_migrated_equal_is_bit_exact():
    got = judge(job(), job(migrations=[PLANNED]))
    assert got["bit_exact"] is True and got["losses_equal"] and got["digest_equal"]
    assert got["exactness_unknown"] is None and got["steps_compared"] == STEPS
    assert got["rank_digests_equal"] == [True, True] and exactness.complaint(got) is None


def test_a_different_digest_or_loss_is_false_not_unknown():
    got = judge(job(), job(migrations=[PLANNED], digest="other"))
    assert got["bit_exact"] is False and got["digest_equal"] is False and got["losses_equal"] is True
    got = judge(job(), job(migrations=[PLANNED], losses=lambda s: [1.0 / s, 2.0 / s + (s == 7)]))
    assert got["bit_exact"] is False and got["losses_equal"] is False and got["first_differing_steps"] == [7]
    assert exactness.complaint(got).startswith("not bit-exact")


def test_a_step_missing_or_extra_differs():
    short = job(migrations=[PLANNED])
    short["metrics"] = short["metrics"][:-1]
    assert judge(job(), short)["first_differing_steps"] == [STEPS]
    extra = job(migrations=[PLANNED])
    extra["metrics"].append({"step": STEPS + 1, "t": 0, "losses": [0.0, 0.0]})
    assert judge(job(), extra)["losses_equal"] is False


def unknown(got: dict) -> str:
    assert got["bit_exact"] is None and got["losses_equal"] is None and got["digest_equal"] is None, got
    assert exactness.complaint(got).startswith("exactness unknown"), got
    return got["exactness_unknown"]


def test_issue_36_both_jobs_exited_1_at_start_over_an_earlier_runs_records():
    """The negative control of the bug: the records (and digests) of an earlier good run, left
    in a reused directory, with both processes of this run exiting 1 at their start."""
    stale_ref, stale_run = job(rc=1), job(migrations=[PLANNED], rc=1)
    for r in (stale_ref, stale_run):
        r["t_start"] = LAUNCHED - 3600  # written an hour before this launch
    assert "exited with 1" in unknown(judge(stale_ref, stale_run))
    # even with exit codes of 0, a record older than the launch is not this run's
    for r in (stale_ref, stale_run):
        r["exit"]["rc"] = 0
    assert "not from this launch" in unknown(judge(stale_ref, stale_run))


def test_no_migration_no_verdict():
    assert "no planned migration happened" in unknown(judge(job(), job()))
    # a recovery is not the planned migration asked about, nor the reverse
    assert "no planned migration" in unknown(judge(job(), job(migrations=[RECOVERED])))
    assert "no recovery migration" in unknown(judge(job(), job(migrations=[PLANNED]), kind=exactness.RECOVERY))
    aborted = {**PLANNED, "state": "aborted", "switch_step": None}
    assert "did not complete" in unknown(judge(job(), job(migrations=[aborted])))


def test_incomplete_jobs_give_no_verdict():
    ok_run = job(migrations=[PLANNED])
    assert "reference: no record" in unknown(judge({}, ok_run))
    assert "planned: no record" in unknown(judge(job(), None))
    cases = {
        "killed before it ended": dict(killed="did not finish within 100s"),
        "exited with -9": dict(rc=-9),
        "not run: taken": dict(refused="taken"),
    }
    for want, exit_ in cases.items():
        assert want in unknown(judge(job(**exit_), ok_run)), want
        assert want in unknown(judge(job(), job(migrations=[PLANNED], **exit_))), want
    raised = copy.deepcopy(ok_run)
    raised["error"] = "Traceback ...\nRuntimeError: boom"
    assert "raised: RuntimeError: boom" in unknown(judge(job(), raised))
    ended = copy.deepcopy(ok_run)
    ended["rc"] = 3
    assert "ended with 3" in unknown(judge(job(), ended))
    no_final = copy.deepcopy(ok_run)
    no_final["final"] = None
    assert "no final digest" in unknown(judge(job(), no_final))
    assert "trained 8 of 10 steps" in unknown(judge(job(steps=8), ok_run))


def test_a_reused_reference_without_exit_record_is_judged_on_its_own_record():
    ref = job()
    del ref["exit"]  # --ref RAW: another invocation's reference
    assert judge(ref, job(migrations=[PLANNED]))["bit_exact"] is True
    ref["rc"] = 1
    assert "ended with 1" in unknown(judge(ref, job(migrations=[PLANNED])))


def test_recovery_may_skip_the_killed_ranks_missing_loss_only_when_asked():
    run = job(migrations=[RECOVERED], losses=lambda s: [1.0 / s, None if s == 4 else 2.0 / s])
    assert judge(job(), run, exactness.RECOVERY, skip_missing=True)["bit_exact"] is True
    assert judge(job(), run, exactness.RECOVERY)["first_differing_steps"] == [4]


def rows(n, step_s, t0=0.0, first=5.0):
    """n steps: the first takes `first` s (compiling), then `step_s` each."""
    return [{"step": s, "t": t0 + first + (s - 1) * step_s} for s in range(1, n + 1)]


def test_a_pace_that_fits_is_not_stopped():
    assert cannot_fit(rows(12, 0.5), steps=200, started=0.0, timeout_s=120) is None  # needs 104.5 s
    assert cannot_fit(rows(3, 5.0), steps=200, started=0.0, timeout_s=60) is None   # too few steps to judge


def test_a_pace_that_cannot_fit_says_what_it_needs():
    need, why = cannot_fit(rows(12, 0.5), steps=200, started=0.0, timeout_s=90)
    assert need == 104.5 and "need at least 104 s" in why and "90 s" in why
    # within the slack (5 %): not stopped, the deadline itself decides
    assert cannot_fit(rows(12, 0.5), steps=200, started=0.0, timeout_s=101) is None


def test_redone_steps_after_a_rollback_do_not_count_as_fast_steps():
    r = rows(30, 1.0)
    r += [{"step": 20, "t": r[-1]["t"] + 3}] + [{"step": 20 + k, "t": r[-1]["t"] + 3 + k} for k in range(1, 4)]
    need, _ = cannot_fit(r, steps=100, started=0.0, timeout_s=60)
    assert need > 100  # the 1 s pace, not the jump back from step 30 to 20


def test_a_reused_job_directory_is_refused(tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "migrate").mkdir()
    (tmp_path / "migrate" / "raw.json").write_text("{}")
    assert reused(tmp_path, ["ref", "migrate", "kill"]) == [
        f"{tmp_path / 'migrate'} exists from an earlier run: give a new --work (or remove it)"]


def test_a_result_names_the_cards_that_ran_not_only_the_kind_asked():
    """The device tool may lend H200s for an H100 kind: the machine field says so."""
    from bench.results_io import ran_on
    assert ran_on("nvidia-h100-x4", "4x NVIDIA H200") == "nvidia-h100-x4 asked, ran on 4x NVIDIA H200"
    assert ran_on("nvidia-h100-x4", "4x NVIDIA H100 80GB HBM3") == "nvidia-h100-x4"  # the control
    assert ran_on("nvidia-h200", "1x NVIDIA H200") == "nvidia-h200"
