"""The controller's Slurm work beside its loop (controller/slurm_work.py, with the releases of
controller/resize.py): a release still under way when the job ends is waited for, within its
bound, and handed to the policy, so a migration whose node left the job is recorded done (seen
on Slurm 25.11 with rl_enable: the job finished while its throttled shrink ran, and status.json
kept saying `releasing`)."""
from __future__ import annotations

import threading
import time

from trainmover.controller import slurm_work
from trainmover.controller.resize import Resizer
from trainmover.controller.slurm_work import Acquired, Released, RightsChecked, SlurmWork, WorkFailed
from trainmover.errors import SlurmError
from trainmover.slurm import BatchHostRelease
from trainmover.slurm.model import JobInfo


class SlowShrink:
    """A Slurm whose shrink takes `shrink_s` (a throttled slurmctld) or fails as told."""

    def __init__(self, shrink_s: float, fail: Exception | None = None):
        self.shrink_s, self.fail, self.kept = shrink_s, fail, None
        self.started = threading.Event()

    def job(self, job_id):
        return JOB

    def shrink(self, job_id, keep, job=None):
        self.started.set()
        time.sleep(self.shrink_s)
        if self.fail is not None:
            raise self.fail
        self.kept = list(keep)
        return ["train2"]


JOB = JobInfo(job_id=7, state="RUNNING", nodes=("train1", "train2", "spare1"), batch_host="train1",
              restart_count=0, work_dir="/w", partition="p", num_nodes=3)


def work(slurm) -> tuple[SlurmWork, Resizer]:
    """The controller's pair: its work beside the loop and its Resizer (the releases)."""
    return SlurmWork(), Resizer(slurm, JOB, reservation="r", standby_wait_s=1, pool=None, addr=lambda n: "",
                                clock=time.monotonic, gate=lambda: "")


def test_a_release_under_way_at_the_end_is_waited_for_and_handed_over():
    slurm = SlowShrink(0.5)
    w, r = work(slurm)
    w.start("release", lambda: r.release("train2"))
    assert slurm.started.wait(5)
    t0 = time.monotonic()
    assert w.finish_releases() == [Released("train2", True, "")]
    assert 0.2 < time.monotonic() - t0 < 5 and slurm.kept == ["train1", "spare1"]


def test_the_wait_is_bounded_and_a_failed_release_is_said(monkeypatch):
    monkeypatch.setattr(slurm_work, "RELEASE_WAIT_S", 0.2)
    w, r = work(SlowShrink(3.0))
    w.start("release", lambda: r.release("train2"))
    t0 = time.monotonic()
    assert w.finish_releases() == []  # not finished within the bound: nothing claimed
    assert time.monotonic() - t0 < 1.5
    for fail, said in ((SlurmError("throttled"), "release failed: throttled"),
                       (BatchHostRelease("x"), "train2 runs the batch script")):
        w, r = work(SlowShrink(0.0, fail))
        w.start("release", lambda: r.release("train2"))
        (ev,) = w.finish_releases()
        assert (ev.node, ev.ok) == ("train2", False) and ev.message.startswith(said), ev


def test_other_work_is_not_waited_for_and_its_events_stay_out():
    w, _ = work(SlowShrink(0.0))
    gate = threading.Event()
    w.start("acquire", lambda: (gate.wait(5), Acquired("spare2", "10.0.0.9"))[1])
    w.start("rights", lambda: RightsChecked())
    time.sleep(0.1)
    t0 = time.monotonic()
    assert w.finish_releases() == []
    assert time.monotonic() - t0 < 0.5
    gate.set()


def test_work_that_raises_is_a_typed_failure_naming_the_work():
    w, _ = work(SlowShrink(0.0))
    boom = SlurmError("scontrol timed out")

    def fail():
        raise boom
    w.start("acquire", fail)
    ev = w.events.get(timeout=5)
    assert isinstance(ev, WorkFailed) and (ev.name, ev.error) == ("acquire", boom)
    w.start("acquire", lambda: Acquired("spare2", "10.0.0.9"))  # the control: a result is queued as it is
    assert w.events.get(timeout=5) == Acquired("spare2", "10.0.0.9")
