"""State transfer and swappable groups over real gloo groups (threads of one process)."""
import datetime
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from trainmover.errors import MigrationError
from trainmover.runtime import transfer
from trainmover.runtime.groups import SandboxBackend, SwappableGroup, gloo_group

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
