"""One process of `trainmover check-workload`: a reference rank or a joiner rank.

    python -m trainmover.check.proc '<ProcSpec as JSON>'     (started by trainmover.check.run)

Each writes JSON lines to its own file, read by the orchestrator as they come: `phase` (where
it is, for the deadline's message), `loss` per step, `state` (a fingerprint of the full state
after each step from the rollback point on), `encoding`, `sent`, `shadow`, `digest`, the
reference's `replayloss`/`replaystate`/`replaydigest` (its rollback), and `error` if it fails.
What it does is what the runtime does to a rank (runtime/worker.py, standby.py, switch.py): the
same groups, the same sandbox warm-up, the same state encoding, transfer and RNG capture.
"""
from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainmover.check.fingerprint import differences, fingerprint, unplain
from trainmover.check.plan import shadow_total
from trainmover.groups import rng
from trainmover.groups.specs import GroupSpec
from trainmover.groups.swappable import SandboxBackend, SwappableGroup, gloo_group
from trainmover.groups.tensors import digest_tensors, tensors_of
from trainmover.runtime.transfer import state as transfer
from trainmover.workloads import base as workloads
from trainmover.workloads import registry

REFERENCE, JOINER = "reference", "joiner"
HOST = "127.0.0.1"


@dataclass(frozen=True)
class ProcSpec:
    role: str            # reference or joiner
    rank: int
    world: int
    workload: str
    options: dict
    seed: int
    at: int              # the switch: after this many steps
    compare: int         # steps compared after it
    rollback: int        # the reference's replay starts from its state after this many steps
    store: tuple         # (host, port) of the check's TCPStore
    out: str             # this process's JSON-lines file
    timeout_s: float     # every collective and rendezvous
    max_shadow: int = 6  # as TM_SHADOW_STEPS: most shadow steps to reach a steady collective sequence
    restarts: tuple = ()  # fresh instances in the reference get the state after these many steps


class Emitter:
    """Appends one JSON object per line, flushed at once: the orchestrator reads as it goes."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)
        self.where = "starting"

    def phase(self, where: str) -> None:
        self.where = where
        self.emit("phase", phase=where)

    def emit(self, kind: str, **fields) -> None:
        self.file.write(json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")
        self.file.flush()


def full_state(wl: workloads.Workload, step: int) -> dict:
    """What a leaver sends (runtime/worker.py Agent.full_state): workload state, RNG, step."""
    sd = wl.state_dict()
    if not isinstance(sd, dict) or "model" not in sd:
        keys = f" with keys {sorted(sd)}" if isinstance(sd, dict) else ""
        raise TypeError(f"state_dict() must return a dict with a 'model' entry (the runtime digests model and "
                        f"optimizer); got {type(sd).__name__}{keys}")
    return {"workload": sd, "rng": rng.capture(), "step": step}


def digest(wl: workloads.Workload) -> str:
    """The digest the runtime writes into final.json for this rank (Agent.digest)."""
    sd = wl.state_dict()
    return digest_tensors(tensors_of({"model": sd["model"], "optimizer": sd.get("optimizer", {})}))


def group_specs(wl: workloads.Workload, world: int) -> list[GroupSpec]:
    specs = list(wl.group_specs(world))
    if "world" not in {g.name for g in specs}:
        specs.append(GroupSpec("world", tuple(range(world))))
    return specs


def make_groups(specs, rank: int, backend) -> dict[str, SwappableGroup]:
    """The rank's groups as the runtime makes them: SwappableGroups around `backend(spec, grank)`."""
    out = {}
    for g in specs:
        if rank in g.ranks:
            grank = g.ranks.index(rank)
            out[g.name] = SwappableGroup(g.name, grank, len(g.ranks), list(g.ranks), backend(g, grank))
    return out


def shadow_until_steady(wl: workloads.Workload, groups: dict[str, SwappableGroup], max_steps: int) -> int:
    """Shadow steps until one issues the same collectives as the one before (as the standby's
    shadow_until_steady, runtime/roles/standby.py): a joiner's wrappers do their one-time collectives here."""
    sandboxes = [g.inner for g in groups.values()]
    previous, steps = None, 0
    while steps < max_steps:
        marks = [len(b.calls) for b in sandboxes]
        wl.train_step(wl.shadow_data_step())
        steps += 1
        signature = [tuple(b.calls[m:]) for b, m in zip(sandboxes, marks)]
        if signature == previous:
            return steps
        previous = signature
    raise RuntimeError(f"collectives still changing after {max_steps} shadow steps")


