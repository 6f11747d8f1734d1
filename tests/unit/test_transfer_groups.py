"""State transfer and swappable groups over real gloo groups (threads of one process)."""
import datetime
import threading
import time

import pytest
import torch

from trainmover.errors import MigrationError
from trainmover.groups.swappable import SandboxBackend, SwappableGroup
from trainmover.groups.tensors import digest_tensors, flatten
from trainmover.runtime import heartbeat
from trainmover.runtime.transfer import state as transfer
from tests.unit.gloo_world import gloo_groups, serve_store

KEY = b"k" * 32  # the job's key: the manifest crosses the pair sealed with it

pytestmark = pytest.mark.gloo_threads  # see tests/unit/conftest.py

TIMEOUT = datetime.timedelta(seconds=20)


@pytest.fixture
def store():
    master, port = serve_store(TIMEOUT)
    yield port
    del master


def pair(store, prefix, timeout=TIMEOUT):
    return gloo_groups(store, prefix, 2, timeout)


def state():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"workload": {"model": model.state_dict(), "optimizer": opt.state_dict(), "data": {"cursor": 17}},
            "rng": {"torch": torch.get_rng_state()}, "step": 5, "scalar": torch.tensor(3.5)}


def exchange(store, prefix, send, recv, timeout=TIMEOUT):
    """`send(a)` here while `recv(b)` runs on a thread, over a fresh pair (a, b); returns what
    send returned and {"state", "stats"} from recv, or {"error"} with its MigrationError."""
    a, b = pair(store, prefix, timeout)
    result = {}

    def receive():
        try:
            result["state"], result["stats"] = recv(b)
        except MigrationError as exc:
            result["error"] = exc
    t = threading.Thread(target=receive)
    t.start()
    try:
        return send(a), result
    finally:
        t.join(30)


def run_pair(store, prefix, sent, like=None, corrupt=False):
    return exchange(store, prefix, lambda a: transfer.send_state(sent, a, key=KEY, dst=1, corrupt=corrupt),
                    lambda b: transfer.recv_state(b, key=KEY, src=0, like=like))


def flat(obj):
    tensors = []
    flatten(obj, tensors, [])
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
    assert digest_tensors(flat(got["state"])) == digest_tensors(flat(sent)) == stats.digest
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
    def send(a):
        try:
            return {"sent": transfer.send_verified(sent, a, key=KEY, dst=1, corrupt=corrupt)}
        except MigrationError as exc:
            return {"send_error": exc}
    sender, result = exchange(store, prefix, send, lambda b: transfer.recv_verified(b, key=KEY, src=0, like=None))
    return {**result, **sender}


def test_a_rogue_pair_peer_cannot_feed_the_joiner_a_poisoned_state(store):
    """A local user who joined the transfer pair (the store's values are readable) sends the
    joiner a state of their own: its RNG state, counters and tensors, consistent with its own
    checksums. Without the job's key its manifest carries no valid MAC: refused, nothing loaded,
    not retried. Negative control: the same exchange without MACs (key None on both sides, as
    before) loads the poisoned state."""
    poisoned = state()
    poisoned["step"] = 10_000
    poisoned["rng"] = {"torch": torch.manual_seed(666).get_state()}

    def rogue(plan, key=b"r" * 32, context=""):
        def send(a):
            try:
                return transfer.send_verified(poisoned, a, key=key, context=context, dst=1, plan=plan)
            except MigrationError as exc:  # the joiner takes nothing more: the rogue's sends time out
                return exc
        return send
    short = datetime.timedelta(seconds=2)
    _, got = exchange(store, "rogue/", rogue(False), lambda b: transfer.recv_verified(b, key=KEY, src=0, like=None),
                      timeout=short)
    assert isinstance(got.get("error"), transfer.StateRefused) and "not sealed with the job's key" in str(got["error"])
    assert "state" not in got
    # planned protocol (a migration's own path): refused the same way, before its manifest is decoded
    _, got = exchange(store, "rogue-planned/", rogue(None),
                      lambda b: transfer.recv_verified(b, key=KEY, src=0, like=None, plan=None), timeout=short)
    assert isinstance(got.get("error"), transfer.StateRefused) and "state" not in got
    # a manifest sealed with the job's key for another transfer (an earlier epoch, seen on the
    # wire) is not replayed into this one: the context (the pair's prefix) is under the MAC
    _, got = exchange(store, "replay/", rogue(None, key=KEY, context="tm/e1/xfer/r1/"),
                      lambda b: transfer.recv_verified(b, key=KEY, context="tm/e2/xfer/r1/", src=0, like=None, plan=None),
                      timeout=short)
    assert isinstance(got.get("error"), transfer.StateRefused) and "state" not in got
    # negative control: unkeyed, the joiner takes the rogue's state
    _, got = exchange(store, "unkeyed/", lambda a: transfer.send_verified(poisoned, a, key=None, dst=1),
                      lambda b: transfer.recv_verified(b, key=None, src=0, like=None))
    assert got["state"]["step"] == 10_000
    # and the job's own ranks, both with the key, exchange as before
    _, got = exchange(store, "keyed/", lambda a: transfer.send_verified(state(), a, key=KEY, dst=1),
                      lambda b: transfer.recv_verified(b, key=KEY, src=0, like=None))
    assert got["state"]["step"] == 5


def test_corrupted_copy_is_retried_and_then_exact(store):
    sent = state()
    got = run_verified(store, "v1/", sent, corrupt=True)
    assert "error" not in got and "send_error" not in got
    assert got["stats"].attempts == 2 and got["sent"].attempts == 2  # the first copy was refused
    assert digest_tensors(flat(got["state"])) == digest_tensors(flat(sent))


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
    groups = [SwappableGroup("world", r, 3, [0, 1, 2], g) for r, g in enumerate(gloo_groups(store, "rv/", 3, TIMEOUT))]
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
