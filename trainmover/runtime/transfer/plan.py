"""The state transfer's plan, made before the pause: what goes on the wire, in which order,
into which buffers, and how the receiver checks it as it lands.

Why: at the switch the joiner's pause is the copy (~45 ms for a 1B model on NVLink) plus
whatever else runs in it. Everything that depends only on the state's layout (key paths,
shapes, dtypes, where each tensor lands) is worked out in Phase 1, on both sides:

* wire tensors: every device tensor of at least PACK_BELOW_BYTES goes alone, straight into the
  receiver's own buffer (a warm standby's parameters and optimizer state); the small ones
  travel packed, one buffer per dtype, allocated here, and are scattered with one multi-tensor
  copy. Wire tensors are sent in chunks of about CHUNK_BYTES (one NCCL group each);
* verification as chunks land: after each chunk the receiver's side stream sums its words
  (int64 per wire tensor, the word sum of `tensors.digest_tensors`) and takes each floating
  tensor's L1 norm (NaN and Inf propagate: a non-finite state is refused), while the next
  chunk is still on the wire. The sender sums the same words beside its sends and sends the
  sums last; the receiver compares the two vectors on the GPU and reads back two numbers;
* a signature (SHA-256 of the specs): the leaver puts its own in the manifest; a joiner whose
  Phase-1 plan has the same one receives into it, else it builds one from the leaver's specs
  in the pause (slower, still exact).

A plan holds tensors, not copies: the sender's is checked against the state it sends (same
tensors, by data pointer) and rebuilt if the state's tensors changed since.

On a GPU each chunk's checks (a sum kernel per wire tensor, a few multi-tensor norms) are
captured once as a CUDA graph in Phase 1 (`warm`), over the plan's fixed buffers: in the pause
a chunk's checks are then one graph launch instead of hundreds of kernel launches (each tens
of microseconds of host time, which delayed the sender's first send and the receiver's next
posted chunk). Where capture fails the checks run eagerly (same results, slower).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging

import torch

from trainmover.groups.tensors import dtype_of, flatten, word_view

CHUNK_BYTES = 4 << 30          # wire tensors per NCCL group: verification overlaps the next chunk (15 groups
#                                of 1 GiB moved 14.6 GB at 232 GB/s on H100s, one group at 329)
PACK_BELOW_BYTES = 1 << 20     # smaller device tensors travel packed (per-message cost dominates)

log = logging.getLogger("trainmover.xferplan")


def specs_of(paths: list[str], tensors: list[torch.Tensor]) -> list[tuple[str, tuple, str, str]]:
    return [(p, tuple(t.shape), str(t.dtype), t.device.type) for p, t in zip(paths, tensors)]


def signature(specs) -> str:
    return hashlib.sha256(repr([(p, tuple(s), str(d), v) for p, s, d, v in specs]).encode()).hexdigest()


class Plan:
    """The wire layout of one state's specs, bound to buffers (`tensors`, in state order)."""

    def __init__(self, specs, tensors: list[torch.Tensor]):
        self.specs = [(p, tuple(s), str(d), v) for p, s, d, v in specs]
        self.sig = signature(self.specs)
        self.tensors = tensors
        # the wire is the device's (a CPU job's wire is its host tensors, over gloo); host
        # tensors of a GPU job (RNG states, step counters) travel in the manifest
        wire_dev = "cuda" if any(v == "cuda" for _, _, _, v in self.specs) else "cpu"
        self.cpu = [i for i, (_, _, _, v) in enumerate(self.specs) if v != wire_dev]
        # what `still_describes` compares: device tensors by address, host ones (fresh RNG
        # states each time) by shape and dtype
        self.ptrs = [t.data_ptr() if v == wire_dev else (tuple(t.shape), t.dtype)
                     for t, (_, _, _, v) in zip(tensors, self.specs)]
        self.wire_dev = wire_dev
        on_host = set(self.cpu)
        # host tensors travel in the manifest packed, one flat tensor per dtype (hundreds of
        # per-parameter step counters one by one made its encoding and decoding slow)
        host: dict[torch.dtype, list[int]] = {}
        for i in self.cpu:
            host.setdefault(tensors[i].dtype, []).append(i)
        self.cpu_groups = list(host.values())
        dev_idx = [i for i in range(len(tensors)) if i not in on_host]
        big = [i for i in dev_idx if tensors[i].numel() * tensors[i].element_size() >= PACK_BELOW_BYTES]
        small = [i for i in dev_idx if tensors[i].numel() * tensors[i].element_size() < PACK_BELOW_BYTES]
        # packs: one flat buffer per dtype, the small tensors as views of it (both sides alike)
        self.packs: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []
        groups: dict[torch.dtype, list[int]] = {}
        for i in small:
            groups.setdefault(tensors[i].dtype, []).append(i)
        for dt, members in groups.items():
            flat = torch.empty(sum(tensors[i].numel() for i in members), dtype=dt, device=tensors[members[0]].device)
            views = list(flat.split([tensors[i].numel() for i in members]))
            self.packs.append((flat, [tensors[i].detach().view(-1) for i in members], views))
        # chunks of wire tensors; the packed buffers form the last one
        self.chunks: list[list[torch.Tensor]] = [[]]
        size = 0
        for i in big:
            t = tensors[i]
            if self.chunks[-1] and size + t.numel() * t.element_size() > CHUNK_BYTES:
                self.chunks.append([])
                size = 0
            self.chunks[-1].append(t.detach())
            size += t.numel() * t.element_size()
        if self.packs:
            self.chunks.append([p[0] for p in self.packs])
        self.chunks = [c for c in self.chunks if c]
        self.wire = [t for c in self.chunks for t in c]
        self.bounds = []  # (lo, hi) of each chunk in the sums vector
        at = 0
        for c in self.chunks:
            self.bounds.append((at, at + len(c)))
            at += len(c)
        self._words = [[word_view(t.detach()) for t in c] for c in self.chunks]
        self._floats = [[[t for t in c if t.dtype == dt and t.numel()] for dt in sorted({t.dtype for t in c if t.is_floating_point()}, key=str)]
                        for c in self.chunks]
        device = self.wire[0].device if self.wire else torch.device("cpu")
        self.sums = torch.zeros(len(self.wire), dtype=torch.int64, device=device)
        self.peer_sums = torch.zeros(len(self.wire), dtype=torch.int64, device=device)
        self._norms: list[torch.Tensor] = []
        self.bytes = sum(t.numel() * t.element_size() for t in tensors)
        # per chunk: (CUDA graph of its checks, the norms it writes), captured by `warm`
        self._graphs: list[tuple[object, list[torch.Tensor]]] | None = None
        self._graphs_finite = True

    @property
    def graphed(self) -> bool:
        """Whether `warm` captured the checks as CUDA graphs (reported in the pause's parts)."""
        return self._graphs is not None

    @property
    def device(self) -> torch.device:
        return self.sums.device

    def still_describes(self, tensors: list[torch.Tensor]) -> bool:
        """Whether `tensors` are the very buffers this plan was made for (the sender's check)."""
        return len(tensors) == len(self.ptrs) and [
            t.data_ptr() if t.device.type == self.wire_dev else (tuple(t.shape), t.dtype) for t in tensors] == self.ptrs

    def pack_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sender: the state's host tensors (`tensors`: all of the state's, in order) packed."""
        return [torch.cat([tensors[i].detach().reshape(-1) for i in group]) for group in self.cpu_groups]

    def unpack_host(self, flats: list[torch.Tensor]) -> None:
        """Receiver: packed host tensors out into this plan's host tensors."""
        if len(flats) != len(self.cpu_groups) or any(
                f.numel() != sum(self.tensors[i].numel() for i in g) or f.dtype != self.tensors[g[0]].dtype
                for f, g in zip(flats, self.cpu_groups)):
            raise ValueError("the packed host tensors do not match the layout")
        with torch.no_grad():
            for flat, group in zip(flats, self.cpu_groups):
                views = [self.tensors[i].view(-1) for i in group]
                torch._foreach_copy_(views, list(flat.split([v.numel() for v in views])))

    def pack(self) -> None:
        """Sender: the small tensors into their packed buffers (one multi-tensor copy per dtype)."""
        with torch.no_grad():
            for flat, members, views in self.packs:
                torch._foreach_copy_(views, members)

    def unpack(self) -> None:
        """Receiver: the packed buffers out to the small tensors."""
        with torch.no_grad():
            for flat, members, views in self.packs:
                torch._foreach_copy_(members, views)

    def check_chunk(self, c: int, finite: bool = True) -> None:
        """Word sums of chunk `c`'s wire tensors into `sums`; with `finite`, also each floating
        tensor's L1 norm (kept for `verdict`). On the current stream: its captured graph where
        `warm` made one for this kind of check."""
        if self._graphs is not None and finite == self._graphs_finite:
            graph, norms = self._graphs[c]
            graph.replay()
            self._norms.extend(norms)
            return
        self._norms.extend(self._checks(c, finite))

    def _checks(self, c: int, finite: bool) -> list[torch.Tensor]:
        lo, hi = self.bounds[c]
        words = self._words[c]
        if words:
            torch.stack([w.sum(dtype=torch.int64) for w in words], out=self.sums[lo:hi])
        return [torch.stack(torch._foreach_norm(floats, 1)).float()
                for floats in (self._floats[c] if finite else ()) if floats]

    def warm(self, finite: bool = True) -> None:
        """Before the pause: run every kernel the transfer's packing and checks use once (CUDA
        loads a kernel's module at its first use: tens of ms measured inside the pause on an
        H100, 20 ms for the first packing on an H200), then capture each chunk's checks as a
        CUDA graph (`finite`: the receiver's checks, else the sender's). Reads this plan's
        buffers only (the packed ones are scratch)."""
        side = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            self.reset()
            self.pack()  # the packing's copy kernel too (writes only the packed buffers, scratch here)
            for c in range(len(self.chunks)):
                self.check_chunk(c)
            self.peer_sums.copy_(self.sums)
        if side is not None:
            torch.cuda.current_stream(self.device).wait_stream(side)
        self.verdict()
        self.reset()
        if side is not None and self._graphs is None:
            self._capture(side, finite)

    def _capture(self, side: torch.cuda.Stream, finite: bool) -> None:
        """One CUDA graph per chunk's checks (`check_chunk` replays it). Captured on a side
        stream in this thread only (thread-local mode: the process's other threads keep using
        CUDA meanwhile), through the low-level calls: `torch.cuda.graph` would synchronize the
        device and empty the allocator's cache in the middle of training."""
        try:
            pool = torch.cuda.graph_pool_handle()
            graphs = []
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for c in range(len(self.chunks)):
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        norms = self._checks(c, finite)
                    finally:
                        graph.capture_end()
                    graphs.append((graph, norms))
                for graph, _ in graphs:  # a graph's first launch uploads it: 20 ms for 250 kernels, measured
                    graph.replay()       # on an H200 inside the pause; done here instead
            side.synchronize()
        except (RuntimeError, TypeError, AttributeError) as exc:  # eager checks: same results, more host time
            log.warning("transfer checks not captured as CUDA graphs: %s", exc)
            return
        self._graphs, self._graphs_finite = graphs, finite

    def reset(self) -> None:
        self._norms = []

    def verdict(self) -> tuple[int, int]:
        """(wire tensors whose word sum differs from the peer's, floating tensors holding NaN or
        Inf): one read back to the host."""
        bad = (self.sums != self.peer_sums).sum()
        nonfin = (torch.cat(self._norms).isfinite().logical_not().sum() if self._norms
                  else torch.zeros((), dtype=torch.int64, device=self.device))
        a, b = torch.stack([bad, nonfin.to(bad.device)]).tolist()
        return int(a), int(b)


