"""Silent failures (controller/policy/liveness.py): a fake clock and made-up heartbeats."""
import pytest

from trainmover.config import Config
from trainmover.controller.durable.view import JobView
from trainmover.controller.policy.actions import Fence, Finish
from trainmover.controller.policy.core import Policy
from tests.unit.test_policy import ready_standby, sends

PIDS = {0: 100, 1: 101, 2: 102}
NODES = {0: "train1", 1: "train2", 2: "train3"}


def new_policy(**cfg):
    return Policy(Config(**cfg), JobView(7, 3, 1, "train1", dict(NODES)))


def beat(p, now, rank, step, issued, cpu, waiting=None):
    p.heard(now, NODES[rank], PIDS[rank], {"type": "beat", "ranks": [rank], "step": step, "issued": issued,
                                           "waiting": waiting or {}, "cpu_s": cpu})


def step(p, now, rank, n, t=None):
    """A step report, heard as the executor hears every message (controller/executor.py)."""
    msg = {"type": "step", "rank": rank, "step": n, "loss": 1.0, "step_s": 0.1, "compute_s": 0.05,
           "t": now if t is None else t}
    p.heard(now, NODES[rank], PIDS[rank], msg)
    return p.on_message(now, NODES[rank], msg)


def train(p, until, every=0.1, ranks=(0, 1, 2), cpu=None):
    """All ranks step and beat in lockstep until `until` (the controller ticks each second).
    Returns the time of the last beat and the steps complete."""
    t, n, last = 1.0, 0, 1.0
    while t < until:
        n += 1
        for r in ranks:
            step(p, t, r, n)
            beat(p, t, r, n, {"world": 3 * n}, (cpu or {}).get(r, t))
        last = t
        t += every
        if int(round(t * 10)) % 10 == 0:
            assert not [a for a in p.on_tick(t) if isinstance(a, Fence)]
    return last, n


def test_a_frozen_rank_is_named_by_its_silence_fenced_and_recovered():
    p = new_policy()
    ready_standby(p)
    t, n = train(p, 5.0)
    # rank 1 froze at t: the others go on beating (blocked in the collective, their threads alive)
    for k in range(1, 8):
        for r in (0, 2):
            beat(p, t + k * 0.5, r, n, {"world": 3 * n + 1}, t, waiting={"world": k * 0.5})
        acts = p.on_tick(t + k * 0.5)
        fences = [a for a in acts if isinstance(a, Fence)]
        if k * 0.5 <= 3.0:
            assert not fences, f"judged before the timeout at {k * 0.5}s"
            continue
        (fence,) = fences
        assert (fence.node, fence.pid) == ("train2", 101) and "no heartbeat for 3.5s" in fence.reason, fence.reason
        assert "rank" in fence.reason and "[1]" in fence.reason
        (revoke,) = sends(acts, "revoke")
        assert revoke.msg["failed"] == [1] and set(revoke.nodes) == {"train1", "train3"}
        assert p.recovery() is not None and p.recovery().leaver == "train2"
        break
    else:
        raise AssertionError("never judged")
    # once fenced, nothing it says counts, and its later silence is no second verdict
    assert ("train2", 101) in p.fenced_pids
    beat(p, t + 10, 1, n, {"world": 3 * n}, t)
    assert ("train2", 101) not in p.processes
    assert not [a for a in p.on_tick(t + 12) if isinstance(a, Fence)]
    assert p.status()["liveness"]["fenced"][0]["ranks"] == [1]


def test_frames_still_queued_for_the_policy_count_as_heard():
    p = new_policy()
    t, n = train(p, 3.0)
    for r in (0, 1, 2):
        beat(p, t, r, n, {"world": 3 * n}, t)
    arrivals = {(NODES[r], PIDS[r]): t + 9.5 for r in (0, 1, 2)}  # read by the server, not yet by the policy
    assert not [a for a in p.on_tick(t + 0.5) if isinstance(a, Fence)]
    assert not [a for a in p.on_tick(t + 1.0, arrivals) if isinstance(a, Fence)]
    for k in range(2, 20):
        assert not [a for a in p.on_tick(t + k * 0.5, arrivals) if isinstance(a, Fence)]


def test_a_controller_that_did_not_run_for_a_while_judges_nobody_at_once():
    p = new_policy()
    t, n = train(p, 3.0)
    p.on_tick(t)
    # the controller itself stalled for 20 s: every process looks silent, none is judged now
    assert not [a for a in p.on_tick(t + 20) if isinstance(a, Fence)]
    for r in (0, 1, 2):
        beat(p, t + 20.2, r, n, {"world": 3 * n}, t)
    assert not [a for a in p.on_tick(t + 20.5) if isinstance(a, Fence)]


