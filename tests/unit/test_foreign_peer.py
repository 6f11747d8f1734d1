"""A job's failure that names a peer outside the job says so (controller/foreign_peer.py): the
messages are the ones seen when another user took over a gloo pair of a migrating job
(tests/e2e/test_hostile_user.py::test_a_rogue_pair_peer_feeds_the_joiner_nothing)."""
from trainmover.controller import foreign_peer

NODES = ["127.0.1.11", "127.0.1.12", "127.0.1.13", "127.0.1.15"]
GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[{}]:27810. This is typically caused by a remote worker crashing.")
STALLED = "rank 0 stalled (collective allreduce of group world failed: " + GLOO + " (UserCodeError) but no rank was found lost"
LEAVER = "rank 1 on train2 failed in worker: RuntimeError: " + GLOO
WIRE = ("rank 1 on train2 failed in worker: MigrationError: state transfer: wire tensor 2 failed: "
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [{}]:55533: "
        "Connection reset by peer. (phase=switch)")


def test_a_failure_naming_a_peer_outside_the_job_says_so():
    for text in (STALLED, LEAVER, WIRE):
        said = foreign_peer.note(text.format("127.0.0.1"), NODES)
        assert said.startswith(text.format("127.0.0.1"))
        assert "peer 127.0.0.1 is none of the job's nodes" in said and "gloo pairs" in said


def test_a_failure_naming_a_node_of_the_job_is_left_as_it_is():
    """Negative control: a peer that is one of the job's nodes (a rank that really crashed), or
    no peer at all, adds nothing."""
    for text in (STALLED.format("127.0.1.12"), LEAVER.format("127.0.1.13"), WIRE.format("127.0.1.11"),
                 "rank 2 failed: ValueError: x", "[/src/pair.cc:553] no peer named"):
        assert foreign_peer.note(text, NODES) == text
