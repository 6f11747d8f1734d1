import json
import socket
import struct
import time

import pytest

from trainmover.protocol import channel
from trainmover.protocol.messages import make, validate
from trainmover.errors import DeadlineExceeded, ProtocolError


@pytest.mark.parametrize("msg, message", [
    ([], "JSON object"), ({"type": "reboot"}, "unknown message type"),
    ({"type": "migrate"}, "missing field 'node'"), ({"type": "migrate", "node": 3}, "expected str"),
    ({"type": "migrate", "node": "a", "x": 1}, "unexpected fields"),
    ({"type": "step", "rank": -1, "step": 1, "loss": 1.0, "step_s": 0.1, "compute_s": 0.1, "t": 0.0}, "must be >= 0"),
    ({"type": "step", "rank": True, "step": 1, "loss": 1.0, "step_s": 0.1, "compute_s": 0.1, "t": 0.0}, "got bool"),
    ({"type": "prepare", "epoch": 1, "leavers": ["a"], "joiner_node": "s", "assign": {}, "options": {}}, "leavers"),
])
def test_validation_rejects_malformed_messages(msg, message):
    with pytest.raises(ProtocolError, match=message):
        validate(msg)


@pytest.fixture
def server():
    key = channel.new_secret()
    srv = channel.Server("127.0.0.1", key, handshake_timeout=2.0)
    yield srv, key
    srv.close()


def hello():
    return make("hello", role="worker", node="train1", ranks=[0], pid=1)


def test_authenticated_round_trip(server):
    srv, key = server
    conn = channel.connect(srv.address, key, hello())
    conn.send(make("migrate", node="train2"))
    got = [srv.inbox.get(timeout=5)[1] for _ in range(2)]
    assert got[0]["type"] == "hello" and got[1] == {"type": "migrate", "node": "train2"}
    conn.close()


def test_on_hello_runs_at_authentication_without_waiting_for_the_inbox_reader():
    """The controller beats to its keeper from the keeper's hello on, while its own loop is
    still blocked (a throttled Slurm query): the hook runs on the connection's thread, before
    the hello is queued and whether or not anyone reads the inbox. A wrong key never reaches it."""
    key = channel.new_secret()
    seen = []
    srv = channel.Server("127.0.0.1", key, handshake_timeout=2.0,
                         on_hello=lambda conn, msg: seen.append((conn, msg, srv.inbox.qsize())))
    try:
        stranger = channel.connect(srv.address, channel.new_secret(), hello(), timeout=1.0)
        assert _wait_rejected(srv, 1) >= 1 and seen == []
        stranger.close()
        peer = channel.connect(srv.address, key, make("hello", role="keeper", node="k1", ranks=[], pid=7))
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        (conn, msg, queued), = seen
        assert msg["role"] == "keeper" and queued == 0  # before the hello was queued; nobody read it
        conn.send(make("alive"))  # the hook's connection talks back at once
        assert peer.framer.recv(deadline=time.monotonic() + 5) == {"type": "alive"}
        peer.close()
    finally:
        srv.close()


def _wait_rejected(srv, n):
    deadline = time.monotonic() + 5
    while srv.rejected < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return srv.rejected


def test_wrong_secret_is_rejected_and_delivers_nothing(server):
    srv, key = server
    channel.connect(srv.address, b"\x00" * 32, make("migrate", node="train2"))
    assert _wait_rejected(srv, 1) == 1
    assert srv.inbox.empty()  # nothing at all: a peer that never authenticated is never known


def test_failed_handshakes_first_from_each_address_then_a_summary_at_most_once_a_period():
    from trainmover.protocol.handshake_log import HandshakeFailures
    f = HandshakeFailures(summary_every_s=60, max_addresses=2)
    first = f.failed("10.0.0.1:5000", "bad MAC", now=0)
    assert first.startswith("control: failed handshake from 10.0.0.1:5000: bad MAC")
    assert [f.failed("10.0.0.1:5001", "bad MAC", now=t) for t in range(1, 6)] == [None] * 5  # counted
    assert f.failed("10.0.0.2:7", "bad MAC", now=2).startswith("control: failed handshake from 10.0.0.2:7")
    assert f.failed("10.0.0.3:7", "bad MAC", now=3) is None  # a third address: beyond max_addresses, counted
    assert f.failed("10.0.0.1:5002", "bad MAC", now=61) == \
        "control: 7 more failed handshakes in the last 61s from 2 address(es); 9 in all"
    assert f.failed("10.0.0.1:5003", "bad MAC", now=62) is None  # the next summary is due at 121
    assert f.summary(now=100) is None
    assert f.summary(now=100, force=True) == \
        "control: 1 more failed handshakes in the last 39s from 1 address(es); 10 in all"
    assert f.summary(now=500, force=True) is None  # nothing left to count


