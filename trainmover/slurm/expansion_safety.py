"""Slurm releases whose slurmctld crashes on a job expansion, and the verdict for the one a
cluster runs. Pure: the release (slurmctld's own SLURM_VERSION, from `scontrol show config`)
and the admin's declaration in, (safe, reason) out.

The crash: `scontrol update JobId=<donor> NumNodes=0`, the step of `grow()` that merges a donor
into the job, reaches `_valid_license_job_expansion()` (src/slurmctld/job_mgr.c), which hands
both jobs' `license_list` to `list_find_first_ro()`. A job that asked for no licenses has no
list (NULL); list.c only xasserts against that, so a production build dereferences NULL in the
lock path: slurmctld dies with SIGSEGV, for every user of the cluster. A debug build aborts on
the xassert instead. Seen here on 25.11.7 (gdb on the core: job_mgr.c:12581); the project's own
25.11 build carries the one-line fix (cluster/source.py, JOB_EXPANSION_NULL_LICENSES).

How the table was established (2026-11-27; docs/slurm-bug-report.md says the same):
* SchedMD's git history (github.com/SchedMD/slurm, a snapshot with branches to 2026-08-20):
  `_valid_license_job_expansion()` came in commit ce4fc69aa4 (2025-03-24, "Do not allow job
  expansion with OR'd licenses"), first released in 25.05.0, with only a test of the licenses
  *string* for '|' (NULL-safe). The lookup in `license_list` came in commit 26ac6ba616
  (2025-10-01, "Block merge jobs with HRes"), first released in 25.11.0rc1. Every tag was
  read: no 20.02-24.11 tag has the function; 25.05.0-25.05.8 (and the slurm-25.05 branch on
  2026-06-05) have it without the lookup; 25.11.0rc1-25.11.7 and 26.05.0rc1-26.05.3 have the
  unguarded lookup, as do the slurm-25.11 branch (2026-08-18), slurm-26.05 (2026-08-20) and
  master (2026-08-20). A fix was proposed as GitHub pull request 202 (June 2026), unmerged then.
* The vendored 25.11.7 tarball (../shared/vendor) has the same lines (the fix's text is found
  there once: tests/unit/test_slurm_source.py).
* Debian's slurmctld binaries (sid, amd64), disassembled where the donor merge logs "cannot mix
  AND and OR licenses": 26.05.4-1 calls list_find_first_ro() on both lists untested; 26.05.5-1
  tests each list for NULL first. Debian's changelog names no patch for it, so the guard is
  most likely SchedMD's, in 26.05.5; that was not seen in SchedMD's own source (later than
  the snapshot). The project's Slurm matrix grows jobs on Debian's 26.05.5 without a crash.
Unknown, and so refused unless an admin declares the fix applied (docs/admin.md): any 25.11
release after 25.11.7, and any series after 26.05 (master still had the lookup unguarded when
last seen). Later 26.05 releases are taken to keep 26.05.5's guard.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple, Optional

Version = tuple[int, int, int]
CRASH = ("slurmctld crashes (SIGSEGV in _valid_license_job_expansion(), job_mgr.c) at every job expansion "
         "of a job without licenses, the merge TrainMover makes to take a standby")


@dataclass(frozen=True)
class Known:
    """Releases first..last (inclusive; last None: the rest of first's series) and what is
    known of their job expansion: safe True, known to crash False, not checked None."""

    first: Version
    last: Optional[Version]
    safe: Optional[bool]
    evidence: str

    def holds(self, v: Version) -> bool:
        if v < self.first:
            return False
        if self.last is None:
            return v[:2] == self.first[:2]
        return v <= self.last


TABLE: tuple[Known, ...] = (
    Known((0, 0, 0), (25, 5, 999), True,
          "no lookup in a job's license list on expansion before 25.11 (SchedMD's tags 20.02-25.05.8 read)"),
    Known((25, 11, 0), (25, 11, 7), False, "SchedMD's 25.11.0rc1-25.11.7 source; the crash seen on 25.11.7"),
    Known((25, 11, 8), None, None, "no 25.11 release after 25.11.7 checked (the 25.11 branch was unfixed on 2026-08-18)"),
    Known((26, 5, 0), (26, 5, 4), False, "SchedMD's 26.05.0rc1-26.05.3 source and Debian's 26.05.4 binary"),
    Known((26, 5, 5), None, True, "Debian's 26.05.5 slurmctld tests the license list first (disassembled)"),
)

_VERSION = re.compile(r"^\s*(\d+)\.(\d+)\.(\d+)(\S*)\s*$")


def parse(release: str) -> Optional[Version]:
    """'25.11.7' -> (25, 11, 7); a pre-release ('25.11.0-0rc1') counts as its release; None
    for anything else ('', '25.11', 'unknown')."""
    m = _VERSION.match(release or "")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def known(release: str) -> Optional[Known]:
    """The table's row for `release`; None when it is not parsed or not in the table (a later series)."""
    v = parse(release)
    return next((row for row in TABLE if row.holds(v)), None) if v is not None else None


class Verdict(NamedTuple):
    safe: bool
    reason: str


def expansion_verdict(release: str, declared_fixed: bool) -> Verdict:
    """Whether TrainMover may expand a job on slurmctld `release`, and why, in one line.
    `declared_fixed`: the site's admin declares this very release fixed (slurm/expansion_fix.py)."""
    row = known(release)
    shown = release or "of unknown version"
    if row is not None and row.safe:
        return Verdict(True, f"Slurm {shown}: job expansion is safe ({row.evidence})")
    if declared_fixed:
        what = "known to crash" if row is not None and row.safe is False else "not known to be safe"
        return Verdict(True, f"Slurm {shown} is {what} on job expansion, but the site's admin declares the fix "
                             "applied to it (docs/admin.md)")
    if row is not None:  # safe False or None
        said = CRASH if row.safe is False else f"not known to be free of the 25.11/26.05 crash: {CRASH}"
        return Verdict(False, f"Slurm {shown}: {said} ({row.evidence}); TrainMover will not expand jobs there "
                              "unless an admin declares the fix applied (docs/admin.md)")
    return Verdict(False, f"Slurm {shown} is not in TrainMover's table of releases checked for the job-expansion "
                          f"crash of 25.11.0-25.11.7 and 26.05.0-26.05.4 ({CRASH}); TrainMover will not expand jobs "
                          "there unless an admin declares the fix applied (docs/admin.md)")
