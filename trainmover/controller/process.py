"""The controller process (`python -m trainmover.controller.process`), started by
`controller.supervisor` (`trainmover controller`): its arguments, then the executor
(controller/executor.py) until the job ends or it moves; the exit code says which
(controller/exit_codes.py)."""
from __future__ import annotations

import logging
import os
import socket
import sys

from trainmover.config import Config
from trainmover.controller.executor import Controller
from trainmover.controller.exit_codes import CRASHED, REFUSED
from trainmover.errors import ConfigError, TrainMoverError
from trainmover.logs import setup_logging
from trainmover.protocol import files
from trainmover.slurm.backends import client
from trainmover.slurm.job_env import JobEnv
from trainmover.workloads import registry

log = logging.getLogger("trainmover.controller")
OPEN_FILES_CAP = 1 << 20  # where the hard limit is unlimited: more than any job's ranks


def raise_open_files_limit() -> int:
    """The controller holds a connection per rank (and the store a client per rank): at 1,024
    ranks the common soft limit of 1,024 open files made accept() fail with EMFILE and the
    controller crash (issue 38's 128-node run). Raised to the hard limit, which an unprivileged
    process may do; returns the soft limit now."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES_CAP if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return want
    return soft


def main(argv=None) -> int:
    """One controller process, started by `controller.supervisor` (`trainmover controller`)."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m trainmover.controller.process")
    files.private_umask()  # the job's files are its user's alone (docs/security.md)
    p.add_argument("--listen-fd", type=int, help="the supervisor's listening control socket")
    p.add_argument("--store", help="host:port of the supervisor's rendezvous store")
    p.add_argument("--attempt", type=int, default=0, help="0 for the first controller, n for the n-th restart")
    p.add_argument("--resume", action="store_true", help="take over from the journal of a controller that died")
    p.add_argument("--spare-fd", type=int, help="a pre-started spare: wait for the attempt number on this pipe "
                                                "(EOF: not needed), then resume")
    p.add_argument("--keeper", help="the job's keeper node, which runs the steps (controller/succession/keeper.py)")
    p.add_argument("--run-dir", help="the job's run directory, as the supervisor found it (a predecessor's "
                                     "hand-over record is there: controller/durable/handover.py)")
    args = p.parse_args(argv)
    setup_logging()
    log.info("open files: up to %d (one connection per rank)", raise_open_files_limit())
    cfg = Config.from_env()
    # the Slurm client before a spare waits: with pyslurm its process starts now (an
    # interpreter and libslurm: seconds on a busy node), off the takeover's path
    try:
        slurm = client(cfg.slurm_backend, node_query=cfg.node_query)
    except TrainMoverError as exc:  # pyslurm that cannot load here: restarting cannot help
        log.error("controller: %s", exc)
        return REFUSED
    # The workload loaded now (its module imports torch: seconds), before a spare waits: off the
    # takeover's path. One that does not load fails in the Controller below, as it would there.
    try:
        workload = registry.load(cfg.workload, cfg.workload_kwargs())
    except Exception:  # noqa: BLE001 - raised again, and reported, by the Controller's own load
        workload = None
    if args.spare_fd is not None:  # imports are done: a takeover costs only the journal and Slurm queries
        log.info("controller pid %d warm (imports done): waiting to take over", os.getpid())
        with os.fdopen(args.spare_fd, "rb") as pipe:
            word = pipe.readline().strip()
        if not word:
            return 0
        args.attempt, args.resume = int(word), True
    job_id = JobEnv.read().require_job("trainmover controller")
    listen = socket.socket(fileno=args.listen_fd) if args.listen_fd is not None else None
    store = None
    if args.store:
        host, _, port = args.store.rpartition(":")
        store = (host, int(port))
    try:
        return Controller(cfg, job_id, listen=listen, store=store, resume=args.resume, attempt=args.attempt,
                          keeper=args.keeper, slurm=slurm, run_dir=args.run_dir, workload=workload).run()
    except TrainMoverError as exc:  # a clear error (config, corrupt journal): restarting cannot help
        log.error("controller: %s", exc)
        return REFUSED
    except Exception:  # noqa: BLE001 - a bug or a lost dependency: the supervisor may restart from the journal
        log.exception("controller crashed")
        return CRASHED


if __name__ == "__main__":
    sys.exit(main())
