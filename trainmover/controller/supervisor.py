"""The controller's supervisor: the batch step's process (a job without a keeper node), or the
step the keeper runs on the controller's home node (controller/keeper.py). It keeps what must
outlive a controller on its node and restarts the controller there when it dies.

It holds, for the whole job:
  * the control socket the ranks connect to (passed to each controller as a file
    descriptor), so a restarted controller is at the same address and connections made
    while none runs wait in the socket's backlog;
  * the rendezvous store (TCPStore) that ranks use to build groups and hand state over, so
    that a migration's Phase 1 and state copy are not cut by the controller's death.

It runs the controller (`python -m trainmover.controller.main`) as a child. When the child
dies abnormally (a signal such as SIGKILL or an OOM kill, or a crash: exit code 70) it hands
over to a new one with `--resume`, which rebuilds the job's view from the journal; at most
`TM_CONTROLLER_RESTARTS` times. The next controller is pre-started as an idle spare (its
imports, seconds on a busy node, are done before it is needed) and told to take over through
a pipe. An ordinary end (0: training finished; 1: the job stopped
with a reported error; 2: a configuration or journal error) is final, and so is MOVED (3: its
node leaves the job; the keeper starts the controller on another node, resuming).
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
from trainmover.controller import records
from trainmover.errors import ConfigError

log = logging.getLogger("trainmover.supervisor")

MOVED = 3
FINAL = {0: "training finished", 1: "the job stopped with an error", 2: "a configuration or journal error",
         MOVED: "its node leaves the job: the controller moves to another node"}


def restart_decision(code: int, restarts_done: int, limit: int, stopping: bool) -> tuple[bool, str]:
    """Whether to start another controller after one exited with `code` (negative: killed by
    that signal). Pure."""
    if stopping:
        return False, "the job is being stopped"
    if code in FINAL:
        return False, FINAL[code]
    why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"crashed (exit code {code})"
    if restarts_done >= limit:
        return False, f"controller {why}; no restart left (TM_CONTROLLER_RESTARTS={limit})"
    return True, f"controller {why}; restart {restarts_done + 1} of {limit} from the journal"


def _bind(host: str) -> socket.socket:
    return socket.create_server((host, 0), backlog=1024)


def main(argv=None) -> int:
    """`python -m trainmover.controller.supervisor [--keeper NODE] [--resume --attempt N]`: as a
    step the keeper runs (a successor resumes from the journal), or from `trainmover controller`."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m trainmover.controller.supervisor")
    p.add_argument("--keeper", help="the job's keeper node (it runs no rank)")
    p.add_argument("--resume", action="store_true", help="take the job over from the journal")
    p.add_argument("--attempt", type=int, default=0, help="controllers of this job before this one")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("TM_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        job_id = int(os.environ["SLURM_JOB_ID"])
    except (KeyError, ValueError):
        raise ConfigError("trainmover controller runs inside a Slurm job (SLURM_JOB_ID is not set)") from None
    cfg = Config.from_env()
    from trainmover.controller.preflight import preflight
    preflight(cfg)  # options the workload does not take, TM_CHECK_WORKLOAD: before anything starts
    import torch.distributed as dist
    from trainmover.slurm.client import CliSlurm
    slurm = CliSlurm(node_query=cfg.node_query)  # tm_nodes: one RPC a node query, not two
    job = slurm.job(job_id)
    done = records.completed_before(Path(cfg.run_dir or records.run_dir(job.work_dir or os.getcwd(), job_id)),
                                    job_id, cfg.steps)
    if done:
        log.warning("%s", done)
        return 0
    me = os.environ.get("SLURMD_NODENAME") or job.batch_host or job.nodes[0]
    host = slurm.nodes([me])[me].addr  # our node's own address, from Slurm
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
    base = [sys.executable, "-m", "trainmover.controller.main", "--listen-fd", str(listen.fileno()),
            "--store", f"{host}:{store_port}"] + (["--keeper", args.keeper] if args.keeper else [])

    def start_spare():
        if cfg.controller_restarts == 0:
            return None
        r, w = os.pipe()
        proc = subprocess.Popen(base + ["--spare-fd", str(r)], pass_fds=(listen.fileno(), r))
        os.close(r)
        return proc, w

    restarts = args.attempt
    child = subprocess.Popen(base + ["--attempt", str(restarts)] + (["--resume"] if args.resume else []),
                             pass_fds=(listen.fileno(),))
    spare = start_spare()
    try:
        while True:
            t0 = time.time()
            log.info("controller running (pid %d, attempt %d)", child.pid, restarts)
            code = child.wait()
            again, why = restart_decision(code, restarts, cfg.controller_restarts, stopping)
            log.log(logging.INFO if code == 0 else logging.WARNING,
                    "controller pid %d ended after %.1fs: %s", child.pid, time.time() - t0, why)
            if not again or spare is None:
                return code if code >= 0 else 128 - code
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
            try:
                spare[0].wait(timeout=30)
            except subprocess.TimeoutExpired:
                spare[0].kill()


if __name__ == "__main__":
    sys.exit(main())
