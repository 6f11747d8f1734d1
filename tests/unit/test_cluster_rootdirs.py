"""Root's state directories (trainmover/cluster/rootdirs.py): what another local user can plant
under /var/tmp before root's `cluster up`, `demo` or user set-up (a link, a directory of theirs,
a directory others can write, a cluster.json of theirs) is refused with a clear message, and
nothing is created or written through a link. Negative control in each: root's own directory
(0700, or 0755 where users pass through) is accepted and used."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from trainmover.cluster import lifecycle, netblock, rootdirs, users
from trainmover.cluster.procs import ClusterError, flocked
from trainmover.cluster.spec import ClusterSpec, Ports

OTHER_UID = 65534  # nobody: "another user" where the test runs as root
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's needs root")


def _spec(state_dir: Path, root: str = "") -> ClusterSpec:
    return ClusterSpec(state_dir=state_dir, nodes=2, standby=1, ports=Ports(6817, 6819, 3306, 7000),
                       db_password="secret-pw", root=root)


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def _planted(tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """(where root's directory should be, where the planting user wants root to write)."""
    target = tmp_path / "users-own"
    target.mkdir()
    where = tmp_path / "state"
    if kind == "link":
        where.symlink_to(target)
    elif kind == "other-user":
        where.mkdir(mode=0o700)
        os.chown(where, OTHER_UID, OTHER_UID)
    elif kind == "writable":
        where.mkdir()
        where.chmod(0o777)
    return where, target


# --- the cluster's state directory -------------------------------------------------------------

@as_root
@pytest.mark.parametrize("kind, says", [("link", "is a symbolic link"),
                                        ("other-user", f"belongs to uid {OTHER_UID}"),
                                        ("writable", "is writable by group or others")])
def test_a_planted_state_directory_is_refused_and_nothing_is_made_through_it(tmp_path, kind, says):
    where, target = _planted(tmp_path, kind)
    if kind != "link":  # the planting user's cluster.json, naming their own root filesystem
        (where / "cluster.json").write_text(_spec(where, root=str(target)).to_json())
    for attempt in (lambda: lifecycle._locked(where).__enter__(), lambda: lifecycle._load_spec(where),
                    lambda: lifecycle.down(where), lambda: lifecycle.status(where)):
        with pytest.raises(rootdirs.UnsafeDir) as err:
            attempt()
        msg = str(err.value)
        assert str(where) in msg and says in msg and "owner uid" in msg and "mode" in msg and "remove it" in msg
    assert not (where / ".lock").exists() and os.listdir(target) == []


def test_a_proper_state_directory_is_made_root_0700_and_used(tmp_path):
    """Negative control: root's own directory, made here, or one made before (0755 after
    _write_files opened it for the users' jobs), is accepted; the lock is 0600."""
    where = tmp_path / "state"
    with lifecycle._locked(where):
        pass
    assert _mode(where) == 0o700 and os.lstat(where).st_uid == os.geteuid()
    assert _mode(where / ".lock") == 0o600
    where.chmod(0o755)
    with lifecycle._locked(where):
        pass
    assert lifecycle._load_spec(where) is None  # no cluster.json yet: no cluster


def test_cluster_json_is_0600_and_believed_only_when_root_wrote_it(tmp_path):
    where = rootdirs.own_dir(tmp_path / "state")
    spec = _spec(where, root="/var/cache/trainmover/rootfs/24.11")
    lifecycle._save_spec(spec)
    assert _mode(where / "cluster.json") == 0o600  # it holds the database password
    assert lifecycle._load_spec(where) == spec     # negative control: root's own file is believed
    (where / "cluster.json").chmod(0o666)
    with pytest.raises(rootdirs.UnsafeDir, match="could have been written by another user"):
        lifecycle._load_spec(where)
    (where / "cluster.json").unlink()
    evil = tmp_path / "evil.json"
    evil.write_text(_spec(where, root="/home/evil/root").to_json())
    (where / "cluster.json").symlink_to(evil)
    with pytest.raises(rootdirs.UnsafeDir, match="is a symbolic link"):
        lifecycle._load_spec(where)


@as_root
def test_a_cluster_json_of_another_user_is_not_believed(tmp_path):
    where = rootdirs.own_dir(tmp_path / "state")
    (where / "cluster.json").write_text(_spec(where, root="/home/evil/root").to_json())
    os.chown(where / "cluster.json", OTHER_UID, OTHER_UID)
    with pytest.raises(rootdirs.UnsafeDir, match=f"owner uid {OTHER_UID}"):
        lifecycle._load_spec(where)


def test_a_planted_lock_link_is_not_followed(tmp_path):
    where = rootdirs.own_dir(tmp_path / "state")
    victim = tmp_path / "victim"
    (where / ".lock").symlink_to(victim)
    with pytest.raises(ClusterError, match="symbolic link there is refused"):
        with flocked(where / ".lock", 1, "test"):
            pass
    assert not victim.exists()  # the old open(path, "a") created it, as root


@as_root
def test_a_state_directory_under_another_users_directory_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(rootdirs.UnsafeDir, match=f"{theirs} \\(above .*\\) belongs to another user"):
        rootdirs.own_dir(theirs / "sub" / "state")
    assert os.listdir(theirs) == []  # refused before anything was made in it
    group_writable = tmp_path / "gw"
    group_writable.mkdir()
    group_writable.chmod(0o775)
    with pytest.raises(rootdirs.UnsafeDir, match="writable by group or others and not sticky"):
        rootdirs.own_dir(group_writable / "state")
    sticky = tmp_path / "sticky"  # like /var/tmp: others cannot rename root's directory away
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert rootdirs.own_dir(sticky / "state") == sticky / "state"


# --- the address-block registry, the users' homes, the demo's directory -------------------------

@as_root
@pytest.mark.parametrize("kind", ["link", "other-user", "writable"])
def test_a_planted_registry_is_refused(tmp_path, kind):
    reg, target = _planted(tmp_path, kind)
    cluster = rootdirs.own_dir(tmp_path / "c")
    with pytest.raises(rootdirs.UnsafeDir, match=str(reg)):
        netblock.claim(cluster, registry=reg)
    assert os.listdir(target) == []


def test_a_claim_counts_only_for_root_written_cluster_json(tmp_path):
    reg = tmp_path / "nets"
    a = rootdirs.own_dir(tmp_path / "a")
    assert netblock.claim(a, registry=reg) == 1
    assert _mode(reg) == 0o700
    (a / "cluster.json").write_text(json.dumps({"net": 1}))
    b = rootdirs.own_dir(tmp_path / "b")
    assert netblock.claim(b, registry=reg) == 2          # negative control: a's claim holds
    (a / "cluster.json").chmod(0o666)                    # a's file now writable by anyone
    assert netblock.claim(b, preferred=1, registry=reg) == 1  # not believed: a's block taken over


@as_root
@pytest.mark.parametrize("kind", ["link", "other-user", "writable"])
def test_a_planted_homes_directory_is_refused(tmp_path, kind, monkeypatch):
    homes, target = _planted(tmp_path, kind)
    monkeypatch.setattr(users, "HOMES", homes)
    acct = users.Account("tmuser", OTHER_UID, OTHER_UID, str(homes / "tmuser"))
    with pytest.raises(rootdirs.UnsafeDir, match=str(homes)):
        users._ensure_home(acct)
    assert os.listdir(target) == []


@as_root
def test_homes_made_root_0755_and_the_home_the_users(tmp_path, monkeypatch):
    """Negative control: root's HOMES (0755, the users pass through it) and the user's 0700 home."""
    homes = tmp_path / "homes"
    monkeypatch.setattr(users, "HOMES", homes)
    acct = users.Account("tmuser", OTHER_UID, OTHER_UID, str(homes / "tmuser"))
    users._ensure_home(acct)
    assert _mode(homes) == 0o755 and os.lstat(homes).st_uid == 0
    home = os.lstat(homes / "tmuser")
    assert stat.S_IMODE(home.st_mode) == 0o700 and home.st_uid == OTHER_UID
    users._ensure_home(acct)  # again: accepted as it is


@as_root
def test_a_planted_demo_directory_is_refused(tmp_path, monkeypatch):
    from trainmover import demo
    where, target = _planted(tmp_path, "link")
    monkeypatch.setattr(demo, "DEMO_DIR", where)
    monkeypatch.setattr(users, "host_account", lambda name: users.Account(name, OTHER_UID, OTHER_UID, "/h"))
    with pytest.raises(rootdirs.UnsafeDir, match="is a symbolic link"):
        demo._submit_dir("tmuser")
    assert os.listdir(target) == []
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path / "demo")  # negative control: root's own
    d = demo._submit_dir("tmuser")
    assert _mode(tmp_path / "demo") == 0o755 and os.lstat(d).st_uid == OTHER_UID
