"""The keeper and the steps it runs for the controller (controller/succession/keeper.py, controller/steps.py)."""
import json

from trainmover.controller.steps import KeeperSteps
from trainmover.controller.succession.keeper import Keeper, choose_home
from trainmover.protocol.messages import LaunchMsg

from trainmover.controller.durable.records import sealed_outcome

KEY = b"k" * 32  # the job's key: the journal and the outcome are sealed with it


class Conn:
    def __init__(self, fail=False):
        self.sent, self.fail = [], fail

    def send(self, msg):
        if self.fail:
            raise OSError("gone")
        self.sent.append(msg)


def test_the_next_home_is_the_first_node_neither_left_nor_draining_nor_down():
    nodes = ["train1", "train2", "train3", "spare1"]
    states = {"train1": "ALLOCATED", "train2": "ALLOCATED+DRAIN", "train3": "DOWN+NOT_RESPONDING",
              "spare1": "ALLOCATED"}
    assert choose_home(nodes, {"train1"}, states) == "spare1"
    assert choose_home(nodes, set(), states) == "train1"
    assert choose_home(["train2", "train3"], set(), states) is None


def test_launches_wait_in_order_for_the_keeper_and_its_report_of_what_runs():
    steps = KeeperSteps()
    steps.launch("train1", "worker", ["srun", "x"], {"A": "1"}, "/tmp/w1.log")
    steps.launch("spare1", "standby", ["srun", "y"], {}, "/tmp/s1.log")
    conn = Conn()
    steps.connected(conn, {})
    assert [m["node"] for m in conn.sent] == ["train1", "spare1"] and conn.sent[0]["argv"] == ["srun", "x"]
    assert steps.exited() == []
    steps.on_exit("train1", 0)
    assert steps.exited() == [("train1", 0)] and steps.exited() == []


def test_a_successor_learns_which_steps_ended_while_no_controller_ran():
    steps = KeeperSteps()
    steps.running = {"train1": "worker", "train2": "worker"}  # what a resumed controller expects
    steps.connected(Conn(), {"train2": "worker"})
    assert steps.exited() == [("train1", 0)]
    steps.on_exit("train3", 1)  # an end the keeper kept for it
    assert steps.exited() == [("train3", 1)]


def test_a_keeper_that_cannot_be_reached_keeps_the_launches():
    steps = KeeperSteps()
    steps.connected(Conn(fail=True), {})
    steps.launch("train1", "worker", ["srun"], {}, "/tmp/x")
    assert steps.conn is None and len(steps.queued) == 1
    ok = Conn()
    steps.connected(ok, {})
    assert len(ok.sent) == 1 and steps.queued == []


def test_the_jobs_outcome_is_read_from_status_only_when_a_controller_ended_it(tmp_path):
    k = Keeper.__new__(Keeper)
    k.root = k.at = tmp_path
    k.key = KEY
    assert k._outcome() is None
    (tmp_path / "status.json").write_text(json.dumps({"job_id": 1}))  # running, or moved away
    assert k._outcome() is None
    (tmp_path / "status.json").write_text(json.dumps({"outcome": sealed_outcome(KEY, True, "training finished")}))
    assert k._outcome() == 0
    (tmp_path / "status.json").write_text(json.dumps({"outcome": sealed_outcome(KEY, False, "x")}))
    assert k._outcome() == 1
    # negative control: an outcome not sealed with the job's key (another user's file) is never believed
    (tmp_path / "status.json").write_text(json.dumps({"outcome": {"ok": True, "message": "forged"}}))
    assert k._outcome() is None


def test_a_controller_that_ended_the_job_is_never_replaced_even_before_its_status_is_written(tmp_path):
    """Its journal's `end` is written first at its shutdown; status.json's outcome last. In
    between (its shutdown may hang or die), the keeper already reads the job as ended: a loss
    verdict then turns into waiting for its step (succession ENDING), never a successor."""
    import json

    from trainmover.controller.durable import journal
    from trainmover.controller.succession import rules as succession

    k = Keeper.__new__(Keeper)
    k.root = k.at = tmp_path
    k.key = KEY
    j = journal.Journal(tmp_path / "journal.jsonl", key=KEY)
    j.write(1.0, [{"kind": "start", "job_id": 7, "world_size": 2, "ranks_per_node": 1, "batch_host": "k",
                   "rank_node": {"0": "train1", "1": "train2"}}])
    assert k._outcome() is None  # running: a silent controller would be replaced
    j.write(2.0, [{"kind": "end", "ok": False, "message": "user code raised on rank 1 (train2) at step 3: E"}])
    j.close()
    assert k._outcome() == 1  # FAILED, from the journal alone
    (tmp_path / "status.json").write_text(json.dumps({"outcome": sealed_outcome(KEY, True, "trained")}))
    assert k._outcome() == 0  # status.json's outcome, once written, is the final word
    primary = succession.Primary("train1", 0, 0.0, 2.0, 120.0)
    primary.heard(0.5)
    verdict = primary.check(10.0)  # silent in its shutdown
    assert verdict is not None and verdict.fence
    primary.ending(10.0)  # what the keeper's loop does with a loss verdict once _outcome() says ended
    assert primary.state is succession.State.ENDING
    assert primary.exited(11.0, 1, k._outcome()) == 0


