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
.venv/bin/pip install -q --disable-pip-version-check -c constraints.txt -e ".[test,sandbox,simulate,megatron,lightning]"
# NCCL's headers and library (the wheel torch's CUDA builds use; no dependencies) so that
# cuda/libtmdelta.so compiles where a CUDA toolkit exists. Same version as the GPU machines.
if [ -f /usr/local/cuda/include/cuda_runtime.h ] || command -v nvcc >/dev/null 2>&1; then
  .venv/bin/pip install -q --disable-pip-version-check --no-deps "nvidia-nccl-cu13==2.28.9" \
    || echo "setup: nvidia-nccl-cu13 not installed; cuda/ will build its plan-only library" >&2
fi
# The end-to-end tests run jobs as an ordinary user (trainmover/cluster/users.py) with this
# interpreter: every directory on the way to it and to its base installation (pyenv's under
# /root, 0700) must be searchable by others: o+x only, which lets nobody list or write them.
if [ "$(id -u)" = 0 ]; then
  .venv/bin/python -I -c '
import os, stat, sys
for target in {os.path.realpath(sys.executable), sys.base_prefix, os.path.abspath(".venv")}:
    p = target
    while p != "/":
        p = os.path.dirname(p)
        mode = os.stat(p).st_mode
        if not mode & stat.S_IXOTH:
            os.chmod(p, stat.S_IMODE(mode) | stat.S_IXOTH)
            print(f"setup: {p} searchable by others (o+x) for the tests of ordinary users", file=sys.stderr)
'
fi
touch .venv/.installed
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch, trainmover; print("torch", torch.__version__, "trainmover", trainmover.__version__)'))"
