"""Recorded collectives (HDF5): what a live rank's collectives returned, in call order.

A job's recordings are versions of one base name, `<run dir>/recordings/rank<R>.h5`: version N
is `rank<R>.v<N>.h5` (written to a temporary name, renamed when complete, so a reader never
sees half a recording). A new version is recorded when a step's collectives change shape.

    /init/<seq>      collectives issued while the workload was built (DDP checks, broadcasts);
                     only in a recording that starts at the workload's construction
    /it<k>/<seq>     one dataset per output tensor of the k-th recorded iteration's seq-th
                     collective, flattened (chunked, not compressed); attrs: group, op, dtype, shape.
                     A point-to-point `send` keeps no data, only `digest` (SHA-256 of what the
                     live rank sent): a replay checks that the shadow step sends the same. On a
                     pipeline stage that is not the last, that is the check that its shadow
                     step computed what the live one did (its loss arrives by broadcast).
    /it<k>.attrs     loss of that iteration on the recording rank, and its training step
    /.attrs          rank, iterations, version, first_step, complete

bfloat16 has no numpy type: such tensors are stored as int16 words with their dtype in attrs.

Writing is off the training thread: outputs on a GPU are copied into pinned host buffers by
non-blocking copies on a side stream ordered after the collective, and a writer thread waits
for each copy and writes HDF5. The training thread only enqueues (see `RecordingWriter`).
"""
from __future__ import annotations

import hashlib
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from trainmover.errors import DeadlineExceeded, MigrationError
from trainmover.protocol import files

try:
    import h5py
except ImportError:  # the sandbox then answers collectives locally (see SandboxBackend)
    h5py = None

CHUNK_ELEMS = 1 << 18      # HDF5 chunk: 1 MiB of float32
SLICE_CHUNKS = 4           # chunks per write call: bounds how long the writer holds the GIL at once
COPY_DEADLINE_S = 120.0    # longest wait for one device-to-host copy in the writer thread


def available() -> tuple[bool, str]:
    return (h5py is not None, "" if h5py is not None else "h5py is not installed (pip install trainmover[sandbox])")


def base_of(directory: str | Path, rank: int) -> Path:
    """The base name of rank `rank`'s recordings in a job's recording directory."""
    return Path(directory) / f"rank{rank}.h5"


def version_path(base: Path, version: int) -> Path:
    base = Path(base)
    return base.with_name(f"{base.stem}.v{version}{base.suffix}")


def versions(base: Path) -> list[int]:
    """Complete versions present for `base`, oldest first (a writer's temporary is not one)."""
    base = Path(base)
    pattern = re.compile(re.escape(base.stem) + r"\.v(\d+)" + re.escape(base.suffix) + "$")
    if not base.parent.is_dir():
        return []
    return sorted(int(m.group(1)) for m in map(pattern.match, os.listdir(base.parent)) if m)


def _key(iteration: int | str) -> str:
    return "init" if iteration == "init" else f"it{int(iteration)}"


def _flat(tensors) -> list[torch.Tensor]:
    return [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]


# Tensor-in/tensor-out collectives, recorded under the name of their list form (what a
# SandboxBackend answers them as).
_TENSOR_OPS = {"_allgather_base": "allgather", "_reduce_scatter_base": "reduce_scatter"}


def outputs_of(op: str, args) -> list[torch.Tensor] | None:
    """The tensors a collective writes (for a `send`: the tensors it sends, recorded as
    digests), from the arguments of the ProcessGroup call (None for a barrier)."""
    if op == "barrier":
        return None
    if op in _TENSOR_OPS:  # (output, input): one output tensor, not a list
        return [args[0]]
    return _flat(args[0])


def signature_of(group: str, op: str, tensors) -> tuple:
    """What a replay checks of a collective: group, op, shapes and dtypes of its outputs."""
    return (group, _TENSOR_OPS.get(op, op),
            tuple((tuple(t.shape), str(t.dtype)) for t in tensors))


