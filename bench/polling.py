"""Bounded polling and JSON-lines reading shared by the benchmarks (every wait has a deadline)."""
from __future__ import annotations

import json
import time
from pathlib import Path


def wait(what, check, timeout, interval=0.1):
    """`check()`'s first truthy value, polled every `interval` s; TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waiting for {what} ({timeout:g}s)")
        time.sleep(interval)
    return value


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file; none while it does not exist yet."""
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []
