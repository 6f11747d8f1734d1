"""Process groups whose backend can be replaced underneath PyTorch.

Why a wrapper: DDP's reducer, Megatron's `parallel_state` globals and optimizers keep
references to the process-group object they were built with. A migration must change
who sits behind a rank without touching those references, so every group a workload
uses is a `SwappableGroup`: a real `torch.distributed.ProcessGroup` (DDP accepts it)
whose collectives are forwarded to an inner backend that the switch replaces.

Inner backends:
* a real group (gloo on CPU; NCCL on GPUs) built on a `PrefixStore` by the members only;
* `SandboxBackend`, used by a standby before it joins: collectives are answered locally,
  so a standby can build DDP and run shadow steps without reaching the live job.
"""
from __future__ import annotations

import contextlib
import datetime
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from trainmover import config
from trainmover.errors import MigrationError

# The runtime's own groups, beside the workload's (every rank is a member of both):
CONTROL = "tm-control"    # the per-step agreement (boundary.py): 8 bytes over gloo, no GPU sync
SNAPSHOT = "tm-snapshot"  # the snapshot tier's exchange (snapshot.py): gloo, host memory, beside the step's collectives


@dataclass(frozen=True)
class CollectiveFailure:
    """The mark a group keeps when one of its collectives failed: a peer gone (its socket
    closed), the group revoked by the controller, a backend timeout.

    Why a mark, not an exception type: the error reaches the training loop through the user's
    code (DDP's backward, an optimizer), which may wrap, replace or re-raise it as anything;
    and the user's own errors are RuntimeErrors too (a shape mismatch, out of memory). So the
    wrapper, which sees a collective fail where it fails, marks its group; the loop asks the
    groups (`first_failure`), never the exception's type (STYLE.md lesson 14)."""
    group: str
    generation: int
    op: str
    error: str

    def __str__(self) -> str:
        return f"collective {self.op} of group {self.group} failed: {self.error}"


def first_failure(groups) -> CollectiveFailure | None:
    """The failed collective of any of `groups` in their current generation, or None: then an
    exception that ended a step is not a lost peer but an error of the code that raised it."""
    return next((g.failure for g in groups if g.failure is not None), None)


class FutureWork(dist.Work):
    """A Work that is its future. Why not torch's own future-wrapping Work: its `wait()`
    returns True when the future failed, so `dist.all_reduce(..., group=g)` would go on with
    a half-reduced tensor after a peer died. This one raises the future's error (and marks
    `group` failed, should nothing have marked it yet)."""

    def __init__(self, fut: torch.futures.Future, group: "SwappableGroup | None" = None, op: str = ""):
        super().__init__()
        self.fut, self.group, self.op = fut, group, op

    def wait(self, timeout=None) -> bool:
        try:
            self.fut.wait()  # raises the error the future was completed with
        except RuntimeError as exc:
            if self.group is not None:
                self.group.mark(self.op, exc)
            raise
        return True

    def is_completed(self) -> bool:
        return self.fut.done()

    def get_future(self) -> torch.futures.Future:
        return self.fut


def completed_work(result) -> dist.Work:
    fut = torch.futures.Future()
    fut.set_result(result)
    return FutureWork(fut)


class Revoked(RuntimeError):
    """A collective of a group whose members lost a peer. A RuntimeError, like the errors of
    the backends themselves, so that whatever waits on it (DDP's reducer) fails the same way."""


def _gate() -> tuple[torch.futures.Future, torch.futures.Future]:
    """(gate, out): complete `gate` with a value or with an exception *object*; `out` then
    holds the value, or that exception as a real error.

    Why not `Future.set_exception`: it stores the exception as an ordinary *result* that only
    Python's `wait()` unwraps. C++ readers (DDP's reducer) take it for the tensors they asked
    for and crash the process. An exception raised in a `then` callback is a true error."""
    gate = torch.futures.Future()
    return gate, gate.then(_unwrap)


def _unwrap(gate: torch.futures.Future):
    value = gate.value()
    if isinstance(value, BaseException):
        raise value
    return value


def _failed(exc: Exception) -> dist.Work:
    gate, out = _gate()
    gate.set_result(exc)
    return FutureWork(out)


class MarkedWork(dist.Work):
    """A backend's own Work (gloo's point-to-point and tensor reduce-scatter, which have no
    future to chain on) whose failed `wait()` marks its group before the error goes on."""

    def __init__(self, work: dist.Work, group: "SwappableGroup", op: str):
        super().__init__()
        self.work, self.group, self.op = work, group, op

    def wait(self, timeout=None) -> bool:
        try:
            return self.work.wait() if timeout is None else self.work.wait(timeout)
        except RuntimeError as exc:
            self.group.mark(self.op, exc)
            raise

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def get_future(self) -> torch.futures.Future:
        return self.work.get_future()

    def source_rank(self) -> int:
        return self.work.source_rank()


