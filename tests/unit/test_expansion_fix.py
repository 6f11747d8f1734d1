"""The admin's declaration that slurmctld carries the job-expansion fix (slurm/expansion_fix.py):
where it is looked for, what it says, and that only a file of root's alone is believed."""
from __future__ import annotations

import os

from trainmover.config import Config
from trainmover.slurm import expansion_fix as ef

ME = (os.geteuid(),)  # the tests' files are their own: trusted as root's would be


def _stat(uid: int, mode: int) -> os.stat_result:
    return os.stat_result((0o100000 | mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


def test_it_is_looked_for_beside_slurm_conf_unless_told_otherwise():
    assert ef.location("auto", "/site/etc/slurm.conf") == ef.Path("/site/etc") / ef.FILE_NAME
    assert ef.location("auto", None) == ef.Path("/etc/slurm") / ef.FILE_NAME
    assert ef.location("/opt/fix", "/site/etc/slurm.conf") == ef.Path("/opt/fix")
    assert ef.location("off", "/site/etc/slurm.conf") is None
    assert Config().slurm_expansion_fix == "auto"
    assert Config.from_env({"TM_SLURM_EXPANSION_FIX": "off"}).slurm_expansion_fix == "off"


def test_releases_one_a_line_with_comments():
    assert ef.parse("# patched 2026-11-27\n25.11.7\n\n  26.05.4  # also\n25.11.7\n") == ("25.11.7", "26.05.4")


def test_a_root_only_file_declares_exactly_the_releases_it_names(tmp_path):
    f = tmp_path / ef.FILE_NAME
    f.write_text("25.11.7\n")
    os.chmod(f, 0o644)
    os.chmod(tmp_path, 0o755)
    d = ef.read(f, owners=ME)
    assert d.releases == ("25.11.7",) and d.ignored == "" and d.covers("25.11.7")
    assert not d.covers("25.11.8") and not d.covers("")   # an upgrade does not inherit it
    assert "declares 25.11.7 fixed, not this release" in d.note()


def test_a_file_others_could_write_is_ignored_with_the_reason(tmp_path):
    f = tmp_path / ef.FILE_NAME
    f.write_text("25.11.7\n")
    os.chmod(tmp_path, 0o755)
    os.chmod(f, 0o666)
    d = ef.read(f, owners=ME)
    assert d.releases == () and "group or others may write it (mode 666)" in d.ignored
    assert not d.covers("25.11.7") and d.note().startswith(f"the declaration {f} was ignored")
    os.chmod(f, 0o644)
    os.chmod(tmp_path, 0o777)  # a directory anyone may write: the file could be swapped
    assert "its directory" in ef.read(f, owners=ME).ignored
    os.chmod(tmp_path, 0o755)
    assert ef.read(f, owners=ME).covers("25.11.7")  # the control: the same file, trusted


def test_another_users_file_a_link_and_a_missing_file(tmp_path):
    assert ef.untrusted(_stat(1000, 0o644)) == "it belongs to uid 1000, not root"
    assert ef.untrusted(_stat(0, 0o644)) == ""
    os.chmod(tmp_path, 0o755)
    real = tmp_path / "real"
    real.write_text("25.11.7\n")
    link = tmp_path / ef.FILE_NAME
    link.symlink_to(real)
    assert ef.read(link, owners=ME).ignored.startswith("not opened")
    assert ef.read(tmp_path / "absent", owners=ME) == ef.Declaration()
    assert ef.read(None) == ef.Declaration() and ef.Declaration().note() == ""
    big = tmp_path / "big"
    big.write_text("25.11.7\n" * 1000)
    assert "longer than" in ef.read(big, owners=ME).ignored