def test_silence_is_counted_only_to_when_the_reader_last_looked():
    """The channel's reader fell behind (a turn stalled 4 s): frames sent meanwhile are unread, so
    no process is judged for that time; once the reader has looked past a process's deadline and
    found nothing, the silent one is judged, and only it."""
    p = new_policy()
    t, n = train(p, 3.0)
    p.on_tick(t)
    for k in range(1, 10):  # the reader last looked at t + 0.2; the policy ticks on
        assert not [a for a in p.on_tick(t + k * 0.5, {}, looked_at=t + 0.2) if isinstance(a, Fence)]
    # it looked again at t + 4.6: ranks 0 and 2 were heard (their frames read), rank 1 nothing
    arrivals = {(NODES[r], PIDS[r]): t + 4.5 for r in (0, 2)}
    fences = [a for a in p.on_tick(t + 5.0, arrivals, looked_at=t + 4.6) if isinstance(a, Fence)]
    assert [f.node for f in fences] == ["train2"]


def test_a_rank_three_times_slower_is_slow_not_dead():
    p = new_policy()
    ready_standby(p)
    t, n = train(p, 3.0)
    # rank 1 computes 3x as long: steps take 0.3 s, every rank still beats and completes steps
    for k in range(60):
        t += 0.3
        n += 1
        for r in (0, 1, 2):
            beat(p, t, r, n, {"world": 3 * n}, t)
            step(p, t, r, n)
        acts = p.on_tick(t)
        assert not [a for a in acts if isinstance(a, Fence)] and not sends(acts, "revoke")
    assert p.recovery() is None


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_stuck_rank_is_the_one_the_others_wait_on_with_an_idle_training_thread(backend):
    """gloo: the others report how long they wait in the collective. NCCL: a collective returns
    once enqueued, so nobody reports waiting; the issued counts alone show who is behind."""
    p = new_policy(progress_timeout_s=5.0)
    ready_standby(p)
    t, n = train(p, 4.0)
    # rank 2's training thread hangs (not in a collective, no CPU); ranks 0, 1 issued the next
    # collectives and wait in them, their threads also idle; all three still beat
    frozen_cpu = {0: t, 1: t, 2: t}
    fences = []
    for k in range(1, 30):
        now = t + k * 0.5
        waits = {"world": k * 0.5} if backend == "gloo" else {}
        beat(p, now, 0, n, {"world": 3 * n + 2}, frozen_cpu[0], waiting=waits)
        beat(p, now, 1, n, {"world": 3 * n + 2}, frozen_cpu[1], waiting=waits)
        beat(p, now, 2, n, {"world": 3 * n}, frozen_cpu[2])
        acts = p.on_tick(now)
        fences = [a for a in acts if isinstance(a, Fence)]
        if fences:
            break
    (fence,) = fences
    assert fence.node == "train3" and "stuck" in fence.reason and f"it issued {3 * n}" in fence.reason
    assert ("ranks [0, 1] wait in it" in fence.reason) == (backend == "gloo")
    assert 5.0 < k * 0.5 <= 7.0  # the deadline (5 s) plus the CPU window


def test_a_rank_behind_whose_thread_computes_is_not_stuck():
    """A recompile or a very slow step: no step for long, the others wait on it, but its
    training thread uses CPU all along."""
    p = new_policy(progress_timeout_s=5.0)
    t, n = train(p, 4.0)
    for k in range(1, 40):
        now = t + k * 0.5
        beat(p, now, 0, n, {"world": 3 * n + 2}, t, waiting={"world": k * 0.5})
        beat(p, now, 1, n, {"world": 3 * n + 2}, t, waiting={"world": k * 0.5})
        beat(p, now, 2, n, {"world": 3 * n}, t + k * 0.45)  # computing
        assert not [a for a in p.on_tick(now) if isinstance(a, Fence)]


def test_the_stuck_deadline_scales_with_the_step_time():
    p = new_policy(progress_timeout_s=1.0, progress_steps=10)
    train(p, 20.0, every=0.5)
    assert p.status()["liveness"]["stuck_deadline_s"] == 5.0


def test_a_silent_standby_is_lost_and_fenced_not_a_rank():
    p = new_policy()
    ready_standby(p)
    p.heard(1.5, "spare1", 300, {"type": "ready", "node": "spare1", "local": 0, "warmup_s": 1.0, "shadow_steps": 2,
                                 "detail": {}})
    p.heard(2.0, "spare1", 300, {"type": "beat", "ranks": [], "step": 0, "issued": {}, "waiting": {}, "cpu_s": 0.0})
    t, n = train(p, 3.0)
    acts = []
    for k in range(1, 12):  # the ranks beat on; the standby froze after its beat at 2.0
        for r in (0, 1, 2):
            beat(p, t + k * 0.5, r, n, {"world": 3 * n}, t)
        acts += p.on_tick(t + k * 0.5)
    (fence,) = [a for a in acts if isinstance(a, Fence)]
    assert fence.node == "spare1" and "standby" in fence.reason
    assert "spare1" not in p.view.standbys and p.standbys_lost[0]["node"] == "spare1"
    assert p.recovery() is None and not [a for a in acts if isinstance(a, Finish)]


