"""Phase 1's pre-connection of a pipeline group's neighbours (NcclBackend.preconnect with
`neighbours`), without a GPU: which groups ask for it, and that the sends and receives of all
members of a group pair up (an unmatched one would hang NCCL until the group timeout)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from trainmover.groups.nccl import backend as nccl_backend
from trainmover.groups.specs import GroupSpec
from trainmover.runtime.worker import Agent


class FakeComm:
    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.ops = rank, size, []

    def send(self, t, peer):
        self.ops.append(("send", peer, t.data_ptr()))

    def recv(self, t, peer):
        self.ops.append(("recv", peer, t.data_ptr()))


def neighbour_ops(size: int) -> list[list[tuple]]:
    buf = torch.ones(2)
    out = []
    for rank in range(size):
        comm = FakeComm(rank, size)
        nccl_backend.NcclBackend(comm, store=None, prefix="p/")._preconnect_neighbours(buf)
        out.append(comm.ops)
    return out


@pytest.fixture(autouse=True)
def no_nccl_group(monkeypatch):
    monkeypatch.setattr(nccl_backend.lib, "group", contextlib.nullcontext)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_every_send_has_its_receive_on_the_neighbour(size):
    ops = neighbour_ops(size)
    sends = sorted((r, p) for r, rank_ops in enumerate(ops) for kind, p, _ in rank_ops if kind == "send")
    recvs = sorted((p, r) for r, rank_ops in enumerate(ops) for kind, p, _ in rank_ops if kind == "recv")
    assert sends == recvs  # rank r sends to p exactly when p receives from r
    # both ways between neighbours, nothing else: a pipeline's stages talk to r-1 and r+1 only
    assert set(sends) == {(r, p) for r in range(size) for p in (r - 1, r + 1) if 0 <= p < size}
    assert not any(abs(r - p) > 1 for r, p in sends)


def test_sent_from_the_first_float_received_into_the_second():
    buf = torch.ones(2)
    comm = FakeComm(1, 3)
    nccl_backend.NcclBackend(comm, store=None, prefix="p/")._preconnect_neighbours(buf)
    base, step = buf.data_ptr(), buf.element_size()
    assert {ptr for kind, _, ptr in comm.ops if kind == "send"} == {base}
    assert {ptr for kind, _, ptr in comm.ops if kind == "recv"} == {base + step}


def test_only_a_group_marked_p2p_asks_its_backend_for_neighbours(monkeypatch):
    asked = {}

    class FakeBackend:
        def preconnect(self, p2p, neighbours=False):
            asked[self.name] = (p2p, neighbours)

    def fake_group(store, prefix, grank, size, *, timeout_s, name, device=None):
        b = FakeBackend()
        b.name = name
        return b

    monkeypatch.setattr(nccl_backend, "nccl_group", fake_group)
    agent = SimpleNamespace(backend="nccl", store=None, spec=SimpleNamespace(job=SimpleNamespace(group_timeout_s=5)),
                            specs=[GroupSpec("world", (0, 1, 2), p2p=True), GroupSpec("embd.0", (0, 2)),
                                   GroupSpec("tm-control", (0, 1, 2))])
    for name, size in (("world", 3), ("embd.0", 2), ("xfer", 2)):
        Agent.build_backend(agent, name, f"tm/e1/{name}/", 0, size)
    assert asked == {"world": (False, True),  # the pipeline: its neighbours
                     "embd.0": (False, False),  # control: an all-reduce group, no sends
                     "xfer": (True, False)}  # the transfer pair: its own p2p pre-connection
