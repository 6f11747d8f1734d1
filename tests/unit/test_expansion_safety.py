"""The table of Slurm releases whose slurmctld crashes on a job expansion (slurm/expansion_safety.py):
each boundary of each range, the releases nobody checked, and the admin's declaration."""
from __future__ import annotations

import pytest

from trainmover.slurm import expansion_safety as es


@pytest.mark.parametrize("release", ["22.05.8", "23.11.10", "24.11.0", "24.11.5", "24.11.7", "25.05.0",
                                     "25.05.0-0rc1", "25.05.8", "26.05.5", "26.05.6"])
def test_releases_without_the_crash_are_safe(release):
    safe, reason = es.expansion_verdict(release, declared_fixed=False)
    assert safe and reason.startswith(f"Slurm {release}: job expansion is safe")
    assert "declares" not in reason  # safe on its own, not by a declaration


@pytest.mark.parametrize("release", ["25.11.0", "25.11.0-0rc1", "25.11.3", "25.11.7",
                                     "26.05.0", "26.05.0-0rc1", "26.05.3", "26.05.4"])
def test_releases_known_to_crash_are_refused_with_the_crash_named(release):
    safe, reason = es.expansion_verdict(release, declared_fixed=False)
    assert not safe
    assert reason.startswith(f"Slurm {release}: slurmctld crashes (SIGSEGV in _valid_license_job_expansion()")
    assert "unless an admin declares the fix applied" in reason and "not known" not in reason


@pytest.mark.parametrize("release", ["25.11.8", "25.11.12", "26.11.0", "27.05.1", "26.11.0-0pre1"])
def test_releases_nobody_checked_are_refused_as_unknown(release):
    safe, reason = es.expansion_verdict(release, declared_fixed=False)
    assert not safe and ("not known to be free" in reason or "not in TrainMover's table" in reason)
    assert "unless an admin declares the fix applied" in reason


@pytest.mark.parametrize("release", ["", "25.11", "unknown", "slurm 25.11.7", "25.11.x"])
def test_a_version_not_read_is_refused(release):
    assert es.parse(release) is None
    safe, reason = es.expansion_verdict(release, declared_fixed=False)
    assert not safe and "not in TrainMover's table" in reason


@pytest.mark.parametrize("release", ["25.11.0", "25.11.7", "25.11.8", "26.05.4", "26.11.0"])
def test_the_admins_declaration_is_accepted_for_an_unsafe_or_unknown_release(release):
    safe, reason = es.expansion_verdict(release, declared_fixed=True)
    assert safe and "the site's admin declares the fix applied" in reason


def test_the_edges_of_each_range():
    """One release either side of every boundary: a shifted range fails here."""
    edges = {"25.05.8": True, "25.11.0": False, "25.11.7": False, "25.11.8": None,
             "26.05.4": False, "26.05.5": True, "26.11.0": "absent"}
    for release, want in edges.items():
        row = es.known(release)
        assert (row.safe if row is not None else "absent") == want, release


def test_the_table_is_ordered_and_its_ranges_do_not_overlap():
    rows = es.TABLE
    assert all(a.first < b.first for a, b in zip(rows, rows[1:]))
    for a, b in zip(rows, rows[1:]):
        assert a.last is not None and a.last < b.first or a.first[:2] != b.first[:2]
    assert all(row.evidence for row in rows)
