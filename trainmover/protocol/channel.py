"""An authenticated message channel over TCP.

Frame: 4-byte big-endian length | JSON body | 32-byte HMAC-SHA256.
The MAC key is the job's secret; the MAC covers a per-connection random challenge sent by
the server, a random nonce sent by the client, the direction and a sequence number, so a
process without the secret can neither talk nor replay a captured frame to either side.
Frames over `MAX_FRAME` bytes (`HELLO_MAX` before authentication) are refused before they
are read. Every blocking call has a deadline; the server bounds what an unauthenticated
peer can hold (see Server).
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
from collections.abc import Callable

from trainmover.protocol import files
from trainmover.protocol.handshake_log import HandshakeFailures
from trainmover.protocol.messages import Message, validate
from trainmover.errors import DeadlineExceeded, ProtocolError

log = logging.getLogger(__name__)

MAX_FRAME = 1 << 20
HELLO_MAX = 16 << 10  # the first frame, before the peer is known: a hello, a CLI request
MAX_PENDING = 64      # connections in the handshake at once (see Server)
_MAC = 32
_CHALLENGE = 16


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def write_secret(path: str) -> bytes:
    """Create the job's secret, readable by the job's user only (it lives on the shared
    job directory so that the CLI on a login node can use it). Never through a link."""
    secret = new_secret()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret.hex().encode())
    return secret


def read_secret(path: str) -> bytes:
    """The job's secret, once per process (callers keep it): a regular file of this user's,
    readable by nobody else; anything else is refused, never used. Root (an admin's
    `trainmover migrate`) takes it only as the run directory's owner's, in a directory nobody
    else can write."""
    try:
        owner = os.geteuid()
        if owner == 0:
            st = os.stat(os.path.dirname(os.path.abspath(path)))
            if st.st_mode & 0o022:
                raise OSError("its directory is writable by group or others")
            owner = st.st_uid
        data = files.read_limited(path, 256, owner=owner)
        if os.stat(path, follow_symlinks=False).st_mode & 0o077:
            raise OSError("readable or writable by group or others")
        key = bytes.fromhex(data.decode().strip())
        if len(key) < 16:
            raise ValueError("too short")
        return key
    except (OSError, ValueError) as exc:
        raise ProtocolError(f"cannot use the job secret at {path}: {exc}") from exc


class AuthenticationFailed(ProtocolError):
    """A frame whose MAC does not match: a peer without the job's secret, a replay, corruption."""


