"""What the job's user may do (trainmover/slurm/rights.py): Slurm's answers parsed, and the
decision from them. Pure: facts in, capabilities out."""
from __future__ import annotations

from trainmover.slurm import rights
from trainmover.slurm.expansion_fix import Declaration
from trainmover.slurm.parse import parse_reservation_text

CONFIG = """Configuration data as of 2026-11-26T13:00:00
AccountingStorageType   = accounting_storage/slurmdbd
SchedulerParameters     = permit_job_expansion,batch_sched_delay=0
SLURM_VERSION           = 24.11.5
SlurmUser               = slurm(64030)
"""
RESV = ("ReservationName=trainmover_standby StartTime=2026-11-26T12:00:00 EndTime=2027-11-26T12:00:00 "
        "Duration=365-00:00:00 Nodes=spare[1-2] NodeCnt=2 CoreCnt=8 Features=(null) PartitionName=(null) "
        "Flags=IGNORE_JOBS,SPEC_NODES TRES=cpu=8 Users=root,tmuser Groups=(null) Accounts=(null) Licenses=(null) "
        "State=ACTIVE BurstBuffer=(null) Watts=n/a MaxStartDelay=(null)\n")


def facts(**kw) -> rights.Facts:
    base = dict(user="tmuser", uid=940, groups=("tmuser",), account="", slurm_user="slurm",
                scheduler_parameters="permit_job_expansion,batch_sched_delay=0", admin_level=None, accounting=False,
                reservation="trainmover_standby", reservation_fields=parse_reservation_text(RESV)["trainmover_standby"],
                slurm_version="24.11.5")
    return rights.Facts(**{**base, **kw})


def test_config_and_admin_level_are_parsed():
    c = rights.parse_config(CONFIG)
    assert c["SchedulerParameters"] == "permit_job_expansion,batch_sched_delay=0"
    assert rights.slurm_user_name(c["SlurmUser"]) == "slurm"
    assert rights.parse_admin_level("Operator|\n") == "Operator"
    assert rights.parse_admin_level("\n") is None


def test_an_ordinary_user_admitted_by_the_reservation_may_grow_and_shrink_but_not_drain():
    caps = rights.decide(facts())
    assert (caps.grow, caps.shrink, caps.drain) == (True, True, False)
    assert "tmuser is not root, not the SlurmUser (slurm)" in caps.why["drain"]
    lines = caps.consequences(standbys=1)
    assert len(lines) == 1 and lines[0].startswith("drain: no") and "held in the job" in lines[0]


def test_root_the_slurm_user_and_operators_may_drain():
    assert rights.decide(facts(user="root", uid=0)).drain
    assert rights.decide(facts(user="slurm", uid=64030)).drain
    assert rights.decide(facts(admin_level="Operator", accounting=True)).drain
    assert rights.decide(facts(admin_level="Administrator", accounting=True)).drain
    none = rights.decide(facts(admin_level="None", accounting=True))
    assert not none.drain and "has AdminLevel None" in none.why["drain"]
    assert "not in the accounting database" in rights.decide(facts(accounting=True)).why["drain"]


def test_a_reservation_that_refuses_the_user_means_no_grow_with_the_reason():
    other = parse_reservation_text(RESV.replace("Users=root,tmuser", "Users=root,alice"))["trainmover_standby"]
    caps = rights.decide(facts(reservation_fields=other))
    assert not caps.grow and "Users=root,alice, which does not admit tmuser" in caps.why["grow"]
    assert "no migration or recovery is possible" in caps.consequences(standbys=1)[0]
    assert "not needed: TM_STANDBYS=0" in caps.consequences(standbys=0)[0]
    assert caps.start_error(0, "trainmover_standby") == ""  # no standbys wanted: it may run
    assert caps.start_error(1, "trainmover_standby").startswith(
        "cannot take standbys: reservation trainmover_standby has Users=root,alice, which does not admit tmuser")
    missing = rights.decide(facts(reservation_fields=None, reservation_error="Reservation x not found"))
    assert not missing.grow and "not found" in missing.why["grow"]


