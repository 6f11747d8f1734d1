"""`python -m trainmover.cluster {up,down,status,env} [--nodes N] [--standby S] [--dir D]`."""

from __future__ import annotations

import argparse
import json
import sys

from trainmover.cluster import lifecycle
from trainmover.errors import TrainMoverError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainmover cluster", description="Embedded local Slurm cluster")
    p.add_argument("action", choices=["up", "down", "status", "env"])
    p.add_argument("--nodes", type=int, default=4, help="training nodes train[1-N] (default 4)")
    p.add_argument("--standby", type=int, default=2, help="standby nodes spare[1-S] (default 2)")
    p.add_argument("--dir", default=None,
                   help="state directory (default $TM_CLUSTER_DIR or /var/tmp/trainmover-cluster)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.action == "up":
            info = lifecycle.up(nodes=args.nodes, standby=args.standby, state_dir=args.dir)
            what = "already running" if info.already_running else f"up in {info.seconds:.1f}s"
            print(f"cluster {what}: nodes {','.join(info.train_nodes)}; standby {','.join(info.standby_nodes)} "
                  f"(reservation {info.reservation}); state in {info.state_dir}")
            print(f'use it from a shell:  eval "$(python -m trainmover.cluster env --dir {info.state_dir})"')
        elif args.action == "down":
            stopped = lifecycle.down(args.dir)
            print(f"stopped {len(stopped)} processes" if stopped else "nothing was running")
        elif args.action == "status":
            st = lifecycle.status(args.dir)
            print(json.dumps(st, indent=2))
            return 0 if st["running"] else 3
        else:
            sys.stdout.write(lifecycle.env_lines(args.dir))
    except TrainMoverError as exc:
        print(f"trainmover cluster {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
