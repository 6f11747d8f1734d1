"""Grouped NCCL send/recv of a model's state tensor list through cuda/libtmdelta, against one
buffer of the same size: where does state-copy bandwidth go?

    python bench/p2p_grouped.py --preset 1b     (2 GPUs; variants of NCCL settings by env)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKER = r'''
import os, sys, time, json, datetime, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from trainmover.groups.nccl import lib
from trainmover.workloads.gpt_demo import GPT, PRESETS
rank, port, order = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4]
torch.cuda.set_device(rank)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
if rank == 0: store.set("uid", lib.unique_id())
comm = lib.Comm.init_start("p2p", store.get("uid"), 2, rank, rank); comm.wait(60000)
layers, d, h, s, b, v = PRESETS[sys.argv[5]]
with torch.device("meta"):
    shapes = [p.shape for p in GPT(layers, d, h, s, v).parameters()]
tensors = [torch.ones(sh, device="cuda") for sh in shapes for _ in range(3)]  # param, exp_avg, exp_avg_sq
if order == "big-first": tensors.sort(key=lambda t: -t.numel())
flat = torch.ones(sum(t.numel() for t in tensors), device="cuda")
def run(ts):
    out = []
    for i in range(5):
        torch.cuda.synchronize(); store.set(f"b{i}{len(ts)}{rank}", "1"); store.wait([f"b{i}{len(ts)}{1-rank}"])
        t0 = time.perf_counter()
        with lib.group():
            for t in ts: (comm.send if rank == 0 else comm.recv)(t, 1 - rank)
        torch.cuda.synchronize(); out.append(time.perf_counter() - t0)
    return sorted(out[1:])[len(out[1:]) // 2]
nbytes = flat.numel() * 4
r = {"tensors": len(tensors), "bytes": nbytes, "grouped_GBps": nbytes / run(tensors) / 1e9, "one_buffer_GBps": nbytes / run([flat]) / 1e9}
if rank == 1: print("RESULT", json.dumps(r), flush=True)
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="1b")
    args = ap.parse_args()
    variants = {"default": {}, "chunk2M": {"NCCL_P2P_NVL_CHUNKSIZE": str(2 << 20)},
                "minch32": {"NCCL_MIN_P2P_NCHANNELS": "32"}, "order": {}}
    results = {}
    for i, (name, extra) in enumerate(variants.items()):
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
               "NVSHMEM_DISABLE_NVLS": "1", **extra}
        order = "big-first" if name == "order" else "as-is"
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(29600 + i), str(ROOT), order, args.preset],
                                  stdout=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
        out = procs[1].communicate(timeout=240)[0]
        procs[0].wait(timeout=60)
        line = next((l for l in out.splitlines() if l.startswith("RESULT")), None)
        results[name] = {**json.loads(line[7:]), "env": extra, "order": order} if line else {"error": out[-500:]}
        print(name, results[name], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
