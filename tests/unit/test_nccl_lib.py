"""The communicator library (cuda/) and its binding (trainmover.groups.nccl.lib).

CPU (a machine with a C++ compiler, a CUDA toolkit and NCCL; the tests skip without them): the
build, the communicator state logic on the test build's fake handles (libtmdelta_test.so), the
exported symbols of both builds, the NCCL enum values, the init error path without a GPU.
GPU (`-m gpu`, >= 2 GPUs; the migration test >= 3): real communicators in spawned processes.
    TM_TEST_GPU=1 python -m pytest tests/unit/test_nccl_lib.py -m gpu   (tests/conftest.py: why apart)
"""
from __future__ import annotations

import ctypes
import datetime
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from trainmover.groups.nccl import lib

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "scripts" / "build_cuda.sh"
# Every GPU run on the shared machines keeps NVLink multicast off.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.fixture(scope="session")
def build() -> str:
    """Runs the build script once (the library and its test build); returns its last line
    ("build_cuda: built/skipped ...")."""
    proc = subprocess.run(["bash", str(BUILD), "all", "test"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"build_cuda.sh failed:\n{proc.stdout}\n{proc.stderr}"
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(("build_cuda: built", "build_cuda: skipped")), proc.stdout
    lib._loaded.clear()  # load what this build produced
    return last


@pytest.fixture
def full(build):
    ok, why = lib.available()
    if not ok:
        pytest.skip(build if "skipped" in build else why)
    return lib.load()


@pytest.fixture
def testlib(build, monkeypatch):
    """The test build (make test: the production library plus tm_test_comm_fake), loaded in
    place of the production one for this test through TM_NCCL_LIB."""
    path = REPO / "cuda/build/libtmdelta_test.so"
    if not path.is_file():
        pytest.skip(build)
    monkeypatch.setenv("TM_NCCL_LIB", str(path))
    monkeypatch.setattr(lib, "_loaded", {})
    so = lib.load()
    so.tm_test_comm_fake.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
    so.tm_test_comm_fake.restype = ctypes.c_int
    return so


def fake_comm(so, name: str, rank: int, size: int) -> lib.Comm:
    """A READY handle without NCCL behind it (the test build's hook)."""
    h = ctypes.c_void_p()
    lib._check(so, so.tm_test_comm_fake(name.encode(), rank, size, ctypes.byref(h)))
    return lib.Comm(h, name)


def test_build_script_builds_or_says_what_is_missing(build):
    if "skipped" in build:
        assert "no " in build  # names what is missing
        assert not (REPO / "cuda/build/libtmdelta.so").exists()  # no stale library left to load
    else:
        assert (REPO / "cuda/build/libtmdelta.so").is_file()
        assert (REPO / "cuda/build/libtmdelta_test.so").is_file()


# ---- communicator state logic on the test build's fake handles ---------------------------------

def test_comm_lifecycle_on_fakes(testlib):
    c = fake_comm(testlib, "x", 0, 1)
    assert c.state == lib.CommState.READY and c.poll()
    c.revoke()
    assert c.state == lib.CommState.REVOKED
    c.destroy()
    assert c.state == lib.CommState.DESTROYED
    with pytest.raises(lib.NcclStateError, match="comm 'x' rank 0/1 phase=revoke: communicator is DESTROYED"):
        c.revoke()
    c.release()
    with pytest.raises(lib.NcclStateError, match="released"):
        c.state


def test_collectives_refuse_a_handle_without_nccl_and_abort_is_final(testlib):
    c = fake_comm(testlib, "y", 1, 2)
    with pytest.raises(lib.NcclError, match="comm 'y' rank 1/2 phase=allreduce: test fake has no NCCL communicator"):
        lib._check(testlib, testlib.tm_allreduce(c._handle(), None, None, 0, 7, 0, None))
    c.abort()
    assert c.state == lib.CommState.ABORTED
    c.destroy()  # destroying an aborted communicator is a no-op, not an error
    assert c.state == lib.CommState.ABORTED
    with pytest.raises(lib.NcclStateError, match="phase=poll: communicator is ABORTED"):
        c.poll()
    c.release()


# ---- native hygiene and binding details ------------------------------------------------------

@pytest.mark.skipif(not shutil.which("nm"), reason="nm (binutils) not installed")
@pytest.mark.parametrize("name", ["libtmdelta.so", "libtmdelta_test.so"])
def test_only_tm_symbols_are_exported_and_the_test_hook_only_by_the_test_build(build, name):
    path = REPO / "cuda/build" / name
    if not path.is_file():
        pytest.skip(build)
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert names and all(n.startswith("tm_") for n in names), names
    assert ("tm_test_comm_fake" in names) == (name == "libtmdelta_test.so"), names
    assert set(lib._SIGS) <= set(names)  # the binding's every function is there


def _nccl_header() -> Path | None:
    for p in [os.environ.get("NCCL_HOME", "")] + [str(Path(s) / "nvidia" / "nccl") for s in __import__("sys").path]:
        if p and (Path(p) / "include/nccl.h").is_file():
            return Path(p) / "include/nccl.h"
    return None


def test_dtype_and_op_values_match_nccl_h():
    header = _nccl_header()
    if header is None:
        pytest.skip("no nccl.h in NCCL_HOME or site-packages nvidia/nccl")
    text = header.read_text()
    names = {"int8": "ncclInt8", "uint8": "ncclUint8", "int32": "ncclInt32", "int64": "ncclInt64",
             "float16": "ncclFloat16", "float32": "ncclFloat32", "float64": "ncclFloat64",
             "bfloat16": "ncclBfloat16", "sum": "ncclSum", "prod": "ncclProd", "max": "ncclMax",
             "min": "ncclMin", "avg": "ncclAvg"}
    table = {**lib._NCCL_DTYPES, **lib._NCCL_OPS}
    for ours, theirs in names.items():
        m = re.search(rf"\b{theirs}\s*=\s*(\d+)", text)
        assert m and int(m.group(1)) == table[ours], ours


def test_op_names_and_reduce_ops():
    import torch.distributed as dist
    assert lib._op(dist.ReduceOp.AVG) == lib._op("avg") == 4
    assert lib._op(dist.ReduceOp.PRODUCT) == lib._op("prod")
    with pytest.raises(ValueError, match="not supported"):
        lib._op(dist.ReduceOp.BAND)
    assert lib._dtype(torch.zeros(1, dtype=torch.bfloat16)) == 9
    with pytest.raises(ValueError, match="not supported"):
        lib._dtype(torch.zeros(1, dtype=torch.complex64))


def test_available_never_raises(monkeypatch, tmp_path):
    monkeypatch.setenv("TM_NCCL_LIB", str(tmp_path / "nope.so"))
    monkeypatch.setattr(lib, "_loaded", {})
    ok, why = lib.available()
    assert not ok and "nope.so is not built" in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path without a GPU")
def test_init_without_a_gpu_names_comm_rank_and_phase(full):
    with pytest.raises(lib.NcclError, match=r"comm 'world@e1' rank 1/2 phase=init: cudaSetDevice failed") as err:
        lib.Comm.init_start("world@e1", lib.unique_id(), 2, 1, 0)
    assert err.value.status == lib.Status.CUDA


def test_unique_ids_differ_and_no_comm_was_created(testlib):
    before = lib.created_count()
    a, b = lib.unique_id(), lib.unique_id()
    assert len(a) == lib.UNIQUE_ID_BYTES and a != b
    fake_comm(testlib, "f", 0, 1).release()
    assert lib.created_count() == before


# ---- GPU: real communicators in spawned processes ---------------------------------------------
TIMEOUT_MS = 60_000


def _store(port: int):
    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))


