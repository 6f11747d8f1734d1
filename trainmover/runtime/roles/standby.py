"""A standby's part of the agent: rehearse every role a standby may take, stay warm, re-warm.

A standby builds the workload against sandboxed groups (every collective answered from the
live job's recordings, trainmover.sandbox), rehearses each role in turn (each pipeline stage
kind; one role without pipeline parallelism), runs shadow steps until its collectives are
steady, reports `ready` and waits. When a role's live rank records a new version it re-warms.
A `prepare` makes it a joiner (switch.py), a `recover` takes a vanished rank (recovery.py).

On a host it shares with live ranks (the GPU machines' one-host allocation, the CPU demo's
local cluster) a standby's warm-up must not slow them: the warm-up runs in a thread of its own
at `TM_STANDBY_NICE` (niceness is per thread on Linux; threads it starts inherit it), with few
torch.compile workers (`TM_STANDBY_COMPILE_THREADS`) and one intra-op thread (worker.main). The
main thread, which joins and trains, is never niced: an unprivileged process could not lower
its niceness back (that needs CAP_SYS_NICE), and a joiner must train at the job's priority. In a one-node job it also binds itself to
the rank it will take and builds that rank's groups ahead (ahead.py), and holds the node's
snapshots when the controller names it (`hold`, holding.py).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

from trainmover.errors import MigrationError
from trainmover.groups.swappable import CONTROL, SwappableGroup
from trainmover.runtime.roles import ahead
from trainmover.runtime.changes import UseGroups
from trainmover.runtime.context import RankContext
from trainmover.runtime.protection.role import Protection
from trainmover.runtime.rankstate import RankState

log = logging.getLogger("trainmover.worker")

REWARM_POLL_S = 1.0  # an idle standby looks for a newer recording version this often


class StandbyRole:
    """A standby's warm-up and what it keeps warm: the role it rehearsed, the recording versions
    it replayed, the groups it built ahead. Its wait for a `prepare` or a `recover` is the
    process's (worker.Agent.serve_as_standby), which hands those to the switch or the recovery."""

    def __init__(self, ctx: RankContext, protection: Protection):
        self.ctx, self.protection = ctx, protection
        self.ahead: ahead.Ahead | None = None  # groups built ahead for the rank it will take (one-node jobs)
        self.replayed: dict[int, int] = {}  # the latest recording version it warmed on, by role rank
        self.rehearsed: int | None = None  # the rank whose role its workload is built for
        self.shadow_step: int | None = None  # step its shadow steps replay (the latest recorded one)

    def warm_up(self) -> float:
        """The first warm-up, then `ready`. Returns when it began (perf_counter), which later
        `ready` reports count their warm-up time from."""
        t0 = time.perf_counter()
        limits = limit_warmup(self.ctx.spec.job.standby_compile_threads)
        expected, shadow, steps, limits["nice"] = niced(self.ctx.spec.job.standby_nice, self._warm_up)
        if expected is not None and self.ctx.spec.job.standby_warmup != "cold":
            self.ahead = ahead.Ahead(self.ctx, expected)
        self.ctx.send("ready", enter=RankState.READY, node=self.ctx.spec.node, local=self.ctx.local,
                      warmup_s=time.perf_counter() - t0, shadow_steps=steps,
                      detail={**shadow, "limits": limits,
                              "bound_rank": expected if expected is not None else self.rehearsed})
        log.info("standby on %s warm after %.2fs", self.ctx.spec.node, time.perf_counter() - t0)
        return t0

    def rewarm_if_newer(self, t0: float) -> None:
        """Between the controller's messages: re-warm, niced, if a role recorded a new version."""
        niced(self.ctx.spec.job.standby_nice, self._rewarm_if_newer, t0)

    def _warm_up(self) -> tuple:
        """The warm-up proper (run niced, in its own thread): replay the recordings, rehearse
        the role it will take, shadow steps until steady. Returns (bound rank or None, replay
        report, shadow steps)."""
        self.ctx.faults.at("warmup")  # die-in-warmup: the controller gives it to the chosen launch only
        shadow = self._replay()
        expected = ahead.anticipated_rank(self.ctx.spec.world_size, self.ctx.spec.job.ranks_per_node, self.ctx.local)
        if shadow["replay"] != "done":
            log.warning("shadow iterations without a recording: %s", shadow["replay"])
            if self.rehearsed is None:  # else: a role before the missing one was rehearsed and stays built
                rehearse = self.ctx.local % self.ctx.spec.world_size  # any valid rank: a join rebinds to the leaver's
                self.rehearse(rehearse, self.ctx.make_groups(rehearse, sandbox=True))
        if expected is not None and self.rehearsed != expected:  # bound now to the rank it will take
            self.rehearse(expected, self.ctx.make_groups(expected, sandbox=True))
        with self.warm_stance():
            steps = self.shadow_until_steady(self.ctx.spec.job.shadow_steps)
        return expected, shadow, steps

    def ahead_builder(self, build):
        """Phase 1's builder, taking a group built ahead where there is one (one-node jobs)."""
        def take_or_build(name: str, prefix: str, grank: int, size: int):
            if self.ahead is not None and size == 1 and grank == 0:
                got = self.ahead.take(name, (self.ahead.rank,), self.ahead.rank)
                if got is not None:
                    return got
            return build(name, prefix, grank, size)
        return take_or_build

    def now_a_worker(self, step: int) -> None:
        """This standby took a rank: it stops holding snapshots and gives back the groups built
        ahead it did not use (retired off the critical path)."""
        self.protection.stop_holding()
        if self.ahead is not None:
            for backend in self.ahead.rest():
                self.ctx.retire(backend, step)
            self.ahead = None

    def roles(self) -> dict[str, int]:
        """The roles a standby rehearses and the ranks that record them ({} if not recording)."""
        if not self.ctx.spec.recording_dir or not self.ctx.spec.job.record_iterations:
            return {}
        return self.ctx.workload.standby_roles(self.ctx.spec.world_size)

    def _replay(self) -> dict:
        """Shadow iterations on the live job's recordings: the standby rehearses every role
        (each pipeline stage kind; one role without pipeline parallelism) and must compute the
        very losses and sends its rank computed. Between roles it drops the previous role's
        model and optimizer, so that it never holds more than one rank's state; the last
        role stays built (a join rebinds it to the leaver's rank)."""
        if self.ctx.spec.job.standby_warmup == "cold":
            return {"replay": "skipped: cold standby (TM_STANDBY_WARMUP=cold)"}
        roles = self.roles()
        if not roles:
            return {"replay": "unavailable: recording disabled"}
        from trainmover.sandbox import shadow

        # The live ranks may record later than the job start (TM_RECORD_FROM_STEP): wait longer.
        done, failed = shadow.replay_roles(
            self.ctx.specs, Path(self.ctx.spec.recording_dir), roles, 3 * self.ctx.spec.job.group_timeout_s, CONTROL,
            self.rehearse,
            self.ctx.workload.train_step, settle=lambda: self.shadow_until_steady(self.ctx.spec.job.shadow_steps),
            reset_peak=lambda: reset_peak_memory(self.ctx.device), peak=lambda: peak_memory(self.ctx.device))
        for report in done:
            self.replayed[report["rank"]], self.shadow_step = report["version"], report["last_step"]
        if failed is not None:
            return {**failed, "roles": done}
        free_device_memory(self.ctx.device)  # keeps the last role's model and optimizer, not its activations
        return shadow.combine(done, self.ctx.memory())

    def rehearse(self, rank: int, groups: dict[str, SwappableGroup]) -> None:
        """A standby: build the workload for `rank`'s role on `groups` (sandboxed), first
        dropping the role it holds, so that it never holds two ranks' state."""
        if self.rehearsed is not None:
            self.ctx.workload.release()
            free_device_memory(self.ctx.device)
        self.ctx.apply(UseGroups(groups))
        workload = self.ctx.workload
        (workload.rebind if self.rehearsed is not None else workload.build)(self.ctx.build_context(rank))
        self.rehearsed = rank

    @contextlib.contextmanager
    def warm_stance(self):
        """Around the shadow steps. A cold standby (a benchmark's baseline) forgets afterwards
        everything it compiled, so that its first real step compiles as in a fresh process.

        Why not skip compiling in its shadow steps (force_eager): DDP fixes its bucket layout
        from the gradient order of its first step, and eager and compiled backward passes
        order gradients differently; a joiner whose buckets differ from the job's reduces
        other parameters at the same offsets (silently wrong) or buckets of other sizes (NCCL
        hangs). So the layout comes from a compiled step, as the job's did, and only the
        compiled code is thrown away. (Every joiner's layout is checked: _layout_mismatch.)"""
        yield
        if self.ctx.spec.job.standby_warmup == "cold":
            forget_compiled(self.ctx.spec.node)

    def _rewarm_if_newer(self, t0: float) -> None:
        """A warm standby re-warms when a role's live rank recorded a new version (its
        collectives changed shape): it rebinds to that role if it holds another, replays the
        version, then reports ready again with the new version's report."""
        if self.ctx.spec.job.standby_warmup == "cold" or not self.replayed:
            return
        from trainmover.sandbox import recording, shadow
        found = {rank: shadow.newer(recording.base_of(self.ctx.spec.recording_dir, rank), version)
                 for rank, version in self.replayed.items()}
        rank, version = next(((r, v) for r, v in found.items() if v is not None), (None, None))
        if version is None:
            return
        self.ctx.send("warming", enter=RankState.WARMING, node=self.ctx.spec.node, version=version, rank=rank)
        if rank != self.rehearsed:
            self.rehearse(rank, self.ctx.make_groups(rank, sandbox=True))
        path = recording.version_path(recording.base_of(self.ctx.spec.recording_dir, rank), version)
        report = shadow.rewarm(self.ctx.groups, path, CONTROL, self.ctx.workload.train_step)
        self.replayed[rank], self.shadow_step = version, report["last_step"]
        steps = self.shadow_until_steady(self.ctx.spec.job.shadow_steps)
        self.ctx.send("ready", enter=RankState.READY, node=self.ctx.spec.node, local=self.ctx.local,
                      warmup_s=time.perf_counter() - t0, shadow_steps=steps, detail=report)

    def shadow_until_steady(self, max_steps: int) -> int:
        """Run shadow steps until a step issues the same collectives as the one before.

        Wrappers do one-time collectives in their first iterations (DDP broadcasts its
        rebuilt bucket layout in the second forward). A joiner must have done those in the
        sandbox: issuing them against the live job would mismatch the stayers' sequence."""
        sandboxes = [g.inner for g in self.ctx.groups.values()]
        previous, steps = None, 0
        while steps < max_steps:
            marks = [len(b.calls) for b in sandboxes]
            workload = self.ctx.workload
            workload.train_step(workload.shadow_data_step() if self.shadow_step is None else self.shadow_step)
            steps += 1
            signature = [tuple(b.calls[m:]) for b, m in zip(sandboxes, marks)]
            if signature == previous:
                return steps
            previous = signature
        raise MigrationError(f"collectives still changing after {max_steps} shadow steps", phase="warmup",
                             host=self.ctx.spec.node)