def test_fenced_processes_survive_a_controller_restart_in_the_journal():
    from trainmover.controller.durable import journal
    p = new_policy()
    ready_standby(p)
    t, n = train(p, 3.0)
    for k in range(1, 10):
        for r in (0, 2):
            beat(p, t + k * 0.5, r, n, {"world": 3 * n}, t)
        p.on_tick(t + k * 0.5)
    assert ("train2", 101) in p.fenced_pids
    records = journal.diff({}, p.durable())
    text = "".join(__import__("json").dumps({"v": journal.VERSION, "seq": i, "t": 0.0, **r}) + "\n"
                   for i, r in enumerate([{"kind": "start", "job_id": 7, "world_size": 3, "ranks_per_node": 1,
                                           "batch_host": "train1", "rank_node": {}}] + records))
    replayed = journal.fold(text.splitlines(keepends=True))
    q = new_policy()
    q.resume(t + 5, replayed, 0)
    assert ("train2", 101) in q.fenced_pids


def test_a_threads_cpu_time_is_read_from_proc_and_grows_only_while_it_computes():
    import threading
    import time
    from trainmover.runtime.heartbeat import thread_cpu_s
    ids, done, stop = [], threading.Event(), threading.Event()

    def busy():
        ids.append(threading.get_native_id())
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        done.set()
        stop.wait(5)
    th = threading.Thread(target=busy)
    th.start()
    assert done.wait(30)
    first = thread_cpu_s(ids[0])
    time.sleep(0.3)  # now it only waits
    assert 0.25 <= first and thread_cpu_s(ids[0]) - first < 0.05
    stop.set()
    th.join()
    assert thread_cpu_s(2 ** 30) == 0.0  # no such thread: unreadable, never an error


def test_a_process_still_starting_may_be_silent_as_long_as_a_rendezvous_may_take():
    """Before its first step a process builds its groups and its model, and a CUDA context or a
    library's initialisation can hold the interpreter's lock for seconds: it is judged silent
    only after TM_GROUP_TIMEOUT_S then (a crash is still seen at once, by its closed connection)."""
    p = new_policy(group_timeout_s=20.0)
    ready_standby(p)
    for r in (0, 1, 2):
        beat(p, 1.0, r, 0, {}, 0.0)
    for k in range(1, 60):
        now = 1.0 + k * 0.5
        for r in (0, 2):
            beat(p, now, r, 0, {}, 0.0)
        fences = [a for a in p.on_tick(now) if isinstance(a, Fence)]
        if now - 1.0 <= 20.0:
            assert not fences, f"judged at {now - 1.0}s while starting"
        elif fences:
            (fence,) = fences
            assert fence.node == "train2" and "starting: TM_GROUP_TIMEOUT_S=20" in fence.reason
            break
    else:
        raise AssertionError("never judged")


def test_after_a_pause_of_the_stuck_rule_the_ranks_get_a_whole_deadline():
    """The stuck rule is suspended while a recovery runs; when it applies again the deadline
    counts from then, not from the last step before the pause (a recovery that waited 60 s
    once judged every rank stuck 0.2 s after it resumed). Negative control: without the pause
    the same silence is judged at once."""
    def stuck_nodes(p, t0, n, until, rule_from):
        """Tick every 0.5 s from t0 to `until`, every rank beating (rank 2 behind, all idle);
        the stuck rule applies from `rule_from` on. Returns (time, node) of stuck verdicts."""
        out, now = [], t0
        while now < until:
            now += 0.5
            for r in (0, 1, 2):
                beat(p, now, r, n, {"world": 3 * n + (0 if r == 2 else 2)}, t0,
                     waiting={"world": 1.0} if r < 2 else {})
            out += [(now, h.node) for h, why in p.liveness.verdicts(now, {}, judging=True, stuck_rule=now >= rule_from)
                    if "stuck" in why]
            if out:
                return out
        return out

    p = new_policy(progress_timeout_s=5.0)
    ready_standby(p)
    t, n = train(p, 4.0)
    ((when, node),) = stuck_nodes(p, t, n, t + 80, rule_from=t + 60)  # a recovery ran from t to t + 60
    assert node == "train3" and when >= t + 65  # a whole deadline after the rule applied again
    q = new_policy(progress_timeout_s=5.0)
    ready_standby(q)
    t, n = train(q, 4.0)
    ((when, node),) = stuck_nodes(q, t, n, t + 80, rule_from=t)
    assert node == "train3" and when <= t + 7


