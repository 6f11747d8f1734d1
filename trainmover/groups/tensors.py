"""The tensor helpers a rank's state is walked and checked with: pure functions over tensors,
shared by the transfer (transfer/state.py, transfer/plan.py), the snapshot copy (capture.py, holding.py)
and the NCCL channel (groups/nccl/backend.py), so that none of them reaches into another's privates.

* `flatten`/`unflatten`: a state's tensors replaced by integer references and back, each
  tensor's key path recorded (receivers match buffers by path, never by position);
* `word_view`/`digest_tensors`: a tensor's bytes as 32/16-bit words, and the digest of a list
  of tensors that every migration's bit-exactness check compares;
* `by_dtype`: tensors grouped by dtype, packed one buffer per dtype on the wire;
* `dtype_of`, `numel`: a tensor's spec (its dtype's name, its shape) read back.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch


def flatten(obj: Any, tensors: list[torch.Tensor], paths: list[str], path: str = "") -> Any:
    """Replace tensors by integer refs (1-element dicts, so weights_only can load them),
    recording each tensor's key path: receivers match buffers by path, never by position."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        paths.append(path)
        return {"__tm_tensor__": len(tensors) - 1}
    if isinstance(obj, dict):
        return {k: flatten(v, tensors, paths, f"{path}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [flatten(v, tensors, paths, f"{path}/{i}") for i, v in enumerate(obj)]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def unflatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`flatten`'s skeleton with each reference replaced by its tensor from `tensors`."""
    if isinstance(obj, dict):
        if set(obj) == {"__tm_tensor__"}:
            return tensors[obj["__tm_tensor__"]]
        return {k: unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unflatten(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(unflatten(v, tensors) for v in obj)
    return obj


def tensors_of(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    flatten(obj, out, [])
    return out


def word_view(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as 32-bit words where its size allows, else 16-bit, else bytes."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if flat.numel() % size == 0:
            return flat.view(dtype)
    return flat


def digest_tensors(tensors: list[torch.Tensor]) -> str:
    """SHA-256 over shapes, dtypes and bytes. CUDA tensors are reduced on the GPU first
    (sum of their 32/16-bit words, per tensor), so no state crosses to the host."""
    h = hashlib.sha256()
    sums = []
    for t in tensors:
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        if t.device.type == "cuda":
            sums.append(word_view(t).sum(dtype=torch.int64) if t.numel() else torch.zeros((), dtype=torch.int64,
                                                                                           device=t.device))
        elif t.numel():
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    if sums:
        h.update(torch.stack(sums).cpu().numpy().tobytes())
    return h.hexdigest()


def by_dtype(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, list[torch.Tensor]]]:
    """Tensors grouped by dtype, in first-seen order: the same on sender and receiver."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.items())


def dtype_of(name: str) -> torch.dtype:
    """The dtype named `name` ("float32" or "torch.float32"); ValueError for any other name."""
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a dtype: {name!r}")
    return dt


def numel(shape: Iterable[int]) -> int:
    """The number of elements of a tensor of `shape`."""
    n = 1
    for s in shape:
        n *= int(s)
    return n
