#!/usr/bin/env bash
# Issue 21's GPU proofs in one call on nvidia-h200-x2 (1 worker + 1 standby), within 10 minutes:
# builds, tests and measures, each part with its own deadline; one part's failure never stops the
# others. Run from the repository root:
#
#   bench/gpu_issue21.sh                       # on the GPU machine ($OUT: where results go)
#   TM_ISSUE21_DEVICE=cpu bench/gpu_issue21.sh # dry run of the same sequence on the CPU (gloo, tiny models)
#   TM_ISSUE21_PARTS="warm" bench/gpu_issue21.sh   # only some parts (default: tests refs gpt megatron warm)
#
# Parts, in order of importance (a part gets min(its maximum, what is left of TM_BUDGET_S)):
#   setup    nvidia-smi, cuda/libtmdelta.so (scripts/build_cuda.sh), megatron-core from .whl/ (carried)
#   tests    unit tests of the new paths, the CUDA capture test included (pinned, side stream, gate)
#   refs     the two uninterrupted reference jobs side by side: gpt_demo 1B on GPU 0, Megatron 1B on GPU 1
#   gpt      gpt_demo 1B: planned migration, then SIGKILL of the worker (snapshot tier, the standby
#            holds the snapshots), both against the reference: gpu-planned-1b-gpu0.json,
#            gpu-failure-1b-gpu0.json
#   megatron Megatron-core GPT 1B bf16, planned migration: planned-gpu-megatron-1b-dp1.json
#   warm     125M compiled: the worker's throughput while the standby warms up, niced and with 4
#            compile workers: warm-joiner-gpu-125m.json
# $OUT receives at most 8 files: the 4 JSON results, summary.txt, driver.log (this script's
# output) and logs.tar.gz (every job's logs and run files, no recordings or compile caches).
# The sequence and its parts are bench/gpu_common.sh's (shared with bench/gpu_issue27.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_common.sh
gpu_begin 21 nvidia-h200-x2 "tests refs gpt megatron warm"
gpu_setup

part tests 60 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_capture_holding.py \
  tests/unit/test_one_node_recovery_policy.py

gpu_models

gpu_warm

# what comes back (bench/gpu_common.sh): the results, and in summary.txt these metrics of each
gpu_finish complete planned_downtime_s pause_measured_on unexpected_downtime_s goal_met detect_s \
  plan_s rebuild_s first_step_after_s joiner_rebind_s joiner_build_s state_copy_s restore_GBps \
  digest_equal bit_exact losses_equal losses_equal_except_lost first_step_ratio \
  stayer_throughput_ratio standby_warmup_s standby_limits
