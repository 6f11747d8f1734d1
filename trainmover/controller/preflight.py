"""What the batch step checks before any rank starts: the workload loads with the options the
user set (an unknown one is an error naming it), and with TM_CHECK_WORKLOAD=1 a migration of
it would be exact (`trainmover check-workload`, on this node's CPUs)."""
from __future__ import annotations

import logging

from trainmover.config import Config
from trainmover.errors import ConfigError
from trainmover.workloads import registry

log = logging.getLogger("trainmover.preflight")


def preflight(cfg: Config, run_check=None) -> None:
    """Raise ConfigError, with the reason, when the job must not start. `run_check`: the check
    (trainmover.check.run.run_check; a parameter for tests)."""
    registry.load(cfg.workload, cfg.workload_kwargs())
    if not cfg.check_workload:
        return
    if run_check is None:
        from trainmover.check.run import run_check
    log.info("TM_CHECK_WORKLOAD=1: checking that a migration of %s would be exact (%d steps compared)",
             cfg.workload, cfg.check_steps)
    report = run_check(cfg.workload, cfg.workload_kwargs(), steps=cfg.check_steps, seed=cfg.seed,
                       timeout_s=max(cfg.group_timeout_s, 300.0))
    if report.exact:
        log.info("%s", report.text())
    else:  # the report goes out once, in the error
        raise ConfigError("TM_CHECK_WORKLOAD=1: a migration of this workload would not be exact; not starting.\n"
                          + report.text())
