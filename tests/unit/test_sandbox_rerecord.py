"""Re-recording after a change of shapes: the live rank notices that a step's collectives no
longer match the recording and records a new version; a warm standby re-warms on it."""
import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainmover.errors import MigrationError
from trainmover.groups.swappable import SwappableGroup, gloo_group
from trainmover.groups.specs import GroupSpec
from trainmover.sandbox import recording, shadow
from trainmover.sandbox.live import Recorder, State
from trainmover.workloads.base import BuildContext, Workload

from tests.unit.late_store import LateStore

h5py = pytest.importorskip("h5py")
TIMEOUT = datetime.timedelta(seconds=30)
SPECS = [GroupSpec("world", (0, 1))]


class BatchRamp(Workload):
    """DDP over a linear model, plus an all-reduce of the per-sample losses (a global metric):
    its shape is the batch size, which doubles at every step of `grow_at` (a batch-size ramp,
    as in GPT-3's training)."""

    def __init__(self, grow_at=(4,), preset: str = "", pace_s: float = 0.0):
        # preset: passed by the controller to every workload (unused); pace_s: sleep per step, so
        # that a job through the real runtime lasts long enough for its standby to follow
        self.grow_at = (grow_at,) if isinstance(grow_at, int) else tuple(grow_at)
        self.pace_s = float(pace_s)

    def build(self, ctx: BuildContext) -> None:
        torch.manual_seed(ctx.seed)
        self.model = nn.Linear(8, 1)
        self.group = ctx.groups["world"]
        self.ddp = DDP(self.model, process_group=self.group)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.gen = torch.Generator().manual_seed(ctx.seed * 100 + ctx.rank)

    def batch(self, step: int) -> int:
        return 4 * 2 ** sum(step >= s for s in self.grow_at)

    def train_step(self, step: int) -> float:
        x = torch.randn(self.batch(step), 8, generator=self.gen)
        per_sample = (self.ddp(x).squeeze(1) - 1.0) ** 2
        loss = per_sample.mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.group.allreduce([per_sample.detach().clone()]).wait()
        if self.pace_s:
            time.sleep(self.pace_s)
        return loss.item()

    def state_dict(self):
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])


