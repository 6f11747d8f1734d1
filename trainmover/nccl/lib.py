"""ctypes binding of the communicator-delta library (`cuda/`, built by scripts/build_cuda.sh).

Two shared objects:
* `cuda/build/libtmdelta.so`: everything (needs libnccl.so.2 and libcudart.so at load time);
* `cuda/build/libtmdelta_plan.so`: the delta plan and the slot transition table only (no
  NCCL/CUDA), so `plan()` and `slot_transition()` work on any machine the library builds on.

`TM_NCCL_LIB` / `TM_NCCL_PLAN_LIB` override their paths (read once, in `_paths`). Nothing is
compiled at import; nothing is loaded until first use. ctypes releases the GIL during every
call, so `Comm.wait` in a Phase-1 thread does not stall training.

Every nonzero status raises `NcclError` (a `MigrationError`) carrying the library's message,
which names the communicator or slot, its rank and the phase; timeouts raise `NcclTimeout`
(also a `DeadlineExceeded`), illegal transitions `NcclStateError`.
"""
from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from trainmover.errors import DeadlineExceeded, MigrationError

UNIQUE_ID_BYTES = 128
_REPO = Path(__file__).resolve().parents[2]


class Status(enum.IntEnum):  # tm_status in cuda/include/tmdelta.h
    OK = 0
    INVALID = 1
    STATE = 2
    NCCL = 3
    CUDA = 4
    TIMEOUT = 5
    NOMEM = 6
    UNSUPPORTED = 7
    INTERNAL = 8


class CommState(enum.IntEnum):  # tm_comm_state
    INITIALIZING = 0
    READY = 1
    FAILED = 2
    REVOKED = 3
    ABORTED = 4
    DESTROYED = 5


class SlotState(enum.IntEnum):  # tm_slot_state
    ACTIVE = 0
    PREPARED = 1
    SWITCHING = 2
    CLOSED = 3


class SlotEvent(enum.IntEnum):  # tm_slot_event
    PREPARE = 0
    SWITCH = 1
    SWITCHED = 2
    CANCEL = 3
    CLOSE = 4


class NcclError(MigrationError):
    """A call into libtmdelta failed; `status` is the library's tm_status."""

    def __init__(self, message: str, status: int = Status.INTERNAL):
        super().__init__(message)
        self.status = Status(status) if status in Status._value2member_map_ else status


class NcclTimeout(NcclError, DeadlineExceeded):
    """A deadline in the library ran out (init, revoke or an enqueue settling)."""


class NcclStateError(NcclError):
    """An illegal transition of a slot or a call on a communicator in the wrong state."""


class NcclUnavailable(NcclError):
    """The library is not built or cannot be loaded here."""


# ---- loading ----------------------------------------------------------------------------------

def _paths() -> tuple[Path, Path]:
    build = _REPO / "cuda" / "build"
    full = os.environ.get("TM_NCCL_LIB") or str(build / "libtmdelta.so")
    plan = os.environ.get("TM_NCCL_PLAN_LIB") or str(build / "libtmdelta_plan.so")
    return Path(full), Path(plan)


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | str] = {}  # "full"/"plan" -> library, or the reason it failed

