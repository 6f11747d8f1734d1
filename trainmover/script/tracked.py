"""The objects a script names with `track(...)`: their state, and loading it back in place.

What a script's future steps depend on lives in objects the script made (a model, an
optimizer, an LR scheduler, a GradScaler, a sampler or loader with a state, its own
generators, a dict of counters). `track(name=obj, ...)` names them; here each kind is turned
into a state the transfer can carry (tensors, numbers, strings, None, dicts and lists of
them: it decodes with torch.load(weights_only=True)) and loaded back *in place*: DDP and the
optimizer hold the very parameter tensors, so a model's tensors are copied into, never replaced.
"""
from __future__ import annotations

import logging
import random

import torch

from trainmover.errors import ConfigError

log = logging.getLogger("trainmover.script")

try:  # NumPy is optional for scripts (torch brings it in practice)
    import numpy as np
except ImportError:  # pragma: no cover - torch's wheels depend on numpy
    np = None


def kind_of(obj) -> str:
    """What sort of tracked object `obj` is: decides how its state is taken and loaded."""
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, torch.Generator):
        return "generator"
    if isinstance(obj, random.Random):
        return "random"
    if np is not None and isinstance(obj, np.random.Generator):
        return "numpy"
    if isinstance(obj, dict):
        return "dict"
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return "stateful"
    raise ConfigError(f"track(): cannot carry a {type(obj).__name__}: give a module, an optimizer, a torch.Generator, "
                      "a random.Random, a numpy Generator, a dict of numbers/tensors, or any object with "
                      "state_dict()/load_state_dict()")


def base_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP (`.module`) and torch.compile (`._orig_mod`) wrappers: its keys do
    not depend on whether the script wrapped it before or after calling track()."""
    while True:
        inner = getattr(model, "module", None) if hasattr(model, "reducer") else getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def state_of(obj):
    kind = kind_of(obj)
    if kind == "model":  # tensors only: Megatron's modules keep `_extra_state` entries (None, bytes) beside them
        return {k: v for k, v in base_module(obj).state_dict().items() if isinstance(v, torch.Tensor)}
    if kind in ("optimizer", "stateful"):
        return obj.state_dict()
    if kind == "generator":
        return obj.get_state()
    if kind == "random":
        version, internal, gauss = obj.getstate()
        return [version, torch.tensor(internal, dtype=torch.int64), gauss]
    if kind == "numpy":
        return _numpy_state(obj.bit_generator.state)
    return dict(obj)


def load_into(obj, state) -> None:
    """Put `state` back into `obj`, in place where it holds tensors others refer to."""
    kind = kind_of(obj)
    if kind == "model":
        own = state_of(obj)
        missing = sorted(set(own) - set(state))
        if missing:
            raise ConfigError(f"tracked model: the state lacks {missing[:5]} (a different model?)")
        with torch.no_grad():
            for name, t in own.items():
                if state[name] is not t:
                    t.copy_(state[name])
    elif kind == "optimizer":
        from trainmover.workloads.base import load_optimizer_in_place
        load_optimizer_in_place(obj, state)
    elif kind == "stateful":
        obj.load_state_dict(state)
    elif kind == "generator":
        obj.set_state(state)
    elif kind == "random":
        version, internal, gauss = state
        obj.setstate((int(version), tuple(int(x) for x in internal.tolist()), gauss))
    elif kind == "numpy":
        setattr(obj.bit_generator, "state", _numpy_restore(state))  # NumPy's API: a property setter
    else:
        obj.clear()
        obj.update(state)


def _numpy_state(state: dict) -> dict:
    """A NumPy bit generator's state with its big integers as strings (a uint128 does not fit a
    tensor; strings cross the transfer as they are)."""
    return {k: _numpy_state(v) if isinstance(v, dict) else (f"int:{v}" if isinstance(v, int) else v)
            for k, v in state.items()}


def _numpy_restore(state: dict) -> dict:
    return {k: _numpy_restore(v) if isinstance(v, dict) else (int(v[4:]) if isinstance(v, str) and v.startswith("int:")
                                                               else v) for k, v in state.items()}


class Tracked:
    """The objects one run of the script tracks, by name (names are the script's keywords)."""

    def __init__(self):
        self.objects: dict[str, object] = {}

    def add(self, objects: dict) -> None:
        for name, obj in objects.items():
            kind_of(obj)  # refuse what cannot be carried now, where the script named it
            self.objects[name] = obj

    def state(self) -> dict:
        """{"model": {name: ...}, "optimizer": {name: ...}, "objects": {name: ...}}: models and
        optimizers apart, since the job's digest is of those (controller/durable/records.py)."""
        out: dict = {"model": {}, "optimizer": {}, "objects": {}}
        for name, obj in self.objects.items():
            kind = kind_of(obj)
            out[kind if kind in ("model", "optimizer") else "objects"][name] = state_of(obj)
        return out

    def load(self, state: dict) -> None:
        for name, obj in self.objects.items():
            kind = kind_of(obj)
            if kind == "optimizer" and "optimizer" not in state:
                # the runtime's negative control (TM_INJECT=skip-optimizer-state) sends none: keep ours
                log.warning("the state carries no optimizer: %r keeps its own", name)
                continue
            part = state.get(kind if kind in ("model", "optimizer") else "objects", {})
            if name not in part:
                raise ConfigError(f"track(): the state has no {name!r} (tracked here: {sorted(self.objects)}; "
                                  f"in the state: {sorted(k for p in state.values() if isinstance(p, dict) for k in p)})")
            load_into(obj, part[name])

    def covers(self, obj) -> bool:
        """Whether `obj` is carried: tracked; a module inside a tracked model or a wrapper around
        one (DDP, Megatron's DDP, torch.compile: the parameters are the same); or an object a
        tracked object holds as an attribute (an adapter whose state_dict speaks for it)."""
        tracked = list(self.objects.values())
        if any(obj is o for o in tracked):
            return True
        if isinstance(obj, torch.nn.Module):
            mods = [o for o in tracked if isinstance(o, torch.nn.Module)]
            if any(any(obj is m for m in o.modules()) or any(o is m for m in obj.modules()) for o in mods):
                return True
        return any(any(obj is v for v in vars(o).values()) for o in tracked if hasattr(o, "__dict__")
                   and not isinstance(o, torch.nn.Module))
