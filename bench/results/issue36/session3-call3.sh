#!/usr/bin/env bash
# issue 36 session 3, call 3: the GPU test session (make test's GPU part), then GPT 1.2B 3+1 SIGKILL
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TM_COMMIT=$1 TM_BENCH_MACHINE=nvidia-h100-x4
T0=$(date +%s)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
timeout 90 scripts/build_cuda.sh all test 2>&1 | tail -1
echo "build $(( $(date +%s) - T0 ))s"
set -o pipefail
s=$(date +%s)
TM_TEST_GPU=1 timeout 330 python3 -m pytest tests/unit -m gpu -ra -p no:cacheprovider --basetemp=/tmp/pt --durations=20 2>&1 | tee $OUT/gpu-session.log
echo "== GPU tests: rc=$? $(( $(date +%s) - s ))s" | tee -a $OUT/gpu-session.log
for f in $(find /tmp/pt -name '*.json' -path '*gpu*' 2>/dev/null | grep -v logs | head -5); do cp $f $OUT/session-$(basename $f); done
left=$(( 560 - ($(date +%s) - T0) ))
echo "left ${left}s for the kill bench"
if (( left > 100 )); then
W=/tmp/w36k-$(date +%s); mkdir -p $W/res
timeout $left python3 bench/gpu_planned_migration.py --preset 1b --gpus 4 --leaver gpu1 --fault kill --steps 160 --migrate-at 25 \
  --machine nvidia-h100-x4 --out $W/res --work $W/job --deadline-s $(( left - 10 )) > $W/bench-kill.log 2>&1; echo "kill rc=$?"
tail -4 $W/bench-kill.log
cp $W/res/*.json $OUT/ 2>/dev/null
python3 - $W/res <<'PY'
import json,sys,glob
for p in glob.glob(sys.argv[1]+"/*.json"):
    d=json.load(open(p)); m=d.get("metrics") or {}
    print(p.split("/")[-1], d.get("complete"), d.get("errors"))
    print({k:m.get(k) for k in ("unexpected_downtime_s","fault_to_first_step_s","detect_s","plan_s","rebuild_s","first_step_after_s","bit_exact","joiner_prebound","rebind_s","joiner_build_s","joiner_groups_built_ahead")})
PY
tar -C $W -czf $OUT/kill-logs.tar.gz --exclude='*.h5' --exclude=secret --exclude=compile-cache . 2>/dev/null
fi
ls -la $OUT; echo "total $(( $(date +%s) - T0 ))s"
