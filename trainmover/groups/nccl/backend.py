"""NCCL as an inner backend of `SwappableGroup`, through the communicator-delta library.

Every collective is enqueued on the caller's current CUDA stream and returns an already
completed `Work`: ordering with the surrounding kernels is the stream's, as with
ProcessGroupNCCL's default synchronisation, so DDP's bucket hooks and optimizers see the
results in order without host waits. Communicators are owned by `trainmover.groups.nccl.lib`,
which builds replacements non-blocking (Phase 1) and revokes old ones (Phase 2).
"""
from __future__ import annotations

import contextlib
import datetime
import io
import threading
import time

import torch
import torch.distributed as dist

from trainmover.errors import MigrationError
from trainmover.groups.nccl import lib
from trainmover.groups.swappable import completed_work
from trainmover.groups.tensors import by_dtype

WARM_SIZES = (256, 1 << 16, 1 << 20, 1 << 23)  # float32 elements: LL, LL128 and Simple ranges

# Two floats per device that every pre-connecting collective uses (`NcclBackend.preconnect`),
# allocated at the process's first one (its world group, before training) and kept. A tensor
# made in each Phase 1 instead, on its private stream, made the caching allocator reserve a new
# 2 MiB segment for that stream on every stayer, at every migration (stayer_extra_reserved_bytes
# 2,097,152 in every 4-GPU run), which no training stream ever reuses. The buffer holds 1.0 and
# every use keeps it so (max-reduce of ones, a send/recv of it): collectives of two groups being
# built at once in one process may share it.
_SCRATCH: dict[int, torch.Tensor] = {}
_SCRATCH_LOCK = threading.Lock()


def _scratch() -> tuple[torch.Tensor, bool]:
    """(this device's pre-connect buffer, whether it was made just now: on the current stream,
    which must then come before its first use on another)."""
    dev = torch.cuda.current_device()
    with _SCRATCH_LOCK:
        t = _SCRATCH.get(dev)
        if t is None:
            t = _SCRATCH[dev] = torch.ones(2, device=dev)  # [0]: reduced and sent, [1]: received into
            return t, True
    return t, False

_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min",
        dist.ReduceOp.PRODUCT: "prod", dist.ReduceOp.AVG: "avg"}


def _op(opts) -> str:
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    for known, name in _OPS.items():
        if op == known:
            return name
    raise MigrationError(f"reduce op {op} is not supported by the NCCL backend")


@contextlib.contextmanager
def _on_device(t: torch.Tensor):
    """NCCL needs device memory; DDP's set-up checks pass small CPU tensors."""
    if t.device.type == "cuda":
        yield t
        return
    tmp = t.to(torch.cuda.current_device())
    yield tmp
    t.copy_(tmp.cpu())


