"""Install the Debian packages the embedded cluster needs, when they are missing."""

from __future__ import annotations

import glob
import os
import shutil
import sys

from trainmover.cluster.procs import ClusterError, run_cmd

# Debian 12 ships Slurm 22.05. The -dev packages are for building SPANK plugins.
PACKAGES = [
    "slurm-wlm", "slurmdbd", "munge", "libslurm-dev", "slurm-wlm-basic-plugins-dev",
    "mariadb-server", "mariadb-client",
]
# program -> where it is looked for (PATH plus sbin directories, which a non-login
# root shell may lack)
REQUIRED = [
    "slurmctld", "slurmd", "slurmdbd", "slurmstepd", "sinfo", "scontrol", "squeue", "salloc",
    "srun", "sbatch", "scancel", "sacctmgr", "munged", "munge", "mariadbd", "mariadb-install-db",
    "mariadb", "unshare", "setsid", "mount",
]
_SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/sbin", "/bin"])


def which(program: str) -> str | None:
    return shutil.which(program, path=_SEARCH)


def missing_programs() -> list[str]:
    return [p for p in REQUIRED if which(p) is None]


def _apt_env() -> dict[str, str]:
    env = dict(os.environ)
    env["DEBIAN_FRONTEND"] = "noninteractive"
    env["PATH"] = _SEARCH
    return env


def ensure_installed(*, log=lambda msg: print(f"trainmover cluster: {msg}", file=sys.stderr)) -> bool:
    """Install PACKAGES with apt-get when a required program is missing.

    Returns True when it installed something. Needs root and a Debian/Ubuntu
    package source; otherwise raises ClusterError naming what is missing.
    """
    missing = missing_programs()
    if not missing:
        return False
    if which("apt-get") is None:
        raise ClusterError(f"missing programs {missing} and no apt-get to install them; "
                           f"install the Slurm 22.05+ daemons, munge and MariaDB by hand")
    if os.geteuid() != 0:
        raise ClusterError(f"missing programs {missing}; run as root so that apt-get can install "
                           f"{' '.join(PACKAGES)}")
    log(f"missing {', '.join(missing)}; installing Debian packages "
        f"{' '.join(PACKAGES)} (apt-get, about 15 s)")
    env = _apt_env()
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    if not glob.glob("/var/lib/apt/lists/*_Packages*"):
        log("apt package lists are empty; running apt-get update")
        run_cmd(["apt-get", "update"], timeout=300, env=env, what="apt-get update")
    proc = run_cmd(install, timeout=900, env=env, what="apt-get install", check=False)
    if proc.returncode != 0:
        log("apt-get install failed; running apt-get update and retrying")
        run_cmd(["apt-get", "update"], timeout=300, env=env, what="apt-get update")
        run_cmd(install, timeout=900, env=env, what="apt-get install")
    still = missing_programs()
    if still:
        raise ClusterError(f"after installing {' '.join(PACKAGES)} these programs are still missing: {still}")
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
