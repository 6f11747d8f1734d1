"""How many standbys (trainmover/standbys/): the closed-form pool model against the simulator's
Monte-Carlo and the paper's projection, TM_STANDBYS=auto's choice, the site file, the history
sources and `trainmover plan`'s output. Pure logic: no Slurm (sacct intercepted), no clock."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from trainmover.cli import main as cli_main
from trainmover.config import Config
from trainmover.errors import ConfigError
from trainmover.slurm import commands
from trainmover.standbys import history
from trainmover.standbys.auto import choose
from trainmover.standbys.model import best_size, erlang_b, ettr, mean_rollback_h, poisson_quantile
from trainmover.standbys.site import SiteRates, load

PAPER_VALUE_32K = 2400   # design digest: one 8-GPU standby at 32K GPUs is worth ~2,400 training GPUs


# ---- the model's parts ----------------------------------------------------------------------

def test_erlang_b_matches_its_closed_form():
    for a in (0.1, 0.6, 2.0):
        assert erlang_b(0, a) == 1.0
        assert erlang_b(1, a) == pytest.approx(a / (1 + a))
        assert erlang_b(2, a) == pytest.approx((a * a / 2) / (1 + a + a * a / 2))


def test_mean_rollback_is_the_mean_of_an_exponential_modulo_the_interval():
    rate, ckpt = 0.63, 0.5   # 32K GPUs, 30-min checkpoints
    # numeric: E[X mod C] = sum over whole intervals of the integral of (x - jC) rate e^{-rate x}
    dx, total, x = 1e-4, 0.0, 0.0
    while x < 60:
        total += (x % ckpt) * rate * math.exp(-rate * x) * dx
        x += dx
    assert mean_rollback_h(rate, ckpt) == pytest.approx(total, rel=1e-3)
    assert mean_rollback_h(1e-12, 0.5) == pytest.approx(0.25)     # rare events: half an interval
    assert mean_rollback_h(1e6, 0.5) == pytest.approx(1e-6)       # events far more often than checkpoints


def test_poisson_quantile():
    assert poisson_quantile(0.0, 0.99) == 0
    assert poisson_quantile(1.0, 0.5) == 1          # P(<=0) = 0.37, P(<=1) = 0.74
    assert poisson_quantile(68.4, 0.99) >= 68 + 2 * math.sqrt(68.4)
    exact = poisson_quantile(499.0, 0.99)                  # summed
    approx = poisson_quantile(501.0, 0.99)                 # normal approximation
    assert exact == 552 and abs(approx - (exact + 2)) <= 1
    assert poisson_quantile(2303.6, 0.99) == math.ceil(2303.6 + 2.3263 * math.sqrt(2303.6) - 0.5)


def test_no_standby_is_checkpoint_restart_and_a_pool_that_never_empties_is_trainmover():
    job = SiteRates().job(8192)
    e0, b0, _ = ettr(job, 0)
    lam, d_r = job.rate_per_h, job.restart_s / 3600
    roll = mean_rollback_h(lam, job.checkpoint_interval_h)
    assert b0 == 1.0 and e0 == pytest.approx((1 / lam - (1 - job.planned_fraction) * roll) / (1 / lam + d_r))
    fast = SiteRates(replenish_h=0.0).job(8192)   # a used slot is warm again at once
    e1, b1, _ = ettr(fast, 1)
    d_tm = (job.planned_fraction * job.tm_planned_s + (1 - job.planned_fraction) * job.tm_unplanned_s) / 3600
    assert b1 == 0.0 and e1 == pytest.approx(1 / (1 + lam * d_tm))


# ---- the model against the simulator's Monte-Carlo -----------------------------------------------
# Tolerance: |ETTR(model) - ETTR(Monte-Carlo)| <= 0.001 up to 8K GPUs, <= 0.006 at 32K; the
# blocked share within 0.012 absolute. Measured with these trials and seed: worst |dETTR| 0.00014
# at 1K, 0.00069 at 8K, 0.0041 at 32K; blocked 0.0022, 0.0039, 0.0107. The model is pessimistic:
# no event falls in a downtime, so a restart's long pause refills slots, which a Poisson arrival
# stream does not see; and an event that finds no standby follows others closely, so it rolls
# back less than the average interval the model uses. At 128K the gap is 0.02-0.04
# (docs/simulator.md), so the model is not claimed there.

@pytest.mark.parametrize("gpus, replenish_h, tol", [(1024, 1.0, 0.001), (1024, 4.0, 0.001), (8192, 1.0, 0.001),
                                                    (8192, 4.0, 0.001), (32768, 1.0, 0.006), (32768, 4.0, 0.006)])
def test_model_agrees_with_the_monte_carlo(gpus, replenish_h, tol):
    pytest.importorskip("numba")
    from trainmover.simulate.inputs import Scenario
    from trainmover.simulate.kernel import TRAINMOVER
    from trainmover.simulate.model import run_mode
    sc = Scenario(gpus=gpus, trials=200, replenish_h=replenish_h, seed=3)
    job = SiteRates(replenish_h=replenish_h).job(gpus)
    assert job.rate_per_h == pytest.approx(sc.rate_per_h) and job.restart_s == sc.restart_s
    for k in range(4):
        res = run_mode(sc, TRAINMOVER, standbys=k)
        mc_ettr = res[:, 0].mean()
        mc_blocked = res[:, 2].sum() / res[:, 1].sum()
        e, b, _ = ettr(job, k)
        assert abs(e - mc_ettr) <= tol, (k, e, mc_ettr)
        assert abs(b - mc_blocked) <= 0.012, (k, b, mc_blocked)
        se = res[:, 0].std(ddof=1) / math.sqrt(len(res))
        assert se < tol / 3   # the comparison is sharp enough to see a gap of the tolerance


def test_model_disagrees_when_the_replenish_time_is_wrong():
    """Negative control: the comparison above would see a model fed the wrong refill time."""
    pytest.importorskip("numba")
    from trainmover.simulate.inputs import Scenario
    from trainmover.simulate.kernel import TRAINMOVER
    from trainmover.simulate.model import run_mode
    sc = Scenario(gpus=8192, trials=200, replenish_h=1.0, seed=3)
    mc = run_mode(sc, TRAINMOVER, standbys=1)[:, 0].mean()
    assert abs(ettr(SiteRates(replenish_h=4.0).job(8192), 1)[0] - mc) > 0.01


# ---- against the paper's projection --------------------------------------------------------------

def _value_first_standby(gpus, replenish_h):
    job = SiteRates(replenish_h=replenish_h).job(gpus)
    return (ettr(job, 1)[0] - ettr(job, 0)[0]) * gpus


def test_first_standby_at_32k_is_worth_what_the_paper_projects():
    """The paper (at its failure rates): one 8-GPU standby at 32K GPUs is worth ~2,400 training
    GPUs. Its refill time is not published; ours gives 3,836 at 1 h and 1,782 at 4 h, and the
    refill time that gives 2,400 is 2.6 h: within 1..4 h, the range of a node taken, checked and
    warmed. Tolerance: that range."""
    assert _value_first_standby(32768, 4.0) < PAPER_VALUE_32K < _value_first_standby(32768, 1.0)
    lo, hi = 1.0, 4.0
    for _ in range(40):   # the value falls as the refill time grows: bisect for 2,400
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _value_first_standby(32768, mid) > PAPER_VALUE_32K else (lo, mid)
    assert 2.0 < lo < 3.0, lo
    assert _value_first_standby(32768, lo) == pytest.approx(PAPER_VALUE_32K, rel=1e-3)


def test_one_standby_is_enough_for_about_2400_gpus():
    """Read the other way: the largest job for which one standby is the best pool. 2,544 GPUs
    with a 30-min refill (the paper's ~2,400 within 6%), 1,696 with the 1 h default, 1,152 with
    2 h: the answer moves with the refill time, which the site file sets."""
    def largest_with_one(replenish_h):
        rates = SiteRates(replenish_h=replenish_h)
        return max(n for n in range(8, 8192, 8) if best_size(rates.job(n)) <= 1)
    assert abs(largest_with_one(0.5) - 2400) / 2400 < 0.10
    assert largest_with_one(2.0) < largest_with_one(1.0) < largest_with_one(0.5)


# ---- TM_STANDBYS=auto ----------------------------------------------------------------------------

def test_auto_picks_more_standbys_for_a_larger_job():
    site = SiteRates(min_standbys=0, max_standbys=32)
    picks = [choose(nodes, site)["standbys"] for nodes in (16, 128, 1024, 4096)]
    assert picks == sorted(picks) and picks[-1] > picks[0], picks
    assert picks == [0, 1, 3, 5]


def test_auto_picks_more_standbys_for_a_higher_failure_rate():
    picks = [choose(1024, SiteRates(node_mtbf_h=h, max_standbys=32))["standbys"] for h in (50_000, 8_000, 1_000)]
    assert picks[0] < picks[1] < picks[2], picks


def test_auto_keeps_to_the_sites_bounds_and_says_why():
    small = choose(3, SiteRates())        # 24 GPUs: a standby gains far less than its 8 GPUs
    assert small["best"] == 0 and small["standbys"] == 1
    assert "clamped to the site's 1..8" in small["why"] and "24 GPUs" in small["why"]
    big = choose(4096, SiteRates(max_standbys=2))
    assert big["best"] == 5 and big["standbys"] == 2 and "clamped" in big["why"]
    free = choose(4096, SiteRates())
    assert free["standbys"] == 5 and "clamped" not in free["why"] and "best size 5" in free["why"]
    assert choose(4096, SiteRates()) == free   # pure: the same inputs, the same choice


def test_config_takes_auto_or_an_integer():
    assert Config.from_env({"TM_STANDBYS": "auto"}).standbys == "auto"
    assert Config.from_env({"TM_STANDBYS": "AUTO"}).standbys == "auto"
    assert Config.from_env({"TM_STANDBYS": "3"}).standbys == 3
    for bad, msg in (("many", "TM_STANDBYS='many': expected auto or an integer"),
                     ("-1", "TM_STANDBYS=-1: expected auto or an integer >= 0"), ("1.5", "expected auto or an integer")):
        with pytest.raises(ConfigError, match=msg):
            Config.from_env({"TM_STANDBYS": bad})
    with pytest.raises(ConfigError, match="expected auto or an integer"):
        Config(standbys="lots")


def test_status_shows_the_choice():
    from trainmover.controller.policy.core import Policy
    from trainmover.controller.durable.view import JobView
    view = JobView(1, 2, 1, "n1", {0: "n1", 1: "n2"})
    fixed = Policy(Config(standbys=2), view).status()["standby_pool"]
    assert fixed["choice"] == {"setting": "fixed", "standbys": 2, "why": "TM_STANDBYS=2"}
    p = Policy(Config(standbys=1), view)
    p.pool_choice = choose(2, SiteRates())
    assert p.status()["standby_pool"]["choice"]["setting"] == "auto"
    json.dumps(p.status())   # status.json must hold it


# ---- the site file -------------------------------------------------------------------------------

def test_site_file_is_read_and_checked(tmp_path):
    d = tmp_path / "etc"
    d.mkdir(mode=0o755)
    f = d / "site.toml"
    f.write_text("node_mtbf_h = 2000\nreplenish_h = 0.5\nmin_standbys = 0\ntm_profile = 'gpu-measured'\n")
    f.chmod(0o644)
    s = load(str(f))
    assert (s.node_mtbf_h, s.replenish_h, s.min_standbys, s.tm_profile) == (2000.0, 0.5, 0, "gpu-measured")
    assert s.source == str(f) and s.rate_per_h(8 * 100) == pytest.approx(100 / 2000)
    assert load(str(d / "missing.toml")) == SiteRates()
    f.chmod(0o664)
    with pytest.raises(ConfigError, match="not trusted: it is writable by group or others"):
        load(str(f))
    f.chmod(0o644)
    link = d / "link.toml"
    link.symlink_to(f)
    with pytest.raises(ConfigError, match="not opened"):
        load(str(link))
    for text, msg in (("node_mtbf = 5\n", "unknown key"), ("node_mtbf_h = -5\n", "node_mtbf_h must be > 0"),
                      ("min_standbys = 1.5\n", "must be an integer"), ("max_standbys = 99\n", "max_standbys <= 64"),
                      ("replenish_h = 'soon'\n", "must be a number"), ("node_mtbf_h = \n", "site.toml")):
        f.write_text(text)
        with pytest.raises(ConfigError, match=msg):
            load(str(f))


# ---- history ---------------------------------------------------------------------------------

def _journal(path, t0, hours, nodes, migrations, torn=False):
    path.mkdir(parents=True)
    recs = [{"v": 1, "seq": 1, "t": t0, "kind": "start", "job_id": 1, "world_size": nodes, "ranks_per_node": 1,
             "batch_host": "n0", "rank_node": {str(i): f"n{i}" for i in range(nodes)}}]
    for i, (leaver, trigger) in enumerate(migrations):
        m = {"id": i + 1, "leaver": leaver, "leaver_ranks": [0], "trigger": trigger, "requested_at": t0 + 1,
             "epoch": 1, "joiner": "s", "phase": "done", "times": {}}
        recs += [{"v": 1, "seq": len(recs) + 1, "t": t0 + 1 + i, "kind": "migration", "m": m}] * 2  # two phases
    recs.append({"v": 1, "seq": len(recs) + 1, "t": t0 + hours * 3600, "kind": "restart", "attempt": 1})
    text = "".join(json.dumps(r) + "\n" for r in recs) + ('{"v": 1, "se' if torn else "")
    (path / "journal.jsonl").write_text(text)


def test_rates_from_journals(tmp_path):
    runs = tmp_path / "runs"
    _journal(runs / "11", 1e9, 10.0, 4, [("n1", "drain"), ("n2", "failure"), ("n2", "failure"), ("n3", "rebalance")])
    _journal(runs / "12", 2e9, 5.0, 2, [("n0", "healthcheck")], torn=True)
    h = history.from_journals([str(runs)])
    assert (h.node_hours, h.planned, h.unplanned, h.jobs) == (pytest.approx(50.0), 2, 1, 2)
    assert h.node_mtbf_h() == pytest.approx(50.0 / 3)
    out = _plan(["--gpus", "64", "--from-runs", str(runs), "--json"])
    assert out["inputs"]["rates"]["node_mtbf_h"] == pytest.approx(50.0 / 3)
    assert out["inputs"]["rates"]["planned_fraction"] == pytest.approx(2 / 3)
    assert out["inputs"]["history"]["unplanned"] == 1


def test_refill_times_from_the_journals_pool_records():
    """The pool as the journal records it (the demo's own run: spare1 warm, joins at 335.6,
    spare2 warm at 339.8), then a lost standby and an aborted migration (ready again: no refill)."""
    views = [(325.9, {"spare1": "starting"}), (332.8, {"spare1": "ready"}), (335.4, {"spare1": "joining"}),
             (335.6, {}), (336.2, {"spare2": "starting"}), (339.8, {"spare2": "ready"}),
             (400.0, {"spare2": "joining"}), (401.0, {"spare2": "ready"}),        # aborted: still a standby
             (500.0, {}), (530.0, {"spare3": "ready"})]                          # lost, refilled
    assert [round(h * 3600, 1) for h in history.refill_times(views)] == [4.2, 30.0]
    h = history.History(1.0, 1, 0, 1, "x", tuple(history.refill_times(views)))
    assert h.replenish_h * 3600 == pytest.approx(17.1)


def test_history_without_interruptions_is_an_error_not_a_guess(tmp_path):
    _journal(tmp_path / "runs" / "1", 1e9, 3.0, 2, [("n1", "rebalance")])
    with pytest.raises(ConfigError, match="no interruption in 6.0 node-hours of 1 job"):
        history.from_journals([str(tmp_path / "runs")]).node_mtbf_h()
    with pytest.raises(ConfigError, match="no journal.jsonl found"):
        history.from_journals([str(tmp_path)])


def test_rates_from_sacct_go_through_the_slurm_choke_point():
    seen = []

    def sacct(argv, timeout, env):
        seen.append(argv)
        out = "10|COMPLETED|4|36000\n11|NODE_FAIL|8|3600\n12|CANCELLED by 0|2|1800\n"
        return subprocess.CompletedProcess(argv, 0, out, "")
    with commands.intercept(sacct):
        h = history.from_sacct("2026-01-01")
    assert seen[0][:2] == ["sacct", "-a"] and "2026-01-01" in seen[0]
    assert (h.node_hours, h.unplanned, h.jobs) == (pytest.approx(40 + 8 + 1), 1, 3)

    def no_accounting(argv, timeout, env):
        return subprocess.CompletedProcess(argv, 1, "", "sacct: error: Slurm accounting storage is disabled")
    with commands.intercept(no_accounting), pytest.raises(ConfigError, match="accounting storage is disabled"):
        history.from_sacct("2026-01-01")


# ---- `trainmover plan` -----------------------------------------------------------------------------

def _plan(argv):
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli_main(["plan", "--site", "/nonexistent/site.toml", *argv])
    assert code == 0
    return json.loads(buf.getvalue()) if "--json" in argv else buf.getvalue()


def test_plan_json_has_a_row_per_pool_size_and_the_best_is_where_one_more_costs_more():
    out = _plan(["--gpus", "8192", "--json"])
    pools, best = out["pools"], out["best"]["standbys"]
    assert [p["standbys"] for p in pools] == list(range(len(pools))) and len(pools) >= best + 2
    assert best == 3
    assert pools[best]["value_gpus"] >= 8 > pools[best + 1]["value_gpus"]
    totals = [p["total_gpu_hours_per_week"] for p in pools]
    assert totals.index(min(totals)) == best     # the same place, seen as GPU-hours
    for p in pools:
        assert p["lost_gpu_hours_per_week"] == pytest.approx((1 - p["ettr"]) * 8192 * 168)
        assert p["standby_gpu_hours_per_week"] == p["standbys"] * 8 * 168
    assert out["reservation"]["held_standbys"] == 3 and out["reservation"]["nodes"] > 3


def test_plan_text_and_a_set_of_jobs():
    text = _plan(["--gpus", "1024", "--jobs", "32768,8192x4,1024x10"])
    assert "best pool: 1 standby(s): one more would add 4.1 training GPUs, less than the 8 it costs" in text
    assert "reservation for 1x 32,768 GPUs (5 standby(s) each), 4x 8,192 GPUs (3 standby(s) each), " \
           "10x 1,024 GPUs (1 standby(s) each), as TM_STANDBYS=auto picks: 27 held as standbys" in text
    out = _plan(["--gpus", "1024", "--jobs", "32768,8192x4,1024x10", "--json"])
    assert [j["gpus"] for j in out["reservation"]["jobs"]] == [32768] + [8192] * 4 + [1024] * 10


def test_plan_node_mtbf_and_gpus_per_node():
    out = _plan(["--gpus", "4096", "--gpus-per-node", "4", "--node-mtbf-h", "5000", "--json"])
    assert out["inputs"]["nodes"] == 1024
    assert out["inputs"]["event_rate_per_h"] == pytest.approx(1024 / 5000)
    assert out["best"]["cost_gpus"] == 4


@pytest.mark.parametrize("argv, msg", [
    (["--gpus", "100"], "--gpus must be a positive multiple of 8"),
    (["--gpus", "64", "--jobs", "64,12"], "every job's GPUs must be a positive multiple of 8"),
    (["--gpus", "64", "--jobs", "64xfew"], "is not GPUS or GPUSxCOUNT"),
    (["--gpus", "64", "--node-mtbf-h", "0"], "node_mtbf_h must be > 0"),
    (["--gpus", "64", "--max-standbys", "99"], "--max-standbys must be in 0..64"),
])
def test_plan_bad_input_is_a_clear_error(argv, msg, capsys):
    assert cli_main(["plan", "--site", "/nonexistent/site.toml", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_plan_plot(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "pool.png"
    out = _plan(["--gpus", "8192", "--plot", str(png), "--json"])
    assert out["plot"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # as if the extra were not installed
    assert cli_main(["plan", "--site", "/nonexistent/site.toml", "--gpus", "8192", "--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot needs matplotlib, which is not installed: pip install 'trainmover[simulate]'" in capsys.readouterr().err


def test_plan_monte_carlo_column():
    pytest.importorskip("numba")
    out = _plan(["--gpus", "8192", "--monte-carlo", "50", "--max-standbys", "2", "--json"])
    for p, m in zip(out["pools"], out["monte_carlo"]):
        assert abs(p["ettr"] - m["ettr"]) < 0.002


def test_plan_says_where_a_jobs_standbys_come_from_on_this_cluster_only_when_asked(monkeypatch):
    import subprocess

    from trainmover.slurm import commands
    asked = []

    def runner(argv, timeout, env):
        asked.append(argv[:3])
        out = ("SchedulerParameters = permit_job_expansion\nSLURM_VERSION = 25.11.7\n" if argv[:2] == ["scontrol", "show"]
               else "ReservationName=trainmover_standby Nodes=spare1 Users=root\n")
        return subprocess.CompletedProcess(argv, 0, out, "")
    monkeypatch.setenv("TM_SLURM_EXPANSION_FIX", "off")
    with commands.intercept(runner):
        text = _plan(["--gpus", "1024", "--cluster"])
        assert asked == [["scontrol", "show", "config"], ["scontrol", "-o", "show"]]
        out = _plan(["--gpus", "1024", "--cluster", "--json"])
        asked.clear()
        _plan(["--gpus", "1024"])
    assert text.splitlines()[-1].startswith("trainmover: this job's standby mode: none (Slurm 25.11.7: slurmctld crashes")
    assert out["cluster"]["standby_mode"] == text.splitlines()[-1]
    assert asked == []  # without --cluster, plan asks Slurm nothing (it plans off the cluster too)
