"""The planned state transfer (runtime/transfer/plan.py) over real gloo groups (threads of one process),
and its GPU checks on one GPU (marked gpu)."""
import threading

import pytest
import torch

from tests.unit.test_transfer_groups import flat, pair, state, store  # noqa: F401 - the fixture
from trainmover.errors import MigrationError
from trainmover.groups.tensors import digest_tensors, word_view
from trainmover.runtime.transfer import plan as xferplan, state as transfer

KEY = b"k" * 32  # the job's key: the manifest crosses the pair sealed with it

GLOO = pytest.mark.gloo_threads  # the gloo tests (see tests/unit/conftest.py); the GPU one runs in the GPU session


def big_state():
    """A state with tensors above and below the packing threshold, in several dtypes."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(512, 600), torch.nn.Linear(600, 8))  # 1.2 MB weight: on the wire
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    return {"workload": {"model": model.state_dict(), "optimizer": opt.state_dict(), "data": {"cursor": 3},
                         "half": torch.randn(700, 800).to(torch.bfloat16), "ids": torch.arange(5, dtype=torch.int64)},
            "rng": {"torch": torch.get_rng_state()}, "step": 9}


def zeroed(s):
    with torch.no_grad():
        for t in flat(s):
            if t.is_floating_point():
                t.zero_()
    return s


def exchange(store, prefix, sent, like, send_plan=None, recv_plan=None, corrupt=False):
    a, b = pair(store, prefix)
    out = {}

    def recv():
        try:
            out["state"], out["stats"] = transfer.recv_verified(b, key=KEY, src=0, like=like, plan=recv_plan)
        except MigrationError as exc:
            out["error"] = exc
    t = threading.Thread(target=recv)
    t.start()
    try:
        out["sent"] = transfer.send_verified(sent, a, key=KEY, dst=1, corrupt=corrupt, plan=send_plan)
    except MigrationError as exc:
        out["send_error"] = exc
    t.join(30)
    assert not t.is_alive()
    return out


@GLOO
def test_planned_transfer_is_bit_exact_into_the_receivers_own_buffers(store, monkeypatch):
    monkeypatch.setattr(xferplan, "CHUNK_BYTES", 2 << 20)  # several chunks, each checked as it lands
    sent, like = big_state(), zeroed(big_state())
    send_plan = xferplan.of_state(sent)[1]
    recv_plan = xferplan.for_receiving(like)
    assert len(send_plan.chunks) >= 3 and send_plan.packs and send_plan.sig == recv_plan.sig
    weight = like["workload"]["model"]["0.weight"]
    exp_avg = like["workload"]["optimizer"]["state"][0]["exp_avg"]
    got = exchange(store, "p1/", sent, like, send_plan, recv_plan)
    assert "error" not in got and "send_error" not in got
    assert digest_tensors(flat(got["state"])) == digest_tensors(flat(sent))
    assert got["state"]["workload"]["model"]["0.weight"] is weight            # a big one, on the wire
    assert got["state"]["workload"]["optimizer"]["state"][0]["exp_avg"] is exp_avg
    assert got["state"]["workload"]["model"]["1.bias"] is like["workload"]["model"]["1.bias"]  # packed
    assert got["state"]["step"] == 9 and got["state"]["workload"]["data"]["cursor"] == 3
    parts = got["stats"].parts
    assert parts["into_own_buffers"] and got["sent"].parts["plan_ahead"]
    assert parts["chunks"] == len(send_plan.chunks) and got["stats"].attempts == 1


@GLOO
def test_other_layout_is_received_into_new_buffers_still_exact(store):
    sent = big_state()
    like = zeroed(big_state())
    del like["workload"]["half"]  # the joiner's guess differs from the sender's layout
    recv_plan = xferplan.for_receiving(like)
    got = exchange(store, "p2/", sent, like, xferplan.of_state(sent)[1], recv_plan)
    assert "error" not in got
    assert not got["stats"].parts["into_own_buffers"]
    assert torch.equal(got["state"]["workload"]["half"], sent["workload"]["half"])
    assert got["state"]["workload"]["model"]["0.weight"] is like["workload"]["model"]["0.weight"]  # by key path
    assert digest_tensors(flat(got["state"])) == digest_tensors(flat(sent))


@GLOO
def test_sender_plan_is_remade_when_its_tensors_changed(store):
    sent = big_state()
    stale = xferplan.of_state(big_state())[1]  # another state's tensors: not this one's
    got = exchange(store, "p3/", sent, zeroed(big_state()), stale, None)
    assert "error" not in got and not got["sent"].parts["plan_ahead"]
    assert digest_tensors(flat(got["state"])) == digest_tensors(flat(sent))


@GLOO
def test_corrupted_chunk_is_caught_by_the_word_sums_and_sent_again(store):
    sent, like = big_state(), zeroed(big_state())
    got = exchange(store, "p4/", sent, like, xferplan.of_state(sent)[1], xferplan.for_receiving(like), corrupt=True)
    assert "error" not in got and got["stats"].attempts == 2 and got["sent"].attempts == 2
    assert digest_tensors(flat(got["state"])) == digest_tensors(flat(sent))


@GLOO
def test_nonfinite_state_is_refused(store):
    sent = big_state()
    sent["workload"]["model"]["0.weight"][3, 4] = float("inf")
    like = zeroed(big_state())
    got = exchange(store, "p5/", sent, like, xferplan.of_state(sent)[1], xferplan.for_receiving(like))
    assert "NaN or Inf" in str(got["error"]) and "refused" in str(got["send_error"])


def test_plan_sums_are_the_word_sums_and_pack_round_trips():
    s = big_state()
    plan = xferplan.of_state(s)[1]
    for c in range(len(plan.chunks)):
        plan.check_chunk(c)
    plan.pack()
    plan.reset()
    for c in range(len(plan.chunks)):  # the packed buffers now hold the small tensors
        plan.check_chunk(c)
    want = [int(word_view(t).sum(dtype=torch.int64)) for t in plan.wire]
    assert plan.sums.tolist() == want
    plan.peer_sums.copy_(plan.sums)
    assert plan.verdict() == (0, 0)
    plan.peer_sums[0] += 1
    assert plan.verdict() == (1, 0)
    other = xferplan.into(plan.specs, None)  # fresh buffers of the same layout
    for dst, src in zip(other.wire, plan.wire):
        dst.copy_(src)
    other.unpack()
    for i, t in enumerate(plan.tensors):
        if i not in plan.cpu:
            assert torch.equal(other.tensors[i], t)


def test_manifest_with_a_forged_signature_is_refused():
    class Chan:
        def recv_bytes(self, src):
            import io
            buf = io.BytesIO()
            torch.save({"skeleton": {}, "specs": [("/a", (2,), "torch.float32", "cpu")], "sig": "0" * 64,
                        "cpu": [], "cpu_digest": ""}, buf)
            return transfer.seal_manifest(KEY, buf.getvalue())  # sealed, yet its signature lies
    with pytest.raises(MigrationError, match="undecodable manifest"):
        transfer.recv_planned(Chan(), None, key=KEY)


@pytest.mark.gpu
def test_gpu_checks_on_a_side_stream_match_the_word_sums():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    # no optimizer step here: its graph-capture check touches CUDA in a forked test's child
    cuda = {"w": torch.randn(600, 512, device="cuda"), "h": torch.randn(700, 800, device="cuda").to(torch.bfloat16),
            "small": torch.randn(7, device="cuda"), "rng": torch.get_rng_state()}
    plan = xferplan.of_state(cuda)[1]
    assert plan.cpu == [3] and plan.wire_dev == "cuda"
    side = torch.cuda.Stream()
    plan.pack()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in range(len(plan.chunks)):
            plan.check_chunk(c)
    torch.cuda.current_stream().wait_stream(side)
    want = [int(word_view(t).sum(dtype=torch.int64)) for t in plan.wire]
    assert plan.sums.tolist() == want
    plan.peer_sums.copy_(plan.sums)
    assert plan.verdict() == (0, 0)
    plan.warm()  # the checks once before the pause: same sums, nothing left behind
    assert plan.sums.tolist() == want and plan.verdict() == (0, 0)
    assert plan._graphs is not None and len(plan._graphs) == len(plan.chunks)  # captured: replayed from here on
    other = xferplan.into(plan.specs, None)  # host tensors travel packed in the manifest
    other.unpack_host(plan.pack_host(plan.tensors))
    assert torch.equal(other.tensors[3], cuda["rng"])
    cuda["w"][0, 0] = float("nan")  # written in place: the graphs read the new bytes
    plan.reset()
    plan.sums.zero_()
    with torch.cuda.stream(side):
        for c in range(len(plan.chunks)):
            plan.check_chunk(c)
    torch.cuda.current_stream().wait_stream(side)
    assert plan.sums.tolist() == [int(word_view(t).sum(dtype=torch.int64)) for t in plan.wire]
    assert plan.verdict() == (1, 1)
    # the sender's kind (no norms): its own graphs; a receiver's check on it runs eagerly
    sender = xferplan.of_state({"a": torch.randn(600, 512, device="cuda"), "b": torch.randn(5, device="cuda")})[1]
    assert sender.chunks[0][0].data_ptr() == sender.tensors[0].data_ptr()  # "a" travels alone, not packed
    sender.warm(finite=False)
    assert sender._graphs is not None and not sender._graphs_finite
    sender.pack()
    sender.sums.zero_()
    for c in range(len(sender.chunks)):
        sender.check_chunk(c, finite=False)
    assert sender.sums.tolist() == [int(word_view(t).sum(dtype=torch.int64)) for t in sender.wire]
    assert sender._norms == []
    sender.tensors[0][0, 0] = float("inf")
    for c in range(len(sender.chunks)):
        sender.check_chunk(c)  # with norms: eager
    sender.peer_sums.copy_(sender.sums)
    assert sender.verdict() == (0, 1)


def test_a_leaver_votes_for_the_switch_only_a_boundary_after_its_plan():
    """The leaver's plan (~0.1 s for a 1B model) is made at a boundary of its own: with no stayer
    the switch could otherwise follow at that very boundary, and the plan would fall into the pause."""
    from trainmover.runtime.phase1 import Prepared
    from trainmover.runtime.roles.switch import switch_ready
    leaver = Prepared(3, None, "leaver", 0)  # the delta plays no part in the vote
    assert switch_ready(leaver, 10) == 0          # Phase 1 still running
    leaver.done.set()
    assert switch_ready(leaver, 10) == 0          # no plan yet
    leaver.plan_at = 10
    assert switch_ready(leaver, 10) == 0          # made at this boundary
    assert switch_ready(leaver, 11) == 3          # the next one
    stayer = Prepared(3, None, "stayer", 1)
    stayer.done.set()
    assert switch_ready(stayer, 10) == 3
    stayer.error = "built nothing"
    assert switch_ready(stayer, 10) == 0
