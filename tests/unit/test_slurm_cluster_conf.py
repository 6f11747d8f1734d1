"""The embedded cluster's generated configuration (pure rendering, no daemons)."""

from pathlib import Path

import pytest

from trainmover.cluster import spec as specmod
from trainmover.cluster.__main__ import build_parser
from trainmover.cluster.spec import ClusterSpec, Ports


def _spec(nodes=4, standby=2) -> ClusterSpec:
    return ClusterSpec(state_dir=Path("/var/tmp/tmc"), nodes=nodes, standby=standby,
                       ports=Ports(slurmctld=16817, slurmdbd=16819, mariadb=16306, slurmd_base=16901),
                       db_password="pw")


def test_names_addresses_ports():
    s = _spec()
    assert s.train_nodes == ["train1", "train2", "train3", "train4"] and s.spare_nodes == ["spare1", "spare2"]
    assert s.keeper_nodes == ["keep1", "keep2"] and s.keeper_expr == "keep[1-2]"
    assert [s.addr(n) for n in s.all_nodes] == [f"127.0.1.{i}" for i in range(11, 19)]
    assert s.slurmd_port("spare2") == 16906
    assert s.train_expr == "train[1-4]" and _spec(1, 1).spare_expr == "spare1"


def test_slurm_conf_has_the_settings_trainmover_needs():
    conf = specmod.render_slurm_conf(_spec()).splitlines()
    for line in [
        "SchedulerParameters=permit_job_expansion,batch_sched_delay=0,sched_min_interval=0,default_queue_depth=100,"
        "sched_interval=5",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStoragePort=16819",
        "AccountingStoragePass=/var/tmp/tmc/run/munge/munge.socket.2",
        "AuthInfo=socket=/var/tmp/tmc/run/munge/munge.socket.2",
        "SlurmctldHost=localhost(127.0.0.1)",
        "SlurmctldPort=16817",
        "CommunicationParameters=NoCtldInAddrAny",
        "NodeName=spare2 NodeAddr=127.0.1.16 NodeHostname=spare2 Port=16906 CPUs=4 RealMemory=2048 Weight=100 "
        "Features=tm_train State=UNKNOWN",
        # keepers: a job's batch script runs on one (docs/admin.md, "No special node")
        "NodeName=keep1 NodeAddr=127.0.1.17 NodeHostname=keep1 Port=16907 CPUs=4 RealMemory=2048 Weight=1000 "
        "Features=tm_keeper State=UNKNOWN",
        "PartitionName=train Nodes=train[1-4],spare[1-2],keep[1-2] Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=EXCLUSIVE",
        # the admin guide's health-check lines (docs/admin.md), pointing at the cluster's copy
        "HealthCheckProgram=/var/tmp/tmc/etc/healthcheck.sh",
        f"HealthCheckInterval={specmod.HEALTHCHECK_INTERVAL_S}",
        "HealthCheckNodeState=IDLE,CYCLE",
        "BatchStartTimeout=3600",  # no requeue of a job one registration left out
        "EnforcePartLimits=ALL",  # too many nodes for the partition: refused at submit, not pending for ever
    ]:
        assert line in conf, line


def test_slurmdbd_conf_and_reservation():
    dbd = specmod.render_slurmdbd_conf(_spec()).splitlines()
    assert "StoragePort=16306" in dbd and "DbdPort=16819" in dbd and "StoragePass=pw" in dbd
    assert specmod.reservation_args(_spec()) == [
        "ReservationName=trainmover_standby", "Nodes=spare[1-2]", "StartTime=now", "Duration=infinite",
        "Users=root,tmuser", "Flags=IGNORE_JOBS"]


def test_hosts_file_drops_conflicting_lines():
    system = "127.0.0.1 localhost\n127.0.1.1 myhost\n127.0.1.12 stale\n10.0.0.5 train3 # old\n"
    hosts = specmod.render_hosts(_spec(), system).splitlines()
    assert "127.0.0.1 localhost" in hosts and "127.0.1.1 myhost" in hosts
    assert "127.0.1.12 stale" not in hosts and not any(h.startswith("10.0.0.5") for h in hosts)
    assert "127.0.1.13 train3" in hosts and "127.0.1.16 spare2" in hosts