def _uid(store, key: str, create: bool) -> bytes:
    if create:
        store.set(key, lib.unique_id())
    return store.get(key)  # waits (store timeout) until the creator has set it


def _check_collectives(comm, i: int, m: int):
    """allreduce (sum, avg), broadcast, allgather, reduce_scatter on a READY comm of m ranks."""
    x = torch.full((1000,), float(i + 1), device="cuda")
    comm.allreduce(x)
    a = torch.full((10,), float(i), device="cuda", dtype=torch.float64)
    comm.allreduce(a, op=torch.distributed.ReduceOp.AVG)
    b = torch.arange(8, device="cuda", dtype=torch.int64) * (i + 1)
    comm.broadcast(b, root=m - 1)
    g = torch.empty(m * 3, device="cuda", dtype=torch.bfloat16)
    comm.allgather(torch.full((3,), float(i), device="cuda", dtype=torch.bfloat16), g)
    rs = torch.empty(4, device="cuda", dtype=torch.int32)
    comm.reduce_scatter(torch.arange(4 * m, device="cuda", dtype=torch.int32), rs)
    torch.cuda.synchronize()
    assert torch.all(x == m * (m + 1) / 2), x[:4]
    assert torch.allclose(a, torch.full_like(a, (m - 1) / 2))
    assert torch.equal(b, torch.arange(8, device="cuda", dtype=torch.int64) * m)
    assert torch.equal(g.float(), torch.arange(m, device="cuda").repeat_interleave(3).float())
    assert torch.equal(rs, (torch.arange(4, device="cuda", dtype=torch.int32) + 4 * comm.rank) * m)


STATE = [(1000, torch.float32), (333, torch.bfloat16), (77, torch.int64), (4096, torch.float16), (5, torch.uint8)]


def _state_tensors(seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(0, 100, (n,), generator=g).to(dt).cuda() for n, dt in STATE]


