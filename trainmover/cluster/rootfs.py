"""Which Slurm an embedded cluster runs, and the Debian root filesystems that provide
a Slurm the host does not have.

    host_version()                         # "22.05.8", or None without a host Slurm
    locate("24.11", cache=..., log=...)    # ("24.11", "24.11.5", "/var/cache/trainmover/rootfs/24.11", False)
    root = ensure_built(release("24.11"), cache, log=...)   # built once, then reused
    prefix = launcher(root, binds(state_dir))                # argv prefix that runs a program inside it

A root filesystem is `debootstrap --variant=minbase <suite>` from Debian's archive plus
Slurm, munge, gcc and the shared libraries the host's Python interpreter and its
packages load. It is built once into the cache directory (under a lock, renamed into
place only when complete, marked by `.trainmover-rootfs.json`) and reused by every
cluster of that version. Programs run in it through nodeexec.py in a private mount
namespace: /proc, /sys, /dev, /tmp, /var/tmp, the state directory, the checkout and
the interpreter are bind-mounted at their own paths there, so the same paths work
inside and out, and no mount outlives the processes that use it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from trainmover import config
from trainmover.cluster import install, rootdirs, source
from trainmover.cluster.procs import ClusterError, flocked, run_cmd
from trainmover.cluster.releases import RELEASES, Release, parse_version, release
from trainmover.cluster.releases import unfixed as releases_unfixed

DEFAULT_CACHE = "/var/cache/trainmover/rootfs"
MIRROR = "http://deb.debian.org/debian"
MARKER = ".trainmover-rootfs.json"
NODEEXEC = Path(__file__).with_name("nodeexec.py")
CHECKOUT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT = 1200.0
# apt inside a root: Debian unstable's Release file can read as expired in an archive
# snapshot; packages are still checked against the archive's signed checksums.
APT_OPTS = ["-o", "Acquire::Check-Valid-Until=false", "-o", "Acquire::Retries=3", "-o", "APT::Sandbox::User=root"]


def host_version() -> Optional[str]:
    """The host's Slurm version (slurmd -V: the daemons the cluster would run), or None."""
    slurmd = install.which("slurmd")
    if slurmd is None:
        return None
    proc = run_cmd([slurmd, "-V"], timeout=30, what="slurmd -V", check=False)
    return parse_version(proc.stdout + proc.stderr)


def host_suite() -> Optional[str]:
    """The host's Debian codename (VERSION_CODENAME in /etc/os-release), or None."""
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return None
    m = re.search(r"^VERSION_CODENAME=\"?([a-z]+)\"?$", text, re.M)
    return m.group(1) if m else None


def resolve_cache(cache: Optional[os.PathLike | str] = None) -> Path:
    """The root filesystem cache: the argument, else $TM_ROOTFS_CACHE, else /var/cache/trainmover/rootfs."""
    d = cache if cache is not None else config.setting("TM_ROOTFS_CACHE") or DEFAULT_CACHE
    return Path(d).expanduser().absolute()


def built(root: Path) -> Optional[dict]:
    """The marker of a complete root filesystem, or None."""
    try:
        return json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None


# --- running programs inside a root --------------------------------------------------

def binds(*extra: os.PathLike | str) -> list[str]:
    """Host paths shown at the same path inside a root: the kernel's file systems, the
    temporary directories (job working directories of tests), the checkout, the
    interpreter (venv and base installation) and `extra` (a state directory). Paths
    under another bound path are left out (the recursive bind brings them)."""
    wanted = ["/proc", "/sys", "/dev", "/tmp", "/var/tmp", str(CHECKOUT), sys.prefix, sys.base_prefix,
              os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))), *map(str, extra)]
    out: list[str] = []
    for p in sorted({os.path.normpath(os.path.abspath(w)) for w in wanted}, key=lambda q: (len(q), q)):
        if p != "/" and os.path.exists(p) and not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    return out


def unseen(pid: int, paths: Sequence[str]) -> list[str]:
    """Those of `paths` that process `pid` (a node's slurmd inside a root) cannot see: a
    cluster started from another checkout or interpreter runs none of this one's code."""
    def same(p: str) -> bool:  # the host's own directory there, not an empty mount point
        try:
            inside, host = os.stat(f"/proc/{pid}/root{p}"), os.stat(p)
        except OSError:
            return False
        return (inside.st_dev, inside.st_ino) == (host.st_dev, host.st_ino)
    return [p for p in paths if not same(p)]


def launcher(root: Path, bind_paths: Sequence[str], *, hostname: Optional[str] = None,
             hosts: Optional[os.PathLike | str] = None, chdir: Optional[str] = None) -> list[str]:
    """argv prefix that runs a program inside `root` (see nodeexec.py); with `hostname`
    also in its own UTS namespace as that host."""
    unshare = install.which("unshare") or "unshare"
    argv = [unshare, *(["--uts"] if hostname else []), "--mount", "--propagation", "private",
            sys.executable, "-I", "-S", str(NODEEXEC), "--root", str(root)]
    for p in bind_paths:
        argv += ["--bind", p]
    if hostname:
        argv += ["--hostname", hostname]
    if hosts:
        argv += ["--hosts", str(hosts)]
    if chdir:
        argv += ["--chdir", chdir]
    return argv + ["--"]


