"""The embedded cluster's ordinary users (trainmover/cluster/users.py): ids, and copying them
into a root filesystem at the host's uid and gid."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainmover.cluster import users
from trainmover.cluster.procs import ClusterError


def _root(tmp_path: Path, passwd: str, group: str) -> Path:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/passwd").write_text(passwd)
    (tmp_path / "etc/group").write_text(group)
    (tmp_path / "etc/shadow").write_text("")
    (tmp_path / "etc/gshadow").write_text("")
    return tmp_path


def test_free_id_skips_taken_ids_downwards():
    assert users.free_id({940, 939, 100}) == 938
    assert users.free_id(set()) == users.PREFERRED_UID
    with pytest.raises(ClusterError, match="no free system id"):
        users.free_id(range(500, 941))


def test_the_names_are_constants_other_tests_import():
    assert (users.JOB_USER, users.OTHER_USER) == ("tmuser", "tmother")


def test_a_uid_taken_by_another_name_in_the_root_is_an_error_not_another_uid(tmp_path):
    root = _root(tmp_path, "root:x:0:0::/root:/bin/sh\nslurm:x:940:940::/:/bin/false\n", "root:x:0:\nslurm:x:940:\n")
    with pytest.raises(ClusterError, match="uid 940 of tmuser is taken by slurm"):
        users.ensure_root(root, [users.Account("tmuser", 940, 940, "/var/tmp/trainmover-users/tmuser")])


def test_a_name_with_another_uid_in_the_root_is_an_error(tmp_path):
    root = _root(tmp_path, "tmuser:x:1001:1001::/:/bin/false\n", "tmuser:x:1001:\n")
    with pytest.raises(ClusterError, match="uid 1001 in .* but 940 on the host"):
        users.ensure_root(root, [users.Account("tmuser", 940, 940, "/x")])


@pytest.mark.skipif(os.geteuid() != 0 or not users.install.which("useradd"), reason="useradd --root needs root")
def test_users_are_copied_into_a_root_at_the_hosts_ids_once(tmp_path):
    root = _root(tmp_path, "root:x:0:0::/root:/bin/sh\n", "root:x:0:\n")
    accts = [users.Account("tmuser", 940, 940, "/var/tmp/trainmover-users/tmuser"),
             users.Account("tmother", 939, 939, "/var/tmp/trainmover-users/tmother")]
    users.ensure_root(root, accts)
    users.ensure_root(root, accts)  # idempotent: nothing added twice
    passwd = (root / "etc/passwd").read_text()
    assert [l.split(":")[0] for l in passwd.splitlines()].count("tmuser") == 1 and "tmuser:x:940:940:" in passwd and "tmother:x:939:939:" in passwd
    assert "tmuser:x:940:" in (root / "etc/group").read_text()


def test_a_command_as_a_user_goes_through_the_choke_point_with_runuser():
    import subprocess

    from trainmover.slurm import commands
    seen = []

    def runner(argv, timeout, env):
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0, "42\n", "")

    with commands.intercept(runner):
        commands.run(["sbatch", "--parsable", "x.sh"], timeout=5, env={"SLURM_CONF": "/nonexistent"}, user="tmuser")
    assert seen == [["runuser", "-u", "tmuser", "--", "sbatch", "--parsable", "x.sh"]]
