# What bench/gpu_issue21.sh and bench/gpu_issue27.sh share: sourced by them (not run), from the
# repository root. One sequence of parts (setup, tests, refs, gpt, megatron, ..., warm), each with
# its own deadline, one part's failure never stopping the others; each script picks its parts,
# its tests and the metrics its summary shows.
#
#   gpu_begin ISSUE MACHINE PARTS   settings from TM_ISSUE<ISSUE>_{DEVICE,PARTS,WORK}, TM_BUDGET_S,
#                                   TM_BENCH_MACHINE (default MACHINE), OUT; output to $OUT/driver.log
#   part NAME MAX_S CMD...          one part (below)
#   gpu_setup                       nvidia-smi, cuda/libtmdelta.so, megatron-core from .whl/, versions
#   gpu_models                      the parts refs, gpt and megatron
#   gpu_warm                        the part warm
#   gpu_finish KEY...               results and summary.txt (the metrics KEY...), logs.tar.gz

# gpu_begin ISSUE MACHINE PARTS: the settings every part reads (globals: this file is sourced).
gpu_begin() {
  ISSUE=$1
  local device_var=TM_ISSUE$1_DEVICE parts_var=TM_ISSUE$1_PARTS work_var=TM_ISSUE$1_WORK
  OUT=${OUT:-/tmp/issue$1-out}
  DEVICE=${!device_var:-cuda}
  BUDGET=${TM_BUDGET_S:-570}
  # a new directory per run: the benchmarks refuse a job directory an earlier run left (issue 36)
  W=${!work_var:-/tmp/issue$1-$(date +%Y%m%d-%H%M%S)}
  mkdir -p "$OUT" "$W/res"
  T0=$(date +%s)
  exec > >(tee "$OUT/driver.log") 2>&1
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  export TM_BENCH_MACHINE=${TM_BENCH_MACHINE:-$2}
  PY=${PYTHON:-python3}
  [ "$DEVICE" = cpu ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
  if [ -z "${TM_COMMIT:-}" ]; then
    TM_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
  fi
  export TM_COMMIT
  if [ "$DEVICE" = cuda ]; then
    GPT=1b; MEG=1b; WARM=125m; GPT_STEPS=260; GPT_AT=25; EVERY=20; MEG_STEPS=80; MEG_AT=20
  else  # the CPU dry run: tiny models, more steps (a standby warms up for seconds on a loaded CPU)
    GPT=tiny; MEG=tiny; WARM=tiny; GPT_STEPS=800; GPT_AT=100; EVERY=100; MEG_STEPS=300; MEG_AT=60
  fi
  WARM_EXTRA=(); [ "$DEVICE" = cpu ] && WARM_EXTRA=(--no-compile)  # compiling on a loaded CPU takes ~400 s
  COMMON=(--device "$DEVICE" --gpus 2 --machine "$TM_BENCH_MACHINE")
  PARTS=" ${!parts_var:-$3} "
}

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
note() { echo "$*" | tee -a "$OUT/summary.txt"; }

# part NAME MAX_S CMD...: runs CMD with a deadline of min(MAX_S, time left - 15); its output goes
# to $W/NAME.log (tail shown); skipped when less than 30 s would be left for it.
part() {
  local name=$1 max=$2 l d t rc
  shift 2
  [[ "$PARTS" == *" $name "* ]] || return 0
  l=$(left); d=$(( max < l - 15 ? max : l - 15 ))
  if (( d < 30 )); then note "[$name] SKIPPED: ${l}s of the budget left"; return 0; fi
  echo "=== [$name] deadline ${d}s ($(left)s of ${BUDGET}s left)"
  t=$(date +%s)
  DEADLINE=$(( d - 10 )) timeout -k 10 "$d" "$@" > "$W/$name.log" 2>&1
  rc=$?
  tail -n 30 "$W/$name.log"
  note "[$name] rc=$rc in $(( $(date +%s) - t ))s"
}

gpu_setup() {
  note "issue ${ISSUE} on ${TM_BENCH_MACHINE} (${DEVICE}), commit ${TM_COMMIT}, budget ${BUDGET}s, $(date -u +%FT%TZ)"
  if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader || true
    timeout 60 scripts/build_cuda.sh 2>&1 | tail -3
    if ls .whl/*.whl >/dev/null 2>&1; then
      timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
      note "no .whl/ carried: the Megatron part will fail (megatron-core is not installed there)"
    fi
  fi
  "$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "gpus", torch.cuda.device_count(),
      "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
try:
    from importlib import metadata
    print("megatron-core", metadata.version("megatron-core"))
except Exception as exc:  # noqa: BLE001
    print("megatron-core: not importable:", exc)
EOF
  note "[setup] done at $(( $(date +%s) - T0 ))s"
}

# the reference jobs, then the gpt_demo and the Megatron migrations against them
gpu_models() {
  # bash -c: both references side by side, each bounded by the part's deadline ($DEADLINE)
  part refs 130 bash -c '
    "$0" bench/gpu_planned_migration.py --preset '"$GPT"' --steps '"$GPT_STEPS"' '"${COMMON[*]}"' --ref-only \
      --first-gpu 0 --work '"$W"'/gpt --out '"$W"'/res --deadline-s "$DEADLINE" > '"$W"'/ref-gpt.log 2>&1 & a=$!
    "$0" bench/gpu_megatron_migration.py --preset '"$MEG"' --steps '"$MEG_STEPS"' '"${COMMON[*]}"' --ref-only \
      --first-gpu 1 --work '"$W"'/meg --out '"$W"'/res --deadline-s "$DEADLINE" > '"$W"'/ref-meg.log 2>&1 & b=$!
    wait $a; ra=$?; wait $b; rb=$?
    tail -n 3 '"$W"'/ref-gpt.log '"$W"'/ref-meg.log
    echo "gpt ref rc=$ra, megatron ref rc=$rb"; exit $(( ra || rb ))' "$PY"

  local gpt_ref=() meg_ref=()
  # a reference that wrote no record is moved aside: the next part runs its own in that directory
  [ -d "$W/gpt/ref" ] && [ ! -f "$W/gpt/ref/raw.json" ] && mv "$W/gpt/ref" "$W/gpt/ref-failed"
  [ -d "$W/meg/ref" ] && [ ! -f "$W/meg/ref/raw.json" ] && mv "$W/meg/ref" "$W/meg/ref-failed"
  [ -f "$W/gpt/ref/raw.json" ] && gpt_ref=(--ref "$W/gpt/ref/raw.json")
  part gpt 210 bash -c '"$0" bench/gpu_planned_migration.py "$@" --deadline-s "$DEADLINE"' "$PY" \
    --preset "$GPT" --steps "$GPT_STEPS" --migrate-at "$GPT_AT" --snapshot-every "$EVERY" --fault both \
    "${COMMON[@]}" "${gpt_ref[@]}" --work "$W/gpt" --out "$W/res"

  # SIGKILL 5 steps after the first version is held: recovered from it (the standby's GPU copy)
  part gptfirst 120 bash -c '"$0" bench/gpu_planned_migration.py "$@" --deadline-s "$DEADLINE"' "$PY" \
    --preset "$GPT" --steps "$GPT_STEPS" --migrate-at "$GPT_AT" --snapshot-every "$EVERY" --fault kill \
    --kill-when first-held "${COMMON[@]}" "${gpt_ref[@]}" --work "$W/gpt" --out "$W/res"

  [ -f "$W/meg/ref/raw.json" ] && meg_ref=(--ref "$W/meg/ref/raw.json")
  part megatron 130 bash -c '"$0" bench/gpu_megatron_migration.py "$@" --deadline-s "$DEADLINE"' "$PY" \
    --preset "$MEG" --steps "$MEG_STEPS" --migrate-at "$MEG_AT" "${COMMON[@]}" "${meg_ref[@]}" \
    --work "$W/meg" --out "$W/res"
}

gpu_warm() {
  part warm 200 bash -c '"$0" bench/gpu_warm_joiner.py "$@" --deadline-s "$DEADLINE"' "$PY" \
    --preset "$WARM" --jobs warm --steady-steps 30 --after-steps 10 "${WARM_EXTRA[@]}" "${COMMON[@]}" \
    --work "$W/warm" --out "$W/res"
}

# gpu_finish KEY...: what comes back: the results, the summary (the metrics KEY... of each result),
# the logs (one tarball)
gpu_finish() {
  local f
  for f in "$W"/res/*.json; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  "$PY" - "$OUT" "$@" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
keys = sys.argv[2:]
for p in sorted(Path(sys.argv[1]).glob("*.json")):
    d = json.loads(p.read_text())
    m = d.get("metrics") or {}
    print(f"== {p.name}: complete={d.get('complete')} errors={d.get('errors')}")
    print("   " + json.dumps({k: m.get(k) for k in keys if k in m}))
    snap = m.get("snapshot")
    if snap:
        print("   snapshot: " + json.dumps({k: snap.get(k) for k in ("every", "d2h_copy_s", "d2h_GBps", "gate_wait_s",
                                                                   "issue_s", "to_standby_s", "pinned", "cost_from_rows",
                                                                   "held_detail")}))
EOF
  tar -C "$W" --exclude='*.h5' --exclude='secret' --exclude='compile-cache' --exclude='*.so' -czf "$OUT/logs.tar.gz" \
    $(cd "$W" && ls -d *.log gpt meg warm 2>/dev/null) 2>/dev/null
  if [ "$(stat -c %s "$OUT/logs.tar.gz" 2>/dev/null || echo 0)" -gt 15000000 ]; then  # the 16 MiB limit a file
    tar -C "$W" -czf "$OUT/logs.tar.gz" $(cd "$W" && ls *.log) 2>/dev/null
  fi
  note "[done] $(( $(date +%s) - T0 ))s; files in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
}
