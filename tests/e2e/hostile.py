"""The other user's attacks on a running job (tests/e2e/test_hostile_user.py runs this as
OTHER_USER with `runuser`): what anyone on the nodes and the network can do without the job's
files, bounded in count and time.

* `--control HOST:PORT`: hold `--conns` connections to the controller's control port, none of
  which ever completes a handshake (one byte every `--drip` seconds); one the server drops is
  opened again after `--reopen` seconds, so that the pressure lasts.
* `--store HOST:PORT`: claim every rendezvous key a migration of epochs 1..4 will use (cancel,
  go, layout of each rank; the joiner's gloo address keys) with forged values, again and again,
  without overwriting a value already there (compare_set on an empty key): the job must ignore
  them, never cancel or be misdirected.

Ends after `--seconds` or when the file `--stop` appears; writes what it did as JSON to `--out`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import selectors
import socket
import time


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def store_keys(ranks: int) -> list[str]:
    keys = []
    for epoch in range(1, 5):
        for rank in range(ranks):
            base = f"tm/e{epoch}/xfer/r{rank}/"
            keys += [base + "cancel", base + "go", base + "layout", base + "/0/0", base + "/0/1"]
    return keys


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--control")
    p.add_argument("--store")
    p.add_argument("--conns", type=int, default=1000)
    p.add_argument("--drip", type=float, default=3.0)
    p.add_argument("--reopen", type=float, default=2.0)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--stop", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.conns + 256)), hard))
    end = time.monotonic() + args.seconds
    report = {"opened": 0, "refused": 0, "dropped_by_server": 0, "most_open": 0, "store_claims": 0,
              "store_errors": [], "drops_within_s": []}

    store = None
    keys = store_keys(args.ranks)
    if args.store:
        import torch.distributed as dist
        host, port = _addr(args.store)
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=5))

    sel = selectors.DefaultSelector()
    opened_at: dict[socket.socket, float] = {}
    reopen_at: list[float] = []

    def open_one() -> None:
        try:
            s = socket.create_connection(_addr(args.control), timeout=2)
        except OSError:
            report["refused"] += 1
            reopen_at.append(time.monotonic() + args.reopen)
            return
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        opened_at[s] = time.monotonic()
        report["opened"] += 1

    if args.control:
        for _ in range(args.conns):
            open_one()
    with open(args.out + ".started", "w") as f:  # the test drains the node once the flood is on
        json.dump({"opened": report["opened"]}, f)
    next_drip = time.monotonic() + args.drip
    next_claim = 0.0
    while time.monotonic() < end and not os.path.exists(args.stop):
        for key, _ in sel.select(timeout=0.1):
            s = key.fileobj
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:  # the server dropped it
                report["dropped_by_server"] += 1
                report["drops_within_s"].append(round(time.monotonic() - opened_at.pop(s), 2))
                sel.unregister(s)
                s.close()
                reopen_at.append(time.monotonic() + args.reopen)
        now = time.monotonic()
        for t in [t for t in reopen_at if t <= now]:
            reopen_at.remove(t)
            open_one()
        report["most_open"] = max(report["most_open"], len(opened_at))
        if now >= next_drip:  # one byte: never a whole nonce and frame
            next_drip = now + args.drip
            for s in list(opened_at):
                try:
                    s.send(b"\x00")
                except OSError:
                    pass
        if store is not None and now >= next_claim:
            next_claim = now + 0.2
            for k in keys:
                try:
                    store.compare_set(k, b"", b"1")  # only where nothing is yet: never a genuine value
                    report["store_claims"] += 1
                except Exception as exc:  # noqa: BLE001 - the store gone (the job ended): report it
                    report["store_errors"].append(str(exc)[:200])
                    store = None
                    break
    for s in list(opened_at):
        s.close()
    report["drops_within_s"] = sorted(report["drops_within_s"])
    with open(args.out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
