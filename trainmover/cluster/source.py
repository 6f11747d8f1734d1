"""Slurm built from SchedMD's source inside a root filesystem, for a release no Debian
suite ships (25.11: the release PyPI's pyslurm 25.11 needs).

    tarball = find_tarball(SLURM_25_11)              # $TM_SLURM_SOURCE, else ../shared/vendor
    build_in(root, SLURM_25_11, tarball, log=print)  # configure, make -j2, make install in the root

The tarball is looked for at $TM_SLURM_SOURCE (the file, or a directory holding it), else in
`../shared/vendor` beside the checkout (where CI keeps it); its SHA-256 must equal the one
pinned here (a SHA256SUMS beside it is not trusted for that: it could be edited with the
tarball). Without a local copy the error names SchedMD's download page: this module does
not download (the build machines here have no route to SchedMD).

The build runs inside the root through nodeexec (the root's gcc and headers, so its
binaries match the root's C library), at `nice 19` and `make -j2`: it takes the machine's
CPUs for minutes and must not starve what else runs there.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from trainmover import config
from trainmover.cluster.procs import ClusterError, run_cmd

CHECKOUT = Path(__file__).resolve().parents[2]
VENDOR = CHECKOUT.parent / "shared" / "vendor"
CONFIGURE_TIMEOUT = 900.0
MAKE_TIMEOUT = 5400.0  # measured 2 cores shared with other work: see docs/admin.md
SRC_DIR = "/usr/src"   # inside the root
# slurmfull (pyslurm links it) lives in <libdir>/slurm, outside the loader's default path.
LD_CONF = "etc/ld.so.conf.d/trainmover-slurm.conf"


@dataclass(frozen=True)
class Fix:
    """A change made to the source before the build, for a Slurm bug TrainMover runs into:
    why, the file, and the exact text replaced (it must occur once: a tarball that differs
    stops the build rather than being built unfixed)."""

    why: str
    path: str
    old: str
    new: str


# slurmctld 25.11.7 crashed (SIGSEGV, core in the cluster's log/) at the first job expansion the
# contract test made: `scontrol update JobId=<donor> NumNodes=0`, how grow() merges a standby.
# gdb: list_find_first_ro(l=NULL) <- _valid_license_job_expansion() job_mgr.c:12581: a job
# without licenses has no license_list, and list.c does not accept NULL.
JOB_EXPANSION_NULL_LICENSES = Fix(
    why="job expansion of jobs without licenses: NULL license_list (slurmctld SIGSEGV)",
    path="src/slurmctld/job_mgr.c",
    old="""	if (list_find_first_ro(job_ptr1->license_list, _find_hres, NULL) ||
	    list_find_first_ro(job_ptr2->license_list, _find_hres, NULL))
		return false;""",
    new="""	if ((job_ptr1->license_list &&
	     list_find_first_ro(job_ptr1->license_list, _find_hres, NULL)) ||
	    (job_ptr2->license_list &&
	     list_find_first_ro(job_ptr2->license_list, _find_hres, NULL)))
		return false;""")


@dataclass(frozen=True)
class Source:
    """One Slurm source release: the tarball's name and pinned SHA-256, SchedMD's page for
    it, and the configure options (Debian's layout: binaries in /usr, slurm.conf's default
    in /etc/slurm; the REST daemon, X11 forwarding and debug symbols left out: the cluster
    uses none and they lengthen the build)."""

    version: str
    tarball: str
    sha256: str
    url: str
    fixes: tuple[Fix, ...] = ()
    configure: tuple[str, ...] = ("--prefix=/usr", "--sysconfdir=/etc/slurm", "--disable-debug",
                                  "--disable-dependency-tracking", "--disable-slurmrestd", "--disable-x11",
                                  "--enable-silent-rules")

    @property
    def tree(self) -> str:
        return f"slurm-{self.version}"


SLURM_25_11 = Source(
    version="25.11.7", tarball="slurm-25.11.7.tar.xz",
    sha256="f71f1e5f33a72e7864104a6857e86862eac3c4e5e348c92dd0c10dbe03a82dec",
    url="https://github.com/SchedMD/slurm/archive/refs/tags/slurm-25-11-7-1.tar.gz (or schedmd.com/download)",
    fixes=(JOB_EXPANSION_NULL_LICENSES,))


def apply_fixes(tree: Path, fixes: tuple[Fix, ...]) -> list[str]:
    """Make each fix in the unpacked `tree`; returns their `why`s. ClusterError when a fix's
    text is not found exactly once."""
    for fix in fixes:
        path = tree / fix.path
        text = path.read_text()
        if text.count(fix.old) != 1:
            raise ClusterError(f"{path}: the text fixed for '{fix.why}' occurs {text.count(fix.old)} times, not once; "
                               "is this the Slurm release the fix was written for?")
        path.write_text(text.replace(fix.old, fix.new))
    return [f.why for f in fixes]


def find_tarball(src: Source, where: Optional[str] = None) -> Path:
    """The verified tarball of `src`: `where` (a file or a directory), else $TM_SLURM_SOURCE,
    else VENDOR. ClusterError naming every place looked and the checksum seen otherwise."""
    given = where if where is not None else config.setting("TM_SLURM_SOURCE")
    places = [Path(given).expanduser()] if given else [VENDOR]
    candidates = [p / src.tarball if p.is_dir() else p for p in places]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise ClusterError(
            f"Slurm {src.version} source not found (looked at {', '.join(map(str, candidates))}); download "
            f"{src.tarball} ({src.url}) and set TM_SLURM_SOURCE to its path; its SHA-256 must be {src.sha256}")
    digest = sha256_of(path)
    if digest != src.sha256:
        raise ClusterError(f"{path}: SHA-256 {digest}, expected {src.sha256} (Slurm {src.version}); "
                           "the file is damaged or another release")
    return path.absolute()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_in(root: Path, src: Source, tarball: Path, *, run_in: Callable[[list[str], str], list[str]],
             log: Callable[[str], None]) -> dict:
    """Unpack `tarball` into root/usr/src, build and install Slurm (src/ and the headers) there. `run_in(argv, cwd)`
    gives the argv that runs `argv` inside the root in `cwd` (rootfs.launcher). Returns the
    seconds of each step and the fixes made, for the root's marker."""
    t0 = time.monotonic()
    tree = root / SRC_DIR.lstrip("/") / src.tree
    shutil.rmtree(tree, ignore_errors=True)
    tree.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tf:
        tf.extractall(tree.parent, filter="data")  # no links or devices out of the tree
    if not (tree / "configure").exists():
        raise ClusterError(f"{tarball} has no {src.tree}/configure: not a Slurm release tarball")
    fixed = apply_fixes(tree, src.fixes)
    log(f"Slurm {src.version} from source: " + (f"fixed {'; '.join(fixed)}" if fixed else
                                                "as SchedMD ships it, no fixes (releases.unfixed)"))
    inside = f"{SRC_DIR}/{src.tree}"
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}
    niced = ["nice", "-n", "19"]
    # src/ (daemons, commands, plugins, libraries) and the headers only: the top level's
    # `make` also builds doc/ (HTML generated by python3, man pages) and testsuite/, which the
    # cluster never reads.
    steps = [("configure", ["./configure", *src.configure], CONFIGURE_TIMEOUT),
             ("make", ["make", "-j2", "-C", "src"], MAKE_TIMEOUT),
             ("make install", ["make", "-C", "src", "install"], CONFIGURE_TIMEOUT),
             ("headers", ["make", "install-pkgincludeHEADERS"], CONFIGURE_TIMEOUT)]
    times = {"unpack_s": round(time.monotonic() - t0, 1), "fixes": fixed}
    for name, argv, timeout in steps:
        log(f"Slurm {src.version} from source: {name} (nice 19{', 2 jobs' if name == 'make' else ''})")
        t = time.monotonic()
        proc = run_cmd(niced + run_in(argv, inside), timeout=timeout, env=env, check=False,
                       what=f"Slurm {src.version} {name}")
        if proc.returncode != 0:
            raise ClusterError(f"Slurm {src.version} {name} failed (exit {proc.returncode}) in {tree}: "
                               f"{(proc.stderr or proc.stdout)[-2000:]}")
        times[f"{name.replace(' ', '_')}_s"] = round(time.monotonic() - t, 1)
    (root / LD_CONF).write_text("/usr/lib/slurm\n")
    run_cmd(run_in(["ldconfig"], "/"), timeout=120, env=env, what="ldconfig (root filesystem)")
    shutil.rmtree(tree, ignore_errors=True)  # objects: ~1 GB the cluster never reads again
    log(f"Slurm {src.version} built and installed in {root} ({time.monotonic() - t0:.0f}s)")
    return times