class SandboxBackend:
    """Answers collectives without any peer. Replies come from `answers` when given
    (recorded collectives, issue 4); otherwise a rank's own data stands for every peer's,
    which is what a shadow step needs to exercise the real code path."""

    def __init__(self, rank: int, size: int, answers: Callable | None = None):
        self.rank_, self.size_, self.answers = rank, size, answers
        self.calls: list[tuple] = []  # (op, shapes) in call order: shows when a step is steady

    def _answer(self, op: str, tensors):
        flat = [t for x in tensors for t in (x if isinstance(x, list) else [x])]
        self.calls.append((op, tuple(tuple(t.shape) for t in flat)))
        if self.answers is not None:
            self.answers(op, tensors)
        return completed_work(tensors)

    def allreduce(self, tensors, opts=None):
        return self._answer("allreduce", tensors)

    def broadcast(self, tensors, opts=None):
        if self.answers is not None and opts is not None and opts.rootRank == self.rank_:
            # this rank is the source: its own data is the answer, to be checked, not replaced
            self.calls.append(("broadcast", tuple(tuple(t.shape) for t in tensors)))
            self.answers("broadcast-source", tensors)
            return completed_work(tensors)
        return self._answer("broadcast", tensors)

    def allgather(self, output_lists, input_tensors, opts=None):
        for outs, inp in zip(output_lists, input_tensors):
            for out in outs:
                out.copy_(inp)
        return self._answer("allgather", output_lists)

    def _allgather_base(self, output, input, opts=None):
        output.copy_(input.repeat(self.size_, *([1] * (input.dim() - 1))).view_as(output))
        return self._answer("allgather", [output])

    def reduce_scatter(self, outputs, input_lists, opts=None):
        for out, ins in zip(outputs, input_lists):
            out.copy_(ins[self.rank_])
        return self._answer("reduce_scatter", outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        output.copy_(input.reshape(self.size_, -1)[self.rank_].view_as(output))
        return self._answer("reduce_scatter", [output])

    def barrier(self, opts=None):
        return self._answer("barrier", [])

    def send(self, tensors, dst, tag=0):
        return self._answer("send", tensors)

    def recv(self, tensors, src, tag=0):
        for t in tensors:  # defined contents (buffers are often torch.empty): a shadow step stays finite
            t.detach().zero_()  # detach: recv buffers may require grad (pipeline activations)
        return self._answer("recv", tensors)

    def shutdown(self):
        pass


class SwappableGroup(dist.ProcessGroup):
    """A process group with a fixed (rank, size) and a replaceable inner backend."""

    def __init__(self, name: str, rank: int, size: int, global_ranks: list[int], inner):
        _guard_from_compile()
        super().__init__(rank, size)
        self.group_name_ = name
        self.global_ranks = list(global_ranks)
        self._inner = inner
        self._lock = threading.Lock()
        self.generation = 0
        self.first_call_at: float | None = None  # perf_counter of the first collective since reset
        self.first_call_cpu: float | None = None  # process CPU time at that moment
        self.revoked = ""                  # why this generation was revoked ("" while usable)
        self.failure: CollectiveFailure | None = None  # this generation's first failed collective
        self._pending: dict = {}           # gate -> monotonic issue time: this generation's gloo collectives in flight
        # What a heartbeat reports (runtime/heartbeat.py), so that the controller can see which
        # rank the others wait on: collectives issued on this group, over every generation.
        self.issued = 0
        # observer(group, op, args, work) -> Work | None, called after each forwarded collective:
        # the recording rank's recorder (trainmover.sandbox.live), which may return a Work to
        # hand on instead. It lives on the group, not on the backend, so that a migration's
        # swap of the backend leaves it in place.
        self.observer: Callable | None = None

    @property
    def inner(self):
        return self._inner

    @property
    def sandboxed(self) -> bool:
        return isinstance(self._inner, SandboxBackend)

    def swap(self, new_inner):
        """Point the group at `new_inner`; returns the old backend (caller disposes of it).
        Only called at an iteration boundary, when no collective of this group is in flight."""
        with self._lock:
            old, self._inner = self._inner, new_inner
            self.generation += 1
            self.revoked = ""
            self.failure = None
            self._pending = {}
            # Every member swaps at the same boundary (a joiner's sandbox counted its shadow
            # steps): counting afresh keeps the members' counts comparable.
            self.issued = 0
        return old

    @contextlib.contextmanager
    def sandbox_for_a_while(self):
        """Answer this group's collectives locally for the duration, then put everything back
        as it was (backend, generation, marks, observer). A script run that re-enters its loop
        (trainmover/script) runs its set-up and warm iterations again: DDP's broadcasts and
        bucket rebuild must not reach the peers, which are not running them."""
        if self.sandboxed:
            yield
            return
        with self._lock:
            saved = (self._inner, self.revoked, self.failure, self._pending, self.issued, self.observer)
            self._inner = SandboxBackend(self.rank(), self.size())
            self.revoked, self.failure, self._pending, self.observer = "", None, {}, None
        try:
            yield
        finally:
            with self._lock:
                self._inner, self.revoked, self.failure, self._pending, self.issued, self.observer = saved

    def mark(self, op: str, error) -> None:
        """Record that a collective of this generation failed (the first failure is kept).
        Called from the training thread, gloo's threads and the control channel's reader."""
        with self._lock:
            if self.failure is None:
                self.failure = CollectiveFailure(self.group_name_, self.generation, op, str(error)[:300])

    def waiting_s(self, now: float) -> float:
        """How long the oldest collective in flight has waited (0 if none; gloo only: NCCL
        collectives return once enqueued). Read by the heartbeat thread."""
        with self._lock:
            oldest = min(self._pending.values(), default=None)
        return 0.0 if oldest is None else max(0.0, now - oldest)

    def revoke(self, reason: str) -> None:
        """Fail every collective in flight and every later one until the next `swap`.

        Why: a member died, and a gloo collective only notices when a socket of its own
        breaks: ranks two hops away from the dead one would wait for the whole group
        timeout. Called from another thread (the control channel's reader); the collective
        itself is abandoned in gloo's thread and its backend retired, never used again.
        NCCL backends are aborted instead, which ends their kernels."""
        with self._lock:
            if self.revoked:
                return
            self.revoked = reason
            pending, self._pending = self._pending, {}
        self.mark("revoke", f"revoked: {reason}")
        for gate in pending:  # removed from _pending under the lock: only this thread completes them
            gate.set_result(Revoked(f"group {self.group_name_} revoked: {reason}"))
        abort = getattr(self._inner, "abort", None)
        if abort is not None and not isinstance(self._inner, dist.ProcessGroupGloo):
            abort()

    def _revocable(self, work: dist.Work, op: str) -> dist.Work:
        """`work`, behind a future that `revoke` can fail before the backend gives up."""
        gate, out = _gate()
        with self._lock:
            self._pending[gate] = time.monotonic()

        # The callback holds the group weakly. It runs, and is freed, on gloo's worker thread:
        # were it the last holder of this group, the backend's destructor would join that very
        # thread ("Resource deadlock avoided": the process aborts at its end).
        me = weakref.ref(self)

        def done(inner):
            try:
                value = inner.value()
            except Exception as exc:  # noqa: BLE001 - the backend's own error, passed on as is
                value = exc
            group = me()
            if group is None:  # the group is gone: nobody is left to revoke the gate
                gate.set_result(value)
                return
            if isinstance(value, BaseException):
                group.mark(op, value)  # here, where it fails: whoever waits (or not) may hide it
            with group._lock:
                mine = gate in group._pending  # else revoke took it and completes it
                group._pending.pop(gate, None)
            del group
            if mine:
                gate.set_result(value)

        work.get_future().add_done_callback(done)
        return FutureWork(out, self, op)


def _forwarder(op: str):
    """A method that forwards collective `op` to the current inner backend.

    Errors come back through the returned Work, never raised here: DDP calls collectives
    from autograd hooks, and an exception there would leave its reducer mid-iteration."""
    def forward(self, *a, **k):
        if self.first_call_at is None:  # ends a rank's own compute: from here on it may wait for peers
            self.first_call_at = time.perf_counter()
            self.first_call_cpu = time.process_time()
        if _TRACE:
            _trace(self, op, a)
        self.issued += 1
        if self.revoked:
            self.mark(op, f"revoked: {self.revoked}")
            return _failed(Revoked(f"group {self.group_name_} revoked: {self.revoked}"))
        try:
            work = getattr(self._inner, op)(*a, **k)
        except Exception as exc:  # noqa: BLE001 - an aborted NCCL communicator raises its own error type
            if self.revoked:  # revoked (its communicator aborted) while this call was being issued
                self.mark(op, f"revoked: {self.revoked}")
                return _failed(Revoked(f"group {self.group_name_} revoked: {self.revoked}"))
            if isinstance(exc, RuntimeError):  # the backend's: a peer gone, a timeout
                self.mark(op, exc)
                return _failed(exc)
            raise  # ours (e.g. a sandbox's mismatch with its recording): clear, and at once
        if self.observer is not None:  # a recorder may hand back a Work that copies the outputs on completion
            work = self.observer(self.group_name_, op, a, work) or work
        if isinstance(self._inner, dist.ProcessGroupGloo):
            return self._revocable(work, op) if op in _REVOCABLE else MarkedWork(work, self, op)
        return work
    forward.__name__ = op
    return forward


_compile_guard_lock = threading.Lock()
_compile_guarded = False


def _guard_from_compile() -> None:
    """Marks the forwarders as never compiled, once, when the first group is made.

    DDP's reducer calls collectives from inside a compiled (torch.compile) forward, e.g. the
    broadcast of rebuilt buckets in the second step: they must run eagerly, never traced by
    dynamo. Done here, not at import: `torch.compiler.disable` imports torch._dynamo (~2.6 s
    of CPU on a 2-core node), which a process that imports this module but makes no group
    never needs (check-workload's orchestrator, which the supervisor runs for
    TM_CHECK_WORKLOAD)."""
    global _compile_guarded
    with _compile_guard_lock:
        if _compile_guarded:
            return
        for name in (*FORWARDED, "all_gather_single", "reduce_scatter_single"):
            setattr(SwappableGroup, name, torch.compiler.disable(SwappableGroup.__dict__[name]))
        _compile_guarded = True


# The collectives DDP, the optimizers and Megatron call on a group object; the Python
# ProcessGroup trampoline dispatches to these class attributes.
FORWARDED = ("allreduce", "broadcast", "allgather", "_allgather_base", "reduce_scatter", "_reduce_scatter_base",
             "barrier", "send", "recv")
# gloo's point-to-point and tensor reduce-scatter works have no future to chain on ("Work::getFuture
# not implemented"); they fail on the dead peer's socket or at the group timeout.
_REVOCABLE = set(FORWARDED) - {"send", "recv", "_reduce_scatter_base"}
for _op in FORWARDED:
    setattr(SwappableGroup, _op, _forwarder(_op))


# Tensor-in/tensor-out collectives under both of torch's names (2.11: `_allgather_base`,
# `_reduce_scatter_base`; 2.13: `all_gather_single`, `reduce_scatter_single`). Inner backends
# implement the 2.11 names (gloo has them in both versions).
SwappableGroup.all_gather_single = _forwarder("_allgather_base")
SwappableGroup.reduce_scatter_single = _forwarder("_reduce_scatter_base")


def _coalesced(single: str, options):
    """A coalesced collective (what `torch.distributed._coalescing_manager` issues, e.g. for
    Megatron's gradient buckets) as the same collective per tensor, in order, each awaited:
    inner backends need only the single-tensor op, and every member runs the same sequence."""
    def run(self, outputs, inputs=None, opts=None):
        if inputs is None or not isinstance(inputs, list):  # allreduce_coalesced(tensors, opts)
            tensors, opts = outputs, inputs
            for t in tensors:
                one = dist.AllreduceOptions()
                one.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
                getattr(self, single)([t], one).wait()
            return completed_work(tensors)
        for out, inp in zip(outputs, inputs):
            one = options()
            if opts is not None and hasattr(opts, "reduceOp"):
                one.reduceOp = opts.reduceOp
            getattr(self, single)(out, inp, one).wait()
        return completed_work(outputs)
    run.__name__ = f"{single}_coalesced"
    return run


SwappableGroup.allreduce_coalesced = _coalesced("allreduce", None)
for _name in ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"):  # 2.13, 2.11
    setattr(SwappableGroup, _name, _coalesced("_allgather_base", _c10d.AllgatherOptions))
for _name in ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"):
    setattr(SwappableGroup, _name, _coalesced("_reduce_scatter_base", dist.ReduceScatterOptions))

# TM_TRACE_COLLECTIVES=1 prints every collective a group forwards (debugging mismatched
# sequences between ranks, e.g. a joiner's one-time DDP broadcasts).
_TRACE = bool(config.setting("TM_TRACE_COLLECTIVES"))


def _trace(g, op, args):
    first = args[0] if args else None
    shapes = [tuple(t.shape) for t in first if hasattr(t, "shape")] if isinstance(first, list) else ""
    print(f"TRACE {g.group_name_} gen={g.generation} {op} {shapes}", file=sys.stderr, flush=True)


def gloo_group(store: dist.Store, prefix: str, rank: int, size: int, *, host: str,
               timeout: datetime.timedelta, devices: int = 1) -> dist.ProcessGroupGloo:
    """A gloo group built by its members only, on `store` under `prefix`.

    `host` is this node's address from Slurm: every node of the local cluster shares one
    machine's port space, and on a real cluster it picks the right interface. `devices` > 1:
    that many connections between each pair of members, each with its own I/O thread; a
    send or receive with tag t goes over connection t % devices (every member must pass the
    same number)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host) for _ in range(max(1, devices))]
    try:
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)
    except RuntimeError as exc:  # gloo reports rendezvous timeouts as RuntimeError
        raise MigrationError(f"building group {prefix!r} failed: {exc}", rank=rank, host=host) from exc
