"""slurm_plugin/healthcheck.sh as slurmd runs it (root, only SLURMD_NODENAME set) and the NHC
line docs/admin.md gives: Python isolated from the working directory and the environment, the
site file read and never sourced, untrusted files refused, the 10 s budget kept, and under
NHC the node's reason is the health check's own text."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainmover.healthcheck.state import root_trusted

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "slurm_plugin" / "healthcheck.sh"
NHC_FILE = ROOT / "slurm_plugin" / "trainmover.nhc"


pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (root_trusted(Path(sys.executable)) and root_trusted(Path(os.path.realpath(sys.executable)))),
    reason="healthcheck.sh runs as root with a root-owned interpreter; this Python or user is not that")


@pytest.fixture
def installed(tmp_path):
    """The script as an admin installs it: a copy with a healthcheck.env beside it."""
    bindir = tmp_path / "slurm_plugin"
    bindir.mkdir(mode=0o755)
    shutil.copy(SCRIPT, bindir)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    env = bindir / "healthcheck.env"
    env.write_text(f"TRAINMOVER_PYTHON={sys.executable}\n"
                   f"TRAINMOVER_HEALTHCHECK_ARGS='--state-dir {state} --no-straggler --disk /'\n")
    env.chmod(0o644)

    def run(*args, cwd="/", extra_env=None, timeout=20):
        return subprocess.run(["/usr/bin/env", "-i", "SLURMD_NODENAME=n1", *(extra_env or []),
                               str(bindir / "healthcheck.sh"), *args],
                              capture_output=True, text=True, timeout=timeout, cwd=cwd)
    run.bindir, run.state, run.env = bindir, state, env
    return run


def test_healthy_run_reports_and_exits_0(installed):
    p = installed("--no-drain")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "n1: healthy" in p.stdout


def test_python_is_isolated_from_the_working_directory_and_the_environment(installed, tmp_path):
    """A `trainmover` package in the directory the check is started from, or on a PYTHONPATH
    or PYTHONSTARTUP that reached the script, must not be what runs as root."""
    evil = tmp_path / "evil"
    (evil / "trainmover").mkdir(parents=True)
    marker = tmp_path / "pwned"
    (evil / "trainmover" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (evil / "startup.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    p = installed("--no-drain", cwd=str(evil),
                  extra_env=[f"PYTHONPATH={evil}", f"PYTHONSTARTUP={evil}/startup.py", "PYTHONINSPECT=1"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert not marker.exists()


def test_the_site_file_is_read_not_sourced(installed, tmp_path):
    marker = tmp_path / "pwned"
    installed.env.write_text(installed.env.read_text() + f"touch {marker}\nSLURM_CONF=$(touch {marker})\n"
                             "PYTHONPATH=/somewhere\n")
    p = installed("--no-drain")
    assert p.returncode == 0, p.stdout + p.stderr
    assert not marker.exists()
    assert "healthcheck.env:3 ignored (only SLURM_CONF, TRAINMOVER_PYTHON, TRAINMOVER_HEALTHCHECK_ARGS are read)" in p.stderr


def test_a_site_file_others_can_write_is_ignored(installed):
    installed.env.chmod(0o666)
    p = installed("--no-drain")
    assert "healthcheck.env ignored: it or its directory is not root's, or is writable by group or others" in p.stderr
    assert p.returncode == 2 and "no Python interpreter" in p.stderr  # the default venv is not there


def test_an_interpreter_in_a_directory_others_can_write_is_refused(installed, tmp_path):
    shared = tmp_path / "shared-bin"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "python").symlink_to(sys.executable)
    installed.env.write_text(f"TRAINMOVER_PYTHON={shared}/python\n")
    p = installed("--no-drain")
    assert p.returncode == 2 and f"{shared}/python not used" in p.stderr


def test_the_run_never_outlasts_10_s(installed, tmp_path):
    hung = tmp_path / "bin" / "python"
    hung.parent.mkdir(mode=0o755)
    hung.write_text("#!/bin/sh\nexec sleep 60\n")
    hung.chmod(0o755)
    installed.env.write_text(f"TRAINMOVER_PYTHON={hung}\n")
    t0 = time.monotonic()
    p = installed("--no-drain", timeout=30)
    took = time.monotonic() - t0
    assert p.returncode == 124 and took < 10.5, (p.returncode, took)


# ---- NHC ---------------------------------------------------------------------------------------

def documented_nhc_line() -> str:
    text = (ROOT / "docs" / "admin.md").read_text()
    (line,) = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("* || check_trainmover")]
    return line


def run_nhc_line(line: str, script: Path) -> subprocess.CompletedProcess:
    """NHC evaluates `<target> || <check> <args>`; `die RC MSG` is how a check fails (NHC marks
    the node down with MSG). The stub prints what NHC would put on the node."""
    check = line.split("||", 1)[1].strip().replace("/opt/trainmover/slurm_plugin/healthcheck.sh", str(script))
    program = (f"die() {{ echo \"DIE $1: $2\"; }}\n. {NHC_FILE}\n{check}\necho \"RET $?\"\n")
    return subprocess.run(["/usr/bin/env", "-i", "PATH=/usr/bin:/bin", "/bin/bash", "-c", program],
                          capture_output=True, text=True, timeout=30, cwd="/")


def test_the_documented_nhc_line_passes_a_healthy_node(installed):
    line = documented_nhc_line()
    assert "--no-drain" in line
    p = run_nhc_line(line, installed.bindir / "healthcheck.sh")
    assert p.stdout.strip() == "RET 0", p.stdout + p.stderr


def test_the_documented_nhc_line_fails_with_the_health_checks_reason(installed):
    """NHC gives no SLURMD_NODENAME: the script names the node by `hostname -s`."""
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True, timeout=5).stdout.strip()
    (installed.state / f"inject-fault-{host}").write_text("XID 79 (injected for NHC)\n")
    p = run_nhc_line(documented_nhc_line(), installed.bindir / "healthcheck.sh")
    m = re.search(r"^DIE 1: (.*)$", p.stdout, re.M)
    assert m, p.stdout + p.stderr
    assert m.group(1) == (f"trainmover: healthcheck inject: XID 79 (injected for NHC) (fault injected by "
                          f"{installed.state}/inject-fault-{host})")
    assert p.stdout.strip().endswith("RET 1")


def test_nhc_reports_a_check_that_could_not_run(installed):
    installed.env.write_text("TRAINMOVER_PYTHON=/nonexistent/python\n")
    p = run_nhc_line(documented_nhc_line(), installed.bindir / "healthcheck.sh")
    assert "DIE 1: check_trainmover:  2 returned by" in p.stdout and "no Python interpreter" in p.stdout


def test_scripts_are_root_installable_as_is():
    for f in (SCRIPT, NHC_FILE):
        mode = stat.S_IMODE(f.stat().st_mode)
        assert not mode & 0o022, f"{f} is writable by group or others in the checkout"
    assert SCRIPT.stat().st_mode & stat.S_IXUSR


def _venv_importing(tmp_path: Path, checkout: Path) -> Path:
    """A virtual environment whose site-packages points at `checkout` (as an editable install's
    .pth does); its interpreter is root's."""
    venv = tmp_path / "venv"
    subprocess.run([os.path.realpath(sys.executable), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "__editable__.trainmover.pth").write_text(f"{checkout}\n")
    return venv / "bin" / "python"


def test_a_package_tree_others_can_write_is_not_imported(installed, tmp_path):
    """An editable install imports the checkout: if anyone but root can change a file there,
    root must not run it."""
    checkout = tmp_path / "checkout"
    (checkout / "trainmover").mkdir(parents=True)
    marker = tmp_path / "pwned"
    (checkout / "trainmover" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (checkout / "trainmover" / "cli.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    python = _venv_importing(tmp_path, checkout)
    installed.env.write_text(f"TRAINMOVER_PYTHON={python}\n")
    (checkout / "trainmover" / "cli.py").chmod(0o666)  # one file anyone can change
    p = installed("--no-drain")
    assert p.returncode == 2 and f"trainmover package {checkout / 'trainmover'} not used" in p.stderr, p.stderr
    assert not marker.exists()
    (checkout / "trainmover" / "cli.py").chmod(0o644)
    checkout.chmod(0o777)  # a directory above the package anyone can write
    p = installed("--no-drain")
    assert p.returncode == 2 and "not used" in p.stderr and not marker.exists(), p.stderr


def test_site_packages_others_can_write_are_not_used(installed, tmp_path):
    python = _venv_importing(tmp_path, tmp_path / "nowhere")
    (site,) = (tmp_path / "venv").glob("lib/python*/site-packages")
    site.chmod(0o777)
    installed.env.write_text(f"TRAINMOVER_PYTHON={python}\n")
    p = installed("--no-drain")
    assert p.returncode == 2 and f"{site} not used" in p.stderr, p.stderr