def encoding(state: dict) -> dict:
    """Does the state survive the transfer's encoding (pack, the manifest's weights_only
    decoding, the checksum) unchanged?"""
    bad = unplain(state)
    if bad:
        return {"ok": False, "message": f"the state holds values the transfer cannot decode (torch.load with "
                f"weights_only=True): {', '.join(bad[:4])}; keep tensors, numbers, strings and "
                f"dicts/lists of them (a torch.Generator: its get_state())"}
    try:
        manifest, tensors, _ = transfer.pack(state)
        meta, into = transfer.unpack(manifest)
        with torch.no_grad():
            for dst, src in zip(into, tensors):
                dst.copy_(src)
        decoded, _ = transfer.assemble(meta, into)
    except Exception as exc:  # noqa: BLE001 - reported as the finding, with its text
        return {"ok": False, "message": f"the transfer's encoding failed: {exc}"}
    diffs = differences(fingerprint(state), fingerprint(decoded))
    return {"ok": not diffs, "diffs": diffs[:20], "tensors": len(tensors), "bytes": len(manifest) + sum(
        t.numel() * t.element_size() for t in tensors)}


def _context(spec: ProcSpec, groups, backend=None) -> workloads.BuildContext:
    """`backend(name, grank, size)`: the inner backend of a group the workload makes while it
    builds (a script's dist.new_group); default: sandboxed (a joiner before its state)."""
    backend = backend or (lambda name, grank, size: SandboxBackend(grank, size))

    def new_group(name: str, ranks: tuple[int, ...]):
        if spec.rank not in ranks:
            return None
        if name not in groups:  # a fresh run of the same script makes the same group again: the one made
            grank = list(ranks).index(spec.rank)
            groups[name] = SwappableGroup(name, grank, len(ranks), list(ranks), backend(name, grank, len(ranks)))
        return groups[name]
    return workloads.BuildContext(rank=spec.rank, world_size=spec.world, groups=groups, seed=spec.seed,
                                  options={**spec.options, "device": "cpu"}, before_update=lambda: None,
                                  new_group=new_group)


def _train(wl, out: Emitter, first: int, last: int, states_from: int, kind: str = "",
           groups: dict[str, SwappableGroup] | None = None, **extra) -> None:
    """Steps first+1..last (train_step(first)..train_step(last - 1)); a state fingerprint after
    each step from `states_from` on. `kind` prefixes the lines' kinds (a replay's, a restart's);
    `extra` goes into every line (a restart's point). With `groups`: the collectives each step
    issued in each of them (a joiner must issue what the rank it replaces would have)."""
    for step in range(first, last):
        out.phase(f"{kind + ' ' if kind else ''}step {step + 1}")
        before = {name: g.issued for name, g in (groups or {}).items()}
        loss = float(wl.train_step(step))
        out.emit(f"{kind}loss", step=step + 1, loss=loss, **extra)
        if groups:
            out.emit(f"{kind}collectives", step=step + 1, counts={n: g.issued - before[n] for n, g in groups.items()})
        if step + 1 >= states_from:
            out.emit(f"{kind}state", step=step + 1, fp=fingerprint(full_state(wl, step + 1)), **extra)


def _restore(wl, saved: dict) -> None:
    """As the snapshot and checkpoint tiers restore (runtime/worker.py Agent.load_full): a copy
    through load_state_dict, then the RNG."""
    wl.load_state_dict(transfer.host_copy(saved)["workload"])
    rng.restore(saved["rng"])


