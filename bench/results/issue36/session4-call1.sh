#!/usr/bin/env bash
# issue 36 session 4, call 1 (nvidia-h200-x2): the GPU test session on 2 GPUs, then GPT 1.2B
# 1 worker + 1 standby, SIGKILL after the snapshot at step 20 (restore from the joiner's host copy)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TM_COMMIT=$1 TM_BENCH_MACHINE=nvidia-h200-x2
T0=$(date +%s)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee $OUT/gpus.txt
python3 -c "import torch,sys;print('torch',torch.__version__,'nccl',torch.cuda.nccl.version(),'py',sys.version.split()[0])" | tee -a $OUT/gpus.txt
timeout 90 scripts/build_cuda.sh all test 2>&1 | tail -1
echo "build $(( $(date +%s) - T0 ))s"
set -o pipefail
s=$(date +%s)
TM_TEST_GPU=1 timeout 330 python3 -m pytest tests/unit -m gpu -ra -p no:cacheprovider --basetemp=/tmp/pt --durations=20 2>&1 | tee $OUT/gpu-session.log
echo "== GPU tests: rc=$? $(( $(date +%s) - s ))s" | tee -a $OUT/gpu-session.log
for f in $(find /tmp/pt -name '*.json' -path '*gpu*' 2>/dev/null | grep -v logs | head -5); do cp $f $OUT/session-$(basename $f); done
left=$(( 570 - ($(date +%s) - T0) ))
echo "left ${left}s for the host-copy kill bench"
if (( left > 90 )); then
W=/tmp/w36h-$(date +%s); mkdir -p $W/res
timeout $left python3 bench/gpu_planned_migration.py --preset 1b --gpus 2 --fault kill --snapshot-every 20 --steps 200 --migrate-at 25 \
  --machine nvidia-h200-x2 --out $W/res --work $W/job --deadline-s $(( left - 10 )) > $W/bench-host.log 2>&1; echo "host kill rc=$?"
tail -4 $W/bench-host.log; cp $W/bench-host.log $OUT/
cp $W/res/*.json $OUT/ 2>/dev/null
python3 - $W/res <<'PY'
import json,sys,glob
for p in glob.glob(sys.argv[1]+"/*.json"):
    d=json.load(open(p)); m=d.get("metrics") or {}
    print(p.split("/")[-1], d.get("complete"), d.get("errors"))
    print({k:v for k,v in m.items() if any(x in k for x in ("fault","downtime","restore","first_step","bit_exact","digest","plan_s","rebuild","detect"))})
PY
tar -C $W -czf $OUT/host-logs.tar.gz --exclude='*.h5' --exclude=secret --exclude=compile-cache . 2>/dev/null
fi
ls -la $OUT; echo "total $(( $(date +%s) - T0 ))s"
