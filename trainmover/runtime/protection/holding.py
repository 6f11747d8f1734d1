"""The standby as the holder of a one-node job's snapshots.

Where a snapshot must live: what a SIGKILL (or a crashed node) takes is the worker's process,
with its memory, pinned buffers and GPU; with a dead node also every other process there. With
more than one training node a rank's copy goes to the same local index on the next node
(snapshot.py). With one training node there is no other training node, and a copy kept in
another process on the same node would survive a killed process but not the node. The warm
standby is on another node, it is the one that will need the copy, and it is idle: it holds
the copies of the node it would replace. At recovery the state is then already where it is
needed: no transfer pair to build and nothing on the wire, only a host-to-device copy from
pinned memory into the standby's own model and optimizer buffers (capture.restore_into).
What it costs: the standby's host memory, 2 versions of the node's state (the newest complete
one survives an exchange cut by the failure), and one copy of the state over the network per
snapshot, in background threads on both sides. The controller assigns the holder (`hold`: a
ready standby, while the job has one training node) and tells both sides; the holder reports
each complete, verified version (`snapshot_held`), and the controller picks from those reports
(controller/policy/tiers.py), never from the assignment.

Protocol, per ward rank, on a 2-member gloo group (member 0 the worker, 1 the standby) under
the assignment's prefix, beside a store client of each side's own (a long wait here must not
hold up the agent's store operations). Version n:

    worker:  store  <prefix>v<n>/manifest  (step, skeleton, key paths, shapes, dtypes, word digest)
             gloo   every tensor, straight from the pinned slab, spread over STREAMS connections
    standby: gloo   into a slab of its own (pinned), checks each tensor as it lands (word sum,
             NaN/Inf; on its GPU when it has one), compares the word digest, then
             store <prefix>v<n>/verdict<a>  OK / AGAIN / REFUSED
    AGAIN: the worker sends the tensors again (attempt a+1), up to transfer.ATTEMPTS times.

The first version, where both sides can (a GPU holder with room for it): straight from the
worker's model and optimizer tensors into new buffers on the standby's GPU, over a 2-member
transfer pair of its own (NCCL on GPUs; `direct/` under the ward's prefix), at the first step
boundary after that pair is built. The worker waits for it (the copy, about as long as a planned
migration's), but nothing on either side is allocated in host memory or pinned first: pinning
a 1B model's 14.6 GB took the holder 3.7-6.3 s on the lent H200 host (its memory grows as it is
touched) and the worker as long again, so the job was unprotected for 7.5 s after its first
step. The holder says first whether it takes it (`direct/offer`: yes/no, from its free GPU
memory); the worker says when it sends (`direct/go`), so neither posts an operation that waits
for the other. The host versions then go on as below; the GPU version is dropped once two host
versions are held.

The standby posts its receives only once the manifest is there, i.e. while the worker sends:
no gloo operation waits for the next snapshot (an abandoned gloo operation that times out ends
the process). Gloo groups whose peer may be gone are never destroyed (that ends the process
too): both sides keep them until exit (`KEPT`).
"""
from __future__ import annotations

import datetime
import io
import logging
import threading
import time

import torch
import torch.distributed as dist

from trainmover.errors import MigrationError
from trainmover.groups.swappable import gloo_group
from trainmover.groups.tensors import dtype_of, numel, unflatten
from trainmover.protocol.store import AuthStore
from trainmover.runtime.protection import capture
from trainmover.runtime.transfer import state as transfer

log = logging.getLogger("trainmover.holding")

OK, AGAIN, REFUSED = transfer.OK, transfer.AGAIN, transfer.REFUSED
POLL_S = 0.05    # a holder looks for the next version's manifest this often
STREAMS = 8      # connections of a pair, tensors spread over them by index: one TCP stream moved
#                  a 1B model's 14.6 GB in 4.0 s on an H100 host, 4 streams in 1.8 s on an H200
#                  host; the first version is what protects the job (same number on both
#                  sides: a code constant, not a setting)
KEPT: list = []  # gloo groups never destroyed (see the module docstring)
DIRECT_MARGIN_BYTES = 2 << 30  # free GPU memory a holder keeps beside the first version (its shadow steps)


