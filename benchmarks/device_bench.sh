#!/usr/bin/env bash
# Reproduces the 2-GPU tables of docs/performance.md on a machine with 2 GPUs (run from the
# repository root). Steps (default: check forward training):
#   check     tests/gpu/run.sh: gpu_check and fused_check
#   forward   the prefill table: sequential and fused, interleaved, 4096/8192/16384 tokens per GPU
#   decode    the decode table: sequential and fused, interleaved, 128 tokens per GPU
#   training  the forward+backward table: sequential and fused:train, interleaved
# Each table step writes $OUT/<step>/results.json (and results.md). To put one on the page: copy
# the JSON to benchmarks/results/, add its line to SOURCES in benchmarks/performance_page.py, run it.
#   usage: bash benchmarks/device_bench.sh [check] [forward] [decode] [training]
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
steps=("$@"); (( ${#steps[@]} )) || steps=(check forward training)
nvidia-smi -L; nvidia-smi topo -m | head -5
bench() { local name=$1; shift
  echo "+ torchrun --nproc-per-node 2 -m interlace.tools.bench $*"
  python3 -m torch.distributed.run --nproc-per-node 2 -m interlace.tools.bench "$@" --out "$OUT/$name" \
    2>&1 | tee "$OUT/$name.log"
  return "${PIPESTATUS[0]}"
}
status=0
for step in "${steps[@]}"; do
  case $step in
    check)    OUT="$OUT/check" bash tests/gpu/run.sh || status=1 ;;
    forward)  bench forward --strategies sequential fused --tokens 4096 8192 16384 --interleave || status=1 ;;
    decode)   bench decode --strategies sequential fused --tokens 128 --interleave || status=1 ;;
    training) bench training --strategies sequential fused:train --tokens 4096 8192 16384 --mode fwdbwd \
                --interleave || status=1 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
