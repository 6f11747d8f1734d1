"""What Megatron needs from the runtime's groups: the collectives it issues through
torch.distributed (tensor reduce-scatter/all-gather, coalesced buckets, p2p by global rank),
c10d's view of our groups, sandbox answers for shadow steps, and the CPU compat layer."""
from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from trainmover.groups.swappable import SandboxBackend, SwappableGroup
from tests.unit.gloo_world import gloo_groups, serve_store

pytestmark = pytest.mark.gloo_threads  # see tests/unit/conftest.py

TIMEOUT = datetime.timedelta(seconds=20)


@pytest.fixture
def pair():
    """Two SwappableGroups over one real gloo group (threads of this process)."""
    master, port = serve_store(TIMEOUT)
    yield [SwappableGroup("dp.0", r, 2, [0, 1], g) for r, g in enumerate(gloo_groups(port, "t/", 2, TIMEOUT))]
    del master


def both(groups, fn):
    """Run fn(group, rank) on both members at once; returns their results."""
    results, errors = [None, None], []

    def run(r):
        try:
            results[r] = fn(groups[r], r)
        except Exception as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    if errors:
        raise errors[0]
    return results


def test_tensor_reduce_scatter_and_all_gather_through_torch_distributed(pair):
    def run(g, r):
        full = torch.arange(4, dtype=torch.float32) + 10 * r
        shard = torch.empty(2)
        dist.reduce_scatter_tensor(shard, full, group=g)
        gathered = torch.empty(4)
        dist.all_gather_into_tensor(gathered, shard, group=g)
        return shard, gathered
    (s0, g0), (s1, g1) = both(pair, run)
    assert s0.tolist() == [10.0, 12.0] and s1.tolist() == [14.0, 16.0]
    assert g0.tolist() == g1.tolist() == [10.0, 12.0, 14.0, 16.0]


@pytest.mark.parametrize("async_ops", [False, True])
def test_coalesced_buckets_as_megatrons_ddp_issues_them(pair, async_ops):
    def run(g, r):
        a, b = torch.full((3,), 1.0 + r), torch.full((2,), 5.0 * (r + 1))
        shards = [torch.empty(2), torch.empty(1)]
        with dist._coalescing_manager(group=g, async_ops=async_ops) as cm:
            dist.all_reduce(a, group=g, async_op=async_ops)
            dist.all_reduce(b, group=g, async_op=async_ops)
        if async_ops:
            cm.wait()
        with dist._coalescing_manager(group=g, async_ops=async_ops) as cm:
            dist.reduce_scatter_tensor(shards[0], torch.arange(4.0) * (r + 1), group=g, async_op=async_ops)
            dist.reduce_scatter_tensor(shards[1], torch.tensor([1.0, 2.0]), group=g, async_op=async_ops)
        if async_ops:
            cm.wait()
        return a, b, shards
    (a0, b0, sh0), (a1, b1, sh1) = both(pair, run)
    assert a0.tolist() == a1.tolist() == [3.0] * 3 and b0.tolist() == b1.tolist() == [15.0] * 2
    assert [s.tolist() for s in sh0] == [[0.0, 3.0], [2.0]] and [s.tolist() for s in sh1] == [[6.0, 9.0], [4.0]]


def test_sandbox_answers_what_a_shadow_pipeline_step_needs():
    box = SandboxBackend(1, 2)
    g = SwappableGroup("pp.0", 1, 2, [3, 7], box)
    out = torch.empty(2)
    g.reduce_scatter_single(out, torch.tensor([1.0, 2.0, 3.0, 4.0])).wait()
    assert out.tolist() == [3.0, 4.0]  # own rank's chunk
    act = torch.full((2, 2), float("nan"), requires_grad=True)  # pipeline activations require grad
    g.recv([act], 0).wait()
    assert act.detach().eq(0).all()
    assert [op for op, _ in box.calls] == ["reduce_scatter", "recv"]


def test_c10d_knows_our_groups_and_forgets_them(monkeypatch):
    from trainmover.megatron import c10d
    world = SwappableGroup("world", 5, 8, list(range(8)), SandboxBackend(5, 8))
    pp = SwappableGroup("pp.1", 1, 2, [1, 5], SandboxBackend(1, 2))
    assert not dist.is_initialized()
    c10d.install(world, [world, pp], "gloo")
    try:
        assert dist.is_initialized() and dist.get_rank() == 5 and dist.get_world_size() == 8
        assert dist.get_rank(group=pp) == 1 and dist.get_process_group_ranks(pp) == [1, 5]
        assert dist.get_global_rank(pp, 0) == 1 and dist.get_backend(pp) == "gloo"
        t = torch.ones(3)
        dist.send(t, dst=1, group=pp)  # by global rank, as Megatron's p2p does: group rank 0
        dist.recv(t, src=1, group=pp)
        assert [op for op, _ in pp.inner.calls] == ["send", "recv"] and t.eq(0).all()
    finally:
        c10d.uninstall()
    assert not dist.is_initialized()
    with pytest.raises(KeyError):
        dist.get_process_group_ranks(pp)