def of_state(state: dict) -> tuple[object, Plan]:
    """(skeleton, plan) of a state, the state's own tensors as the buffers (the sender's)."""
    tensors: list[torch.Tensor] = []
    paths: list[str] = []
    skeleton = flatten(state, tensors, paths)
    # the very tensor objects (not detached aliases): a workload's load_state_dict skips the
    # tensors that already are its own, by identity
    tensors = [t if t.is_contiguous() else t.detach().contiguous() for t in tensors]
    return skeleton, Plan(specs_of(paths, tensors), tensors)


def into(specs, like: dict | None) -> Plan:
    """The receiver's plan for a sender's `specs`: `like`'s tensors where key path, shape, dtype
    and device match (a warm standby's buffers), new ones elsewhere."""
    have: list[torch.Tensor] = []
    paths: list[str] = []
    if like is not None:
        flatten(like, have, paths)
    targets = dict(zip(paths, have))
    out = []
    for path, shape, dtype, device in specs:
        dt = dtype_of(dtype)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"bad device {device!r} at {path}")
        t = targets.get(path)
        if (t is None or tuple(t.shape) != tuple(shape) or t.dtype != dt or not t.is_contiguous()
                or t.device.type != device):
            t = torch.empty(shape, dtype=dt, device="cuda" if device == "cuda" else "cpu")
        out.append(t)
    return Plan(specs, out)


def for_receiving(like: dict) -> Plan:
    """A joiner's Phase-1 guess: its own state's layout, received into its own tensors."""
    _, plan = of_state(like)
    return plan
