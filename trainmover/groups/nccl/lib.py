"""ctypes binding of the communicator library (`cuda/`, built by scripts/build_cuda.sh):
`cuda/build/libtmdelta.so`, which needs libnccl.so.2 and libcudart.so at load time.

`TM_NCCL_LIB` (trainmover/config.py) overrides its path. Nothing is compiled at import; nothing
is loaded until first use. ctypes releases the GIL during every call, so `Comm.wait` in a
Phase-1 thread does not stall training.

Every nonzero status raises `NcclError` (a `MigrationError`) carrying the library's message,
which names the communicator, its rank and the phase; timeouts raise `NcclTimeout` (also a
`DeadlineExceeded`), calls on a communicator in the wrong state `NcclStateError`.
"""
from __future__ import annotations

import contextlib
import ctypes
import enum
import threading
from pathlib import Path

from trainmover import config
from trainmover.errors import DeadlineExceeded, MigrationError

UNIQUE_ID_BYTES = 128
_REPO = Path(__file__).resolve().parents[3]  # trainmover/groups/nccl/lib.py -> the repository


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


class NcclError(MigrationError):
    """A call into libtmdelta failed; `status` is the library's tm_status."""

    def __init__(self, message: str, status: int = Status.INTERNAL):
        super().__init__(message)
        self.status = Status(status) if status in Status._value2member_map_ else status


class NcclTimeout(NcclError, DeadlineExceeded):
    """A deadline in the library ran out (init, revoke or an enqueue settling)."""


class NcclStateError(NcclError):
    """A call on a communicator in the wrong state (e.g. a collective on a revoked one)."""


class NcclUnavailable(NcclError):
    """The library is not built or cannot be loaded here."""


# ---- loading ----------------------------------------------------------------------------------

def _path() -> Path:
    return Path(config.setting("TM_NCCL_LIB") or _REPO / "cuda" / "build" / "libtmdelta.so")


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | str] = {}  # "lib" -> the library, or the reason it failed to load

_c_int_p = ctypes.POINTER(ctypes.c_int)
_vp, _sz, _ci = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
_SIGS = {
    "tm_last_error": ([], ctypes.c_char_p),
    "tm_nccl_version": ([_c_int_p, _c_int_p], _ci),
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
}


def load() -> ctypes.CDLL:
    """The library; raises NcclUnavailable with the reason if it cannot be loaded."""
    with _lock:
        got = _loaded.get("lib")
        if got is None:
            path = _path()
            if not path.is_file():
                got = f"{path} is not built (run scripts/build_cuda.sh)"
            else:
                try:
                    lib = ctypes.CDLL(str(path))
                    for name, (args, res) in _SIGS.items():
                        fn = getattr(lib, name)
                        fn.argtypes, fn.restype = args, res
                    got = lib
                except (OSError, AttributeError) as exc:
                    got = f"cannot load {path}: {exc}"
            _loaded["lib"] = got
    if isinstance(got, str):
        raise NcclUnavailable(got, Status.UNSUPPORTED)
    return got


def available() -> tuple[bool, str]:
    """(True, "NCCL <version>") if the library loads here, else (False, why). Never raises.
    A GPU is not needed for True: only the NCCL and CUDA runtime libraries."""
    try:
        compiled, runtime = nccl_version()
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


# ---- version, unique ids, groups ------------------------------------------------------------

def nccl_version() -> tuple[int, int]:
    """(compiled, runtime) NCCL_VERSION_CODE."""
    lib = load()
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
