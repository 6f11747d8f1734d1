"""The job's keeper: the batch script's process on the job's keeper node (docs/admin.md, "No special
node").

Slurm never releases the node that runs a job's batch script, and a step ends with the `srun` that
launched it. So a job asks for one small keeper node besides its training nodes (`sbatch
--constraint="[tm_keeper*1&...]" --batch=tm_keeper`), and its batch script runs this process
there, which:

* runs the controller as a step on a training node (its "home") and, from the start, a warm
  successor on another (imported, bound, waiting for one word on its stdin); when the controller
  moves away (it says `moving`: its home is leaving the job) or is lost (its channel closed, its
  step ended without an outcome, or it was silent past TM_CONTROLLER_DEADLINE_S: fenced with
  SIGKILL), the keeper tells the successor `takeover <attempt>` and starts a new successor
  (controller/succession/rules.py decides; the successor's claim in the journal fences the old one);
* runs every other step the controller asks for (`launch`), so that the sruns outlive any
  controller, and tells the controller of each step's end (`step_exit`);
* ends with the controller's final exit code: the job's own state (COMPLETED on success).

Every training node can then leave the job like any other. The keeper node runs no rank and
no controller; its loss ends the steps it launched (docs/admin.md says why that is the trade).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from trainmover.config import Config
from trainmover.controller.durable import journal, records
from trainmover.controller.steps import start_srun, step_environment
from trainmover.controller.succession import rules as succession
from trainmover.errors import ConfigError, ProtocolError, TrainMoverError
from trainmover.protocol import channel, endpoint, files
from trainmover.protocol.messages import ByeMsg, LaunchMsg, MovingMsg, make, typed
from trainmover.protocol.worker_spec import ENV as SPEC_ENV
from trainmover.slurm import parse
from trainmover.slurm.job_env import JobEnv
from trainmover.slurm.model import KEEPER_FEATURE, TRAIN_FEATURE, JobInfo, NodeInfo
from trainmover.slurm.pacing import Paced, TokenBucket

log = logging.getLogger("trainmover.keeper")

CONTROLLER_STEP = "tm-controller"  # the controller's step name (kill_steps picks it by name)
PROBE_S = 1.0        # the keeper asks the controller for its status this often (a failed send: channel
                     # closed); the controller's own beats (`alive`, every 0.25 s) prove it alive
START_DEADLINE_S = 120.0  # a controller that never writes its endpoint is lost too
SUCCESSOR_RETRY_S = (60.0, 600.0)  # between tries to place a warm successor when no node was free (two
                                   # queries each): doubling from the first to the second; a standby's
                                   # launch (a node joined the job) makes it try at once
END_WAIT_S = 60.0    # a controller that ended the job (journal `end`) gets this long to exit
# The sruns the keeper starts for the controller, paced to slurmctld's per-user bucket (rl_enable:
# 30 tokens, 2 a second; slurm/pacing.py's Paced says what one costs) with room left in it for what
# the job's start asks besides (sbatch, the controllers' own two sruns, the standby's allocation:
# with a burst of 20 here a 16-node start still drew 7 "rate limit exceeded"): 10 tokens, 1.5 a
# second, so a start of N nodes takes about (2 N - 10) / 1.5 s (128 nodes: about 165 s; docs/scale.md).
LAUNCH_BUCKET = (10.0, 1.5)
SRUN_RPCS = 2


@dataclass(frozen=True)
class Home:
    """A node for a controller, with what the keeper read to choose it."""
    node: str
    job: JobInfo
    addr: str


def joined_from_launch(job: JobInfo, node: str, env: dict) -> tuple | None:
    """What a standby's launch tells of the job (pure): the controller's record of its nodes (the
    step's SLURM_JOB_NODELIST) and the standby's address (its worker spec), as a reading for
    placing a successor there without asking Slurm; None if the launch does not say."""
    try:
        addr = json.loads(env.get(SPEC_ENV, "{}")).get("node_addr", "")
        nodes = JobEnv.read(env).allocation()
    except (ValueError, AttributeError, ConfigError):
        return None
    if not addr or node not in nodes:
        return None
    job = dataclasses.replace(job, nodes=nodes, nodelist=",".join(nodes), num_nodes=len(nodes))
    return job, {node: NodeInfo(node, addr, "ALLOCATED")}


def choose_home(candidates: list[str], avoid: set[str], states: dict[str, str]) -> str | None:
    """The next controller's node: the first candidate neither avoided nor draining or down
    (pure). `states`: Slurm's word for each node."""
    for node in candidates:
        state = states.get(node, "")
        if node not in avoid and "DRAIN" not in state and not state.startswith(("DOWN", "FAIL")):
            return node
    return None


class Keeper:
    def __init__(self, cfg: Config, slurm, job_id: int, node: str, environ=os.environ, reading: tuple | None = None):
        """`reading`: (job, its nodes' infos) as the batch script found them (start_reading)."""
        self.cfg, self.slurm, self.job_id, self.node = cfg, slurm, job_id, node
        self.environ = dict(environ)
        job = reading[0] if reading else slurm.job(job_id)
        self.reading: tuple = reading or (job, None)  # the last (job, its nodes' infos) read: reused at once
        self.joined: tuple | None = None    # (job, {standby: info}) from a standby's launch: placed there, no query
        # the job's user's alone; one someone else made first is refused (protocol/files.py)
        self.root = files.private_dir(Path(cfg.run_dir or records.run_dir(job.work_dir or os.getcwd(), job_id)))
        self.at = files.held_dir(self.root)  # read through: a `runs/` another user swaps in is never read
        self.key: bytes | None = None  # the job's secret: read once, when the controller has made it
        self.steps: dict[str, tuple[str, object]] = {}  # node -> (role, Popen)
        self.launches = Paced(TokenBucket(*LAUNCH_BUCKET, time.monotonic()), SRUN_RPCS)  # asked, not yet started
        self.controller = None          # (node, Popen) of the primary controller's step
        self.primary: succession.Primary | None = None
        # (node, Popen) of each warm successor's step, oldest (the next promoted) first:
        # TM_CONTROLLER_SUCCESSORS of them
        self.successors: list[tuple[str, object]] = []
        self.successor_starts = 0
        self.successor_retry_at = 0.0   # no node for one: asked Slurm again no sooner than this
        self.successor_retry_s = SUCCESSOR_RETRY_S[0]
        self.retired: list = []         # sruns of former primaries, reaped as they end
        self.attempt = 0
        self.conn = None
        self.inbox: queue.Queue = queue.Queue()
        self.stopping = False
        self.unreported: list[dict] = []  # step ends no controller has heard of yet
        self.ended_at: float | None = None  # when we saw the controller had ended the job on purpose
        self.why = ""                       # why the keeper itself ended the job, if it did

    # --- the controller's steps ---------------------------------------------------------
    def _srun(self, home: Home, argv: list[str], successor: bool):
        """The supervisor's step on `home`, told what the keeper read already (the job's directory,
        the node's address), so that it asks slurmctld nothing before it serves."""
        argv = argv + ["--work-dir", home.job.work_dir or os.getcwd(), "--node-addr", home.addr]
        env = self.slurm.step_env(home.job, self.environ)  # the job as _next_home just read it
        srun = self.slurm.step_argv(self.job_id, home.node, argv, ntasks=1, name=CONTROLLER_STEP)
        return start_srun(srun, env, None, stdin_pipe=successor)  # the job's output file, as without a keeper

    def _start_controller(self, home: Home, resume: bool) -> None:
        """A cold start (the first controller, or no warm successor to promote)."""
        argv = [sys.executable, "-m", "trainmover.controller.succession.supervisor", "--keeper", self.node]
        if resume:
            argv += ["--resume", "--attempt", str(self.attempt)]
        self._became_primary(home.node, self._srun(home, argv, successor=False))
        log.info("controller started on %s (attempt %d%s)", home.node, self.attempt, ", resuming" if resume else "")

    def _became_primary(self, home: str, proc) -> None:
        self.controller = (home, proc)
        self.primary = succession.Primary(home, self.attempt, time.monotonic(), self.cfg.controller_deadline_s,
                                          START_DEADLINE_S)
        self.conn = None
        self.inbox = queue.Queue()

    def _start_successor(self, avoid: frozenset = frozenset(), reading: tuple | None = None) -> None:
        """Warm successors on other nodes, up to TM_CONTROLLER_SUCCESSORS (docs/admin.md, "No
        special node"): each imports, binds and waits for `takeover <attempt>` on its stdin (srun
        forwards it to the task). `reading`: what placing the primary read a moment ago."""
        budget = (2 * (self.cfg.controller_restarts + 1)) * max(1, self.cfg.controller_successors)
        if len(self.successors) >= self.cfg.controller_successors or self.successor_starts > budget:
            return
        # never the node of a lost controller being fenced (its step kill picks steps by name),
        # nor one that holds a successor already: one node lost must not take two of them
        avoid = set(avoid) | ({self.controller[0]} if self.controller else set()) | {n for n, _ in self.successors}
        now = time.monotonic()
        if now < self.successor_retry_at:  # each try costs two Slurm queries: not every loop turn
            return
        reading, self.joined = reading or self.joined, None
        job, infos = self.reading
        if reading is None and infos is not None and choose_home(
                [n for n in job.nodes if n != self.node], avoid, {}) is None:
            # the job as last read leaves nowhere, and no node joined since (a standby's launch
            # would say): asking Slurm again would find no more (a move: its leaver is draining)
            reading = self.reading
        try:
            home = self._next_home(avoid, reading)
        except TrainMoverError as exc:
            log.warning("no warm successor for now (node query failed: %s)", exc)
            home = None
        if home is None:
            if not self.successors:
                log.warning("no node free of the controller for a warm successor: a move starts one cold")
            # A node joins the job only as a standby the controller has us launch (_launch asks
            # again then); until then a try now and then, in case an admin's change freed one.
            self.successor_retry_at = now + self.successor_retry_s
            self.successor_retry_s = min(SUCCESSOR_RETRY_S[1], 2 * self.successor_retry_s)
            return
        argv = [sys.executable, "-m", "trainmover.controller.succession.supervisor", "--keeper", self.node, "--successor"]
        self.successors.append((home.node, self._srun(home, argv, successor=True)))
        self.successor_starts += 1
        log.info("warm successor controller starting on %s (%d of %d)", home.node, len(self.successors),
                 self.cfg.controller_successors)

    def _fence(self, node: str) -> None:
        try:
            self.slurm.kill_steps(self.job_id, node, names=(CONTROLLER_STEP,))
        except TrainMoverError as exc:
            log.warning("could not kill the lost controller's step on %s: %s", node, exc)

    def _next_home(self, avoid: set[str], reading: tuple | None = None) -> Home | None:
        """Where a controller can run now: two queries (the job, its nodes) unless `reading` gives
        them (the primary and its successor placed at the same moment ask once); the supervisor
        started there is given the answers, so that it need not ask them again."""
        job, infos = reading or (None, None)
        job = job or self.slurm.job(self.job_id)
        candidates = [n for n in job.nodes if n != self.node]
        if infos is None:
            infos = self.slurm.nodes(candidates)
        candidates = [n for n in candidates if n in infos]  # a standby's launch names its node alone
        self.reading = (job, infos)
        node = choose_home(candidates, avoid, {n: i.state for n, i in infos.items()})
        return Home(node, job, infos[node].addr) if node is not None else None

    def _promote(self, p: succession.Promote) -> bool:
        """Hand the job to the warm successor (or, with none, start one cold elsewhere); False when
        there is nowhere or no restart left."""
        old, proc = self.controller
        if p.fence and proc.poll() is None:  # lost but running (frozen, cut off): it must never act again
            proc.kill()  # its srun: Slurm ends the step (its node may not hear of it: fenced below)
            # Slurm may wait on a dead node's slurmd for seconds: not before the successor starts.
            threading.Thread(target=self._fence, args=(old,), name="tm-fence-controller", daemon=True).start()
        # (the successor's claim in the journal demotes the old one even if both kills miss it)
        self.retired.append(proc)
        if not succession.may_promote(p.fence, self.attempt, self.cfg.controller_restarts):
            self.why = (f"controller on {old} {p.why}; no restart left "
                        f"(TM_CONTROLLER_RESTARTS={self.cfg.controller_restarts})")
            log.error("%s", self.why)
            return False
        self.attempt += 1
        # the oldest live successor off the old primary's node: the likeliest to be warm already
        pick = next(((h, s) for h, s in self.successors if s.poll() is None and h != old), None)
        if pick is not None:
            home, succ = pick
            self.successors.remove(pick)
            try:
                succ.stdin.write(f"takeover {self.attempt}\n".encode())
                succ.stdin.flush()
            except OSError as exc:
                log.warning("warm successor on %s is gone (%s): starting one cold", home, exc)
            else:
                log.warning("controller on %s %s: warm successor on %s takes over (attempt %d)", old, p.why, home,
                            self.attempt)
                self._became_primary(home, succ)
                self._start_successor(frozenset({old}))
                return True
        home = self._next_home({old})
        if home is None:
            self.why = f"controller on {old} {p.why}, and no other node of the job can take it"
            log.error("%s", self.why)
            return False
        log.warning("controller on %s %s: resuming it cold on %s", old, p.why, home.node)
        self._start_controller(home, resume=True)
        self._start_successor(frozenset({old}), self.reading)
        return True

    # --- the channel to the controller ----------------------------------------------------
    def _reach(self) -> None:
        """Connect to the primary, unless it ended the job (ENDING): then only its step's exit is
        awaited, and a connect would retry its closed port for its whole 2 s deadline, during
        which the loop sees no exit (it delayed every job's end by 2 s)."""
        if self.primary.state is not succession.State.ENDING:
            self._connect()

    def _read_key(self) -> None:
        """The job's secret, once the first controller has made it (kept from then on)."""
        if self.key is None and (self.at / "secret").exists():
            try:
                self.key = channel.read_secret(str(self.at / "secret"))
            except ProtocolError as exc:
                log.error("%s", exc)

    def _connect(self) -> None:
        self._read_key()
        if self.key is None:
            return  # the first controller has not made it yet (or it is refused: logged)
        ep = endpoint.read(self.at / endpoint.NAME, self.key)
        if ep is None or ep.node != self.controller[0] or ep.attempt != self.attempt:
            return  # the new controller has not written where it is yet
        try:
            self.conn = channel.connect(ep.address, self.key, make("hello", role="keeper", node=self.node, ranks=[],
                                                             pid=os.getpid()), timeout=2.0, source=None)
            # a launch still waiting for its tokens runs as far as a controller is concerned
            self.conn.send(make("steps", running={**{n: role for n, (role, p) in self.steps.items()},
                                                  **{m.node: m.role for m in self.launches.queued}}))
            for msg in self.unreported:  # ends while no controller ran: its successor must know
                self.conn.send(msg)
            self.unreported = []
            self.inbox = queue.Queue()
            threading.Thread(target=_read, args=(self.conn, self.inbox), name="tm-keeper-reader", daemon=True).start()
            self.primary.heard(time.monotonic())
            log.info("connected to the controller on %s", ep.node)
        except (TrainMoverError, OSError) as exc:
            log.info("controller on %s not reachable yet: %s", self.controller[0], exc)
            self.conn = None

    def _serve(self) -> succession.Promote | None:
        """What the controller sent: launches to run; any frame (a reply to a probe) proves it alive."""
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return None
            if msg is None:
                self.conn = None
                return self.primary.channel_closed(time.monotonic())
            self.primary.heard(time.monotonic())
            m = typed(msg)
            if isinstance(m, LaunchMsg):
                self.launches.add(m)
            elif isinstance(m, MovingMsg):
                self.conn = None
                return self.primary.moving(time.monotonic(), m.reason)
            elif isinstance(m, ByeMsg):
                log.info("controller says bye: %s", m.reason)

    def _launch(self, msg: LaunchMsg) -> None:
        node, role = msg.node, msg.role
        log_path = Path(msg.log)
        if log_path.resolve().parent != self.root.resolve():  # an authenticated controller of this job writes only there
            log.error("launch of %s on %s refused: its log %s is outside the run directory", role, node, log_path)
            return
        # opened through the held directory: a `runs/` swapped since gets none of the step's output
        self.steps[node] = (role, start_srun(msg.argv, step_environment(msg.env), self.at / log_path.name))
        log.info("launched %s on %s for the controller", role, node)
        if role == "standby":  # a node joined the job: a warm successor may go there now
            self.successor_retry_at, self.successor_retry_s = 0.0, SUCCESSOR_RETRY_S[0]
            self.joined = joined_from_launch(self.reading[0], node, msg.env)

    def _report_exits(self) -> None:
        for node, (role, proc) in list(self.steps.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.steps[node]
            msg = make("step_exit", node=node, role=role, code=code)
            try:
                if self.conn is None:
                    raise OSError("no controller")
                self.conn.send(msg)
            except OSError:
                self.unreported.append(msg)  # sent to the next controller that connects

    # --- the loop -----------------------------------------------------------------------
    def run(self) -> int:
        home = self._next_home(set(), self.reading)  # the job as __init__ read it
        if home is None:
            log.error("job %d has no node besides the keeper %s to run the controller on", self.job_id, self.node)
            return 2
        self._start_controller(home, resume=False)
        self._start_successor(reading=self.reading)
        next_probe = 0.0
        while True:
            now = time.monotonic()
            verdict = self._primary_exit(now) if self.controller[1].poll() is not None else None
            if isinstance(verdict, int):
                return self._finish(verdict)
            if verdict is None and self.conn is None:
                self._reach()
            elif verdict is None:
                verdict = self._serve()
                if verdict is None and self.conn is not None and now >= next_probe:
                    next_probe = now + PROBE_S
                    try:
                        self.conn.send(make("status"))
                    except OSError:
                        self.conn = None
                        verdict = self.primary.channel_closed(now)
            verdict = verdict or self.primary.check(time.monotonic())
            if verdict is not None and self.stopping:  # scancel: everything ends; the primary's exit ends us
                verdict = None
            if verdict is not None and verdict.fence and self._outcome() is not None:
                self.primary.ending(time.monotonic())  # it ends the job: silent or gone on purpose
                verdict = None
            if self.primary.state is succession.State.ENDING:  # its shutdown gets END_WAIT_S, bounded
                self.ended_at = self.ended_at or time.monotonic()
                if time.monotonic() - self.ended_at > END_WAIT_S and self.controller[1].poll() is None:
                    log.warning("controller still running %.0fs after it ended the job; killing its step", END_WAIT_S)
                    self.controller[1].kill()
            if verdict is not None and not self._promote(verdict):
                return 1
            for msg in self.launches.due(time.monotonic()):
                self._launch(msg)
            self._watch_successor()
            self._report_exits()
            self.retired = [p for p in self.retired if p.poll() is None]
            time.sleep(0.02)

    def _primary_exit(self, now: float):
        """The primary's step ended: the job's exit code (it ended the job), or a promotion."""
        code = self.controller[1].returncode
        final = self._final_code(code)
        if final is None and self.stopping:
            final = code
        return self.primary.exited(now, code, final)

    def _final_code(self, code: int) -> int | None:
        """The job's exit code if the controller ended the job for good, else None (it moved,
        crashed, or its node failed: srun may then exit 0, so its code alone cannot say)."""
        final = self._outcome()
        if final is None and code == 2:  # a configuration or journal error: no other node helps
            final = 2
        return final

    def _watch_successor(self) -> None:
        """A successor whose step ended (its node left the job or died) is started again elsewhere."""
        for home, proc in [x for x in self.successors if x[1].poll() is not None]:
            log.warning("warm successor on %s ended (srun exit code %s)", home, proc.returncode)
            self.successors.remove((home, proc))
        if len(self.successors) < self.cfg.controller_successors and self.primary.state is succession.State.SERVING:
            self._start_successor()

    def _outcome(self) -> int | None:
        """The job's exit code if a controller ended it for good, else None: status.json's outcome
        (written last at its shutdown: 0 trained, 1 stopped with an error) or, before that is
        written, the journal's `end` (written first: a controller that ended the job and then
        died or hung in its shutdown is never replaced)."""
        self._read_key()
        outcome = records.read_outcome(self.at / "status.json", self.key)  # sealed with the job's key, or None
        if outcome:
            return 0 if outcome["ok"] else 1
        end = journal.ended(self.at / "journal.jsonl", self.key)
        return None if end is None else (0 if end["ok"] else 1)

    def _finish(self, code: int) -> int:
        """The controller ended for good: let the remaining steps end (bounded), then end too. A
        step on a node that left the job (a lost node, released) has no process to wait for: its
        srun may wait on a dead slurmd for minutes."""
        successors, self.successors = self.successors, []
        for _, proc in successors:  # EOF on its stdin: it exits (waited for below)
            try:
                proc.stdin.close()
            except OSError:
                pass
        # A standby holds nothing of the job's: its step ends now. One launched just before the end
        # never reached the controller and would wait TM_GROUP_TIMEOUT_S for it (seen: the job's
        # end 60 s after a user's error).
        for node in [n for n, (role, _) in self.steps.items() if role == "standby"]:
            self.steps.pop(node)[1].kill()
        try:
            nodes = set(self.slurm.job(self.job_id).nodes)
            for node in [n for n in self.steps if n not in nodes]:
                self.steps.pop(node)[1].kill()
        except TrainMoverError as exc:
            log.warning("could not read the job's nodes at the end: %s", exc)
        deadline = time.monotonic() + 60
        while self.steps and time.monotonic() < deadline:
            self._report_exits()
            time.sleep(0.2)
        for node, (role, proc) in self.steps.items():
            log.warning("%s step on %s still running at the end; killing its srun", role, node)
            proc.kill()
        for proc in self.retired + [proc for _, proc in successors]:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        return code


def _read(conn, inbox: queue.Queue) -> None:
    """The keeper's reader thread: frames from the controller into `inbox`, None at the end."""
    try:
        while True:
            msg = conn.framer.recv()
            if msg is None:
                break
            inbox.put(msg)
    except (OSError, ProtocolError) as exc:
        log.info("channel to the controller lost: %s", exc)
    inbox.put(None)




def sbatch_args(training_nodes: int) -> list[str]:
    """sbatch options for a job of `training_nodes` training nodes and one keeper node (what the
    templates' #SBATCH lines say, for scripts and tests that set the size on the command line)."""
    return [f"--nodes={training_nodes + 1}", f"--constraint=[{KEEPER_FEATURE}*1&{TRAIN_FEATURE}*{training_nodes}]",
            f"--batch={KEEPER_FEATURE}"]


def start_reading(slurm, job_id: int, node: str, environ, work_dir: str) -> tuple | None:
    """The batch script's first look at its job: its nodes from the allocation Slurm gave it
    (SLURM_JOB_NODELIST: the job has not been resized yet), their states and features in one
    query. (job, infos), or None when the environment does not say (then ask Slurm)."""
    here = JobEnv.read(environ)
    nodes = here.allocation()
    if node not in nodes:
        return None
    job = JobInfo(job_id, "RUNNING", nodes, node, 0, work_dir, here.partition, len(nodes), nodelist=here.nodelist)
    return job, slurm.nodes(list(nodes))


def is_keeper(slurm, node: str) -> bool:
    """Whether `node` is a keeper node (Slurm feature tm_keeper): there the batch script keeps
    the job's steps and the controller runs on a training node."""
    info = slurm.nodes([node]).get(node)
    return info is not None and KEEPER_FEATURE in info.features


def main(cfg: Config, slurm, job_id: int, node: str, reading: tuple | None = None) -> int:
    keeper = Keeper(cfg, slurm, job_id, node, reading=reading)

    def stop(signum, _frame):  # scancel: Slurm signals every step too; end when the controller does
        keeper.stopping = True
        home, proc = keeper.controller or (None, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = keeper.run()
    # Whatever ended the job, a standby request must not hold a spare after it (seen on 24.11).
    # The controller withdraws its own as it ends, but one it had under way can be granted a
    # moment later (seen in CI: a donor granted in the second its controller ended held spare1
    # for the rest of the suite); the keeper ends after it, so it looks once more.
    try:
        gone = slurm.cancel_donors(job_id)
        if gone:
            log.warning("withdrew donor allocation(s) %s the controller left", gone)
    except TrainMoverError as exc:
        log.warning("could not withdraw the job's donor allocations: %s", exc)
    # The job's last word in slurm-<job>.out, however it ended (records.final_line).
    print(records.final_line(keeper.at, job_id, code, keeper.why, stopped=keeper.stopping, shown=keeper.root),
          file=sys.stderr, flush=True)
    return code
