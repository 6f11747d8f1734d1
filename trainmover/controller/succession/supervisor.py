"""The controller's supervisor: the batch step's process (a job without a keeper node), or the
step the keeper runs on the controller's home node (controller/succession/keeper.py). It keeps what must
outlive a controller on its node and restarts the controller there when it dies.

It holds, for the whole job:
  * the control socket the ranks connect to (passed to each controller as a file
    descriptor), so a restarted controller is at the same address and connections made
    while none runs wait in the socket's backlog;
  * the rendezvous store (TCPStore) that ranks use to build groups and hand state over, so
    that a migration's Phase 1 and state copy are not cut by the controller's death.

It runs the controller (`python -m trainmover.controller.process`) as a child. When the child
dies abnormally (a signal such as SIGKILL or an OOM kill, or a crash: exit code 70) it hands
over to a new one with `--resume`, which rebuilds the job's view from the journal; at most
`TM_CONTROLLER_RESTARTS` times. The next controller is pre-started as an idle spare (its
imports, seconds on a busy node, are done before it is needed) and told to take over through
a pipe. An ordinary end (0: training finished; 1: the job stopped
with a reported error; 2: a configuration or journal error) is final, and so is MOVED (3: its
node leaves the job; the keeper starts the controller on another node, resuming), and so is
any end after the controller journaled the job's `end` (journal.ended), whatever its code:
a controller that ended the job on purpose is never started again.
"""
from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from trainmover.config import Config
from trainmover.controller.durable import journal, records
from trainmover.controller.exit_codes import FAILED, FINISHED, MOVED, REFUSED, SUPERSEDED
from trainmover.errors import ConfigError, ProtocolError, TrainMoverError
from trainmover.logs import setup_logging
from trainmover.protocol import channel, files
from trainmover.slurm.job_env import JobEnv

log = logging.getLogger("trainmover.supervisor")

FINAL = {FINISHED: "training finished", FAILED: "the job stopped with an error", REFUSED: "a configuration or journal error",
         MOVED: "its node leaves the job: the controller moves to another node",
         SUPERSEDED: "another controller took the job over (it claimed the journal)"}


def restart_decision(code: int, restarts_done: int, limit: int, stopping: bool,
                     ended: dict | None = None) -> tuple[bool, str]:
    """Whether to start another controller after one exited with `code` (negative: killed by
    that signal). `ended`: the journal's `end` record, if the controller ended the job. Pure."""
    if stopping:
        return False, "the job is being stopped"
    if ended is not None:
        return False, f"the controller ended the job: {ended['message'][:300]}"
    if code in FINAL:
        return False, FINAL[code]
    why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"crashed (exit code {code})"
    if restarts_done >= limit:
        return False, f"controller {why}; no restart left (TM_CONTROLLER_RESTARTS={limit})"
    return True, f"controller {why}; restart {restarts_done + 1} of {limit} from the journal"


def _refused(root: Path, job_id: int, exc: Exception, last_line: bool, shown: Path | None = None) -> int:
    """The job cannot start (the workload does not construct, a bad option): said in status.json,
    with the user's traceback where it was theirs, and in the batch script's last line."""
    from trainmover.runtime.usercode import UserCodeError
    user = isinstance(exc, UserCodeError)
    message = (f"user code raised constructing the workload: {exc.error}" if user
               else f"the job did not start: {exc}")
    log.error("%s%s", message, f"\n{exc.traceback.rstrip()}" if user else "")
    root.mkdir(parents=True, exist_ok=True)
    records.write_json(root / "status.json", {
        "job_id": job_id, "outcome": {"ok": False, "message": message},
        "failure": {"rank": None, "node": JobEnv.read().node, "step": 0, "phase": "construction",
                    "user": user, "error": exc.error if user else str(exc)[:1000],
                    "traceback": exc.traceback if user else ""}})
    if last_line:
        print(records.final_line(root, job_id, REFUSED, shown=shown), file=sys.stderr, flush=True)
    return REFUSED


def _bind(host: str) -> socket.socket:
    return socket.create_server((host, 0), backlog=1024)


def _key(at: Path) -> bytes | None:
    """The job's secret if a controller made it (journal.ended believes only records sealed with it)."""
    try:
        return channel.read_secret(str(at / "secret"))
    except ProtocolError:
        return None


