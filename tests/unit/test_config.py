import ast
import dataclasses
import re
from pathlib import Path

import pytest

from trainmover import config
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


# ---- every TM_* variable is declared in config.py and read there ---------------------------------

PACKAGE = Path(config.__file__).resolve().parent
DECLARED = {f.metadata["env"] for f in dataclasses.fields(Config)} | {v.env for v in config.VARIABLES}
TM_NAME = re.compile(r"\bTM_[A-Z][A-Z0-9_]*\b")


def _modules():
    """The package's modules and the benchmarks' (bench/*.py, tools that read TM_ variables too)."""
    for path in sorted(PACKAGE.rglob("*.py")) + sorted((PACKAGE.parent / "bench").glob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _is_environ(node) -> bool:
    """`os.environ`, `environ` (a parameter defaulting to it) or `os.getenv`/`getenv`."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name in ("environ", "getenv")


def _environ_reads(tree) -> list[tuple[int, ast.AST]]:
    """(line, key expression) of every environ.get(k)/getenv(k)/environ[k]/`k in environ`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and _is_environ(f.value)) \
                    or _is_environ(f):
                out.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            out.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            out.append((node.lineno, node.left))
    return out


def _str_constants(tree) -> dict[str, str]:
    """Module-level NAME = "string" assignments (a read through such a constant counts too)."""
    return {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str) for t in n.targets if isinstance(t, ast.Name)}


def test_every_tm_name_in_the_code_is_declared():
    """Any TM_ name in a string of trainmover/ or bench/ (a read, a message, a doc) is a declared variable:
    Config.from_env would refuse an undeclared one as unknown, so setting it stops the job."""
    seen, undeclared = set(), []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for name in TM_NAME.findall(node.value):
                    seen.add(name)
                    if name not in DECLARED:
                        undeclared.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    assert not undeclared, undeclared
    assert {"TM_NCCL_LIB", "TM_TRACE_SWITCH", "TM_LOG_LEVEL", "TM_STEPS", "TM_COMMIT"} <= seen  # the scan sees the code


def test_tm_variables_are_read_only_in_config_py():
    """No module but config.py reads a TM_ variable from the environment: they go through
    Config.from_env or config.setting. The scan is checked on a module that does it wrong."""
    def tm_reads(tree):
        consts = _str_constants(tree)
        keys = [(line, key.value if isinstance(key, ast.Constant) else consts.get(getattr(key, "id", ""), ""))
                for line, key in _environ_reads(tree)]
        return [(line, k) for line, k in keys if isinstance(k, str) and k.startswith("TM_")]
    found = [f"{path.relative_to(PACKAGE.parent)}:{line} {key}" for path, tree in _modules()
             if path.name != "config.py" or path.parent != PACKAGE for line, key in tm_reads(tree)]
    assert not found, found
    wrong = ast.parse('import os\nENV = "TM_X"\na = os.environ.get("TM_Y")\nb = os.getenv(ENV)\n'
                      'c = "TM_Z" in os.environ\ndef f(environ=os.environ):\n    return environ["TM_W"]\n')
    assert sorted(k for _, k in tm_reads(wrong)) == ["TM_W", "TM_X", "TM_Y", "TM_Z"]


def test_every_setting_call_names_a_declared_variable():
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "setting" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                assert node.args[0].value in {v.env for v in config.VARIABLES}, (path, node.lineno)


def test_tool_and_debug_variables_are_accepted_by_the_parser():
    env = {"TM_NCCL_LIB": "/opt/libtmdelta.so", "TM_TRACE_SWITCH": "1", "TM_TRACE_COLLECTIVES": "1",
           "TM_LOG_LEVEL": "DEBUG", "TM_STEPS": "7"}
    assert Config.from_env(env).steps == 7
    with pytest.raises(ConfigError, match="unknown TrainMover variable"):
        Config.from_env({**env, "TM_NCCL_LIBS": "/x.so"})  # a typo still is an error


def test_setting_reads_the_environment_or_the_default():
    assert config.setting("TM_NCCL_LIB", {"TM_NCCL_LIB": "/x.so"}) == "/x.so"
    assert config.setting("TM_LOG_LEVEL", {}) == "INFO"
    assert config.setting("TM_LOG_LEVEL", {"TM_LOG_LEVEL": ""}) == "INFO"  # empty: unset
    with pytest.raises(KeyError):
        config.setting("TM_STEPS", {})  # the job's configuration is read by Config.from_env only


def test_the_other_variables_are_documented_in_their_group():
    text = describe()
    assert {v.group for v in config.VARIABLES} == {"process", "tool", "debug", "test"}
    for v in config.VARIABLES:
        assert re.search(rf"^{v.env}\s+{v.group}\s+\S", text, re.M), v.env


def test_a_bad_log_level_is_a_clear_error(monkeypatch):
    from trainmover.logs import setup_logging
    monkeypatch.setenv("TM_LOG_LEVEL", "LOUD")
    with pytest.raises(ConfigError, match="TM_LOG_LEVEL='LOUD': expected a logging level name"):
        setup_logging()