class _Framer:
    def __init__(self, sock: socket.socket, key: bytes, session: bytes, is_server: bool):
        """`session`: the server's challenge and the client's nonce; every MAC covers both, so a
        frame of one connection means nothing on another, whichever side started it."""
        self.sock, self.key, self.session = sock, key, session
        self.tx_dir, self.rx_dir = (b"S", b"C") if is_server else (b"C", b"S")
        self.tx_seq = self.rx_seq = 0
        self.lock = threading.Lock()

    def _mac(self, direction: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(self.key, self.session + direction + struct.pack(">Q", seq) + body, hashlib.sha256).digest()

    def send(self, msg: Message) -> None:
        body = json.dumps(validate(msg), separators=(",", ":")).encode()
        if len(body) > MAX_FRAME:
            raise ProtocolError(f"message too large ({len(body)} bytes)")
        with self.lock:
            mac = self._mac(self.tx_dir, self.tx_seq, body)
            self.tx_seq += 1
            self.sock.sendall(struct.pack(">I", len(body)) + body + mac)

    def recv(self, limit: int = MAX_FRAME, deadline: float | None = None) -> Message | None:
        """The next frame; None at a clean end (EOF between frames). `limit`: the largest body
        accepted (a peer not yet authenticated gets HELLO_MAX); `deadline` (monotonic): the
        whole frame must arrive by then. A frame cut short is a ProtocolError."""
        head = _read_exact(self.sock, 4, deadline)
        if head is None:
            return None
        (length,) = struct.unpack(">I", head)
        if length > limit:
            raise ProtocolError(f"frame of {length} bytes exceeds the limit of {limit}")
        data = _read_exact(self.sock, length + _MAC, deadline)
        if data is None:
            raise ProtocolError("connection closed inside a frame")
        body, mac = data[:length], data[length:]
        if not hmac.compare_digest(mac, self._mac(self.rx_dir, self.rx_seq, body)):
            raise AuthenticationFailed("message authentication failed (wrong secret, replay or corruption)")
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


def _read_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """`n` bytes; None on EOF before the first byte; ProtocolError on EOF inside them (a short
    read is the peer's protocol error, never a crash of the reader); socket.timeout when
    `deadline` passes first."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline passed")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if not buf:
                return None
            raise ProtocolError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


class Connection:
    """One authenticated peer. `recv` runs in the owner's reader thread."""

    def __init__(self, framer: _Framer, peer: str):
        self.framer, self.peer = framer, peer
        self.closed = False
        self.identity: Message | None = None  # the peer's hello
        self.last_frame_at = time.time()   # when the reader last received a frame (liveness)

    def send(self, msg: Message) -> None:
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
    of the job is not affected.

    Before a peer has authenticated it gets little (docs/security.md): the whole handshake
    (nonce and first frame) must arrive within `handshake_timeout`, the first frame is at most
    HELLO_MAX bytes, and at most MAX_PENDING connections wait in the handshake at once (a new one
    pushes the oldest out, so that a flood of idle connections delays a real peer, which
    retries, but never locks it out). The accept loop survives any error."""

    def __init__(self, host: str, key: bytes, port: int = 0, handshake_timeout: float = 10.0,
                 sock: socket.socket | None = None, max_pending: int | None = None,
                 on_hello: Callable[[Connection, Message], None] | None = None):
        """`sock`: a listening socket to accept on (the supervisor's, which outlives a
        controller, so that a restarted one is found at the same address). `on_hello(conn,
        hello)`: called on the connection's thread once a peer has authenticated, before its
        hello is queued (for what must not wait for the owner's loop to turn)."""
        self.on_hello = on_hello
        self.key, self.handshake_timeout = key, handshake_timeout
        self.max_pending = max_pending or MAX_PENDING
        self.sock = sock if sock is not None else socket.create_server((host, port), backlog=1024)
        self.address = self.sock.getsockname()[:2]
        self.inbox: queue.Queue[tuple[Connection, Message | None]] = queue.Queue()
        self.rejected = 0
        self.evicted = 0
        self.handshake_failures = HandshakeFailures()  # failed MACs before a hello: which get a line
        self._pending: dict[socket.socket, float] = {}  # in the handshake, oldest first
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name="tm-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, peer = self.sock.accept()
            except OSError as exc:
                if self._stop.is_set() or self.sock.fileno() < 0:
                    return
                log.warning("control: accept failed: %s", exc)  # out of descriptors: not for good
                time.sleep(0.05)
                continue
            try:
                self._admit(sock)
                threading.Thread(target=self._serve, args=(sock, f"{peer[0]}:{peer[1]}"), daemon=True).start()
            except Exception as exc:  # noqa: BLE001 - no thread left, a socket gone: drop this one, go on
                log.warning("control: cannot serve %s:%s: %s", peer[0], peer[1], exc)
                self._forget(sock)
                sock.close()

    def _admit(self, sock: socket.socket) -> None:
        with self._lock:
            while len(self._pending) >= self.max_pending:
                oldest = next(iter(self._pending))
                del self._pending[oldest]
                self.evicted += 1
                try:
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread sees the end and exits
                except OSError:
                    pass
            self._pending[sock] = time.monotonic()

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._pending.pop(sock, None)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _serve(self, sock: socket.socket, peer: str) -> None:
        challenge = secrets.token_bytes(_CHALLENGE)
        conn = None
        try:
            deadline = time.monotonic() + self.handshake_timeout
            sock.settimeout(self.handshake_timeout)
            sock.sendall(challenge)
            nonce = _read_exact(sock, _CHALLENGE, deadline)
            if nonce is None:
                return
            conn = Connection(_Framer(sock, self.key, challenge + nonce, is_server=True), peer)
            first = conn.framer.recv(limit=HELLO_MAX, deadline=deadline)
            if first is None:
                return
            self._forget(sock)
            sock.settimeout(None)  # authenticated peers may stay idle (standbys wait for hours)
            conn.identity = first
            _bounded_sends(sock)
            if self.on_hello is not None:
                self.on_hello(conn, first)
            self.inbox.put((conn, first))
            while True:
                msg = conn.framer.recv()
                if msg is None:
                    break
                conn.last_frame_at = time.time()
                self.inbox.put((conn, msg))
        except (ProtocolError, OSError, socket.timeout) as exc:
            self.rejected += 1
            # a peer that never got through the handshake (a scan, a flood) is noise: counted,
            # summed up every 100; a failed MAC before the hello gets a line for the first from
            # each address, then a summary at most once a minute (handshake_log.py); a known
            # peer's loss is worth a line each
            known = conn is not None and conn.identity is not None
            if isinstance(exc, AuthenticationFailed) and not known:
                with self._lock:
                    line = self.handshake_failures.failed(peer, str(exc), time.monotonic())
                if line:
                    log.warning("%s", line)
                return
            log.log(logging.WARNING if known else logging.DEBUG, "control: dropped connection from %s: %s", peer, exc)
            if not known and self.rejected % 100 == 0:
                log.warning("control: %d connections dropped before authenticating so far (%d pushed out while "
                            "waiting)", self.rejected, self.evicted)
        except Exception as exc:  # noqa: BLE001 - whatever a peer sends, this thread ends cleanly
            self.rejected += 1
            log.warning("control: dropped connection from %s: %s: %s", peer, type(exc).__name__, exc)
        finally:
            self._forget(sock)
            if conn is None:
                sock.close()
            else:
                if not conn.closed:
                    conn.close()
                if conn.identity is not None:
                    self.inbox.put((conn, None))  # None: this peer is gone

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        with self._lock:
            line = self.handshake_failures.summary(time.monotonic(), force=True)
        if line:
            log.warning("%s", line)


def connect(address: tuple[str, int], key: bytes, hello: Message, *, timeout: float = 10.0,
            source: str | None = None) -> Connection:
    """Connect and authenticate; `hello` is the first message. Retries until `timeout` (a
    connection the server dropped in the handshake, as under a flood, is tried again)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        sock = None
        try:
            sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()),
                                            source_address=(source, 0) if source else None)
            challenge = _read_exact(sock, _CHALLENGE, deadline)
            if challenge is None:
                raise ProtocolError("controller closed the connection during the handshake")
            nonce = secrets.token_bytes(_CHALLENGE)
            sock.settimeout(None)
            _bounded_sends(sock)
            sock.sendall(nonce)
            conn = Connection(_Framer(sock, key, challenge + nonce, is_server=False), f"{address[0]}:{address[1]}")
            conn.send(hello)
            return conn
        except (OSError, ProtocolError) as exc:
            last = exc
            if sock is not None:
                sock.close()
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    raise DeadlineExceeded(f"could not reach the controller at {address[0]}:{address[1]} within {timeout:.0f}s: {last}")


def request(address: tuple[str, int], key: bytes, msg: Message, *, timeout: float = 10.0) -> Message:
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