def train_reporting_steps_only(p, until, every=0.1, ranks=(0, 1, 2)):
    """All ranks report steps and send no beats (runtime/heartbeat.py skips a beat that a step
    report within TM_HEARTBEAT_S makes redundant). Returns the last step's time and number."""
    t, n, last = 1.0, 0, 1.0
    while t < until:
        n += 1
        for r in ranks:
            step(p, t, r, n)
        last = t
        t += every
        if int(round(t * 10)) % 10 == 0:
            assert not [a for a in p.on_tick(t) if isinstance(a, Fence)]
    return last, n


def test_without_beats_while_steps_flow_a_frozen_or_stuck_rank_is_found_as_soon_as_with_them():
    """Issue 38: ranks that report a step within the beat interval send no beat. A frozen rank
    (no frame at all) is judged at the same silence as in the test above (3.5 s after its last
    frame, the beats of the others resumed once their steps stopped), and named by the ranks its
    step reports gave; a stuck one by the beats that resume when steps stop, within the same bound
    as with beats all along (the deadline plus the CPU window)."""
    from trainmover.runtime.heartbeat import beat_due_in
    assert beat_due_in(0.5, 10.0, None) == 0.0          # no step yet: every beat goes
    assert beat_due_in(0.5, 10.0, 9.8) == pytest.approx(0.3)  # a step 0.2 s ago: the beat waits 0.3 s
    assert beat_due_in(0.5, 10.0, 9.5) == 0.0           # a whole interval since the last step: due
    # frozen: rank 1's last frame is the step at t
    p = new_policy()
    ready_standby(p)
    t, n = train_reporting_steps_only(p, 5.0)
    fence = None
    for k in range(1, 8):
        for r in (0, 2):
            beat(p, t + k * 0.5, r, n, {"world": 3 * n + 1}, t, waiting={"world": k * 0.5})
        fences = [a for a in p.on_tick(t + k * 0.5) if isinstance(a, Fence)]
        if k * 0.5 <= 3.0:
            assert not fences, f"judged before the timeout at {k * 0.5}s"
            continue
        (fence,) = fences
        break
    assert fence is not None and (fence.node, fence.pid) == ("train2", 101)
    assert "no heartbeat for 3.5s" in fence.reason and "[1]" in fence.reason, fence.reason
    # stuck: rank 2's training thread hangs; every rank's beats resume 0.5 s after its last step
    p = new_policy(progress_timeout_s=5.0)
    ready_standby(p)
    t, n = train_reporting_steps_only(p, 4.0)
    fences = []
    for k in range(1, 30):
        now = t + k * 0.5
        beat(p, now, 0, n, {"world": 3 * n + 2}, t, waiting={"world": k * 0.5})
        beat(p, now, 1, n, {"world": 3 * n + 2}, t, waiting={"world": k * 0.5})
        beat(p, now, 2, n, {"world": 3 * n}, t)
        fences = [a for a in p.on_tick(now) if isinstance(a, Fence)]
        if fences:
            break
    (fence,) = fences
    assert fence.node == "train3" and "stuck" in fence.reason
    assert 5.0 < k * 0.5 <= 7.0


def test_ranks_stalled_with_nobody_lost_wait_for_the_reader_to_catch_up():
    """Stalled reports arrived but the reader is behind (a lost peer's closed connection may sit
    unread after them): the detection window counts only to its last look, then ends the job."""
    from trainmover.controller.policy.recovery import DETECT_WINDOW_S
    p = new_policy()
    t, n = train(p, 3.0)
    for r in (0, 2):
        p.on_message(t, NODES[r], {"type": "stalled", "rank": r, "step": n, "digest": "d", "error": "peer gone",
                                   "role": "stayer", "holds": {"replicas": [], "own": [], "held": {}}})
    late = t + DETECT_WINDOW_S + 5
    for k in range(1, 2 * int(late - t)):  # the policy ticks on; the reader last looked at t + 1
        assert not [a for a in p.on_tick(t + k * 0.5, {}, looked_at=t + 1.0) if isinstance(a, (Finish, Fence))]
    heard = {(NODES[r], PIDS[r]): late for r in (0, 1, 2)}  # it caught up: everyone beat, nobody is lost
    (fin,) = [a for a in p.on_tick(late, heard, looked_at=late) if isinstance(a, Finish)]
    assert "no rank was found lost" in fin.message