def which_in(root: Path, program: str) -> Optional[str]:
    """The absolute path (as seen inside `root`) of `program` there, or None."""
    for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        if os.path.lexists(root / d.lstrip("/") / program):
            return f"{d}/{program}"
    return None


def root_id(root: Path) -> list[int]:
    """(device, inode) of the root's top directory: a process already chrooted there sees
    it as its "/" (commands.run then runs Slurm commands directly)."""
    st = os.stat(root)
    return [st.st_dev, st.st_ino]


# --- building --------------------------------------------------------------------------

def _lock(path: Path, timeout: float):
    return flocked(path, timeout, "another process builds this root filesystem", poll_s=1.0)


def _apt_env() -> dict[str, str]:
    return {"PATH": install.SEARCH_PATH, "DEBIAN_FRONTEND": "noninteractive", "LANG": "C.UTF-8"}


def ensure_built(rel: Release, cache: Path, *, log: Callable[[str], None], mirror: str = MIRROR) -> Path:
    """The root filesystem for `rel` in `cache`, built first when missing (debootstrap and
    apt-get from `mirror`; about a minute and 500 MB), or given the packages this version
    of TrainMover lists that it lacks. Raises ClusterError naming the step that failed,
    with the end of its output."""
    root = cache / rel.root_name
    if _complete(rel, root):
        return root
    if os.geteuid() != 0:
        raise ClusterError(f"building the Slurm {rel.version} root filesystem in {root} needs root")
    # A waiter may sit out another process's whole build, a source build included.
    wait = BUILD_TIMEOUT + (source.CONFIGURE_TIMEOUT * 2 + source.MAKE_TIMEOUT if rel.source else 0)
    # the cache made here on a fresh machine (root's, checked: the lock below needs its folder;
    # a fresh clone's `make slurm-matrix` stopped at "cannot open the lock file")
    rootdirs.own_dir(cache, 0o755)
    with _lock(cache / f".{rel.root_name}.lock", timeout=wait):
        marker = built(root)
        if marker is None:
            _build(rel, root, log=log, mirror=mirror)
        elif not _complete(rel, root):
            _top_up(rel, root, marker, log=log)
    return root


def _wanted(rel: Release) -> list[str]:
    return rel.packages + rel.root_extras


def _complete(rel: Release, root: Path) -> bool:
    marker = built(root)
    return marker is not None and set(_wanted(rel)) <= set(marker.get("packages", []))


def _apt(root: Path, *args: str, timeout: float, what: str):
    return run_cmd([*launcher(root, ["/proc", "/sys", "/dev"]), "apt-get", *APT_OPTS, *args], timeout=timeout,
                   env=_apt_env(), what=what)


def _top_up(rel: Release, root: Path, marker: dict, *, log: Callable[[str], None]) -> None:
    missing = [p for p in _wanted(rel) if p not in marker.get("packages", [])]
    log(f"adding {' '.join(missing)} to the Slurm {rel.version} root filesystem {root}")
    _apt(root, "update", timeout=600, what="apt-get update (root filesystem)")
    _apt(root, "install", "-y", "--no-install-recommends", *missing, timeout=BUILD_TIMEOUT,
         what=f"apt-get install (Slurm {rel.version} root filesystem)")
    _apt(root, "clean", timeout=120, what="apt-get clean")
    marker["packages"] = sorted(set(marker.get("packages", [])) | set(missing))
    tmp = root / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1) + "\n")
    tmp.replace(root / MARKER)


def _ensure_debootstrap(log: Callable[[str], None]) -> str:
    path = install.which("debootstrap")
    if path:
        return path
    if install.which("apt-get") is None:
        raise ClusterError("debootstrap is missing and there is no apt-get to install it")
    log("installing debootstrap (apt-get)")
    env = {**os.environ, **_apt_env()}
    proc = run_cmd(["apt-get", "install", "-y", "--no-install-recommends", "debootstrap"], timeout=300, env=env,
                   what="apt-get install debootstrap", check=False)
    if proc.returncode != 0:
        run_cmd(["apt-get", "update"], timeout=300, env=env, what="apt-get update")
        run_cmd(["apt-get", "install", "-y", "--no-install-recommends", "debootstrap"], timeout=300, env=env,
                what="apt-get install debootstrap")
    return install.which("debootstrap") or "debootstrap"


