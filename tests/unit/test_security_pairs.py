"""Pairs only the job's ranks can use (issue 37): the rendezvous store's values encrypted and
tagged with the job's key (a co-user who connects to the store learns neither gloo's addresses
nor NCCL's unique id, and plants nothing), and the CPU wire tensors of a state transfer bound
to the key (a peer that relays the leaver's sealed manifest cannot swap the tensors behind it)."""
from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_transfer_groups import pair, store  # noqa: F401 - the fixture
from tests.unit.test_xferplan import big_state, zeroed
from tests.unit.gloo_world import gloo_groups
from trainmover.errors import MigrationError
from trainmover.protocol.store import AuthStore, ForgedValue, open_value, seal
from trainmover.runtime.transfer import plan as xferplan, state as transfer
from trainmover.groups.swappable import gloo_group
from trainmover.groups.tensors import digest_tensors

KEY = b"k" * 32
GLOO = pytest.mark.gloo_threads  # see tests/unit/conftest.py


# --- the store's values --------------------------------------------------------------------------

def test_a_store_value_is_unreadable_without_the_key_and_opens_with_it():
    uid = bytes(range(128))  # the size of an NCCL unique id
    raw = seal(KEY, "tm/e1/xfer/r0/nccl-id", uid)
    assert uid[:16] not in raw and len(raw) == len(uid) + 16 + 32  # nonce, ciphertext, tag
    assert open_value(KEY, "tm/e1/xfer/r0/nccl-id", raw) == uid  # control: the job's ranks read it
    assert seal(KEY, "tm/e1/xfer/r0/nccl-id", uid) != raw  # a fresh nonce each time: equal values look unequal


def test_a_flipped_ciphertext_byte_or_another_key_is_refused():
    raw = bytearray(seal(KEY, "n", b"127.0.0.1:29500"))
    assert open_value(KEY, "n", bytes(raw)) == b"127.0.0.1:29500"  # control
    raw[20] ^= 1
    with pytest.raises(ForgedValue):
        open_value(KEY, "n", bytes(raw))
    with pytest.raises(ForgedValue):
        open_value(b"x" * 32, "n", seal(KEY, "n", b"v"))
    with pytest.raises(ForgedValue):
        open_value(KEY, "n", b"short")


def _member(port, rank, out):
    inner = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=20),
                          wait_for_workers=False)
    pg = gloo_group(AuthStore(inner, KEY), "tm/enc/", rank, 2, host="127.0.0.1",
                    timeout=datetime.timedelta(seconds=20))
    t = torch.tensor([float(rank + 1)])
    pg.allreduce([t]).wait()
    out[rank] = t.item()


