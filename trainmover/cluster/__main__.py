"""`python -m trainmover.cluster {up,down,status,env} [--nodes N] [--standby S] [--dir D] [--slurm V]
[--no-job-expansion] [--slurm-unfixed] [--no-node-reader]`;
`python -m trainmover.cluster releases [--besides-host]`: the supported Slurm releases, one a line;
`python -m trainmover.cluster build --slurm V`: build V's root filesystem when missing (from source for
25.11: minutes; `make slurm-matrix` runs it before a release's tests, so their time is the tests'),
and print its path (empty: the host's Slurm)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from trainmover import config
from trainmover.cluster import lifecycle, rootfs
from trainmover.cluster.releases import RELEASES
from trainmover.errors import TrainMoverError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainmover cluster", description="Embedded local Slurm cluster")
    p.add_argument("action", choices=["up", "down", "status", "env", "releases", "build"])
    p.add_argument("--nodes", type=int, default=4, help="training nodes train[1-N] (default 4)")
    p.add_argument("--standby", type=int, default=2, help="standby nodes spare[1-S] (default 2)")
    p.add_argument("--dir", default=None,
                   help="state directory (default $TM_CLUSTER_DIR, else /var/tmp/trainmover-cluster, "
                        "or /var/tmp/trainmover-cluster-<V> with --slurm V)")
    p.add_argument("--slurm", metavar="V", default=None,
                   help=f"Slurm release ({', '.join(RELEASES)}): the host's when it has that one, else a Debian "
                        "root filesystem built once (default: the host's, or what the cluster in --dir ran)")
    p.add_argument("--rootfs", action="store_true",
                   help="run --slurm V from its Debian root filesystem even when the host has V")
    p.add_argument("--besides-host", action="store_true",
                   help="releases: leave out the host's (the one a cluster without --slurm runs)")
    p.add_argument("--no-job-expansion", dest="job_expansion", action="store_false",
                   help="up: slurm.conf without SchedulerParameters=permit_job_expansion, as Slurm ships it (a "
                        "running cluster's is rewritten and reconfigured): no job can grow")
    p.add_argument("--no-node-reader", dest="node_reader", action="store_false",
                   help="up: no per-cluster node-state reader (started by default, as a site runs it: "
                        "docs/admin.md); each job polls slurmctld itself every TM_POLL_S")
    p.add_argument("--slurm-unfixed", action="store_true", default=config.setting("TM_SLURM_UNFIXED") == "1",
                   help="up, build: --slurm 25.11 built without TrainMover's fixes to its source (its slurmctld "
                        "crashes at every job expansion), in a root filesystem of its own (default: "
                        "$TM_SLURM_UNFIXED=1)")
    p.add_argument("--rootfs-cache", default=None, metavar="DIR",
                   help="where root filesystems are built and kept (default $TM_ROOTFS_CACHE or "
                        "/var/cache/trainmover/rootfs)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.rootfs and not args.slurm:
            raise TrainMoverError("--rootfs needs --slurm V")
        if args.action == "releases":
            host = rootfs.host_release() if args.besides_host else None
            print("\n".join(v for v in RELEASES if v != host))
        elif args.action == "build":
            if not args.slurm:
                raise TrainMoverError("build needs --slurm V")
            t0 = time.monotonic()
            _, full, root, _ = rootfs.locate(args.slurm, cache=rootfs.resolve_cache(args.rootfs_cache),
                                             log=lambda m: print(f"trainmover cluster: {m}", file=sys.stderr, flush=True),
                                             force_root=args.rootfs, unfixed=args.slurm_unfixed)
            print(f"trainmover cluster: Slurm {full} ready in {root or 'the host'} ({time.monotonic() - t0:.0f}s)",
                  file=sys.stderr)
            print(root)  # alone on stdout: `make pyslurm` builds against it
        elif args.action == "up":
            info = lifecycle.up(nodes=args.nodes, standby=args.standby, state_dir=args.dir, slurm=args.slurm,
                                rootfs_cache=args.rootfs_cache, force_root=args.rootfs,
                                job_expansion=args.job_expansion, unfixed=args.slurm_unfixed,
                                node_reader=args.node_reader)
            what = "already running" if info.already_running else f"up in {info.seconds:.1f}s"
            print(f"cluster {what} on {info.slurm}: nodes {','.join(info.train_nodes)}; "
                  f"standby {','.join(info.standby_nodes)} (reservation {info.reservation}); state in {info.state_dir}")
            print(f'use it from a shell:  eval "$(python -m trainmover.cluster env --dir {info.state_dir})"')
        elif args.action == "down":
            stopped = lifecycle.down(args.dir, args.slurm)
            print(f"stopped {len(stopped)} processes" if stopped else "nothing was running")
        elif args.action == "status":
            st = lifecycle.status(args.dir, args.slurm)
            print(json.dumps(st, indent=2))
            return 0 if st["running"] else 3
        else:
            sys.stdout.write(lifecycle.env_lines(args.dir, args.slurm))
    except TrainMoverError as exc:
        print(f"trainmover cluster {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
