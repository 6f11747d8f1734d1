#!/usr/bin/env bash
# issue 36 session 4, call 2 (nvidia-h200-x2): GPT 1.2B, 2 DP workers + 1 standby sharing GPU 1 with
# gpu1's worker, SIGKILL of gpu1's worker: groups foreseen (--foresee-nodes 4), then the control
# (--foresee-nodes 0) on the same reference
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TM_COMMIT=$1 TM_BENCH_MACHINE=nvidia-h200-x2
T0=$(date +%s)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee $OUT/gpus.txt
timeout 90 scripts/build_cuda.sh 2>&1 | tail -1
W=/tmp/w36f-$(date +%s); mkdir -p $W/fore $W/ctl
run() {  # name foresee-nodes extra...
  local name=$1 n=$2; shift 2
  local left=$(( 575 - ($(date +%s) - T0) ))
  echo "== $name: ${left}s left"
  (( left > 60 )) || return 0
  timeout $left python3 bench/gpu_planned_migration.py --preset 1b --gpus 3 --host-gpus 3 --standby-gpu 1 --leaver gpu1 \
    --fault kill --steps 160 --migrate-at 25 --foresee-nodes $n --machine nvidia-h200-x2 --out $W/$name/res \
    --work $W/$name/job --deadline-s $(( left - 10 )) "$@" > $W/$name/bench.log 2>&1; echo "$name rc=$?"
  tail -3 $W/$name/bench.log; cp $W/$name/bench.log $OUT/bench-$name.log
  for f in $W/$name/res/*.json; do cp $f $OUT/$name-$(basename $f); done
  grep -rh "foreseen groups\|groups foreseen" $W/$name/job 2>/dev/null | head -12
  tar -C $W/$name -czf $OUT/$name-logs.tar.gz --exclude='*.h5' --exclude=secret --exclude=compile-cache job 2>/dev/null
}
run fore 4
run ctl 0 --ref $W/fore/job/ref/raw.json
python3 - $OUT <<'PY'
import json,sys,glob
for p in sorted(glob.glob(sys.argv[1]+"/*.json")):
    d=json.load(open(p)); m=d.get("metrics") or {}
    print(p.split("/")[-1], d.get("complete"), d.get("errors"))
    print({k:m.get(k) for k in ("unexpected_downtime_s","detect_s","plan_s","rebuild_s","first_step_after_s","bit_exact","digest_equal","joiner_prebound","joiner_build_s","joiner_groups_built_ahead","joiner_group_build_s")})
PY
ls -la $OUT; echo "total $(( $(date +%s) - T0 ))s"
