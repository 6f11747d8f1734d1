"""A workload gets only the options the user set, checked against its constructor's keyword
arguments; the batch step's preflight refuses a job whose options or check fail."""
from __future__ import annotations

import pytest

from trainmover.check import compare
from trainmover.check.plan import plan
from trainmover.check.run import Report
from trainmover.config import Config
from trainmover.controller.preflight import preflight
from trainmover.errors import ConfigError
from trainmover.workloads import base as workloads
from trainmover.workloads import registry
from trainmover.workloads.base import BuildContext, Workload


class NoOptions(Workload):
    def build(self, ctx: BuildContext) -> None: ...
    def train_step(self, step: int) -> float: return 0.0
    def state_dict(self) -> dict: return {"model": {}}
    def load_state_dict(self, state: dict) -> None: ...


class Needs(NoOptions):
    def __init__(self, width: int, lr: float = 0.1):
        self.width, self.lr = width, lr


class Anything(NoOptions):
    def __init__(self, **options):
        self.options = options


HERE = __name__


def test_a_workload_without_options_runs_with_the_defaults():
    cfg = Config.from_env({"TM_WORKLOAD": f"{HERE}:NoOptions"})
    assert cfg.workload_kwargs() == {}
    assert isinstance(registry.load(cfg.workload, cfg.workload_kwargs()), NoOptions)


def test_a_preset_for_a_workload_without_one_names_tm_model_and_what_it_accepts():
    cfg = Config.from_env({"TM_WORKLOAD": f"{HERE}:Needs", "TM_MODEL": "small", "TM_WORKLOAD_OPTIONS": "width=3"})
    with pytest.raises(ConfigError, match=r"does not accept options \['preset'\] \(preset from TM_MODEL\); "
                                          r"it accepts: lr, width \(the keyword arguments of Needs.__init__\)"):
        registry.load(cfg.workload, cfg.workload_kwargs())


def test_unknown_and_missing_options_are_named():
    with pytest.raises(ConfigError, match=r"does not accept options \['depth', 'tp'\] \(depth from "
                                          r"TM_WORKLOAD_OPTIONS, tp from TM_TP\)"):
        registry.load(f"{HERE}:Needs", {"width": 1, "depth": 2, "tp": 2})
    with pytest.raises(ConfigError, match=r"needs option\(s\) \['width'\].*TM_WORKLOAD_OPTIONS=width=\.\.\."):
        registry.load(f"{HERE}:Needs", {"lr": 0.5})
    with pytest.raises(ConfigError, match="it accepts: no options"):
        registry.load(f"{HERE}:NoOptions", {"lr": 0.5})
    assert registry.load(f"{HERE}:Needs", {"width": 2}).width == 2


def test_a_workload_taking_any_keyword_gets_what_was_set():
    assert registry.load(f"{HERE}:Anything", {"a": 1, "preset": "x"}).options == {"a": 1, "preset": "x"}


def test_the_built_ins_keep_their_default_preset():
    assert registry.load("gpt_demo", Config.from_env({}).workload_kwargs()).preset == "tiny"
    assert registry.load("gpt_demo", Config.from_env({"TM_MODEL": "small"}).workload_kwargs()).preset == "small"


def _report(exact: bool) -> Report:
    finding = compare.Finding("migration", exact, "first difference at step 30" if not exact else "equal", 30)
    return Report("w", 2, plan(4), 1.0, findings=[finding])


def test_preflight_refuses_bad_options_before_any_check():
    calls = []
    with pytest.raises(ConfigError, match="does not accept options"):
        preflight(Config.from_env({"TM_WORKLOAD": f"{HERE}:NoOptions", "TM_WORKLOAD_OPTIONS": "x=1",
                                   "TM_CHECK_WORKLOAD": "1"}), run_check=lambda *a, **k: calls.append(a))
    assert calls == []


def test_preflight_runs_the_check_only_when_asked_and_stops_on_a_difference():
    calls = []

    def fake(workload, options, **kw):
        calls.append((workload, options, kw["steps"]))
        return _report(exact=len(calls) > 1)

    cfg = Config.from_env({"TM_WORKLOAD": f"{HERE}:Needs", "TM_WORKLOAD_OPTIONS": "width=2", "TM_CHECK_WORKLOAD": "1",
                           "TM_CHECK_STEPS": "7"})
    preflight(Config.from_env({"TM_WORKLOAD": f"{HERE}:NoOptions"}), run_check=fake)
    assert calls == []
    with pytest.raises(ConfigError, match=r"(?s)would not be exact; not starting.*first difference at step 30"):
        preflight(cfg, run_check=fake)
    preflight(cfg, run_check=fake)
    assert calls == [(f"{HERE}:Needs", {"width": 2}, 7)] * 2
    with pytest.raises(ConfigError, match="TM_CHECK_WORKLOAD must be 0 or 1"):
        Config.from_env({"TM_CHECK_WORKLOAD": "2"})