def test_a_successor_with_nowhere_to_go_is_placed_again_rarely_and_at_once_when_a_standby_joins(tmp_path,
                                                                                             monkeypatch):
    """Each placement costs two queries of the user's rate-limit bucket (the job, its nodes):
    with no node free, tries back off from 60 s to 600 s; a standby's launch resets them."""
    from trainmover.controller.succession import keeper as keeper_mod
    from trainmover.slurm.model import JobInfo, NodeInfo

    class Slurm:
        queries = 0

        def job(self, job_id):
            Slurm.queries += 1
            return JobInfo(job_id, "RUNNING", ("keep1", "train1"), "keep1", 0, "/w", "train", 2)

        def nodes(self, names):
            Slurm.queries += 1
            return {n: NodeInfo(n, "10.0.0.1", "ALLOCATED") for n in names}

    class Cfg:
        controller_successors, controller_restarts = 1, 3

    k = Keeper.__new__(Keeper)
    k.cfg, k.slurm, k.job_id, k.node = Cfg(), Slurm(), 7, "keep1"
    k.successors, k.successor_starts, k.controller = [], 0, ("train1", None)
    k.successor_retry_at, k.successor_retry_s = 0.0, keeper_mod.SUCCESSOR_RETRY_S[0]
    k.reading, k.joined = (Slurm().job(7), None), None
    Slurm.queries = 0
    k._start_successor()
    k._start_successor()  # at once again: not asked
    assert Slurm.queries == 2 and k.successors == [] and k.successor_retry_s == 120.0
    k.successor_retry_at = 0.0  # as if the backoff had run out
    for _ in range(5):
        k._start_successor()
        k.successor_retry_at = 0.0
    assert k.successor_retry_s == keeper_mod.SUCCESSOR_RETRY_S[1]
    assert Slurm.queries == 2  # the job as last read left nowhere, and no standby joined: not asked again
    k.successor_retry_at = 1e18
    monkeypatch.setattr(keeper_mod, "start_srun", lambda *a, **kw: None)
    k.root, k.at, k.steps = tmp_path, tmp_path, {}
    env = {"TM_WORKER_SPEC": json.dumps({"node_addr": "10.0.0.7"}), "SLURM_JOB_NODELIST": "keep1,spare1,train1"}
    k._launch(LaunchMsg(node="spare1", role="standby", log=str(tmp_path / "standby-spare1.log"), argv=["srun"], env=env))
    assert k.successor_retry_at == 0.0 and k.successor_retry_s == keeper_mod.SUCCESSOR_RETRY_S[0]
    placed = []
    monkeypatch.setattr(k, "_srun", lambda home, argv, successor: placed.append(home) or "proc")
    k._start_successor()  # on the standby, from what its launch said: no query
    assert [(h.node, h.addr, h.job.nodes) for h in placed] == [("spare1", "10.0.0.7", ("keep1", "spare1", "train1"))]
    assert Slurm.queries == 2 and k.successors == [("spare1", "proc")]


def test_the_batch_script_reads_its_job_from_the_allocation_and_its_nodes_in_one_query():
    from trainmover.controller.succession.keeper import start_reading
    from trainmover.slurm.model import NodeInfo
    asked = []

    class Slurm:
        def nodes(self, names):
            asked.append(list(names))
            return {n: NodeInfo(n, "10.0.0.1", "ALLOCATED", features=("tm_keeper",) if n == "keep1" else ())
                    for n in names}

    env = {"SLURM_JOB_NODELIST": "keep1,train[1-2]", "SLURM_JOB_PARTITION": "train"}
    job, infos = start_reading(Slurm(), 7, "keep1", env, "/w")
    assert job.nodes == ("keep1", "train1", "train2") and job.work_dir == "/w" and job.partition == "train"
    assert asked == [["keep1", "train1", "train2"]] and "tm_keeper" in infos["keep1"].features
    assert start_reading(Slurm(), 7, "keep9", env, "/w") is None and len(asked) == 1  # not ours: ask Slurm


def test_a_controller_that_ended_the_job_is_not_connected_to_again(tmp_path, monkeypatch):
    """ENDING: its outcome is written and only its step's exit is awaited. A connect would retry
    its closed port for the whole 2 s deadline while the loop sees no exit (every job ended 2 s
    late); before that, and for a new primary, the keeper connects as ever."""
    from trainmover.controller.succession import rules as succession

    tried = []
    monkeypatch.setattr(Keeper, "_connect", lambda self: tried.append(self.primary.state))
    k = Keeper.__new__(Keeper)
    k.primary = succession.Primary("train1", 0, 0.0, 2.0, 120.0)
    k._reach()
    k.primary.heard(0.5)
    k.primary.ending(1.0)
    k._reach()
    assert tried == [succession.State.STARTING]
