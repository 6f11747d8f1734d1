"""State transfer and swappable groups over real gloo groups (threads of one process)."""
import datetime
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from trainmover.errors import MigrationError
from trainmover.runtime import heartbeat, transfer
from trainmover.runtime.groups import SandboxBackend, SwappableGroup, gloo_group

pytestmark = pytest.mark.gloo_threads  # see tests/unit/conftest.py

TIMEOUT = datetime.timedelta(seconds=20)


@pytest.fixture
def store():
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=s.detach(),
                           use_libuv=False, timeout=TIMEOUT)
    yield port
    del master


def pair(store, prefix):
    out = [None, None]

    def build(r):  # one store client per member, as on separate nodes
        client = dist.TCPStore("127.0.0.1", store, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
        out[r] = gloo_group(client, prefix, r, 2, host="127.0.0.1", timeout=TIMEOUT)
    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return out


def state():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"workload": {"model": model.state_dict(), "optimizer": opt.state_dict(), "data": {"cursor": 17}},
            "rng": {"torch": torch.get_rng_state()}, "step": 5, "scalar": torch.tensor(3.5)}


def run_pair(store, prefix, sent, like=None, corrupt=False):
    a, b = pair(store, prefix)
    result = {}

    def recv():
        try:
            result["state"], result["stats"] = transfer.recv_state(b, src=0, like=like)
        except MigrationError as exc:
            result["error"] = exc
    t = threading.Thread(target=recv)
    t.start()
    stats = transfer.send_state(sent, a, dst=1, corrupt=corrupt)
    t.join(30)
    return stats, result


def flat(obj):
    tensors = []
    transfer._flatten(obj, tensors, [])
    return tensors


def test_state_arrives_bit_exact_and_in_place(store):
    sent = state()
    like = state()
    with torch.no_grad():
        for t in flat(like):
            t.zero_() if t.is_floating_point() else None
    target = like["workload"]["model"]["weight"]
    stats, got = run_pair(store, "t1/", sent, like=like)
    assert "error" not in got
    assert transfer.digest_tensors(flat(got["state"])) == transfer.digest_tensors(flat(sent)) == stats.digest
    assert got["state"]["workload"]["model"]["weight"] is target  # received into the standby's buffer
    assert got["state"]["step"] == 5 and got["state"]["workload"]["data"]["cursor"] == 17
    assert stats.bytes == got["stats"].bytes > 0


def test_corrupted_transfer_is_detected(store):
    stats, got = run_pair(store, "t2/", state(), corrupt=True)
    assert isinstance(got.get("error"), MigrationError)
    assert "checksum mismatch" in str(got["error"])


def test_missing_entries_do_not_shift_onto_other_buffers(store):
    """Targets are matched by key path: a receiver lacking optimizer state must not get
    the sender's tensors written into same-shaped buffers of other keys."""
    sent = state()
    like = state()
    like["workload"]["optimizer"] = {}
    _, got = run_pair(store, "t3/", sent, like=like)
    assert torch.equal(got["state"]["workload"]["model"]["bias"], sent["workload"]["model"]["bias"])
    assert set(got["state"]["workload"]["optimizer"]) == {"state", "param_groups"}


def test_swappable_group_switches_backend_under_ddp(store):
    """DDP built on a sandboxed wrapper, warmed up alone, then swapped onto a live group:
    gradients are averaged with the peer from then on, without rebuilding DDP."""
    backends = pair(store, "g/")
    results = {}

    def rank(r):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1, bias=False)
        group = SwappableGroup("world", r, 2, [0, 1], SandboxBackend(r, 2))
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        ddp(torch.ones(1, 3) * (r + 1)).sum().backward()  # sandbox: no peer involved
        assert group.sandboxed and group.inner.calls
        group.swap(backends[r])
        model.zero_grad()
        ddp(torch.ones(1, 3) * (r + 1)).sum().backward()
        results[r] = model.weight.grad.clone()
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert torch.equal(results[0], results[1])
    assert torch.allclose(results[0], torch.full((1, 3), 1.5))  # mean of 1 and 2


