"""GPU: a one-node job's first snapshot goes straight from the worker's GPU to the standby
holder's (runtime/protection/holding.py, "The first version"): NCCL through cuda/libtmdelta, no host
memory pinned on either side; held, verified (a spoilt copy sent again), and restorable into
the standby's own buffers bit for bit. Skipped without 2 GPUs (run with `pytest -m gpu`)."""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

KEY = b"k" * 32
TIMEOUT_S = 60


def _state(step: int, seed: int, device: str) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    big = torch.randn(64, 1 << 20, generator=g).to(device)            # 256 MB
    small = torch.randn(7, 5, generator=g).to(device, torch.bfloat16)  # packed
    return {"workload": {"model": {"w": big, "b": small}, "data": {"cursor": step}},
            "rng": {"torch": torch.get_rng_state()}, "step": step}


def _pair(store, prefix, grank):
    from trainmover.groups.nccl.backend import nccl_group
    backend = nccl_group(store, prefix, grank, 2, timeout_s=TIMEOUT_S, name="xfer")
    backend.preconnect(p2p=True)
    return backend


def _side(role: str, port: int, out) -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    import time
    from tests.unit.test_capture_holding import _until
    from trainmover.runtime.protection import capture, holding
    from trainmover.groups.tensors import digest_tensors, tensors_of
    try:
        torch.cuda.set_device(0 if role == "worker" else 1)
        torch.cuda.init()
        addr = ("127.0.0.1", port)
        live = _state(9, seed=1, device="cuda")
        digest = digest_tensors(tensors_of(live))
        if role == "worker":
            link = holding.StandbyLink(addr, "tm/hold/g1/", 0, "gpu1", "127.0.0.1", TIMEOUT_S, key=KEY, direct=_pair)
            assert _until(link.direct_due, TIMEOUT_S), link.direct_note
            numbers = link.send_direct(9, live, corrupt=True)
            out.put(("worker", numbers["attempts"], digest))
            time.sleep(3)  # the holder restores and reports before this side's communicator goes
        else:
            reports = []
            layout = capture.specs_of(*capture.flatten(live)[1:])
            holder = holding.Holding(addr, "tm/hold/g1/", 0, "127.0.0.1", TIMEOUT_S,
                                     lambda r, s, d: reports.append((s, d)), key=KEY, verify_on="cuda",
                                     layout=layout, direct=_pair)
            assert _until(lambda: bool(reports), TIMEOUT_S), holder.direct_note
            version = holder.version(9)
            mine = _state(0, seed=2, device="cuda")
            restored, placed = capture.restore_into(version.state(), like=mine)
            model = version.state()["workload"]["model"]  # RNG states and counters stay host tensors
            out.put(("holder", reports[0][0], version.on_device, all(t.is_cuda for t in model.values()),
                     digest_tensors(tensors_of(restored)), placed,
                     restored["workload"]["model"]["w"].data_ptr() == mine["workload"]["model"]["w"].data_ptr()))
            holder.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((role, "error", repr(exc)))


@pytest.mark.timeout(180)
def test_the_first_snapshot_lands_on_the_holders_gpu_and_restores_bit_exactly():
    import torch.distributed as dist
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=s.detach(),
                            use_libuv=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_side, args=(role, port, out)) for role in ("worker", "holder")]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        item = out.get(timeout=150)
        got[item[0]] = item[1:]
    for p in procs:
        p.join(30)
    del master
    assert "error" not in got["worker"] and "error" not in got["holder"], got
    attempts, digest = got["worker"]
    steps, on_device, cuda, restored_digest, placed, in_place = got["holder"]
    assert attempts == 2  # the spoilt first copy was seen and sent again
    assert steps == [9] and on_device and cuda and in_place and placed > 256 << 20
    assert restored_digest == digest
