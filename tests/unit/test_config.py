import pytest

from trainmover.config import Config, describe
from trainmover.errors import ConfigError


def test_env_values_are_parsed():
    cfg = Config.from_env({"TM_STEPS": "12", "TM_POLL_S": "0.5", "TM_INJECT": "skip-optimizer-state, corrupt-transfer"})
    assert cfg.steps == 12 and cfg.poll_s == 0.5
    assert cfg.inject == ("skip-optimizer-state", "corrupt-transfer")


@pytest.mark.parametrize("env, message", [
    ({"TM_STEPS": "ten"}, "TM_STEPS='ten': expected int"),
    ({"TM_STEPS": "0"}, "TM_STEPS must be > 0"),
    ({"TM_STPES": "3"}, "unknown TrainMover variable"),
    ({"TM_INJECT": "meteor"}, "unknown injection"),
    ({"TM_PHASE1_TIMEOUT_S": "-1"}, "timeouts must be > 0"),
    ({"TM_SHADOW_STEPS": "1"}, "TM_SHADOW_STEPS must be >= 2"),
])
def test_bad_values_fail_with_a_clear_message(env, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_env(env)


def test_every_field_is_documented():
    text = describe()
    for name in ("TM_STEPS", "TM_STANDBYS", "TM_RESERVATION", "TM_INJECT"):
        assert name in text
