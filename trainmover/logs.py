"""The one logging set-up of TrainMover's processes: controller, supervisor, keeper, rank
processes and the node reader. Lines go to stderr (the process's Slurm step log) at
`TM_LOG_LEVEL` (trainmover/config.py), each with its time and logger name."""
from __future__ import annotations

import logging
import sys

from trainmover import config
from trainmover.errors import ConfigError


def setup_logging(node: str | None = None) -> None:
    """Configures the root logger once per process (a second call changes nothing, as
    logging.basicConfig does). `node`: named in every line after the logger's name, for a
    rank process, whose lines a user reads next to other nodes'."""
    level = config.setting("TM_LOG_LEVEL").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ConfigError(f"TM_LOG_LEVEL={level!r}: expected a logging level name (DEBUG, INFO, WARNING, ERROR)")
    who = "%(name)s" if node is None else f"%(name)s[{node}]"
    logging.basicConfig(level=level, format=f"%(asctime)s {who} %(message)s", stream=sys.stderr)
