#!/usr/bin/env bash
# Issue 27's GPU proofs on nvidia-h100-x2 (1 worker + 1 standby), each call within 10 minutes
# (bench/gpu_issue21.sh's sequence with the planned transfer, protection_ready_s and the health check):
# builds, tests and measures, each part with its own deadline; one part's failure never stops the
# others. Run from the repository root:
#
#   bench/gpu_issue27.sh                       # on the GPU machine ($OUT: where results go)
#   TM_ISSUE27_DEVICE=cpu bench/gpu_issue27.sh # dry run of the same sequence on the CPU (gloo, tiny models)
#   TM_ISSUE27_PARTS="health warm" bench/gpu_issue27.sh   # only some parts (default: all of them)
#
# Parts, in order of importance (a part gets min(its maximum, what is left of TM_BUDGET_S)):
#   setup    nvidia-smi, cuda/libtmdelta.so (scripts/build_cuda.sh), megatron-core from .whl/ (carried)
#   tests    unit tests of the new paths, the CUDA capture test included (pinned, side stream, gate)
#   p2p      bench/p2p_plan.py: the planned transfer alone (chunk sizes; checks as CUDA graphs or not)
#   refs     the two uninterrupted reference jobs side by side: gpt_demo 1B on GPU 0, Megatron 1B on GPU 1
#   gpt      gpt_demo 1B: planned migration, then SIGKILL of the worker (snapshot tier, the standby
#            holds the snapshots), both against the reference: gpu-planned-1b-gpu0.json,
#            gpu-failure-1b-gpu0.json
#   gptfirst gpt_demo 1B, SIGKILL 5 steps after the first version is held (it went straight to the
#            standby's GPU): recovered from that copy: gpu-failure-first-1b-gpu0.json
#   megatron Megatron-core GPT 1B bf16, planned migration: planned-gpu-megatron-1b-dp1.json
#   health   bench/gpu_healthcheck.py: healthy runs with NVLink traffic, every fault kind injected
#   warm     125M compiled: the worker's throughput while the standby warms up, niced and with 4
#            compile workers: warm-joiner-gpu-125m.json
# $OUT receives at most 8 files: the 4 JSON results, summary.txt, driver.log (this script's
# output) and logs.tar.gz (every job's logs and run files, no recordings or compile caches).
# The sequence and its parts are bench/gpu_common.sh's (shared with bench/gpu_issue21.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_common.sh
gpu_begin 27 nvidia-h100-x2 "tests p2p refs gpt gptfirst megatron health warm"
gpu_setup

part tests 120 env TM_TEST_GPU=1 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_xferplan.py \
  tests/unit/test_capture_holding.py tests/unit/test_gpu_first_snapshot.py

# the planned transfer alone, GPU 0 to GPU 1: chunk sizes, checks as CUDA graphs or kernel by kernel
[ "$DEVICE" = cuda ] && part p2p 100 "$PY" bench/p2p_plan.py --preset "$GPT" --machine "$TM_BENCH_MACHINE" \
  --out "$W/res/p2p-plan-$GPT.json" --timeout-s 85

gpu_models

HEALTH_EXTRA=(); [ "$DEVICE" = cpu ] && HEALTH_EXTRA=(--dry-run)
part health 150 "$PY" bench/gpu_healthcheck.py --machine "$TM_BENCH_MACHINE" "${HEALTH_EXTRA[@]}" \
  --out "$W/res/gpu-healthcheck-${TM_BENCH_MACHINE}.json"

gpu_warm

# what comes back (bench/gpu_common.sh): the results, and in summary.txt these metrics of each
gpu_finish complete planned_downtime_s pause_measured_on unexpected_downtime_s goal_met detect_s \
  plan_s rebuild_s first_step_after_s joiner_rebind_s joiner_build_s state_copy_s restore_GBps \
  digest_equal bit_exact losses_equal losses_equal_except_lost first_step_ratio first_step_extra_s \
  pause_parts leaver_parts plan_made_ahead_s protection_ready_s holder_alloc_s \
  stayer_throughput_ratio standby_warmup_s standby_limits healthy_runs_passed_ratio \
  injected_faults_caught_ratio controls_passed_ratio
