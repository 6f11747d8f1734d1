"""The job's keeper: the batch script's process on the job's keeper node (docs/admin.md, "No special
node").

Slurm never releases the node that runs a job's batch script, and a step ends with the `srun` that
launched it. So a job asks for one small keeper node besides its training nodes (`sbatch
--constraint="[tm_keeper*1&...]" --batch=tm_keeper`), and its batch script runs this process
there, which:

* runs the controller as a step on a training node (its "home"), and starts it again on another
  one when it moves away (exit code MOVED: its home is leaving the job) or is lost (its step ended
  abnormally, or it stopped answering: fenced with SIGKILL first); each successor resumes from the
  journal on the shared run directory;
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
import sys
import threading
import time
from pathlib import Path

from trainmover.config import Config
from trainmover.control import channel, endpoint, files
from trainmover.control.messages import make
from trainmover.controller import records
from trainmover.controller.steps import start_srun, step_environment
from trainmover.errors import ProtocolError, TrainMoverError

log = logging.getLogger("trainmover.keeper")

CONTROLLER_STEP = "tm-controller"  # the controller's step name (kill_steps picks it by name)
MOVED = 3            # the controller's exit code when its home leaves the job (controller/main.py)
PROBE_S = 1.0        # the keeper asks the controller for its status this often
LOST_AFTER = 3       # unanswered probes in a row: the controller is lost
START_DEADLINE_S = 120.0  # a controller that never writes its endpoint is lost too


def choose_home(candidates: list[str], avoid: set[str], states: dict[str, str]) -> str | None:
    """The next controller's node: the first candidate neither avoided nor draining or down
    (pure). `states`: Slurm's word for each node."""
    for node in candidates:
        state = states.get(node, "")
        if node not in avoid and "DRAIN" not in state and not state.startswith(("DOWN", "FAIL")):
            return node
    return None


