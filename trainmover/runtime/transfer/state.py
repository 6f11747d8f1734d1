"""Move a rank's full training state to the rank that takes its slot.

Protocol, over a *channel* between the leaver (sender) and the joiner (receiver):
  1. the manifest: a `torch.save` of the state with every tensor replaced by its index,
     plus per-tensor (key path, shape, dtype) and a checksum of all tensor bytes; loaded
     with `weights_only=True`, so a peer cannot make us run code;
  2. the tensors, received *in place* where the receiver already holds a tensor of that
     key path, shape and dtype (a warm standby's buffers), else into a new one.
The receiver recomputes the checksum; a mismatch is an error, never silently used.

The manifest crosses the pair sealed with the job's key (`seal_manifest`: HMAC-SHA256 ahead of
its bytes) and the receiver checks it before decoding anything (`open_manifest`): a peer that is
not one of the job's ranks (a local user who joined the gloo or NCCL pair) cannot feed a joiner
its RNG state, counters, host tensors or checksums; the state is refused (`StateRefused`), never
loaded. On the CPU (gloo) path the wire tensors' bytes are bound to the key too (`wire_mac`: a
keyed BLAKE2b sent after them, checked before the state is used), so a peer that relays the
genuine manifest cannot swap the tensors behind it; GPU tensors (NCCL) are checked by word sums
only, their bootstrap kept from others by the store's encryption (docs/security.md).

Channels (one interface, two implementations):
  * `GlooChannel`: CPU tensors; one flat buffer per dtype, so a few large messages.
  * `trainmover.groups.nccl.backend.NcclChannel`: GPU tensors; one grouped NCCL send/recv of all
    tensors straight into the joiner's buffers (no staging copy); manifest via the job store.
"""
from __future__ import annotations

import hashlib
import hmac
import io
import logging
import threading
import time
from dataclasses import dataclass

import torch

from trainmover.errors import MigrationError
from trainmover.groups.tensors import by_dtype, digest_tensors, flatten, tensors_of, unflatten
from trainmover.runtime.transfer import plan as xferplan

log = logging.getLogger(__name__)

ATTEMPTS = 3  # sends of one state before a persistent checksum mismatch is an error
MANIFEST_TIMEOUT_S = 300.0  # bound on a manifest fetched beside the posted receives (the store's own timeout applies too)


class ChecksumMismatch(MigrationError):
    """The received bytes are not the bytes sent: the copy is retried, never used."""


class StateRefused(MigrationError):
    """A manifest not sealed with the job's key: not from one of the job's ranks; never retried."""


_MANIFEST_LABEL = b"trainmover state manifest\0"  # a MAC made for another purpose never passes
_MAC_LEN = 32


def _manifest_mac(key: bytes, context: str, manifest: bytes) -> bytes:
    return hmac.new(key, _MANIFEST_LABEL + context.encode() + b"\0" + manifest, hashlib.sha256).digest()


def seal_manifest(key: bytes | None, manifest: bytes, context: str = "") -> bytes:
    """`manifest` with HMAC-SHA256 under the job's key ahead of it (`key` None: as it is; the
    check tool's own processes only). `context` names the transfer (its pair's prefix: epoch and
    rank), so that a manifest sealed for one transfer cannot be replayed into another."""
    if key is None:
        return manifest
    return _manifest_mac(key, context, manifest) + manifest


def open_manifest(key: bytes | None, data: bytes, context: str = "") -> bytes:
    """The manifest `seal_manifest` sealed with `key` for `context`; StateRefused otherwise
    (before a byte of it is decoded)."""
    if key is None:
        return data
    mac, manifest = data[:_MAC_LEN], data[_MAC_LEN:]
    if len(data) < _MAC_LEN or not hmac.compare_digest(mac, _manifest_mac(key, context, manifest)):
        raise StateRefused("state transfer: refused: the manifest is not sealed with the job's key (a peer that "
                           "is not one of the job's ranks joined the pair?); nothing of it is loaded", phase="switch")
    return manifest


_WIRE_LABEL = b"trainmover wire tensors\0"


