"""The job's rendezvous store with every value authenticated by the job's key.

The store (a TCPStore on the controller's node) is reachable by anyone who can reach its port,
and its address is no secret. Whoever could write to it could cancel a migration (the switch's
`cancel` keys), forge a holder's verdict, overwrite the CPU tensors a joiner loads, or race
gloo's and NCCL's address keys to receive the state stream. So every TrainMover process talks
to it through `AuthStore`: `set` stores nonce || ciphertext || tag, the value encrypted with a
key stream drawn from the job's key and a fresh nonce (SHAKE-256: the standard library has no
AES) and tagged with HMAC-SHA256 over (name, nonce, ciphertext) under another key drawn from the
job's; every read (`get`, `check`, `wait`, `compare_set`) accepts a value only with a valid tag
for that very name, under the full name the server sees (a PrefixStore above this one adds its
prefix first, so gloo's own address keys, which go through `set`/`get`/`wait` of the store
handed to ProcessGroupGloo, are covered too).

Encrypted, not only tagged: who can read the store could otherwise learn where gloo's pairs
listen and their sequence numbers, NCCL's unique id (whose bootstrap admits whoever holds it),
and the host tensors a GPU transfer passes through the store (RNG states, counters). A co-user
who connects to the store sees only lengths.

A forged value is never used: a read waits (within its deadline) for a genuine one, and `check`
says False. What the store cannot stop is someone deleting or overwriting the genuine value
after it was set: that is a denial of service (the wait times out and the migration fails
with a named error), never a misdirection (docs/security.md).

`add` is refused: a counter cannot carry a tag, and no TrainMover code relies on one.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import secrets
import time

import torch.distributed as dist

log = logging.getLogger(__name__)

_TAG = 32
_NONCE = 16
_POLL_S = 0.02  # between reads of a key that holds a forged value


class ForgedValue(RuntimeError):
    """A value in the store that the job's key did not tag."""


def _subkey(key: bytes, purpose: bytes) -> bytes:
    # one key for the stream, another for the tag: neither use can reveal the other's
    return hmac.new(key, b"trainmover store " + purpose, hashlib.sha256).digest()


def _stream(key: bytes, nonce: bytes, n: int) -> bytes:
    return hashlib.shake_256(_subkey(key, b"stream") + nonce).digest(n) if n else b""


def _tag(key: bytes, name: str, body: bytes) -> bytes:
    return hmac.new(_subkey(key, b"tag"), name.encode() + b"\0" + body, hashlib.sha256).digest()


def _xor(data: bytes, stream: bytes) -> bytes:
    return (int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")).to_bytes(len(data), "little")


def seal(key: bytes, name: str, value: bytes, nonce: bytes | None = None) -> bytes:
    """`value` encrypted and tagged for `name` (`nonce`: tests only; a fresh random one else)."""
    nonce = secrets.token_bytes(_NONCE) if nonce is None else nonce
    body = nonce + _xor(value, _stream(key, nonce, len(value)))
    return body + _tag(key, name, body)


def open_value(key: bytes, name: str, raw: bytes) -> bytes:
    """The value `seal` made for `name`; ForgedValue otherwise (the tag is checked first)."""
    body = raw[:-_TAG]
    if len(raw) < _NONCE + _TAG or not hmac.compare_digest(raw[-_TAG:], _tag(key, name, body)):
        raise ForgedValue(f"rendezvous key {name!r} holds a value not written by this job (ignored)")
    nonce, ciphertext = body[:_NONCE], body[_NONCE:]
    return _xor(ciphertext, _stream(key, nonce, len(ciphertext)))


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


# torch's type stubs for Store lack its `timeout` property and type values as str, where the
# stores take bytes: the `type: ignore`s below are those two, nothing else.
class AuthStore(dist.Store):
    """A `torch.distributed.Store` over `inner` (a TCPStore client) whose values are tagged with
    the job's `key`; usable wherever a store is (PrefixStore, ProcessGroupGloo)."""

    def __init__(self, inner: dist.Store, key: bytes) -> None:
        super().__init__()
        self.inner, self.key = inner, key
        super().set_timeout(inner.timeout)  # type: ignore[attr-defined]
        self.forged = 0  # forged values seen (tests, logs)
        self._warned: set[str] = set()  # keys already logged (a poll loop would repeat it)

    # --- writes ---------------------------------------------------------------------------
    def set(self, name: str, value: str | bytes) -> None:
        self.inner.set(name, seal(self.key, name, _bytes(value)))  # type: ignore[arg-type]

    def compare_set(self, name: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """As TCPStore.compare_set, on genuine values (a forged value reads as absent, empty):
        `desired` is stored if the key's genuine value equals `expected`; returns the genuine
        value held afterwards."""
        expected, desired = _bytes(expected), _bytes(desired)
        raw = self.inner.get(name) if self.inner.check([name]) else b""
        current = (self._genuine(name, raw) or b"") if raw else b""
        if current != expected:
            return current
        # atomic: `desired` is stored only while the raw value is still `raw`
        got = self.inner.compare_set(name, raw, seal(self.key, name, desired))  # type: ignore[arg-type]
        return (self._genuine(name, got) or b"") if got else b""

    def add(self, name: str, amount: int) -> int:
        raise NotImplementedError("AuthStore: counters cannot be authenticated; use set/get")

    def delete_key(self, name: str) -> bool:
        return bool(self.inner.delete_key(name))

    # --- reads ----------------------------------------------------------------------------
    def _genuine(self, name: str, raw: bytes) -> bytes | None:
        try:
            return open_value(self.key, name, raw)
        except ForgedValue as exc:
            self.forged += 1
            if name not in self._warned:
                self._warned.add(name)
                log.warning("%s", exc)
            return None

    def get(self, name: str) -> bytes:
        """The genuine value of `name`, waiting up to the store's timeout for one (as TCPStore.get
        waits for the key to exist)."""
        waited = self.timeout.total_seconds()  # type: ignore[attr-defined]
        deadline = time.monotonic() + waited
        while True:
            value = self._genuine(name, self.inner.get(name))
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"rendezvous key {name!r}: no genuine value within "
                                          f"{waited:.0f}s (a forged one is there)")
            time.sleep(_POLL_S)

    def check(self, names: list[str]) -> bool:
        """Whether every key holds a genuine value (a forged one counts as absent)."""
        if not self.inner.check(names):
            return False
        return all(self._genuine(n, self.inner.get(n)) is not None for n in names)

    def wait(self, names: list[str], timeout: datetime.timedelta | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout  # type: ignore[attr-defined]
        deadline = time.monotonic() + timeout.total_seconds()
        for name in names:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistStoreError(f"rendezvous wait for {name!r} timed out after "
                                              f"{timeout.total_seconds():.3f}s")
                self.inner.wait([name], datetime.timedelta(seconds=left))  # raises at its deadline
                if self._genuine(name, self.inner.get(name)) is not None:
                    break
                time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)
        super().set_timeout(timeout)
