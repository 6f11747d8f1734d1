"""A workload by name: a registry key (the built-in models), `package.module:Class` (a user's
class, imported), or `script:PATH` (script mode, trainmover/script), with the options the job
sets checked against its constructor.

Apart from the `Workload` interface (base.py) that every workload, script mode's included,
implements: the interface is imported by its implementations, the loader imports them.
Nothing here loads torch; loading a workload imports its module, which usually does.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from trainmover.errors import ConfigError
from trainmover.workloads.base import Workload

REGISTRY = {"gpt_demo": "trainmover.workloads.gpt_demo:GPTDemo",
            "megatron_gpt": "trainmover.workloads.megatron_gpt:MegatronGPT",
            # the scale harness's ranks without training (issue 38): see workloads/stub.py
            "stub": "trainmover.workloads.stub:Stub"}

# Where each constructor option a job hands a workload comes from (the rest: TM_WORKLOAD_OPTIONS).
OPTION_SOURCES = {"preset": "TM_MODEL", "tp": "TM_TP", "pp": "TM_PP", "dp": "TM_DP",
                  "distributed_optimizer": "TM_DISTRIBUTED_OPTIMIZER"}


def resolve(name: str) -> type[Workload]:
    """The class of workload `name`, a registry key or `package.module:Class` (imported)."""
    target = REGISTRY.get(name, name)
    module_name, _, cls_name = target.partition(":")
    if not cls_name:
        raise ConfigError(f"workload {name!r}: expected one of {sorted(REGISTRY)} or 'module:Class'")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"workload {name!r} cannot be loaded: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Workload)):
        raise ConfigError(f"workload {name!r} is not a trainmover Workload")
    return cls


def accepted_options(cls: type) -> tuple[dict[str, inspect.Parameter], bool]:
    """What a workload declares it accepts: the keyword arguments of its constructor, and
    whether it takes any keyword (**kwargs)."""
    params = inspect.signature(cls).parameters
    named = {n: p for n, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return named, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_options(name: str, cls: type, options: dict[str, Any]) -> None:
    """Refuse, naming the key and the variable that set it, an option the workload does not
    accept, and a required constructor argument that no option sets. Pure."""
    named, any_key = accepted_options(cls)
    accepts = ", ".join(sorted(named)) or "no options"
    unknown = sorted(set(options) - set(named)) if not any_key else []
    if unknown:
        sources = ", ".join(f"{k} from {OPTION_SOURCES.get(k, 'TM_WORKLOAD_OPTIONS')}" for k in unknown)
        raise ConfigError(f"workload {name!r} does not accept options {unknown} ({sources}); it accepts: "
                          f"{accepts} (the keyword arguments of {cls.__name__}.__init__)")
    missing = sorted(n for n, p in named.items() if p.default is inspect.Parameter.empty and n not in options)
    if missing:
        raise ConfigError(f"workload {name!r} needs option(s) {missing}: set them in TM_WORKLOAD_OPTIONS "
                          f"(e.g. TM_WORKLOAD_OPTIONS={missing[0]}=...)")


def load(name: str, options: dict[str, Any] | None = None) -> Workload:
    """`name` is a registry key or `package.module:Class`; `options` are the constructor's
    keyword arguments, checked against its signature first."""
    options = dict(options or {})
    if name.startswith("script:"):  # script mode: the user's own script (trainmover/script)
        from trainmover.script.workload import ScriptWorkload
        unknown = sorted(set(options) - {"argv"})
        if unknown:
            raise ConfigError(f"a script takes its own arguments (TM_SCRIPT_ARGS), not options {unknown}")
        return ScriptWorkload(name[len("script:"):], options.get("argv", ()))
    cls = resolve(name)
    check_options(name, cls, options)
    try:
        return cls(**options)
    except TypeError as exc:  # raised inside the constructor: say whose
        raise ConfigError(f"workload {name!r} refused options {sorted(options)}: {exc}") from exc
