"""Install the Debian packages the embedded cluster needs on the host, when they are missing
(a cluster of a Slurm release the host does not have runs from a root filesystem instead:
trainmover/cluster/rootfs.py)."""

from __future__ import annotations

import glob
import os
import shutil
import sys

from trainmover.cluster.procs import ClusterError, run_cmd
from trainmover.cluster.releases import Release

# programs, looked for on PATH plus the sbin directories (which a non-login root shell may lack)
REQUIRED = [
    "slurmctld", "slurmd", "slurmstepd", "sinfo", "scontrol", "squeue", "salloc",
    "srun", "sbatch", "scancel", "munged", "munge", "unshare", "setsid",
]
REQUIRED_FOR_ACCOUNTING = ["slurmdbd", "sacctmgr", "mariadbd", "mariadb-install-db", "mariadb"]
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/sbin", "/bin"])


def which(program: str) -> str | None:
    return shutil.which(program, path=SEARCH_PATH)


def missing_programs(rel: Release) -> list[str]:
    wanted = REQUIRED + (REQUIRED_FOR_ACCOUNTING if rel.accounting else [])
    return [p for p in wanted if which(p) is None]


def _apt_env() -> dict[str, str]:
    env = dict(os.environ)
    env["DEBIAN_FRONTEND"] = "noninteractive"
    env["PATH"] = SEARCH_PATH
    return env


def ensure_installed(rel: Release, *, log=lambda msg: print(f"trainmover cluster: {msg}", file=sys.stderr)) -> bool:
    """Install `rel.packages` with apt-get when a required program is missing (on the
    Debian release that ships `rel`).

    Returns True when it installed something. Needs root and a Debian/Ubuntu
    package source; otherwise raises ClusterError naming what is missing.
    """
    packages = rel.packages
    missing = missing_programs(rel)
    if not missing:
        return False
    if which("apt-get") is None:
        raise ClusterError(f"missing programs {missing} and no apt-get to install them; "
                           f"install Slurm {rel.version} ({' '.join(packages)}) by hand")
    if os.geteuid() != 0:
        raise ClusterError(f"missing programs {missing}; run as root so that apt-get can install "
                           f"{' '.join(packages)}")
    log(f"missing {', '.join(missing)}; installing Debian packages "
        f"{' '.join(packages)} (apt-get, about 15 s)")
    env = _apt_env()
    install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    if not glob.glob("/var/lib/apt/lists/*_Packages*"):
        log("apt package lists are empty; running apt-get update")
        run_cmd(["apt-get", "update"], timeout=300, env=env, what="apt-get update")
    proc = run_cmd(install, timeout=900, env=env, what="apt-get install", check=False)
    if proc.returncode != 0:
        log("apt-get install failed; running apt-get update and retrying")
        run_cmd(["apt-get", "update"], timeout=300, env=env, what="apt-get update")
        run_cmd(install, timeout=900, env=env, what="apt-get install")
    still = missing_programs(rel)
    if still:
        raise ClusterError(f"after installing {' '.join(packages)} these programs are still missing: {still}")
    return True


def ensure_program(program: str, package: str) -> str:
    """The path of `program`, installing Debian's `package` first when it is missing (tools the
    tests use beside the cluster, e.g. nft for a partition)."""
    found = which(program)
    if found:
        return found
    if which("apt-get") is None or os.geteuid() != 0:
        raise ClusterError(f"{program} is missing; install the {package} package")
    env = _apt_env()
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    if run_cmd(install, timeout=300, env=env, what=f"apt-get install {package}", check=False).returncode != 0:
        run_cmd(["apt-get", "update"], timeout=300, env=env, what="apt-get update")
        run_cmd(install, timeout=300, env=env, what=f"apt-get install {package}")
    found = which(program)
    if not found:
        raise ClusterError(f"{program} still missing after installing {package}")
    return found
