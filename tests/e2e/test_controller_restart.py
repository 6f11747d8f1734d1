"""The controller killed mid-migration, end to end on the real local Slurm cluster.

`trainmover migrate` starts a planned migration; the controller kills itself with SIGKILL
(TM_INJECT=controller-die:...) at a chosen point of it. The supervisor in the batch step
starts a new controller with --resume; it rebuilds the job's view from the journal, the
ranks and the standby reconnect and resync, and the migration in flight is completed (the
ranks switched while no controller ran) or aborted and asked again. The job ends with the
same job id, no requeue, and losses and digests equal to an uninterrupted run.
"""
from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import wait_for
from tests.e2e.test_migration import (  # noqa: F401 - fixtures shared with the planned-migration tests
    assert_same_training, demo, leaver_of, reference, resume_drained_nodes, start_training)

pytestmark = pytest.mark.slurm


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Killed right after `prepare` went out, the ranks may have switched before the new controller
# asks them (completed) or not yet (resumed: it carries the same migration on): both are right.
# With a keeper node the successor runs on another node with its own rendezvous store (the old
# one ends with the old controller's step): a Phase 1 still building its groups through the old
# store then fails, and the migration is aborted and asked again (a new epoch): right too.
@pytest.mark.parametrize("point, resolutions", [("prepare", ("completed", "resumed", "aborted")),
                                                ("preparing", ("aborted",))])
def test_the_controller_killed_mid_migration_is_restarted_and_the_job_trains_on(demo, reference, slurm_client,
                                                                                point, resolutions):
    # pace (the same bits): the steps must outlast the migration, a controller restart and a
    # retried Phase 1 (CI on an idle machine: the job ended 10 s after its standby was warm)
    run = demo(f"ctl-{point}", TM_INJECT=f"controller-die:{point},pace:0.085")
    start_training(run, slurm_client, min_step=60)
    wait_for("a warm standby", lambda: any(s["state"] == "ready" for s in run.status()["standbys"]), timeout=60)
    node = leaver_of(run)
    out = run.cli("migrate", "--job", str(run.job_id), "--node", node)
    assert out.returncode == 0, out.stderr
    wait_for("a restarted controller", lambda: json.loads((run.dir / "controller.json").read_text())["attempt"] >= 1,
             timeout=60)
    assert run.wait_done(slurm_client) == "COMPLETED", run.slurm_out()[-3000:]
    assert_same_training(run, reference)
    job = slurm_client.job(run.job_id)
    assert job.restart_count == 0 and node not in job.nodes  # the same job, never requeued; the node left
    status = run.status()
    # 1, or 2 when the warm successor sat on the node this migration moves off: it takes over,
    # then hands over again as that node leaves (docs/admin.md, "No special node")
    assert status["controller"]["restarts"] in (1, 2) and not status["controller"]["resuming"]
    assert status["outcome"]["ok"]
    done = [m for m in status["migrations"] if m["leaver"] == node and m["state"] == "done"]
    assert len(done) == 1
    timeline = jsonl(run.dir / "timeline.jsonl")
    resumed = [e for e in timeline if e["event"] == "resumed"]
    # The successor resolves the migration it finds in flight (`resumed`), unless a rank's
    # Phase 1, cut off from the old store, failed first and aborted it (no `resumed` then).
    resolution = resumed[0]["resolution"] if resumed else "aborted"
    assert len(resumed) <= 1 and resolution in resolutions, resumed
    if not resumed:
        assert any(e["event"] == "aborted" and e["migration"] == done[0]["id"] - 1 for e in timeline), timeline
    if resolution == "aborted":  # the retry is a new migration, with a new epoch, that completed
        aborted = [m for m in status["migrations"] if m["state"] == "aborted"]
        assert len(aborted) == 1 and done[0]["epoch"] > aborted[0]["epoch"]
    else:
        assert done[0]["id"] == resumed[0]["migration"]
    records = jsonl(run.dir / "journal.jsonl")
    restart = next(i for i, r in enumerate(records) if r["kind"] == "restart")
    died, back = records[restart - 1]["t"], records[restart]["t"]
    resynced = next(e for e in timeline if e["event"] in ("resumed", "controller_resynced") and e["t"] >= back)
    print(f"\n{point}: controller killed ~{died:.3f}, new controller read the journal after {back - died:.2f}s, "
          f"every rank resynced {resynced['waited_s']:.2f}s later (resumed control {resynced['t'] - died:.2f}s after "
          f"the kill); resolution {resolution}; migration {done[0]['id']} done, downtime {done[0]['downtime_s']}s")