_c_int_p = ctypes.POINTER(ctypes.c_int)
_PLAN_SIGS = {
    "tm_last_error": ([], ctypes.c_char_p),
    "tm_nccl_version": ([_c_int_p, _c_int_p], ctypes.c_int),
    "tm_plan_changed": ([ctypes.c_int, _c_int_p, _c_int_p, ctypes.c_int, _c_int_p,
                         ctypes.POINTER(ctypes.c_ubyte)], ctypes.c_int),
    "tm_plan_for_rank": ([ctypes.c_int, _c_int_p, _c_int_p, ctypes.c_int, _c_int_p, ctypes.c_int,
                          ctypes.c_int, _c_int_p, _c_int_p, _c_int_p], ctypes.c_int),
    "tm_slot_transition": ([ctypes.c_int, ctypes.c_int, _c_int_p], ctypes.c_int),
}
_vp, _sz, _ci = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
_FULL_SIGS = dict(_PLAN_SIGS, **{
    "tm_get_unique_id": ([ctypes.c_char_p], _ci),
    "tm_comm_init_start": ([ctypes.c_char_p, ctypes.c_char_p, _ci, _ci, _ci, ctypes.POINTER(_vp)], _ci),
    "tm_comm_poll": ([_vp, _c_int_p], _ci),
    "tm_comm_wait": ([_vp, _ci], _ci),
    "tm_comm_revoke": ([_vp], _ci),
    "tm_comm_abort": ([_vp], _ci),
    "tm_comm_destroy": ([_vp], _ci),
    "tm_comm_release": ([_vp], _ci),
    "tm_comm_info": ([_vp, _c_int_p, _c_int_p, _c_int_p, _c_int_p], _ci),
    "tm_comm_set_op_timeout": ([_vp, _ci], _ci),
    "tm_comm_count_created": ([ctypes.POINTER(ctypes.c_longlong)], _ci),
    "tm_allreduce": ([_vp, _vp, _vp, _sz, _ci, _ci, _vp], _ci),
    "tm_broadcast": ([_vp, _vp, _vp, _sz, _ci, _ci, _vp], _ci),
    "tm_allgather": ([_vp, _vp, _vp, _sz, _ci, _vp], _ci),
    "tm_reduce_scatter": ([_vp, _vp, _vp, _sz, _ci, _ci, _vp], _ci),
    "tm_send": ([_vp, _vp, _sz, _ci, _ci, _vp], _ci),
    "tm_recv": ([_vp, _vp, _sz, _ci, _ci, _vp], _ci),
    "tm_group_start": ([], _ci),
    "tm_group_end": ([], _ci),
    "tm_slot_create": ([ctypes.c_char_p, _vp, ctypes.POINTER(_vp)], _ci),
    "tm_slot_prepare": ([_vp, _vp], _ci),
    "tm_slot_switch": ([_vp], _ci),
    "tm_slot_cancel": ([_vp], _ci),
    "tm_slot_active": ([_vp, ctypes.POINTER(_vp)], _ci),
    "tm_slot_state_of": ([_vp, _c_int_p], _ci),
    "tm_slot_destroy": ([_vp], _ci),
    "tm_test_comm_fake": ([ctypes.c_char_p, _ci, _ci, ctypes.POINTER(_vp)], _ci),
})


def _load(kind: str) -> ctypes.CDLL:
    with _lock:
        got = _loaded.get(kind)
        if got is None:
            path = _paths()[0 if kind == "full" else 1]
            sigs = _FULL_SIGS if kind == "full" else _PLAN_SIGS
            if not path.is_file():
                got = f"{path} is not built (run scripts/build_cuda.sh)"
            else:
                try:
                    lib = ctypes.CDLL(str(path))
                    for name, (args, res) in sigs.items():
                        fn = getattr(lib, name)
                        fn.argtypes, fn.restype = args, res
                    got = lib
                except (OSError, AttributeError) as exc:
                    got = f"cannot load {path}: {exc}"
            _loaded[kind] = got
    if isinstance(got, str):
        raise NcclUnavailable(got, Status.UNSUPPORTED)
    return got


def load() -> ctypes.CDLL:
    """The full library; raises NcclUnavailable with the reason if it cannot be loaded."""
    return _load("full")


def _plan_lib() -> ctypes.CDLL:
    try:
        return _load("full")
    except NcclUnavailable:
        return _load("plan")


def available() -> tuple[bool, str]:
    """(True, "NCCL <version>") if the full library loads here, else (False, why). Never raises.
    A GPU is not needed for True: only the NCCL and CUDA runtime libraries."""
    try:
        compiled, runtime = nccl_version()
        _load("full")
    except NcclError as exc:
        return False, str(exc)
    return True, f"NCCL {_fmt_version(runtime)} (compiled against {_fmt_version(compiled)})"


def _fmt_version(code: int) -> str:
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def _check(lib: ctypes.CDLL, rc: int) -> None:
    if rc == Status.OK:
        return
    msg = (lib.tm_last_error() or b"").decode(errors="replace") or f"libtmdelta status {rc}"
    cls = {Status.TIMEOUT: NcclTimeout, Status.STATE: NcclStateError}.get(rc, NcclError)
    raise cls(msg, rc)


