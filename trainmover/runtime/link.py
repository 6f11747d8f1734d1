"""A rank's control channel that outlives its controller.

The controller may die and be restarted from its journal (controller.supervisor): at the
same address, with the same job secret. When the channel drops without the controller's
`bye`, the reader thread reconnects with backoff until `reconnect_timeout_s`, authenticates
as before, and re-sends what the new controller needs: `hello`, a `resync` (where this
process is) and the messages that may have been lost (`resync_messages`, from the agent).
Training never waits on this: while the channel is down `send` drops the message (the
agent keeps what a resync needs) and returns at once.

Messages to the agent go to `inbox`; None there means the controller is gone for good
(it said `bye`, or no successor answered in time).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from trainmover.errors import DeadlineExceeded, TrainMoverError
from trainmover.protocol import channel

log = logging.getLogger("trainmover.link")

# Short: a successor serves within a second of a hand-over (controller/succession/keeper.py), and a pause
# also ends as soon as `news()` changes (controller.json rewritten by a successor).
BACKOFF_S = (0.05, 0.1, 0.2, 0.5)


class Link:
    def __init__(self, address: tuple[str, int], key: bytes, hello: Callable[[], dict],
                 resync_messages: Callable[[], list[dict]], on_message: Callable[[dict], None],
                 *, connect_timeout: float, reconnect_timeout: float, on_gone: Callable[[], None] = lambda: None,
                 source: str | None = None, where: Callable[[], tuple[str, int]] | None = None,
                 news: Callable[[], object] = lambda: None):
        """`where()`: the controller's address now, asked before each reconnection attempt
        (a successor may run on another node: protocol/endpoint.py). `news()`: a cheap token
        that changes when `where()` may have (the endpoint file's mtime): a backoff pause ends
        early then."""
        self.address, self.key, self.source = address, key, source
        self.where, self.news = where or (lambda: self.address), news
        self.hello, self.resync_messages, self.on_message = hello, resync_messages, on_message
        self.reconnect_timeout, self.on_gone = reconnect_timeout, on_gone
        self.inbox: queue.Queue = queue.Queue()
        self.lock = threading.Lock()     # one writer at a time; a resync is not interleaved
        self.closed = False
        self.dial_error: Exception | None = None  # the last failed connection attempt's (see _dial)
        self.conn = self._connect_first(address, connect_timeout)
        self.up = True
        self.bye: str | None = None      # the controller's reason, once it said `bye` (the job ends)
        self.settled = threading.Event()  # set while up, and once gone for good
        self.settled.set()
        self.reconnects: list[float] = []  # seconds each reconnection took
        threading.Thread(target=self._read, name="tm-inbox", daemon=True).start()

    def _connect_first(self, address: tuple[str, int], timeout: float) -> channel.Connection:
        """The first connection, within `timeout`, dialled as a reconnection is (`_dial`): a
        controller may move between this process's launch and its start, and the address it
        was given is then gone: one long attempt there waited its whole 60 s and the standby was
        counted lost (three times in one job, which then took no more standbys)."""
        conn = self._dial(time.monotonic() + timeout, "connect", first=address)
        if conn is None:
            raise DeadlineExceeded(f"could not reach the controller within {timeout:.0f}s "
                                   f"(last at {self.address[0]}:{self.address[1]}): {self.dial_error}")
        return conn

    def _dial(self, deadline: float, what: str, first: tuple[str, int] | None = None) -> channel.Connection | None:
        """Short connection attempts until `deadline` (None once it passed, or the link closed):
        the first to `first` when given, every other to `where()` asked anew, a successor
        elsewhere being looked for again soon; between them a backoff that a rewritten
        controller.json (`news()` changed) cuts short. The last failure: `dial_error`."""
        attempt = 0
        while not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            seen = self.news()
            self.address = first if first is not None and attempt == 0 else self.where()
            try:
                return channel.connect(self.address, self.key, self.hello(), timeout=min(left, 2.0),
                                       source=self.source)
            except TrainMoverError as exc:
                self.dial_error = exc
                log.info("%s attempt %d: %s", what, attempt + 1, exc)
            until = min(time.monotonic() + BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)], deadline)
            while time.monotonic() < until and self.news() == seen:
                time.sleep(0.02)
            attempt += 1
        return None

    def send(self, msg: dict) -> bool:
        """Send now, or drop if the controller is unreachable (returns whether it was sent)."""
        with self.lock:
            if not self.up:
                return False
            try:
                self.conn.send(msg)
                return True
            except OSError as exc:
                log.warning("cannot reach the controller (%s); %s not sent", exc, msg["type"])
                self.up = False
                return False

    def _read(self) -> None:
        while True:
            bye = self._read_until_closed()
            with self.lock:
                self.up = False
                self.settled.clear()
            if bye or self.closed:
                break
            if not self._reconnect():
                break
        self.settled.set()
        if not self.closed:
            self.on_gone()
        self.inbox.put(None)

    def _read_until_closed(self) -> bool:
        """Deliver messages until the channel closes; True if the controller said `bye`."""
        try:
            while True:
                msg = self.conn.framer.recv()
                if msg is None:
                    return False
                if msg["type"] == "bye":
                    log.info("controller ends: %s", msg["reason"])
                    self.bye = msg["reason"]
                    return True
                self.on_message(msg)
                self.inbox.put(msg)
        except (OSError, TrainMoverError) as exc:
            if not self.closed:
                log.error("control channel lost: %s", exc)
            return False

    def _reconnect(self) -> bool:
        t0 = time.monotonic()
        deadline = t0 + self.reconnect_timeout
        log.warning("controller lost: trying to reach its successor (last at %s:%d) for %.0fs", *self.address,
                    self.reconnect_timeout)
        while not self.closed:
            conn = self._dial(deadline, "reconnect")
            if conn is None:
                if not self.closed:
                    log.error("no controller at %s:%d within %.0fs: going on without one", *self.address,
                              self.reconnect_timeout)
                return False
            with self.lock:  # nothing else is sent between the hello and the last re-sent message
                try:
                    for msg in self.resync_messages():
                        conn.send(msg)
                except OSError as exc:
                    log.warning("controller dropped the channel during the resync: %s", exc)
                    conn.close()
                    continue
                self.conn, self.up = conn, True
                self.settled.set()
            self.reconnects.append(time.monotonic() - t0)
            log.info("reconnected to the controller after %.3fs", self.reconnects[-1])
            return True
        return False

    def flush(self) -> None:
        """Before this process exits: if the controller is being replaced, wait (at most the
        reconnect deadline) for its successor, so that the resync delivers this process's last
        reports (a leaver's last steps, a rank's `finished`)."""
        if not self.settled.is_set():
            log.info("waiting for the controller to come back before exiting")
            self.settled.wait(self.reconnect_timeout + 1)

    def close(self) -> None:
        self.closed = True
        with self.lock:
            self.up = False
        self.conn.close()
