"""The controller's channel server under the load of many ranks, on one machine (issue 38).

A child process opens `--conns` authenticated connections (one per stub rank) and sends what
ranks send the controller in steady state: a `step` report every `--step-s` and a `beat` every
`--beat-s` per connection (`--beats-after-steps`: a beat only when no step report went out for
`--beat-s`, as runtime/heartbeat.py now does). This process runs channel.Server and a consumer
that drains its inbox the way the controller's loop does. Printed and written as JSON: this
process's CPU seconds per minute (the server's threads and the consumer), its thread count,
the messages per second received.

    python bench/channel_server_load.py --conns 1024 --seconds 30
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from trainmover.protocol import channel
from trainmover.protocol.messages import make


def _threads() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def client(address: tuple[str, int], key: bytes, conns: int, seconds: float, step_s: float, beat_s: float,
           beats_after_steps: bool) -> None:
    peers = [channel.connect(address, key, make("hello", role="worker", node=f"n{i // 8}", ranks=[i], pid=i),
                             timeout=60) for i in range(conns)]
    print("connected", flush=True)
    t0 = time.monotonic()
    next_step = t0 + step_s
    next_beat = t0 + beat_s
    last_step = t0
    step = 0
    while time.monotonic() - t0 < seconds:
        now = time.monotonic()
        if now >= next_step:
            step += 1
            for i, c in enumerate(peers):
                c.send(make("step", rank=i, step=step, loss=0.0, step_s=step_s, compute_s=step_s, t=time.time()))
            next_step += step_s
            last_step = now
        if now >= next_beat:
            if not beats_after_steps or now - last_step >= beat_s:
                for i, c in enumerate(peers):
                    c.send(make("beat", ranks=[i], step=step, issued={}, waiting={}, cpu_s=0.0))
            next_beat = (last_step + beat_s) if beats_after_steps and now - last_step < beat_s else next_beat + beat_s
        time.sleep(max(0.0, min(next_step, next_beat) - time.monotonic()))
    for c in peers:
        c.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conns", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--beat-s", type=float, default=0.5)
    ap.add_argument("--beats-after-steps", action="store_true")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--client", default="")  # internal: host:port:keyhex
    args = ap.parse_args()
    if args.client:
        host, port, key = args.client.split(":")
        client((host, int(port)), bytes.fromhex(key), args.conns, args.seconds, args.step_s, args.beat_s,
               args.beats_after_steps)
        return 0
    key = channel.new_secret()
    srv = channel.Server("127.0.0.1", key, handshake_timeout=30.0)
    got = {"n": 0}

    def consume() -> None:
        while True:
            srv.inbox.get()
            got["n"] += 1
    threading.Thread(target=consume, daemon=True).start()
    warm = 5.0
    child = subprocess.Popen([sys.executable, __file__, "--client", f"{srv.address[0]}:{srv.address[1]}:{key.hex()}",
                              "--conns", str(args.conns), "--seconds", str(args.seconds + warm + 2),
                              "--step-s", str(args.step_s), "--beat-s", str(args.beat_s)]
                             + (["--beats-after-steps"] if args.beats_after_steps else []),
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    child.stdout.readline()  # connected
    time.sleep(warm)
    c0, n0, w0 = time.process_time(), got["n"], time.monotonic()
    time.sleep(args.seconds)
    c1, n1, w1 = time.process_time(), got["n"], time.monotonic()
    threads = _threads()
    child.wait(timeout=120)
    res = {"label": args.label, "conns": args.conns, "seconds": round(w1 - w0, 2), "step_s": args.step_s,
           "beat_s": args.beat_s, "beats_after_steps": args.beats_after_steps,
           "server_cpu_s_per_min": round((c1 - c0) / (w1 - w0) * 60, 2),
           "messages_per_s": round((n1 - n0) / (w1 - w0), 1), "threads": threads,
           "loadavg": os.getloadavg()}
    print(json.dumps(res))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(res) + "\n")
    srv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
