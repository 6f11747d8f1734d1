"""An authenticated message channel over TCP.

Frame: 4-byte big-endian length | JSON body | 32-byte HMAC-SHA256.
The MAC key is the job's secret; the MAC covers a per-connection random challenge sent by
the server, the direction and a sequence number, so a process without the secret can
neither talk nor replay a captured frame. Frames over `MAX_FRAME` bytes are refused
before they are read. Every blocking call has a deadline.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import queue
import secrets
import socket
import struct
import threading
import time
import logging

from trainmover.control.messages import validate
from trainmover.errors import DeadlineExceeded, ProtocolError

log = logging.getLogger(__name__)

MAX_FRAME = 1 << 20
_MAC = 32
_CHALLENGE = 16


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def write_secret(path: str) -> bytes:
    """Create the job's secret, readable by the job's user only (it lives on the shared
    job directory so that the CLI on a login node can use it)."""
    secret = new_secret()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret.hex().encode())
    return secret


def read_secret(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return bytes.fromhex(f.read().decode().strip())
    except (OSError, ValueError) as exc:
        raise ProtocolError(f"cannot read the job secret at {path}: {exc}") from exc


class _Framer:
    def __init__(self, sock: socket.socket, key: bytes, challenge: bytes, is_server: bool):
        self.sock, self.key, self.challenge = sock, key, challenge
        self.tx_dir, self.rx_dir = (b"S", b"C") if is_server else (b"C", b"S")
        self.tx_seq = self.rx_seq = 0
        self.lock = threading.Lock()

    def _mac(self, direction: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(self.key, self.challenge + direction + struct.pack(">Q", seq) + body, hashlib.sha256).digest()

    def send(self, msg: dict) -> None:
        body = json.dumps(validate(msg), separators=(",", ":")).encode()
        if len(body) > MAX_FRAME:
            raise ProtocolError(f"message too large ({len(body)} bytes)")
        with self.lock:
            mac = self._mac(self.tx_dir, self.tx_seq, body)
            self.tx_seq += 1
            self.sock.sendall(struct.pack(">I", len(body)) + body + mac)

    def recv(self) -> dict | None:
        head = _read_exact(self.sock, 4)
        if head is None:
            return None
        (length,) = struct.unpack(">I", head)
        if length > MAX_FRAME:
            raise ProtocolError(f"frame of {length} bytes exceeds the limit of {MAX_FRAME}")
        data = _read_exact(self.sock, length + _MAC)
        if data is None:
            raise ProtocolError("connection closed inside a frame")
        body, mac = data[:length], data[length:]
        if not hmac.compare_digest(mac, self._mac(self.rx_dir, self.rx_seq, body)):
            raise ProtocolError("message authentication failed (wrong secret, replay or corruption)")
        self.rx_seq += 1
        try:
            return validate(json.loads(body))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"malformed JSON: {exc}") from exc


SEND_TIMEOUT_S = 5  # a send to a peer that reads nothing (frozen, cut off) fails instead of blocking


def _bounded_sends(sock: socket.socket) -> None:
    """Sends fail after SEND_TIMEOUT_S instead of blocking for good; receives still wait (an
    idle standby may say nothing for hours). A frozen or cut-off peer stops reading: without
    this a full socket buffer would block the sender (the controller's loop, a rank's step)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_S, 0))
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # unacknowledged data: the connection is dead after this
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, SEND_TIMEOUT_S * 1000)


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None if not buf else bytes(buf)
        buf += chunk
    return bytes(buf)


class Connection:
    """One authenticated peer. `recv` runs in the owner's reader thread."""

    def __init__(self, framer: _Framer, peer: str):
        self.framer, self.peer = framer, peer
        self.closed = False
        self.identity: dict | None = None  # the peer's hello
        self.last_frame_at = time.time()   # when the reader last received a frame (liveness)

    def send(self, msg: dict) -> None:
        self.framer.send(msg)

    def close(self) -> None:
        self.closed = True
        try:
            self.framer.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.framer.sock.close()


class Server:
    """Accepts authenticated connections; delivers (connection, message) on `inbox`.
    A connection that fails authentication or validation is closed and logged; the rest
    of the job is not affected."""

    def __init__(self, host: str, key: bytes, port: int = 0, handshake_timeout: float = 10.0,
                 sock: socket.socket | None = None):
        """`sock`: a listening socket to accept on (the supervisor's, which outlives a
        controller, so that a restarted one is found at the same address)."""
        self.key, self.handshake_timeout = key, handshake_timeout
        self.sock = sock if sock is not None else socket.create_server((host, port))
        self.address = self.sock.getsockname()[:2]
        self.inbox: queue.Queue = queue.Queue()
        self.rejected = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name="tm-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, f"{peer[0]}:{peer[1]}"), daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        challenge = secrets.token_bytes(_CHALLENGE)
        conn = Connection(_Framer(sock, self.key, challenge, is_server=True), peer)
        try:
            sock.settimeout(self.handshake_timeout)
            sock.sendall(challenge)
            first = conn.framer.recv()
            if first is None:
                return conn.close()
            sock.settimeout(None)  # authenticated peers may stay idle (standbys wait for hours)
            conn.identity = first
            _bounded_sends(sock)
            self.inbox.put((conn, first))
            while True:
                msg = conn.framer.recv()
                if msg is None:
                    break
                conn.last_frame_at = time.time()
                self.inbox.put((conn, msg))
        except (ProtocolError, OSError, socket.timeout) as exc:
            self.rejected += 1
            log.warning("control: dropped connection from %s: %s", peer, exc)
        finally:
            if not conn.closed:
                conn.close()
            self.inbox.put((conn, None))  # None: this peer is gone

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


def connect(address: tuple[str, int], key: bytes, hello: dict, *, timeout: float = 10.0,
            source: str | None = None) -> Connection:
    """Connect and authenticate; `hello` is the first message. Retries until `timeout`."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()),
                                            source_address=(source, 0) if source else None)
            challenge = _read_exact(sock, _CHALLENGE)
            if challenge is None or len(challenge) != _CHALLENGE:
                raise ProtocolError("controller closed the connection during the handshake")
            sock.settimeout(None)
            _bounded_sends(sock)
            conn = Connection(_Framer(sock, key, challenge, is_server=False), f"{address[0]}:{address[1]}")
            conn.send(hello)
            return conn
        except OSError as exc:
            last = exc
            time.sleep(0.2)
    raise DeadlineExceeded(f"could not reach the controller at {address[0]}:{address[1]} within {timeout:.0f}s: {last}")


def request(address: tuple[str, int], key: bytes, msg: dict, *, timeout: float = 10.0) -> dict:
    """One request/reply exchange (used by the CLI)."""
    conn = connect(address, key, msg, timeout=timeout)
    try:
        conn.framer.sock.settimeout(timeout)
        reply = conn.framer.recv()
    except socket.timeout as exc:
        raise DeadlineExceeded(f"controller did not reply within {timeout:.0f}s") from exc
    finally:
        conn.close()
    if reply is None:
        raise ProtocolError("controller closed the connection without a reply")
    return reply