def test_spec_round_trips_and_validates():
    s = _spec()
    assert ClusterSpec.from_json(s.to_json()) == s
    with pytest.raises(ValueError):
        _spec(nodes=0)
    with pytest.raises(ValueError):
        _spec(nodes=200, standby=100)


def test_cli_parser():
    a = build_parser().parse_args(["up", "--nodes", "2", "--standby", "1", "--dir", "/d"])
    assert (a.action, a.nodes, a.standby, a.dir) == ("up", 2, 1, "/d")


def test_a_slurm_built_with_the_expansion_fix_declares_it_and_no_other_does():
    """cluster/lifecycle.py writes this beside slurm.conf; a job's controller reads it there
    (slurm/expansion_fix.py) and only then expands a job on the cluster's 25.11.7."""
    from trainmover.cluster.source import JOB_EXPANSION_NULL_LICENSES
    from trainmover.slurm import expansion_fix, expansion_safety
    text = specmod.render_expansion_fix("25.11.7", [JOB_EXPANSION_NULL_LICENSES.why])
    assert expansion_fix.parse(text) == ("25.11.7",)
    assert expansion_safety.expansion_verdict("25.11.7", "25.11.7" in expansion_fix.parse(text)).safe
    assert specmod.render_expansion_fix("25.11.7", []) is None           # built without the fix
    assert specmod.render_expansion_fix("25.11.7", ["another fix"]) is None
    assert specmod.render_expansion_fix("", [JOB_EXPANSION_NULL_LICENSES.why]) is None
    assert _spec().expansion_fix_file == Path("/var/tmp/tmc/etc") / expansion_fix.FILE_NAME


def test_without_job_expansion_slurm_conf_is_as_slurm_ships_it():
    """`cluster up --no-job-expansion`: a site's stock slurm.conf, where no job can grow."""
    import dataclasses
    import json
    line = next(ln for ln in specmod.render_slurm_conf(_spec()).splitlines() if ln.startswith("SchedulerParameters="))
    assert line.startswith("SchedulerParameters=permit_job_expansion,")   # the control: the default cluster
    stock = dataclasses.replace(_spec(), job_expansion=False)
    lines = specmod.render_slurm_conf(stock).splitlines()
    (params,) = [ln for ln in lines if ln.startswith("SchedulerParameters=")]
    assert params == ("SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,default_queue_depth=100,"
                      "sched_interval=5")
    assert not any("permit_job_expansion" in ln for ln in lines if not ln.startswith("#"))
    assert ClusterSpec.from_json(stock.to_json()) == stock
    assert stock.describe_slurm() == "Slurm 22.05 (host, no permit_job_expansion)"
    d = json.loads(_spec().to_json())
    del d["job_expansion"], d["unfixed"], d["node_reader"]  # a cluster.json written before these existed
    assert ClusterSpec.from_json(json.dumps(d)) == _spec()


def test_cli_cluster_options_for_a_stock_slurm_conf_and_an_unfixed_build(monkeypatch):
    monkeypatch.delenv("TM_SLURM_UNFIXED", raising=False)
    a = build_parser().parse_args(["up"])
    assert (a.job_expansion, a.slurm_unfixed, a.node_reader) == (True, False, True)  # a reader, as a site runs one
    assert build_parser().parse_args(["up", "--no-node-reader"]).node_reader is False
    a = build_parser().parse_args(["up", "--slurm", "25.11", "--no-job-expansion", "--slurm-unfixed"])
    assert (a.slurm, a.job_expansion, a.slurm_unfixed) == ("25.11", False, True)
    monkeypatch.setenv("TM_SLURM_UNFIXED", "1")
    assert build_parser().parse_args(["build", "--slurm", "25.11"]).slurm_unfixed