def ward_prefix(prefix: str, rank: int) -> str:
    return f"{prefix}r{rank}/"


def _client(store_addr: tuple[str, int], timeout_s: float, key: bytes) -> AuthStore:
    """A store client of this side's own, its values tagged with the job's key (protocol/store.py)."""
    return AuthStore(dist.TCPStore(store_addr[0], store_addr[1], is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s)), key)


def _wait_key(store, key: str, deadline: float, stop: threading.Event | None = None, poll_s: float = 0.01) -> bool:
    """Whether `key` appeared before `deadline` (False also when `stop` was set). Polled with
    `check`: a timed `wait` that expires makes c10d log two warnings, every time."""
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            return False
        if store.check([key]):
            return True
        time.sleep(poll_s)
    return False


def _sendable(views: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    return [(i, t.reshape(-1).view(torch.uint8)) for i, t in enumerate(views) if t.numel()]


class StandbyLink:
    """The worker's side: sends each captured version to its standby holder (member 0)."""

    def __init__(self, store_addr, prefix: str, rank: int, holder: str, host: str, timeout_s: float, *, key: bytes,
                 direct=None):
        """`direct(store, prefix, grank)`: builds the 2-member transfer pair of the first version
        (module docstring); None: host versions only."""
        self.prefix, self.rank, self.holder, self.timeout_s = ward_prefix(prefix, rank), rank, holder, timeout_s
        self.key = key
        self.version = 0
        self.pair = None
        self.error = ""
        self.store = None
        self.built = threading.Event()
        self.direct = None          # the first version's transfer pair, once built
        self.direct_sent = direct is None  # nothing to send that way (or sent, or given up)
        self.direct_note = ""       # why not, if not
        self.direct_ok = False      # the first version was held that way
        # Built at once (in a thread), not at the next snapshot: the holder waits for us now.
        threading.Thread(target=self._build, args=(store_addr, host, direct, _device()), name="tm-hold-link",
                         daemon=True).start()

    def _build(self, store_addr, host, direct, device) -> None:
        try:
            self.store = _client(store_addr, self.timeout_s, self.key)
            self.pair = gloo_group(self.store, self.prefix + "pair/", 0, 2, host=host,
                                   timeout=datetime.timedelta(seconds=self.timeout_s), devices=STREAMS)
            KEPT.append(self.pair)
        except Exception as exc:  # noqa: BLE001 - no holder: snapshots stay on this node, reported
            self.error = f"link to holder {self.holder} for rank {self.rank}: {exc}"
            log.warning("%s", self.error)
        self.built.set()
        if direct is not None and self.store is not None:
            self._build_direct(direct, device)

    def _build_direct(self, direct, device) -> None:
        _set_device(device)
        try:
            offer = self.prefix + "direct/offer"
            if not _wait_key(self.store, offer, time.monotonic() + self.timeout_s):
                raise MigrationError(f"holder {self.holder} said nothing in {self.timeout_s:g}s", phase="snapshot")
            said = self.store.get(offer).decode()
            if said != "yes":
                self.direct_note = f"holder {self.holder}: {said}"
                log.info("first snapshot through host memory: %s", self.direct_note)
                self.direct_sent = True
                return
            self.direct = direct(self.store, self.prefix + "direct/", 0)
            log.info("first snapshot of rank %d goes straight to %s's GPU", self.rank, self.holder)
        except Exception as exc:  # noqa: BLE001 - host versions only
            self.direct_note = f"first-version pair to {self.holder} not built: {exc}"
            log.warning("%s", self.direct_note)
            self.direct_sent = True
            try:  # the holder waits for it before pinning its host buffers: it is not coming
                self.store.set(self.prefix + "direct/go", "-1")
            except Exception:  # noqa: BLE001 - then the holder waits its deadline
                pass

    def direct_due(self) -> bool:
        """The first version may go straight to the holder's GPU now (its pair is built)."""
        return not self.direct_sent and self.direct is not None

    def send_direct(self, step: int, state: dict, corrupt: bool = False) -> dict:
        """The first version, from the live `state` of `step` (the caller's training waits: a
        step boundary, nothing in flight). Verified by the holder (checksum, NaN/Inf)."""
        self.direct_sent = True  # once, whatever happens: the host versions follow anyway
        t0 = time.perf_counter()
        self.store.set(self.prefix + "direct/go", str(int(step)))
        stats = transfer.send_verified(state, self.direct, key=self.key, context=self.prefix + "direct/", dst=1,
                                       corrupt=corrupt)
        return {"bytes": stats.bytes, "send_s": time.perf_counter() - t0, "copy_s": stats.copy_s,
                "attempts": stats.attempts, "direct": True}

    def send(self, cap: capture.Captured, corrupt: bool = False) -> dict:
        """Send one complete version (call after `cap.wait`); verified by the holder. Returns
        bytes, seconds, attempts. Raises MigrationError when the holder refused it or kept
        seeing a mismatch, or on a deadline."""
        if not self.built.wait(self.timeout_s) or self.pair is None:
            raise MigrationError(self.error or f"link to holder {self.holder}: not built in {self.timeout_s:g}s",
                                 phase="snapshot", rank=self.rank)
        t0 = time.perf_counter()
        self.version += 1
        key = f"{self.prefix}v{self.version}/"
        buf = io.BytesIO()
        torch.save({"step": cap.step, "skeleton": cap.skeleton, "specs": cap.specs, "digest": cap.digest}, buf)
        self.store.set(key + "manifest", buf.getvalue())
        views = _sendable(cap.slab.views)
        for attempt in range(1, transfer.ATTEMPTS + 1):
            spoilt = None
            if corrupt and attempt == 1 and views:  # fault injection: the first copy arrives with a flipped byte
                spoilt = views[0][1].clone()
                spoilt[0] ^= 0xFF
            works = [self.pair.send([spoilt if (spoilt is not None and n == 0) else t], 1, i)
                     for n, (i, t) in enumerate(views)]
            for w in works:
                w.wait()
            if not _wait_key(self.store, f"{key}verdict{attempt}", time.monotonic() + self.timeout_s):
                raise MigrationError(f"holder {self.holder} gave no verdict on step {cap.step} in {self.timeout_s:g}s",
                                     phase="snapshot", rank=self.rank)
            verdict = int(self.store.get(f"{key}verdict{attempt}"))
            if verdict == OK:
                return {"bytes": cap.slab.bytes, "send_s": time.perf_counter() - t0, "attempts": attempt}
            if verdict == REFUSED:
                raise MigrationError(f"holder {self.holder} refused step {cap.step} (NaN/Inf)", phase="snapshot",
                                     rank=self.rank)
            log.warning("snapshot %d to %s: checksum mismatch (attempt %d); sending again", cap.step, self.holder,
                        attempt)
        raise MigrationError(f"snapshot {cap.step} to {self.holder}: checksum mismatch in all {transfer.ATTEMPTS} "
                             "attempts", phase="snapshot", rank=self.rank)


def _device() -> int | None:
    """The caller's CUDA device (a thread starts on device 0, whatever its process set)."""
    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def _set_device(device: int | None) -> None:
    if device is not None:
        torch.cuda.set_device(device)


class OnDevice:
    """The first version's buffers on the holder's GPU (slab-like: views, bytes): never
    reused for a host version."""
    pinned = False
    on_device = True

    def __init__(self, tensors: list[torch.Tensor]):
        self.views = tensors
        self.bytes = sum(t.numel() * t.element_size() for t in tensors)

    def matches(self, specs) -> bool:
        return False


class Held:
    """One complete, verified version a holder keeps (in one of its slabs, or on its GPU)."""

    def __init__(self, step: int, skeleton, specs, slab):
        self.step, self.skeleton, self.specs, self.slab = step, skeleton, specs, slab
        self.on_device = getattr(slab, "on_device", False)

    def state(self) -> dict:
        return unflatten(self.skeleton, list(self.slab.views))


class Holding:
    """The standby's side: receives the versions of ward rank `ward` (member 1) into slabs of its
    own, keeps the newest 2 complete ones and reports each (`report(ward, steps, detail)`)."""

    def __init__(self, store_addr, prefix: str, ward: int, host: str, timeout_s: float, report, *, key: bytes,
                 verify_on: str | None = None, layout: list | None = None, direct=None):
        self.prefix, self.ward, self.timeout_s, self.report = ward_prefix(prefix, ward), ward, timeout_s, report
        self.key = key
        self.verify_on = verify_on if verify_on == "cuda" and torch.cuda.is_available() else None
        self.pin = self.verify_on is not None
        self.held: dict[int, Held] = {}
        self.slabs: list[capture.Slab] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.error = ""
        self.last: dict = {}
        self.layout = layout  # the expected layout: both slabs allocated before the first version
        self.alloc_s: float | None = None
        self.first_held_t: float | None = None  # wall time the first version was complete and verified
        self.alloc_detail: dict = {}
        self.second: threading.Thread | None = None
        self.direct_note = ""
        # set once the first version came to the GPU or will not: host buffers are pinned only
        # then (pinning beside that copy would slow it: both want the driver)
        self.direct_done = threading.Event()
        if direct is None:
            self.direct_done.set()
        self.thread = threading.Thread(target=self._run, args=(store_addr, host), name=f"tm-holding-r{ward}",
                                       daemon=True)
        self.thread.start()
        if direct is not None:
            threading.Thread(target=self._direct, args=(store_addr, direct, _device()),
                             name=f"tm-holding-direct-r{ward}", daemon=True).start()

    def steps(self) -> list[int]:
        with self.lock:
            return sorted(self.held)

    def version(self, step: int) -> Held:
        with self.lock:
            if step not in self.held:
                raise KeyError(f"this standby holds no snapshot of rank {self.ward} at step {step} "
                               f"(holds {sorted(self.held)})")
            return self.held[step]

    def close(self) -> None:
        """Stop receiving (this standby takes a rank now); what it holds stays readable."""
        self.stop.set()

    def _room(self) -> str:
        """Why the first version cannot go on this GPU ("": it can): it needs the state's size
        beside the standby's own model, with a margin for its shadow steps."""
        if not (self.verify_on == "cuda" and self.layout):
            return "no GPU, or the layout is not known ahead"
        need = sum(numel(shape) * dtype_of(dt).itemsize for _, shape, dt in self.layout)
        need += DIRECT_MARGIN_BYTES
        free, _ = torch.cuda.mem_get_info()
        return "" if free >= need else f"{free / 2**30:.1f} GiB free on its GPU, {need / 2**30:.1f} needed"

    def _direct(self, store_addr, direct, device) -> None:
        """The first version straight onto this GPU (module docstring)."""
        try:
            self._direct_version(store_addr, direct, device)
        finally:
            self.direct_done.set()

    def _direct_version(self, store_addr, direct, device) -> None:
        _set_device(device)
        t0 = time.perf_counter()
        try:
            store = _client(store_addr, self.timeout_s, self.key)
            why = self._room()
            store.set(self.prefix + "direct/offer", "yes" if not why else f"no: {why}")
            if why:
                self.direct_note = why
                log.info("holding rank %d: first version through host memory (%s)", self.ward, why)
                return
            pair = direct(store, self.prefix + "direct/", 1)
            KEPT.append(pair)  # never torn down under a peer that may still use it
            if not _wait_key(store, self.prefix + "direct/go", time.monotonic() + self.timeout_s, self.stop,
                             poll_s=0.01):
                self.direct_note = f"the worker sent no first version in {self.timeout_s:g}s"
                return
            if int(store.get(self.prefix + "direct/go")) < 0:
                self.direct_note = "the worker's side of the pair was not built"
                return
            t1 = time.perf_counter()
            state, stats = transfer.recv_verified(pair, key=self.key, context=self.prefix + "direct/", src=0)
        except Exception as exc:  # noqa: BLE001 - the host versions still come
            self.direct_note = f"first version not received on the GPU: {exc}"
            log.warning("holding rank %d: %s", self.ward, self.direct_note)
            return
        skeleton, paths, tensors = capture.flatten(state)
        step = int(state["step"])
        with self.lock:
            if self.stop.is_set():
                return
            self.held[step] = Held(step, skeleton, capture.specs_of(paths, tensors), OnDevice(tensors))
            steps = sorted(self.held)
        self.first_held_t = self.first_held_t or time.time()
        self.report(self.ward, steps, {"step": step, "bytes": stats.bytes, "direct": True, "on_device": True,
                                       "recv_s": round(stats.copy_s, 4), "seconds": round(time.perf_counter() - t1, 4),
                                       "build_s": round(t1 - t0, 4), "attempts": stats.attempts,
                                       "first_held_t": self.first_held_t})

    def _second_slab(self) -> None:
        try:
            slab = capture.Slab(self.layout, pin=self.pin)
        except (RuntimeError, MemoryError) as exc:  # one slab still holds every other version
            log.warning("holding rank %d: second slab not allocated: %s", self.ward, exc)
            return
        with self.lock:
            self.slabs.append(slab)

    def _slab(self, specs) -> capture.Slab:
        """A slab that holds no version we keep: the one the older version is in is freed first
        (a version is dropped before its slab is written, never while it is being read)."""
        with self.lock:
            in_use = {id(h.slab) for h in self.held.values()}
            free = [s for s in self.slabs if id(s) not in in_use and s.matches(specs)]
            if free:
                return free[0]
            if self.slabs and not self.held and not self.slabs[0].matches(specs):
                mine = self.slabs[0].specs
                diff = next(((a, b) for a, b in zip(mine, specs) if tuple(a) != tuple(b)), (len(mine), len(specs)))
                log.warning("holding rank %d: the worker's layout differs from the slab allocated ahead (%s vs %s): "
                            "allocating another", self.ward, diff[0], diff[1])
        if self.second is not None and self.second.is_alive():
            self.second.join(self.timeout_s)  # the second slab, being pinned since the first version was held
            self.second = None
            return self._slab(specs)
        with self.lock:
            on_host = [s for s, h in self.held.items() if not h.on_device]
            if len(self.slabs) >= 2 and on_host:
                victim = self.held.pop(min(on_host)).slab
                if victim.matches(specs):
                    return victim
                self.slabs.remove(victim)
        slab = capture.Slab(specs, pin=self.pin)
        with self.lock:
            self.slabs.append(slab)
        return slab

    def _first_slab(self) -> None:
        self.direct_done.wait(self.timeout_s)
        t0 = time.perf_counter()
        try:
            first = capture.Slab(self.layout, pin=self.pin)
        except (RuntimeError, MemoryError) as exc:  # allocated at the first version instead
            log.warning("holding rank %d: slab not allocated ahead: %s", self.ward, exc)
            return
        with self.lock:
            self.slabs = [first]
        self.alloc_s = time.perf_counter() - t0
        self.alloc_detail = {"touch_s": round(getattr(first, "touch_s", 0.0), 3),
                             "pin_mode": getattr(first, "pin_mode", None)}

    def _run(self, store_addr, host) -> None:
        # One slab before the first version (it alone protects the job), pinned while the link
        # is built; the second once the first version is held (pinning both at once took 5.3 s
        # for a 1B model, and pinning beside the first version's receipt slowed both).
        first = threading.Thread(target=self._first_slab, name=f"tm-holding-slab-r{self.ward}", daemon=True)
        if self.layout:
            first.start()
        try:
            store = _client(store_addr, self.timeout_s, self.key)
            pair = gloo_group(store, self.prefix + "pair/", 1, 2, host=host,
                              timeout=datetime.timedelta(seconds=self.timeout_s), devices=STREAMS)
            KEPT.append(pair)
        except Exception as exc:  # noqa: BLE001 - this standby holds nothing; the controller sees no reports
            self.error = f"holding rank {self.ward}: link not built: {exc}"
            log.warning("%s", self.error)
            return
        if self.layout:
            first.join()
        n = 0
        while not self.stop.is_set():
            n += 1
            key = f"{self.prefix}v{n}/"
            if not _wait_key(store, key + "manifest", float("inf"), self.stop, poll_s=POLL_S):
                return
            try:
                self._receive(store, pair, key)
            except MigrationError as exc:  # refused (NaN/Inf) or spoilt every time: the next version may do
                log.warning("holding rank %d: version %d: %s", self.ward, n, exc)
            except Exception as exc:  # noqa: BLE001 - the worker died mid-copy: the versions before stay
                self.error = f"holding rank {self.ward}: version {n}: {exc}"
                log.warning("%s", self.error)
                return
            finally:
                store.delete_key(key + "manifest")

    def _receive(self, store, pair, key: str) -> None:
        t0 = time.perf_counter()
        meta = torch.load(io.BytesIO(store.get(key + "manifest")), weights_only=True)
        specs = [(p, tuple(s), str(d)) for p, s, d in meta["specs"]]
        slab = self._slab(specs)
        views = _sendable(slab.views)
        for attempt in range(1, transfer.ATTEMPTS + 1):
            t1 = time.perf_counter()
            works = {i: pair.recv([t], 0, i) for i, t in views}
            # each tensor checked as it lands (in order), while the later ones are on the wire
            check = capture.Checker(self.verify_on)
            for i, t in enumerate(slab.views):
                if i in works:
                    works[i].wait()
                check.add(t)
            t2 = time.perf_counter()
            got = capture.word_digest(specs, check.sums())
            if got != meta["digest"]:
                log.warning("snapshot %d of rank %d: checksum mismatch (attempt %d); asking again", meta["step"],
                            self.ward, attempt)
                store.set(f"{key}verdict{attempt}", str(AGAIN))
                continue
            if check.nonfinite():
                store.set(f"{key}verdict{attempt}", str(REFUSED))
                raise MigrationError(f"snapshot {meta['step']} of rank {self.ward} holds NaN/Inf: refused",
                                     phase="snapshot")
            with self.lock:
                self.held[int(meta["step"])] = Held(int(meta["step"]), meta["skeleton"], specs, slab)
                if sum(not h.on_device for h in self.held.values()) >= 2:  # the GPU's copy is not needed now
                    self.held = {s: h for s, h in self.held.items() if not h.on_device}
                steps = sorted(self.held)
            self.first_held_t = self.first_held_t or time.time()
            if self.layout and self.second is None and len(self.slabs) < 2:
                self.second = threading.Thread(target=self._second_slab, name=f"tm-holding-slab2-r{self.ward}",
                                               daemon=True)
                self.second.start()
            store.set(f"{key}verdict{attempt}", str(OK))
            self.last = {"step": int(meta["step"]), "bytes": slab.bytes, "alloc_s": self.alloc_s,
                         "recv_s": round(t2 - t1, 4), "streams": STREAMS,
                         "verify_s": round(time.perf_counter() - t2, 4), "seconds": round(time.perf_counter() - t0, 4),
                         "attempts": attempt, "pinned": slab.pinned, "first_held_t": self.first_held_t,
                         **self.alloc_detail}
            self.report(self.ward, steps, dict(self.last))
            return
        raise MigrationError(f"snapshot {meta['step']} of rank {self.ward}: checksum mismatch in all "
                             f"{transfer.ATTEMPTS} attempts", phase="snapshot")
