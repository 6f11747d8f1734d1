"""The Slurm releases the embedded cluster runs, and what differs between them in its
configuration. Pure: no processes (trainmover/cluster/rootfs.py finds or builds a Slurm;
trainmover/slurm/ handles the differences in how Slurm is called and what it prints).

    release("24.11.5")   -> Release(version="24.11", suite="trixie", accounting=False, ...)
    release("25.11").source  -> Source(version="25.11.7", ...): no Debian suite ships it; built from source
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Optional

from trainmover.cluster.procs import ClusterError
from trainmover.cluster.source import SLURM_25_11, Source


@dataclass(frozen=True)
class Release:
    """A Slurm major release and the Debian suite that ships it.

    `accounting`: slurmdbd (with MariaDB) is needed. Slurm 22.05 resizes a job only once
    without it (every later update: "DB index is being set"); 24.11 and 26.05 grew, shrank
    and grew the same job again with `accounting_storage/none` (and slurmdbd 24.11 dies at
    start against Debian 13's MariaDB 11.8), so they run without it.
    `cgroup_disabled`: slurmd needs `cgroup.conf` with `CgroupPlugin=disabled` (24.11 and
    later stop at start otherwise: "Unable to initialize cgroup plugin"; 22.05 has no such
    value and runs without a cgroup.conf).
    `first_job_id`: where the cluster's job ids start. Demos of several releases run from
    one checkout, each job writing runs/<job id> there; a controller refuses a run
    directory another job's controller used, so each release counts from its own
    number (24.11: 24110001, ...; 22.05 from 1, as always).
    `source`: built from SchedMD's source inside a root filesystem of `suite` (source.py),
    not installed from the suite's packages; never the host's Slurm."""

    version: str
    suite: str
    accounting: bool
    cgroup_disabled: bool
    first_job_id: int = 1
    source: Optional[Source] = None
    variant: str = ""  # "unfixed": built without source.fixes (unfixed()); its own root filesystem

    @property
    def root_name(self) -> str:
        """The root filesystem's directory in the cache: a variant never shares the release's."""
        return f"{self.version}-{self.variant}" if self.variant else self.version

    @property
    def packages(self) -> list[str]:
        """Debian packages for the cluster's Slurm: daemons, client commands, munge, the headers
        for the SPANK plugin; MariaDB and slurmdbd where accounting is needed. From source:
        munge and what Slurm's configure needs to build its munge authentication."""
        if self.source is not None:
            return ["munge", "libmunge-dev", "pkg-config"]
        pkgs = ["slurm-wlm", "munge", "libslurm-dev", "slurm-wlm-basic-plugins-dev"]
        if self.accounting:
            pkgs += ["slurmdbd", "mariadb-server", "mariadb-client"]
        return pkgs

    @property
    def root_extras(self) -> list[str]:
        """What a root filesystem adds: the compiler for the SPANK plugin, and shared libraries
        for the host's Python interpreter (its extension modules) and the virtual environment's
        wheels (torch: libstdc++, libgomp)."""
        t64 = self.suite != "bookworm"  # Debian 13 renamed these for 64-bit time_t
        return ["gcc", "make", "libc6-dev", "libstdc++6", "libgomp1", "zlib1g", "libffi8", "libbz2-1.0", "liblzma5", "libsqlite3-0",
                "libexpat1", "libuuid1", "libncursesw6", "libssl3t64" if t64 else "libssl3",
                "libreadline8t64" if t64 else "libreadline8", "hostname", "procps"]


RELEASES = {
    "22.05": Release("22.05", "bookworm", accounting=True, cgroup_disabled=False),
    "24.11": Release("24.11", "trixie", accounting=False, cgroup_disabled=True, first_job_id=24110001),
    "25.11": Release("25.11", "trixie", accounting=False, cgroup_disabled=True, first_job_id=25110001,
                     source=SLURM_25_11),
    "26.05": Release("26.05", "sid", accounting=False, cgroup_disabled=True, first_job_id=26050001),
}

_VERSION = re.compile(r"\b(\d+\.\d+)(\.\d+)?\b")


def parse_version(text: str) -> Optional[str]:
    """The first Slurm version in `text`: 'slurm-wlm 22.05.8' -> '22.05.8'."""
    m = _VERSION.search(text or "")
    return m.group(0) if m else None


def unfixed(rel: Release) -> Release:
    """`rel` built from SchedMD's source as it is, without the fixes TrainMover makes to it
    (source.py): for tests that show TrainMover never triggers the bug a fix is for (25.11.7's
    slurmctld crashes at every job expansion). ClusterError for a release with no fixes to leave out."""
    if rel.source is None or not rel.source.fixes:
        raise ClusterError(f"Slurm {rel.version} is not built from source with fixes: nothing to leave out "
                           f"(only {', '.join(r.version for r in RELEASES.values() if r.source and r.source.fixes)})")
    return dataclasses.replace(rel, source=dataclasses.replace(rel.source, fixes=()), variant="unfixed")


def release(version: str) -> Release:
    """The supported release of `version` ('24.11' or '24.11.5'); ClusterError naming the
    supported versions otherwise."""
    m = _VERSION.fullmatch(str(version).strip())
    if m is None or m.group(1) not in RELEASES:
        raise ClusterError(f"Slurm {version} is not supported by the embedded cluster; supported versions: "
                           f"{', '.join(RELEASES)}")
    return RELEASES[m.group(1)]