def wire_mac(key: bytes, context: str, sig: str, tensors: list[torch.Tensor]) -> bytes:
    """A keyed BLAKE2b (32 bytes) over host tensors' bytes, each with its length, bound to the
    transfer (`context`) and the plan (`sig`): what the planned protocol's CPU wire carries.
    BLAKE2b, not HMAC-SHA256: faster on a CPU (64 MiB: 0.32 s against 0.54 s on the 2-core
    development machine, 2026-11-28), and keyed BLAKE2b is a MAC by design."""
    sub = hmac.new(key, _WIRE_LABEL, hashlib.sha256).digest()  # the job's key may be longer than BLAKE2b takes
    h = hashlib.blake2b(key=sub, digest_size=_MAC_LEN)
    h.update(context.encode() + b"\0" + sig.encode() + b"\0")
    for t in tensors:
        flat = t.detach().reshape(-1)
        h.update(flat.numel().to_bytes(8, "little") + str(t.dtype).encode())
        if flat.numel():
            h.update(flat.contiguous().view(torch.uint8).numpy().data)  # no copy
    return h.digest()


def _wait(work, what: str):
    try:
        work.wait()
    except RuntimeError as exc:  # timeouts are the group's (set when it was built)
        raise MigrationError(f"state transfer: {what} failed: {exc}", phase="switch") from exc


class GlooChannel:
    """The transfer channel over a 2-member gloo group (CPU tensors)."""

    HOST_WIRE = True  # the planned protocol's wire is host memory: MACed (wire_mac), no device copy

    def __init__(self, pg):
        self.pg = pg

    def send_bytes(self, data: bytes, dst: int) -> None:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        _wait(self.pg.send([torch.tensor([payload.numel()], dtype=torch.int64)], dst, 0), "manifest length")
        _wait(self.pg.send([payload], dst, 1), "manifest")

    def recv_bytes(self, src: int) -> bytes:
        length = torch.zeros(1, dtype=torch.int64)
        _wait(self.pg.recv([length], src, 0), "manifest length")
        if not 0 < int(length) < (1 << 31):
            raise MigrationError(f"state transfer: bad manifest length {int(length)}", phase="switch")
        payload = torch.empty(int(length), dtype=torch.uint8)
        _wait(self.pg.recv([payload], src, 1), "manifest")
        return payload.numpy().tobytes()

    def send_tensors(self, tensors: list[torch.Tensor], dst: int, corrupt: bool = False) -> None:
        for tag, (dtype, members) in enumerate(by_dtype(tensors), start=2):
            flat = torch.cat([t.reshape(-1) for t in members])
            if corrupt and tag == 2 and flat.numel():  # fault injection: flip bytes on the wire
                flat.view(torch.uint8)[0] ^= 0xFF
            _wait(self.pg.send([flat], dst, tag), f"{dtype} buffer")

    def send_verdict(self, verdict: int, dst: int) -> None:
        _wait(self.pg.send([torch.tensor([verdict], dtype=torch.int64)], dst, 99), "verdict")

    def recv_verdict(self, src: int) -> int:
        t = torch.zeros(1, dtype=torch.int64)
        _wait(self.pg.recv([t], src, 99), "verdict")
        return int(t)

    def next_attempt(self) -> None:
        pass  # tags are matched in order: a resend needs no new names

    def recv_tensors(self, tensors: list[torch.Tensor], src: int) -> None:
        for tag, (dtype, members) in enumerate(by_dtype(tensors), start=2):
            flat = torch.empty(sum(t.numel() for t in members), dtype=dtype)
            _wait(self.pg.recv([flat], src, tag), f"{dtype} buffer")
            with torch.no_grad():
                for t, part in zip(members, flat.split([t.numel() for t in members])):
                    t.copy_(part.view_as(t))


    # --- the planned protocol (runtime/transfer/plan.py): wire tensors in chunks, checked as they land
    def send_planned(self, plan, dst: int, corrupt: bool = False, manifest=None) -> None:
        """`manifest()`: its bytes, sent first (gloo matches messages in order)."""
        self.send_bytes(manifest(), dst)
        plan.pack()
        for c in range(len(plan.chunks)):
            plan.check_chunk(c, finite=False)
        t0 = time.perf_counter()
        for tag, t in enumerate(plan.wire, start=2):
            if corrupt and tag == 2:  # fault injection: the first wire tensor arrives with a flipped byte
                t = t.clone()
                t.view(-1).view(torch.uint8)[0] ^= 0xFF
            _wait(self.pg.send([t.reshape(-1)], dst, tag), f"wire tensor {tag - 2}")
        _wait(self.pg.send([plan.sums], dst, len(plan.wire) + 2), "word sums")
        self.group_s = time.perf_counter() - t0

    def early_sig(self, src: int) -> str | None:
        return None  # the plan is known from the manifest only

    def finish_planned(self, posted) -> dict:
        return posted

    def recv_planned(self, plan, src: int) -> dict:
        plan.reset()
        t0 = time.perf_counter()
        tag = 2
        for c, chunk in enumerate(plan.chunks):
            for t in chunk:
                _wait(self.pg.recv([t.view(-1)], src, tag), f"wire tensor {tag - 2}")
                tag += 1
            plan.check_chunk(c)  # on the CPU in line: the checks of the last chunk are the tail
        t1 = time.perf_counter()
        _wait(self.pg.recv([plan.peer_sums], src, tag), "word sums")
        plan.unpack()
        self.group_s = time.perf_counter() - t0
        return {"copy_s": self.group_s, "verify_tail_s": 0.0, "checks_inline_s": t1 - t0}