# ---- plan and slot table (pure; work with the plan-only library too) --------------------------

@dataclass(frozen=True)
class NativePlan:
    changed: tuple[bool, ...]                 # per group, in the order given
    mine: tuple[tuple[int, int], ...] = ()    # (group index, group rank) for `rank`, if asked


def _csr(groups: Sequence) -> tuple[int, ctypes.Array, ctypes.Array]:
    members = [tuple(getattr(g, "ranks", g)) for g in groups]
    offsets = [0]
    for m in members:
        offsets.append(offsets[-1] + len(m))
    flat = [r for m in members for r in m]
    return len(members), (ctypes.c_int * len(offsets))(*offsets), (ctypes.c_int * max(1, len(flat)))(*flat)


def plan(groups: Sequence, leavers: Iterable[int], rank: int | None = None) -> NativePlan:
    """Which groups change when `leavers` go (groups: GroupSpecs or rank sequences in group-rank
    order) and, for `rank`, the changed groups it rebuilds with its group rank in each.
    Raises NcclError (status INVALID) on the inputs trainmover.runtime.plan.delta rejects."""
    lib = _plan_lib()
    n, offsets, ranks = _csr(groups)
    lv = list(leavers)
    leave = (ctypes.c_int * max(1, len(lv)))(*lv)
    changed = (ctypes.c_ubyte * max(1, n))()
    _check(lib, lib.tm_plan_changed(n, offsets, ranks, len(lv), leave, changed))
    mine: tuple[tuple[int, int], ...] = ()
    if rank is not None:
        og, orank, count = (ctypes.c_int * max(1, n))(), (ctypes.c_int * max(1, n))(), ctypes.c_int()
        _check(lib, lib.tm_plan_for_rank(n, offsets, ranks, len(lv), leave, rank, n, og, orank,
                                         ctypes.byref(count)))
        mine = tuple((og[i], orank[i]) for i in range(count.value))
    return NativePlan(tuple(bool(changed[i]) for i in range(n)), mine)


def slot_transition(state: int, event: int) -> SlotState:
    """The slot table: the state after `event` in `state`; NcclStateError if illegal."""
    lib = _plan_lib()
    nxt = ctypes.c_int()
    _check(lib, lib.tm_slot_transition(int(state), int(event), ctypes.byref(nxt)))
    return SlotState(nxt.value)


def nccl_version() -> tuple[int, int]:
    """(compiled, runtime) NCCL_VERSION_CODE; (0, 0) from the plan-only library."""
    lib = _load("full")
    c, r = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.tm_nccl_version(ctypes.byref(c), ctypes.byref(r)))
    return c.value, r.value


# ---- communicators ----------------------------------------------------------------------------

def unique_id() -> bytes:
    lib = load()
    buf = ctypes.create_string_buffer(UNIQUE_ID_BYTES)
    _check(lib, lib.tm_get_unique_id(buf))
    return buf.raw


def created_count() -> int:
    """Communicators this process has started through the library."""
    lib = load()
    n = ctypes.c_longlong()
    _check(lib, lib.tm_comm_count_created(ctypes.byref(n)))
    return n.value


@contextlib.contextmanager
def group():
    """ncclGroupStart/End around the body: its sends/recvs form one grouped transfer. The end
    settles every communicator used inside (each bounded by its op timeout)."""
    lib = load()
    _check(lib, lib.tm_group_start())
    try:
        yield
    except BaseException:
        lib.tm_group_end()  # keep NCCL's group depth balanced; the body's error wins
        raise
    _check(lib, lib.tm_group_end())


# ncclDataType_t / ncclRedOp_t values (nccl.h; tests check them against the header when found).
_NCCL_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "int64": 4, "float16": 6, "float32": 7,
                "float64": 8, "bfloat16": 9}
_NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


def _dtype(t) -> int:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _NCCL_DTYPES:
        raise ValueError(f"dtype {t.dtype} is not supported (one of {sorted(_NCCL_DTYPES)})")
    return _NCCL_DTYPES[name]