def test_cpu_compat_is_scoped_to_megatron():
    pytest.importorskip("megatron.core")
    if torch.cuda.is_available():
        pytest.skip("the compat layer is off where CUDA exists")
    import trainmover.megatron.stack  # noqa: F401 - activates it
    from megatron.core import utils as megatron_utils
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from trainmover.megatron import compat
    assert compat.active() and compat.activate()  # idempotent
    assert megatron_utils.torch.cuda.current_device() == torch.device("cpu")
    assert megatron_utils.torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.zeros(1).type() == "torch.FloatTensor" and torch.cuda is not megatron_utils.torch.cuda
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("tm-test", 7)
    before = torch.get_rng_state()
    with tracker.fork("tm-test"):
        first = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched by the fork
    with tracker.fork("tm-test"):
        second = torch.rand(2)
    assert not torch.equal(first, second)  # the tracked stream advanced
    tracker.reset()


def _process_groups(roots, depth: int = 4) -> dict[int, dist.ProcessGroup]:
    """Every ProcessGroup reachable from `roots` through attributes, dicts and lists."""
    found, seen = {}, set()
    frontier = list(roots)
    for _ in range(depth):
        nxt = []
        for obj in frontier:
            if id(obj) in seen or isinstance(obj, (torch.Tensor, str, int, float, type)):
                continue
            seen.add(id(obj))
            if isinstance(obj, dist.ProcessGroup):
                found[id(obj)] = obj
                continue
            if isinstance(obj, dict):
                nxt += list(obj.values())
            elif isinstance(obj, (list, tuple, set)):
                nxt += list(obj)
            elif hasattr(obj, "__dict__"):
                nxt += list(vars(obj).values())
        frontier = nxt
    return found


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_every_group_megatron_holds_is_a_runtime_group(distributed_optimizer):
    """Rank 5 (last stage, TP peer) of TP2 x PP2 x DP2, built in this process on sandboxed
    groups: parallel_state, DDP, its buckets, the optimizer and the model's layers hold only
    SwappableGroups the runtime built, so a swap reaches every reference. One shadow step
    runs (the sandbox answers the pipeline's receives)."""
    pytest.importorskip("megatron.core")
    import math

    from megatron.core import parallel_state

    from trainmover.megatron import c10d
    from trainmover.workloads import base as workloads
    from trainmover.workloads import registry
    wl = registry.load("megatron_gpt", {"tp": 2, "pp": 2, "dp": 2, "distributed_optimizer": distributed_optimizer})
    rank = 5
    groups = {g.name: SwappableGroup(g.name, g.ranks.index(rank), len(g.ranks), list(g.ranks),
                                     SandboxBackend(g.ranks.index(rank), len(g.ranks)))
              for g in wl.group_specs(8) if rank in g.ranks}
    wl.build(workloads.BuildContext(rank=rank, world_size=8, groups=groups, seed=1, options={"device": "cpu"}))
    try:
        assert math.isfinite(wl.train_step(0))
        held = _process_groups([wl.stack.ddp, wl.stack.optimizer, list(wl.stack.model.modules()),
                                {k: v for k, v in vars(parallel_state).items() if k.startswith("_")}])
        ours = {id(g) for g in groups.values()}
        assert len(held) >= 5 and set(held) <= ours, [g for i, g in held.items() if i not in ours]
        assert parallel_state.get_pipeline_model_parallel_group().global_ranks == [1, 5]
        assert parallel_state.get_tensor_model_parallel_group().global_ranks == [4, 5]
        assert parallel_state.get_data_parallel_group().global_ranks == [5, 7]
        assert parallel_state.get_embedding_group().global_ranks == [1, 5]
    finally:
        parallel_state.destroy_model_parallel()
        c10d.uninstall()


@pytest.mark.parametrize("preset", ["tiny", "tiny3"])
def test_bf16_model_size_and_fp32_main_params(preset):
    """One rank on sandboxed groups, bf16: the whole model is bf16 (the learned position
    embedding included), `param_count` (the benchmark's model size) is exact, and the
    optimizer state carries fp32 main params, one per model param."""
    pytest.importorskip("megatron.core")
    import math

    from megatron.core import parallel_state

    from trainmover.megatron import c10d
    from trainmover.workloads import base as workloads
    from trainmover.workloads import registry
    from trainmover.workloads.megatron_gpt import param_count
    wl = registry.load("megatron_gpt", {"preset": preset, "tp": 1, "pp": 1, "dp": 1, "dtype": "bf16",
                                         "distributed_optimizer": True})
    groups = {g.name: SwappableGroup(g.name, 0, 1, [0], SandboxBackend(0, 1)) for g in wl.group_specs(1)}
    wl.build(workloads.BuildContext(rank=0, world_size=1, groups=groups, seed=1, options={"device": "cpu"}))
    try:
        assert math.isfinite(wl.train_step(0))
        params = list(wl.stack.model.parameters())
        assert sum(p.numel() for p in params) == param_count(preset)
        assert {p.dtype for p in params} == {torch.bfloat16}
        main = [t for part in wl.state_dict()["optimizer"]["main_params"] for t in part]
        assert {t.dtype for t in main} == {torch.float32} and len(main) == len(params)
    finally:
        parallel_state.destroy_model_parallel()
        c10d.uninstall()
