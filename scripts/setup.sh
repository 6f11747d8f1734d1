#!/usr/bin/env bash
# Set up a fresh machine for TrainMover's demo and tests (idempotent):
#   * the virtual environment .venv/ with torch pinned by constraints.txt and trainmover installed
#     in editable mode (its bin/trainmover is the CLI);
#   * Debian's Slurm, munge and MariaDB are installed by `trainmover cluster up` itself
#     (trainmover/cluster/install.py), so that the CLI works the same outside make.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
  echo "setup: Python >= 3.11 is needed (found: $("$PY" --version 2>&1))" >&2; exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv || { echo "setup: cannot create .venv (on Debian: apt-get install python3-venv)" >&2; exit 1; }
fi
# torch first, pinned: any unpinned torch requirement would pull the multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check -c constraints.txt "torch==2.13.0"
.venv/bin/pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
touch .venv/.installed
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch, trainmover; print("torch", torch.__version__, "trainmover", trainmover.__version__)'))"
