"""The job's own diet on slurmctld (issue 30): the token bucket that paces standby requests, and
the controller's resizes, which keep the job's record instead of asking Slurm for it. A fake
Slurm that counts its queries; no cluster."""
from __future__ import annotations

import pytest

from trainmover.controller import resize
from trainmover.controller.node_watch import PoolWatch
from trainmover.controller.slurm_work import Acquired, Released, Unavailable
from trainmover.errors import SlurmError
from trainmover.slurm.model import JobInfo, NodeInfo, NoStandbyAvailable
from trainmover.slurm.pacing import Paced, TokenBucket


def test_bucket_allows_its_burst_then_its_rate_and_repays_debt_first():
    b = TokenBucket(10, 0.5, now=0.0)
    assert b.wait(0.0, 7) == 0.0
    b.take(0.0, 7)
    assert b.wait(0.0, 7) == pytest.approx(8.0)   # 3 left, 4 more at 0.5 a second
    assert b.wait(8.0, 7) == 0.0
    b.take(8.0, 7 + 20)                           # a grow that asked four times: 27 spent, 20 in debt
    assert b.wait(8.0, 1) == pytest.approx(42.0)  # the debt first, then the token
    assert b.wait(1000.0, 100) == 0.0             # never more than the capacity is asked for
    assert b.tokens == 10
    with pytest.raises(ValueError):
        TokenBucket(0, 1, 0.0)


class _Slurm:
    """Counts what the controller asks; grow takes spare1, then finds none."""

    def __init__(self):
        self.queries: list[str] = []
        self.granted = ["spare1"]
        self.shrunk: list[list[str]] = []
        self.timeouts: list[float] = []

    def job(self, job_id):
        self.queries.append("job")
        return _job(("keep1", "train1", "spare1"))

    def nodes(self, names):
        self.queries.append("nodes")
        return {n: NodeInfo(n, "10.0.0.9", "IDLE") for n in names}

    def grow(self, job_id, *, reservation, partition=None, timeout=30.0):
        assert partition == "train"  # the kept record's: grow need not read the job for it
        self.timeouts.append(timeout)
        if not self.granted:
            raise NoStandbyAvailable("none")
        return self.granted.pop(0)

    def shrink(self, job_id, keep, job=None):
        assert job is not None and set(keep) < set(job.nodes)  # the record goes along: no query
        self.shrunk.append(list(keep))
        if "gone" in keep:
            raise SlurmError("cannot shrink: gone not in the job")
        return []


def _job(nodes):
    return JobInfo(7, "RUNNING", tuple(nodes), "keep1", 0, "/w", "train", len(nodes))


class _Reservation:
    def reservation_nodes(self, name):
        return ["spare1", "spare2"]


def _resizer(slurm, clock):
    pool = PoolWatch(_Reservation(), "trainmover_standby")
    pool.nodes()
    pool.saw({"spare1": NodeInfo("spare1", "10.0.0.5", "IDLE+RESERVED")})
    seen = {"spare1": "10.0.0.5"}
    return resize.Resizer(slurm, _job(("keep1", "train1")), reservation="trainmover_standby", standby_wait_s=10,
                          pool=pool, addr=lambda n: seen.get(n, ""), clock=lambda: clock[0], gate=lambda: ""), pool


def test_resizes_keep_the_jobs_record_and_ask_slurm_nothing_more():
    slurm, clock = _Slurm(), [0.0]
    r, pool = _resizer(slurm, clock)
    assert r.acquire() == Acquired("spare1", "10.0.0.5")  # its address from the node poll
    assert r.job.nodes == ("keep1", "train1", "spare1") and r.job.nodelist == "keep1,train1,spare1"
    assert r.release("train1") == Released("train1", True, "")
    assert slurm.shrunk == [["keep1", "spare1"]] and r.job.nodes == ("keep1", "spare1")
    assert slurm.queries == []  # no job or node query: the record and the poll had it all


