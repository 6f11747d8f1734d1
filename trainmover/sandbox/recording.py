"""Recorded collectives (HDF5): what a live rank's collectives returned, in call order.

Layout of `<run dir>/recordings/rank<R>.h5` (written to a temporary name, renamed when
complete, so a reader never sees half a recording):

    /init/<seq>      collectives issued while the workload was built (DDP checks, broadcasts)
    /it<k>/<seq>     one dataset per output tensor of the k-th iteration's seq-th collective
                     (chunked, lzf-compressed); attrs: group, op, dtype, shape
    /it<k>.attrs     loss of that iteration on the recording rank
    /.attrs          rank, iterations, complete

bfloat16 has no numpy type: such tensors are stored as int16 words with their dtype in attrs.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from trainmover.errors import MigrationError

try:
    import h5py
except ImportError:  # the sandbox then answers collectives locally (see SandboxBackend)
    h5py = None


def available() -> tuple[bool, str]:
    return (h5py is not None, "" if h5py is not None else "h5py is not installed (pip install trainmover[sandbox])")


def _key(iteration: int | str) -> str:
    return "init" if iteration == "init" else f"it{int(iteration)}"


def _flat(tensors) -> list[torch.Tensor]:
    return [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]


def _to_numpy(t: torch.Tensor):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


class RecordingWriter:
    def __init__(self, path: Path, rank: int, iterations: int):
        if h5py is None:
            raise MigrationError(available()[1], phase="record")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(self.path.name + ".part")
        self.file = h5py.File(self.tmp, "w")
        self.file.attrs.update(rank=rank, iterations=iterations, complete=False)
        self.iteration, self.seq = 0, 0
        self.overhead_s = 0.0  # time spent recording: the cost the live rank pays

    def begin(self, iteration: int | str) -> None:
        """`iteration`: a step number, or "init" for the workload's construction."""
        self.iteration, self.seq = iteration, 0
        self.file.require_group(_key(iteration))

    def record(self, group: str, op: str, tensors) -> None:
        t0 = time.perf_counter()
        for t in _flat(tensors):
            ds = self.file.create_dataset(f"{_key(self.iteration)}/{self.seq:05d}", data=_to_numpy(t),
                                          chunks=True if t.numel() else None,
                                          compression="lzf" if t.numel() else None)
            ds.attrs.update(group=group, op=op, dtype=str(t.dtype), shape=list(t.shape))
            self.seq += 1
        self.overhead_s += time.perf_counter() - t0

    def end_iteration(self, loss: float) -> None:
        self.file[_key(self.iteration)].attrs["loss"] = loss

    def close(self) -> int:
        self.file.attrs["complete"] = True
        self.file.close()
        os.replace(self.tmp, self.path)
        return self.path.stat().st_size


class RecordingBackend:
    """Wraps a live backend for the recorded iterations: forwards every collective, waits
    for it, and records its outputs. Swapped in and out of a SwappableGroup like any backend."""

    def __init__(self, inner, writer: RecordingWriter, group: str):
        self.inner, self.writer, self.group = inner, writer, group

    def _run(self, op: str, outputs, call):
        work = call()
        work.wait()
        self.writer.record(self.group, op, outputs)
        return work

    def allreduce(self, tensors, opts=None):
        return self._run("allreduce", tensors, lambda: self.inner.allreduce(tensors, opts) if opts is not None
                         else self.inner.allreduce(tensors))

    def broadcast(self, tensors, opts=None):
        return self._run("broadcast", tensors, lambda: self.inner.broadcast(tensors, opts) if opts is not None
                         else self.inner.broadcast(tensors))

    def allgather(self, output_lists, input_tensors, opts=None):
        return self._run("allgather", output_lists, lambda: self.inner.allgather(output_lists, input_tensors, opts)
                         if opts is not None else self.inner.allgather(output_lists, input_tensors))

    def _allgather_base(self, output, input, opts=None):
        return self._run("allgather", [output], lambda: self.inner._allgather_base(output, input, opts)
                         if opts is not None else self.inner._allgather_base(output, input))

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return self._run("reduce_scatter", outputs, lambda: self.inner.reduce_scatter(outputs, input_lists, opts)
                         if opts is not None else self.inner.reduce_scatter(outputs, input_lists))

    def recv(self, tensors, src, tag=0):
        return self._run("recv", tensors, lambda: self.inner.recv(tensors, src, tag))

    def send(self, tensors, dst, tag=0):  # a standby skips sends: nothing to record
        return self.inner.send(tensors, dst, tag)

    def barrier(self, opts=None):  # skipped in the sandbox too
        return self.inner.barrier(opts) if opts is not None else self.inner.barrier()


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
        self.iteration, self.seq = 0, 0

    def begin(self, iteration: int | str) -> None:
        if _key(iteration) not in self.file:
            raise MigrationError(f"recording {self.path.name} has no iteration {iteration}", phase="warmup")
        self.iteration, self.seq = iteration, 0

    def loss(self, iteration: int) -> float:
        return float(self.file[f"it{iteration}"].attrs["loss"])

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
