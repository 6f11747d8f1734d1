"""`trainmover healthcheck`: argument parsing and output (the CLI entry point calls main)."""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

from trainmover.healthcheck import fence_record
from trainmover.healthcheck.rates import DEFAULT_THRESHOLDS_PER_S, DEFAULT_WINDOW_S, RatePolicy
from trainmover.healthcheck.readings import COUNTER_KINDS
from trainmover.healthcheck.run import DEFAULT_STATE_DIR, Options, run
from trainmover.healthcheck.source import SPECS
from trainmover.healthcheck.verdict import Policy


def _threshold(text: str) -> tuple[str, float]:
    kind, sep, value = text.partition("=")
    if not sep or kind not in COUNTER_KINDS:
        raise argparse.ArgumentTypeError(f"expected KIND=ERRORS_PER_S with KIND one of {', '.join(COUNTER_KINDS)}")
    try:
        rate = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of errors per second") from None
    if rate < 0:
        raise argparse.ArgumentTypeError("a threshold is >= 0")
    return kind, rate


def _source(text: str) -> str:
    if text in ("auto", "nvml", "dcgm") or (text.startswith("file:") and len(text) > 5):
        return text
    raise argparse.ArgumentTypeError(f"one of {', '.join(SPECS)}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node", help="node to check and drain (default: $SLURMD_NODENAME, else the short hostname)")
    p.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                   help=f"where the counter state and the test hook inject-fault-<node> live (default {DEFAULT_STATE_DIR})")
    p.add_argument("--disk", action="append", metavar="PATH",
                   help="file system whose free space below --min-free-gb drains the node (repeatable; default "
                        "none: / and /tmp are reported as warnings only, since any user can fill /tmp, and / where "
                        "/tmp or /var/tmp lies on it; docs/admin.md)")
    p.add_argument("--min-free-gb", type=float, default=1.0, help="least free space per --disk path (default 1)")
    p.add_argument("--no-drain", action="store_true", help="report only (for NHC, which drains by itself)")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU checks")
    p.add_argument("--straggler", dest="straggler", action="store_true", default=None,
                   help="read the TrainMover controllers' straggler verdicts about this node (default: on, except "
                        "as root: those files are the jobs' users', so root trusts them only when told: "
                        "docs/security.md)")
    p.add_argument("--no-straggler", dest="straggler", action="store_false",
                   help="skip the TrainMover controllers' straggler verdicts about this node")
    p.add_argument("--gpu-source", type=_source, default="auto", metavar="SOURCE",
                   help="auto (DCGM where dcgmi is installed, else NVML), nvml, dcgm, or file:PATH "
                        "(a recorded reading: dry runs)")
    defaults = ", ".join(f"{k}={v:.3g}" for k, v in DEFAULT_THRESHOLDS_PER_S.items())
    p.add_argument("--rate-threshold", type=_threshold, action="append", default=[], metavar="KIND=PER_S",
                   help=f"errors per second above which a link fails (repeatable; defaults {defaults})")
    p.add_argument("--rate-window", type=float, default=DEFAULT_WINDOW_S, metavar="S",
                   help=f"least time a counter rise is spread over (default {DEFAULT_WINDOW_S:g} s)")
    p.add_argument("--drain-notices", metavar="DIR",
                   help="root-owned directory, seen by every node, where a drain is announced to the jobs on the "
                        "node at once (docs/admin.md, \"Load on slurmctld\"; default: none)")
    p.add_argument("--fence-record", action="store_true",
                   help="as the node's Epilog: drain it if the ending job held it after fencing it (its status.json, "
                        "found through SLURM_JOB_ID, SLURM_JOB_UID and SLURM_JOB_WORK_DIR; healthcheck/fence_record.py)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args: argparse.Namespace) -> int:
    """0: healthy; 1: a fault was found (and the node drained unless --no-drain)."""
    node = args.node or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    try:
        rates = RatePolicy(window_s=args.rate_window).with_thresholds(dict(args.rate_threshold))
    except ValueError as exc:
        print(f"trainmover healthcheck: {exc}", file=sys.stderr)
        return 2
    opts = Options(node=node, state_dir=Path(args.state_dir), min_free_gb=args.min_free_gb,
                   disk_paths=tuple(args.disk) if args.disk else Options.disk_paths,
                   drain=not args.no_drain, gpu=not args.no_gpu,
                   straggler=args.straggler if args.straggler is not None else os.geteuid() != 0,
                   gpu_source=args.gpu_source, policy=Policy(rates=rates),
                   drain_notices=Path(args.drain_notices) if args.drain_notices else None)
    extra = []
    if args.fence_record:
        try:
            end = fence_record.JobEnd.from_env(os.environ)
        except ValueError as exc:
            print(f"trainmover healthcheck: {exc}", file=sys.stderr)
            return 2
        extra.append((fence_record.NAME, lambda: fence_record.findings(end, node)))
    report = run(opts, extra=extra)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        if report.gpu_source:
            print(f"trainmover healthcheck {node}: gpu source: {report.gpu_source}")
        for f in report.findings:
            print(f"trainmover healthcheck {node}: {f.line()}")
        for note in report.notes:
            print(f"trainmover healthcheck {node}: note: {note}", file=sys.stderr)
        verdict = "drained: " + report.action.reason if report.drained else report.action.reason
        print(f"trainmover healthcheck {node}: {verdict} ({report.seconds:.2f}s)")
    return 0 if report.healthy else 1