def test_a_flood_of_failed_handshakes_is_counted_not_logged_line_by_line(server, caplog):
    """8,681 WARNING lines in 5 s were seen (issue 37). Negative control: the previous server
    logged one line per failed handshake, 20 here, where this one logs 2."""
    import logging
    srv, key = server
    caplog.set_level(logging.WARNING, logger=channel.__name__)
    for _ in range(20):
        channel.connect(srv.address, channel.new_secret(), hello()).close()
    assert _wait_rejected(srv, 20) == 20
    time.sleep(0.2)  # the last connection's thread logs after counting
    srv.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 2, lines  # the first from 127.0.0.1, then the summary as the server closes
    assert lines[0].startswith("control: failed handshake from 127.0.0.1:")
    assert lines[1].startswith("control: 19 more failed handshakes") and lines[1].endswith("20 in all")


def test_replayed_frame_is_rejected(server):
    srv, key = server
    conn = channel.connect(srv.address, key, hello())
    body = json.dumps(make("migrate", node="x")).encode()
    mac = conn.framer._mac(b"C", 0, body)  # a frame valid for sequence 0, sent as sequence 1
    conn.framer.sock.sendall(struct.pack(">I", len(body)) + body + mac)
    assert _wait_rejected(srv, 1) == 1


def test_oversized_and_garbage_frames_are_rejected(server):
    srv, key = server
    for payload in (struct.pack(">I", channel.MAX_FRAME + 1), b"\xff" * 64):
        s = socket.create_connection(srv.address)
        s.recv(16)
        s.sendall(payload)
        s.close()
    assert _wait_rejected(srv, 2) == 2


def test_unreachable_controller_times_out_with_a_clear_error():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(DeadlineExceeded, match=f"127.0.0.1:{port}"):
        channel.connect(("127.0.0.1", port), b"k" * 32, hello(), timeout=0.5)


def test_secret_file_is_private(tmp_path):
    path = tmp_path / "secret"
    key = channel.write_secret(str(path))
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert channel.read_secret(str(path)) == key
    with pytest.raises(FileExistsError):
        channel.write_secret(str(path))  # never overwrite another job's secret


def test_every_message_type_is_a_class_and_crosses_the_wire_unchanged():
    """The schema is the classes (protocol/messages.py): SCHEMA is derived from them, and a
    message read as its class and written back is the same JSON object; a wrong field is refused
    at construction of the wire form."""
    import dataclasses

    from trainmover.errors import ProtocolError
    from trainmover.protocol.messages import SCHEMA, TYPES, AbortMsg, make, typed, wire
    sample = {int: 3, float: 1.5, str: "x", bool: True, list: [], dict: {}}
    assert set(TYPES) == set(SCHEMA) and all(cls.__name__.endswith("Msg") for cls in TYPES.values())
    for kind, fields in SCHEMA.items():
        msg = make(kind, **{name: sample[typ if isinstance(typ, type) else float] for name, typ in fields.items()})
        obj = typed(msg)
        assert type(obj) is TYPES[kind] and dataclasses.is_dataclass(obj)
        assert wire(obj) == msg
    assert typed(make("abort", epoch=2, reason="r")) == AbortMsg(epoch=2, reason="r")
    with pytest.raises(ProtocolError, match="abort.epoch: must be >= 0"):
        wire(AbortMsg(epoch=-1, reason="r"))  # the wire form is validated as a received one is


def test_looked_at_is_held_while_a_turn_is_stalled_and_moves_on_after_it():
    """The reader's `looked_at` (what the silence rule counts to, liveness.py) is the start of its
    last finished turn: a turn stalled in the middle (here: a hook that blocks, as a long turn
    over 1,024 busy connections did at 128 nodes) holds it back, so no peer looks silent for the
    reader's own delay; once the turn ends it moves past the stall."""
    import threading
    key = channel.new_secret()
    release = threading.Event()
    srv = channel.Server("127.0.0.1", key, handshake_timeout=5.0, on_hello=lambda conn, msg: release.wait(10))
    try:
        deadline = time.monotonic() + 5
        first = srv.looked_at
        while srv.looked_at == first and time.monotonic() < deadline:  # idle turns: it moves (each <= 1 s)
            time.sleep(0.05)
        assert srv.looked_at > first
        peer = channel.connect(srv.address, key, hello())  # its hello stalls the selector's turn
        time.sleep(0.3)
        stalled = srv.looked_at
        time.sleep(1.5)  # longer than an idle turn: had the reader turned, looked_at would have moved
        assert srv.looked_at == stalled and stalled < time.time() - 1.5
        assert "in _read" in srv.selector_stack() and "release.wait" in srv.selector_stack()  # where it is held
        released = time.time()
        release.set()
        while srv.looked_at < released and time.monotonic() < deadline + 5:
            time.sleep(0.05)
        assert srv.looked_at >= released  # a turn begun after the stall, finished
        peer.close()
    finally:
        release.set()
        srv.close()
