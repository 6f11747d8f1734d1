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

import hmac
import json
import os
import queue
import secrets
import selectors
import socket
import struct
import sys
import threading
import time
import traceback
import logging
from collections import deque
from collections.abc import Callable

from trainmover.protocol import files
from trainmover.protocol.handshake_log import HandshakeFailures
from trainmover.protocol.messages import Message, validate
from trainmover.errors import DeadlineExceeded, ProtocolError

log = logging.getLogger(__name__)

MAX_FRAME = 1 << 20
HELLO_MAX = 16 << 10  # the first frame, before the peer is known: a hello, a CLI request
MAX_PENDING = 64      # connections in the handshake at once (see Server)
FLUSH_EVERY = 256     # the selector hands its reader what it read at least this often within a turn
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
        return hmac.digest(self.key, self.session + direction + struct.pack(">Q", seq) + body, "sha256")

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
        return self.open(data[:length], data[length:])

    def open(self, body: bytes, mac: bytes) -> Message:
        """A received frame's body, checked (its MAC, in sequence) and validated; the server's
        selector thread calls this with what it buffered, `recv` with what it read."""
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
    """One authenticated peer. A client's `recv` runs in its owner's reader thread; a server's
    connections are read by the server's selector thread (Server)."""

    def __init__(self, framer: _Framer, peer: str):
        self.framer, self.peer = framer, peer
        self.closed = False
        self.identity: Message | None = None  # the peer's hello
        self.last_frame_at = time.time()   # when the reader last received a frame (liveness)
        self.served_by: Server | None = None  # set on the server's side: its thread closes the socket

    def send(self, msg: Message) -> None:
        self.framer.send(msg)

    def close(self) -> None:
        """Close the connection. A server's connection is shut down here and closed by the
        server's thread, which sees it end (so that its descriptor is never reused while the
        selector still watches it)."""
        self.closed = True
        try:
            self.framer.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.served_by is None:
            self.framer.sock.close()
        else:
            self.served_by.wake()


_NONCE, _HELLO, _OPEN = "nonce", "hello", "open"  # a served connection's stages (Server)
_READ_CHUNK = 1 << 16


class _Peer:
    """What the selector thread holds for one connection: its stage, what arrived of the next
    frame, and (from its nonce on) its Connection."""

    __slots__ = ("sock", "peer", "challenge", "stage", "deadline", "buf", "conn")

    def __init__(self, sock: socket.socket, peer: str, challenge: bytes, deadline: float):
        self.sock, self.peer, self.challenge, self.deadline = sock, peer, challenge, deadline
        self.stage = _NONCE
        self.buf = bytearray()
        self.conn: Connection | None = None


Delivery = tuple["Connection", "Message | None"]  # a message from a peer; None: the peer is gone


class Inbox:
    """What a Server delivers, in order, to one reader (the controller's loop): queue.Queue's
    `get`, `get_nowait`, `empty` and `qsize`, filled a selector turn's worth at a time, so that
    the reader is woken once per turn, not once per message."""

    def __init__(self) -> None:
        self._items: deque[Delivery] = deque()
        self._ready = threading.Condition(threading.Lock())

    def put(self, item: Delivery) -> None:
        self.put_many([item])

    def put_many(self, items: list[Delivery]) -> None:
        with self._ready:
            self._items.extend(items)
            self._ready.notify_all()

    def get_nowait(self) -> Delivery:
        try:
            return self._items.popleft()
        except IndexError:
            raise queue.Empty from None

    def get(self, block: bool = True, timeout: float | None = None) -> Delivery:
        """The next delivery; queue.Empty when `timeout` (seconds) passes first."""
        try:
            return self._items.popleft()
        except IndexError:
            if not block:
                raise queue.Empty from None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._ready:
            while not self._items:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise queue.Empty
                self._ready.wait(left)
            return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