def _storage_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.int16 if dtype == torch.bfloat16 else dtype


def _words(t: torch.Tensor) -> torch.Tensor:
    """`t` flattened, as the storage dtype numpy can hold."""
    return t.detach().reshape(-1).view(_storage_dtype(t.dtype))


def sent_digest(host_words) -> str:
    """SHA-256 of a sent tensor's bytes (a numpy array of its storage words)."""
    return hashlib.sha256(host_words.tobytes()).hexdigest()


class PinnedPool:
    """Host buffers reused across recorded iterations: the writer thread gives a buffer back
    once it is written. Pinned on GPU nodes (required for copies that do not block the host).
    `reserve` allocates ahead, off the training thread, once the recorder knows the sizes a
    recording will need (the step before it starts): pinning memory takes milliseconds per
    megabyte, which would otherwise land in the recorded steps."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.free: dict[int, list[torch.Tensor]] = {}
        self.lock = threading.Lock()
        self.allocated_bytes = 0
        self.reserved_bytes = 0

    def reserve(self, sizes: list[int]) -> threading.Thread:
        """Allocate buffers of `sizes` bytes in a background thread (returned, started)."""
        def run():
            for n in sizes:
                buf = torch.empty(n, dtype=torch.uint8, pin_memory=self.pinned)
                with self.lock:
                    self.free.setdefault(n, []).append(buf)
                    self.allocated_bytes += n
                    self.reserved_bytes += n
        th = threading.Thread(target=run, name="tm-recording-reserve", daemon=True)
        th.start()
        return th

    def clear(self) -> None:
        """Give the buffers back (a recording is written): stayers keep no pinned memory. Freeing
        pinned memory can wait for the device: done in a background thread, not in a step."""
        with self.lock:
            self.free.clear()
        if not self.pinned:
            return
        fn = next((getattr(torch._C, n) for n in ("_accelerator_emptyHostCache", "_host_emptyCache")
                   if hasattr(torch._C, n)), None)  # torch's cache of pinned blocks (name differs by version)
        if fn is not None:
            threading.Thread(target=fn, name="tm-recording-unpin", daemon=True).start()

    def get(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            bucket = self.free.get(nbytes)
            if bucket:
                return bucket.pop()
            self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def put(self, buf: torch.Tensor) -> None:
        with self.lock:
            self.free.setdefault(buf.numel(), []).append(buf)


def _attrs(group: str, op: str, t: torch.Tensor) -> dict:
    return dict(group=group, op=_TENSOR_OPS.get(op, op), dtype=str(t.dtype),
                shape=list(t.shape))


class CopyOnWait(dist.Work):
    """A host collective's Work that takes the recording's copy of its outputs the moment the
    training thread learns it is complete (its `wait`, or a callback chained on its future),
    before anything can read or overwrite them. Once only."""

    def __init__(self, inner: dist.Work, take: Callable[[], None]):
        super().__init__()
        self.inner, self._take, self.lock, self.taken = inner, take, threading.Lock(), False

    def _once(self) -> None:
        with self.lock:
            if not self.taken:
                self.taken = True
                self._take()

    def wait(self, timeout=None) -> bool:
        ok = self.inner.wait() if timeout is None else self.inner.wait(timeout)
        self._once()
        return ok

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def get_future(self) -> torch.futures.Future:
        def then(fut):
            value = fut.value()  # raises the collective's error: nothing to take then
            self._once()
            return value
        return self.inner.get_future().then(then)


class RecordingWriter:
    """Takes a recording rank's collective outputs on the training thread (`record`: enqueue a
    copy, no host wait on a GPU) and writes them from a background thread."""

    def __init__(self, path: Path, rank: int, iterations: int, *, version: int = 1, first_step: int = 0,
                 pool: PinnedPool | None = None):
        if h5py is None:
            raise MigrationError(available()[1], phase="record")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a unique 0600 temporary (O_EXCL) h5py then opens by name: never a fixed `.part` name,
        # which a link planted there would redirect (protocol/files.py)
        self.tmp = files.temp_path(self.path)
        self.file = h5py.File(self.tmp, "w")
        self.file.attrs.update(rank=rank, iterations=iterations, version=version, first_step=first_step,
                               complete=False)
        self.version, self.first_step = version, first_step
        self.iteration, self.seq = 0, 0
        self.host_s = 0.0           # time spent in record() on the training thread
        self.writer_s = 0.0         # time the writer thread spent writing
        self.size: int | None = None
        self.error: BaseException | None = None
        self.pool = pool or PinnedPool(pinned=torch.cuda.is_available())
        self.stream = None          # side stream of the device-to-host copies (created on first use)
        self.last_copy = None       # event after the latest copy: the next iteration waits on it
        self.pending: list[CopyOnWait] = []  # this iteration's host collectives still in flight
        self.queue: queue.Queue = queue.Queue()
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._write_loop, name="tm-recording-writer", daemon=True)
        self.thread.start()

    @property
    def overhead_s(self) -> float:  # kept for callers of the synchronous recorder
        return self.host_s

    # --- training thread ---------------------------------------------------------------------
    def begin(self, iteration: int | str, step: int | None = None) -> None:
        """`iteration`: the index of a recorded iteration, or "init" for the workload's construction;
        `step`: the training step it is (defaults to the index)."""
        self.iteration, self.seq = iteration, 0
        self.queue.put(("group", _key(iteration), {} if iteration == "init" else
                        {"step": int(iteration if step is None else step)}))

    def record(self, group: str, op: str, tensors, work=None):
        """Take a collective's outputs. Returns the Work the caller must hand on instead of
        `work` (None: `work` itself): see `CopyOnWait`."""
        t0 = time.perf_counter()
        flat = _flat(tensors)
        if (op != "send" and work is not None and flat and not flat[0].is_cuda
                and not work.is_completed()):
            # A host collective still in flight: copy its outputs when the training thread
            # waits for it. Waiting here instead would hang a pipeline schedule (a stage posts
            # its receive before the send its peer waits for).
            names = [self._name() for _ in flat]
            replaced = CopyOnWait(work, lambda: self._enqueue_host(names, group, op, flat))
            self.pending.append(replaced)
            self.host_s += time.perf_counter() - t0
            return replaced
        for t in flat:
            name = self._name()
            if t.is_cuda:  # a send's tensor holds its data when the call is issued: no wait for the peer
                self._copy_async(name, _attrs(group, op, t), t, None if op == "send" else work)
            else:  # a send, or a complete host collective
                self._enqueue_host([name], group, op, [t])
        self.host_s += time.perf_counter() - t0
        return None

    def _name(self) -> str:
        name = f"{_key(self.iteration)}/{self.seq:05d}"
        self.seq += 1
        return name

    def _enqueue_host(self, names: list[str], group: str, op: str, tensors: list[torch.Tensor]) -> None:
        for name, t in zip(names, tensors):
            self.queue.put(("data", name, _attrs(group, op, t), _words(t).clone(), None, None))

    def _copy_async(self, name: str, attrs: dict, t: torch.Tensor, work) -> None:
        current = torch.cuda.current_stream(t.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(t.device)
        after_collective = torch.cuda.Event()
        after_collective.record(current)  # trainmover's NCCL backend enqueues on the caller's stream
        nbytes = t.numel() * t.element_size()
        buf = self.pool.get(nbytes)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after_collective)
            if work is not None:
                work.wait()  # ProcessGroupNCCL: makes the side stream wait for its own stream
            dst = buf.view(_storage_dtype(t.dtype)) if nbytes else buf
            dst.copy_(_words(t), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        t.record_stream(self.stream)  # the allocator must not reuse t's memory before the copy
        self.last_copy = done
        self.queue.put(("data", name, attrs, dst, done, buf))

    def end_iteration(self, loss: float) -> None:
        """Called at the iteration boundary. The next iteration may overwrite what was recorded
        (DDP refills its buckets in the next backward): its kernels wait for the copies, and
        host outputs not yet taken (a Work nobody waited for) are taken now."""
        for work in self.pending:
            if not work.taken:  # a gloo Work must not be waited twice: its second wait never ends
                work.wait()
        self.pending = []
        if self.last_copy is not None:
            torch.cuda.current_stream().wait_event(self.last_copy)
        self.queue.put(("loss", _key(self.iteration), float(loss)))

    def finish(self) -> None:
        """No more data: the writer thread completes the file in the background (see done())."""
        self.queue.put(("close",))

    def done(self) -> bool:
        return self.finished.is_set()

    def close(self, timeout_s: float = 600.0) -> int:
        """finish() and wait for the file; returns its size in bytes."""
        self.finish()
        return self.wait(timeout_s)

    def wait(self, timeout_s: float) -> int:
        if not self.finished.wait(timeout_s):
            raise DeadlineExceeded(f"recording {self.path.name}: writer still busy after {timeout_s:.0f}s")
        if self.error is not None:
            raise MigrationError(f"writing recording {self.path.name} failed: {self.error}", phase="record") \
                from self.error
        return self.size

    # --- writer thread -------------------------------------------------------------------------
    def _write_loop(self) -> None:
        try:
            while True:
                item = self.queue.get()
                t0 = time.perf_counter()
                if item[0] == "close":
                    self.file.attrs["complete"] = True
                    self.file.close()
                    os.replace(self.tmp, self.path)
                    self.size = self.path.stat().st_size
                    self.writer_s += time.perf_counter() - t0
                    return
                if item[0] == "group":
                    self.file.require_group(item[1]).attrs.update(item[2])
                elif item[0] == "loss":
                    self.file[item[1]].attrs["loss"] = item[2]
                else:
                    self._write(*item[1:])
                self.writer_s += time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - reported by wait() and by the recorder
            self.error = exc
            try:
                self.file.close()
            except Exception:  # noqa: BLE001 - the first error is the one reported
                pass
        finally:
            self.finished.set()

    def _write(self, name: str, attrs: dict, data: torch.Tensor, done, buf) -> None:
        if done is not None:
            deadline = time.monotonic() + COPY_DEADLINE_S
            while not done.query():  # polled, not synchronize(): a stuck device must not hang us silently
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(f"device-to-host copy of {name} not done after {COPY_DEADLINE_S:.0f}s")
                time.sleep(0.0005)
        arr = data.numpy()
        n = arr.shape[0]
        if attrs["op"] == "send":
            ds = self.file.create_dataset(name, shape=(0,), dtype=arr.dtype)
            attrs = {**attrs, "digest": sent_digest(arr)}
        elif n == 0:
            ds = self.file.create_dataset(name, data=arr)
        else:
            chunk = min(n, CHUNK_ELEMS)
            # Not compressed: lzf wrote gradients and activations at ~94 MB/s and saved 15% on
            # such noisy floats (Megatron 1B PP3, 4x H200 host: the first stage's 3 iterations,
            # 881 MB, took 9.4 s to write while the standby waited for them, and longer to read
            # back; uncompressed, 1,040 MB took 1.1 s. DP3's recording was not written within
            # a minute; uncompressed, one iteration's 6.8 GB took 6.3 s).
            ds = self.file.create_dataset(name, shape=(n,), dtype=arr.dtype, chunks=(chunk,))
            step = chunk * SLICE_CHUNKS
            for a in range(0, n, step):
                ds[a:a + step] = arr[a:a + step]
        ds.attrs.update(attrs)
        if buf is not None:
            self.pool.put(buf)


class RecordingBackend:
    """Wraps a live backend and records every collective's outputs (a test harness of the
    writer; the runtime records through `SwappableGroup.observer`, which survives swaps)."""

    def __init__(self, inner, writer: RecordingWriter, group: str):
        self.inner, self.writer, self.group = inner, writer, group

    def __getattr__(self, op):
        call = getattr(self.inner, op)

        def run(*args, **kwargs):
            work = call(*args, **kwargs)
            outs = outputs_of(op, args)
            if outs is not None:
                work = self.writer.record(self.group, op, outs, work) or work
            return work
        return run


class Replay:
    """Answers a standby's collectives from a recording, checking that the step asks for
    exactly what was recorded (same order, group, op, shapes, dtypes)."""

    def __init__(self, path: Path):
        if h5py is None:
            raise MigrationError(available()[1], phase="warmup")
        self.path = Path(path)
        self.file = h5py.File(self.path, "r")
        if not self.file.attrs.get("complete"):
            raise MigrationError(f"recording {self.path} is incomplete", phase="warmup")
        self.iterations = int(self.file.attrs["iterations"])
        self.rank = int(self.file.attrs["rank"])
        self.version = int(self.file.attrs.get("version", 1))
        self.first_step = int(self.file.attrs.get("first_step", 0))
        self.has_init = "init" in self.file
        self.iteration, self.seq = 0, 0
        self.sends = 0                      # sends checked against the recorded digests
        self.sends_differ: list[str] = []   # the ones whose data differed

    def begin(self, iteration: int | str) -> None:
        if _key(iteration) not in self.file:
            raise MigrationError(f"recording {self.path.name} has no iteration {iteration}", phase="warmup")
        self.iteration, self.seq = iteration, 0

    def loss(self, iteration: int) -> float:
        return float(self.file[f"it{iteration}"].attrs["loss"])

    def step_of(self, iteration: int) -> int:
        """The training step the `iteration`-th recorded iteration was (a workload whose
        shapes depend on the step must replay that step)."""
        return int(self.file[f"it{iteration}"].attrs.get("step", iteration))

    def for_group(self, group: str):
        def answer(op: str, tensors) -> None:
            if op == "barrier":
                return  # skipped: a standby never talks to the live job
            for t in _flat(tensors):
                self._fill(group, op, t)
        return answer

    def _entry(self, group: str, op: str, t: torch.Tensor):
        """The next recorded collective, checked against what the step asks for."""
        name = f"{_key(self.iteration)}/{self.seq:05d}"
        want = f"{op} on {group}, shape {list(t.shape)}, {t.dtype}"
        if name not in self.file:
            raise MigrationError(f"sandbox: iteration {self.iteration} asked for collective #{self.seq} ({want}) "
                                 f"but only {self.seq} were recorded", phase="warmup")
        ds = self.file[name]
        got = f"{ds.attrs['op']} on {ds.attrs['group']}, shape {[int(x) for x in ds.attrs['shape']]}, {ds.attrs['dtype']}"
        if got != want:
            raise MigrationError(f"sandbox: iteration {self.iteration} collective #{self.seq}: the step asked for "
                                 f"{want}, the recording has {got}", phase="warmup")
        self.seq += 1
        return ds

    def _fill(self, group: str, op: str, t: torch.Tensor) -> None:
        if op in ("send", "broadcast-source"):
            # What this rank gives its peers: nothing to answer; compare it with what the live
            # rank gave (a digest for a send, the recorded data for a broadcast it sourced).
            ds = self._entry(group, "send" if op == "send" else "broadcast", t)
            ours = _words(t).cpu().numpy()
            same = (sent_digest(ours) == ds.attrs["digest"] if op == "send" else
                    (ours == ds[()]).all() if ours.size else True)
            self.sends += 1
            if not same:
                self.sends_differ.append(f"it{self.iteration}/#{self.seq - 1} ({op} on {group}, {list(t.shape)})")
            return
        ds = self._entry(group, op, t)
        data = torch.from_numpy(ds[()])
        if t.dtype == torch.bfloat16:
            data = data.view(torch.bfloat16)
        with torch.no_grad():
            t.copy_(data.reshape(t.shape))

    def close(self) -> None:
        self.file.close()
