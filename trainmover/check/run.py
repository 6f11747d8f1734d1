"""Run the check: start the reference and joiner processes, follow them against a deadline,
and turn what they reported into a `Report`.

This module is the check's only place with effects (processes, files, the clock); what to
run is `plan.py`'s and what it means is `compare.py`'s.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainmover.check import compare
from trainmover.check.plan import Plan, plan as make_plan
from trainmover.check.proc import HOST, JOINER, REFERENCE, ProcSpec
from trainmover.errors import ConfigError
from trainmover.workloads import base as workloads
from trainmover.workloads import registry

WORLD_CANDIDATES = (2, 1, 3, 4, 5, 6, 7, 8)  # the first one the workload's layout accepts
POLL_S = 0.1
KILL_WAIT_S = 5.0
STACKS_WAIT_S = 1.0  # for the stuck processes to write their stacks
STACKS_CHARS = 6000


@dataclass
class Report:
    workload: str
    world: int
    plan: Plan
    seconds: float
    findings: list[compare.Finding] = field(default_factory=list)
    failure: str = ""          # a process failed or the deadline passed: the first cause
    shadow_steps: int | None = None

    @property
    def exact(self) -> bool:
        return not self.failure and bool(self.findings) and all(f.ok for f in self.findings)

    def first_difference(self) -> compare.Finding | None:
        return next((f for f in self.findings if not f.ok), None)

    def text(self) -> str:
        head = (f"check-workload {self.workload}: {self.world} rank{'s' if self.world > 1 else ''} over gloo, "
                f"switch after step {self.plan.at}, {self.plan.compare} steps compared, rollback to step "
                f"{self.plan.rollback}"
                + (f", joiners warmed by {self.shadow_steps} shadow steps" if self.shadow_steps is not None else "")
                + f" ({self.seconds:.1f}s)")
        lines = [head]
        if self.failure:
            lines.append(f"  FAILED: {self.failure}")
        for f in self.findings:
            lines.append(f"  {f.check:<12} {'ok  ' if f.ok else 'FAIL'} {f.message}")
        lines.append("  a migration would be exact" if self.exact else "  a migration would NOT be exact")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"workload": self.workload, "world": self.world, "at": self.plan.at, "compare": self.plan.compare,
                "rollback": self.plan.rollback,
                "seconds": self.seconds, "exact": self.exact, "failure": self.failure,
                "shadow_steps": self.shadow_steps, "findings": [asdict(f) for f in self.findings]}


def choose_world(wl: workloads.Workload, ranks: int | None) -> int:
    """`ranks`, or the first of WORLD_CANDIDATES whose group layout the workload accepts."""
    tried = []
    for world in ([ranks] if ranks else WORLD_CANDIDATES):
        try:
            wl.group_specs(world)
            return world
        except ConfigError as exc:
            tried.append(f"{world}: {exc}")
    raise ConfigError(f"the workload accepts none of the world sizes tried ({'; '.join(tried)})"
                      + ("" if ranks else "; pass --ranks"))


class _Proc:
    def __init__(self, spec: ProcSpec, log: Path, env: dict):
        self.spec, self.log = spec, log
        self.record = compare.Record()
        self.offset = 0
        # A session of its own: what it starts (DataLoader workers: one was seen left behind on a
        # loaded machine, parked on a futex) is killed with it, never outlives the check.
        with open(log, "wb") as out:
            self.popen = subprocess.Popen([sys.executable, "-m", "trainmover.check.proc", json.dumps(spec.__dict__)],
                                          stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def kill_group(self) -> None:
        """SIGKILL to the process and everything it started that is still in its group."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is gone already
            pass

    @property
    def name(self) -> str:
        return f"{self.spec.role} rank {self.spec.rank}"

    def read(self) -> None:
        """Fold the lines written since the last read (a partial last line waits)."""
        try:
            with open(self.spec.out, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            if line.strip():
                self.record.add(json.loads(line))
        self.offset += end

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""


def _stacks(running: list[_Proc]) -> str:
    """Where each process still running is: its threads' stacks, which it writes into its log
    on SIGUSR1 (check/proc.py), shortened to the frames."""
    for p in running:
        try:
            p.popen.send_signal(signal.SIGUSR1)
        except ProcessLookupError:  # ended meanwhile
            pass
    time.sleep(STACKS_WAIT_S)
    out = []
    for p in running:
        text = p.tail(STACKS_CHARS)
        # faulthandler's header: "Thread 0x..." per thread, "Current thread 0x..." for the one it ran on
        start = min((i for i in (text.find("Current thread 0x"), text.find("Thread 0x")) if i >= 0), default=-1)
        if start >= 0:
            out.append(f"\n{p.name}, its threads:\n{text[start:]}")
    return "".join(out)


def _first_failure(procs: list[_Proc]) -> str:
    """The root cause: the earliest error reported, else a process that died without one."""
    errors = sorted((p.record.error["t"], p) for p in procs if p.record.error)
    if errors:
        _, p = errors[0]
        e = p.record.error
        return f"{p.name} failed in '{e['phase']}': {e['error']}\n{e.get('trace', '')}"
    for p in procs:
        code = p.popen.poll()
        if code not in (None, 0):
            return f"{p.name} exited with {code} in '{p.record.phase}' without a report:\n{p.tail()}"
    return ""


def run_check(workload: str, options: dict, *, steps: int = 24, ranks: int | None = None, seed: int = 1234,
              timeout_s: float = 300.0, workdir: str | None = None) -> Report:
    """Check `workload` with `options` (its constructor's keyword arguments, as a job hands them)."""
    import torch.distributed as dist
    t0 = time.monotonic()
    the_plan = make_plan(steps)
    world = choose_world(registry.load(workload, options), ranks)  # the options are checked here too
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    tmp = tempfile.TemporaryDirectory(prefix="tm-check-", dir=workdir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs: list[_Proc] = []
    try:
        for role in (REFERENCE, JOINER):
            for rank in range(world):
                base = Path(tmp.name) / f"{role}-{rank}"
                spec = ProcSpec(role=role, rank=rank, world=world, workload=workload, options=options, seed=seed,
                                at=the_plan.at, compare=the_plan.compare, rollback=the_plan.rollback,
                                restarts=the_plan.restarts,
                                store=(HOST, store.port),
                                out=f"{base}.jsonl", timeout_s=timeout_s)
                procs.append(_Proc(spec, Path(f"{base}.log"), env))
        failure = _follow(procs, t0 + timeout_s, timeout_s)
    finally:
        for p in procs:
            p.kill_group()  # also a finished process's leftovers (its DataLoader workers)
        for p in procs:
            try:
                p.popen.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        tmp.cleanup()
    refs = [p.record for p in procs if p.spec.role == REFERENCE]
    joins = [p.record for p in procs if p.spec.role == JOINER]
    report = Report(workload, world, the_plan, time.monotonic() - t0, failure=failure,
                    shadow_steps=joins[0].shadow if joins else None)
    if not failure:
        report.findings = compare.findings(the_plan, refs, joins)
    return report


def _follow(procs: list[_Proc], deadline: float, timeout_s: float) -> str:
    """Wait for every process to finish; '' or the first failure. Past the deadline: which
    processes were still running, and where each was."""
    while True:
        for p in procs:
            p.read()
        failure = _first_failure(procs)
        if failure:
            return failure
        if all(p.popen.poll() == 0 for p in procs):
            for p in procs:
                p.read()
            missing = [p.name for p in procs if not p.record.done]
            return f"{', '.join(missing)} exited without finishing" if missing else ""
        if time.monotonic() > deadline:
            running = [p for p in procs if p.popen.poll() is None]
            stuck = [f"{p.name} in '{p.record.phase}'" for p in running]
            return f"timed out after {timeout_s:g}s; still running: {'; '.join(stuck)}" + _stacks(running)
        time.sleep(POLL_S)