def _build(rel: Release, root: Path, *, log: Callable[[str], None], mirror: str) -> None:
    t0 = time.monotonic()
    # The source first: a build without it would fail after minutes of debootstrap.
    tarball = source.find_tarball(rel.source) if rel.source else None
    partial = root.with_name(f"{rel.root_name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted build; it never holds mounts
    shutil.rmtree(root, ignore_errors=True)     # a root without its marker is incomplete
    debootstrap = _ensure_debootstrap(log)
    log(f"building a Debian {rel.suite} root filesystem for Slurm {rel.version} in {root} "
        f"(debootstrap from {mirror}; once, about a minute)")
    run_cmd([debootstrap, "--variant=minbase", rel.suite, partial, mirror], timeout=BUILD_TIMEOUT,
            env={**os.environ, **_apt_env()}, what=f"debootstrap {rel.suite}")
    t1 = time.monotonic()
    # Package scripts must not start daemons in the root (the cluster starts its own).
    policy = partial / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    _apt(partial, "update", timeout=600, what="apt-get update (root filesystem)")
    _apt(partial, "install", "-y", "--no-install-recommends", *_wanted(rel), timeout=BUILD_TIMEOUT,
         what=f"apt-get install (Slurm {rel.version} root filesystem)")
    _apt(partial, "clean", timeout=120, what="apt-get clean")
    t2 = time.monotonic()
    steps = {}
    if rel.source is not None:
        steps = source.build_in(partial, rel.source, tarball, log=log,
                                run_in=lambda argv, cwd: [*launcher(partial, ["/proc", "/dev"], chdir=cwd), *argv])
    proc = run_cmd([*launcher(partial, ["/proc"]), "slurmd", "-V"], timeout=60, env=_apt_env(),
                   what="slurmd -V (root filesystem)")
    full = parse_version(proc.stdout + proc.stderr)
    if full is None or release(full).version != rel.version:
        raise ClusterError(f"the Debian {rel.suite} root filesystem has Slurm {full or '?'} "
                           f"({(proc.stdout + proc.stderr).strip()!r}), not {rel.version}")
    (partial / MARKER).write_text(json.dumps({
        "slurm": full, "release": rel.version, "suite": rel.suite, "mirror": mirror,
        "packages": _wanted(rel), **({"source": tarball.name, "sha256": rel.source.sha256} if rel.source else {}),
        "built": time.strftime("%Y-%m-%dT%H:%M:%S"), "debootstrap_s": round(t1 - t0, 1),
        "install_s": round(t2 - t1, 1), **({"source_build": steps} if steps else {})}, indent=1) + "\n")
    partial.rename(root)
    log(f"Slurm {full} root filesystem ready in {root} ({time.monotonic() - t0:.0f}s: "
        f"debootstrap {t1 - t0:.0f}s, packages {t2 - t1:.0f}s"
        + (f", source build {time.monotonic() - t2:.0f}s" if steps else "") + ")")


def host_release() -> Optional[str]:
    """The release a cluster without --slurm runs here: the host's Slurm, else the one the
    host's Debian release ships (installed at the first `up`); None when neither is supported."""
    host = host_version()
    if host is not None:
        try:
            return release(host).version
        except ClusterError:
            return None
    return next((r.version for r in RELEASES.values() if r.suite == host_suite() and r.source is None), None)


# --- choosing ----------------------------------------------------------------------------

def locate(requested: Optional[str], *, cache: Path, log: Callable[[str], None],
           force_root: bool = False, unfixed: bool = False) -> tuple[str, str, str, bool]:
    """(release, full version, root filesystem or '', whether host packages were installed)
    of the Slurm a new cluster runs.

    `requested` None: the host's Slurm (installed with apt-get when missing, as the host's
    Debian release ships it). A release the host has: the host's Slurm (unless
    `force_root`). Any other supported release: its root filesystem, built when missing.
    `unfixed`: a release built from source, without TrainMover's fixes (releases.unfixed),
    in a root filesystem of its own; ClusterError for any other.
    """
    if unfixed:
        if requested is None:
            raise ClusterError("an unfixed Slurm needs the release named (--slurm 25.11)")
        rel = releases_unfixed(release(requested))
        root = ensure_built(rel, cache, log=log)
        return rel.version, built(root)["slurm"], str(root), False
    host = host_version()
    if requested is None:
        if host is None:
            rel = next((r for r in RELEASES.values() if r.suite == host_suite() and r.source is None), None)
            if rel is None:
                raise ClusterError(f"no Slurm on this host and its Debian release ({host_suite() or 'unknown'}) "
                                   f"ships none we support; use --slurm with one of {', '.join(RELEASES)}")
        else:
            try:
                rel = release(host)
            except ClusterError as exc:
                raise ClusterError(f"the host runs Slurm {host}: {exc}; --slurm {sorted(RELEASES)[-1]} runs "
                                   "a supported one from a Debian root filesystem") from None
        return _host(rel, log)
    rel = release(requested)
    # A release built from source (25.11) is the host's only where the host runs it already.
    if not force_root and ((host is not None and _same(host, rel))
                           or (host is None and rel.source is None and host_suite() == rel.suite)):
        return _host(rel, log)
    root = ensure_built(rel, cache, log=log)
    return rel.version, built(root)["slurm"], str(root), False


def _same(version: str, rel: Release) -> bool:
    try:
        return release(version) == rel
    except ClusterError:
        return False


def _host(rel: Release, log: Callable[[str], None]) -> tuple[str, str, str, bool]:
    installed = install.ensure_installed(rel, log=log)
    full = host_version()
    if full is None or not _same(full, rel):
        raise ClusterError(f"the host's Slurm is {full or 'missing'} after installing {' '.join(rel.packages)}, "
                           f"not {rel.version}")
    return rel.version, full, "", installed