def live_run(base, store, grow_at, steps, max_versions, from_step):
    """Two live ranks train `steps` steps; rank 0 runs the Recorder (3 iterations per version:
    DDP's one-time broadcast is in the second step, the third is steady).
    Returns rank 0's reports and its recorder's final state."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()

    def rank(r):
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
        torch.set_num_threads(1)
        group = SwappableGroup("world", r, 2, [0, 1], gloo_group(client, "w/", r, 2, host="127.0.0.1", timeout=TIMEOUT))
        rec = Recorder({"world": group}, base, 0, 3, skip="control", max_versions=max_versions,
                       steady_steps=1, from_step=from_step) if r == 0 else None
        wl = BatchRamp(grow_at)
        wl.build(BuildContext(r, 2, {"world": group}, seed=3))
        reports = []
        for step in range(steps):
            if rec:
                rec.before(step)
            loss = wl.train_step(step)
            if rec:
                report = rec.after(step, loss, 0.01)
                if report:
                    reports.append(report)
                if rec.state is State.WRITING:  # the background write takes a step or several: make it
                    rec.writer.wait(60)         # one, so that the versions' steps are deterministic
        if rec:
            rec.close()
            queue.put({"reports": reports, "state": rec.state.value})

    port = store.port
    procs = [ctx.Process(target=rank, args=(r,)) for r in (0, 1)]
    [p.start() for p in procs]
    store.serve()  # after the fork: late_store says why
    try:
        out = queue.get(timeout=120)
        [p.join(30) for p in procs]
    finally:
        [p.kill() for p in procs if p.is_alive()]
        store.close()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return out


def run(tmp_path, grow_at=(5,), steps=16, max_versions=4, from_step=0):
    out = live_run(tmp_path / "rank0.h5", LateStore(TIMEOUT), grow_at, steps, max_versions, from_step)
    return tmp_path / "rank0.h5", out


def shapes(path, iteration):
    with h5py.File(path, "r") as f:
        grp = f[f"it{iteration}"]
        return int(grp.attrs["step"]), [tuple(int(x) for x in grp[k].attrs["shape"]) for k in sorted(grp)]


def test_a_change_of_shapes_is_recorded_as_a_new_version(tmp_path):
    base, out = run(tmp_path)
    assert recording.versions(base) == [1, 2]
    assert [r["version"] for r in out["reports"]] == [1, 2] and out["state"] == "watching"
    step, v1 = shapes(recording.version_path(base, 1), 0)
    assert step == 0 and (4,) in v1 and (8,) not in v1 and shapes(recording.version_path(base, 1), 2)[0] == 2
    step, v2 = shapes(recording.version_path(base, 2), 0)
    assert step >= 7 and (8,) in v2  # the change (step 5) is confirmed by step 6, recorded from then on
    with h5py.File(recording.version_path(base, 2), "r") as f:
        assert "init" not in f and int(f.attrs["version"]) == 2 and int(f.attrs["first_step"]) == step
    assert all(r["bytes"] > 0 and r["detail"]["measured"] for r in out["reports"])


def test_steady_shapes_are_recorded_once(tmp_path):
    base, out = run(tmp_path, grow_at=(100,), steps=10)
    assert recording.versions(base) == [1] and [r["version"] for r in out["reports"]] == [1]


def test_versions_are_capped(tmp_path):
    base, out = run(tmp_path, grow_at=(5, 11), steps=18, max_versions=2)
    assert recording.versions(base) == [1, 2] and out["state"] == State.STOPPED.value


def standby(base, grow_at, settle=False):
    wl = BatchRamp(grow_at)

    def build(rank, groups):
        wl.build(BuildContext(rank, 2, groups, seed=3))

    def settle_steps():  # what the worker's shadow_until_steady does: DDP's one-time broadcast is in step 2
        for _ in range(2):
            wl.train_step(0)
        return 2

    groups, report = shadow.replay(SPECS, base, 10, "control", build, wl.train_step,
                                   settle=settle_steps if settle else None)
    return wl, groups, report


def test_a_warm_standby_rewarms_on_the_new_version(tmp_path):
    base, _ = run(tmp_path)
    wl, groups, first = standby(base, (5,))
    assert first["version"] == 1 and first["losses_compared"] and first["loss_equal"], first
    assert shadow.newer(base, 1) == 2 and shadow.newer(base, 2) is None
    again = shadow.rewarm(groups, recording.version_path(base, 2), "control", wl.train_step)
    assert again["version"] == 2 and again["first_step"] >= 7 and again["loss_equal"] is None
    assert all(g.sandboxed and g.inner.answers is None for g in groups.values())  # back to local answers


def test_a_standby_that_does_not_see_the_change_fails_clearly(tmp_path):
    base, _ = run(tmp_path)
    wl, groups, _ = standby(base, (100,))  # its batch never grows
    with pytest.raises(MigrationError, match=r"the step asked for allreduce on world, shape \[4\].*"
                                             r"the recording has allreduce on world, shape \[8\]"):
        shadow.rewarm(groups, recording.version_path(base, 2), "control", wl.train_step)


def test_a_recording_that_starts_mid_job_is_replayed_after_settling_steps(tmp_path):
    """TM_RECORD_FROM_STEP > 0: the recording has no construction and no one-time collectives;
    a fresh standby must get its own DDP past them (locally answered) before replaying."""
    base, out = run(tmp_path, grow_at=(100,), steps=12, from_step=4)
    assert recording.versions(base) == [1] and out["reports"][0]["detail"]["first_step"] == 4
    with pytest.raises(MigrationError, match="starts at step 4, after the workload's construction"):
        standby(base, (100,))
    _, groups, report = standby(base, (100,), settle=True)
    assert report["first_step"] == 4 and report["settle_steps"] == 2 and report["loss_equal"] is None
