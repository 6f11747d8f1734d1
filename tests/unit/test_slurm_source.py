"""Slurm built from source (trainmover/cluster/source.py): the tarball is found where the
user or CI put it and refused unless its SHA-256 is the pinned one; the release that needs
it never runs from the host's packages. The build itself: `make slurm-matrix` (25.11)."""
from __future__ import annotations

import hashlib

import pytest

from trainmover.cluster import rootfs, source
from trainmover.cluster.procs import ClusterError
from trainmover.cluster.releases import RELEASES, release
from trainmover.cluster.source import Source, find_tarball


def _src(tmp_path, body: bytes = b"slurm source") -> Source:
    (tmp_path / "slurm-1.2.3.tar.xz").write_bytes(body)
    return Source(version="1.2.3", tarball="slurm-1.2.3.tar.xz", sha256=hashlib.sha256(body).hexdigest(),
                  url="https://example.invalid/slurm-1.2.3")


def test_tarball_from_a_directory_or_a_file_and_the_variable(tmp_path, monkeypatch):
    src = _src(tmp_path)
    assert find_tarball(src, str(tmp_path)) == tmp_path / "slurm-1.2.3.tar.xz"
    assert find_tarball(src, str(tmp_path / "slurm-1.2.3.tar.xz")) == tmp_path / "slurm-1.2.3.tar.xz"
    monkeypatch.setenv("TM_SLURM_SOURCE", str(tmp_path))
    assert find_tarball(src) == tmp_path / "slurm-1.2.3.tar.xz"


def test_a_missing_or_altered_tarball_is_refused_with_what_to_do(tmp_path, monkeypatch):
    src = _src(tmp_path)
    with pytest.raises(ClusterError, match=r"not found \(looked at .*nowhere.*\).*TM_SLURM_SOURCE.*" + src.sha256):
        find_tarball(src, str(tmp_path / "nowhere"))
    (tmp_path / "slurm-1.2.3.tar.xz").write_bytes(b"slurm source, altered")
    with pytest.raises(ClusterError, match=f"SHA-256 [0-9a-f]{{64}}, expected {src.sha256}"):
        find_tarball(src, str(tmp_path))
    monkeypatch.delenv("TM_SLURM_SOURCE", raising=False)
    assert source.VENDOR.name == "vendor" and source.VENDOR.parent.name == "shared"  # CI: ../shared/vendor


def test_the_source_release_is_pinned_and_never_the_hosts(monkeypatch, tmp_path):
    rel = release("25.11")
    assert rel.source.sha256 == "f71f1e5f33a72e7864104a6857e86862eac3c4e5e348c92dd0c10dbe03a82dec"
    assert rel.suite == "trixie" and "libmunge-dev" in rel.packages and "slurm-wlm" not in rel.packages
    assert "--prefix=/usr" in rel.source.configure and "--sysconfdir=/etc/slurm" in rel.source.configure
    # A trixie host without Slurm runs 24.11 from its packages, never 25.11.
    monkeypatch.setattr(rootfs, "host_version", lambda: None)
    monkeypatch.setattr(rootfs, "host_suite", lambda: "trixie")
    assert rootfs.host_release() == "24.11"
    built = []
    monkeypatch.setattr(rootfs, "ensure_built", lambda rel, cache, log: built.append(rel.version) or tmp_path)
    monkeypatch.setattr(rootfs, "built", lambda root: {"slurm": "25.11.7"})
    assert rootfs.locate("25.11", cache=tmp_path, log=print) == ("25.11", "25.11.7", str(tmp_path), False)
    assert built == ["25.11"] and RELEASES["25.11"].first_job_id == 25110001


def test_fixes_apply_once_or_stop_the_build(tmp_path):
    f = tmp_path / "src" / "x.c"
    f.parent.mkdir()
    f.write_text("a();\n\tif (list_find(l))\n\t\treturn;\nb();\n")
    fix = source.Fix(why="NULL list", path="src/x.c", old="\tif (list_find(l))", new="\tif (l && list_find(l))")
    assert source.apply_fixes(tmp_path, (fix,)) == ["NULL list"]
    assert "\tif (l && list_find(l))\n" in f.read_text()
    with pytest.raises(ClusterError, match="'NULL list' occurs 0 times, not once"):
        source.apply_fixes(tmp_path, (fix,))  # applied already / another release: not silently skipped