def test_reservation_lists_users_excluded_accounts_and_groups():
    def grow(**fields) -> bool:
        r = {"ReservationName": "r", "Users": "(null)", "Accounts": "(null)", "Groups": "(null)", **fields}
        return rights.decide(facts(reservation_fields=r, account="ml")).grow
    assert grow(Users="-bob")                     # everyone but bob
    assert not grow(Users="-tmuser")
    assert grow(Accounts="ml,cv") and not grow(Accounts="cv")
    assert grow(Groups="tmuser") and not grow(Groups="wheel")
    assert not grow(Users="tmuser", Accounts="cv")  # every list that is set must admit
    assert not grow()                               # a reservation naming nobody


def test_without_permit_job_expansion_nothing_can_grow():
    caps = rights.decide(facts(scheduler_parameters="batch_sched_delay=0"))
    assert not caps.grow and "permit_job_expansion" in caps.why["grow"]


def test_the_cli_client_gathers_the_facts_through_the_choke_point():
    import os
    import subprocess

    from trainmover.slurm import commands
    from trainmover.slurm.client import CliSlurm
    answers = {("scontrol", "show", "config"): CONFIG,
               ("scontrol", "--local", "-o", "show", "job"): "JobId=7 JobName=x UserId=tmuser(940) Account=ml JobState=RUNNING\n",
               ("scontrol", "-o", "show", "reservation"): RESV,
               ("sacctmgr", "-nP", "show", "user"): "Operator|\n"}
    seen = []

    def runner(argv, timeout, env):
        key = next(k for k in answers if tuple(argv[:len(k)]) == k)
        seen.append(key)
        return subprocess.CompletedProcess(argv, 0, answers[key], "")

    with commands.intercept(runner):
        caps = CliSlurm(slurm_conf="/nonexistent/slurm.conf").capabilities(7, "trainmover_standby")
    assert ("scontrol", "show", "config") in seen and caps.shrink
    assert caps.grow == (caps.user in ("root", "tmuser"))   # the reservation's Users=root,tmuser
    # root may drain; anyone else here only as the Operator that sacctmgr (accounting is on) says
    assert caps.drain and (os.getuid() == 0 or ("sacctmgr", "-nP", "show", "user") in seen)


# --- the slurmctld release (slurm/expansion_safety.py) and the admin's declaration ----------

def _declared(*releases: str) -> Declaration:
    return Declaration(releases, "/etc/slurm/trainmover-expansion-fix")


def test_a_release_whose_slurmctld_crashes_on_expansion_means_no_grow_with_the_crash_named():
    caps = rights.decide(facts(slurm_version="25.11.7"))
    assert not caps.grow and caps.grow_blocked_by == "release"
    assert caps.why["grow"].startswith("Slurm 25.11.7: slurmctld crashes (SIGSEGV in _valid_license_job_expansion()")
    assert caps.expansion == {"slurm": "25.11.7", "safe": False, "why": caps.why["grow"]}
    assert caps.as_status()["expansion"]["safe"] is False and caps.as_status()["why"]["grow"] == caps.why["grow"]
    line = caps.consequences(standbys=1)[0]
    assert line.startswith("grow: no (Slurm 25.11.7: slurmctld crashes") and "no migration or recovery" in line
    error = caps.start_error(1, "trainmover_standby")
    assert error.startswith("cannot take standbys: Slurm 25.11.7") and "upgrade Slurm, or to apply the fix" in error
    assert "admit user" not in error and error.endswith("set TM_STANDBYS=0 to run without migration")
    assert "1 more node(s) at submit and TM_INJOB_STANDBYS=1" in error  # what the user can do alone
    # the control: the same facts on a release without the crash
    assert rights.decide(facts(slurm_version="24.11.5")).grow


