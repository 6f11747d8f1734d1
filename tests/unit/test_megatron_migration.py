"""Megatron-core TP2 x PP2 x DP2 with ranks replaced mid-run: bit-exact, no Slurm.

Eight forked processes train on gloo groups (a TCPStore in the test process); for each
planned migration a ninth process plays the standby: it builds the workload on sandboxed
groups for another rank, rebinds to the leaver's rank, then, at the switch step, the
changed groups are rebuilt (trainmover.groups.specs.delta), the leaver's full state moves
over trainmover.runtime.transfer.state, and the joiner trains on. Losses of every step and the
final parameter/optimizer digests of every rank must equal an uninterrupted run's; with the
optimizer state left out of the copy they must not (negative control).

Torch and Megatron are imported once, here, before the fork (importing costs ~3 s a process).
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import traceback

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402

import trainmover.megatron.stack  # noqa: E402,F401  - Megatron imported before the fork
from tests.unit.late_store import LateStore  # noqa: E402
from trainmover.groups import rng  # noqa: E402
from trainmover.groups.specs import delta  # noqa: E402
from trainmover.groups.swappable import SandboxBackend, SwappableGroup, gloo_group  # noqa: E402
from trainmover.groups.tensors import digest_tensors, tensors_of  # noqa: E402
from trainmover.runtime.transfer import state as transfer  # noqa: E402
from trainmover.runtime.phase1 import xfer_prefix  # noqa: E402
from trainmover.workloads import base as workloads  # noqa: E402
from trainmover.workloads import registry  # noqa: E402

KEY = b"k" * 32  # the job's key: the manifest crosses the pair sealed with it

TIMEOUT = datetime.timedelta(seconds=90)
LAYOUT = {"tp": 2, "pp": 2, "dp": 2}
WORLD = 8
STEPS = 7
SEED = 1234
# Rank coordinates (tp, dp, pp): rank = tp + 2*dp + 4*pp.
FIRST_STAGE, LAST_STAGE, TP_PEER = 2, 7, 1   # (0,1,0) first stage; (1,1,1) last stage; (1,0,0)


class Job:
    """One process's part: its rank's workload, groups and losses."""

    def __init__(self, store, options: dict):
        self.store, self.options = store, options
        self.workload = registry.load("megatron_gpt", options)
        self.specs = self.workload.group_specs(WORLD)
        self.groups: dict[str, SwappableGroup] = {}
        self.losses: dict[int, float] = {}

    def make_groups(self, rank: int, sandbox: bool) -> None:
        self.groups = {}
        for g in self.specs:
            if rank in g.ranks:
                grank = g.ranks.index(rank)
                inner = (SandboxBackend(grank, len(g.ranks)) if sandbox else
                         gloo_group(self.store, f"tm/e0/{g.name}/", grank, len(g.ranks), host="127.0.0.1",
                                    timeout=TIMEOUT))
                self.groups[g.name] = SwappableGroup(g.name, grank, len(g.ranks), list(g.ranks), inner)

    def build(self, rank: int) -> None:
        self.rank = rank
        self.workload.build(workloads.BuildContext(rank=rank, world_size=WORLD, groups=self.groups, seed=SEED,
                                                   options={"device": "cpu"}))
        self.initial_tracker = {k: v.clone() for k, v in self.workload.state_dict()["rng_tracker"].items()}

    def new_backends(self, d, rank: int) -> dict:
        return {g.name: gloo_group(self.store, d.prefix(g), g.ranks.index(rank), len(g.ranks), host="127.0.0.1",
                                   timeout=TIMEOUT) for g in d.groups_to_build(rank)}

    def full_state(self, step: int) -> dict:
        return {"workload": self.workload.state_dict(), "rng": rng.capture(), "step": step}

    def digest(self) -> str:
        sd = self.workload.state_dict()
        return digest_tensors(tensors_of({"model": sd["model"], "optimizer": sd["optimizer"]}))


def _train(job: Job, start: int, migrations: list[tuple[int, int]], drop: str | None = None):
    """Train from `start`; at each boundary of `migrations` ((step, leaver), epoch = index + 1)
    act as stayer or leaver. Returns ("left", losses) or ("done", losses, digest).
    `drop` (negative controls): the leaver leaves its optimizer state out of the copy, or
    sends the RNG tracker states it had at build time instead of the current ones."""
    for step in range(start, STEPS):
        job.losses[step] = job.workload.train_step(step)
        boundary = step + 1
        for epoch, (at, leaver) in enumerate(migrations, start=1):
            if at != boundary:
                continue
            d = delta(job.specs, {leaver}, epoch)
            if job.rank == leaver:
                xfer = gloo_group(job.store, xfer_prefix(epoch, leaver), 0, 2, host="127.0.0.1", timeout=TIMEOUT)
                state = job.full_state(boundary)
                if drop == "optimizer":
                    state["workload"].pop("optimizer")
                elif drop == "rng_tracker":
                    state["workload"]["rng_tracker"] = job.initial_tracker
                elif drop == "main_params":  # what a joiner would derive from the bf16 model params
                    opt = state["workload"]["optimizer"]
                    opt["main_params"] = [[t.to(torch.bfloat16).float() for t in part] for part in opt["main_params"]]
                transfer.send_state(state, xfer, key=KEY, dst=1)
                return ("left", job.losses)
            for name, backend in job.new_backends(d, job.rank).items():
                job.groups[name].swap(backend)
    return ("done", job.losses, job.digest())


def _worker(rank, port, options, migrations, drop, results):
    try:
        torch.set_num_threads(1)
        job = Job(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT), options)
        job.make_groups(rank, sandbox=False)
        job.build(rank)
        results.put((rank, "worker", _train(job, 0, migrations, drop), None))
    except Exception:  # noqa: BLE001 - reported to the test with the rank
        results.put((rank, "worker", None, traceback.format_exc()))


def _joiner(index, port, options, migrations, drop, results):
    """The standby for migration `index`: warm on another rank's role, then take the leaver's."""
    at, leaver = migrations[index]
    epoch = index + 1
    try:
        torch.set_num_threads(1)
        job = Job(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT), options)
        rehearse = (leaver + 4) % WORLD  # the other pipeline stage: rebind must change the stage
        job.make_groups(rehearse, sandbox=True)
        job.build(rehearse)
        for _ in range(2):
            job.workload.train_step(job.workload.shadow_data_step())
        job.make_groups(leaver, sandbox=True)
        job.workload.rebind(workloads.BuildContext(rank=leaver, world_size=WORLD, groups=job.groups, seed=SEED,
                                                   options={"device": "cpu"}))
        job.rank = leaver
        for _ in range(2):
            job.workload.train_step(job.workload.shadow_data_step())
        d = delta(job.specs, {leaver}, epoch)
        backends = job.new_backends(d, leaver)
        xfer = gloo_group(job.store, xfer_prefix(epoch, leaver), 1, 2, host="127.0.0.1", timeout=TIMEOUT)
        state, _ = transfer.recv_state(xfer, key=KEY, src=0, like=job.full_state(0))
        assert state["step"] == at
        job.workload.load_state_dict(state["workload"])
        rng.restore(state["rng"])
        for name, backend in backends.items():
            job.groups[name].swap(backend)
        results.put((leaver, f"joiner{epoch}", _train(job, at, migrations), None))
    except Exception:  # noqa: BLE001
        results.put((leaver, f"joiner{epoch}", None, traceback.format_exc()))


def run_job(distributed_optimizer: bool, migrations=(), drop=None, dtype="fp32"):
    """Per rank: the losses of every step (whoever played the rank) and the final digest."""
    store = LateStore(TIMEOUT)  # its server starts after the fork (late_store.py says why)
    port = store.port
    options = {**LAYOUT, "distributed_optimizer": distributed_optimizer, "dtype": dtype}
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, options, list(migrations), drop, results))
             for r in range(WORLD)]
    procs += [ctx.Process(target=_joiner, args=(i, port, options, list(migrations), drop, results))
              for i in range(len(migrations))]
    for p in procs:
        p.start()
    store.serve()
    losses = {r: {} for r in range(WORLD)}
    digests, errors = {}, []
    try:
        for _ in procs:
            rank, role, out, error = results.get(timeout=300)
            if error:
                errors.append(f"rank {rank} ({role}):\n{error}")
                break
            losses[rank].update(out[1])
            if out[0] == "done":
                digests[rank] = out[2]
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    store.close()
    assert not errors, errors[0]
    return losses, digests


@pytest.fixture(scope="module")
def reference():
    return {flag: run_job(flag) for flag in (False, True)}


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp-optimizer", "distributed-optimizer"])
def test_first_stage_last_stage_and_tp_peer_migrations_are_bit_exact(reference, distributed_optimizer):
    ref_losses, ref_digests = reference[distributed_optimizer]
    assert len(ref_digests) == WORLD and all(len(ref_losses[r]) == STEPS for r in range(WORLD))
    migrations = [(2, FIRST_STAGE), (4, LAST_STAGE), (5, TP_PEER)]
    losses, digests = run_job(distributed_optimizer, migrations)
    for r in range(WORLD):
        assert losses[r] == ref_losses[r], f"rank {r}: losses differ from the uninterrupted run"
        assert digests[r] == ref_digests[r], f"rank {r}: parameter/optimizer digest differs"


def test_reference_runs_are_not_trivially_equal(reference):
    """The two optimizer modes hold different optimizer states (shards vs full), and the
    loss falls: the digests compared above carry information."""
    (losses_ddp, digests_ddp), (_, digests_dist) = reference[False], reference[True]
    assert digests_ddp[0] != digests_dist[0]
    assert losses_ddp[0][STEPS - 1] < losses_ddp[0][0]


@pytest.mark.parametrize("drop", ["optimizer", "rng_tracker"])
def test_without_a_part_of_the_state_the_run_diverges(reference, drop):
    """Negative controls: the joiner keeps its own optimizer state (the leaver's shard is
    what makes the distributed optimizer exact), or its own model-parallel RNG tracker
    (dropout inside tensor-parallel regions draws from it)."""
    _, ref_digests = reference[True]
    _, digests = run_job(True, [(2, LAST_STAGE)], drop=drop)
    assert digests[LAST_STAGE] != ref_digests[LAST_STAGE]


@pytest.fixture(scope="module")
def bf16_reference():
    return run_job(True, dtype="bf16")


def test_bf16_migrations_are_bit_exact_and_need_the_fp32_main_params(bf16_reference):
    """bf16 (the GPU configuration) with the distributed optimizer: the joiner gets the
    leaver's fp32 main params too. Negative control: main params re-derived from the bf16
    model params (what a joiner that did not receive them would hold) change the digest."""
    ref_losses, ref_digests = bf16_reference
    losses, digests = run_job(True, [(2, FIRST_STAGE), (4, LAST_STAGE)], dtype="bf16")
    for r in range(WORLD):
        assert losses[r] == ref_losses[r], f"rank {r}: losses differ from the uninterrupted bf16 run"
        assert digests[r] == ref_digests[r], f"rank {r}: parameter/optimizer digest differs"
    _, digests = run_job(True, [(2, LAST_STAGE)], drop="main_params", dtype="bf16")
    assert digests[LAST_STAGE] != ref_digests[LAST_STAGE]