class Server:
    """Accepts authenticated connections; delivers (connection, message) on `inbox`.
    A connection that fails authentication or validation is closed and logged; the rest
    of the job is not affected.

    Two threads serve every connection, however many: `tm-accept` accepts and sends each
    peer its challenge; `tm-channel` waits on all connections at once (a selector) and reads
    what arrived, frame by frame, without ever blocking on one peer. (A thread per connection
    was 1,036 threads at 1,024 ranks, all contending for the interpreter's lock: docs/scale.md.)

    Before a peer has authenticated it gets little (docs/security.md): the whole handshake
    (nonce and first frame) must arrive within `handshake_timeout`, the first frame is at most
    HELLO_MAX bytes, and at most MAX_PENDING connections wait in the handshake at once (a new one
    pushes the oldest out, so that a flood of idle connections delays a real peer, which
    retries, but never locks it out). The accept loop survives any error; so does the selector's."""

    def __init__(self, host: str, key: bytes, port: int = 0, handshake_timeout: float = 10.0,
                 sock: socket.socket | None = None, max_pending: int | None = None,
                 on_hello: Callable[[Connection, Message], None] | None = None):
        """`sock`: a listening socket to accept on (the supervisor's, which outlives a
        controller, so that a restarted one is found at the same address). `on_hello(conn,
        hello)`: called on the server's thread once a peer has authenticated, before its
        hello is queued (for what must not wait for the owner's loop to turn); it must not block."""
        self.on_hello = on_hello
        self.key, self.handshake_timeout = key, handshake_timeout
        self.max_pending = max_pending or MAX_PENDING
        self.sock = sock if sock is not None else socket.create_server((host, port), backlog=1024)
        self.address = self.sock.getsockname()[:2]
        self.inbox = Inbox()
        self._out: list[Delivery] = []  # this selector turn's deliveries (put at its end)
        self.rejected = 0
        self.evicted = 0
        self.handshake_failures = HandshakeFailures()  # failed MACs before a hello: which get a line
        self._pending: dict[socket.socket, float] = {}  # in the handshake, oldest first
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.turned_at = time.monotonic()  # the selector's last turn (it turns at least every second)
        # The wall time at which the last *finished* turn looked at every connection: a frame
        # sent before it has been read (a peer silent up to then is silent; after it, unknown).
        self.looked_at = time.time()
        self._arrived: queue.Queue[_Peer] = queue.Queue()  # accepted, challenged: for the selector
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._selector_thread = threading.Thread(target=self._select, name="tm-channel", daemon=True)
        self._selector_thread.start()
        threading.Thread(target=self._accept, name="tm-accept", daemon=True).start()

    # --- the accept thread ------------------------------------------------------------------
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
                challenge = secrets.token_bytes(_CHALLENGE)
                sock.settimeout(self.handshake_timeout)
                sock.sendall(challenge)  # 16 bytes into a new connection's empty buffer
                sock.settimeout(None)    # blocking: the selector reads with MSG_DONTWAIT; sends get SO_SNDTIMEO
                self._arrived.put(_Peer(sock, f"{peer[0]}:{peer[1]}", challenge,
                                        time.monotonic() + self.handshake_timeout))
                self.wake()
            except Exception as exc:  # noqa: BLE001 - a socket gone, a peer reset: drop this one, go on
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
                    oldest.shutdown(socket.SHUT_RDWR)  # the selector sees its end and drops it
                except OSError:
                    pass
            self._pending[sock] = time.monotonic()

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._pending.pop(sock, None)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def wake(self) -> None:
        """Make the selector thread turn (a connection arrived, or was closed by its owner)."""
        try:
            self._wake_w.send(b"w")
        except OSError:
            pass  # its buffer is full: a turn is due anyway; closed: the server stopped

    def selector_stack(self) -> str:
        """Where the selector thread is now (a diagnosis of a turn that does not end)."""
        frame = sys._current_frames().get(self._selector_thread.ident or -1)
        return "".join(traceback.format_stack(frame)) if frame is not None else "(not running)"

    # --- the selector thread ----------------------------------------------------------------
    def _select(self) -> None:
        handshaking: dict[int, _Peer] = {}  # id -> a peer not yet authenticated (its deadline runs)
        while not self._stop.is_set():
            try:
                self._turn(handshaking)
            except Exception as exc:  # noqa: BLE001 - a bug here must not end every connection's service
                log.exception("control: the channel's selector failed a turn: %s", exc)
                time.sleep(0.05)
            finally:
                self._flush()

    def _flush(self) -> None:
        if self._out:
            out, self._out = self._out, []
            self.inbox.put_many(out)

    def _turn(self, handshaking: dict[int, _Peer]) -> None:
        """One wait on every connection and what it brought. A connection its owner closed
        (Connection.close shuts it down) reads as ended here."""
        now = time.monotonic()
        self.turned_at = now
        timeout = min([1.0] + [max(0.0, p.deadline - now) for p in handshaking.values()])
        looked = time.time()
        events = self._selector.select(timeout)
        for key, _ in events:
            if key.data is None:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except OSError:
                    pass
                continue
            p = key.data
            try:
                self._read(p)
                if p.stage == _OPEN:
                    handshaking.pop(id(p), None)
            except Exception as exc:  # noqa: BLE001 - whatever a peer sends, only its connection ends
                self._drop(handshaking, p, exc)
            if len(self._out) >= FLUSH_EVERY:  # a long turn hands the reader its messages as it goes
                self._flush()
        while True:
            try:
                p = self._arrived.get_nowait()
            except queue.Empty:
                break
            try:
                self._selector.register(p.sock, selectors.EVENT_READ, p)
                handshaking[id(p)] = p
            except (OSError, ValueError) as exc:  # closed meanwhile
                self._forget(p.sock)
                p.sock.close()
                log.debug("control: dropped connection from %s: %s", p.peer, exc)
        now = time.monotonic()
        for p in [p for p in handshaking.values() if now > p.deadline]:
            self._drop(handshaking, p, socket.timeout("handshake deadline passed"))
        self.looked_at = looked

    def _read(self, p: _Peer) -> None:
        """What arrived on `p`: its nonce, its hello, then frames, each delivered as it completes.
        Raises ProtocolError (and its AuthenticationFailed), OSError or _Ended."""
        try:
            data = p.sock.recv(_READ_CHUNK, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            raise _Ended(p)
        # when this peer's bytes were read, not when the turn began: a turn over 1,024 busy
        # connections on a loaded host can take seconds, and a stamp from its start made peers
        # look silent for that long to the liveness rules (seen at 128 nodes: judged silent 3.2 s)
        arrived = time.time()
        p.buf += data
        while True:
            if p.stage == _NONCE:
                if len(p.buf) < _CHALLENGE:
                    return
                nonce = bytes(p.buf[:_CHALLENGE])
                del p.buf[:_CHALLENGE]
                p.conn = Connection(_Framer(p.sock, self.key, p.challenge + nonce, is_server=True), p.peer)
                p.stage = _HELLO
                continue
            if len(p.buf) < 4:
                return
            (length,) = struct.unpack_from(">I", p.buf)
            limit = HELLO_MAX if p.stage == _HELLO else MAX_FRAME
            if length > limit:
                raise ProtocolError(f"frame of {length} bytes exceeds the limit of {limit}")
            end = 4 + length + _MAC
            if len(p.buf) < end:
                return
            body, mac = bytes(p.buf[4:4 + length]), bytes(p.buf[4 + length:end])
            del p.buf[:end]
            conn = p.conn
            assert conn is not None
            msg = conn.framer.open(body, mac)
            conn.last_frame_at = arrived
            if p.stage == _HELLO:
                self._forget(p.sock)
                p.stage = _OPEN
                conn.identity = msg
                conn.served_by = self
                _bounded_sends(p.sock)
                if self.on_hello is not None:
                    self.on_hello(conn, msg)
            self._out.append((conn, msg))

    def _drop(self, handshaking: dict[int, _Peer], p: _Peer, exc: BaseException | None) -> None:
        """End `p`'s connection: `exc` why (None: its owner closed it; _Ended: the peer did)."""
        conn = p.conn
        known = conn is not None and conn.identity is not None
        if isinstance(exc, _Ended):  # between frames (or before the nonce): a clean end, as before
            exc = None if not p.buf or (conn is not None and conn.closed) else ProtocolError(
                f"connection closed after {len(p.buf)} bytes of "
                + ("its nonce" if p.stage == _NONCE else "a frame"))
        if exc is not None:
            self._rejected(p, conn, known, exc)
        handshaking.pop(id(p), None)
        try:
            self._selector.unregister(p.sock)
        except (KeyError, ValueError, OSError):
            pass
        self._forget(p.sock)
        if conn is not None:
            conn.closed = True
        try:
            p.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        p.sock.close()
        if known and conn is not None:
            self._out.append((conn, None))  # None: this peer is gone

    def _rejected(self, p: _Peer, conn: Connection | None, known: bool, exc: BaseException) -> None:
        self.rejected += 1
        if not isinstance(exc, (ProtocolError, OSError, socket.timeout)):
            log.warning("control: dropped connection from %s: %s: %s", p.peer, type(exc).__name__, exc)
            return
        # a peer that never got through the handshake (a scan, a flood) is noise: counted,
        # summed up every 100; a failed MAC before the hello gets a line for the first from
        # each address, then a summary at most once a minute (handshake_log.py); a known
        # peer's loss is worth a line each
        if isinstance(exc, AuthenticationFailed) and not known:
            with self._lock:
                line = self.handshake_failures.failed(p.peer, str(exc), time.monotonic())
            if line:
                log.warning("%s", line)
            return
        log.log(logging.WARNING if known else logging.DEBUG, "control: dropped connection from %s: %s", p.peer, exc)
        if not known and self.rejected % 100 == 0:
            log.warning("control: %d connections dropped before authenticating so far (%d pushed out while "
                        "waiting)", self.rejected, self.evicted)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self.wake()
        with self._lock:
            line = self.handshake_failures.summary(time.monotonic(), force=True)
        if line:
            log.warning("%s", line)


class _Ended(Exception):
    """The peer closed its end (EOF)."""

    def __init__(self, p: _Peer):
        super().__init__(p.peer)


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