def channel_for(xfer):
    """The channel for a transfer group: NCCL backends bring their own."""
    return xfer.channel() if hasattr(xfer, "channel") else GlooChannel(xfer)


@dataclass
class TransferStats:
    bytes: int
    seconds: float       # whole call: checksum, manifest and tensors
    tensors: int
    digest: str
    copy_s: float = 0.0  # moving the tensors alone
    attempts: int = 1    # sends needed (more than 1: a checksum mismatch was retried)
    parts: dict | None = None  # planned protocol: where the time went (manifest, copy, verify, ...)


def pack(state: dict) -> tuple[bytes, list[torch.Tensor], str]:
    """A state as (manifest, tensors, checksum): what a transfer sends and a checkpoint file
    holds. The manifest is a `torch.save` of the state with every tensor replaced by its index,
    the (key path, shape, dtype, device) of each tensor and the checksum of all tensor bytes."""
    tensors: list[torch.Tensor] = []
    paths: list[str] = []
    skeleton = flatten(state, tensors, paths)
    tensors = [t.detach().contiguous() for t in tensors]
    digest = digest_tensors(tensors)
    buf = io.BytesIO()
    specs = [(p, tuple(t.shape), str(t.dtype), t.device.type) for p, t in zip(paths, tensors)]
    torch.save({"skeleton": skeleton, "specs": specs, "digest": digest}, buf)
    return buf.getvalue(), tensors, digest


