"""Recorded collectives (HDF5): what a live rank's collectives returned, in call order.

A job's recordings are versions of one base name, `<run dir>/recordings/rank<R>.h5`: version N
is `rank<R>.v<N>.h5` (written to a temporary name, renamed when complete, so a reader never
sees half a recording). A new version is recorded when a step's collectives change shape.

    /init/<seq>      collectives issued while the workload was built (DDP checks, broadcasts);
                     only in a recording that starts at the workload's construction
    /it<k>/<seq>     one dataset per output tensor of the k-th recorded iteration's seq-th
                     collective, flattened (chunked, lzf-compressed); attrs: group, op, dtype, shape
    /it<k>.attrs     loss of that iteration on the recording rank, and its training step
    /.attrs          rank, iterations, version, first_step, complete

bfloat16 has no numpy type: such tensors are stored as int16 words with their dtype in attrs.

Writing is off the training thread: outputs on a GPU are copied into pinned host buffers by
non-blocking copies on a side stream ordered after the collective, and a writer thread waits
for each copy and writes HDF5. The training thread only enqueues (see `RecordingWriter`).
"""
from __future__ import annotations

import os
import queue
import re
import threading
import time
from pathlib import Path

import torch

from trainmover.errors import DeadlineExceeded, MigrationError

try:
    import h5py
except ImportError:  # the sandbox then answers collectives locally (see SandboxBackend)
    h5py = None

CHUNK_ELEMS = 1 << 18      # HDF5 chunk: 1 MiB of float32
SLICE_CHUNKS = 4           # chunks per write call: bounds how long the writer holds the GIL at once
COPY_DEADLINE_S = 120.0    # longest wait for one device-to-host copy in the writer thread


def available() -> tuple[bool, str]:
    return (h5py is not None, "" if h5py is not None else "h5py is not installed (pip install trainmover[sandbox])")


def version_path(base: Path, version: int) -> Path:
    base = Path(base)
    return base.with_name(f"{base.stem}.v{version}{base.suffix}")


def versions(base: Path) -> list[int]:
    """Complete versions present for `base`, oldest first (a .part file is not one)."""
    base = Path(base)
    pattern = re.compile(re.escape(base.stem) + r"\.v(\d+)" + re.escape(base.suffix) + "$")
    if not base.parent.is_dir():
        return []
    return sorted(int(m.group(1)) for m in map(pattern.match, os.listdir(base.parent)) if m)


def _key(iteration: int | str) -> str:
    return "init" if iteration == "init" else f"it{int(iteration)}"


def _flat(tensors) -> list[torch.Tensor]:
    return [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]


def outputs_of(op: str, args) -> list[torch.Tensor] | None:
    """The tensors a collective writes, from the arguments of the ProcessGroup call
    (None for calls with nothing to record: sends and barriers)."""
    if op in ("send", "barrier"):
        return None
    if op == "_allgather_base":
        return [args[0]]
    return _flat(args[0])


def signature_of(group: str, op: str, tensors) -> tuple:
    """What a replay checks of a collective: group, op, shapes and dtypes of its outputs."""
    return (group, "allgather" if op == "_allgather_base" else op,
            tuple((tuple(t.shape), str(t.dtype)) for t in tensors))


def _storage_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.int16 if dtype == torch.bfloat16 else dtype


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


class RecordingWriter:
    """Takes a recording rank's collective outputs on the training thread (`record`: enqueue a
    copy, no host wait on a GPU) and writes them from a background thread."""

    def __init__(self, path: Path, rank: int, iterations: int, *, version: int = 1, first_step: int = 0,
                 pool: PinnedPool | None = None):
        if h5py is None:
            raise MigrationError(available()[1], phase="record")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(self.path.name + ".part")
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

    def record(self, group: str, op: str, tensors, work=None) -> None:
        t0 = time.perf_counter()
        for t in _flat(tensors):
            attrs = dict(group=group, op="allgather" if op == "_allgather_base" else op, dtype=str(t.dtype),
                         shape=list(t.shape))
            name = f"{_key(self.iteration)}/{self.seq:05d}"
            self.seq += 1
            if t.is_cuda:
                self._copy_async(name, attrs, t, work)
            else:  # host tensors: the collective must be complete before its output is read
                if work is not None:
                    work.wait()
                self.queue.put(("data", name, attrs, t.detach().reshape(-1).view(_storage_dtype(t.dtype)).clone(),
                                None, None))
        self.host_s += time.perf_counter() - t0

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
            dst.copy_(t.detach().reshape(-1).view(_storage_dtype(t.dtype)), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        t.record_stream(self.stream)  # the allocator must not reuse t's memory before the copy
        self.last_copy = done
        self.queue.put(("data", name, attrs, dst, done, buf))

    def end_iteration(self, loss: float) -> None:
        """Called at the iteration boundary. The next iteration may overwrite what was recorded
        (DDP refills its buckets in the next backward): its kernels wait for the copies."""
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
        if n == 0:
            ds = self.file.create_dataset(name, data=arr)
        else:
            chunk = min(n, CHUNK_ELEMS)
            ds = self.file.create_dataset(name, shape=(n,), dtype=arr.dtype, chunks=(chunk,), compression="lzf")
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
                self.writer.record(self.group, op, outs, work)
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
            if op in ("barrier", "send"):
                return  # skipped: a standby never talks to the live job
            for t in _flat(tensors):
                self._fill(group, op, t)
        return answer

    def _fill(self, group: str, op: str, t: torch.Tensor) -> None:
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
        data = torch.from_numpy(ds[()])
        if t.dtype == torch.bfloat16:
            data = data.view(torch.bfloat16)
        with torch.no_grad():
            t.copy_(data.reshape(t.shape))
        self.seq += 1

    def close(self) -> None:
        self.file.close()
