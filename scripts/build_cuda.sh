#!/usr/bin/env bash
# Builds cuda/build/libtmdelta.so (needs a C++ compiler, a CUDA toolkit and NCCL). Works offline.
# Arguments: make targets of cuda/Makefile (default: all); `scripts/build_cuda.sh all test` also
# builds the test variant libtmdelta_test.so (tests/unit/test_nccl_lib.py does). Looks for:
#   CUDA toolkit: $CUDA_HOME, the toolkit of `nvcc` on PATH, /usr/local/cuda
#   NCCL:         $NCCL_HOME, <python site-packages>/nvidia/nccl (the nvidia-nccl-cu13 wheel
#                 that torch's CUDA builds depend on), system paths (/usr/include, /usr/local/cuda)
#   Python:       $PYTHON, else .venv/bin/python, else python3 (only to find site-packages)
# The last line says what happened: "build_cuda: built ..." or "build_cuda: skipped ..." (exit 0
# when a prerequisite is missing, so CI without CUDA passes); a compile error exits non-zero.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/cuda"

if ! command -v "${CXX:-g++}" >/dev/null 2>&1 || ! command -v make >/dev/null 2>&1; then
  echo "build_cuda: skipped: no C++ compiler (${CXX:-g++}) or no make on PATH"
  exit 0
fi
targets=("${@:-all}")
# A skipped build must not leave an older library behind to be loaded.
skip() { rm -f build/libtmdelta.so build/libtmdelta_test.so; echo "build_cuda: skipped libtmdelta.so: $*"; exit 0; }
jobs=$(nproc 2>/dev/null || echo 2)
t0=$(date +%s.%N)

cuda_home=""
nvcc_path=$(command -v nvcc 2>/dev/null || true)
nvcc_home=""
if [ -n "$nvcc_path" ]; then
  # nvcc may be a wrapper script (exec /usr/local/cuda-13.0/bin/nvcc "$@"): ask the real one.
  real=$(sed -n 's/^exec \([^ ]*nvcc\) .*/\1/p' "$nvcc_path" 2>/dev/null | head -1)
  nvcc_home=$(dirname "$(dirname "$(readlink -f "${real:-$nvcc_path}")")")
fi
for d in "${CUDA_HOME:-}" "$nvcc_home" /usr/local/cuda; do
  if [ -n "$d" ] && [ -f "$d/include/cuda_runtime.h" ]; then cuda_home=$d; break; fi
done
if [ -z "$cuda_home" ]; then
  skip "no CUDA toolkit (cuda_runtime.h) in \$CUDA_HOME, nvcc's toolkit or /usr/local/cuda"
fi
cuda_lib=""
for d in "$cuda_home/lib64" "$cuda_home/targets/x86_64-linux/lib" "$cuda_home/lib"; do
  if ls "$d"/libcudart.so* >/dev/null 2>&1; then cuda_lib=$d; break; fi
done
if [ -z "$cuda_lib" ]; then
  skip "no libcudart.so under $cuda_home"
fi

python=${PYTHON:-}
[ -z "$python" ] && [ -x "$root/.venv/bin/python" ] && python=$root/.venv/bin/python
[ -z "$python" ] && python=$(command -v python3 || true)
site_nccl=()
if [ -n "$python" ]; then
  # Every sys.path entry that holds nvidia/nccl (site-packages, user site, --target installs).
  mapfile -t site_nccl < <("$python" -c 'import os, sys
for p in sys.path:
    d = os.path.join(p, "nvidia", "nccl")
    if os.path.isfile(os.path.join(d, "include", "nccl.h")): print(d)' 2>/dev/null || true)
fi
nccl_inc="" nccl_lib=""
for d in "${NCCL_HOME:-}" "${site_nccl[@]}" /usr /usr/local "$cuda_home"; do
  [ -n "$d" ] && [ -f "$d/include/nccl.h" ] || continue
  for l in "$d/lib" "$d/lib64" "$d/lib/x86_64-linux-gnu"; do
    if [ -e "$l/libnccl.so.2" ]; then nccl_inc=$d/include; nccl_lib=$l; break 2; fi
  done
done
if [ -z "$nccl_inc" ]; then
  skip "no nccl.h + libnccl.so.2 in \$NCCL_HOME, site-packages nvidia/nccl (pip install nvidia-nccl-cu13) or /usr"
fi

make -s -j"$jobs" "${targets[@]}" CUDA_HOME="$cuda_home" CUDA_LIBDIR="$cuda_lib" NCCL_INC="$nccl_inc" \
  NCCL_LIBDIR="$nccl_lib" >/dev/null
version=$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' "$nccl_inc/nccl.h" | paste -sd.)
secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
names=$(for t in "${targets[@]}"; do case $t in all) echo libtmdelta.so;; test) echo libtmdelta_test.so;; *) echo "$t";; esac; done | paste -sd' ')
echo "build_cuda: built $names (cuda/build/) in ${secs}s (NCCL $version from $nccl_inc, CUDA from $cuda_home)"
