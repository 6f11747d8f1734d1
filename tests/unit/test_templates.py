"""Golden-file tests of every sbatch template.

A template is "rendered" by running it the way the batch step does, with a stub in place
of the interpreter: the stub prints the command line and the TrainMover-relevant
environment the template hands to `trainmover controller`. The golden text is the
template's #SBATCH directives plus that output, for the defaults and for one set of
parameters. Re-record after an intended change with

    TM_RECORD_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_templates.py

and review the diff of tests/unit/test_templates_golden/ before committing it.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = sorted((ROOT / "sbatch_templates").glob("*.sbatch"))
GOLDEN = Path(__file__).with_name("test_templates_golden")
RECORD = os.environ.get("TM_RECORD_GOLDEN") == "1"
RERECORD = "TM_RECORD_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_templates.py"

STUB = """#!/bin/sh
echo "argv: $*"
env | grep -E '^(TM_|OMP_|NCCL_|PYTHONPATH=)' | grep -v '^TM_PYTHON=' | LC_ALL=C sort
"""

# (case name, environment given at submit time / by Slurm)
CASES = {
    "defaults": {},
    "params": {"TM_STEPS": "300", "TM_STANDBYS": "2", "TM_MODEL": "small", "TM_RANKS_PER_NODE": "2",
               "SLURM_GPUS_ON_NODE": "4", "OMP_NUM_THREADS": "2"},
    # inside a job of the local cluster's 4 CPU nodes, 2 ranks each (what Slurm sets)
    "job": {"SLURM_JOB_NUM_NODES": "5", "TM_RANKS_PER_NODE": "2"},  # + the keeper node, which runs no rank
}


def render(template: Path, env: dict[str, str], stub: Path) -> str:
    directives = [ln for ln in template.read_text().splitlines() if ln.startswith("#SBATCH")]
    proc = subprocess.run(
        ["bash", str(template)], capture_output=True, text=True, timeout=30,
        env={"PATH": "/usr/bin:/bin", "SLURM_SUBMIT_DIR": "/submit", "TM_PYTHON": str(stub), **env})
    assert proc.returncode == 0, f"{template.name} failed to run: {proc.stderr}"
    return "\n".join(directives) + "\n" + proc.stdout.replace(str(stub), "<python>")


@pytest.fixture(scope="module")
def stub(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stub") / "python"
    path.write_text(STUB)
    path.chmod(0o755)
    return path


def test_there_are_templates():
    names = {t.name for t in TEMPLATES}
    assert {"demo_gpt_cpu.sbatch", "torch_ddp.sbatch"} <= names


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
@pytest.mark.parametrize("case", sorted(CASES))
def test_template_matches_golden(template, case, stub):
    got = render(template, CASES[case], stub)
    golden = GOLDEN / f"{template.stem}.{case}.txt"
    if RECORD:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(got)
        return
    assert golden.exists(), (f"no golden file {golden.relative_to(ROOT)} for {template.name} ({case}); "
                             f"record it with: {RERECORD}")
    assert got == golden.read_text(), (
        f"{template.name} ({case}) renders differently from {golden.relative_to(ROOT)}.\n"
        f"If the change is intended, re-record with: {RERECORD}\n"
        f"--- golden ---\n{golden.read_text()}--- got ---\n{got}")


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_template_documents_its_parameters(template):
    text = template.read_text()
    assert re.search(r"^# Parameters", text, re.M), f"{template.name}: no '# Parameters' section"
    assert subprocess.run(["bash", "-n", str(template)], capture_output=True, timeout=10).returncode == 0
    used = set(re.findall(r"\$\{(TM_[A-Z0-9_]+)", text))
    header = text.split("\n#SBATCH", 1)[0]
    undocumented = sorted(v for v in used if v not in header)
    assert not undocumented, f"{template.name} uses {undocumented} without documenting them in its header"


def test_golden_files_belong_to_templates():
    known = {f"{t.stem}.{c}.txt" for t in TEMPLATES for c in CASES}
    stray = sorted(p.name for p in GOLDEN.glob("*.txt") if p.name not in known)
    assert not stray, f"golden files without a template/case: {stray}; delete them"