@GLOO
def test_gloos_addresses_are_not_in_the_store_in_clear(store):  # noqa: F811 - the fixture
    """What another user reading the store sees of gloo's pair addresses: not the address."""
    reader = dist.TCPStore("127.0.0.1", store, is_master=False, timeout=datetime.timedelta(seconds=20),
                           wait_for_workers=False)
    out: dict = {}
    threads = [threading.Thread(target=_member, args=(store, r, out)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == {0: 3.0, 1: 3.0}
    loopback = bytes([127, 0, 0, 1])  # gloo's address: a sockaddr, the IPv4 address as 4 bytes
    for k in ("tm/enc//0/0", "tm/enc//0/1"):
        raw = reader.get(k)
        assert loopback in open_value(KEY, k, raw)  # control: the address is in the value
        assert loopback not in raw[16:-32]            # but not in what the store holds


# --- the CPU wire tensors ------------------------------------------------------------------------

class Relay(transfer.GlooChannel):
    """A peer between the leaver and the joiner: it relays the leaver's sealed manifest (it
    cannot make one) and sends tensors of its own; word sums it can compute, the MAC it cannot
    (it has no key: it sends one made under another). `poison` False: the bytes are the leaver's."""

    def __init__(self, pg, poison: bool):
        super().__init__(pg)
        self.poison, self.sent = poison, 0

    def send_planned(self, plan, dst, corrupt=False, manifest=None):
        sealed = manifest()  # the leaver's genuine bytes
        if self.poison:
            with torch.no_grad():
                for t in plan.tensors:
                    if t.is_floating_point():
                        t.add_(1.0)
        super().send_planned(plan, dst, manifest=lambda: sealed)

    def send_bytes(self, data, dst):
        self.sent += 1
        if self.poison and self.sent == 2:  # the wire MAC: only one under another key can be made
            data = transfer.wire_mac(b"r" * 32, "x", "", [])
        super().send_bytes(data, dst)


def _relayed(store_port, prefix, poison, key):  # noqa: F811
    a, b = gloo_groups(store_port, prefix, 2, datetime.timedelta(seconds=20))
    sent, like = big_state(), zeroed(big_state())
    want = digest_tensors(transfer.pack(big_state())[1])
    out: dict = {}

    def recv():
        try:
            out["state"], _, _ = transfer.recv_planned(transfer.GlooChannel(b), xferplan.for_receiving(like),
                                                       key=key, context="tm/e1/r0", src=0, like=like)
        except MigrationError as exc:
            out["error"] = exc
    t = threading.Thread(target=recv)
    t.start()
    _, plan = xferplan.of_state(sent)
    transfer.send_planned(sent, Relay(a, poison), plan, key=key, context="tm/e1/r0", dst=1)
    t.join(30)
    return out, want


@GLOO
def test_a_relayed_manifest_with_swapped_wire_tensors_is_refused(store):  # noqa: F811
    out, _ = _relayed(store, "relay1/", poison=True, key=KEY)
    assert isinstance(out.get("error"), transfer.StateRefused) and "wire tensors" in str(out["error"])
    assert "state" not in out


@GLOO
def test_relayed_genuine_bytes_pass_and_without_the_mac_a_swap_would_be_loaded(store):  # noqa: F811
    """Controls: the leaver's own bytes pass the MAC (bit-exact); without a key (the check tool's
    own processes) the swapped tensors pass the word sums: the MAC is what refuses them."""
    out, want = _relayed(store, "relay2/", poison=False, key=KEY)
    assert "error" not in out and digest_tensors(transfer.pack(out["state"])[1]) == want
    out, want = _relayed(store, "relay3/", poison=True, key=None)
    assert "error" not in out and digest_tensors(transfer.pack(out["state"])[1]) != want


def test_the_wire_mac_is_bound_to_key_transfer_plan_and_bytes():
    ts = [torch.arange(10, dtype=torch.float32), torch.ones(3, dtype=torch.int64)]
    mac = transfer.wire_mac(KEY, "tm/e1/r0", "sig", ts)
    assert mac == transfer.wire_mac(KEY, "tm/e1/r0", "sig", [t.clone() for t in ts])  # control: same bytes
    assert mac != transfer.wire_mac(b"x" * 32, "tm/e1/r0", "sig", ts)
    assert mac != transfer.wire_mac(KEY, "tm/e1/r1", "sig", ts)   # replayed into another transfer
    assert mac != transfer.wire_mac(KEY, "tm/e1/r0", "sig2", ts)
    flipped = [ts[0].clone(), ts[1]]
    flipped[0].view(torch.uint8)[5] ^= 1
    assert mac != transfer.wire_mac(KEY, "tm/e1/r0", "sig", flipped)
    # bytes moved from one tensor to the next are another input (each tensor's length is hashed)
    assert transfer.wire_mac(KEY, "c", "s", [torch.zeros(4, dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8)]) \
        != transfer.wire_mac(KEY, "c", "s", [torch.zeros(2, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8)])


def test_wire_mac_cost_on_cpu(capsys):
    """The CPU cost of the MAC, one side (docs/security.md quotes the number this prints); the
    bound only catches a MAC that went byte by byte in Python."""
    t = torch.randn(64 << 18)  # 64 MiB of float32
    transfer.wire_mac(KEY, "c", "s", [t])
    t0 = time.perf_counter()
    transfer.wire_mac(KEY, "c", "s", [t])
    s = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nwire_mac: 64 MiB in {s * 1000:.1f} ms ({64 / 1024 / s:.2f} GiB/s)")
    assert s < 5.0
