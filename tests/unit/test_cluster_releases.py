"""Which Slurm the embedded cluster runs: the supported releases, what differs in their
configuration, the root filesystem plumbing that needs no root (tests/e2e run the rest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainmover.cluster import procs, rootfs
from trainmover.cluster import spec as specmod
from trainmover.cluster.__main__ import build_parser
from trainmover.cluster.procs import ClusterError
from trainmover.cluster.releases import RELEASES, parse_version, release
from trainmover.cluster.spec import ClusterSpec, Ports


def _spec(slurm="22.05", root="") -> ClusterSpec:
    return ClusterSpec(state_dir=Path("/var/tmp/tmc"), nodes=4, standby=2,
                       ports=Ports(slurmctld=16817, slurmdbd=16819, mariadb=16306, slurmd_base=16901),
                       db_password="pw", slurm=slurm, slurm_version=f"{slurm}.5", root=root)


def test_supported_releases_and_a_clear_error_for_others():
    assert list(RELEASES) == ["22.05", "24.11", "25.11", "26.05"]
    assert release("24.11.5") is RELEASES["24.11"] and release("26.05").suite == "sid"
    assert release("25.11.7").source is not None and release("24.11").source is None
    for bad in ("23.02", "24.11.x", "", "latest"):
        with pytest.raises(ClusterError, match="supported versions: 22.05, 24.11, 25.11, 26.05"):
            release(bad)
    assert parse_version("slurm-wlm 22.05.8") == "22.05.8" and parse_version("slurm 26.05.5\n") == "26.05.5"
    assert parse_version("no version") is None


def test_accounting_only_where_the_release_needs_it():
    old = specmod.render_slurm_conf(_spec("22.05")).splitlines()
    assert "AccountingStorageType=accounting_storage/slurmdbd" in old and not any("FirstJobId" in x for x in old)
    assert specmod.render_cgroup_conf(_spec("22.05")) is None
    assert RELEASES["22.05"].accounting and "mariadb-server" in RELEASES["22.05"].packages
    for v in ("24.11", "25.11", "26.05"):
        conf = specmod.render_slurm_conf(_spec(v, root=f"/cache/{v}")).splitlines()
        assert "AccountingStorageType=accounting_storage/none" in conf
        assert not any(x.startswith(("AccountingStoragePort", "AccountingStorageHost")) for x in conf)
        assert f"FirstJobId={RELEASES[v].first_job_id}" in conf
        assert "CgroupPlugin=disabled" in specmod.render_cgroup_conf(_spec(v)).splitlines()
        assert not RELEASES[v].accounting and "mariadb-server" not in RELEASES[v].packages
        assert "libssl3t64" in RELEASES[v].root_extras
    assert len({r.first_job_id for r in RELEASES.values()}) == len(RELEASES)


def test_rate_limit_on_where_slurm_has_it():
    """rl_enable (Slurm 23.02+) at its defaults, so that every e2e test runs under it."""
    assert not any("rl_enable" in x for x in specmod.render_slurm_conf(_spec("22.05")).splitlines())
    for v in ("24.11", "26.05"):
        assert "SlurmctldParameters=rl_enable" in specmod.render_slurm_conf(_spec(v, root=f"/cache/{v}")).splitlines()


def test_spec_records_its_slurm():
    s = _spec("24.11", root="/var/cache/trainmover/rootfs/24.11")
    assert ClusterSpec.from_json(s.to_json()) == s
    assert s.describe_slurm() == "Slurm 24.11.5 (Debian trixie root filesystem /var/cache/trainmover/rootfs/24.11)"
    assert _spec().describe_slurm() == "Slurm 22.05.5 (host)"
    assert s.layout_key() != _spec("26.05").layout_key()  # another release: fresh slurmctld state
    # a cluster.json written before releases were recorded: Debian 12's 22.05 on the host
    import json
    d = json.loads(_spec().to_json())
    for k in ("slurm", "slurm_version", "root"):
        del d[k]
    assert ClusterSpec.from_json(json.dumps(d)).slurm == "22.05"
    with pytest.raises(ValueError, match="unsupported Slurm release"):
        _spec("23.02")


def test_unseen_names_what_a_process_cannot_see(tmp_path):
    """A cluster started from another checkout runs none of this one's code: up() restarts it."""
    assert rootfs.unseen(os.getpid(), [str(tmp_path), str(rootfs.CHECKOUT)]) == []
    # another process with this host's root sees what exists here, and nothing that does not
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert rootfs.unseen(child.pid, ["/nonexistent/x", str(tmp_path)]) == ["/nonexistent/x"]
    finally:
        child.kill()
        child.wait()
    assert rootfs.unseen(2 ** 22 + 7, [str(tmp_path)]) == [str(tmp_path)]  # no such process