def run_verified(store, prefix, sent, corrupt=False):
    a, b = pair(store, prefix)
    result = {}

    def recv():
        try:
            result["state"], result["stats"] = transfer.recv_verified(b, src=0, like=None)
        except MigrationError as exc:
            result["error"] = exc
    t = threading.Thread(target=recv)
    t.start()
    try:
        result["sent"] = transfer.send_verified(sent, a, dst=1, corrupt=corrupt)
    except MigrationError as exc:
        result["send_error"] = exc
    t.join(30)
    return result


def test_corrupted_copy_is_retried_and_then_exact(store):
    sent = state()
    got = run_verified(store, "v1/", sent, corrupt=True)
    assert "error" not in got and "send_error" not in got
    assert got["stats"].attempts == 2 and got["sent"].attempts == 2  # the first copy was refused
    assert transfer.digest_tensors(flat(got["state"])) == transfer.digest_tensors(flat(sent))


def test_state_with_nan_is_refused_on_both_sides(store):
    sent = state()
    sent["workload"]["model"]["bias"][0] = float("nan")
    got = run_verified(store, "v2/", sent)
    assert "NaN or Inf" in str(got["error"])
    assert "refused" in str(got["send_error"])
    assert "state" not in got


def test_nonfinite_counts_only_floating_tensors():
    assert transfer.nonfinite([torch.tensor([1.0, float("inf")]), torch.tensor([3]), torch.zeros(2)]) == 1
    assert transfer.nonfinite([torch.tensor([1, 2])]) == 0


def test_revoke_frees_ranks_waiting_on_a_peer_that_never_comes(store):
    """A member alive but silent (a hung node): without revoke the others would wait for the
    group timeout (20 s here); revoke fails their collective at once, and so does any later
    one, until a new backend is swapped in."""
    groups = [None] * 3

    def build(r):
        client = dist.TCPStore("127.0.0.1", store, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
        groups[r] = SwappableGroup("world", r, 3, [0, 1, 2], gloo_group(client, "rv/", r, 3, host="127.0.0.1",
                                                                        timeout=TIMEOUT))
    threads = [threading.Thread(target=build, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    outcome = {}

    def reduce(r):  # rank 2 never joins
        t0 = time.monotonic()
        try:
            groups[r].allreduce([torch.ones(4)]).wait()
            outcome[r] = ("completed", time.monotonic() - t0)
        except RuntimeError as exc:
            outcome[r] = (str(exc), time.monotonic() - t0)
    threads = [threading.Thread(target=reduce, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    time.sleep(0.5)
    # what their heartbeats say meanwhile (runtime/heartbeat.py): the others wait on rank 2
    seen = [heartbeat.beat([r], 4, {"world": groups[r]}, threading.get_native_id(), time.monotonic())
            for r in range(3)]
    assert [b["issued"]["world"] for b in seen] == [1, 1, 0]
    assert seen[0]["waiting"]["world"] >= 0.4 and seen[1]["waiting"]["world"] >= 0.4 and seen[2]["waiting"] == {}
    for g in groups[:2]:
        g.revoke("rank 2 lost")
    [t.join(10) for t in threads]
    # Rank 2 comes back late: the abandoned collective then ends inside gloo, harmlessly
    # (left pending, it would time out at exit and gloo would abort the process).
    groups[2].allreduce([torch.ones(4)]).wait()
    for r in (0, 1):
        what, took = outcome[r]
        assert "revoked: rank 2 lost" in what and took < 5, outcome
    with pytest.raises(RuntimeError, match="revoked"):
        groups[0].allreduce([torch.ones(4)]).wait()
    groups[0].swap(SandboxBackend(0, 3))
    assert groups[0].issued == 0 and groups[0].waiting_s(time.monotonic()) == 0.0  # counted afresh
    t = torch.ones(2)
    groups[0].allreduce([t]).wait()  # usable again with its new backend
    assert torch.equal(t, torch.ones(2))