def _op(op) -> int:
    """A name ("sum", "avg", ...) or a torch.distributed.ReduceOp."""
    if isinstance(op, str):
        key = op.lower()
    else:
        import torch.distributed as dist
        names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.PRODUCT: "prod", dist.ReduceOp.MAX: "max",
                 dist.ReduceOp.MIN: "min", dist.ReduceOp.AVG: "avg"}
        key = next((v for k, v in names.items() if op == k), "")
    if key not in _NCCL_OPS:
        raise ValueError(f"reduce op {op!r} is not supported (one of {sorted(_NCCL_OPS)})")
    return _NCCL_OPS[key]


def _buf(t, what: str):
    if t.device.type != "cuda":
        raise ValueError(f"{what}: NCCL needs a CUDA tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous")
    return ctypes.c_void_p(t.data_ptr()), t.numel()


def _stream(stream) -> ctypes.c_void_p:
    if stream is None:
        import torch
        stream = torch.cuda.current_stream()
    return ctypes.c_void_p(getattr(stream, "cuda_stream", stream))


class Comm:
    """One NCCL communicator, non-blocking. Build with `Comm.init_start(...)` then `wait()`."""

    def __init__(self, handle: ctypes.c_void_p, name: str):
        self._lib, self._h, self.name = load(), handle, name
        r, n, d, _ = self._info()
        self.rank, self.size, self.device = r, n, d

    @classmethod
    def init_start(cls, name: str, uid: bytes, nranks: int, rank: int, device: int) -> "Comm":
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"comm {name!r}: unique id has {len(uid)} bytes, expected {UNIQUE_ID_BYTES}")
        lib = load()
        h = ctypes.c_void_p()
        _check(lib, lib.tm_comm_init_start(name.encode(), uid, nranks, rank, device, ctypes.byref(h)))
        return cls(h, name)

    @classmethod
    def _fake(cls, name: str, rank: int, size: int) -> "Comm":
        """Test hook: a READY handle without NCCL behind it (slot logic without a GPU)."""
        lib = load()
        h = ctypes.c_void_p()
        _check(lib, lib.tm_test_comm_fake(name.encode(), rank, size, ctypes.byref(h)))
        return cls(h, name)

    def _info(self):
        r, n, d, s = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        _check(self._lib, self._lib.tm_comm_info(self._handle(), ctypes.byref(r), ctypes.byref(n),
                                                 ctypes.byref(d), ctypes.byref(s)))
        return r.value, n.value, d.value, s.value

    def _handle(self) -> ctypes.c_void_p:
        if self._h is None:
            raise NcclStateError(f"comm {self.name!r}: handle already released", Status.STATE)
        return self._h

    def _call(self, fn, *args) -> None:
        _check(self._lib, fn(self._handle(), *args))

    @property
    def state(self) -> CommState:
        return CommState(self._info()[3])

    def poll(self) -> bool:
        done = ctypes.c_int()
        self._call(self._lib.tm_comm_poll, ctypes.byref(done))
        return bool(done.value)

    def wait(self, timeout_ms: int) -> None:
        """Ready within `timeout_ms`, or NcclTimeout (the half-built communicator is aborted)."""
        self._call(self._lib.tm_comm_wait, int(timeout_ms))

    def set_op_timeout(self, timeout_ms: int) -> None:
        self._call(self._lib.tm_comm_set_op_timeout, int(timeout_ms))

    def revoke(self) -> None:
        self._call(self._lib.tm_comm_revoke)

    def abort(self) -> None:
        self._call(self._lib.tm_comm_abort)

    def destroy(self) -> None:
        self._call(self._lib.tm_comm_destroy)

    def release(self) -> None:
        """Drop this object's reference (the last one aborts a live communicator)."""
        h, self._h = self._h, None
        if h is not None:
            _check(self._lib, self._lib.tm_comm_release(h))

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to report to
            pass

    def __repr__(self) -> str:
        state = self.state.name if self._h is not None else "RELEASED"
        return f"Comm({self.name!r}, rank={self.rank}/{self.size}, device={self.device}, {state})"

    # Collectives: enqueued on `stream` (default: torch's current stream); return once enqueued.
    def allreduce(self, send, recv=None, op="sum", stream=None) -> None:
        recv = send if recv is None else recv
        (sp, n), (rp, m) = _buf(send, "allreduce"), _buf(recv, "allreduce")
        if n != m or send.dtype != recv.dtype:
            raise ValueError("allreduce: send and recv differ in size or dtype")
        self._call(self._lib.tm_allreduce, sp, rp, n, _dtype(send), _op(op), _stream(stream))

    def broadcast(self, send, recv=None, root: int = 0, stream=None) -> None:
        recv = send if recv is None else recv
        (sp, n), (rp, m) = _buf(send, "broadcast"), _buf(recv, "broadcast")
        if n != m or send.dtype != recv.dtype:
            raise ValueError("broadcast: send and recv differ in size or dtype")
        self._call(self._lib.tm_broadcast, sp, rp, n, _dtype(send), int(root), _stream(stream))

    def allgather(self, send, recv, stream=None) -> None:
        (sp, n), (rp, m) = _buf(send, "allgather"), _buf(recv, "allgather")
        if m != n * self.size or send.dtype != recv.dtype:
            raise ValueError(f"allgather: recv must hold {self.size} x {n} elements of {send.dtype}")
        self._call(self._lib.tm_allgather, sp, rp, n, _dtype(send), _stream(stream))

    def reduce_scatter(self, send, recv, op="sum", stream=None) -> None:
        (sp, n), (rp, m) = _buf(send, "reduce_scatter"), _buf(recv, "reduce_scatter")
        if n != m * self.size or send.dtype != recv.dtype:
            raise ValueError(f"reduce_scatter: send must hold {self.size} x {m} elements of {recv.dtype}")
        self._call(self._lib.tm_reduce_scatter, sp, rp, m, _dtype(send), _op(op), _stream(stream))

    def send(self, t, peer: int, stream=None) -> None:
        p, n = _buf(t, "send")
        self._call(self._lib.tm_send, p, n, _dtype(t), int(peer), _stream(stream))

    def recv(self, t, peer: int, stream=None) -> None:
        p, n = _buf(t, "recv")
        self._call(self._lib.tm_recv, p, n, _dtype(t), int(peer), _stream(stream))