def unpack(manifest: bytes, like: dict | None = None) -> tuple[dict, list[torch.Tensor]]:
    """Decode a manifest (weights_only: a peer or a file cannot make us run code) and give the
    tensors to fill: `like`'s where key path, shape and dtype match, else new ones."""
    try:
        meta = torch.load(io.BytesIO(manifest), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a protocol error
        raise MigrationError(f"state transfer: undecodable manifest: {exc}", phase="switch") from exc
    have: list[torch.Tensor] = []
    have_paths: list[str] = []
    if like is not None:
        flatten(like, have, have_paths)
    targets = dict(zip(have_paths, have))
    into = []
    for path, shape, dtype, device in meta["specs"]:
        dt = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(dt, torch.dtype) or device not in ("cpu", "cuda"):
            raise MigrationError(f"state transfer: bad spec {dtype!r}/{device!r} at {path}", phase="switch")
        t = targets.get(path)
        if (t is None or tuple(t.shape) != tuple(shape) or t.dtype != dt or not t.is_contiguous()
                or t.device.type != device):
            t = torch.empty(shape, dtype=dt, device="cuda" if device == "cuda" else "cpu")
        into.append(t)
    return meta, into


def assemble(meta: dict, into: list[torch.Tensor]) -> tuple[dict, str]:
    """The state from a decoded manifest and its filled tensors, once their checksum matches."""
    got = digest_tensors(into)
    if got != meta["digest"]:
        raise ChecksumMismatch(f"state transfer: checksum mismatch (sent {meta['digest'][:12]}, "
                               f"received {got[:12]})", phase="switch")
    return unflatten(meta["skeleton"], into), got


def host_copy(state: dict) -> dict:
    """A deep copy of `state` with every tensor copied into host memory: what a snapshot or a
    checkpoint keeps, unaffected by the training steps that follow."""
    tensors: list[torch.Tensor] = []
    skeleton = flatten(state, tensors, [])
    return unflatten(skeleton, [t.detach().to("cpu", copy=True) for t in tensors])


def send_state(state: dict, xfer, *, key: bytes | None, context: str = "", dst: int = 1, corrupt: bool = False,
               chan=None) -> TransferStats:
    """`key`: the job's, sealing the manifest for `context` (seal_manifest)."""
    t0 = time.perf_counter()
    chan = chan or channel_for(xfer)
    manifest, tensors, digest = pack(state)
    chan.send_bytes(seal_manifest(key, manifest, context), dst)
    t1 = time.perf_counter()
    chan.send_tensors(tensors, dst, corrupt=corrupt)
    t2 = time.perf_counter()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return TransferStats(nbytes, t2 - t0, len(tensors), digest, getattr(chan, "group_s", 0.0) or t2 - t1)


def recv_state(xfer, *, key: bytes | None, context: str = "", src: int = 0, like: dict | None = None,
               chan=None) -> tuple[dict, TransferStats]:
    """Receive a state; tensors land in `like`'s tensors when key, shape and dtype match. Its
    manifest must be sealed with `key` (StateRefused)."""
    t0 = time.perf_counter()
    chan = chan or channel_for(xfer)
    meta, into = unpack(open_manifest(key, chan.recv_bytes(src), context), like)
    t1 = time.perf_counter()
    with torch.no_grad():
        chan.recv_tensors(into, src)
    copy_s = getattr(chan, "group_s", 0.0) or time.perf_counter() - t1
    state, got = assemble(meta, into)
    nbytes = sum(t.numel() * t.element_size() for t in into)
    return state, TransferStats(nbytes, time.perf_counter() - t0, len(into), got, copy_s)


# --- the planned protocol: layout worked out in Phase 1 (transfer/plan.py) ----------------------
def send_planned(state: dict, chan, plan, *, key: bytes | None, context: str = "", dst: int = 1,
                 corrupt: bool = False):
    """Send `state` by `plan` (made ahead from this very state's tensors; rebuilt here if they
    changed since). The manifest carries the skeleton, the specs and their signature, and the
    host tensors (RNG states, step counters) with their digest; the wire carries the rest."""
    t0 = time.perf_counter()
    tensors: list[torch.Tensor] = []
    skeleton = flatten(state, tensors, [])
    ahead = plan is not None and plan.still_describes(tensors)
    if not ahead:
        skeleton, plan = xferplan.of_state(state)
        tensors = plan.tensors
    t1 = time.perf_counter()
    encoded = {}

    def manifest() -> bytes:
        # built while the wire tensors are on their way where the channel allows (NCCL)
        cpu = plan.pack_host(tensors)
        buf = io.BytesIO()
        torch.save({"skeleton": skeleton, "specs": plan.specs, "sig": plan.sig, "cpu": cpu,
                    "cpu_digest": digest_tensors(cpu)}, buf)
        encoded["s"] = time.perf_counter() - t1
        return seal_manifest(key, buf.getvalue(), context)
    chan.send_planned(plan, dst, corrupt=corrupt, manifest=manifest)
    if key is not None and chan.HOST_WIRE:
        # after the wire (gloo matches the bytes' tags in order: the manifest, then this)
        chan.send_bytes(wire_mac(key, context, plan.sig, plan.wire), dst)
    t2 = time.perf_counter()
    return TransferStats(plan.bytes, t2 - t0, len(plan.tensors), plan.sig, getattr(chan, "group_s", 0.0) or t2 - t1,
                         parts={"state_walk_s": round(t1 - t0, 5), "manifest_at_s": round(encoded.get("s", 0.0), 5),
                                "send_s": round(t2 - t1, 5), "plan_ahead": ahead,
                                "marks": getattr(chan, "send_marks", None), "checks_graphed": plan.graphed,
                                "chunks": len(plan.chunks), "wire_tensors": len(plan.wire)})


def warm_manifest(state: dict, plan) -> None:
    """Encode and decode a manifest of `state` once before the pause: the first weights-only
    load of a process sets itself up (its allow-lists, hundreds of small host tensors' storages)."""
    tensors: list[torch.Tensor] = []
    skeleton = flatten(state, tensors, [])
    cpu = plan.pack_host(tensors)
    buf = io.BytesIO()
    torch.save({"skeleton": skeleton, "specs": plan.specs, "sig": plan.sig, "cpu": cpu,
                "cpu_digest": digest_tensors(cpu)}, buf)
    meta = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    digest_tensors(meta["cpu"])


def recv_planned(chan, guess, *, key: bytes | None, context: str = "", src: int = 0, like: dict | None = None):
    """Receive by the sender's plan: into `guess` (the joiner's Phase-1 plan of its own buffers)
    when the signatures match, else into a plan made now from the sender's specs. Returns
    (state, stats, non-finite floating tensors); a word-sum mismatch raises ChecksumMismatch."""
    t0 = time.perf_counter()
    # Where the channel tells the sender's signature ahead (NCCL: a store key set before its
    # sends) and it is this joiner's Phase-1 plan's, the receives are posted at once and the
    # manifest is read while the wire tensors land.
    early = guess is not None and chan.early_sig(src) == guess.sig
    fetched: dict = {}
    if early:
        # the manifest is fetched and decoded in a thread while this one posts the receives
        # (posting a grouped NCCL receive returns only once the sender's sends are matched)
        def fetch():
            try:
                data = open_manifest(key, chan.recv_bytes(src), context)  # the MAC first: nothing unsealed is decoded
                fetched["meta"] = torch.load(io.BytesIO(data), weights_only=True)
            except Exception as exc:  # noqa: BLE001 - reported below, as a protocol error
                fetched["error"] = exc
        reader = threading.Thread(target=fetch, name="tm-manifest", daemon=True)
        reader.start()
    posted = chan.recv_planned(guess, src) if early else None
    try:
        if early:
            reader.join(MANIFEST_TIMEOUT_S)
            if isinstance(fetched.get("error"), StateRefused):
                raise fetched["error"]
            if "error" in fetched or "meta" not in fetched:
                raise ValueError(fetched.get("error") or f"no manifest within {MANIFEST_TIMEOUT_S:g}s")
            meta = fetched["meta"]
        else:
            meta = torch.load(io.BytesIO(open_manifest(key, chan.recv_bytes(src), context)), weights_only=True)
        if meta["sig"] != xferplan.signature(meta["specs"]) or (early and meta["sig"] != guess.sig):
            raise ValueError("the signature does not match the specs")
        plan = guess if guess is not None and guess.sig == meta["sig"] else xferplan.into(meta["specs"], like)
    except MigrationError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a protocol error
        raise MigrationError(f"state transfer: undecodable manifest: {exc}", phase="switch") from exc
    cpu = meta["cpu"]
    if digest_tensors(cpu) != meta["cpu_digest"]:
        raise ChecksumMismatch("state transfer: the host tensors of the manifest do not match its digest",
                               phase="switch")
    try:
        plan.unpack_host(cpu)
    except ValueError as exc:
        raise MigrationError(f"state transfer: {exc}", phase="switch") from exc
    t1 = time.perf_counter()
    parts = chan.finish_planned(posted if early else chan.recv_planned(plan, src))
    # read before any verdict: a retry's manifest must not meet this attempt's MAC
    peer_mac = chan.recv_bytes(src) if key is not None and chan.HOST_WIRE else None
    t2 = time.perf_counter()
    bad, nonfin = plan.verdict()
    t3 = time.perf_counter()
    if bad:
        raise ChecksumMismatch(f"state transfer: {bad} of {len(plan.wire)} wire tensors arrived with other "
                               f"word sums than sent", phase="switch")
    if peer_mac is not None:
        t_mac = time.perf_counter()
        if not hmac.compare_digest(peer_mac, wire_mac(key, context, plan.sig, plan.wire)):  # type: ignore[arg-type]
            raise StateRefused("state transfer: refused: the wire tensors are not the ones a rank holding the "
                               "job's key sent (a peer that is not one of the job's ranks joined the pair?); "
                               "nothing of them is loaded", phase="switch")
        parts = {**parts, "wire_mac_s": round(time.perf_counter() - t_mac, 5)}
    state = unflatten(meta["skeleton"], plan.tensors)
    nonfin += nonfinite(cpu)
    parts = {**parts, "manifest_s": round(t1 - t0, 5), "recv_s": round(t2 - t1, 5), "posted_early": early,
             "verdict_read_s": round(t3 - t2, 5), "into_own_buffers": plan is guess,
             "chunks": len(plan.chunks), "wire_tensors": len(plan.wire)}
    stats = TransferStats(plan.bytes, time.perf_counter() - t0, len(plan.tensors), plan.sig,
                          parts.get("copy_s") or t2 - t1, parts=parts)
    return state, stats, nonfin


# --- verified transfer: checksum, retry, refuse non-finite state -------------------------
OK, AGAIN, REFUSED = 1, 2, 3


def send_verified(state: dict, xfer, *, key: bytes | None, context: str = "", dst: int = 1, corrupt: bool = False,
                  plan=False) -> TransferStats:
    """`send_state`, then wait for the receiver's verdict: on a checksum mismatch send again
    (up to ATTEMPTS times). `corrupt` (fault injection) spoils the first attempt only.
    `plan` (not False): the planned protocol, by this plan made ahead (None: made now); the
    receiver must call `recv_verified` with a `plan` too. `key`: the job's (seal_manifest); None
    only between the check tool's own processes. `context`: the transfer's name, the same on
    both sides (its pair's prefix)."""
    chan = channel_for(xfer)
    for attempt in range(1, ATTEMPTS + 1):
        bad = corrupt and attempt == 1
        stats = (send_state(state, xfer, key=key, context=context, dst=dst, corrupt=bad, chan=chan) if plan is False
                 else send_planned(state, chan, plan, key=key, context=context, dst=dst, corrupt=bad))
        verdict = chan.recv_verdict(dst)
        if verdict == OK:
            stats.attempts = attempt
            return stats
        if verdict == REFUSED:
            raise MigrationError("state transfer: the receiver refused the state (non-finite values)", phase="switch")
        log.warning("state transfer attempt %d: receiver saw a checksum mismatch; sending again", attempt)
        chan.next_attempt()
    raise MigrationError(f"state transfer: checksum mismatch in all {ATTEMPTS} attempts", phase="switch")


def recv_verified(xfer, *, key: bytes | None, context: str = "", src: int = 0, like: dict | None = None,
                  plan=False) -> tuple[dict, TransferStats]:
    """`recv_state` with the receiver's side of `send_verified`: a checksum mismatch asks for
    the state again; NaN or Inf in floating-point state is refused (an error, never loaded).
    `plan` (not False): the planned protocol, received into this plan's buffers when the
    sender's layout is the same (None: into `like`'s, planned now). A manifest not sealed with
    `key` raises StateRefused at once: not retried, nothing loaded."""
    chan = channel_for(xfer)
    for attempt in range(1, ATTEMPTS + 1):
        try:
            if plan is False:
                state, stats = recv_state(xfer, key=key, context=context, src=src, like=like, chan=chan)
                bad = None
            else:
                state, stats, bad = recv_planned(chan, plan, key=key, context=context, src=src, like=like)
        except ChecksumMismatch as exc:
            log.warning("state transfer attempt %d: %s; asking again", attempt, exc)
            chan.send_verdict(AGAIN, src)
            chan.next_attempt()
            continue
        bad = nonfinite(tensors_of(state)) if bad is None else bad
        if bad:
            chan.send_verdict(REFUSED, src)
            raise MigrationError(f"state transfer: refused: {bad} tensor(s) hold NaN or Inf", phase="switch")
        chan.send_verdict(OK, src)
        stats.attempts = attempt
        return state, stats
    raise MigrationError(f"state transfer: checksum mismatch in all {ATTEMPTS} attempts", phase="switch")


def nonfinite(tensors: list[torch.Tensor]) -> int:
    """How many floating-point tensors hold a NaN or Inf (one host sync for all of them)."""
    flags = [~torch.isfinite(t).all() for t in tensors if t.is_floating_point() and t.numel()]
    if not flags:
        return 0
    return int(torch.stack([f.to(flags[0].device) for f in flags]).sum())
