"""The fault-injection hook: a file `<state dir>/inject-fault-<node>`.

Two forms:
  * text (the original hook): the check fails with the first line as the fault's text
    (check "inject"), whatever the GPUs say;
  * JSON, one fault or a list of them: each is applied *as data* to the GPU reading (and,
    for a counter jump, to the kept state) before verdict.py judges it, so an injected fault
    goes through the same decision code as a real one:

    {"kind": "counter_jump", "gpu": 0, "link": "nvlink1", "counter": "replay", "add": 1000000}
        the counter reads `add` more than at the last run (link: "nvlink<N>" or "pcie";
        default the GPU's first active NVLink, else PCIe; counter: a rates.py kind)
    {"kind": "ecc_uncorrectable", "gpu": 0, "count": 2}
    {"kind": "row_remap_failure", "gpu": 0}
    {"kind": "retirement_pending", "gpu": 0}
    {"kind": "fallen_off_bus", "gpu": 0}
    {"kind": "xid", "gpu": 0, "xid": 79}         a critical XID since the last run
    {"kind": "counter_reset", "gpu": 0}          every counter reads 0 (driver reload): must pass

While a JSON hook is in place the GPU state is not saved, so injected values never become
a baseline. The hook is honoured only where the state directory and the file pass
state.read_trusted (owned by the checking user, not writable by others): a user who could
write it could drain nodes. A hook that does not parse fails the check (it was meant to).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from trainmover.healthcheck.rates import Base
from trainmover.healthcheck.readings import COUNTER_KINDS, NodeReading, XidEvent
from trainmover.healthcheck.state import GpuState, NodeState, read_trusted

PREFIX = "inject-fault-"
KINDS = ("counter_jump", "ecc_uncorrectable", "row_remap_failure", "retirement_pending", "fallen_off_bus",
         "xid", "counter_reset")
DEFAULT_JUMP = 1_000_000
DEFAULT_WINDOW_S = 60.0


class InjectError(ValueError):
    pass


def hook_path(state_dir: Path, node: str) -> Path:
    return Path(state_dir) / f"{PREFIX}{node}"


@dataclass(frozen=True)
class Hook:
    path: Path
    text: Optional[str] = None            # the text form's first line
    faults: tuple[dict, ...] = ()         # the JSON form
    problem: Optional[str] = None         # set: the hook is ignored (untrusted) ...
    invalid: Optional[str] = None         # ... or present but malformed (a fault)

    @property
    def present(self) -> bool:
        return self.text is not None or bool(self.faults) or self.invalid is not None


def read_hook(state_dir: Path, node: str) -> Hook:
    path = hook_path(state_dir, node)
    text, problem = read_trusted(path)
    if problem:
        return Hook(path, problem=f"{path} ignored: {problem}")
    if text is None:
        return Hook(path)
    body = text.strip()
    if not body.startswith(("{", "[")):
        return Hook(path, text=body.splitlines()[0][:120] if body else "injected fault")
    try:
        doc = json.loads(body)
        faults = tuple(doc if isinstance(doc, list) else [doc])
        for f in faults:
            _validate(f)
    except (ValueError, TypeError) as exc:
        return Hook(path, invalid=f"{path}: not a valid fault list ({exc})")
    return Hook(path, faults=faults)


def _validate(f: Any) -> None:
    if not isinstance(f, dict) or f.get("kind") not in KINDS:
        raise InjectError(f"each fault is an object with a kind among {', '.join(KINDS)}; got {f!r}")
    if "counter" in f and f["counter"] not in COUNTER_KINDS:
        raise InjectError(f"counter {f['counter']!r} is not one of {', '.join(COUNTER_KINDS)}")
    for key in ("gpu", "add", "count", "xid"):
        if key in f and (not isinstance(f[key], int) or f[key] < 0):
            raise InjectError(f"{key} must be a non-negative integer; got {f[key]!r}")


def describe(f: dict) -> str:
    extra = ", ".join(f"{k}={v}" for k, v in f.items() if k != "kind")
    return f"{f['kind']}({extra})"


def apply(prev: Optional[NodeState], reading: NodeReading, faults: tuple[dict, ...], now: float
          ) -> tuple[Optional[NodeState], NodeReading]:
    """The world as it would look with `faults`: (state of the last run, reading now)."""
    for f in faults:
        gi = int(f.get("gpu", 0))
        g = reading.gpu(gi)
        if g is None:
            raise InjectError(f"{describe(f)}: the reading has no GPU {gi} (GPUs: {[x.index for x in reading.gpus]})")
        kind = f["kind"]
        if kind == "ecc_uncorrectable":
            g = replace(g, ecc_uncorrected=g.ecc_uncorrected + int(f.get("count", 1)))
        elif kind == "row_remap_failure":
            g = replace(g, remap_failed=True)
        elif kind == "retirement_pending":
            g = replace(g, retire_pending=True)
        elif kind == "fallen_off_bus":
            g = replace(g, lost=True, counters={})
        elif kind == "counter_reset":
            g = replace(g, counters={link: {k: 0 for k in kinds} for link, kinds in g.counters.items()})
        elif kind == "xid":
            reading = replace(reading, xids=reading.xids + (XidEvent(int(f.get("xid", 79)), g.name, None, "injected"),))
        elif kind == "counter_jump":
            g, prev = _counter_jump(prev, reading, g, f, now)
        reading = reading.with_gpu(g)
    return prev, reading


def _counter_jump(prev: Optional[NodeState], reading: NodeReading, g, f: dict, now: float):
    nvlinks = sorted((k for k in g.counters if k.startswith("nvlink")), key=lambda k: int(k[len("nvlink"):]))
    link = f.get("link") or (nvlinks[0] if nvlinks else "pcie")
    counter = f.get("counter") or ("pcie_replay" if link == "pcie" else "crc_flit")
    add = int(f.get("add", DEFAULT_JUMP))
    current = int(g.counters.get(link, {}).get(counter, 0))
    counters = {k: dict(v) for k, v in g.counters.items()}
    counters.setdefault(link, {})[counter] = current + add
    # The jump is "since the last run": where the last run kept no base for this counter (a
    # GPU without that link, a first run), give it one at the current value.
    seqs = [x.seq for x in reading.xids if x.seq is not None]
    state = prev or NodeState(reading.boot_id, now - DEFAULT_WINDOW_S, {}, max(seqs, default=-1))
    kept = state.gpus.get(g.uuid) or GpuState(g.index, g.pci, {})
    if counter not in kept.bases.get(link, {}):
        since = state.time if state.time < now else now - DEFAULT_WINDOW_S
        bases = {k: dict(v) for k, v in kept.bases.items()}
        bases.setdefault(link, {})[counter] = Base(current, since, current)
        if prev is None:  # the other counters of a first run are a baseline like this one
            for lk, kinds in g.counters.items():
                for kd, v in kinds.items():
                    bases.setdefault(lk, {}).setdefault(kd, Base(int(v), since, int(v)))
        state = replace(state, gpus={**state.gpus, g.uuid: replace(kept, bases=bases)})
    return replace(g, counters=counters), state
