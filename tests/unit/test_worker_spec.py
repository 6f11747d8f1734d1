"""The spec a rank process gets (protocol/worker_spec.py) holds the job's Config whole, with the
controller's values for the launch: one set of defaults and checks, and a JSON that round-trips."""
import dataclasses
import json

import pytest

from trainmover.config import Config
from trainmover.errors import ConfigError
from trainmover.protocol.worker_spec import ENV, WorkerSpec

LAUNCH = dict(role="worker", ranks=(2, 3), world_size=4, node="n2", node_addr="10.0.0.2",
              controller=("10.0.0.1", 5000), store=("10.0.0.1", 5001), secret_file="/run/secret")


def test_no_spec_field_repeats_a_config_field():
    spec_fields = {f.name for f in dataclasses.fields(WorkerSpec)}
    config_fields = {f.name for f in dataclasses.fields(Config)}
    # Same name, another meaning in the spec: the constructor's kwargs (Config.workload_kwargs()),
    # and the injections this launch makes (faults.for_launch)
    assert spec_fields & config_fields == {"workload_options", "inject"}
    assert WorkerSpec(**LAUNCH).job == Config()


def test_from_config_carries_the_jobs_configuration_whole():
    cfg = Config(steps=37, seed=9, standby_nice=3, snapshot_every=20, group_timeout_s=12.5, device="cpu",
                 backend="gloo", workload_options="lr=0.01", model="small", shadow_steps=4, straggler="report")
    spec = WorkerSpec.from_config(cfg, inject=("kill-worker",), **LAUNCH)
    assert spec.job == cfg
    assert spec.workload_options == {"preset": "small", "lr": 0.01} == cfg.workload_kwargs()
    assert spec.inject == ("kill-worker",) and spec.role == "worker" and spec.ranks == (2, 3)


def test_the_controllers_own_values_win_over_configs():
    cfg = Config(snapshot_every=50, ranks_per_node=1)
    spec = WorkerSpec.from_config(cfg, inject=(), snapshot_every=0, ranks_per_node=2, checkpoint_dir="/ck", **LAUNCH)
    assert (spec.job.snapshot_every, spec.job.ranks_per_node, spec.checkpoint_dir) == (0, 2, "/ck")
    assert cfg.snapshot_every == 50  # the job's own Config is not changed


def test_the_json_round_trips_and_a_minimal_one_gets_configs_defaults():
    # a launched process's own form of an injection (the chosen standby's plain die-in-warmup),
    # which the job's TM_INJECT could not hold, round-trips too
    spec = WorkerSpec.from_config(Config(steps=5, inject=("die-in-warmup:1",)), inject=("die-in-warmup",),
                                  checkpoint_dir="/ck", **LAUNCH)
    assert WorkerSpec.from_env({ENV: spec.to_env()}) == spec
    minimal = {k: list(v) if isinstance(v, tuple) else v for k, v in LAUNCH.items()}
    got = WorkerSpec.from_env({ENV: json.dumps(minimal)})
    assert got.job == Config() and got.ranks == (2, 3) and got.controller == ("10.0.0.1", 5000)


@pytest.mark.parametrize("env, message", [
    ({}, "is not set"), ({ENV: "{"}, "is malformed"), ({ENV: json.dumps({"role": "worker"})}, "is malformed"),
    # the job's part is checked as the job's environment is: a value Config refuses, an unknown field
    ({ENV: json.dumps({**LAUNCH, "job": {"steps": 0}})}, "is malformed: TM_STEPS must be > 0"),
    ({ENV: json.dumps({**LAUNCH, "job": {"no_such": 1}})}, "is malformed"),
])
def test_a_missing_or_malformed_spec_is_a_clear_error(env, message):
    with pytest.raises(ConfigError, match=f"{ENV} {message}"):
        WorkerSpec.from_env(env)