class NcclBackend:
    def __init__(self, comm: "lib.Comm", store, prefix: str):
        self.comm, self.store, self.prefix = comm, store, prefix
        self.rank_, self.size_ = comm.rank, comm.size

    def abort(self) -> None:
        """End this communicator's kernels now (a member vanished: they would spin forever)."""
        self.comm.abort()

    def allreduce(self, tensors, opts=None):
        op = _op(opts)
        for t in tensors:
            with _on_device(t) as d:
                self.comm.allreduce(d, d, op)
        return completed_work(tensors)

    def broadcast(self, tensors, opts=None):
        root = getattr(opts, "rootRank", 0)
        for t in tensors:
            with _on_device(t) as d:
                self.comm.broadcast(d, d, root)
        return completed_work(tensors)

    def _allgather_base(self, output, input, opts=None):
        self.comm.allgather(input, output)
        return completed_work([output])

    def allgather(self, output_lists, input_tensors, opts=None):
        for outs, inp in zip(output_lists, input_tensors):
            dev = torch.cuda.current_device()
            flat = torch.empty((self.size_,) + tuple(inp.shape), dtype=inp.dtype, device=dev)
            self.comm.allgather(inp.contiguous().to(dev), flat)
            for i, out in enumerate(outs):
                out.copy_(flat[i])
        return completed_work(output_lists)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op = _op(opts)
        for out, ins in zip(outputs, input_lists):
            flat = torch.cat([t.reshape(-1) for t in ins])
            self.comm.reduce_scatter(flat, out, op)
        return completed_work(outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        """Tensor reduce-scatter (Megatron's distributed optimizer: gradient buckets)."""
        self.comm.reduce_scatter(input, output, _op(opts))
        return completed_work([output])

    def barrier(self, opts=None):
        t = torch.zeros(1, device=torch.cuda.current_device())
        self.comm.allreduce(t, t, "sum")
        torch.cuda.current_stream().synchronize()
        return completed_work([])

    def send(self, tensors, dst, tag=0):
        for t in tensors:
            self.comm.send(t, dst)
        return completed_work(tensors)

    def recv(self, tensors, src, tag=0):
        for t in tensors:
            self.comm.recv(t, src)
        return completed_work(tensors)

    def preconnect(self, p2p: bool, neighbours: bool = False) -> None:
        """Make NCCL set up its connections now (Phase 1), not at the first real use (the
        pause): one tiny collective, or for a transfer pair one tiny send/recv, since p2p
        connections are separate from ring/tree ones. `neighbours` (a pipeline group, whose
        stages send to the next and the previous one): also one tiny send and receive with
        each neighbour in group-rank order, both ways, in one NCCL group. Without it the first
        step after a switch set them up: Megatron 1B PP3 on 4x H200, the joiner's first step
        2.9x a steady one and every stage waiting for it (a 0.43 s pause, the switch itself
        0.033 s). Run by every member on a private
        stream, so it never queues behind (or ahead of) training kernels on other comms, on the
        process's one pre-connect buffer (`_scratch`): a stayer's Phase 1 takes nothing from
        torch's allocator, not even a segment for the private stream."""
        stream = torch.cuda.Stream()
        t, new = _scratch()
        if new:  # filled on the current stream (once per process: its first group, before training)
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if p2p:
                with lib.group():
                    (self.comm.send if self.rank_ == 0 else self.comm.recv)(t[:1], 1 - self.rank_)
                # The pair (leaver, joiner) also runs all-reduces of the sizes DDP buckets use:
                # the joiner has so far only met sandboxed collectives, and NCCL loads kernels
                # and sets up protocols on first use. Stayers take no part (no memory of theirs).
                for n in WARM_SIZES:
                    buf = torch.ones(n, device=torch.cuda.current_device())
                    self.comm.allreduce(buf, buf, "sum")
                    del buf
            else:
                self.comm.allreduce(t[:1], t[:1], "max")  # ones stay ones
                if neighbours and self.size_ > 1:
                    self._preconnect_neighbours(t)
        stream.synchronize()

    def _preconnect_neighbours(self, t: torch.Tensor) -> None:
        """One float to and from each neighbour (group ranks r-1 and r+1): every send has its
        receive on the peer, in the same NCCL group. Sent from t[0], received into t[1] (both
        hold 1.0 and keep it)."""
        peers = [p for p in (self.rank_ - 1, self.rank_ + 1) if 0 <= p < self.size_]
        with lib.group():
            for p in peers:
                self.comm.send(t[:1], p)
                self.comm.recv(t[1:2], p)

    def channel(self) -> "NcclChannel":
        return NcclChannel(self)

    def shutdown(self):
        self.comm.revoke()


class NcclChannel:
    """State transfer over a 2-member NCCL communicator: the manifest and the few small CPU
    tensors (RNG states, step counters) through the job's store, every GPU tensor in one
    grouped send/recv directly into the receiver's buffers (no staging copy)."""

    # GPU wire tensors: word sums, no MAC (hashing them would copy the state to the host);
    # the communicator admits only holders of its unique id, encrypted in the store
    HOST_WIRE = False

    def __init__(self, backend: NcclBackend):
        self.b = backend
        self.group_s = 0.0
        self.attempt = 0  # store keys are per attempt: a resend never meets the last one's

    def _key(self, what: str) -> str:
        return f"{self.b.prefix}a{self.attempt}/{what}"

    def next_attempt(self) -> None:
        self.attempt += 1

    def send_bytes(self, data: bytes, dst: int) -> None:
        self.b.store.set(self._key("manifest"), data)

    def recv_bytes(self, src: int) -> bytes:
        return self.b.store.get(self._key("manifest"))

    def send_verdict(self, verdict: int, dst: int) -> None:
        self.b.store.set(self._key("verdict"), str(verdict))

    def recv_verdict(self, src: int) -> int:
        return int(self.b.store.get(self._key("verdict")))

    def send_tensors(self, tensors, dst: int, corrupt: bool = False) -> None:
        big, small = _split([t for t in tensors if t.device.type == "cuda"])
        if corrupt and big:  # fault injection: the first tensor arrives with a flipped byte
            bad = big[0].clone()
            bad.view(-1).view(torch.uint8)[0] ^= 0xFF
            big = [bad] + big[1:]
        buf = io.BytesIO()
        torch.save([t for t in tensors if t.device.type != "cuda"], buf)
        self.b.store.set(self._key("cpu-tensors"), buf.getvalue())
        packed = [torch.cat([t.reshape(-1) for t in ts]) for _, ts in by_dtype(small)]
        torch.cuda.current_stream().synchronize()
        t0 = time.perf_counter()
        with lib.group():
            for t in big + packed:
                self.b.comm.send(t, dst)
        torch.cuda.current_stream().synchronize()
        self.group_s = time.perf_counter() - t0

    def recv_tensors(self, tensors, src: int) -> None:
        cpu = [t for t in tensors if t.device.type != "cuda"]
        got = torch.load(io.BytesIO(self.b.store.get(self._key("cpu-tensors"))), weights_only=True)
        if len(got) != len(cpu):
            raise MigrationError(f"state transfer: {len(got)} CPU tensors sent, {len(cpu)} expected", phase="switch")
        for t, g in zip(cpu, got):
            t.copy_(g)
        big, small = _split([t for t in tensors if t.device.type == "cuda"])
        groups = by_dtype(small)
        packed = [torch.empty(sum(t.numel() for t in ts), dtype=dt, device=ts[0].device) for dt, ts in groups]
        torch.cuda.current_stream().synchronize()
        t0 = time.perf_counter()
        with lib.group():
            for t in big + packed:
                self.b.comm.recv(t, src)
        torch.cuda.current_stream().synchronize()
        self.group_s = time.perf_counter() - t0  # the NCCL transfer alone
        with torch.no_grad():
            for flat, (_, ts) in zip(packed, groups):
                for t, part in zip(ts, flat.split([t.numel() for t in ts])):
                    t.copy_(part.view_as(t))
        torch.cuda.current_stream().synchronize()


    # --- the planned protocol (runtime/transfer/plan.py) ------------------------------------------
    def _side(self) -> torch.cuda.Stream:
        side = getattr(self, "_side_stream", None)
        if side is None:
            side = self._side_stream = torch.cuda.Stream()
        return side

    def early_sig(self, src: int) -> str | None:
        return self.b.store.get(self._key("sig")).decode()

    def send_planned(self, plan, dst: int, corrupt: bool = False, manifest=None) -> None:
        """Chunks of wire tensors, one NCCL group each, on the current stream; their word sums
        on a side stream beside the sends (reads only), sent last. The plan's signature goes
        to the store first (a joiner with the same plan posts its receives at once), the
        manifest (`manifest()`) once the sends are posted."""
        ts = [time.perf_counter()]
        self.b.store.set(self._key("sig"), plan.sig)
        ts.append(time.perf_counter())
        main, side = torch.cuda.current_stream(), self._side()
        plan.pack()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for c in range(len(plan.chunks)):
                plan.check_chunk(c, finite=False)
        chunks = plan.chunks
        if corrupt and chunks:  # fault injection: the first wire tensor arrives with a flipped byte
            bad = chunks[0][0].clone()
            bad.view(-1).view(torch.uint8)[0] ^= 0xFF
            chunks = [[bad] + chunks[0][1:]] + chunks[1:]
        t0 = time.perf_counter()
        ts.append(t0)
        for chunk in chunks:
            with lib.group():
                for t in chunk:
                    self.b.comm.send(t, dst)
            ts.append(time.perf_counter())
        main.wait_stream(side)
        with lib.group():
            self.b.comm.send(plan.sums, dst)
        self.send_bytes(manifest(), dst)
        ts.append(time.perf_counter())
        main.synchronize()
        self.group_s = time.perf_counter() - t0
        # where the sender's host time went, from its first call: signature stored, checks
        # enqueued, each chunk posted, manifest stored, (then) the device done
        self.send_marks = [round(t - ts[0], 5) for t in ts[1:]] + [round(time.perf_counter() - ts[0], 5)]

    def recv_planned(self, plan, src: int):
        """Chunks straight into the plan's buffers; after each, the side stream checks it while
        the next one is on the wire. Returns what `finish_planned` waits for."""
        main, side = torch.cuda.current_stream(), self._side()
        plan.reset()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        side.wait_stream(main)  # the buffers' earlier users come first
        ev[0].record(main)
        t0 = time.perf_counter()
        self.post_marks = []  # host time each chunk's receives were posted (and its checks enqueued)
        for c, chunk in enumerate(plan.chunks):
            with lib.group():
                for t in chunk:
                    self.b.comm.recv(t, src)
            landed = torch.cuda.Event()
            landed.record(main)
            side.wait_event(landed)
            with torch.cuda.stream(side):
                plan.check_chunk(c)
            self.post_marks.append(round(time.perf_counter() - t0, 5))
        with lib.group():
            self.b.comm.recv(plan.peer_sums, src)
        ev[1].record(main)
        ev[2].record(side)
        main.wait_stream(side)
        plan.unpack()
        return plan, ev, t0, time.perf_counter() - t0

    def finish_planned(self, posted) -> dict:
        """Wait for the posted receives and checks. Device times from CUDA events: the copy
        (first receive posted to the sender's sums landed) and the checks' tail after it."""
        plan, ev, t0, posted = posted
        torch.cuda.current_stream().synchronize()
        self.group_s = ev[0].elapsed_time(ev[1]) / 1000
        return {"copy_s": round(self.group_s, 5), "verify_tail_s": round(max(0.0, ev[1].elapsed_time(ev[2])) / 1000, 5),
                "post_s": round(posted, 5), "host_wait_s": round(time.perf_counter() - t0, 5),
                "post_marks": list(self.post_marks), "checks_graphed": plan.graphed}


PACK_BELOW_BYTES = 1 << 20  # smaller tensors travel packed: one message per dtype, not hundreds


def _split(tensors):
    """(big, small): big ones go straight into the receiver's buffers; small ones (biases,
    norms, a few MB in all) are packed, since per-message cost dominates for them."""
    big = [t for t in tensors if t.numel() * t.element_size() >= PACK_BELOW_BYTES]
    small = [t for t in tensors if t.numel() * t.element_size() < PACK_BELOW_BYTES]
    return big, small


def nccl_group(store, prefix: str, grank: int, size: int, *, timeout_s: float, name: str,
               device: int | None = None) -> NcclBackend:
    """Build a communicator by its members only: group rank 0 publishes the unique id on
    the job store under `prefix`; init is non-blocking and bounded by `timeout_s` (on
    timeout the half-built communicator is aborted and nothing else changes)."""
    device = torch.cuda.current_device() if device is None else device
    key = prefix + "nccl-uid"
    if grank == 0:
        uid = lib.unique_id()
        store.set(key, uid)
    else:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        uid = store.get(key)
    comm = lib.Comm.init_start(f"{name}@{prefix}", uid, size, grank, device)
    comm.wait(int(timeout_s * 1000))
    return NcclBackend(comm, store, prefix)
