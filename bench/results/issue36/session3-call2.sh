#!/usr/bin/env bash
# issue 36 session 3, call 2: Megatron 1B PP3 and DP3 (distributed optimizer) planned, after b350c40
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TM_COMMIT=$1 TM_BENCH_MACHINE=nvidia-h100-x4
T0=$(date +%s)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
timeout 60 scripts/build_cuda.sh 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
W=/tmp/w36-$(date +%s); R=$W/res; mkdir -p $R
summ() { python3 - $R <<'PY'
import json,sys,glob
for p in sorted(glob.glob(sys.argv[1]+"/*.json")):
    d=json.load(open(p)); m=d.get("metrics") or {}
    print(p.split("/")[-1], d.get("complete"), d.get("errors"))
    print({k:m.get(k) for k in ("planned_downtime_s","first_step_ratio","first_step_extra_s","steady_step_s","standby_warmup_s","bit_exact","exactness_unknown","stayer_throughput_ratio","phase1_s","switch_s")})
    for n,j in (d.get("jobs") or {}).items(): print(n, j.get("steps_done"), j.get("wall_s"))
PY
}
timeout 160 python3 bench/gpu_megatron_migration.py --preset 1b --gpus 4 --layout pp --steps 160 --migrate-at 40 --record-iterations 1 \
  --machine nvidia-h100-x4 --out $R/pp1 --work $W/pp1 --deadline-s 150 > $W/bench-pp1.log 2>&1; echo "pp rec1 rc=$? at $(( $(date +%s) - T0 ))s"
timeout 270 python3 bench/gpu_megatron_migration.py --preset 1b --gpus 4 --layout dp --steps 170 --migrate-at 30 --record-iterations 1 \
  --machine nvidia-h100-x4 --out $R/dp --work $W/dp --deadline-s 260 > $W/bench-dp.log 2>&1; echo "dp rec1 rc=$? at $(( $(date +%s) - T0 ))s"
left=$(( 570 - ($(date +%s) - T0) ))
if (( left > 120 )); then
timeout $left python3 bench/gpu_megatron_migration.py --preset 1b --gpus 4 --layout pp --steps 160 --migrate-at 40 \
  --machine nvidia-h100-x4 --out $R/pp3 --work $W/pp3 --deadline-s $(( left - 10 )) > $W/bench-pp3.log 2>&1; echo "pp rec3 rc=$? at $(( $(date +%s) - T0 ))s"
fi
for d in pp1 dp pp3; do for f in $R/$d/*.json; do [ -f $f ] && cp $f $OUT/${d}-$(basename $f); done; done
for d in pp1 dp pp3; do echo "== $d"; (R=$R/$d; summ); done
tar -C $W -czf $OUT/logs.tar.gz --exclude='*.h5' --exclude=secret --exclude=compile-cache --exclude=recordings . 2>/dev/null
ls -la $OUT; echo "total $(( $(date +%s) - T0 ))s"
