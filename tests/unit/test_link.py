"""A rank's control link across a controller's death: real sockets on loopback, no processes.
The listening socket outlives the 'controller' (as the supervisor's does)."""
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from trainmover.protocol import channel
from trainmover.protocol.messages import make
from trainmover.runtime.link import Link


def get(server, timeout=5.0):
    return server.inbox.get(timeout=timeout)


def accept_one(listen, key):
    """A controller that serves one connection and then dies (it accepts nothing more)."""
    sock, _ = listen.accept()
    challenge = b"c" * channel._CHALLENGE
    sock.sendall(challenge)
    nonce = channel._read_exact(sock, channel._CHALLENGE)  # the client's own
    conn = channel.Connection(channel._Framer(sock, key, challenge + nonce, is_server=True), "peer")
    return conn, conn.framer.recv()


def test_the_link_reconnects_and_resyncs_and_a_bye_ends_it():
    key = channel.new_secret()
    listen = socket.create_server(("127.0.0.1", 0), backlog=16)
    hello = lambda: make("hello", role="worker", node="n1", ranks=[3], pid=1)  # noqa: E731
    resync = lambda: [make("resync", node="n1", ranks=[3], role="worker", step=9, pending=0, switched=2,  # noqa: E731
                           state="training")]
    gone = []
    accepted = ThreadPoolExecutor(1).submit(accept_one, listen, key)
    link = Link(listen.getsockname(), key, hello, resync, lambda m: None, connect_timeout=5, reconnect_timeout=10,
                on_gone=lambda: gone.append(1))
    conn, msg = accepted.result(timeout=5)
    assert msg["type"] == "hello"
    # the controller dies: its connection drops without a bye; sends meanwhile are dropped, not blocking
    conn.close()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert link.send(make("finished", rank=3, step=9, digest="d", loss=1.0)) is False
    assert time.monotonic() - t0 < 0.1
    # its successor accepts on the same socket: hello, then the resync, in this order
    second = channel.Server("127.0.0.1", key, sock=listen)
    kinds = []
    while len(kinds) < 2:
        c, m = get(second)
        if m is not None:
            kinds.append(m["type"])
    deadline = time.monotonic() + 5  # the link notes the reconnection after it has sent both
    while not link.reconnects and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kinds == ["hello", "resync"] and link.reconnects and link.inbox.empty()
    assert link.send(make("step", rank=3, step=10, loss=1.0, step_s=0.1, compute_s=0.1, t=1.0))
    assert get(second)[1]["type"] == "step"
    c.send(make("bye", reason="training finished"))
    assert link.inbox.get(timeout=5) is None and gone == [1]  # gone for good: no reconnection
    link.close()


def test_no_successor_within_the_deadline_means_gone():
    key = channel.new_secret()
    listen = socket.create_server(("127.0.0.1", 0), backlog=16)
    accepted = ThreadPoolExecutor(1).submit(accept_one, listen, key)
    link = Link(listen.getsockname(), key, lambda: make("hello", role="standby", node="s", ranks=[], pid=1),
                lambda: [], lambda m: None, connect_timeout=5, reconnect_timeout=1.0)
    conn, _ = accepted.result(timeout=5)
    listen.close()
    conn.close()
    t0 = time.monotonic()
    assert link.inbox.get(timeout=10) is None
    assert time.monotonic() - t0 < 5
    link.close()


def test_the_first_connection_follows_a_controller_that_moved_before_this_process_started():
    """Launched with the address of a controller that has moved on (nothing listens there), the
    link asks `where()` again between short attempts and connects to the successor well within
    its deadline, rather than waiting the whole of it on the dead address."""
    key = channel.new_secret()
    dead = socket.create_server(("127.0.0.1", 0))
    gone_addr = dead.getsockname()
    dead.close()  # the old controller: nothing listens there any more
    listen = socket.create_server(("127.0.0.1", 0), backlog=16)
    asked = []

    def where():
        asked.append(1)
        return listen.getsockname()  # controller.json names the successor

    accepted = ThreadPoolExecutor(1).submit(accept_one, listen, key)
    t0 = time.monotonic()
    link = Link(gone_addr, key, lambda: make("hello", role="standby", node="s", ranks=[], pid=1), lambda: [],
                lambda m: None, connect_timeout=30, reconnect_timeout=1.0, where=where)
    conn, msg = accepted.result(timeout=5)
    assert msg["type"] == "hello" and asked and time.monotonic() - t0 < 5
    assert link.address == listen.getsockname()
    conn.close()
    link.close()


def test_the_first_connection_gives_up_at_its_deadline():
    key = channel.new_secret()
    dead = socket.create_server(("127.0.0.1", 0))
    addr = dead.getsockname()
    dead.close()
    t0 = time.monotonic()
    try:
        Link(addr, key, lambda: make("hello", role="standby", node="s", ranks=[], pid=1), lambda: [], lambda m: None,
             connect_timeout=1.5, reconnect_timeout=1.0)
    except Exception as exc:  # noqa: BLE001 - the type and message are what is checked
        assert type(exc).__name__ == "DeadlineExceeded" and "could not reach the controller within" in str(exc), exc
    else:
        raise AssertionError("connected to nothing")
    assert 1.4 < time.monotonic() - t0 < 4


def test_the_first_store_follows_controller_json_when_the_launch_named_a_gone_one():
    """A process launched with the store of a controller that moved: short attempts, controller.json
    read before each, the successor's store and controller taken; at the deadline the error."""
    from types import SimpleNamespace
    from trainmover.runtime.worker import first_store
    tried = []

    def connect(host, port):
        tried.append((host, port))
        if (host, port) != ("10.0.0.2", 2):
            raise RuntimeError("connection refused")
        return "client"

    written = iter([None, None, SimpleNamespace(store=("10.0.0.2", 2), address=("10.0.0.2", 9))])
    got = first_store(("10.0.0.1", 1), ("10.0.0.1", 8), 30, connect, lambda: next(written, None))
    assert got == ("client", ("10.0.0.2", 2), ("10.0.0.2", 9)) and tried[0] == ("10.0.0.1", 1) and len(tried) == 3
    t0 = time.monotonic()
    try:
        first_store(("10.0.0.1", 1), ("10.0.0.1", 8), 0.5, connect, lambda: None)
    except RuntimeError:
        assert 0.4 < time.monotonic() - t0 < 3
    else:
        raise AssertionError("connected to nothing")
