"""Recorded collectives: a live rank records, a standby replays and computes the same losses."""
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainmover.errors import MigrationError
from trainmover.groups.swappable import SandboxBackend, SwappableGroup, gloo_group
from trainmover.sandbox.recording import RecordingBackend, RecordingWriter, Replay
from trainmover.workloads.base import BuildContext
from trainmover.workloads.gpt_demo import GPTDemo
from tests.unit.late_store import LateStore

h5py = pytest.importorskip("h5py")
TIMEOUT = datetime.timedelta(seconds=30)
ITERATIONS = 3


def live_run(tmp_path, store):
    """Two live ranks (separate processes: torch's RNG is per process) train 5 steps; rank 0
    records its first ITERATIONS. Returns the ranks' losses and the recording's size."""
    ctx = mp.get_context("fork")
    port = store.port
    queue = ctx.Queue()

    def rank(r):
        losses = {}
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
        torch.set_num_threads(1)
        group = SwappableGroup("world", r, 2, [0, 1], gloo_group(client, "w/", r, 2, host="127.0.0.1", timeout=TIMEOUT))
        writer = None
        if r == 0:  # recording covers the workload's construction too (DDP's set-up collectives)
            writer = RecordingWriter(tmp_path / "rank0.h5", rank=0, iterations=ITERATIONS)
            live = group.swap(RecordingBackend(group.inner, writer, "world"))
            writer.begin("init")
        wl = GPTDemo("tiny")
        wl.build(BuildContext(r, 2, {"world": group}, seed=7))
        out = []
        for step in range(5):
            if writer and step < ITERATIONS:
                writer.begin(step)
            out.append(wl.train_step(step))
            if writer and step < ITERATIONS:
                writer.end_iteration(out[-1])
                if step == ITERATIONS - 1:
                    group.swap(live)  # the hook is removed after the recorded iterations
                    losses["bytes"] = writer.close()
                    losses["overhead_s"] = writer.overhead_s
        losses[r] = out
        queue.put(losses)

    procs = [ctx.Process(target=rank, args=(r,)) for r in (0, 1)]
    [p.start() for p in procs]
    store.serve()  # after the fork: late_store says why
    merged = {}
    for _ in procs:
        merged.update(queue.get(timeout=120))
    [p.join(30) for p in procs]
    return merged


@pytest.fixture
def recorded(tmp_path):
    store = LateStore(TIMEOUT)
    losses = live_run(tmp_path, store)
    store.close()
    return tmp_path / "rank0.h5", losses


def shadow(path, preset="tiny", iterations=ITERATIONS):
    replay = Replay(path)
    group = SwappableGroup("world", 0, 2, [0, 1], SandboxBackend(0, 2, answers=replay.for_group("world")))
    wl = GPTDemo(preset)
    replay.begin("init")
    wl.build(BuildContext(0, 2, {"world": group}, seed=7))
    got = []
    for it in range(iterations):
        replay.begin(it)
        got.append((replay.loss(it), wl.train_step(it)))
    return got


def test_shadow_iterations_compute_the_recorded_losses(recorded):
    path, live = recorded
    assert live["bytes"] > 0 and live["overhead_s"] >= 0
    pairs = shadow(path)
    assert [rec for rec, _ in pairs] == live[0][:ITERATIONS]
    assert all(rec == got for rec, got in pairs), pairs


def test_recording_is_chunked_and_not_compressed(recorded):
    path, _ = recorded
    with h5py.File(path, "r") as f:
        assert f.attrs["complete"] and int(f.attrs["iterations"]) == ITERATIONS
        ds = f["it0/00000"]
        assert ds.compression is None and ds.chunks is not None  # see recording.RecordingWriter._write
        assert ds.attrs["group"] == "world" and ds.attrs["op"]


def test_a_step_that_differs_from_the_recording_is_a_clear_error(recorded):
    """A standby whose model differs from the recorded rank's asks for other shapes."""
    path, _ = recorded
    replay = Replay(path)
    group = SwappableGroup("world", 0, 2, [0, 1], SandboxBackend(0, 2))
    wl = GPTDemo("small")
    wl.build(BuildContext(0, 2, {"world": group}, seed=7))
    group.swap(SandboxBackend(0, 2, answers=replay.for_group("world")))
    replay.begin(0)
    with pytest.raises(MigrationError, match=r"iteration 0 collective #0: the step asked for allreduce on world, "
                                             r"shape \[\d+\], torch.float32, the recording has allreduce on world, shape"):
        wl.train_step(0)


def test_a_recording_is_written_through_a_unique_temporary_never_a_planted_link(tmp_path):
    """A fixed `<file>.part` name (before issue 37) would have been opened through a link
    planted there: the writer's temporary is a fresh O_EXCL file of its own."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (tmp_path / "r.h5.part").symlink_to(victim)  # what the old name would have written through
    w = RecordingWriter(tmp_path / "r.h5", rank=0, iterations=1)
    w.file.close()
    assert w.tmp.name != "r.h5.part" and not w.tmp.is_symlink() and w.tmp.parent == tmp_path
    assert victim.read_bytes() == b"keep"


def test_incomplete_recording_is_refused(tmp_path):
    w = RecordingWriter(tmp_path / "r.h5", rank=0, iterations=1)
    w.file.close()
    w.tmp.rename(tmp_path / "r.h5")
    with pytest.raises(MigrationError, match="incomplete"):
        Replay(tmp_path / "r.h5")


def test_tensor_in_tensor_out_collectives_record_their_one_output(tmp_path):
    """`_reduce_scatter_base` / `_allgather_base` (Megatron's distributed optimizer) take
    (output, input) tensors: the output is recorded whole, and a replay answers it."""
    writer = RecordingWriter(tmp_path / "r.h5", rank=0, iterations=1)
    live = RecordingBackend(SandboxBackend(0, 2), writer, "dp")
    writer.begin(0)
    shard, full = torch.empty(4), torch.empty(8)
    live._reduce_scatter_base(shard, torch.arange(8.0))
    live._allgather_base(full, torch.arange(4.0) + 10)
    writer.end_iteration(1.0)
    writer.close()
    rec = Replay(tmp_path / "r.h5")
    rec.begin(0)
    sandbox = SandboxBackend(0, 2, answers=rec.for_group("dp"))
    got_shard, got_full = torch.full((4,), -1.0), torch.full((8,), -1.0)
    sandbox._reduce_scatter_base(got_shard, torch.zeros(8))
    sandbox._allgather_base(got_full, torch.zeros(4))
    assert torch.equal(got_shard, shard) and torch.equal(got_full, full)
    with pytest.raises(MigrationError, match="only 2 were recorded"):
        sandbox._reduce_scatter_base(torch.empty(4), torch.zeros(8))
