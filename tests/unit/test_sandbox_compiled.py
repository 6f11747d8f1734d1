"""gpt_demo with torch.compile (TM_WORKLOAD_OPTIONS=compile=true) under DDP: the live rank
records, the standby compiles during its shadow iterations and reproduces the recorded
losses, and after a rebind (the joiner's new DDP wrapper) the shadow steps leave nothing to
compile for the first real step."""
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainmover.config import Config, parse_options
from trainmover.errors import ConfigError
from trainmover.groups.specs import GroupSpec
from trainmover.groups.swappable import SwappableGroup, gloo_group
from trainmover.sandbox import shadow
from trainmover.sandbox.live import Recorder
from trainmover.workloads.base import BuildContext
from trainmover.workloads.gpt_demo import GPTDemo
from tests.unit.late_store import LateStore

h5py = pytest.importorskip("h5py")
TIMEOUT = datetime.timedelta(seconds=60)


def test_workload_options_are_parsed_and_validated():
    assert parse_options("compile=true, lr=0.01,name=x") == {"compile": True, "lr": 0.01, "name": "x"}
    assert Config.from_env({"TM_WORKLOAD_OPTIONS": "compile=true"}).workload_options == "compile=true"
    for bad in ("compile", "=1", "preset=1b"):
        with pytest.raises(ConfigError):
            parse_options(bad)
    with pytest.raises(ConfigError, match="TM_STANDBY_WARMUP"):
        Config(standby_warmup="lukewarm")
    with pytest.raises(ConfigError, match="compile='maybe'"):
        GPTDemo("tiny", compile="maybe")
    assert GPTDemo("tiny", compile="true").compile and not GPTDemo("tiny").compile


def graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def live_run(base, store):
    ctx = mp.get_context("fork")
    port = store.port
    queue = ctx.Queue()

    def rank(r):
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
        torch.set_num_threads(1)
        group = SwappableGroup("world", r, 2, [0, 1], gloo_group(client, "w/", r, 2, host="127.0.0.1", timeout=TIMEOUT))
        rec = Recorder({"world": group}, base, 0, 3, skip="control", steady_steps=1) if r == 0 else None
        wl = GPTDemo("tiny", compile=True)
        wl.build(BuildContext(r, 2, {"world": group}, seed=7))
        losses = []
        for step in range(5):
            if rec:
                rec.before(step)
            losses.append(wl.train_step(step))
            if rec:
                rec.after(step, losses[-1], 0.0)
        if rec:
            rec.close()
        queue.put((r, losses))

    procs = [ctx.Process(target=rank, args=(r,)) for r in (0, 1)]
    [p.start() for p in procs]
    store.serve()  # after the fork: late_store says why
    out = dict(queue.get(timeout=400) for _ in procs)
    [p.join(60) for p in procs]
    return out


@pytest.mark.timeout(600)
def test_compiled_standby_reproduces_losses_and_its_first_real_step_is_warm(tmp_path):
    store = LateStore(TIMEOUT)
    live = live_run(tmp_path / "rank0.h5", store)
    store.close()

    wl = GPTDemo("tiny", compile=True)

    def build(rank, groups):
        wl.build(BuildContext(rank, 2, groups, seed=7))

    groups, report = shadow.replay([GroupSpec("world", (0, 1))], tmp_path / "rank0.h5", 30, "control", build,
                                   wl.train_step)
    assert report["loss_equal"] and report["recorded_losses"] == live[0][:3], report
    assert graphs() > 0  # the standby compiled during its shadow iterations

    # The joiner's path: a new DDP wrapper on its new groups, then shadow steps in the sandbox.
    wl.rebind(BuildContext(0, 2, groups, seed=7))
    for _ in range(2):
        wl.train_step(2)
    before = graphs()
    wl.train_step(3)  # the first real step: nothing left to compile
    assert graphs() == before


def test_cold_standby_keeps_the_compiled_bucket_layout_and_compiles_its_first_real_step(monkeypatch, tmp_path):
    """TM_STANDBY_WARMUP=cold (the benchmark's cold joiner). Its shadow steps cannot run
    eagerly: DDP fixes its bucket layout from its first step's gradient order, and an eager
    backward orders gradients unlike a compiled one, so an eager-rehearsed joiner would reduce
    other parameters than the stayers at the same offsets. It compiles, then forgets the code."""
    from trainmover.runtime.roles import standby
    from trainmover.groups.swappable import SandboxBackend

    def rehearsed(compile):
        group = SwappableGroup("world", 0, 2, [0, 1], SandboxBackend(0, 2))
        wl = GPTDemo("tiny", compile=compile)
        wl.build(BuildContext(0, 2, {"world": group}, seed=7))
        for step in range(3):  # DDP rebuilds its buckets in the second
            wl.train_step(step)
        return wl
    compiled, eager = rehearsed(True), rehearsed(False)
    layout = compiled.collective_layout()
    assert "params" in layout and layout != eager.collective_layout()  # what a joiner checks
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # restored after the test
        monkeypatch.setenv(var, str(tmp_path / var))
    standby.forget_compiled("test")
    before = graphs()
    compiled.train_step(3)
    assert graphs() > before  # compiled again: the cold joiner's first real step pays it
    assert compiled.collective_layout() == layout