def main(argv=None) -> int:
    """`python -m trainmover.controller.succession.supervisor [--keeper NODE] [--resume --attempt N]`: as a
    step the keeper runs (a successor resumes from the journal), or from `trainmover controller`."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m trainmover.controller.succession.supervisor")
    p.add_argument("--keeper", help="the job's keeper node (it runs no rank)")
    p.add_argument("--resume", action="store_true", help="take the job over from the journal")
    p.add_argument("--attempt", type=int, default=0, help="controllers of this job before this one")
    p.add_argument("--successor", action="store_true",
                   help="a warm successor (controller/succession/keeper.py): bind, start the controller idle, and take the job "
                        "over on `takeover <attempt>` read from stdin (EOF: not needed, exit 0)")
    p.add_argument("--work-dir", help="the job's working directory (the keeper read it from Slurm: not asked again)")
    p.add_argument("--node-addr", help="this node's address (the keeper read it from Slurm: not asked again)")
    args = p.parse_args(argv)
    files.private_umask()  # the job's files are its user's alone (docs/security.md)
    setup_logging()
    job_id = JobEnv.read().require_job("trainmover controller")
    cfg = Config.from_env()
    from trainmover.controller.preflight import preflight
    from trainmover.runtime.usercode import user_code
    from trainmover.slurm.backends import client
    slurm = client(cfg.slurm_backend, node_query=cfg.node_query)  # tm_nodes: one RPC a node query, not two
    log.info("Slurm backend: %s (TM_SLURM_BACKEND)", cfg.slurm_backend)
    # Started by the keeper, which read the job and this node just before: asking slurmctld again
    # would spend two more of the user's tokens on each start (docs/admin.md, "Load on slurmctld").
    job = None if args.work_dir and args.node_addr else slurm.job(job_id)
    work_dir = args.work_dir or job.work_dir
    # verified first: a run directory someone else planted (with a final.json saying "done") is refused
    root = files.private_dir(Path(cfg.run_dir or records.run_dir(work_dir or os.getcwd(), job_id)))
    at = files.held_dir(root)  # read through: a `runs/` another user swaps in mid-job is never read
    try:
        with user_code("construction"):  # constructing the workload runs the user's code
            preflight(cfg)  # options the workload does not take, TM_CHECK_WORKLOAD: before anything starts
    except TrainMoverError as exc:  # it would fail the same on any node: final (2), never restarted
        return _refused(at, job_id, exc, last_line=not args.keeper, shown=root)
    import torch.distributed as dist
    done = records.completed_before(at, job_id, cfg.steps)
    if done:
        log.warning("%s", done)
        return 0
    me = JobEnv.read().node or (job.batch_host or job.nodes[0] if job else "")
    host = args.node_addr or slurm.nodes([me])[me].addr  # our node's own address, from Slurm
    listen = _bind(host)
    store_sock = _bind(host)
    store_port = store_sock.getsockname()[1]
    store = dist.TCPStore(host, store_port, is_master=True, wait_for_workers=False,  # noqa: F841 - serves the job
                          timeout=datetime.timedelta(seconds=cfg.group_timeout_s),
                          master_listen_fd=store_sock.detach(), use_libuv=False)
    child: subprocess.Popen | None = None
    stopping = False

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    base = [sys.executable, "-m", "trainmover.controller.process", "--listen-fd", str(listen.fileno()),
            "--store", f"{host}:{store_port}", "--run-dir", str(root)] + (["--keeper", args.keeper] if args.keeper else [])

    def start_spare(force=False):
        # With a keeper, the warm successor on another node is the spare (controller/succession/keeper.py):
        # the keeper alone decides who takes over, so no local restart races it.
        if not force and (cfg.controller_restarts == 0 or args.keeper):
            return None
        r, w = os.pipe()
        proc = subprocess.Popen(base + ["--spare-fd", str(r)], pass_fds=(listen.fileno(), r))
        os.close(r)
        return proc, w

    restarts = args.attempt
    if args.successor:
        child, w = start_spare(force=True)
        log.info("warm successor on %s: controller pid %d waits for the keeper's word", me, child.pid)
        word = sys.stdin.readline().split()  # blocks for the job's life; EOF when the keeper ends it
        if word[:1] != ["takeover"] or len(word) != 2 or not word[1].isdigit():
            os.close(w)  # EOF: the idle controller exits
            child.wait(timeout=30)
            return 0
        restarts = int(word[1])
        log.info("warm successor on %s takes over (attempt %d)", me, restarts)
        os.write(w, f"{restarts}\n".encode())
        os.close(w)
    else:
        child = subprocess.Popen(base + ["--attempt", str(restarts)] + (["--resume"] if args.resume else []),
                                 pass_fds=(listen.fileno(),))
    spare = start_spare()
    try:
        while True:
            t0 = time.time()
            log.info("controller running (pid %d, attempt %d)", child.pid, restarts)
            code = child.wait()
            ended = journal.ended(at / "journal.jsonl", _key(at))
            again, why = restart_decision(code, restarts, cfg.controller_restarts, stopping, ended)
            log.log(logging.INFO if code == 0 else logging.WARNING,
                    "controller pid %d ended after %.1fs: %s", child.pid, time.time() - t0, why)
            if not again or spare is None:
                if ended is not None and code not in FINAL:  # it ended the job, then died in its shutdown
                    code = 0 if ended["ok"] else 1
                code = code if code >= 0 else 128 - code
                if not args.keeper and code != MOVED:  # the batch step itself: the job's last line
                    print(records.final_line(at, job_id, code, why, stopped=stopping, shown=root),
                          file=sys.stderr, flush=True)
                return code
            restarts += 1
            child, w = spare
            try:
                os.write(w, f"{restarts}\n".encode())
            except OSError:  # the spare died meanwhile: a cold start then
                log.warning("spare controller pid %d is gone; starting one cold", child.pid)
                child = subprocess.Popen(base + ["--attempt", str(restarts), "--resume"], pass_fds=(listen.fileno(),))
            os.close(w)
            spare = start_spare() if restarts < cfg.controller_restarts else None
    finally:
        if spare is not None:  # EOF: the spare exits
            os.close(spare[1])
            try:  # it reads the pipe only once its imports are done (seconds on a busy node): the
                spare[0].wait(timeout=1)  # job's end does not wait for them, and it holds nothing
            except subprocess.TimeoutExpired:
                spare[0].kill()
                spare[0].wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
