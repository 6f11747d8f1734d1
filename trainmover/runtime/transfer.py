"""Move a rank's full training state to the rank that takes its slot.

Wire format over a 2-member group (sender group rank 0, receiver 1):
  1. int64 tensor [manifest_length]
  2. uint8 tensor: the manifest, a `torch.save` of the state with every tensor replaced
     by its index, plus per-tensor (shape, dtype) and a SHA-256 over all tensor bytes;
     loaded with `weights_only=True`, so a peer cannot make us run code;
  3. one flat buffer per dtype (few large messages rather than one per tensor), unpacked
     *in place* where the receiver already holds a tensor of that key, shape and dtype (a
     warm standby's buffers), else into a new one.
The receiver recomputes the digest; a mismatch is an error, never silently used.
"""
from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainmover.errors import MigrationError


def _flatten(obj, tensors: list[torch.Tensor], paths: list[str], path: str = ""):
    """Replace tensors by integer refs (1-element dicts, so weights_only can load them),
    recording each tensor's key path: receivers match buffers by path, never by position."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        paths.append(path)
        return {"__tm_tensor__": len(tensors) - 1}
    if isinstance(obj, dict):
        return {k: _flatten(v, tensors, paths, f"{path}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_flatten(v, tensors, paths, f"{path}/{i}") for i, v in enumerate(obj)]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _unflatten(obj, tensors: list[torch.Tensor]):
    if isinstance(obj, dict):
        if set(obj) == {"__tm_tensor__"}:
            return tensors[obj["__tm_tensor__"]]
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_unflatten(v, tensors) for v in obj)
    return obj


def digest_tensors(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _wait(work, what: str):
    # Timeouts are those of the group (set when it was built); a failure names the step.
    try:
        work.wait()
    except RuntimeError as exc:
        raise MigrationError(f"state transfer: {what} failed: {exc}", phase="switch") from exc


def _by_dtype(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, list[torch.Tensor]]]:
    """Tensors grouped by dtype, in first-seen order: the same on sender and receiver."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.items())


@dataclass
class TransferStats:
    bytes: int
    seconds: float
    tensors: int
    digest: str


def send_state(state: dict, pg, *, dst: int = 1, corrupt: bool = False) -> TransferStats:
    t0 = time.perf_counter()
    tensors: list[torch.Tensor] = []
    paths: list[str] = []
    skeleton = _flatten(state, tensors, paths)
    tensors = [t.detach().contiguous() for t in tensors]
    digest = digest_tensors(tensors)
    buf = io.BytesIO()
    specs = [(p, tuple(t.shape), str(t.dtype)) for p, t in zip(paths, tensors)]
    torch.save({"skeleton": skeleton, "specs": specs, "digest": digest}, buf)
    manifest = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    _wait(pg.send([torch.tensor([manifest.numel()], dtype=torch.int64)], dst, 0), "manifest length")
    _wait(pg.send([manifest], dst, 1), "manifest")
    nbytes = manifest.numel()
    for tag, (dtype, members) in enumerate(_by_dtype(tensors), start=2):
        flat = torch.cat([t.reshape(-1) for t in members])
        if corrupt and tag == 2 and flat.numel():  # fault injection: flip bytes on the wire
            flat.view(torch.uint8)[0] ^= 0xFF
        _wait(pg.send([flat], dst, tag), f"{dtype} buffer")
        nbytes += flat.numel() * flat.element_size()
    return TransferStats(nbytes, time.perf_counter() - t0, len(tensors), digest)


def recv_state(pg, *, src: int = 0, like: dict | None = None) -> tuple[dict, TransferStats]:
    """Receive a state; tensors land in `like`'s tensors when key, shape and dtype match."""
    t0 = time.perf_counter()
    length = torch.zeros(1, dtype=torch.int64)
    _wait(pg.recv([length], src, 0), "manifest length")
    if not 0 < int(length) < (1 << 31):
        raise MigrationError(f"state transfer: bad manifest length {int(length)}", phase="switch")
    manifest = torch.empty(int(length), dtype=torch.uint8)
    _wait(pg.recv([manifest], src, 1), "manifest")
    try:
        meta = torch.load(io.BytesIO(manifest.numpy().tobytes()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a protocol error
        raise MigrationError(f"state transfer: undecodable manifest: {exc}", phase="switch") from exc
    have: list[torch.Tensor] = []
    have_paths: list[str] = []
    if like is not None:
        _flatten(like, have, have_paths)
    targets = dict(zip(have_paths, have))
    into = []
    for path, shape, dtype in meta["specs"]:
        dt = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(dt, torch.dtype):
            raise MigrationError(f"state transfer: unknown dtype {dtype!r} at {path}", phase="switch")
        t = targets.get(path)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dt or not t.is_contiguous():
            t = torch.empty(shape, dtype=dt)
        into.append(t)
    nbytes = manifest.numel()
    for tag, (dtype, members) in enumerate(_by_dtype(into), start=2):
        flat = torch.empty(sum(t.numel() for t in members), dtype=dtype)
        _wait(pg.recv([flat], src, tag), f"{dtype} buffer")
        nbytes += flat.numel() * flat.element_size()
        with torch.no_grad():
            for t, part in zip(members, flat.split([t.numel() for t in members])):
                t.copy_(part.view_as(t))
    got = digest_tensors(into)
    if got != meta["digest"]:
        raise MigrationError(f"state transfer: checksum mismatch (sent {meta['digest'][:12]}, "
                             f"received {got[:12]})", phase="switch")
    return _unflatten(meta["skeleton"], into), TransferStats(nbytes, time.perf_counter() - t0, len(into), got)