def test_the_25_11_fix_matches_the_vendored_source():
    """The job-expansion fix's text is in the 25.11.7 tarball once (where CI keeps it)."""
    import tarfile
    try:
        path = find_tarball(source.SLURM_25_11)
    except ClusterError as exc:
        pytest.skip(f"no Slurm 25.11.7 tarball here: {exc}")
    fix = source.JOB_EXPANSION_NULL_LICENSES
    with tarfile.open(path) as tf:
        text = tf.extractfile(f"slurm-25.11.7/{fix.path}").read().decode()
    assert text.count(fix.old) == 1 and fix in source.SLURM_25_11.fixes


def test_an_unfixed_build_is_a_variant_with_no_fixes_in_a_root_of_its_own(tmp_path, monkeypatch):
    """`cluster up --slurm 25.11 --slurm-unfixed`: SchedMD's 25.11.7 as shipped (its slurmctld
    crashes at every job expansion), never in the fixed build's root filesystem."""
    from trainmover.cluster.releases import unfixed
    fixed = release("25.11")
    plain = unfixed(fixed)
    assert plain.source.fixes == () and plain.variant == "unfixed" and plain.root_name == "25.11-unfixed"
    assert fixed.source.fixes == (source.JOB_EXPANSION_NULL_LICENSES,) and fixed.root_name == "25.11"  # untouched
    assert plain.source.sha256 == fixed.source.sha256 and plain.version == "25.11"
    with pytest.raises(ClusterError, match="not built from source with fixes: nothing to leave out"):
        unfixed(release("24.11"))
    # the build choice: locate hands ensure_built the variant, whose root is its own
    asked = []
    monkeypatch.setattr(rootfs, "ensure_built", lambda rel, cache, log: asked.append(rel) or cache / rel.root_name)
    monkeypatch.setattr(rootfs, "built", lambda root: {"slurm": "25.11.7"})
    assert rootfs.locate("25.11", cache=tmp_path, log=print, unfixed=True) == (
        "25.11", "25.11.7", str(tmp_path / "25.11-unfixed"), False)
    assert rootfs.locate("25.11", cache=tmp_path, log=print) == ("25.11", "25.11.7", str(tmp_path / "25.11"), False)
    assert [r.source.fixes for r in asked] == [(), fixed.source.fixes]
    with pytest.raises(ClusterError, match="needs the release named"):
        rootfs.locate(None, cache=tmp_path, log=print, unfixed=True)


def test_a_built_unfixed_root_is_found_under_its_own_name(tmp_path):
    import json

    from trainmover.cluster.releases import unfixed
    plain = unfixed(release("25.11"))
    root = tmp_path / "25.11-unfixed"
    root.mkdir()
    (root / rootfs.MARKER).write_text(json.dumps({"slurm": "25.11.7", "packages": plain.packages + plain.root_extras,
                                                  "source_build": {"fixes": []}}))
    assert rootfs.ensure_built(plain, tmp_path, log=print) == root   # complete: nothing is built
    assert not (tmp_path / "25.11").exists()


def test_a_running_cluster_is_reused_only_when_fixed_or_not_as_asked():
    import dataclasses
    from pathlib import Path

    from trainmover.cluster.lifecycle import _same_slurm
    from trainmover.cluster.spec import ClusterSpec, Ports
    spec = ClusterSpec(state_dir=Path("/d"), nodes=2, standby=1, ports=Ports(1, 2, 3, 4), db_password="pw",
                       slurm="25.11", slurm_version="25.11.7", root="/c/25.11")
    plain = dataclasses.replace(spec, unfixed=True, root="/c/25.11-unfixed")
    assert _same_slurm(spec, "25.11", False) and not _same_slurm(spec, "25.11", False, unfixed=True)
    assert _same_slurm(plain, "25.11", False, unfixed=True) and not _same_slurm(plain, "25.11", False)
    assert _same_slurm(plain, None, False) and not _same_slurm(spec, None, False, unfixed=True)