def test_binds_leave_out_nested_paths(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    got = rootfs.binds(tmp_path / "a" / "b", tmp_path / "a", "/tmp/../proc", "/nonexistent/x")
    for wanted in ("/proc", "/sys", "/dev", "/tmp", "/var/tmp", str(rootfs.CHECKOUT), sys.base_prefix, sys.prefix,
                   str(tmp_path / "a" / "b")):
        assert any(wanted == q or wanted.startswith(q + "/") for q in got), wanted  # bound, or under a bound path
    assert all(not p.startswith(q + "/") for p in got for q in got)  # nothing twice (/tmp brings tmp_path/a)
    assert "/nonexistent/x" not in got
    assert got == rootfs.binds(tmp_path / "a", tmp_path / "a" / "b")  # same set, same order


def test_launcher_argv(tmp_path):
    argv = rootfs.launcher(tmp_path, ["/proc", "/x"], hostname="train1", hosts="/h")
    assert argv[:5] == [rootfs.install.which("unshare") or "unshare", "--uts", "--mount", "--propagation",
                        "private"]
    assert argv[5:9] == [sys.executable, "-I", "-S", str(rootfs.NODEEXEC)]
    assert argv[9:] == ["--root", str(tmp_path), "--bind", "/proc", "--bind", "/x", "--hostname", "train1",
                        "--hosts", "/h", "--"]
    assert "--uts" not in rootfs.launcher(tmp_path, [])


def test_which_in_and_links_resolved_inside_a_root(tmp_path):
    (tmp_path / "usr/sbin").mkdir(parents=True)
    (tmp_path / "etc/alternatives").mkdir(parents=True)
    (tmp_path / "usr/sbin/slurmd-wlm").write_text("")
    os.symlink("/usr/sbin/slurmd-wlm", tmp_path / "etc/alternatives/slurmd")   # absolute: inside the root
    os.symlink("/etc/alternatives/slurmd", tmp_path / "usr/sbin/slurmd")
    assert rootfs.which_in(tmp_path, "slurmd") == "/usr/sbin/slurmd" and rootfs.which_in(tmp_path, "nope") is None
    assert procs._exe_names("slurmd", str(tmp_path)) == {"slurmd", "slurmd-wlm"}


def test_owned_matches_the_state_directory_as_a_whole_path():
    """`down` of /var/tmp/c must not stop the daemons of /var/tmp/c-24.11."""
    p = subprocess.Popen(["sleep", "30"], env={"TM_CLUSTER_DIR": "/var/tmp/c-24.11", "PATH": "/usr/bin:/bin"})
    try:
        # (once seen not yet visible in /proc right after Popen returned, on a loaded machine)
        procs.wait_until("sleep to run", lambda: procs.owned(p.pid, "sleep", "/var/tmp/c-24.11"), timeout=10)
        assert procs.owned(p.pid, "sleep", "/var/tmp/c-24.11")
        assert not procs.owned(p.pid, "sleep", "/var/tmp/c")
        assert not procs.owned(p.pid, "sleep", "/var/tmp/c-24")
    finally:
        p.kill()
        p.wait()


def test_cli_slurm_options():
    a = build_parser().parse_args(["up", "--slurm", "24.11", "--rootfs-cache", "/c"])
    assert (a.slurm, a.rootfs_cache, a.rootfs) == ("24.11", "/c", False)
    assert build_parser().parse_args(["releases", "--besides-host"]).besides_host


def test_default_state_dir_per_release(monkeypatch):
    from trainmover.cluster.lifecycle import resolve_dir
    monkeypatch.delenv("TM_CLUSTER_DIR", raising=False)
    assert resolve_dir() == Path("/var/tmp/trainmover-cluster")
    assert resolve_dir(slurm="24.11.5") == Path("/var/tmp/trainmover-cluster-24.11")
    assert resolve_dir("/d", slurm="24.11") == Path("/d")
    with pytest.raises(ClusterError, match="supported versions"):
        resolve_dir(slurm="23.02")


def test_a_named_release_runs_beside_the_cluster_of_tm_cluster_dir(monkeypatch, tmp_path, capsys):
    """README order: `make demo`, `eval "$(trainmover cluster env)"` (exports TM_CLUSTER_DIR), then
    `trainmover demo --slurm 25.11`: its own directory, not the 22.05 cluster's."""
    from trainmover.cluster.lifecycle import resolve_dir
    d = tmp_path / "c"
    d.mkdir()
    (d / "cluster.json").write_text(_spec("22.05").to_json())
    monkeypatch.setenv("TM_CLUSTER_DIR", str(d))
    assert resolve_dir() == d and resolve_dir(slurm="22.05") == d
    assert resolve_dir(slurm="25.11") == Path("/var/tmp/trainmover-cluster-25.11")
    assert "holds a Slurm 22.05 cluster; Slurm 25.11 runs beside it" in capsys.readouterr().err
    assert resolve_dir(str(d), slurm="25.11") == d  # named explicitly: up() says what runs there
    monkeypatch.setenv("TM_CLUSTER_DIR", str(tmp_path / "fresh"))
    assert resolve_dir(slurm="25.11") == tmp_path / "fresh"


def test_address_blocks_one_per_cluster(tmp_path):
    """Each cluster claims its own 127.0.N.0/24; a claim whose cluster is gone or moved is reused."""
    import json

    from trainmover.cluster import netblock
    reg = tmp_path / "nets"

    def cluster(name, net=None):
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        n = netblock.claim(d, preferred=net, registry=reg)
        (d / "cluster.json").write_text(json.dumps({"net": n}))
        return d, n

    a, na = cluster("a")
    b, nb = cluster("b")
    assert (na, nb) == (1, 2)
    assert netblock.claim(a, preferred=na, registry=reg) == 1          # its own again (down/up)
    assert cluster("c", net=2)[1] == 3                                  # b holds 2
    (b / "cluster.json").unlink()                                       # b removed: its block is free
    assert cluster("d")[1] == 2
    s = _spec()
    moved = ClusterSpec.from_json(s.to_json().replace('"net": 1', '"net": 7'))
    assert [moved.addr(n) for n in moved.all_nodes][:2] == ["127.0.7.11", "127.0.7.12"]
    assert moved.layout_key() != s.layout_key()  # another block: slurmctld starts from a fresh state
    assert "NodeName=train1 NodeAddr=127.0.7.11" in specmod.render_slurm_conf(moved)
    with pytest.raises(ValueError, match="net must be 1..254"):
        ClusterSpec.from_json(s.to_json().replace('"net": 1', '"net": 255'))
