"""Failure rates from a cluster's history: the jobs' journals, or Slurm accounting (sacct).

* Journals (`runs/<job>/journal.jsonl`, controller/durable/journal.py): exposure = the job's training
  nodes x the span of its records (wall-clock `t`); interruptions = its migrations by trigger:
  `failure` unplanned; `drain`, `healthcheck` (the health check's own drains) and `straggler`
  planned; `rebalance` and `manual` are the user's choice, not interruptions. A node counts once
  per job and trigger (a retried migration is one interruption). They also give the standby
  refill time: from a slot emptied to the next new standby warm (`refill_times`).
* sacct (`--from-sacct`, where accounting runs): exposure = the node-hours of every job that
  ran; interruptions = jobs that ended NODE_FAIL (unplanned only: accounting does not say what a
  drain interrupted, so the planned share stays the site's).

Both give a node MTBF (node-hours per interruption). With no interruption in the history there
is no rate to give, only a lower bound: that is an error naming the exposure, never a guess.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainmover.controller.durable import journal
from trainmover.errors import ConfigError, SlurmError, TrainMoverError
from trainmover.protocol import files
from trainmover.slurm import commands

UNPLANNED = {"failure"}
PLANNED = {"drain", "healthcheck", "straggler"}
SACCT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class History:
    node_hours: float
    planned: int
    unplanned: int
    jobs: int
    source: str
    refills_h: tuple[float, ...] = ()    # measured standby refill times (journals only)

    @property
    def replenish_h(self) -> float | None:
        return sum(self.refills_h) / len(self.refills_h) if self.refills_h else None

    @property
    def events(self) -> int:
        return self.planned + self.unplanned

    def node_mtbf_h(self) -> float:
        if self.events == 0:
            raise ConfigError(f"{self.source}: no interruption in {self.node_hours:,.1f} node-hours of {self.jobs} job(s): "
                              f"the node MTBF is only known to be above {self.node_hours:,.1f} h; too little history "
                              "for a rate (pass --node-mtbf-h)")
        return self.node_hours / self.events

    def to_json(self) -> dict:
        return {"node_hours": self.node_hours, "planned": self.planned, "unplanned": self.unplanned, "jobs": self.jobs,
                "source": self.source, "node_mtbf_h": self.node_hours / self.events if self.events else None,
                "refills": len(self.refills_h), "replenish_h": self.replenish_h}


def refill_times(pools: list[tuple[float, dict]]) -> list[float]:
    """Hours from a standby slot emptied (its node joined the ranks, or was lost) to a new
    standby warm: each emptied slot, in order, paired with the next node that is ready for the
    first time. `pools`: (t, {node: state}) each time the journal's standby pool changed."""
    pool: dict = {}
    emptied: list[float] = []
    warm: set = set()
    out: list[float] = []
    for t, now in pools:
        emptied += [t] * len(set(pool) - set(now))
        for node, state in now.items():
            if state == "ready" and node not in warm:
                warm.add(node)
                if emptied:
                    out.append((t - emptied.pop(0)) / 3600.0)
        pool = now
    return out


def journal_exposure(lines: list[str]) -> tuple[float, int, int, list[float]]:
    """(node-hours, planned, unplanned, refill hours) of one job's journal lines (with their
    newlines; a torn last line is skipped), read by the controller's own replay (journal.fold)."""
    times: list[float] = []
    nodes = 0
    seen: set[tuple[str, str]] = set()
    pools: list[tuple[float, dict]] = []

    def record(rec: dict, state: dict) -> None:
        nonlocal nodes
        if isinstance(rec.get("t"), (int, float)):
            times.append(rec["t"])
        if rec["kind"] == "start":
            nodes = len(set(rec["rank_node"].values()))
        seen.update((m["leaver"], m["trigger"]) for m in state.get("migrations", []))
        pool = {n: s["state"] for n, s in state.get("view", {}).get("standbys", {}).items()}
        if rec["kind"] in ("state", "view") and pool != (pools[-1][1] if pools else {}):
            pools.append((rec["t"], pool))

    journal.fold(lines, on_record=record)
    if not nodes or len(times) < 2:
        return 0.0, 0, 0, []
    planned = sum(1 for _, trig in seen if trig in PLANNED)
    unplanned = sum(1 for _, trig in seen if trig in UNPLANNED)
    return nodes * (max(times) - min(times)) / 3600.0, planned, unplanned, refill_times(pools)


def from_journals(dirs: list[str]) -> History:
    """Every runs/<job>/journal.jsonl under `dirs` (a runs directory, or one job's directory)."""
    paths: list[Path] = []
    for d in dirs:
        p = Path(d)
        if (p / "journal.jsonl").is_file():
            paths.append(p / "journal.jsonl")
        elif p.is_dir():
            paths += sorted(p.glob("*/journal.jsonl"))
        else:
            raise ConfigError(f"--from-runs {d}: not a directory")
    if not paths:
        raise ConfigError(f"--from-runs {' '.join(dirs)}: no journal.jsonl found (expected runs/<job id>/journal.jsonl)")
    hours = planned = unplanned = 0.0
    refills: list[float] = []
    for path in paths:
        try:
            # `plan` may run as root over users' runs/: never through a link, never a FIFO (protocol/files.py)
            text = files.read_limited(path, files.RUN_FILE_MAX).decode(errors="replace")
            h, p, u, r = journal_exposure(text.splitlines(keepends=True))
        except (OSError, TrainMoverError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{path}: not a readable journal ({type(exc).__name__}: {exc})") from None
        hours, planned, unplanned = hours + h, planned + p, unplanned + u
        refills += r
    return History(hours, int(planned), int(unplanned), len(paths), f"{len(paths)} journal(s) under {', '.join(dirs)}",
                   tuple(refills))


def parse_sacct(text: str) -> tuple[float, int, int]:
    """(node-hours, NODE_FAIL jobs, jobs) of `sacct -a -X -n -P -o JobID,State,NNodes,ElapsedRaw`."""
    hours, fails, jobs = 0.0, 0, 0
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 4 or not parts[0]:
            continue
        try:
            nodes, elapsed = int(parts[2]), int(parts[3])
        except ValueError:
            raise ConfigError(f"sacct: unexpected line {line!r}") from None
        jobs += 1
        hours += nodes * elapsed / 3600.0
        fails += parts[1].split()[0] == "NODE_FAIL"
    return hours, fails, jobs


def from_sacct(since: str) -> History:
    """Through the Slurm choke point; an error that says so where accounting is not running."""
    argv = ["sacct", "-a", "-X", "-n", "-P", "-S", since, "-E", "now", "-o", "JobID,State,NNodes,ElapsedRaw"]
    try:
        out = commands.run(argv, timeout=SACCT_TIMEOUT_S).stdout
    except SlurmError as exc:
        raise ConfigError(f"--from-sacct: Slurm accounting did not answer ({exc}); use --from-runs or --node-mtbf-h") from None
    hours, fails, jobs = parse_sacct(out)
    return History(hours, 0, fails, jobs, f"sacct since {since} ({jobs} jobs)")
