"""The spec a rank process gets (protocol/worker_spec.py) is derived from the job's Config: one set of
defaults, copied by one function, and a JSON that round-trips."""
import dataclasses
import json

import pytest

from trainmover.config import Config
from trainmover.protocol.worker_spec import ENV, WorkerSpec
from trainmover.errors import ConfigError

LAUNCH = dict(role="worker", ranks=(2, 3), world_size=4, node="n2", node_addr="10.0.0.2",
              controller=("10.0.0.1", 5000), store=("10.0.0.1", 5001), secret_file="/run/secret")
CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
SPEC_FIELDS = {f.name: f for f in dataclasses.fields(WorkerSpec)}
# Same name, another meaning in the spec: the constructor's kwargs (Config.workload_kwargs()),
# and the injections this launch makes (faults.for_launch).
DERIVED = {"workload_options", "inject"}


def test_a_spec_field_named_like_a_config_field_has_configs_default():
    shared = set(SPEC_FIELDS) & set(CONFIG_FIELDS)
    assert len(shared) >= 20, shared
    for name in shared - DERIVED:
        assert SPEC_FIELDS[name].metadata.get("config"), f"{name}: copy it from Config (_from_config)"
        assert SPEC_FIELDS[name].default == CONFIG_FIELDS[name].default, name
    assert WorkerSpec(**LAUNCH).inject == Config().inject


def test_from_config_copies_the_jobs_configuration():
    cfg = Config(steps=37, seed=9, standby_nice=3, snapshot_every=20, group_timeout_s=12.5, device="cpu",
                 backend="gloo", workload_options="lr=0.01", model="small", shadow_steps=4)
    spec = WorkerSpec.from_config(cfg, inject=("kill-worker",), **LAUNCH)
    for name, f in SPEC_FIELDS.items():
        if f.metadata.get("config"):
            assert getattr(spec, name) == getattr(cfg, name), name
    assert spec.workload_options == {"preset": "small", "lr": 0.01} == cfg.workload_kwargs()
    assert spec.inject == ("kill-worker",) and spec.role == "worker" and spec.ranks == (2, 3)


def test_the_controllers_own_values_win_over_configs():
    cfg = Config(snapshot_every=50, ranks_per_node=1)
    spec = WorkerSpec.from_config(cfg, inject=(), snapshot_every=0, ranks_per_node=2, **LAUNCH)
    assert spec.snapshot_every == 0 and spec.ranks_per_node == 2


def test_the_json_round_trips_and_a_minimal_one_gets_configs_defaults():
    spec = WorkerSpec.from_config(Config(steps=5), inject=("x",), checkpoint_dir="/ck", **LAUNCH)
    assert WorkerSpec.from_env({ENV: spec.to_env()}) == spec
    minimal = {k: list(v) if isinstance(v, tuple) else v for k, v in LAUNCH.items()}
    got = WorkerSpec.from_env({ENV: json.dumps(minimal)})
    assert (got.steps, got.standby_nice, got.snapshot_every) == (Config().steps, Config().standby_nice,
                                                                 Config().snapshot_every)
    assert got.ranks == (2, 3) and got.controller == ("10.0.0.1", 5000)


@pytest.mark.parametrize("env, message", [({}, "is not set"), ({ENV: "{"}, "is malformed"),
                                          ({ENV: json.dumps({"role": "worker"})}, "is malformed")])
def test_a_missing_or_malformed_spec_is_a_clear_error(env, message):
    with pytest.raises(ConfigError, match=f"{ENV} {message}"):
        WorkerSpec.from_env(env)
