"""`trainmover check-workload WORKLOAD [--steps N] [--ranks N] [--timeout S] [--json]`.

The workload's options come from the same variables as in a job (TM_MODEL, TM_TP/TM_PP/TM_DP,
TM_DISTRIBUTED_OPTIMIZER, TM_WORKLOAD_OPTIONS, TM_SEED), so that what is checked is what
runs. Exit status: 0 when a migration would be exact, 1 when not, 2 on a configuration error.
"""
from __future__ import annotations

import argparse
import json
import os

from trainmover.check.plan import MAX_STEADY, MIN_AT


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="package.module:Class (a trainmover Workload), gpt_demo, megatron_gpt, or a "
                                    "script (path ending in .py, script mode: docs/scripts.md) followed by its arguments")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="a script's own arguments (after the script)")
    p.add_argument("--steps", type=int, default=24,
                   help="steps compared after the migration (default 24); the switch comes after a prime number "
                        f"of steps >= max(N, {MIN_AT}) + {MAX_STEADY + 2}. State left out shows only when its effect "
                        "repeats within N steps: use at least your epoch length and LR-schedule period, in steps")
    p.add_argument("--ranks", type=int, help="world size (default: 2, or the first the workload's layout accepts)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of the whole check in seconds (300)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args) -> int:
    from trainmover.check.run import run_check
    from trainmover.config import Config
    if args.script_args and not args.workload.endswith(".py"):
        args = _options_after_the_name(args)
    if args.steps < 1 or (args.ranks is not None and args.ranks < 1) or args.timeout <= 0:
        from trainmover.errors import ConfigError
        raise ConfigError("--steps and --ranks must be >= 1 and --timeout > 0")
    workload, environ = args.workload, dict(os.environ)
    if workload.endswith(".py"):  # script mode: the path and its arguments, as `trainmover run` takes them
        workload = "script:" + os.path.abspath(workload)
        rest = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
        environ["TM_SCRIPT_ARGS"] = json.dumps(rest)

    cfg = Config.from_env(environ, workload=workload)
    report = run_check(cfg.workload, cfg.workload_kwargs(), steps=args.steps, ranks=args.ranks, seed=cfg.seed,
                       timeout_s=args.timeout)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.text())
    return 0 if report.exact else 1


def _options_after_the_name(args):
    """`check-workload cnn:CNN --steps 12`: a class workload takes no arguments, so what follows
    its name is the checker's own options (a script's would be the script's)."""
    own = argparse.ArgumentParser(prog="trainmover check-workload")
    own.add_argument("workload")
    own.add_argument("--steps", type=int, default=args.steps)
    own.add_argument("--ranks", type=int, default=args.ranks)
    own.add_argument("--timeout", type=float, default=args.timeout)
    own.add_argument("--json", action="store_true", default=args.json)
    parsed, unknown = own.parse_known_args([args.workload, *args.script_args])
    if unknown:
        from trainmover.errors import ConfigError
        raise ConfigError(f"unexpected arguments {unknown}: only a script (a .py path) takes arguments")
    parsed.script_args = []
    return parsed
