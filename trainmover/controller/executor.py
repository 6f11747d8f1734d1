"""The job-step controller: runs in the batch step, launches workers and standby agents as
Slurm steps, watches the job's nodes and carries out the policy's actions.

This is the only place of the controller with effects: Slurm calls (through
`trainmover.slurm`), processes, sockets and files. Decisions live in `policy`.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path

from trainmover import faults
from trainmover.config import Config, parse_tiers
from trainmover.controller import foreign_peer, user_rights
from trainmover.controller.durable import handover, journal, records
from trainmover.controller.exit_codes import MOVED, SUPERSEDED
from trainmover.controller.fencing import FencedNodes, kill_and_drain
from trainmover.controller.policy import tiers
from trainmover.protocol import channel, endpoint, files
from trainmover.protocol import checkpoint_layout
from trainmover.protocol.messages import (FailedMsg, FinishedMsg, HelloMsg, MigrateMsg, StatusMsg, StepExitMsg, StepMsg,
                                          StepsMsg, SwitchedMsg, make, typed)
from trainmover.slurm.model import TRAIN_FEATURE
from trainmover.controller.policy.actions import (AcquireStandby, CheckpointDone, Fence, Finish, LaunchStandby, Record,
                                          ReleaseNode, Rewind, Send)
from trainmover.controller.node_watch import NodeWatch
from trainmover.controller.policy.core import Policy
from trainmover.controller.resize import Resizer
from trainmover.controller.slurm_work import (Acquired, Fenced, Released, RightsChecked, SlurmWork, Unavailable,
                                               WorkEvent, WorkFailed)
from trainmover.controller.durable import view as view_mod
from trainmover.controller.durable.view import JobView
from trainmover.controller.steps import KeeperSteps, LocalSteps, step_environment
from trainmover.errors import ConfigError, SlurmError
from trainmover.protocol.worker_spec import ENV as SPEC_ENV, WorkerSpec
from trainmover.slurm.backends import client
from trainmover.slurm.job_env import JobEnv
from trainmover.standbys import auto as auto_pool, site
from trainmover.workloads import registry
from trainmover.workloads.base import Workload

log = logging.getLogger("trainmover.controller")


def rank_program(workload: str, ranks_per_node: int) -> tuple[str, int]:
    """(module, tasks) of a node's step: one rank process per task; the scale harness's stub
    workload one process that plays all of the node's ranks (runtime/stub_node.py, issue 38)."""
    if workload == "stub":
        return "trainmover.runtime.stub_node", 1
    return "trainmover.runtime.worker", ranks_per_node


