"""The planned state transfer alone (runtime/transfer/plan.py through NcclChannel), GPU 0 to GPU 1, on a
model's state layout: how long the receiver's part of the pause takes, and what the chunk size
and the checks (captured as CUDA graphs, or launched kernel by kernel) cost.

    python bench/p2p_plan.py --preset 1b --out bench/results/p2p-plan.json     (2 GPUs)

Each variant: both sides make their plans ahead (as Phase 1 does), then REPEATS transfers, each
started by a store barrier; the receiver's time is from the barrier to the state received and
verified (its `receive_s` in a migration), the sender's marks say where its host time went.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REPEATS = 4
VARIANTS = {  # name: (CHUNK_BYTES, checks captured as CUDA graphs)
    "chunks4G-graphs": (4 << 30, True),
    "chunks4G-eager": (4 << 30, False),
    "chunks1G-graphs": (1 << 30, True),
    "one-group-graphs": (1 << 40, True),
}


def state_of(preset: str, seed: int) -> dict:
    """A gpt_demo model's training state layout (parameter, exp_avg, exp_avg_sq of each), random."""
    import torch
    from trainmover.workloads.gpt_demo import GPT, PRESETS
    layers, d, h, s, b, v = PRESETS[preset]
    with torch.device("meta"):
        named = [(n, p.shape) for n, p in GPT(layers, d, h, s, v).named_parameters()]
    g = torch.Generator(device="cuda").manual_seed(seed)
    model = {n: torch.rand(sh, device="cuda", generator=g) for n, sh in named}
    opt = {n: {"exp_avg": torch.rand(sh, device="cuda", generator=g), "exp_avg_sq": torch.rand(sh, device="cuda", generator=g),
               "step": torch.tensor(5.0)} for n, sh in named}
    return {"workload": {"model": model, "optimizer": {"state": opt}}, "rng": torch.get_rng_state(), "step": 5}


def worker(rank: int, port: int, preset: str) -> None:
    import torch
    import torch.distributed as dist
    from trainmover.groups.nccl import lib
    from trainmover.groups.nccl.backend import NcclBackend
    from trainmover.runtime.transfer import plan as xferplan, state as transfer
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    if rank == 0:
        store.set("uid", lib.unique_id())
    comm = lib.Comm.init_start("p2p-plan", store.get("uid"), 2, rank, rank)
    comm.wait(60000)
    state = state_of(preset, seed=rank + 1)
    torch.cuda.synchronize()
    out = {}
    for vi, (name, (chunk, graphs)) in enumerate(VARIANTS.items()):
        try:
            xferplan.CHUNK_BYTES = chunk
            plan = xferplan.of_state(state)[1] if rank == 0 else xferplan.for_receiving(state)
            plan.warm(finite=rank == 1)
            if not graphs:
                plan._graphs = None
            rows = []
            for rep in range(REPEATS):
                chan = NcclBackend(comm, store, f"v{vi}r{rep}/").channel()
                torch.cuda.synchronize()
                store.set(f"b{vi}-{rep}-{rank}", "1")
                store.wait([f"b{vi}-{rep}-{1 - rank}"])
                t0 = time.perf_counter()
                if rank == 0:
                    stats = transfer.send_planned(state, chan, plan)
                    verdict = chan.recv_verdict(1)
                    rows.append({"send_s": time.perf_counter() - t0, "verdict": verdict, "parts": stats.parts})
                else:
                    _, stats, bad = transfer.recv_planned(chan, plan, like=state)
                    took = time.perf_counter() - t0
                    chan.send_verdict(transfer.OK if not bad else transfer.REFUSED, 0)
                    rows.append({"receive_s": took, "copy_s": stats.copy_s, "parts": stats.parts, "bytes": stats.bytes})
            key = "send_s" if rank == 0 else "receive_s"
            out[name] = {"chunk_bytes": chunk, "graphs": plan._graphs is not None, "chunks": len(plan.chunks),
                         f"{key}_median": statistics.median(r[key] for r in rows[1:]), "rows": rows}
            if rank == 1:
                out[name]["copy_GBps_median"] = statistics.median(r["bytes"] / r["copy_s"] / 1e9 for r in rows[1:])
        except Exception as exc:  # noqa: BLE001 - the other variants still run
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print("RESULT", json.dumps(out), flush=True)
    store.set(f"done{rank}", "1")
    store.wait([f"done{1 - rank}"])


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    from bench import results_io
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--machine", default="unknown", help="the machine kind, for the result (gpu_issue27.sh passes it)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout-s", type=float, default=240)
    args = ap.parse_args()
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "29655", args.preset],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for r in (0, 1)]
    got, errors = {}, []
    for r, p in enumerate(procs):
        try:
            text = p.communicate(timeout=args.timeout_s)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            text = p.communicate()[0]
            errors.append(f"rank {r}: past {args.timeout_s:g}s")
        line = next((ln for ln in text.splitlines() if ln.startswith("RESULT ")), None)
        if line:
            got[r] = json.loads(line[7:])
        else:
            errors.append(f"rank {r}: {text[-800:]}")
    metrics = {}
    for name in VARIANTS:
        recv, send = got.get(1, {}).get(name, {}), got.get(0, {}).get(name, {})
        metrics[name] = {"receive_s_median": recv.get("receive_s_median"), "copy_GBps_median": recv.get("copy_GBps_median"),
                         "send_s_median": send.get("send_s_median"), "graphs": recv.get("graphs"),
                         "chunks": recv.get("chunks"), "error": recv.get("error") or send.get("error"),
                         "receiver_rows": recv.get("rows"), "sender_rows": send.get("rows")}
    result = {"scenario": f"planned-transfer-{args.preset}", "machine": args.machine, **results_io.provenance(__file__),
              "settings": {"repeats": REPEATS, "median_of": "repeats after the first", "variants": VARIANTS},
              "metrics": metrics, "errors": errors, "complete": not errors and all(not m["error"] for m in metrics.values())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results_io.write(args.out, result)


if __name__ == "__main__":
    main()