class Slot:
    """A stable logical group whose communicator is replaced in two phases:
    `prepare(new)` after Phase 1, `switch()` at the iteration boundary (old one revoked and
    destroyed), or `cancel()` if the migration is called off (prepared one aborted)."""

    def __init__(self, name: str, initial: Comm):
        self._lib, self.name = load(), name
        h = ctypes.c_void_p()
        _check(self._lib, self._lib.tm_slot_create(name.encode(), initial._handle(), ctypes.byref(h)))
        self._h = h
        self._comms = {initial._handle().value: initial}  # keep Python objects of held comms

    def _handle(self) -> ctypes.c_void_p:
        if self._h is None:
            raise NcclStateError(f"slot {self.name!r}: closed", Status.STATE)
        return self._h

    def prepare(self, replacement: Comm) -> None:
        _check(self._lib, self._lib.tm_slot_prepare(self._handle(), replacement._handle()))
        self._comms[replacement._handle().value] = replacement

    def switch(self) -> None:
        _check(self._lib, self._lib.tm_slot_switch(self._handle()))
        self._forget_all_but_active()

    def cancel(self) -> None:
        _check(self._lib, self._lib.tm_slot_cancel(self._handle()))
        self._forget_all_but_active()

    @property
    def active(self) -> Comm:
        h = ctypes.c_void_p()
        _check(self._lib, self._lib.tm_slot_active(self._handle(), ctypes.byref(h)))
        return self._comms[h.value]

    @property
    def state(self) -> SlotState:
        s = ctypes.c_int()
        _check(self._lib, self._lib.tm_slot_state_of(self._handle(), ctypes.byref(s)))
        return SlotState(s.value)

    def close(self) -> None:
        """Aborts a pending replacement, releases the active communicator, frees the slot.
        Refused (NcclStateError) while a switch is in progress."""
        if self._h is not None:
            _check(self._lib, self._lib.tm_slot_destroy(self._h))
            self._h = None
        self._comms.clear()

    def _forget_all_but_active(self) -> None:
        active = self.active
        self._comms = {active._handle().value: active}

    def __repr__(self) -> str:
        return f"Slot({self.name!r}, {self.state.name if self._h is not None else 'CLOSED'})"
