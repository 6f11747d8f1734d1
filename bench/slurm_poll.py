"""One controller poll through each Slurm backend: pyslurm (the C API, in the backend's own
pyslurm process: slurm/pyslurm_backend.py says why) against the CLI (a forked `scontrol show
node`), on the embedded Slurm 25.11 cluster; and, for what the process boundary costs and
saves, the same pyslurm call made in the bench's process ("pyslurm_in_process"). For each, the
longest pause a 10 ms ticking thread of the caller saw during the polls: pyslurm holds the GIL
through its RPCs, so in-process every thread (a controller's heartbeat) stops that long.

A poll is what the controller's loop does every TM_POLL_S: `slurm.nodes(watched)`, the
job's training nodes, its standbys and released nodes (controller/executor.py). The bench asks
for the 4 training and 2 standby nodes, alternating the backends so that both see the same
load, and reports the median, 90th percentile and mean per backend. It runs where the
controller runs: inside the cluster's root filesystem (the host cannot load pyslurm's
library, docs/admin.md), re-executing itself there.

    make pyslurm && trainmover cluster up --slurm 25.11
    .venv/bin/python bench/slurm_poll.py [--polls 200] [--dir /var/tmp/trainmover-cluster-25.11]

Writes bench/results/slurm-poll-<time>.json (command, machine, commit, load).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results_io  # noqa: E402
from trainmover import config  # noqa: E402

INSIDE = "TM_BENCH_INSIDE_ROOT"  # the bench's own marker for its re-execution (declared in trainmover/config.py)


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": round(1e3 * statistics.median(xs), 3), "p90_ms": round(1e3 * xs[int(0.9 * (len(xs) - 1))], 3),
            "mean_ms": round(1e3 * statistics.fmean(xs), 3), "min_ms": round(1e3 * xs[0], 3), "polls": len(xs)}


class _InProcess:
    """pyslurm's node load made in this process (what the backend did before its process)."""

    def __init__(self, conf: str):
        from trainmover.slurm.pyslurm_server import Calls, load
        self.calls = Calls(load(conf))

    def nodes(self, names: list[str]) -> dict:
        from trainmover.slurm.pyslurm_backend import _node
        every = {d["name"]: _node(d) for d in self.calls.nodes()}
        return {n: every[n] for n in names}


def measure(conf: str, nodes: list[str], polls: int) -> dict:
    import threading
    from trainmover.slurm import client
    backends = {"pyslurm": client("pyslurm", slurm_conf=conf), "cli": client("cli", slurm_conf=conf),
                "pyslurm_in_process": _InProcess(conf)}
    for b in backends.values():  # same answer from each, and warm (first RPC, page cache)
        got = b.nodes(nodes)
        assert {n: i.state for n, i in backends["cli"].nodes(nodes).items()} == {n: i.state for n, i in got.items()}
    times: dict[str, list[float]] = {k: [] for k in backends}
    pauses: dict[str, list[float]] = {k: [] for k in backends}
    ticks: list[float] = []
    stop = threading.Event()

    def tick():  # a thread like the controller's heartbeat: wakes every 10 ms
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.01)
    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    for _ in range(polls):
        for name, b in backends.items():
            time.sleep(0.02)
            t = time.perf_counter()
            b.nodes(nodes)
            end = time.perf_counter()
            times[name].append(end - t)
            time.sleep(0.02)  # the ticker's first tick after the call ends its pause
            seen = [x for x in ticks[-64:] if t - 0.02 <= x <= end + 0.02]
            pauses[name].append(max((b2 - a for a, b2 in zip(seen, seen[1:])), default=0.0))
    stop.set()
    return {k: {**_stats(v), "longest_thread_pause_ms": round(1e3 * max(pauses[k]), 3)} for k, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--polls", type=int, default=200)
    p.add_argument("--dir", default="/var/tmp/trainmover-cluster-25.11", help="the running 25.11 cluster's state")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from trainmover.cluster import attach, rootfs
    info = attach(args.dir)
    nodes = list(info.train_nodes) + list(info.standby_nodes)
    if config.setting(INSIDE) != "1":
        if info.slurm_root is None:
            raise SystemExit(f"the cluster in {args.dir} runs the host's Slurm; this bench needs Slurm 25.11's root")
        argv = [*rootfs.launcher(info.slurm_root, rootfs.binds(info.state_dir), chdir=str(ROOT)), sys.executable,
                str(Path(__file__).resolve()), *sys.argv[1:]]
        t0 = time.time()
        proc = subprocess.run(argv, env={**os.environ, INSIDE: "1"}, capture_output=True, text=True, timeout=600)
        sys.stderr.write(proc.stderr)
        if proc.returncode != 0:
            raise SystemExit(f"the bench inside {info.slurm_root} failed (exit {proc.returncode})")
        metrics = json.loads(proc.stdout.splitlines()[-1])
        pys, cli = metrics["pyslurm"]["median_ms"], metrics["cli"]["median_ms"]
        metrics["cli_over_pyslurm_median"] = round(cli / pys, 1)
        result = {
            "bench": "slurm-poll", "command": " ".join([sys.executable, *sys.argv]), "commit": results_io.commit(),
            "time": results_io.now(), "seconds": round(time.time() - t0, 1),
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "loadavg_after": os.getloadavg()},
            "slurm": info.slurm, "nodes_per_poll": nodes,
            "what": "one controller poll: SlurmClient.nodes(4 training + 2 standby nodes), inside the 25.11 root, "
                    "backends alternated",
            "metrics": metrics}
        results_io.write(Path(args.out) if args.out else results_io.stamped("slurm-poll"), result)
        return 0
    print(json.dumps(measure(str(info.slurm_conf), nodes, args.polls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
