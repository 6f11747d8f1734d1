"""The Slurm interface TrainMover uses, and its command-line implementation.

`SlurmClient` is the contract; `CliSlurm` implements it with sinfo/squeue/
scontrol/salloc/srun through `commands.run` (the only place that forks them).
`pyslurm_backend.PySlurm` implements the same Protocol with pyslurm where the site's
Slurm matches the pyslurm release (25.11; see docs/admin.md); `client(backend=...)`
picks one (TM_SLURM_BACKEND for the controller).
"""

from __future__ import annotations

import grp
import logging
import math
import os
import pwd
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Optional, Protocol, runtime_checkable

from trainmover.errors import SlurmError
from trainmover.slurm import argv as build
from trainmover.slurm import commands, parse, rights
from trainmover.slurm import expansion_fix as expansion_fix_file
from trainmover.slurm.model import BatchHostRelease, JobInfo, NodeInfo, NoStandbyAvailable, UnknownNodes

log = logging.getLogger(__name__)

__all__ = ["SlurmClient", "CliSlurm", "client"]


@runtime_checkable
class SlurmClient(Protocol):
    """What TrainMover needs from Slurm. Every method is bounded in time."""

    def nodes(self, names: Optional[Sequence[str]] = None) -> dict[str, NodeInfo]:
        """State of `names` (all nodes when None) in one controller call."""

    def job(self, job_id: int) -> JobInfo: ...

    def hostnames(self, nodelist_expr: str) -> list[str]: ...

    def grow(self, job_id: int, *, reservation: str, partition: Optional[str] = None,
             timeout: float = 30.0) -> str:
        """Absorb one free node of `reservation` into running job `job_id` and
        return its name; NoStandbyAvailable (job untouched) when none is granted
        within `timeout` seconds."""

    def shrink(self, job_id: int, keep: Sequence[str], job: Optional[JobInfo] = None) -> list[str]:
        """Release every node of the job not in `keep`; return the released nodes.
        BatchHostRelease when `keep` lacks the batch host. `job`: the caller's record of the
        job, which spares a query (its nodes and batch host are checked against it)."""

    def drain(self, node: str, reason: str) -> None: ...

    def resume(self, node: str) -> None: ...

    def capabilities(self, job_id: int, reservation: str, expansion_fix: str = "auto") -> rights.Capabilities:
        """What this process's user may do to job `job_id` and its nodes (slurm/rights.py),
        from Slurm's records: nothing is changed to find out. `expansion_fix`: where the admin
        declares a fixed slurmctld release (TM_SLURM_EXPANSION_FIX: auto, a path, off)."""

    def free_standbys(self, reservation: str) -> list[str]: ...

    def reservation_nodes(self, reservation: str) -> list[str]:
        """Every node of `reservation` (the standby pool), free or not."""

    def kill_steps(self, job_id: int, node: str, names: Sequence[str] = ()) -> list[str]:
        """SIGKILL the job's steps on `node` (named one of `names` if given); their ids. A backend
        without Slurm steps returns [] and the caller kills the process it started."""

    def cancel_donors(self, job_id: int) -> list[int]:
        """Withdraw the job's pending standby requests (a controller ending while it takes one)."""

    def step_argv(self, job_id: int, node: str, argv: Sequence[str], *, ntasks: int = 1,
                  env_overrides: Optional[Mapping[str, str]] = None, name: str = "") -> list[str]: ...

    def step_env(self, job: JobInfo, base: Optional[Mapping[str, str]] = None) -> dict[str, str]: ...


