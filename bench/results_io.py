"""What every benchmark result carries and where it goes (shared/reference/bench-results.md)."""
from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

from trainmover import config

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The commit measured. A device machine gets the tree without history: the caller passes
    TM_COMMIT there."""
    return config.setting("TM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--verify", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def machine() -> str:
    """The machine a result names by default: TM_BENCH_MACHINE, else "unknown"."""
    return config.setting("TM_BENCH_MACHINE")


def ran_on(machine: str, gpus: str) -> str:
    """`machine` (the kind asked for) unless the cards that ran (`gpus`, e.g. "4x NVIDIA H200")
    are of another model than the kind names: the device tool may lend H200s for an H100 kind,
    and a result must never name cards it did not run on."""
    asked = re.search(r"h(100|200)", machine.lower())
    if asked and f"h{asked.group(1)}" not in gpus.lower():
        return f"{machine} asked, ran on {gpus}"
    return machine


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def provenance(script: str) -> dict:
    """commit, command and when: what every result carries besides its scenario and machine.
    `script` is the benchmark's own file (__file__); the command is it with this run's arguments."""
    return {"commit": commit(),
            "command": " ".join(["python", Path(script).resolve().relative_to(ROOT).as_posix(), *sys.argv[1:]]),
            "when": now()}


def write(path: Path, result: dict) -> Path:
    """Write `result` as JSON, print its metrics and where it went."""
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["metrics"], indent=1))
    print(f"wrote {path}")
    return path


def stamped(prefix: str) -> Path:
    """bench/results/<prefix>-<local time>.json"""
    return ROOT / "bench" / "results" / f"{prefix}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