def test_the_release_is_judged_before_the_reservation_and_after_permit_job_expansion():
    other = parse_reservation_text(RESV.replace("Users=root,tmuser", "Users=root,alice"))["trainmover_standby"]
    both = rights.decide(facts(slurm_version="26.05.4", reservation_fields=other))
    assert both.grow_blocked_by == "release" and "26.05.4" in both.why["grow"]
    off = rights.decide(facts(slurm_version="25.11.7", scheduler_parameters="batch_sched_delay=0"))
    assert off.grow_blocked_by == "slurm.conf" and off.why["grow"] == rights.EXPANSION_OFF
    assert "add permit_job_expansion to SchedulerParameters" in off.start_error(1, "trainmover_standby")
    assert off.expansion["safe"] is False  # still judged: said in status.json even so


def test_the_admins_declaration_for_this_release_lets_it_grow_and_no_other():
    declared = rights.decide(facts(slurm_version="25.11.7", expansion_fix=_declared("25.11.7")))
    assert declared.grow and declared.grow_blocked_by == "" and "grow" not in declared.why
    assert declared.expansion["safe"] and "admin declares the fix applied" in declared.expansion["why"]
    upgraded = rights.decide(facts(slurm_version="25.11.8", expansion_fix=_declared("25.11.7")))
    assert not upgraded.grow and "trainmover-expansion-fix declares 25.11.7 fixed, not this release" in upgraded.why["grow"]
    ignored = Declaration((), "/etc/slurm/trainmover-expansion-fix", "it belongs to uid 1000, not root")
    refused = rights.decide(facts(slurm_version="25.11.7", expansion_fix=ignored))
    assert not refused.grow and "was ignored: it belongs to uid 1000" in refused.why["grow"]
    # a declaration does not admit a user the reservation refuses
    other = parse_reservation_text(RESV.replace("Users=root,tmuser", "Users=root,alice"))["trainmover_standby"]
    caps = rights.decide(facts(slurm_version="25.11.7", expansion_fix=_declared("25.11.7"), reservation_fields=other))
    assert not caps.grow and caps.grow_blocked_by == "reservation"
    assert "admit user tmuser to reservation trainmover_standby" in caps.start_error(1, "trainmover_standby")


def test_a_slurmctld_whose_version_was_not_read_is_not_expanded():
    caps = rights.decide(facts(slurm_version=""))
    assert not caps.grow and "of unknown version" in caps.why["grow"]


def test_the_cli_client_reads_slurmctlds_release_and_the_declaration_beside_slurm_conf(tmp_path, monkeypatch):
    import os
    import subprocess

    from trainmover.slurm import commands
    from trainmover.slurm import expansion_fix
    from trainmover.slurm.client import CliSlurm
    config = CONFIG.replace("24.11.5", "25.11.7")
    answers = {("scontrol", "show", "config"): config,
               ("scontrol", "--local", "-o", "show", "job"): "JobId=7 JobName=x UserId=tmuser(940) Account=ml\n",
               ("scontrol", "-o", "show", "reservation"): RESV.replace("Users=root,tmuser", "Users=-nobody"),
               ("sacctmgr", "-nP", "show", "user"): "Operator|\n"}

    def runner(argv, timeout, env):
        key = next(k for k in answers if tuple(argv[:len(k)]) == k)
        return subprocess.CompletedProcess(argv, 0, answers[key], "")

    real_read = expansion_fix.read
    monkeypatch.setattr(expansion_fix, "read", lambda path: real_read(path, owners=(os.geteuid(),)))
    os.chmod(tmp_path, 0o755)
    client = CliSlurm(slurm_conf=str(tmp_path / "slurm.conf"))
    with commands.intercept(runner):
        before = client.capabilities(7, "trainmover_standby")
        (tmp_path / expansion_fix.FILE_NAME).write_text("25.11.7\n")
        after = client.capabilities(7, "trainmover_standby")
        off = client.capabilities(7, "trainmover_standby", "off")
    assert not before.grow and before.expansion["slurm"] == "25.11.7" and before.grow_blocked_by == "release"
    assert after.grow and "declares the fix applied" in after.expansion["why"]
    assert not off.grow  # TM_SLURM_EXPANSION_FIX=off: no declaration is read
