"""The controller's changes to its job's node set: taking a standby (grow) and releasing a node
(shrink), and the job's record as they leave it.

Why a record of its own: every step launch needs the job's current node list (the step's
environment), and a release needs the nodes to keep. Asking slurmctld each time spent one of
the user's rate-limit tokens per launch and per release (docs/admin.md, "Load on slurmctld");
nothing but this controller resizes a running job, so the record read at its start, changed by
its own grows and releases, is the job's. A failed resize reads it again.

Taking standbys is the Slurm work that can wait, so it is paced per job (slurm/pacing.py);
a release is not (the drained node's hand-back waits on it).

Effects only (Slurm calls through the client); run on the executor's background threads.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

from trainmover.controller.slurm_work import Acquired, Released, Unavailable
from trainmover.errors import SlurmError
from trainmover.slurm import commands
from trainmover.slurm.model import BatchHostRelease, JobInfo, NoStandbyAvailable
from trainmover.slurm.pacing import TokenBucket

log = logging.getLogger("trainmover.controller")

# RPCs of one standby taken (salloc 2, each of the merge's 2 updates 3, the check of the job 1)
# and of each further donor request a grow makes when none was granted (salloc's request, its
# lookups and its withdrawal): slurmctld's log on 24.11, docs/admin.md. A job spends at most ACQUIRE_RATE a second on them after a
# burst of ACQUIRE_BURST, or of the pool the job asked for if larger (TM_STANDBYS standbys are
# taken at once at its start: paced, a third one came 45 s late and a short Megatron job ended
# without it): five jobs of one user 1 RPC/s together, half the bucket's refill.
GROW_RPCS = 9
DONOR_RETRY_RPCS = 3
DONOR_TRY_S = 2.0  # one donor request (CliSlurm.DONOR_TRY_S)
ACQUIRE_BURST = 18.0
ACQUIRE_RATE = 0.2


def with_nodes(job: JobInfo, nodes: tuple[str, ...]) -> JobInfo:
    """`job` as it is after a resize this controller made (Slurm's compressed list is not kept)."""
    return dataclasses.replace(job, nodes=nodes, nodelist=",".join(nodes), num_nodes=len(nodes))


class Resizer:
    """`job`: the record read at the controller's start. `pool`: the node poll's view of the
    reservation (controller/node_watch.PoolWatch); `addr(node)`: a node's address as the poll saw
    it ("" if not seen). `gate()`: why no job expansion may be made ("": it may; None: not known
    yet), asked before every grow: the merge crashes some slurmctld releases
    (slurm/expansion_safety.py), so none is made until the rights check said it is safe."""

    def __init__(self, slurm, job: JobInfo, *, reservation: str, standby_wait_s: float, pool,
                 addr: Callable[[str], str], clock: Callable[[], float], gate: Callable[[], str | None],
                 standbys: int = 1):
        self.slurm, self.job, self.gate = slurm, job, gate
        self.reservation, self.standby_wait_s = reservation, standby_wait_s
        self.pool, self._addr, self._clock = pool, addr, clock
        self._lock = threading.Lock()  # a grow and a release never overlap: each changes self.job
        self.pace = TokenBucket(max(ACQUIRE_BURST, GROW_RPCS * standbys), ACQUIRE_RATE, clock())

    def acquire(self) -> Acquired | Unavailable:
        """One try to take a standby: `Acquired` (node, address) or `Unavailable` (why)."""
        refused = self.gate()
        if refused is None:  # a successor's check in the background has not answered yet
            return Unavailable("waiting for the check of what this job may do (its Slurm release included)")
        if refused:
            return Unavailable(f"no standby is taken: {refused}")
        idle = self.pool.none_idle()
        if idle:  # the last node poll saw no free spare: asking slurmctld now would only cost RPCs
            return Unavailable(idle)
        wait = self.pace.wait(self._clock(), GROW_RPCS)
        if wait > 0:  # this job's share of its user's tokens for standbys is spent: later
            return Unavailable(f"standby requests paced to {ACQUIRE_RATE * 60:g} RPCs a minute; "
                                   f"the next in {wait:.0f}s")
        self.pool.asked()
        # as many donor requests as the job's share allows (each of DONOR_TRY_S): when several of a
        # user's jobs race for one spare that just came free, the losers ask once or twice, not
        # for all of TM_STANDBY_WAIT_S (24.11: three jobs' retries overdrew the bucket)
        # ... and never with the next grow's tokens: a spare freed a moment after a fruitless ask
        # is taken at once (CI: an ask that spent the burst left a job waiting 45 s for a free spare)
        tries = 1 + int(max(0.0, self.pace.tokens - 2 * GROW_RPCS) // DONOR_RETRY_RPCS)
        timeout = min(self.standby_wait_s, tries * DONOR_TRY_S)
        with self._lock:
            sallocs = commands.calls().get("salloc", 0)
            try:
                node = self.slurm.grow(self.job.job_id, reservation=self.reservation, partition=self.job.partition,
                                       timeout=timeout)
            except NoStandbyAvailable as exc:
                self.pool.none_granted()
                return Unavailable(str(exc))
            except SlurmError as exc:
                self._reread()
                return Unavailable(f"taking a standby failed: {exc}")
            finally:  # charged what it asked: each donor request, the merge and its check
                tries = max(1, commands.calls().get("salloc", 0) - sallocs)
                self.pace.take(self._clock(), GROW_RPCS + DONOR_RETRY_RPCS * (tries - 1))
            self.job = with_nodes(self.job, self.job.nodes + (node,))
        # its address from the node poll, which reads the reservation's nodes (one query if not seen)
        return Acquired(node, self._addr(node) or self.slurm.nodes([node])[node].addr)

    def release(self, node: str) -> Released:
        """Release `node` from the job: `Released` (ok, or why not)."""
        with self._lock:  # after any grow under way: its node must be among those kept
            keep = [n for n in self.job.nodes if n != node]
            try:
                self.slurm.shrink(self.job.job_id, keep, job=self.job)  # checked against the record: no query
            except BatchHostRelease:
                return Released(node, False,
                        f"{node} runs the batch script: it stays in the job until the job ends")
            except SlurmError as exc:
                self._reread()
                return Released(node, False, f"release failed: {exc}")
            self.job = with_nodes(self.job, tuple(keep))
            return Released(node, True)

    def record_if_idle(self) -> JobInfo | None:
        """The job's record when no grow or release is under way (None otherwise: a resize in
        flight may be changing it), for a successor (controller/durable/handover.py)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self.job
        finally:
            self._lock.release()

    def _reread(self) -> None:
        """After a failed resize the record may be wrong: read it again (one query)."""
        try:
            self.job = self.slurm.job(self.job.job_id)
        except SlurmError as exc:
            log.warning("cannot read job %d again after a failed resize: %s", self.job.job_id, exc)
