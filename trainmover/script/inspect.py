"""What a script's loop uses that its state does not carry: the checker's script findings.

A migration is exact only if everything that decides future steps is tracked. Some omissions
show in a compared run only by chance (a GradScaler whose scale has not changed yet inside the
compared steps, a generator drawn from only at an epoch's end), so the checker also looks: at
the script's boundaries it inspects the frame that calls `tm.step()` and the script's module,
and names (pure: given the frame's variables and what is tracked)
* stateful objects nobody tracks: optimizers, LR schedulers, GradScalers, samplers and loaders
  with a state, models outside the tracked ones, torch/NumPy/`random` generators;
* a DataLoader iterator held outside tm.loop (its position is not carried), and a loader with
  persistent workers (its workers' random state runs on across epochs and cannot be replayed);
* a number that changes at every boundary and is not passed to `tm.step()` (a step counter the
  loop needs: `tm.step(loss, global_step=global_step)`).
"""
from __future__ import annotations

import random

import torch

from trainmover.script.tracked import Tracked

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None


def stateful_kind(obj) -> str | None:
    """A name for `obj` if it holds state that decides future steps, else None."""
    from torch.optim.lr_scheduler import LRScheduler
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, LRScheduler):
        return "LR scheduler"
    if type(obj).__name__ == "GradScaler" and hasattr(obj, "get_scale"):
        return "GradScaler"
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.Generator):
        return "torch.Generator"
    if isinstance(obj, random.Random):
        return "random.Random"
    if np is not None and isinstance(obj, np.random.Generator):
        return "NumPy Generator"
    if isinstance(obj, type):
        return None
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return type(obj).__name__
    return None


def untracked(variables: dict, tracked: Tracked, level_iters: list) -> list[str]:
    """Findings for the variables of the boundary's frame (and the script's module)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter
    out = []
    for name, obj in sorted(variables.items()):
        if name.startswith("__"):
            continue
        kind = stateful_kind(obj)
        if kind is not None and not tracked.covers(obj):
            if kind == "model" and any(isinstance(o, torch.nn.Module) for o in tracked.objects.values()):
                # a second model (an EMA, a teacher) or a loss module: only a trainable one matters
                if not any(p.requires_grad for p in obj.parameters()) and not list(obj.buffers()):
                    continue
            out.append(f"'{name}' is a {kind} that tm.track() does not carry: a rank that takes over starts it "
                       f"afresh (add {name}={name} to tm.track)")
        if isinstance(obj, _BaseDataLoaderIter) and not any(obj is it for it in level_iters):
            out.append(f"'{name}' is a DataLoader iterator outside tm.loop(...): its position is not carried "
                       "(iterate the loader with tm.loop or tm.enumerate)")
        if isinstance(obj, DataLoader) and obj.num_workers > 0 and obj.persistent_workers:
            out.append(f"'{name}' is a DataLoader with persistent_workers=True: its workers' random state runs on "
                       "across epochs and a rank that takes over cannot replay it (use persistent_workers=False)")
    return out


def moving_counters(history: list[dict], passed: set[str], loop_values: list[set]) -> list[str]:
    """Numbers of the boundary's frame that changed at every one of the last boundaries
    (`history`: the frame's int/float variables at each, oldest first) and are neither passed
    to tm.step() nor a loop's own item or index (`loop_values`: those values at each)."""
    if len(history) < 3:
        return []
    out = []
    for name in sorted(history[-1]):
        if name in passed or name.startswith("_"):
            continue
        values = [h.get(name) for h in history]
        if any(v is None or isinstance(v, bool) for v in values):
            continue
        if all(a != b for a, b in zip(values, values[1:])) and not all(
                v in lv for v, lv in zip(values, loop_values)) and all(isinstance(v, int) for v in values):
            out.append(f"'{name}' changes at every step and is not passed to tm.step(): a rank that takes over "
                       f"finds it at its initial value (tm.step(loss, {name}={name}), or keep it in a tracked dict)")
    return out