def reference(spec: ProcSpec, store, out: Emitter, timeout: datetime.timedelta) -> None:
    wl = registry.load(spec.workload, spec.options)
    if hasattr(wl, "inspect_all"):  # a script: look at its loop's frame at every boundary
        wl.inspect_all = True
    groups = make_groups(group_specs(wl, spec.world), spec.rank, lambda g, grank: gloo_group(
        store, f"ref/{g.name}/", grank, len(g.ranks), host=HOST, timeout=timeout))
    out.phase("build")

    def ref_backend(name: str, grank: int, size: int):
        return gloo_group(store, f"ref/{name}/", grank, size, host=HOST, timeout=timeout)
    wl.build(_context(spec, groups, ref_backend))
    # Host copies, as a snapshot keeps them (runtime/protection/snapshot.py): unaffected by later steps.
    keep = sorted({spec.rollback, *spec.restarts})
    saved: dict[int, dict] = {}
    first = min(keep)
    _train(wl, out, 0, first, states_from=first)
    for a, b in zip(keep, keep[1:] + [spec.at]):
        saved[a] = transfer.host_copy(full_state(wl, a))
        _train(wl, out, a, max(a, b), states_from=first)
    state = full_state(wl, spec.at)
    if hasattr(wl, "findings"):  # a script: what its loop uses that its state does not carry
        out.emit("script", findings=wl.findings())
    out.phase("encoding")
    enc = encoding(state)
    out.emit("encoding", **enc)
    if not enc["ok"] and "message" in enc:  # nothing could be sent: stop with the reason
        raise TypeError(enc["message"])
    out.phase("sending the state to its joiner")
    xfer = gloo_group(store, f"xfer/{spec.rank}/", 0, 2, host=HOST, timeout=timeout)
    stats = transfer.send_verified(state, xfer, key=None, dst=1)  # the check's own processes and store
    out.emit("sent", bytes=stats.bytes, tensors=stats.tensors, seconds=stats.seconds)
    end = spec.at + spec.compare
    _train(wl, out, spec.at, end, states_from=spec.at, groups=groups)
    out.emit("digest", digest=digest(wl))
    # Roll back and replay: the first replayed step is a step run twice from the same
    # (seed, rank, state).
    out.phase(f"rollback to step {spec.rollback}")
    _restore(wl, saved[spec.rollback])
    out.emit("replaystate", step=spec.rollback, fp=fingerprint(full_state(wl, spec.rollback)))
    _train(wl, out, spec.rollback, end, states_from=spec.rollback, kind="replay")
    out.emit("replaydigest", digest=digest(wl))
    # Restarts: a fresh instance (as one rebuilt from a checkpoint) given an early state. It
    # shares the reference's groups: both ranks build in the same order, so DDP's construction
    # collectives match. Instances are kept, never destroyed: tearing down a DDP reducer while
    # its group lives on aborted the process ("Resource deadlock avoided"); the process ends
    # with os._exit.
    alive = [wl]
    for r in spec.restarts:
        out.phase(f"restart from step {r}: build")
        fresh = registry.load(spec.workload, spec.options)
        fresh.build(_context(spec, groups, ref_backend))
        _restore(fresh, saved[r])
        out.emit("restartstate", step=r, fp=fingerprint(full_state(fresh, r)), r=r)
        _train(fresh, out, r, min(r + spec.compare, end), states_from=r, kind="restart", r=r)
        alive.append(fresh)


def joiner(spec: ProcSpec, store, out: Emitter, timeout: datetime.timedelta) -> None:
    wl = registry.load(spec.workload, spec.options)
    specs = group_specs(wl, spec.world)
    # As a standby: built on sandboxed groups and warmed up by shadow steps, then (as at a
    # join) re-pointed at new groups for the rank it takes, and warmed up again.
    out.phase("build on sandboxed groups")
    sandboxed = make_groups(specs, spec.rank, lambda g, grank: SandboxBackend(grank, len(g.ranks)))
    wl.build(_context(spec, sandboxed))
    out.phase("shadow steps on sandboxed groups")
    first = shadow_until_steady(wl, sandboxed, spec.max_shadow)
    groups = make_groups(specs, spec.rank, lambda g, grank: SandboxBackend(grank, len(g.ranks)))
    out.phase("rebind")
    wl.rebind(_context(spec, groups))
    out.phase("shadow steps after the rebind")
    steady = first + shadow_until_steady(wl, groups, spec.max_shadow)
    total = shadow_total(spec.at, steady, spec.compare)
    for _ in range(total - steady):
        wl.train_step(wl.shadow_data_step())
    out.emit("shadow", steps=total)
    out.phase("building the joiner's groups")
    real = {name: gloo_group(store, f"join/{name}/", g.rank(), g.size(), host=HOST, timeout=timeout)
            for name, g in groups.items()}
    out.phase("waiting for the state")
    xfer = gloo_group(store, f"xfer/{spec.rank}/", 1, 2, host=HOST, timeout=timeout)
    state, _ = transfer.recv_verified(xfer, key=None, src=0, like=full_state(wl, 0))
    wl.load_state_dict(state["workload"])
    rng.restore(state["rng"])
    for name, g in groups.items():
        g.swap(real[name])
    out.emit("state", step=spec.at, fp=fingerprint(full_state(wl, spec.at)))
    _train(wl, out, spec.at, spec.at + spec.compare, states_from=spec.at, groups=groups)
    out.emit("digest", digest=digest(wl))


def run(spec: ProcSpec) -> int:
    out = Emitter(spec.out)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    try:
        store = dist.TCPStore(spec.store[0], int(spec.store[1]), is_master=False, timeout=timeout,
                              wait_for_workers=False)
        (reference if spec.role == REFERENCE else joiner)(spec, store, out, timeout)
        out.emit("done")
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the orchestrator
        lines = traceback.format_exception(exc)
        out.emit("error", phase=out.where, error=f"{type(exc).__name__}: {exc}", trace="".join(lines)[-4000:])
        return 1


def main() -> None:
    spec = ProcSpec(**json.loads(sys.argv[1]))
    # Past the check's deadline the orchestrator asks each process still running for its threads'
    # stacks (into its log) before killing it: 'in step 1' alone does not say where a step hangs.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)  # as the runtime's workers: determinism and fair sharing of the cores
    code = run(spec)
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: destroying gloo contexts whose peers have gone can abort or hang.
    os._exit(code)


if __name__ == "__main__":
    main()

