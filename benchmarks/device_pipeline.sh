#!/usr/bin/env bash
# Device runs of the pipelined strategy and its planner on a 2-GPU machine. Steps:
#   check  GPU correctness check of every strategy
#   eval   profile (grid shape classes + the presets) and the planner evaluation grid
#   bench  the forward table of docs/benchmarking.md with pipelined (auto degree from that profile)
#   fb     forward+backward rows for mixtral-8x7b and qwen2-moe
# usage: bash benchmarks/device_pipeline.sh STEP [STEP ...]   (logs, JSON and the profile land under $OUT)
# EVAL_ARGS (e.g. "--warmup 3 --iters 12"), BENCH_ARGS (e.g. "--interleave") and STEP_TIMEOUT (seconds
# per step) are optional.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench-out}
export INTERLACE_PROFILE_DIR=${INTERLACE_PROFILE_DIR:-$OUT/profiles}
mkdir -p "$OUT"
PRESETS="mixtral-8x7b phi3.5-moe qwen2-moe qwen3-30b-a3b dsv3-like flashdmoe-cfg"
EVAL_ARGS=${EVAL_ARGS:-}
BENCH_ARGS=${BENCH_ARGS:-}
T=${STEP_TIMEOUT:-0}
run() { if [ "$T" -gt 0 ]; then timeout "$T" "$@"; else "$@"; fi; }
status=0
for step in "$@"; do
  case $step in
    check) run torchrun --nproc-per-node 2 tests/gpu/gpu_check.py > "$OUT/gpu_check.log" 2>&1 || status=1
           tail -2 "$OUT/gpu_check.log" ;;
    eval)  run torchrun --nproc-per-node 2 -m interlace.tools.evaluate --profile-first --also-profile $PRESETS \
             $EVAL_ARGS --out "$OUT/eval" > "$OUT/pipeline_eval.log" 2>&1 || status=1 ;;
    bench) run torchrun --nproc-per-node 2 -m interlace.tools.bench --strategies naive sequential pipelined \
             --tokens 4096 16384 $BENCH_ARGS --out "$OUT/bench" > "$OUT/bench_pipelined.log" 2>&1 || status=1 ;;
    fb)    run torchrun --nproc-per-node 2 -m interlace.tools.bench --strategies naive sequential pipelined \
             --tokens 4096 16384 --configs mixtral-8x7b qwen2-moe --mode fwdbwd $BENCH_ARGS --out "$OUT/bench_fb" \
             > "$OUT/bench_pipelined_fb.log" 2>&1 || status=1 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