def thread_nice(tid: int | None = None) -> int:
    """The niceness of thread `tid` (a native thread id; None: the calling thread)."""
    return os.getpriority(os.PRIO_PROCESS, tid if tid is not None else threading.get_native_id())


def niced(nice: int, fn, *args):
    """`fn(*args)` in a thread of its own at niceness `nice` (0: as this thread), waited for;
    returns (what fn returned, unpacked when a tuple) + the niceness it ran at, or raises what
    it raised. Only that thread and the threads it starts are niced: the caller keeps its
    priority, which an unprivileged process could not get back. The CUDA device is per thread:
    the caller's is carried over. Each call is bounded by fn's own deadlines (the warm-up's
    group and phase timeouts); a thread cannot be cut short from outside."""
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    out: dict = {}

    def body():
        try:
            if nice:
                # relative to the caller's, as nice(1) is: an absolute value below a niced job's
                # own would be a lowering, which an unprivileged process may not do
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(thread_nice() + nice, 19))
            out["nice"] = thread_nice()
            if device is not None:
                torch.cuda.set_device(device)
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = exc

    t = threading.Thread(target=body, name="tm-warmup", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    value = out["value"]
    return (*value, out["nice"]) if isinstance(value, tuple) else (value, out["nice"])


def limit_warmup(compile_threads: int) -> dict:
    """A standby's process on a shared host: its torch.compile worker pool (set before its
    first compile: the pool is made then). Returns what applied (the warm-up's niceness: niced())."""
    out = {}
    if compile_threads:
        import torch._inductor.config as inductor
        inductor.compile_threads = compile_threads
        out["compile_threads"] = compile_threads
    out["intra_op_threads"] = torch.get_num_threads()
    return out


def reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device: str) -> int | None:
    """Most bytes torch's allocator held since the last reset (None on CPU nodes)."""
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def free_device_memory(device: str) -> None:
    """Give cached device memory back (a standby between roles, and once warm): what it keeps
    is then what it holds, not the peak of the role it rehearsed last."""
    import gc
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def forget_compiled(node: str) -> None:
    """Drop compiled code and point the compile caches at empty folders (torch's own
    recipe, torch._inductor.runtime.cache_dir_utils.temporary_cache_dir): the next compiled
    step traces, generates and builds its kernels again."""
    import tempfile
    from torch._inductor.utils import clear_caches
    fresh = tempfile.mkdtemp(prefix=f"tm-cold-{node}-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh
    os.environ["TRITON_CACHE_DIR"] = os.path.join(fresh, "triton")
    torch.compiler.reset()
    clear_caches()