def _migration_child(i: int, port: int, m: int, k: int):
    """Members 0..m-1 on GPUs 0..m-1 share `world`; process m (GPU m) is the spare. Member k
    leaves: the spare takes group rank k in a new `world`, receives k's state in one grouped
    transfer, stayers switch to the new comm (the old one revoked, then destroyed, as
    trainmover/groups/nccl/backend.py retires one) and the results agree."""
    store = _store(port)
    torch.cuda.set_device(i)
    role = "joiner" if i == m else ("leaver" if i == k else "stayer")
    grank = k if role == "joiner" else i
    active = None
    if role != "joiner":
        old = lib.Comm.init_start("world", _uid(store, "e0/world", i == 0), m, i, i)
        old.wait(TIMEOUT_MS)
        active = old
        _check_collectives(active, i, m)
    # Phase 1, while the old comm keeps working.
    if role in ("stayer", "joiner"):
        new = lib.Comm.init_start("world@e1", _uid(store, "e1/world", i == 0), m, grank, i)
    if role in ("leaver", "joiner"):
        xfer = lib.Comm.init_start("xfer@e1", _uid(store, "e1/xfer", role == "leaver"), 2,
                                   0 if role == "leaver" else 1, i)
    if role != "joiner":
        y = torch.ones(16, device="cuda")
        active.allreduce(y)
        torch.cuda.synchronize()
        assert torch.all(y == m)
    t0 = time.perf_counter()
    if role in ("stayer", "joiner"):
        new.wait(TIMEOUT_MS)
    if role in ("leaver", "joiner"):
        xfer.wait(TIMEOUT_MS)
    print(f"rank {i} ({role}): Phase-1 comms ready {1e3 * (time.perf_counter() - t0):.1f} ms after the old comm's check")
    if role == "stayer":
        assert old.state == lib.CommState.READY and new.state == lib.CommState.READY  # Phase 1 left the live one alone
    # State transfer: several tensors of several dtypes, one grouped send/recv.
    if role == "leaver":
        with lib.group():
            for t in _state_tensors(seed=k):
                xfer.send(t, 1)
        torch.cuda.synchronize()
    if role == "joiner":
        got = [torch.zeros(n, dtype=dt, device="cuda") for n, dt in STATE]
        with lib.group():
            for t in got:
                xfer.recv(t, 0)
        torch.cuda.synchronize()
        for a, b in zip(got, _state_tensors(seed=k)):
            assert torch.equal(a, b), (a.dtype, a[:4], b[:4])
    # Switch (the iteration boundary).
    if role == "stayer":
        t0 = time.perf_counter()
        active = new
        old.revoke()
        old.destroy()
        print(f"rank {i}: switch (revoke + destroy of the old comm) {1e3 * (time.perf_counter() - t0):.1f} ms")
        # NCCL >= 2.28.7 revokes then destroys; older NCCL has no revoke and aborts.
        revoked = lib.nccl_version()[1] >= 22807
        assert old.state == (lib.CommState.DESTROYED if revoked else lib.CommState.ABORTED), old
        with pytest.raises(lib.NcclStateError, match="communicator is"):
            old.allreduce(torch.ones(4, device="cuda"))
    if role == "leaver":
        old.revoke()
        old.destroy()
        xfer.destroy()
    if role == "joiner":
        xfer.destroy()
        active = new
    if role != "leaver":
        new.set_op_timeout(TIMEOUT_MS)
        _check_collectives(active, grank, m)  # the joiner answers as rank k did
        assert lib.created_count() == 2
    store.set(f"done/{i}", b"1")
    store.wait([f"done/{j}" for j in range(m + 1)])


def _timeout_child(i: int, port: int):
    """Two members share `world`; member 0 starts a replacement that member 1 never joins."""
    store = _store(port)
    torch.cuda.set_device(i)
    old = lib.Comm.init_start("world", _uid(store, "t/world", i == 0), 2, i, i)
    old.wait(TIMEOUT_MS)
    if i == 0:
        new = lib.Comm.init_start("world@e1", lib.unique_id(), 2, 0, i)  # nobody else has this id
        t0 = time.monotonic()
        with pytest.raises(lib.NcclTimeout, match=r"comm 'world@e1' rank 0/2 phase=init: not ready after 2000 ms") as err:
            new.wait(2000)
        elapsed = time.monotonic() - t0
        assert 1.9 <= elapsed < 10, elapsed
        assert new.state == lib.CommState.ABORTED and err.value.status == lib.Status.TIMEOUT
    store.set(f"t/phase1-over/{i}", b"1")
    store.wait(["t/phase1-over/0", "t/phase1-over/1"])
    x = torch.full((256,), float(i + 1), device="cuda")
    old.allreduce(x)  # the old communicator is untouched
    torch.cuda.synchronize()
    assert torch.all(x == 3) and old.state == lib.CommState.READY
    old.destroy()


def _spawn(fn, nprocs: int, *args, monkeypatch):
    from torch.distributed import TCPStore
    import torch.multiprocessing as mp
    for k, v in GPU_ENV.items():
        monkeypatch.setenv(k, v)
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
    mp.spawn(fn, args=(master.port, *args), nprocs=nprocs, join=True)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(_gpus() < 3, reason="needs 3 GPUs (2 members + a spare); NCCL refuses 2 ranks of one comm on one GPU")
def test_joiner_takes_the_leavers_slot(full, monkeypatch):
    n = min(_gpus(), 4)
    m = n - 1  # members; the last GPU holds the spare
    _spawn(_migration_child, n, m, 1, monkeypatch=monkeypatch)


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
def test_phase1_timeout_aborts_only_the_new_comm(full, monkeypatch):
    _spawn(_timeout_child, 2, monkeypatch=monkeypatch)