class Controller:
    def __init__(self, cfg: Config, job_id: int, slurm=None, environ=os.environ, *, listen: socket.socket | None = None,
                 store: tuple[str, int] | None = None, resume: bool = False, attempt: int = 0,
                 keeper: str | None = None, run_dir: str | None = None, workload: Workload | None = None):
        """`listen` and `store`: the supervisor's control socket and rendezvous store, which
        outlive this controller (None: its own, for one-process uses such as the benches).
        `resume`: take over a job whose controller died, from its journal. `keeper`: the job's
        keeper node (controller/succession/keeper.py), which runs the steps; no rank runs there. `run_dir`:
        the job's run directory as the supervisor found it, where a predecessor that handed over
        left its record of the job (controller/durable/handover.py). `workload`: the job's workload, loaded
        already (controller/process.py loads it before a spare waits); None: loaded here."""
        self.cfg, self.job_id, self.attempt = cfg, job_id, attempt
        self.faults = faults.Injector(cfg.inject, "controller", first_controller=attempt == 0)
        self.slurm = slurm or client(cfg.slurm_backend, node_query=cfg.node_query)
        self.environ = dict(environ)
        root_given = cfg.run_dir or run_dir
        handed = handover.for_successor(Path(root_given), job_id) if resume and root_given else None
        job = handed.job if handed else self.slurm.job(job_id)
        self.watch = NodeWatch(self.slurm, reservation=cfg.reservation, poll_s=cfg.poll_s,
                               notices=cfg.drain_notices, slurm_conf=self.environ.get("SLURM_CONF"))
        if handed and handed.pool_nodes is not None:
            self.watch.pool.prime(handed.pool_nodes)
        # the job's nodes and the reservation's in one query, which is also the first node poll
        infos = self.slurm.nodes(list(dict.fromkeys(list(job.nodes) + self.watch.pool.nodes())))
        self.watch.prime(time.time(), infos)
        self.addr = {n: infos[n].addr for n in job.nodes}
        nodes = [n for n in job.nodes if n != keeper]  # the training nodes, to begin with
        self.batch_host = job.batch_host or nodes[0]
        self.keeper = keeper
        # Our node (a keeper runs us as a step on a training node; without one, the batch host):
        # bind to its own address, from Slurm.
        self.home = JobEnv.read().node or None if keeper else self.batch_host
        if self.home not in self.addr:
            self.home = self.batch_host
        self.host = self.addr[self.home]
        self.launcher = KeeperSteps() if keeper else LocalSteps()
        root = Path(cfg.run_dir or records.run_dir(job.work_dir or os.getcwd(), job_id))
        self.replayed: journal.Replayed | None = None
        self.metrics_through = 0
        k = cfg.ranks_per_node
        if resume:  # claim the journal (the predecessor is demoted by it), then read what it left
            self.files = records.RunFiles(root)  # held open: a `runs/` another user swaps in is never read
            self.key = channel.read_secret(str(self.files.at / "secret"))  # the ranks hold it: same job, same key
            at = self.files.at
            self.journal = journal.Journal(at / "journal.jsonl", key=self.key, attempt=attempt,
                                           seq=journal.read(at / "journal.jsonl", self.key).seq)
            self.journal.claim(time.time())
            self.replayed = j = journal.read(at / "journal.jsonl", self.key)  # everything before our claim
            if j.job_id != job_id:
                raise ConfigError(f"{root}/journal.jsonl belongs to job {j.job_id}, not {job_id}")
            self.metrics_through = records.trim_torn(at / "metrics.jsonl")
            records.trim_torn(at / "timeline.jsonl")
            # the job's nodes now include standbys: the layout is the journal's
            self.view = JobView(job_id, j.world_size, j.ranks_per_node, j.batch_host, dict(j.rank_node))
            self.in_job: list[str] = []  # the journal has the pool, the job's own standbys included
        else:
            # TM_INJOB_STANDBYS: the last N training nodes are standbys from the start (view.split_in_job)
            nodes, self.in_job = view_mod.split_in_job(
                nodes, cfg.injob_standbys, batch_host=self.batch_host, train_feature=TRAIN_FEATURE,
                features={n: infos[n].features for n in nodes if n in infos})
            if self.in_job:
                log.info("TM_INJOB_STANDBYS=%d: %s keep standbys, %s train", cfg.injob_standbys,
                         ", ".join(self.in_job), ", ".join(nodes))
            self.view = JobView(job_id, len(nodes) * k, k, self.batch_host,
                                {i * k + j: n for i, n in enumerate(nodes) for j in range(k)})
        pool_choice = None
        if cfg.standbys == "auto":  # once, from the job's size and the site's rates (pure; a restart gets the same)
            pool_choice = auto_pool.choose(len(set(self.view.rank_node.values())), site.load(cfg.site_config))
            self.cfg = cfg = dataclasses.replace(cfg, standbys=pool_choice["standbys"])
            log.info("TM_STANDBYS=auto: %d standby(s): %s", cfg.standbys, pool_choice["why"])
        # A layout that cannot fit the job (TP x PP x DP != ranks) fails here, before any launch.
        # Loading it imports its module, and torch with it: the controller needs the workload's
        # own answers (its groups, its replica group), which only its code gives.
        if workload is None:
            workload = registry.load(cfg.workload, cfg.workload_kwargs())
        specs = workload.group_specs(self.view.world_size)
        replica = next((g.ranks for g in specs if g.name == workload.replica_group()),
                       tuple(range(self.view.world_size)) if workload.replica_group() == "world" else None)
        self.snapshot_every = cfg.snapshot_every if tiers.snapshots_needed(
            parse_tiers(cfg.recovery_tiers), replica, self.view.world_size, self.view.ranks_per_node) else 0
        self.policy = Policy(cfg, self.view)
        self.policy.pool_choice = pool_choice
        self.policy.snapshot_every = self.snapshot_every
        if not resume:
            self.files = records.RunFiles(root)
            try:
                self.key = channel.write_secret(str(self.files.secret))
            except FileExistsError:
                raise ConfigError(f"{self.files.root} already holds a job secret: a controller of job {job_id} ran "
                                  "there before (a requeued job?). Move that directory away, or set TM_RUN_DIR "
                                  "to a new one; TrainMover never reuses another controller's secret.") from None
        # the manifests are read and written through the held directory; the ranks get the path
        self.checkpoint_root = self.files.at / "checkpoints"
        self.policy.checkpoint_steps = checkpoint_layout.complete(self.checkpoint_root, self.key)[-checkpoint_layout.KEEP:]
        self.capabilities: dict = {}
        # Why this job takes no standby by job expansion ("": it may; None: not known yet). Set
        # from the rights check; the resizer asks it before every grow (user_rights.grow_refusal).
        self.grow_refusal: str | None = None
        self.fencing = FencedNodes()
        if not resume:  # a resuming controller checks in the background: a move must stay quick
            self._check_rights()
            self.policy.on_grow_verdict(self.grow_refusal)  # refused: the pool is what the job brought
        self.keeper_conn = None  # set on the keeper's hello, on its connection's thread (see _beat_keeper)
        self.server = channel.Server(self.host, self.key, sock=listen, on_hello=self._hello)
        self.store, (self.store_host, self.store_port) = (None, store) if store else self._store()
        if not resume:
            self.journal = journal.Journal(self.files.at / "journal.jsonl", key=self.key, attempt=attempt)
        self.durable: dict = {}
        if resume:  # before ours replaces it: where the predecessor's rendezvous store was
            before = endpoint.read(self.files.at / endpoint.NAME, self.key)
            self.policy.store_moved = before is not None and before.store != (self.store_host, self.store_port)
        endpoint.write(self.files.at, endpoint.Endpoint(self.server.address[0], self.server.address[1],
                                                          self.store_host, self.store_port, self.home, attempt),
                       self.key, job_id=job_id, batch_host=self.batch_host, keeper=keeper or "", pid=os.getpid())
        self.conns: dict[str, list] = {}           # node -> authenticated worker connections
        self.conn_ranks: dict = {}                 # connection -> the ranks its process runs (from its messages)
        self.standby_launches = 0                  # for TM_INJECT die-in-warmup:<n>
        self.outcome: tuple[bool, str] | None = None
        # the job's record, kept by this controller's own grows and releases (controller/resize.py)
        self.resizer = Resizer(self.slurm, job, reservation=cfg.reservation, standby_wait_s=cfg.standby_wait_s,
                               pool=self.watch.pool, addr=self.watch.addr, clock=time.monotonic,
                               standbys=cfg.standbys,  # a number: 'auto' was resolved above
                               gate=lambda: self.grow_refusal)
        self.work = SlurmWork()  # grows, releases, fencing: on threads beside the loop
        self.loop_at = time.monotonic()            # the main loop's last turn (see _beat_keeper)
        self._stall_shown = False                  # a stalled reader's stack logged (once per stall)
        if keeper:
            threading.Thread(target=self._beat_keeper, name="tm-keeper-beat", daemon=True).start()

    # --- what the job's user may do (slurm/rights.py) ----------------------------------------
    def _check_rights(self) -> None:
        """What this job's user may do, in the log and status.json (controller/user_rights.py);
        a start error (a reservation that refuses the user, with standbys wanted) ends the job."""
        self.capabilities, error = user_rights.from_slurm(self.slurm, self.job_id, self.cfg.reservation,
                                                          self.cfg.standbys, self.fencing, self.cfg.slurm_expansion_fix,
                                                          in_job=self.cfg.injob_standbys)
        self.grow_refusal = user_rights.grow_refusal(self.capabilities)
        if error:
            self.files.write("status", {**self.status(), "outcome": records.sealed_outcome(self.key, False, error)})
            raise ConfigError(error)

    def _rights_from_predecessor(self) -> bool:
        caps = user_rights.from_predecessor(self.files.at / "status.json", self.fencing)
        if caps is not None:
            self.capabilities = caps
            self.grow_refusal = user_rights.grow_refusal(caps)
            self.policy.on_grow_verdict(self.grow_refusal)
        return caps is not None

    def status(self) -> dict:
        """The policy's status with what only the executor knows: the user's rights, fenced nodes."""
        return {**self.policy.status(), "capabilities": self.capabilities, "fenced_nodes": self.fencing.status(),
                "node_watch": self.watch.status()}


    def _hello(self, conn, hello: dict) -> None:
        # on the connection's thread: beats from the keeper's hello on, not from the loop's next
        # turn (Slurm queries throttled by slurmctld can outlast the keeper's 2 s deadline)
        if hello.get("type") == "hello" and hello.get("role") == "keeper":
            self.keeper_conn = conn

    def _beat_keeper(self) -> None:
        """Tell the keeper we live, every KEEPER_BEAT_S, from a thread of our own: the keeper
        promotes the warm successor after TM_CONTROLLER_DEADLINE_S of silence (controller/
        succession.py), and the main loop may block longer than that in one Slurm command on a
        slow slurmctld. A loop that has not turned for LOOP_STALL_S (longer than any Slurm
        command's deadline) is hung: the beats stop and the keeper replaces us."""
        while self.outcome is None or self.outcome[0] is not None:
            time.sleep(KEEPER_BEAT_S)
            conn = self.keeper_conn
            if conn is None or conn.closed or time.monotonic() - self.loop_at > LOOP_STALL_S:
                continue
            if time.monotonic() - self.server.turned_at > READER_STALL_S:
                continue  # the channel's reader is hung: nothing is judged meanwhile (liveness.py), so be replaced
            try:
                conn.send(make("alive"))
            except OSError:
                pass  # the keeper's channel is gone: the loop hears of it (handle_gone)

    def _store(self):
        # TCPStore for gloo rendezvous, on a socket bound to this node's address: every node
        # of the local cluster shares one port space, and a real cluster has several NICs.
        # Only without the supervisor's store (one-process uses such as the benches): torch is
        # imported here, not with this module.
        import torch.distributed as dist
        sock = socket.create_server((self.host, 0), backlog=1024)
        port = sock.getsockname()[1]
        store = dist.TCPStore(self.host, port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.cfg.group_timeout_s),
                              master_listen_fd=sock.detach(), use_libuv=False)
        return store, (self.host, port)

    # --- launching -----------------------------------------------------------------------
    def _spec(self, role: str, node: str, ranks: tuple[int, ...]) -> WorkerSpec:
        """The job's configuration as the spec copies it, plus this launch's own fields and the
        values the controller decides: snapshot_every (0 where no snapshot could be used), the
        layout's ranks per node, the faults this launch injects."""
        return WorkerSpec.from_config(
            self.cfg, role=role, ranks=ranks, world_size=self.view.world_size, node=node,
            node_addr=self.addr[node], controller=tuple(self.server.address),
            store=(self.store_host, self.store_port), secret_file=str(self.files.secret),
            controller_file=str(self.files.root / endpoint.NAME),
            recording_dir=str(self.files.root / "recordings") if self.cfg.record_iterations else "",
            snapshot_every=self.snapshot_every, checkpoint_dir=str(self.files.root / "checkpoints"),
            run_dir_id=files.dir_identity(self.files.at),  # the rank holds this directory, no other
            ranks_per_node=self.view.ranks_per_node,
            inject=faults.for_launch(self.cfg.inject, role, self.standby_launches, first_controller=self.attempt == 0))

    def _launch(self, role: str, node: str, ranks: tuple[int, ...]) -> None:
        if role == "standby":
            self.standby_launches += 1
        spec = self._spec(role, node, ranks)
        module, ntasks = rank_program(self.cfg.workload, self.cfg.ranks_per_node)
        argv = self.slurm.step_argv(self.job_id, node, [sys.executable, "-m", module], ntasks=ntasks,
                                    name=f"tm-{role}")
        env = step_environment(self.slurm.step_env(self.resizer.job, self.environ))  # the kept record: no RPC
        env[SPEC_ENV] = spec.to_env()
        # a keeper opens the log through its own held directory (it checks the path); our own srun's
        # log is opened through ours: a `runs/` swapped since gets none of the step's output
        log_path = (self.files.root if self.launcher.remote else self.files.at) / f"{role}-{node}.log"
        pid = self.launcher.launch(node, role, argv, env, log_path)
        self.journal.write(time.time(), [{"kind": "launch", "node": node, "role": role, "ranks": list(ranks),
                                          "pid": pid}])
        log.info("launched %s on %s (ranks %s), log %s", role, node, list(ranks), log_path)

    # --- the loop ------------------------------------------------------------------------
    def _journal_decisions(self) -> None:
        """Write ahead: what the policy just decided is durable before any of it is acted on."""
        now_durable = self.policy.durable()
        self.journal.write(time.time(), journal.diff(self.durable, now_durable))
        self.durable = now_durable

    def apply(self, actions: list) -> None:
        if not self.journal.held():  # a successor claimed the journal: act on nothing more
            raise journal.Superseded("another controller claimed the journal")
        self._journal_decisions()
        actions, held = self.fencing.route(actions)  # a fenced node leaves the job only drained
        for node, why in held:
            log.warning("%s stays in the job: %s", node, why)
            self.work.events.put(Released(node, False, why))
        for a in actions:
            if isinstance(a, AcquireStandby):
                self.work.start("acquire", self.resizer.acquire)
            elif isinstance(a, LaunchStandby):
                self._launch("standby", a.node, ())
            elif isinstance(a, Send):
                if a.msg["type"] == "prepare":
                    self.faults.at("controller", at="preparing")
                for node in a.nodes:
                    for conn in self.conns.get(node, []):
                        try:
                            conn.send(a.msg)
                        except OSError as exc:
                            log.warning("cannot send %s to %s: %s", a.msg["type"], node, exc)
                if a.msg["type"] == "prepare" and a.msg["assign"]:  # the joiner's: the last of a prepare
                    self.faults.at("controller", at="prepare")
            elif isinstance(a, ReleaseNode) and a.node == self.home and self.keeper:
                # Our own node leaves: a successor elsewhere releases it (it resumes from the
                # journal, where this release is due); releasing it now would end us mid-way.
                self.outcome = (None, f"{a.node}, this controller's node, leaves the job")
            elif isinstance(a, ReleaseNode):
                self.work.start("release", lambda n=a.node: self.resizer.release(n))
            elif isinstance(a, Record):
                if a.stream == "final":
                    self.files.write("final", a.payload)
                else:
                    self.files.append(a.stream, a.payload)
            elif isinstance(a, Rewind):
                dropped = self.files.rewind("metrics", a.step)
                log.info("rolled back to step %d: %d metrics rows of later steps dropped (they are redone)",
                         a.step, dropped)
            elif isinstance(a, CheckpointDone):
                checkpoint_layout.write_manifest(self.checkpoint_root, a.step, a.digests, self.key)
                gone = checkpoint_layout.prune(self.checkpoint_root, list(a.keep))
                log.info("checkpoint of step %d complete; pruned %s", a.step, [d.name for d in gone])
            elif isinstance(a, Fence):
                self._fence(a)
            elif isinstance(a, Finish):  # a failure naming a peer outside the job says so
                self.outcome = (a.ok, a.message if a.ok else foreign_peer.note(a.message, self.addr.values()))

    # --- fencing (controller/policy/liveness.py) ------------------------------------------------
    def _refuse(self, conn, reason: str) -> None:
        try:
            conn.send(make("fenced", reason=reason[:500]))
        except OSError:
            pass  # cut off, or frozen with a full buffer: its step is being killed anyway
        conn.close()

    def _fence(self, a: Fence) -> None:
        """A process judged dead never acts again: its connection is refused now and whenever it
        comes back (policy.fenced_pids, journaled), its Slurm step killed, its node drained."""
        for conn in list(self.conns.get(a.node, [])):
            if (conn.identity or {}).get("pid") == a.pid:
                self.conns[a.node].remove(conn)
                self._refuse(conn, a.reason)
        drain = self.fencing.fence(a.node, a.reason)
        if not drain:
            log.warning("fenced %s is not drained (%s): held in the job until it ends", a.node,
                        self.fencing.nodes[a.node].held or "drained already")
            if self.fencing.nodes[a.node].held:
                self._mark_held(a.node, a.reason)
        self.work.start("fence", lambda: kill_and_drain(self.slurm, self.job_id, self.launcher.get(a.node), a.node,
                                                           a.reason, drain))

    def _mark_held(self, node: str, why: str) -> None:
        """`held-<node>.json` beside status.json: by its existence alone it tells that node's Epilog
        (slurm_plugin/epilog.sh, root) that this job's record is to be read at its end, so that
        every other job's end starts no check at all (status.json stays what is judged)."""
        try:
            self.files.write(f"held-{node}", {"node": node, "why": why[:500]})
        except OSError as exc:  # the record in status.json still says it; only the Epilog's shortcut is lost
            log.warning("could not mark %s held for the Epilog: %s", node, exc)

    def handle_peer(self, conn, raw, now: float) -> list:
        """One validated message of an authenticated peer, as its class from here on (typed once:
        the policy's liveness and its handler read the same object)."""
        msg = typed(raw)
        kind = msg.TYPE
        ident = conn.identity or {}
        if (ident.get("node"), ident.get("pid")) in self.policy.fenced_pids:
            log.warning("refused %s from fenced process %s on %s", kind, ident.get("pid"), ident.get("node"))
            self._refuse(conn, "this process was judged dead and replaced")
            return []
        if ident.get("role") == "keeper" and not isinstance(msg, StatusMsg):
            return self._from_keeper(conn, msg)
        if isinstance(msg, HelloMsg):
            self.conns.setdefault(msg.node, []).append(conn)
            self.conn_ranks[conn] = tuple(msg.ranks)  # () for a standby, until it joins
            self.policy.heard(now, msg.node, msg.pid, msg)
            return []
        if isinstance(msg, (MigrateMsg, StatusMsg)):  # CLI requests: one reply, then the CLI hangs up
            if isinstance(msg, MigrateMsg):
                ok, text, actions = self.policy.request(now, msg.node, "manual")
            else:
                ok, text, actions = True, "", []
            try:
                conn.send(make("reply", ok=ok, message=text, data=self.status()))
            except OSError as exc:  # the requester is gone (or was dropped for a bad message): its loss
                log.warning("could not reply to %s: %s", conn.peer, exc)
            return actions
        node = (conn.identity or {}).get("node")
        if node is None:
            return []
        if isinstance(msg, (StepMsg, SwitchedMsg, FinishedMsg)):  # a joiner's rank is learnt here
            self.conn_ranks[conn] = (msg.rank,)
        self.policy.heard(now, node, ident.get("pid", 0), msg)
        if kind == "beat":
            return []
        if isinstance(msg, FailedMsg):
            log.error("rank %d on %s failed in %s%s at step %d: %s\n%s", msg.rank, node, msg.phase,
                      " (the workload's own code)" if msg.user else "", msg.step, msg.error, msg.traceback.rstrip())
        return self.policy.on_message(now, node, msg)

    def _from_keeper(self, conn, msg) -> list:
        """The keeper runs our steps (controller/steps.py): what runs after it (re)connects, then
        each step's end (handled with the other step ends in the loop)."""
        if not isinstance(self.launcher, KeeperSteps):
            log.warning("a keeper on %s connected, but this job runs its steps itself", (conn.identity or {}).get("node"))
            return []
        if isinstance(msg, StepsMsg):
            self.launcher.connected(conn, msg.running)
        elif isinstance(msg, StepExitMsg):
            self.launcher.on_exit(msg.node, msg.code)
        return []

    def handle_gone(self, conn, now: float) -> list:
        """A peer's connection closed. For a rank's agent that has not finished or handed its
        state over, this is the fastest sign that it died (the kernel closes a killed
        process's sockets at once; Slurm reports the step's end later)."""
        hello = conn.identity or {}
        node = hello.get("node")
        if hello.get("type") != "hello" or node is None:
            return []  # a CLI request, or a peer that never authenticated
        if hello.get("role") == "keeper":
            if isinstance(self.launcher, KeeperSteps) and self.launcher.conn is conn:
                self.launcher.gone()
            return []
        if conn in self.conns.get(node, []):
            self.conns[node].remove(conn)
        self.policy.forget(node, hello.get("pid", 0))
        if (node, hello.get("pid")) in self.policy.fenced_pids:  # judged dead already: its end is no news
            self.conn_ranks.pop(conn, None)
            return []
        return self.policy.on_peer_gone(now, node, self.conn_ranks.pop(conn, ()))

    def _begin(self) -> None:
        self.durable = self.policy.durable()
        self.journal.write(time.time(), [{"kind": "start", "job_id": self.job_id, "world_size": self.view.world_size,
                                          "ranks_per_node": self.view.ranks_per_node, "batch_host": self.batch_host,
                                          "rank_node": {str(r): n for r, n in self.view.rank_node.items()}}])
        for node in self.view.train_nodes():
            self._launch("worker", node, self.view.ranks_of(node))
        self.apply(self.policy.start(time.time(), self.in_job))  # the job's own standbys launched here

    def _resume(self) -> None:
        """Take over from a dead controller: its view from the journal, its steps adopted, any
        node Slurm gave the job that the journal does not know of treated as a new standby."""
        j = self.replayed
        t0 = time.time()  # the `restart` record is our claim, written in __init__
        actions = self.policy.resume(t0, j, self.metrics_through)
        self.durable = self.policy.durable()
        # every node the journal accounts for: ranks, standbys, released, a leaver whose release is
        # due (the node a moving controller left), and the keeper, which never trains
        fenced = {n for n, _ in self.policy.fenced_pids}
        leaving = {m.leaver for m in self.policy.migrations if m.active}
        job_nodes = self.resizer.job.nodes  # read in __init__, a moment ago
        for node in view_mod.came_back(job_nodes, self.view, leaving, self.keeper, fenced):
            log.warning("%s left the job earlier and is in it again (taken while the controller died): made a "
                        "standby", node)
            self.view.released.remove(node)
        known = (set(self.view.rank_node.values()) | set(self.view.standbys) | set(self.view.released)
                 | leaving | {self.keeper} | fenced)
        in_job = set(job_nodes)
        # a fenced node still in the job, running no rank: its drain was refused (fencing.py)
        self.fencing.restore(sorted(n for n in fenced & in_job if n not in self.view.rank_node.values()
                                    and n not in self.view.standbys and n != self.keeper), "fenced")
        if not self._rights_from_predecessor():
            self.work.start("rights", lambda: (self._check_rights(), RightsChecked())[1])
        for node, rec in j.steps.items():
            if node in known and node not in self.view.released:
                self.launcher.adopt(node, rec["pid"])
        for node in job_nodes:
            if node not in known:
                log.warning("%s joined the job but is not in the journal (taken while the controller died): "
                            "made a standby", node)
                actions += self.policy.on_standby_acquired(t0, node)  # its address: read in __init__
        log.info("resumed from the journal (%d records) in %.3fs; waiting for the ranks", j.records, time.time() - t0)
        self.apply(actions)

    def run(self) -> int:
        try:
            return self._run()
        except journal.Superseded as exc:
            # Demoted (we were frozen or cut off and the keeper promoted a successor): stop at
            # once, writing nothing more; the successor owns the job, its files and the ranks.
            log.error("controller on %s (attempt %d) was replaced: %s; it stops without acting", self.home,
                      self.attempt, exc)
            self.outcome = (None, "replaced")  # its beats to the keeper stop too
            self.server.close()
            return SUPERSEDED

    def _run(self) -> int:
        if self.replayed is not None:
            self._resume()
        else:
            self._begin()
        next_tick = 0.0
        # The policy's clock (liveness, phase deadlines, standby retries) ticks at least every
        # second, apart from the node poll, which slurmctld's load keeps to TM_POLL_S (10 s).
        tick_s = min(self.cfg.poll_s, TICK_S)
        last_status = None
        status_at = 0.0
        while self.outcome is None:
            now = time.time()
            self.loop_at = time.monotonic()
            actions = []
            mine = self.view.train_nodes() + list(self.view.standbys) + self.view.released
            # a drain notice counts for the ranks' nodes and the standbys' (a controller may run on either)
            states = self.watch.turn(now, mine, list(self.view.rank_node.values()) + list(self.view.standbys))
            if states:
                actions += self.policy.on_nodes(now, states)
            if now >= next_tick:
                next_tick = now + tick_s
                actions += self.policy.on_tick(now, self._arrivals(), looked_at=self.server.looked_at)
            for node, code in self.launcher.exited():
                actions += self.policy.on_step_exit(now, node, code)
            while True:
                try:
                    ev = self.work.events.get_nowait()
                except queue.Empty:
                    break
                actions += self._on_event(now, ev)
            self.apply(actions)
            try:
                conn, msg = self.server.inbox.get(timeout=min(0.2, max(0.01, next_tick - time.time())))
                self._messages(conn, msg)
            except queue.Empty:
                pass
            # At most every STATUS_EVERY_S: at 1,024 ranks status.json is ~40 KB, and a loop turn
            # that rebuilt it each time was much of the controller's CPU (docs/scale.md).
            # Compared as text: status() shares nested dicts with the policy (its straggler
            # verdict is updated in place), so a kept dict would always compare equal.
            if time.monotonic() - status_at >= STATUS_EVERY_S:
                status_at = time.monotonic()
                status = json.dumps(self.status(), indent=1, sort_keys=True)
                if status != last_status and self.journal.held():
                    self.files.write_text("status", status)
                    last_status = status
        return self.shutdown()

    def _messages(self, conn, msg) -> None:
        """`msg` (None: `conn` is gone), then what else arrives for TURN_S: one loop turn's
        messages (step reports of many ranks come faster than turns; node polls and step exits
        must still run). Each message's effects are applied before the next is handled; what a
        decision without effects changed of the durable state is journaled once, at the turn's
        end (before any later effect: a change not yet journaled is as a message not yet
        received, which the ranks' resync gives a successor)."""
        budget = time.monotonic() + TURN_S
        try:
            while True:
                actions = (self.handle_peer(conn, msg, time.time()) if msg is not None
                           else self.handle_gone(conn, time.time()))
                if actions:
                    self.apply(actions)
                if self.outcome is not None:  # ended: nothing more is acted on
                    break
                left = budget - time.monotonic()
                if left <= 0:
                    break
                conn, msg = self.server.inbox.get(timeout=left)
        except queue.Empty:
            pass
        self.apply([])

    def _arrivals(self) -> dict:
        """(node, pid) -> when its connection's reader last received a frame: a message still
        queued for the policy proves its sender alive (controller/policy/liveness.py)."""
        late = time.monotonic() - self.server.turned_at
        if late > 2 * TICK_S:  # it turns at least every second: its frames' times are stale
            log.warning("the control channel's reader has not turned for %.1fs", late)
            if late > 5 * TICK_S and not self._stall_shown:  # once per stall: where it is held
                self._stall_shown = True
                log.warning("the control channel's reader is at:\n%s", self.server.selector_stack())
        else:
            self._stall_shown = False
        return {(node, (c.identity or {}).get("pid", 0)): c.last_frame_at
                for node, conns in self.conns.items() for c in conns}

    def _on_event(self, now: float, ev: WorkEvent) -> list:
        """What the policy hears of the work beside the loop (controller/slurm_work.py)."""
        match ev:
            case Fenced(node, kill_errors, drain, drain_error):
                if kill_errors:
                    log.warning("fencing %s incomplete: %s", node, kill_errors)
                if not drain:
                    return []
                actions, held = self.fencing.drained(node, drain_error)
                if drain_error:
                    log.warning("drain of fenced %s refused (%s): held in the job, out of training and of the "
                                "standby pool, until the job ends", node, drain_error)
                    self._mark_held(node, drain_error)
                for n, why in held:
                    actions += self.policy.on_released(now, n, False, why)
                return actions
            case RightsChecked():  # a successor's check in the background answered (on its thread)
                self.policy.on_grow_verdict(self.grow_refusal)
                return []
            case Acquired(node, addr):
                log.info("standby %s joined the allocation", node)
                self.addr[node] = addr
                return self.policy.on_standby_acquired(now, node)
            case Unavailable(reason):
                return self.policy.on_standby_unavailable(now, reason)
            case Released(node, ok, message):
                return self.policy.on_released(now, node, ok, message)
            case WorkFailed(name, error):
                log.error("background %s failed: %s", name, error)
                return self.policy.on_standby_unavailable(now, str(error)) if name == "acquire" else []
        raise TypeError(f"not an event of the controller's work: {ev!r}")  # a bug: every WorkEvent is matched

    def shutdown(self) -> int:
        ok, message = self.outcome
        if ok is None:  # moving: nothing ends, the successor resumes from the journal
            return self._hand_over(message)
        for ev in self.work.finish_releases():  # a node that left the job is recorded so; nothing new starts
            self.apply([a for a in self.policy.on_released(time.time(), ev.node, ev.ok, ev.message)
                        if isinstance(a, Record)])
        # First, durably: the job ended on purpose. Whatever happens to this process from here
        # on, no keeper or supervisor starts a controller again (journal.ended).
        self.journal.write(time.time(), [{"kind": "end", "ok": bool(ok), "message": message[:2000]}])
        status = self.status()
        status["outcome"] = records.sealed_outcome(self.key, bool(ok), message)  # the keeper believes only this
        self.files.write("status", status)
        log.info("controller: %s", message)
        self._withdraw_donors()  # a standby being taken right now must not outlive us
        for conns in self.conns.values():  # standbys exit when the controller says bye
            for conn in conns:
                try:
                    conn.send(make("bye", reason=message[:500]))
                except OSError:
                    pass
                conn.close()
        self.launcher.stop(30)
        self._withdraw_donors()  # and one granted meanwhile (an acquire under way as the job ended)
        self.server.close()
        self.files.close()
        self.journal.close()
        return 0 if ok else 1

    def _withdraw_donors(self) -> None:
        try:
            gone = self.slurm.cancel_donors(self.job_id)
            if gone:
                log.info("withdrew donor allocation(s) %s", gone)
        except SlurmError as exc:
            log.warning("could not withdraw donor allocations: %s", exc)

    def _hand_over(self, why: str) -> int:
        """Leave the job to a successor on another node (the keeper starts it): everything it needs
        is in the journal, and the ranks find it through controller.json. No `bye`: they wait for it."""
        log.info("controller on %s hands over: %s", self.home, why)
        self.files.append("timeline", {"t": time.time(), "event": "controller_hand_over", "node": self.home,
                                       "attempt": self.attempt, "migration": None})
        self.files.write("status", self.status())
        handover.leave(self.files.at, self.key, attempt=self.attempt, job=self.resizer.record_if_idle(),
                       pool_nodes=self.watch.pool.known())  # what the successor need not ask Slurm
        for conns in self.conns.values():
            for conn in conns:
                conn.close()
        self.server.close()
        self.files.close()
        self.journal.close()
        # Last: the keeper promotes the warm successor on this word (controller/succession/keeper.py),
        # without waiting for this process and its step to end. We act on nothing after it.
        keeper = getattr(self.launcher, "conn", None)
        if keeper is not None:
            try:
                keeper.send(make("moving", reason=why[:500]))
            except OSError as exc:
                log.warning("could not tell the keeper we hand over (it sees the step end): %s", exc)
        return MOVED


TICK_S = 1.0  # the policy's tick at most this far apart (the node poll may be further)
TURN_S = 0.05  # a loop turn handles messages for this long before its node poll, step exits, work events
STATUS_EVERY_S = 0.5  # status.json rewritten at most this often (when it changed)
KEEPER_BEAT_S = 0.25  # the controller's beat to the keeper (controller/succession/keeper.py)
LOOP_STALL_S = 30.0   # a main loop that has not turned for this long is hung: no more beats
# A channel reader in one turn this long is hung, not busy (the longest busy turn seen: 30.5 s, a
# recovery's burst at 128 nodes on 2 loaded cores): silence and "nobody lost" are counted only to
# its last look, so a hung one would hold them for good; the keeper replaces us instead.
READER_STALL_S = 120.0
