"""A state's fingerprint: every leaf of a nested state by its key path, as a digest and a short
preview, so that two runs can be compared in another process and a difference named in the
user's terms ("optimizer state 'momentum_buffer' of param 3")."""
from __future__ import annotations

import hashlib

import torch

# What torch.load(weights_only=True), the transfer's decoder, accepts besides tensors and
# containers (a state holding anything else cannot be migrated). Exact types for the scalars:
# a NumPy float64 is a float, but pickles as a NumPy object the decoder refuses.
SCALARS = (int, float, bool, str, bytes, complex, type(None))
OBJECTS = (torch.dtype, torch.device)


def leaves(obj, path: str = ""):
    """(path, leaf) of every tensor or other leaf, in a stable order. Paths join keys with '/'."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}/{i}")
    else:
        yield path or "/", obj


def _preview(value) -> str:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        if t.numel() <= 4:
            return f"{t.tolist()}"
        if t.is_floating_point():
            return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} sum {float(t.double().sum()):.9g}"
        return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _digest(value) -> str:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h = hashlib.sha256(f"{tuple(t.shape)} {t.dtype}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:24]
    return hashlib.sha256(f"{type(value).__name__}:{value!r}".encode()).hexdigest()[:24]


def fingerprint(state) -> dict[str, list[str]]:
    """path -> [digest, preview] for every leaf (JSON-friendly)."""
    return {path: [_digest(v), _preview(v)] for path, v in leaves(state)}


def unplain(state) -> list[str]:
    """Paths (and types) of leaves the transfer's decoder would refuse."""
    return [f"{path} ({type(v).__module__}.{type(v).__name__})" for path, v in leaves(state)
            if type(v) not in SCALARS and not isinstance(v, (torch.Tensor, *OBJECTS))]


def describe(path: str) -> str:
    """A key path of a full state ({"workload": ..., "rng": ..., "step": ...}) in words."""
    parts = [p for p in path.split("/") if p]
    if parts and parts[0] == "rng":
        return f"the global {'/'.join(parts[1:2])} RNG (captured by the runtime)"
    if parts and parts[0] == "workload":
        parts = parts[1:]
    if len(parts) >= 4 and parts[0] == "optimizer" and parts[1] == "state":
        return f"optimizer state '{'/'.join(parts[3:])}' of param {parts[2]}"
    if len(parts) >= 4 and parts[0] == "optimizer" and parts[1] == "param_groups":
        return f"optimizer param group {parts[2]} '{'/'.join(parts[3:])}'"
    if len(parts) >= 2 and parts[0] == "model":
        return f"model '{'/'.join(parts[1:])}'"
    return f"state '{'/'.join(parts)}'"


def _rank_of(path: str) -> int:
    """Order of explanation: settings and counters (param groups, scheduler, data, scalars)
    say why a run diverged; parameters and optimizer moments are their consequence."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["rng"]:
        return 3
    if "param_groups" in parts:
        return 0
    if "model" in parts[:2] or "state" in parts[1:3]:
        return 2
    return 1


def differences(ours: dict, theirs: dict) -> list[tuple[str, str, str]]:
    """(path, preview in `ours`, preview in `theirs`) of every leaf that differs or exists on one
    side only, most explanatory first."""
    out = []
    for path in sorted(set(ours) | set(theirs), key=lambda p: (_rank_of(p), p)):
        a, b = ours.get(path), theirs.get(path)
        if a is None or b is None or a[0] != b[0]:
            out.append((path, a[1] if a else "(missing)", b[1] if b else "(missing)"))
    return out


def explain(diffs: list[tuple[str, str, str]], mine: str, other: str, limit: int = 4) -> str:
    """The first few differences in words: "optimizer param group 0 'lr' 0.001 (uninterrupted)
    vs 0.01 (migrated); ... (+3 more)"."""
    shown = [f"{describe(p)}: {a} ({mine}) vs {b} ({other})" for p, a, b in diffs[:limit]]
    more = f"; (+{len(diffs) - limit} more)" if len(diffs) > limit else ""
    return "; ".join(shown) + more
