#!/usr/bin/env bash
# One device call on the 2×H200 machine for the pipelining issue: GPU check (all strategies),
# profile + planner evaluation over the default grid, the presets' profile, then the
# BENCHMARKS.md forward table with pipelined (auto degree from the fresh profile).
#   usage: bash scripts/device_pipeline.sh [all|check|eval|bench] Logs, JSON and the profile land under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench-out}
export INTERLACE_PROFILE_DIR=${INTERLACE_PROFILE_DIR:-$OUT/profiles}
mkdir -p "$OUT"
status=0
what=${1:-all}
if [[ $what == all || $what == check ]]; then
  torchrun --nproc-per-node 2 scripts/gpu_check.py > "$OUT/gpu_check.log" 2>&1 || status=1
  tail -2 "$OUT/gpu_check.log"
fi
if [[ $what == all || $what == eval ]]; then
  torchrun --nproc-per-node 2 -m interlace.perf.evaluate --profile-first --out "$OUT/eval" \
    > "$OUT/pipeline_eval.log" 2>&1 || status=1
fi
if [[ $what == all || $what == eval || $what == bench ]]; then
  # The BENCHMARKS.md presets' shape classes too, so that the bench's auto degree is planned
  # from their own measurements.
  torchrun --nproc-per-node 2 -m interlace.cli profile --configs mixtral-8x7b phi3.5-moe qwen2-moe qwen3-30b-a3b \
    dsv3-like flashdmoe-cfg > "$OUT/profile_presets.log" 2>&1 || status=1
fi
if [[ $what == all || $what == bench ]]; then
  torchrun --nproc-per-node 2 -m interlace.bench --strategies naive sequential pipelined --tokens 4096 16384 \
    --out "$OUT/bench" > "$OUT/bench_pipelined.log" 2>&1 || status=1
  torchrun --nproc-per-node 2 -m interlace.bench --strategies naive sequential pipelined --tokens 4096 16384 \
    --configs mixtral-8x7b qwen2-moe --mode fwdbwd --out "$OUT/bench_fb" > "$OUT/bench_pipelined_fb.log" 2>&1 || status=1
fi
exit $status
