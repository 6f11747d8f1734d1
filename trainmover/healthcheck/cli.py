"""`trainmover healthcheck`: argument parsing and output (the CLI entry point calls main)."""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

from trainmover.healthcheck.run import DEFAULT_STATE_DIR, Options, run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node", help="node to check and drain (default: $SLURMD_NODENAME, else the short hostname)")
    p.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                   help=f"where the test hook inject-fault-<node> and the kernel-log cursor live (default {DEFAULT_STATE_DIR})")
    p.add_argument("--disk", action="append", metavar="PATH", help="file system to check (repeatable; default / and /tmp)")
    p.add_argument("--min-free-gb", type=float, default=1.0, help="least free space per --disk path (default 1)")
    p.add_argument("--no-drain", action="store_true", help="report only (for NHC, which drains by itself)")
    p.add_argument("--no-gpu", action="store_true", help="skip the NVML checks")
    p.add_argument("--no-straggler", action="store_true",
                   help="skip the TrainMover controllers' straggler verdicts about this node")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args: argparse.Namespace) -> int:
    """0: healthy; 1: a fault was found (and the node drained unless --no-drain)."""
    node = args.node or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    opts = Options(node=node, state_dir=Path(args.state_dir), min_free_gb=args.min_free_gb,
                   disk_paths=tuple(args.disk) if args.disk else Options.disk_paths,
                   drain=not args.no_drain, gpu=not args.no_gpu, straggler=not args.no_straggler)
    report = run(opts)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        for f in report.findings:
            print(f"trainmover healthcheck {node}: {f.line()}")
        for note in report.notes:
            print(f"trainmover healthcheck {node}: note: {note}", file=sys.stderr)
        verdict = "drained: " + report.action.reason if report.drained else report.action.reason
        print(f"trainmover healthcheck {node}: {verdict} ({report.seconds:.2f}s)")
    return 0 if report.healthy else 1