class Keeper:
    def __init__(self, cfg: Config, slurm, job_id: int, node: str, environ=os.environ):
        self.cfg, self.slurm, self.job_id, self.node = cfg, slurm, job_id, node
        self.environ = dict(environ)
        job = slurm.job(job_id)
        # the job's user's alone; one someone else made first is refused (control/files.py)
        self.root = files.private_dir(Path(cfg.run_dir or records.run_dir(job.work_dir or os.getcwd(), job_id)))
        self.key: bytes | None = None  # the job's secret: read once, when the controller has made it
        self.steps: dict[str, tuple[str, object]] = {}  # node -> (role, Popen)
        self.controller = None          # (node, Popen) of the controller's step
        self.attempt = 0
        self.conn = None
        self.inbox: queue.Queue = queue.Queue()
        self.stopping = False
        self.misses = 0
        self.unreported: list[dict] = []  # step ends no controller has heard of yet

    # --- the controller's step ----------------------------------------------------------
    def _start_controller(self, home: str, resume: bool) -> None:
        argv = [sys.executable, "-m", "trainmover.controller.supervisor", "--keeper", self.node]
        if resume:
            argv += ["--resume", "--attempt", str(self.attempt)]
        env = self.slurm.step_env(self.slurm.job(self.job_id), self.environ)
        srun = self.slurm.step_argv(self.job_id, home, argv, ntasks=1, name=CONTROLLER_STEP)
        proc = start_srun(srun, env, None)  # the job's output file, as without a keeper
        self.controller = (home, proc)
        self.started_at, self.misses, self.conn, self.lost_at = time.monotonic(), 0, None, None
        log.info("controller started on %s (attempt %d%s)", home, self.attempt, ", resuming" if resume else "")

    def _fence(self, node: str) -> None:
        try:
            self.slurm.kill_steps(self.job_id, node, names=(CONTROLLER_STEP,))
        except TrainMoverError as exc:
            log.warning("could not kill the lost controller's step on %s: %s", node, exc)

    def _next_home(self, avoid: set[str]) -> str | None:
        job = self.slurm.job(self.job_id)
        candidates = [n for n in job.nodes if n != self.node]
        states = {n: i.state for n, i in self.slurm.nodes(candidates).items()}
        return choose_home(candidates, avoid, states)

    def _replace_controller(self, why: str) -> bool:
        """Start a successor elsewhere; False when there is nowhere or no restart left."""
        old, proc = self.controller
        if proc.poll() is None:  # lost but running (frozen, cut off): it must never act again
            proc.kill()  # its srun: Slurm ends the step (its node may not hear of it: fenced below)
            # Slurm may wait on a dead node's slurmd for seconds: not before the successor starts.
            threading.Thread(target=self._fence, args=(old,), name="tm-fence-controller", daemon=True).start()
        if self.attempt >= self.cfg.controller_restarts and why != "moved":
            log.error("controller on %s %s; no restart left (TM_CONTROLLER_RESTARTS=%d)", old, why,
                      self.cfg.controller_restarts)
            return False
        home = self._next_home({old})
        if home is None:
            log.error("controller on %s %s, and no other node of the job can take it", old, why)
            return False
        self.attempt += 1
        log.warning("controller on %s %s: resuming it on %s", old, why, home)
        self._start_controller(home, resume=True)
        return True

    # --- the channel to the controller ----------------------------------------------------
    def _connect(self) -> None:
        if self.key is None:
            if not (self.root / "secret").exists():
                return  # the first controller has not made it yet
            try:
                self.key = channel.read_secret(str(self.root / "secret"))
            except ProtocolError as exc:
                log.error("%s", exc)
                return
        ep = endpoint.read(self.root / endpoint.NAME, self.key)
        if ep is None or ep.node != self.controller[0]:
            return  # the new controller has not written where it is yet
        try:
            self.conn = channel.connect(ep.address, self.key, make("hello", role="keeper", node=self.node, ranks=[],
                                                             pid=os.getpid()), timeout=2.0, source=None)
            self.conn.send(make("steps", running={n: role for n, (role, p) in self.steps.items()}))
            for msg in self.unreported:  # ends while no controller ran: its successor must know
                self.conn.send(msg)
            self.unreported = []
            self.inbox = queue.Queue()
            threading.Thread(target=_read, args=(self.conn, self.inbox), name="tm-keeper-reader", daemon=True).start()
            self.lost_at = None
            log.info("connected to the controller on %s", ep.node)
        except (TrainMoverError, OSError) as exc:
            log.info("controller on %s not reachable yet: %s", self.controller[0], exc)
            self.conn = None

    def _serve(self) -> None:
        """What the controller sent: launches to run; any frame (a reply to a probe) proves it alive."""
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if msg is None:
                self._lost_channel()
                return
            self.misses = 0
            if msg["type"] == "launch":
                self._launch(msg)
            elif msg["type"] == "bye":
                log.info("controller says bye: %s", msg["reason"])

    def _lost_channel(self) -> None:
        self.conn = None
        if self.lost_at is None:
            self.lost_at = time.monotonic()

    def _launch(self, msg: dict) -> None:
        node, role = msg["node"], msg["role"]
        log_path = Path(msg["log"])
        if log_path.resolve().parent != self.root.resolve():  # an authenticated controller of this job writes only there
            log.error("launch of %s on %s refused: its log %s is outside the run directory", role, node, log_path)
            return
        self.steps[node] = (role, start_srun(msg["argv"], step_environment(msg["env"]), log_path))
        log.info("launched %s on %s for the controller", role, node)

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
                if self.conn is not None:
                    self._lost_channel()
                self.unreported.append(msg)  # sent to the next controller that connects

    # --- the loop -----------------------------------------------------------------------
    def run(self) -> int:
        home = self._next_home(set())
        if home is None:
            log.error("job %d has no node besides the keeper %s to run the controller on", self.job_id, self.node)
            return 2
        self._start_controller(home, resume=False)
        next_probe = 0.0
        while True:
            home, proc = self.controller
            code = proc.poll()
            if code is not None:
                final = self._outcome()
                if final is None and code == 2:  # a configuration or journal error: no other node helps
                    final = 2
                if final is not None or self.stopping:
                    return self._finish(final if final is not None else code)
                # No outcome written: it moved (MOVED), crashed, or its node failed (srun may
                # then exit 0: its code alone cannot say the job ended).
                if self._replace_controller("moved" if code == MOVED else f"ended (srun exit code {code}) "
                                            "without an outcome"):
                    continue
                return 1
            if self.conn is None:
                self._connect()
                if self.conn is None and self.lost_at is not None and time.monotonic() - self.lost_at > LOST_AFTER * PROBE_S:
                    # its channel broke and nobody answers at its address: its node died or is cut
                    # off (a crashed controller is back at the same address within a second)
                    if not self._replace_controller(f"unreachable for {LOST_AFTER * PROBE_S:.0f}s"):
                        return 1
                    continue
                if self.conn is None and time.monotonic() - self.started_at > START_DEADLINE_S:
                    if not self._replace_controller(f"never answered within {START_DEADLINE_S:.0f}s"):
                        return 1
                    continue
            else:
                self._serve()
                if self.conn is not None and time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + PROBE_S
                    self.misses += 1  # any frame from it resets this
                    try:
                        self.conn.send(make("status"))
                    except OSError:
                        self._lost_channel()
                    if self.misses > LOST_AFTER:
                        if not self._replace_controller(f"did not answer for {LOST_AFTER * PROBE_S:.0f}s"):
                            return 1
                        continue
            self._report_exits()
            time.sleep(0.05)

    def _outcome(self) -> int | None:
        """The job's exit code if a controller ended it for good (status.json's outcome, written
        last at its shutdown: 0 trained, 1 stopped with an error), else None."""
        try:
            outcome = json.loads((self.root / "status.json").read_text()).get("outcome")
        except (OSError, ValueError):
            return None
        return None if not outcome else (0 if outcome.get("ok") else 1)

    def _finish(self, code: int) -> int:
        """The controller ended for good: let the remaining steps end (bounded), then end too. A
        step on a node that left the job (a lost node, released) has no process to wait for: its
        srun may wait on a dead slurmd for minutes."""
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


KEEPER_FEATURE = "tm_keeper"
TRAIN_FEATURE = "tm_train"


def sbatch_args(training_nodes: int) -> list[str]:
    """sbatch options for a job of `training_nodes` training nodes and one keeper node (what the
    templates' #SBATCH lines say, for scripts and tests that set the size on the command line)."""
    return [f"--nodes={training_nodes + 1}", f"--constraint=[{KEEPER_FEATURE}*1&{TRAIN_FEATURE}*{training_nodes}]",
            f"--batch={KEEPER_FEATURE}"]


def is_keeper(slurm, node: str) -> bool:
    """Whether `node` is a keeper node (Slurm feature tm_keeper): there the batch script keeps
    the job's steps and the controller runs on a training node."""
    info = slurm.nodes([node]).get(node)
    return info is not None and KEEPER_FEATURE in info.features


def main(cfg: Config, slurm, job_id: int, node: str) -> int:
    keeper = Keeper(cfg, slurm, job_id, node)

    def stop(signum, _frame):  # scancel: Slurm signals every step too; end when the controller does
        keeper.stopping = True
        home, proc = keeper.controller or (None, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return keeper.run()
