"""Groups foreseen (controller/policy/foresight.py, runtime/roles/foresight.py): what the policy asks
for, when a recovery may take them, and what each process builds (pure; the processes' part,
built before the fault and taken bit-exactly, is test_rank_process.py's replica-foreseen)."""
from trainmover.groups.specs import GroupSpec
from trainmover.protocol.messages import make, typed
from trainmover.runtime.roles import foresight

from test_policy import new_policy, ready_standby, sends, stalled


def foreseen(p, node, tag, cases, rank=None, local=0):
    return p.on_message(2.0, node, make("foreseen", tag=tag, role="standby" if rank is None else "worker",
                                        rank=rank or 0, local=local, cases=cases, detail={}))


def lose_rank_1(p):
    p.on_step_exit(3.0, "train2", 137)
    stalled(p, 3.1, 0, 230)
    return stalled(p, 3.2, 2, 230)


def test_a_ready_standby_gets_every_nodes_loss_foreseen_once_and_the_recovery_takes_them():
    p = new_policy(foresee_nodes=4)
    (fore,) = sends(ready_standby(p), "foresee")
    assert set(fore.nodes) == {"train1", "train2", "train3", "spare1"}
    tag = fore.msg["tag"]
    assert tag == "e0s1t2000"  # epoch, sequence, and the time it was made: never a predecessor's
    assert fore.msg["cases"] == [[0], [1], [2]] and fore.msg["sources"] == [1, 0, 0] and fore.msg["standby"] == "spare1"
    assert not sends(p.on_tick(2.5), "foresee")  # nothing changed: no new tag
    for rank, cases in ((0, [[1], [2]]), (2, [[0], [1]]), (1, [[0], [2]])):
        foreseen(p, f"train{rank + 1}", tag, cases, rank=rank)
    foreseen(p, "spare1", tag, [[0], [1], [2]])
    recover = sends(lose_rank_1(p), "recover")
    assert [r.msg["foreseen"] for r in recover] == [tag, tag]


def test_a_case_not_built_by_every_member_is_not_taken():
    """Negative controls: a live rank that did not report the case, a report of an older tag,
    a standby process that did not report: the plan names no tag (groups built after the fault)."""
    for missing in ("rank", "old-tag", "standby"):
        p = new_policy(foresee_nodes=4)
        (fore,) = sends(ready_standby(p), "foresee")
        tag = fore.msg["tag"]
        foreseen(p, "train1", tag if missing != "old-tag" else "e0s0", [[1], [2]], rank=0)
        if missing != "rank":
            foreseen(p, "train3", tag, [[0], [1]], rank=2)
        if missing != "standby":
            foreseen(p, "spare1", tag, [[0], [1], [2]])
        assert [r.msg["foreseen"] for r in sends(lose_rank_1(p), "recover")] == ["", ""], missing


def test_off_by_default_and_beyond_the_node_limit():
    assert not sends(ready_standby(new_policy()), "foresee")
    assert not sends(ready_standby(new_policy(foresee_nodes=2)), "foresee")  # 3 training nodes > 2
    p = new_policy()
    ready_standby(p)
    assert [r.msg["foreseen"] for r in sends(lose_rank_1(p), "recover")] == ["", ""]


def test_each_process_builds_its_groups_of_each_case_in_one_global_order():
    specs = [GroupSpec("world", (0, 1, 2, 3)), GroupSpec("dp0", (0, 2)), GroupSpec("dp1", (1, 3))]
    msg = typed(make("foresee", tag="e0s1", standby="spare", cases=[[0, 1], [2, 3]], sources=[2, 0]))
    # rank 2 (node 2's first) builds only the case it survives, and is that case's source
    assert [(c, k, g) for c, k, _, _, g, _ in foresight.plan(specs, msg, 2, 0)] == [
        ((0, 1), "world", 2), ((0, 1), "dp0", 1), ((0, 1), "xfer-to-0", 0), ((0, 1), "xfer-to-1", 0)]
    # the standby's process 1 would take rank 1, then rank 3: their groups and receiving pairs
    got = foresight.plan(specs, msg, None, 1)
    assert [(c, k, g, n) for c, k, _, _, g, n in got] == [
        ((0, 1), "world", 1, 4), ((0, 1), "dp1", 0, 2), ((0, 1), "xfer-in", 1, 2),
        ((2, 3), "world", 3, 4), ((2, 3), "dp1", 1, 2), ((2, 3), "xfer-in", 1, 2)]
    # both ends of a pair, and every member of a group, meet under one prefix of the tag and case
    assert foresight.plan(specs, msg, 2, 0)[3][3] == got[2][3] == "tm/fore/e0s1/c0-1/xfer/r1/"
