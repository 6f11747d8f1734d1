"""Snapshots into host slabs (capture.py), a one-node job's standby holding them over gloo
(holding.py: threads of one process stand for the worker and the standby), the one-node
Snapshots that skip a version while the one before is still on its way, and the restore into a
standby's own buffers. The CUDA path (pinned, side stream, gate) has its own test, skipped
without a GPU."""
import datetime
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from trainmover.groups.tensors import digest_tensors, tensors_of
from trainmover.protocol.messages import HoldMsg
from trainmover.runtime.protection import capture, holding
from trainmover.runtime.transfer import state as transfer
from trainmover.runtime.protection.snapshot import Snapshots

KEY = b"k" * 32  # the job's key: the rendezvous values are tagged with it (protocol/store.py)
TIMEOUT_S = 20


def state(step: int, seed: int = 0) -> tuple[dict, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters())
    # AdamW's state as after two steps, set rather than computed: a forked test (gloo_threads)
    # can neither run autograd once the parent has ("Autograd and Fork") nor call step(), whose
    # graph-capture check touches CUDA, on a CUDA build whose parent used the GPU (seen on an H100).
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(2.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
    return ({"workload": {"model": model.state_dict(), "optimizer": opt.state_dict(), "data": {"cursor": step}},
             "rng": {"torch": torch.get_rng_state()}, "step": step}, model, opt)


def digest(s: dict) -> str:
    return digest_tensors(tensors_of(s))


def test_a_capture_is_the_state_of_its_step_and_reuses_its_slab():
    live, model, _ = state(10)
    cap = capture.Capture("cpu", slabs=1)
    first = cap.take(10, live)
    first.wait(TIMEOUT_S)
    kept = first.state()
    assert digest(kept) == digest(live) and kept["step"] == 10 and kept["workload"]["data"]["cursor"] == 10
    assert first.digest == capture.word_digest(first.specs, capture.word_sums(first.slab.views))
    with torch.no_grad():
        model[0].weight.add_(1.0)  # training goes on: the capture keeps the step's values
    assert digest(first.state()) != digest(live)
    second = cap.take(11, live)
    assert second.slab is first.slab and second.issue_s >= 0  # one slab, allocated once
    second.wait(TIMEOUT_S)
    assert digest(second.state()) == digest(live) and second.digest != first.digest


def test_restore_into_a_standbys_own_buffers_in_place():
    src, _, _ = state(7, seed=1)
    cap = capture.Capture("cpu", slabs=1).take(7, src)
    cap.wait(TIMEOUT_S)
    mine, model, opt = state(0, seed=2)  # a standby: same layout, other values
    weight, exp_avg = model[0].weight, opt.state_dict()["state"][0]["exp_avg"]
    restored, placed = capture.restore_into(cap.state(), like=mine)
    assert placed > 0 and digest(restored) == digest(src)
    assert restored["workload"]["model"]["0.weight"].data_ptr() == weight.data_ptr()  # in place
    assert restored["workload"]["optimizer"]["state"][0]["exp_avg"] is exp_avg
    assert torch.equal(weight, src["workload"]["model"]["0.weight"])


def _store():
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=s.detach(),
                           use_libuv=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return master, ("127.0.0.1", port)


def _until(check, deadline_s=TIMEOUT_S) -> bool:
    """Poll `check` until true or `deadline_s` passed; its last value."""
    deadline = time.monotonic() + deadline_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def _held(reports, n, deadline_s=TIMEOUT_S):
    _until(lambda: len(reports) >= n, deadline_s)
    return reports


@pytest.mark.gloo_threads
def test_the_standby_holds_the_two_newest_verified_versions_and_a_spoilt_copy_is_sent_again():
    _master, addr = _store()
    reports = []
    holder = holding.Holding(addr, "tm/hold/a1/", 0, "127.0.0.1", TIMEOUT_S, lambda r, s, d: reports.append((r, s, d)), key=KEY)
    link = holding.StandbyLink(addr, "tm/hold/a1/", 0, "spare1", "127.0.0.1", TIMEOUT_S, key=KEY)
    cap = capture.Capture("cpu", slabs=1)
    states = {}
    for step in (40, 80, 120):
        states[step], _, _ = state(step, seed=step)
        c = cap.take(step, states[step])
        c.wait(TIMEOUT_S)
        stats = link.send(c, corrupt=step == 40)  # the first copy is spoilt on the wire once
        assert stats["attempts"] == (2 if step == 40 else 1) and stats["bytes"] == c.slab.bytes
    _held(reports, 3)
    assert [r[1] for r in reports] == [[40], [40, 80], [80, 120]] and reports[0][2]["attempts"] == 2
    assert holder.steps() == [80, 120]
    for step in (80, 120):
        assert digest(holder.version(step).state()) == digest(states[step])
    with pytest.raises(KeyError, match="holds no snapshot of rank 0 at step 40"):
        holder.version(40)
    # a version with NaN is refused: the holder keeps what it had
    bad, _, _ = state(160, seed=3)
    bad["workload"]["model"]["0.bias"][0] = float("nan")
    c = cap.take(160, bad)
    c.wait(TIMEOUT_S)
    with pytest.raises(Exception, match="refused"):
        link.send(c)
    # the slab of the oldest version was given to the refused one: the newest complete one stays
    assert holder.steps() == [120]
    good, _, _ = state(200, seed=5)
    c = cap.take(200, good)
    c.wait(TIMEOUT_S)
    link.send(c)
    _held(reports, 4)
    assert holder.steps() == [120, 200] and digest(holder.version(200).state()) == digest(good)
    assert reports[-1][2]["streams"] == holding.STREAMS > 1
    holder.close()


def _gloo_pair(store, prefix, grank):
    from trainmover.groups.swappable import gloo_group
    return gloo_group(store, prefix, grank, 2, host="127.0.0.1", timeout=datetime.timedelta(seconds=TIMEOUT_S))


@pytest.mark.gloo_threads
def test_the_first_version_goes_straight_to_the_holder_and_is_dropped_once_two_host_versions_are_held(monkeypatch):
    """The first version over its own transfer pair (NCCL between GPUs; gloo here), with no slab
    on either side: held, verified, restorable; a spoilt copy is sent again; the host versions
    follow and, two of them held, the first is dropped. A holder without room declines and the
    worker's link says so (host versions only)."""
    _master, addr = _store()
    monkeypatch.setattr(holding.Holding, "_room", lambda self: "")
    reports = []
    live, _, _ = state(3, seed=3)
    layout = capture.specs_of(*capture.flatten(live)[1:])
    holder = holding.Holding(addr, "tm/hold/d1/", 0, "127.0.0.1", TIMEOUT_S, lambda r, s, d: reports.append((r, s, d)),
                             key=KEY, layout=layout, direct=_gloo_pair)
    link = holding.StandbyLink(addr, "tm/hold/d1/", 0, "spare1", "127.0.0.1", TIMEOUT_S, key=KEY, direct=_gloo_pair)
    assert _until(link.direct_due), link.direct_note
    numbers = link.send_direct(3, live, corrupt=True)
    assert numbers["direct"] and numbers["attempts"] == 2 and not link.direct_due()
    _held(reports, 1)
    assert reports[0][1] == [3] and reports[0][2]["direct"] and reports[0][2]["first_held_t"]
    assert holder.version(3).on_device and digest(holder.version(3).state()) == digest(live)
    mine, _, _ = state(0, seed=9)
    restored, placed = capture.restore_into(holder.version(3).state(), like=mine)
    assert placed > 0 and digest(restored) == digest(live)
    cap = capture.Capture("cpu", slabs=1)
    for n, step in enumerate((20, 40), 2):
        s_, _, _ = state(step, seed=step)
        c = cap.take(step, s_)
        c.wait(TIMEOUT_S)
        link.send(c)
        _held(reports, n)
    assert [r[1] for r in reports] == [[3], [3, 20], [20, 40]]
    assert reports[-1][2]["first_held_t"] == reports[0][2]["first_held_t"]
    holder.close()

    monkeypatch.setattr(holding.Holding, "_room", lambda self: "1.0 GiB free on its GPU, 9.0 GiB needed")
    refuser = holding.Holding(addr, "tm/hold/d2/", 0, "127.0.0.1", TIMEOUT_S, lambda *a: None, key=KEY,
                              layout=layout, direct=_gloo_pair)
    declined = holding.StandbyLink(addr, "tm/hold/d2/", 0, "spare2", "127.0.0.1", TIMEOUT_S, key=KEY,
                                   direct=_gloo_pair)
    _until(lambda: declined.direct_sent)
    assert declined.direct is None and not declined.direct_due() and "9.0 GiB needed" in declined.direct_note
    refuser.close()


class OneRankCtx:
    """A one-rank job's RankContext, as much of it as Protection uses (protection.py)."""

    def __init__(self, addr, every: int):
        from types import SimpleNamespace
        from trainmover.groups.swappable import SNAPSHOT
        self.rank, self.device, self.key, self.sent = 0, "cpu", KEY, []
        job = SimpleNamespace(snapshot_every=every, checkpoint_every=0, steps=10_000, ranks_per_node=1,
                              group_timeout_s=TIMEOUT_S)
        self.spec = SimpleNamespace(job=job, world_size=1, store=addr, node_addr="127.0.0.1")
        self.faults = SimpleNamespace(at=lambda *a, **k: False)
        self.groups = {SNAPSHOT: SimpleNamespace(inner=None)}
        self.live = {}

    def full_state(self, step):
        self.live.setdefault(step, state(step, seed=step)[0])
        return self.live[step]

    def send(self, kind, **fields):
        self.sent.append((kind, fields))


@pytest.mark.gloo_threads
def test_a_rank_sends_its_first_version_to_the_holders_gpu_then_host_versions_at_the_interval(monkeypatch):
    """protection.py's sequencing with the first-version pair (gloo standing in for NCCL): no
    host version while that pair is being built, the first version at the first boundary after
    it, host versions at the multiples of the interval after that."""
    from trainmover.runtime.protection.role import Protection
    _master, addr = _store()
    monkeypatch.setattr(holding.Holding, "_room", lambda self: "")
    monkeypatch.setattr(Protection, "_pair_builder", lambda self: _gloo_pair)
    ctx = OneRankCtx(addr, every=4)
    reports = []
    layout = capture.specs_of(*capture.flatten(ctx.full_state(0))[1:])
    holder = holding.Holding(addr, "tm/hold/p1/", 0, "127.0.0.1", TIMEOUT_S, lambda r, s, d: reports.append((s, d)),
                             key=KEY, layout=layout, direct=_gloo_pair)
    prot = Protection(ctx)
    prot.on_hold(HoldMsg(holder="spare1", wards=[0], prefix="tm/hold/p1/"))
    link = prot.snapshots.standby
    prot.protect(0)  # a boundary before the pair is built: nothing sent, no host version either
    assert not link.direct_ok and link.version == 0
    _until(link.direct_due)
    prot.protect(1)  # the first boundary after: the first version, this step's, to the holder's GPU
    assert link.direct_ok and link.version == 0
    assert [k for k, _ in ctx.sent] == ["snapshot_taken"] and ctx.sent[0][1]["detail"]["direct"]
    _held(reports, 1)
    assert reports[0][0] == [1] and holder.version(1).on_device
    for step in range(2, 13):
        prot.protect(step)
        prot.snapshots.wait(TIMEOUT_S)
    _held(reports, 4)
    assert [r[0] for r in reports] == [[1], [1, 4], [4, 8], [8, 12]]  # the GPU copy dropped at the second
    assert digest(holder.version(12).state()) == digest(ctx.full_state(12))
    holder.close()


class SlowLink:
    """A standby link whose copy takes `seconds` (the network), recording what it sent."""

    holder = "spare1"

    def __init__(self, seconds: float):
        self.seconds, self.sent = seconds, []

    def send(self, cap, corrupt=False):
        time.sleep(self.seconds)
        self.sent.append(cap.step)
        return {"bytes": cap.slab.bytes, "send_s": self.seconds, "attempts": 1}


def test_a_one_node_rank_skips_a_snapshot_while_the_one_before_is_on_its_way():
    snaps = Snapshots(0, 1, 1, timeout_s=TIMEOUT_S)
    assert snaps.one_node and snaps.capture.keep == 1
    snaps.standby = SlowLink(0.5)
    s1, _, _ = state(10)
    assert snaps.take(10, s1, None) is not None
    assert snaps.take(20, s1, None) is None and snaps.skipped == 1  # no wait: skipped
    snaps.wait(TIMEOUT_S)
    s3, _, _ = state(30, seed=4)
    assert snaps.take(30, s3, None) is not None
    snaps.wait(TIMEOUT_S)
    assert snaps.standby.sent == [10, 30]
    assert [r["step"] for r in snaps.pop_reports()] == [10, 30] and snaps.pop_reports() == []
    assert snaps.report() == {"own": [30], "held": {}} and digest(snaps.own_state(30)) == digest(s3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("stage", [True, False])
def test_cuda_capture_is_pinned_off_the_training_stream_and_gated_before_the_update(stage):
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    opt.step()
    live = {"workload": {"model": model.state_dict(), "optimizer": opt.state_dict()}, "step": 1}
    cap = capture.Capture("cuda", slabs=1, stage=stage)
    cap.prepare(live)
    cap.allocating.join(TIMEOUT_S)
    assert (cap.stage is not None) == stage  # an H100/H200 has room for this small state twice over
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    opt.step()
    expect = transfer.host_copy(live)
    c = cap.take(2, live)
    assert c.slab.pinned and cap.pending is c and (c.staged is not None) == stage
    cap.gate()  # the optimizer step below waits for the copies (or the stage) on the device
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    opt.step()
    c.wait(TIMEOUT_S)
    assert digest(c.state()) == digest(expect) and c.copy_s is not None
    assert (c.stage_s is not None) == stage
    assert c.digest == capture.word_digest(c.specs, capture.word_sums(c.slab.views, via="cuda"))
    assert c.digest == capture.word_digest(c.specs, capture.word_sums(c.slab.views))  # CPU and GPU agree
    # writes queued on the training stream just before the restore (behind a long matmul) land
    # first: the restore's side streams wait for it, so the restored values win
    big = torch.randn(8192, 8192, device="cuda")
    (big @ big).sum()
    for p in model.parameters():
        p.data.mul_(0)
    restored, placed = capture.restore_into(c.state(), like={"workload": {"model": model.state_dict(),
                                                                         "optimizer": opt.state_dict()}, "step": 0})
    # like with like: digest_tensors sums CUDA tensors' words but hashes CPU tensors' bytes
    assert digest(transfer.host_copy(restored)) == digest(expect) and placed == c.slab.bytes


def test_a_snapshot_due_while_its_host_buffers_are_being_allocated_is_skipped():
    snaps = Snapshots(0, 1, 1, timeout_s=TIMEOUT_S)
    s1, _, _ = state(1)
    release = threading.Event()
    snaps.capture.allocating = threading.Thread(target=release.wait, args=(TIMEOUT_S,), daemon=True)
    snaps.capture.allocating.start()
    assert snaps.take(20, s1, None) is None and snaps.skipped == 1  # never waits for pinning
    release.set()
    snaps.capture.allocating.join(TIMEOUT_S)
    snaps.capture.allocating = None
    snaps.capture.prepare(s1)  # the real one: slabs of this layout, ready once the thread is done
    snaps.capture.allocating.join(TIMEOUT_S)
    slab = snaps.capture.slabs[0]
    cap = snaps.take(40, s1, None)
    assert cap is not None and cap.slab is slab and snaps.last["alloc_s"] is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_checks_on_the_gpu_in_pieces_match_the_cpus_and_find_a_nan_in_a_later_piece(monkeypatch):
    monkeypatch.setattr(capture, "VERIFY_CHUNK_BYTES", 4096)  # many pieces per tensor, one buffer reused
    torch.manual_seed(1)
    host = [torch.randn(10_001).pin_memory(), torch.randn(3, 1001).to(torch.bfloat16).pin_memory(),  # odd: 16-bit words
            torch.randn(2049, dtype=torch.float64), torch.arange(5000, dtype=torch.int64), torch.empty(0)]
    on_gpu, on_cpu = capture.Checker("cuda"), capture.Checker(None)
    for t in host:
        on_gpu.add(t)
        on_cpu.add(t)
    assert on_gpu.sums() == on_cpu.sums() == capture.word_sums(host)
    assert on_gpu.nonfinite() == on_cpu.nonfinite() == 0
    host[1].view(-1)[2900] = float("inf")  # far past the first piece
    host[2][2000] = float("nan")
    assert capture.nonfinite_count(host, via="cuda") == capture.nonfinite_count(host) == 2