class CliSlurm:
    """SlurmClient over the Slurm 22.05+ command-line tools.

    `slurm_conf`: the SLURM_CONF to use (None: the process environment's).
    `timeout`: seconds allowed to each query or update command.
    """

    # A node released from a job and merged back into it within the same wall-clock
    # second refuses the job's next step: slurmd revoked the job's credential at the
    # release (1 s resolution) and rejects credentials created no later than that
    # second ("Job credential revoked"). grow() waits out that second.
    CRED_REVOKE_MARGIN_S = 1.05
    # Seconds of one donor request: grow() makes several within its deadline (see there).
    DONOR_TRY_S = 2.0
    RESERVATION_KEEP_S = 5.0

    def __init__(self, *, slurm_conf: Optional[str] = None, timeout: float = 15.0,
                 wall_clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, node_query: str = "off"):
        """`node_query`: the program nodes() asks (see node_query_program): "auto", "off" or a path."""
        self.timeout = timeout
        self._wall_clock, self._sleep, self._clock = wall_clock, sleep, clock
        self._released_at: dict[tuple[int, str], float] = {}
        # Answers kept a few seconds, each a token of the user's rate-limit bucket: the rights
        # check at a controller's start asks for the job and the reservation it has just read.
        self._job_lines: dict[int, str] = {}
        self._reservations: dict[str, tuple[float, subprocess.CompletedProcess]] = {}
        self._env: Optional[dict[str, str]] = None
        if slurm_conf is not None:
            self._env = {**os.environ, "SLURM_CONF": str(slurm_conf)}
        self.node_query = node_query_program(node_query, commands.build_env(self._env).get("SLURM_CONF"))

    # --- plumbing -----------------------------------------------------------------
    def _run(self, argv: list[str], *, timeout: Optional[float] = None, check: bool = True):
        return commands.run(argv, timeout=timeout or self.timeout, env=self._env, check=check)

    def _update_job(self, argv: list[str]):
        """`scontrol update JobId=...` without SLURM_JOBID in its environment: run
        inside a job (the controller in a batch script), scontrol would otherwise
        write slurm_job_<J>_resize.{sh,csh} into the working directory."""
        env = commands.build_env(self._env)
        for key in ("SLURM_JOBID", "SLURM_JOB_ID"):
            env.pop(key, None)
        return commands.run(argv, timeout=self.timeout, env=env)

    # --- queries ------------------------------------------------------------------
    def nodes(self, names: Optional[Sequence[str]] = None) -> dict[str, NodeInfo]:
        names = list(names) if names is not None else None
        if names == []:
            return {}
        # One RPC with tm_nodes (node table only) where it is installed; scontrol also loads the
        # partition table: two RPCs, each a token of the user's rate-limit bucket.
        argv = [self.node_query, *(names or [])] if self.node_query else build.show_nodes(names)
        proc = self._run(argv, check=False)
        found = parse.parse_nodes_text(proc.stdout)
        if proc.returncode != 0 and (names is None or not found) and " not found" not in proc.stdout + proc.stderr:
            what = "scontrol show node" if argv[0] == "scontrol" else os.path.basename(argv[0])
            raise SlurmError(f"{what} exited with {proc.returncode}: "
                             f"{(proc.stderr or proc.stdout).strip()[:300]}")
        if names is None:
            return found
        missing = [n for n in names if n not in found]
        if missing:
            said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if not ln.startswith("NodeName=")]
            raise UnknownNodes(f"Slurm does not know node(s) {missing}: {'; '.join(said)[:300]}")
        return {n: found[n] for n in names}

    def job(self, job_id: int) -> JobInfo:
        out = self._run(build.show_job(job_id)).stdout
        self._job_lines[job_id] = next((ln for ln in out.splitlines() if ln.startswith("JobId=")), "")
        return parse.parse_job_text(out)

    def _show_reservation(self, reservation: str) -> subprocess.CompletedProcess:
        """`scontrol show reservation`, kept RESERVATION_KEEP_S (asked again at once by the
        controller's start: the rights check and the standby pool)."""
        now = self._clock()
        kept = self._reservations.get(reservation)
        if kept is None or now - kept[0] > self.RESERVATION_KEEP_S:
            kept = self._reservations[reservation] = (now, self._run(build.show_reservation(reservation), check=False))
        return kept[1]

    def hostnames(self, nodelist_expr: str) -> list[str]:
        if not nodelist_expr.strip():
            return []
        return self._run(build.hostnames(nodelist_expr)).stdout.split()

    def jobs_on(self, node: str) -> list[tuple[int, str]]:
        """(job id, working directory) of the jobs running on `node`."""
        out = self._run(build.jobs_on_node(node)).stdout
        jobs = []
        for line in out.splitlines():
            job, _, work_dir = line.strip().partition("|")
            if job.isdigit():
                jobs.append((int(job), work_dir))
        return jobs

    def reservation_nodes(self, reservation: str) -> list[str]:
        proc = self._show_reservation(reservation)
        out = parse.parse_reservation_text(proc.stdout)
        if reservation not in out:
            raise SlurmError(f"reservation {reservation} not found: {(proc.stderr or proc.stdout).strip()[:200]}")
        return parse.expand_hostlist(out[reservation].get("Nodes", ""))

    def free_standbys(self, reservation: str) -> list[str]:
        names = self.reservation_nodes(reservation)
        return [n for n, info in self.nodes(names).items() if info.idle]

    def capabilities(self, job_id: int, reservation: str, expansion_fix: str = "auto") -> rights.Capabilities:
        """See SlurmClient.capabilities: `scontrol show config` (its SLURM_VERSION is slurmctld's
        own release), the job's account, the reservation, (with accounting) the user's AdminLevel
        and the admin's declaration of a fixed release, judged by rights.decide."""
        uid = os.getuid()
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            raise SlurmError(f"uid {uid} has no name here: Slurm cannot tell what it may do") from None
        groups = []
        for gid in sorted({os.getgid(), *os.getgroups()}):
            try:
                groups.append(grp.getgrgid(gid).gr_name)
            except KeyError:
                pass
        config = rights.parse_config(self._run(["scontrol", "show", "config"]).stdout)
        line = self._job_lines.get(job_id) or next(
            (ln for ln in self._run(build.show_job(job_id)).stdout.splitlines() if ln.startswith("JobId=")), "")
        account = parse.parse_kv(line).get("Account", "") if line else ""
        accounting = config.get("AccountingStorageType", "").endswith("slurmdbd")
        level = None
        if accounting and uid != 0:
            try:  # no answer (sacctmgr missing, slurmdbd down): no known level, so no drain right
                proc = self._run(["sacctmgr", "-nP", "show", "user", user, "format=AdminLevel"], check=False)
                level = rights.parse_admin_level(proc.stdout) if proc.returncode == 0 else None
            except SlurmError:
                level = None
        proc = self._show_reservation(reservation)
        found = parse.parse_reservation_text(proc.stdout).get(reservation)
        return rights.decide(rights.Facts(
            user=user, uid=uid, groups=tuple(groups), account="" if account == "(null)" else account,
            slurm_user=rights.slurm_user_name(config.get("SlurmUser", "root")),
            scheduler_parameters=config.get("SchedulerParameters", ""), admin_level=level, accounting=accounting,
            reservation=reservation, reservation_fields=found,
            reservation_error="" if found else (proc.stderr or proc.stdout).strip()[:200],
            slurm_version=config.get("SLURM_VERSION", ""),
            expansion_fix=expansion_fix_file.read(expansion_fix_file.location(
                expansion_fix, commands.build_env(self._env).get("SLURM_CONF")))))

    # --- changes --------------------------------------------------------------------
    def drain(self, node: str, reason: str) -> None:
        self._run(build.drain(node, reason))

    def resume(self, node: str) -> None:
        """Return a drained/down node to service; a node already in service is left as is."""
        proc = self._run(build.resume(node), check=False)
        if proc.returncode == 0:
            return
        info = self.nodes([node])[node]
        # Just after a resume a node shows IDLE+NOT_RESPONDING for a moment: it is back in
        # service all the same. Only a node still draining or really DOWN failed to resume.
        if "DRAIN" in info.flags or info.base_state == "DOWN":
            raise SlurmError(f"scontrol could not resume {node} ({info.state}): {proc.stderr.strip()}")

    def kill_steps(self, job_id: int, node: str, names: Sequence[str] = ()) -> list[str]:
        """SIGKILL the job's numbered steps that run on `node` alone, only those named one of
        `names` if given (a rank judged dead: controller/policy/liveness.py; a lost controller:
        controller/succession/keeper.py). Returns the step ids. The batch and extern steps are left."""
        out = self._run(build.steps_of(job_id)).stdout
        ids = []
        for line in out.splitlines():
            step, on, name = (line.strip().split("|") + ["", ""])[:3]
            if on == node and step.partition(".")[2].isdigit() and (not names or name in names):
                ids.append(step)
        for step in ids:
            self._run(build.kill_step(step), check=False)  # a step ending meanwhile is no error
        return ids

    def cancel_donors(self, job_id: int) -> list[int]:
        """Withdraw every donor request for `job_id` (a controller shutting down while it takes
        a standby must not leave an allocation behind holding the spare)."""
        return self._cancel_donors(job_id)

    def _cancel_donors(self, job_id: int) -> list[int]:
        """Withdraw every donor request for `job_id` still known to the controller."""
        proc = self._run(build.jobs_named(build.donor_name(job_id)), check=False)
        ids = [int(x) for x in proc.stdout.split() if x.isdigit()]
        if ids:
            self._run(build.scancel(ids), check=False)
        return ids

    def _describe_reservation(self, reservation: str) -> str:
        """'spare1 IDLE+COMPLETING, spare2 ALLOCATED': why a standby request went unanswered,
        for the error message only (a failure to ask is said, never raised)."""
        try:
            nodes = self.nodes(self.reservation_nodes(reservation))
        except SlurmError as e:
            return f"unknown ({e})"
        return ", ".join(f"{n} {info.state}" for n, info in sorted(nodes.items())) or "none"

    def _request_donor(self, job_id: int, partition: str, reservation: str,
                       try_s: float) -> tuple[Optional[int], str]:
        """One donor request of `try_s` seconds: (donor job id, salloc's stderr) when granted,
        (None, what salloc said) when no node was granted in time; SlurmError for any other
        failure."""
        salloc = build.donor_salloc(job_id, partition=partition, reservation=reservation, timeout=try_s)
        try:
            proc = self._run(salloc, timeout=try_s + 15, check=False)
        except SlurmError:
            self._cancel_donors(job_id)
            raise
        donor = parse.parse_salloc_job_id(proc.stderr)
        if proc.returncode == 0 and parse.salloc_granted(proc.stderr) and donor is not None:
            return donor, proc.stderr
        err = proc.stderr.strip()
        if "Unable to allocate resources" in err and "timed out" in err:
            return None, err.splitlines()[-1]  # salloc withdrew it; grow() checks once at its end
        self._cancel_donors(job_id)
        raise SlurmError(f"salloc for a donor of job {job_id} failed (exit {proc.returncode}): {err}")

    def grow(self, job_id: int, *, reservation: str, partition: Optional[str] = None,
             timeout: float = 30.0) -> str:
        if partition is None:  # a caller that knows the job's partition spares this query
            before = self.job(job_id)
            if not before.running:
                raise SlurmError(f"cannot grow job {job_id}: it is {before.state}, not RUNNING")
        part = partition or before.partition
        # Several short donor requests rather than one that waits the whole deadline: a request that
        # finds no node free when submitted (a standby still completing a job it left a moment ago)
        # stays pending until slurmctld's next full scheduling pass (sched_interval, 60 s by
        # default), and the node's freeing does not bring that forward. Seen on 24.11 and 26.05: a
        # donor pending 10 s beside two idle spares. A new request is placed at once.
        deadline = self._clock() + timeout
        for _ in range(max(1, math.ceil(timeout / self.DONOR_TRY_S))):
            try_s = max(1.0, min(self.DONOR_TRY_S, deadline - self._clock()))
            donor, err = self._request_donor(job_id, part, reservation, try_s)
            if donor is not None or deadline - self._clock() < 1.0:
                break
        if donor is None:
            self._cancel_donors(job_id)  # any request salloc failed to withdraw: once, not after each try
            raise NoStandbyAvailable(
                f"no free standby node in reservation {reservation} for job {job_id} within {timeout:g}s "
                f"({err}; reserved nodes now: {self._describe_reservation(reservation)})")
        try:
            # salloc names the donor's node ("Nodes spare1 are ready for job"): no query for it
            ready = parse.salloc_ready_node(err)
            new_nodes = (ready,) if ready else self.job(donor).nodes
            if len(new_nodes) != 1:
                raise SlurmError(f"donor job {donor} for job {job_id} holds {new_nodes}, expected one node")
            self._update_job(build.merge_donor(donor))
        except SlurmError:
            self._run(build.scancel([donor]), check=False)
            raise
        self._update_job(build.absorb(job_id))
        node = new_nodes[0]
        after = self.job(job_id)
        if node not in after.nodes:
            raise SlurmError(f"job {job_id} did not absorb {node} from donor {donor}: it holds {after.nodelist}")
        self._wait_out_revocation(job_id, node)
        return node

    def _wait_out_revocation(self, job_id: int, node: str) -> None:
        """If this client released `node` from `job_id` moments ago, wait until a step
        credential created now would postdate that release by a whole second."""
        released = self._released_at.pop((job_id, node), None)
        if released is None:
            return
        ready_at = math.floor(released) + self.CRED_REVOKE_MARGIN_S
        wait = ready_at - self._wall_clock()
        if wait > 0:
            self._sleep(wait)

    def shrink(self, job_id: int, keep: Sequence[str], job: Optional[JobInfo] = None) -> list[str]:
        keep = list(dict.fromkeys(keep))
        cur = job if job is not None else self.job(job_id)
        if not cur.running:
            raise SlurmError(f"cannot shrink job {job_id}: it is {cur.state}, not RUNNING")
        strangers = [n for n in keep if n not in cur.nodes]
        if strangers:
            raise SlurmError(f"cannot shrink job {job_id} to {keep}: {strangers} not in its nodes {cur.nodelist}")
        if cur.batch_host and cur.batch_host not in keep:
            raise BatchHostRelease(
                f"cannot release {cur.batch_host} from job {job_id}: it runs the job's batch script "
                f"(Slurm can release any node of a running job except the batch host)")
        released = [n for n in cur.nodes if n not in keep]
        if not released:
            return []
        self._set_nodes(job_id, keep)
        now = self._wall_clock()
        self._released_at.update({(job_id, n): now for n in released})
        if job is not None:
            # The caller keeps the record: the update is synchronous (its success is slurmctld
            # having set the node list), so no read to confirm it, one token fewer of the user's
            # at every migration (docs/admin.md, "Load on slurmctld"). A node somehow still held
            # shows at the next node poll, still allocated.
            return released
        after = self.job(job_id)
        left = [n for n in released if n in after.nodes]
        if left:
            raise SlurmError(f"job {job_id} still holds {left} after shrinking to {keep}")
        return released

    def _set_nodes(self, job_id: int, keep: list[str]) -> None:
        """The update that shrinks the job to `keep` (a backend's own call; shrink checks around it)."""
        self._update_job(build.set_nodelist(job_id, keep))

    # --- steps -------------------------------------------------------------------------
    def step_argv(self, job_id: int, node: str, argv: Sequence[str], *, ntasks: int = 1,
                  env_overrides: Optional[Mapping[str, str]] = None, name: str = "") -> list[str]:
        """The srun command line for a step (see argv.step), ready to start from this process:
        with the cluster's exec prefix when its Slurm lives in a root filesystem (commands.py).
        `name`: the step's name (squeue -s), by which kill_steps picks steps."""
        prefix = commands.exec_prefix(commands.build_env(self._env))
        return prefix + build.step(job_id, node, argv, ntasks=ntasks, env_overrides=env_overrides,
                                   srun_args=[f"--job-name={name}"] if name else [])

    def step_env(self, job: JobInfo, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """Environment for launching step_argv(): `base` (default: this process's
        environment, plus this client's SLURM_CONF) with the allocation variables
        updated to `job`'s current nodes. Needed when the caller runs inside the
        batch script of a job that has since grown or shrunk."""
        if base is None:
            base = self._env if self._env is not None else commands.build_env(None)
        return build.step_env(job, base)


NODE_QUERY = "tm_nodes"


def node_query_program(setting: str, slurm_conf: Optional[str]) -> Optional[str]:
    """The node-state program CliSlurm.nodes() runs instead of scontrol: None for "off"; for
    "auto", tm_nodes beside `slurm_conf` (default /etc/slurm/slurm.conf) when installed there
    (the embedded cluster builds it; docs/admin.md for a site); else the path given."""
    if setting in ("", "off"):
        return None
    if setting != "auto":
        return setting
    path = os.path.join(os.path.dirname(slurm_conf or "/etc/slurm/slurm.conf"), NODE_QUERY)
    if not os.access(path, os.X_OK):
        return None
    # root's node-reader runs it: only a real file (no link) that root (or the user running us)
    # owns and nobody else can write, in directories likewise, never one a user could plant
    why = "it is a symbolic link" if os.path.islink(path) else commands.untrusted(path)
    if why:
        log.warning("%s not run (%s): node states are read with scontrol", path, why)
        return None
    return path