def test_a_failed_release_reads_the_job_again():
    slurm, clock = _Slurm(), [0.0]
    r, _ = _resizer(slurm, clock)
    r.job = _job(("keep1", "train1", "gone"))  # a record gone wrong
    ok = r.release("train1")
    assert (ok.node, ok.ok) == ("train1", False) and "release failed" in ok.message
    assert slurm.queries == ["job"] and r.job.nodes == ("keep1", "train1", "spare1")


def test_standby_requests_are_paced_and_gated_by_the_poll():
    slurm, clock = _Slurm(), [0.0]
    r, pool = _resizer(slurm, clock)
    assert isinstance(r.acquire(), Acquired)
    slurm.granted = []
    pool.nodes()
    pool.saw({"spare2": NodeInfo("spare2", "10.0.0.6", "IDLE+RESERVED")})
    assert isinstance(r.acquire(), Unavailable)  # asked: none granted...
    assert "no idle node" in r.acquire().reason  # ...so not again before a poll sees one idle
    pool.nodes()
    pool.saw({"spare2": NodeInfo("spare2", "10.0.0.6", "IDLE+RESERVED")})
    # each asked once (2 s): a grow's retries never spend the next grow's tokens
    assert slurm.timeouts == [2.0, 2.0]
    got = r.acquire()  # two grows spent the burst: paced
    assert isinstance(got, Unavailable) and "paced" in got.reason, got
    clock[0] += (2 * resize.GROW_RPCS) / resize.ACQUIRE_RATE
    pool.nodes()
    pool.saw({"spare2": NodeInfo("spare2", "10.0.0.6", "IDLE+RESERVED")})
    assert "paced" not in str(r.acquire())


def test_the_pool_the_job_asked_for_is_taken_at_once_and_only_refills_are_paced():
    """TM_STANDBYS=3: three grows at the start, none put off (paced from a burst of two, the
    third came 45 s late and a short job ended without it); a fourth, a refill, waits."""
    for standbys, paced_at in ((1, 2), (3, 3)):
        r = resize.Resizer(_Slurm(), _job(("keep1", "train1")), reservation="trainmover_standby",
                           standby_wait_s=10, pool=None, addr=lambda n: "", clock=lambda: 0.0, gate=lambda: "",
                           standbys=standbys)
        waits = []
        for _ in range(paced_at + 1):
            waits.append(r.pace.wait(0.0, resize.GROW_RPCS))
            r.pace.take(0.0, resize.GROW_RPCS)
        assert waits[:paced_at] == [0.0] * paced_at and waits[paced_at] > 0, (standbys, waits)


def test_a_fruitless_ask_leaves_the_next_grow_its_tokens():
    """No spare free (another job holds them): one donor request, not the whole burst's worth,
    so the spare freed a moment later is taken at once, not 45 s later."""
    slurm, clock = _Slurm(), [0.0]
    r, pool = _resizer(slurm, clock)
    slurm.granted = []
    assert isinstance(r.acquire(), Unavailable) and slurm.timeouts == [2.0]
    slurm.granted = ["spare1"]
    pool.nodes()
    pool.saw({"spare1": NodeInfo("spare1", "10.0.0.5", "IDLE+RESERVED")})
    assert r.acquire() == Acquired("spare1", "10.0.0.5")


def test_paced_launches_stay_within_the_bucket_in_order():
    """129 sruns asked at once (a 128-node job's start, issue 38) go out as the bucket refills:
    never more than its capacity at once, then `rate / cost` a second, in the order asked."""
    p = Paced(TokenBucket(20, 1.6, now=0.0), cost=2)
    for i in range(129):
        p.add(i)
    first = p.due(0.0)
    assert first == list(range(10))
    out, t = list(first), 0.0
    while p.queued:
        t += 0.1
        out += p.due(t)
    assert out == list(range(129))
    assert t == pytest.approx((129 * 2 - 20) / 1.6, abs=0.2)
    assert p.due(t + 100) == []
