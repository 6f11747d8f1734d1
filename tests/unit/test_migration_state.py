import pytest

from trainmover.controller.migration import ALLOWED, IllegalPhaseTransition, Migration, Phase, TERMINAL


def test_happy_path_and_durations():
    m = Migration(1, "train2", (1,), "drain", requested_at=100.0)
    m.to(Phase.PREPARING, 100.5)
    m.to(Phase.SWITCHING, 101.0)
    m.to(Phase.RELEASING, 101.25)
    m.to(Phase.DONE, 102.0)
    j = m.to_json()
    assert j["state"] == "done" and not m.active
    assert j["durations"] == {"wait_standby_s": 0.0, "phase1_s": 0.5, "switch_s": 0.25, "release_s": 0.75}


@pytest.mark.parametrize("start, target", [
    (Phase.REQUESTED, Phase.SWITCHING), (Phase.PREPARING, Phase.DONE), (Phase.SWITCHING, Phase.ABORTED),
    (Phase.DONE, Phase.PREPARING), (Phase.ABORTED, Phase.PREPARING),
])
def test_illegal_transitions_raise(start, target):
    m = Migration(1, "n", (0,), "manual", 0.0)
    m.phase = start
    with pytest.raises(IllegalPhaseTransition, match=f"{start.value} -> {target.value}"):
        m.to(target, 1.0)


def test_terminal_states_have_no_exit_and_every_state_is_covered():
    assert set(ALLOWED) == set(Phase)
    assert all(not ALLOWED[p] for p in TERMINAL)
    # once switching started (the pause), it can no longer be aborted: only finish or fail.
    assert ALLOWED[Phase.SWITCHING] == {Phase.RELEASING, Phase.FAILED}


def test_unknown_trigger():
    with pytest.raises(ValueError):
        Migration(1, "n", (0,), "cosmic-ray", 0.0)
