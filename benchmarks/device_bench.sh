#!/usr/bin/env bash
# One device call on the 2×H200 NVLink machine: GPU correctness check, then the
# BENCHMARKS.md tables of the foundation issue. Full logs and JSON land under $OUT.
#   usage (from the repository root, on the GPU machine): bash benchmarks/device_bench.sh [fwd|fwdbwd|all]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
what=${1:-all}
nvidia-smi -L; nvidia-smi topo -m | head -5
run() { echo "+ $*"; "$@"; }
status=0
if [[ $what == all || $what == check ]]; then
  run torchrun --nproc-per-node 2 tests/gpu/gpu_check.py 2>&1 | tee "$OUT/gpu_check.log" || status=1
fi
if [[ $what == all || $what == fwd ]]; then
  run torchrun --nproc-per-node 2 -m interlace.tools.bench --tokens 4096 16384 --mode fwd --out "$OUT/fwd" \
    2>&1 | tee "$OUT/bench_fwd.log" || status=1
fi
if [[ $what == all || $what == fwdbwd ]]; then
  run torchrun --nproc-per-node 2 -m interlace.tools.bench --configs mixtral-8x7b qwen2-moe --tokens 4096 16384 \
    --mode fwdbwd --out "$OUT/fwdbwd" 2>&1 | tee "$OUT/bench_fwdbwd.log" || status=1
fi
exit $status
