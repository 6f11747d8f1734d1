"""No job expansion unless the rights check said it is safe (controller/resize.py's gate,
controller/user_rights.py): on a slurmctld release that the merge crashes, on one not known,
and while a successor's check has not answered, the resizer asks Slurm nothing."""
from __future__ import annotations

import json

from trainmover.controller import user_rights
from trainmover.controller.fencing import FencedNodes
from trainmover.controller.resize import Resizer
from trainmover.controller.slurm_work import Acquired, Unavailable
from trainmover.slurm import rights
from trainmover.slurm.model import JobInfo

JOB = JobInfo(job_id=7, state="RUNNING", nodes=("train1", "train2"), batch_host="train1", restart_count=0,
              work_dir="/tmp", partition="train", num_nodes=2)


class _Slurm:
    def __init__(self):
        self.grows = 0

    def grow(self, job_id, *, reservation, partition=None, timeout=30.0):
        self.grows += 1
        return "spare1"


class _Pool:
    def none_idle(self):
        return ""

    def asked(self):
        pass

    def none_granted(self):
        pass


def _resizer(slurm, refusal):
    return Resizer(slurm, JOB, reservation="r", standby_wait_s=1, pool=_Pool(), addr=lambda n: "10.0.0.5",
                   clock=lambda: 0.0, gate=lambda: refusal)


def test_a_refused_or_unknown_grow_asks_slurm_nothing_and_says_why():
    slurm = _Slurm()
    crash = "Slurm 25.11.7: slurmctld crashes (SIGSEGV in _valid_license_job_expansion(), job_mgr.c)"
    assert _resizer(slurm, crash).acquire() == Unavailable(f"no standby is taken: {crash}")
    got = _resizer(slurm, None).acquire()
    assert isinstance(got, Unavailable) and got.reason.startswith("waiting for the check of what this job may do")
    assert slurm.grows == 0
    assert _resizer(slurm, "").acquire() == Acquired("spare1", "10.0.0.5")  # the control
    assert slurm.grows == 1


def test_the_refusal_comes_from_the_capabilities_and_not_knowing_them_refuses():
    ok = rights.Capabilities("tmuser", True, True, False, expansion={"slurm": "24.11.5", "safe": True, "why": ""})
    bad = rights.Capabilities("tmuser", False, True, False, {"grow": "Slurm 25.11.7: slurmctld crashes"}, "release")
    assert user_rights.grow_refusal(ok.as_status()) == ""
    assert user_rights.grow_refusal(bad.as_status()) == "Slurm 25.11.7: slurmctld crashes"
    unknown = user_rights.grow_refusal({"unknown": "scontrol show config timed out"})
    assert "not known (scontrol show config timed out)" in unknown and "no job expansion is made" in unknown
    assert user_rights.grow_refusal({}) != ""


def test_a_successor_takes_its_predecessors_verdict_only_if_the_release_was_judged(tmp_path):
    status = tmp_path / "status.json"
    judged = rights.Capabilities("tmuser", False, True, False, {"grow": "Slurm 25.11.7: crash"}, "release",
                                 {"slurm": "25.11.7", "safe": False, "why": "Slurm 25.11.7: crash"})
    status.write_text(json.dumps({"capabilities": judged.as_status()}))
    caps = user_rights.from_predecessor(status, FencedNodes())
    assert caps is not None and user_rights.grow_refusal(caps) == "Slurm 25.11.7: crash"
    older = {k: v for k, v in judged.as_status().items() if k != "expansion"}
    older["grow"] = True  # an older TrainMover's "grow: yes", made without judging the release
    status.write_text(json.dumps({"capabilities": older}))
    assert user_rights.from_predecessor(status, FencedNodes()) is None  # asked again


def test_from_slurm_passes_the_declaration_setting_and_logs_the_verdict(caplog):
    seen = []

    class Slurm:
        def capabilities(self, job_id, reservation, expansion_fix="auto"):
            seen.append(expansion_fix)
            return rights.decide(rights.Facts(user="tmuser", uid=940, scheduler_parameters="permit_job_expansion",
                                              reservation=reservation, reservation_fields={"Users": "tmuser"},
                                              slurm_version="26.05.2"))
    caplog.set_level("INFO")
    caps, error = user_rights.from_slurm(Slurm(), 7, "r", 1, FencedNodes(), "off")
    assert seen == ["off"] and caps["grow"] is False and error.startswith("cannot take standbys: Slurm 26.05.2")
    assert any("grow: no (Slurm 26.05.2: slurmctld crashes" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage().startswith("standby mode: none (Slurm 26.05.2: slurmctld crashes")
               for r in caplog.records)
    assert caps["pool_mode"]["mode"] == "none"


def test_status_says_the_mode_and_why_grow_is_refused():
    from trainmover.cli import _capability_lines
    crash = rights.decide(rights.Facts(user="tmuser", uid=940, scheduler_parameters="permit_job_expansion",
                                       reservation="r", reservation_fields={"Users": "tmuser"}, slurm_version="25.11.7"))
    lines = _capability_lines(crash.as_status())
    assert lines[0].startswith("  standby mode: none (Slurm 25.11.7: slurmctld crashes")
    assert lines[1].startswith("  grow: no (Slurm 25.11.7: slurmctld crashes") and len(lines) == 2
    fine = rights.decide(rights.Facts(user="tmuser", uid=940, scheduler_parameters="permit_job_expansion",
                                      reservation="r", reservation_fields={"Users": "tmuser"}, slurm_version="24.11.5"))
    assert [ln.split(" (")[0] for ln in _capability_lines(fine.as_status())] == ["  standby mode: reservation-grow"]
    assert _capability_lines({"unknown": "timed out"}) == ["  grow: not known (timed out); no job expansion is made"]
    assert _capability_lines({}) == []
