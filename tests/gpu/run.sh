#!/usr/bin/env bash
# The GPU checks, on every GPU of this machine (W = the GPUs visible, at least 2):
#   1. tests/gpu/gpu_check.py   every strategy against an fp32 reference, forward and every gradient,
#                               all routing cases, bitwise repeatability, NaN rows (bf16 tolerances);
#                               persistent forward on the routing cases its router can make
#   2. tests/gpu/fused_check.py the fused strategy on every preset against sequential and naive, then
#                               many calls through CUDA-graph captures, replays and evictions, then a
#                               stack of layers whose graphs share their pool and buffers (stack)
#   3. tests/gpu/compile_check.py a stack of MoE layers under torch.compile and eager, each against
#                               an fp32 twin, the routing, compiled and eager step times
#   4. tests/gpu/persistent_check.py the persistent strategy (world size 1, GPU 0) against the fp32
#                               reference: token counts, skewed routing, NaN rows, repeatability, stress
#   5. tests/gpu/persistent_sim_check.py the W > 1 persistent kernel with simulated ranks on GPU 0
#                               (phases as launches: a memory fault names its launch)
#   6. tests/gpu/persistent_dist_check.py the W > 1 persistent strategy on every GPU against a
#                               distributed fp32 reference (uneven, empty, skewed, graph replays),
#                               then 1000 calls of random token counts (--stress)
#   7. tests/gpu/hf_persistent_check.py a bf16 transformers MoE block on persistent (GPU 0) against
#                               HF's block, beside sequential
# usage (repository root): bash tests/gpu/run.sh [fused_check steps ...]   (default: check stress stack)
# Exits non-zero if any check fails. Logs go to $OUT (default bench-out/gpu-check).
set -uo pipefail
cd "$(dirname "$0")/../.."
# NVLink multicast off: the fused kernels use plain peer mappings, not multicast objects; every
# recorded run in docs/performance.md ran this way.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench-out/gpu-check}
mkdir -p "$OUT"
W=${W:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
if (( W < 2 )); then
  echo "tests/gpu/run.sh needs at least 2 GPUs (found $W)"; exit 2
fi
steps=("$@"); (( ${#steps[@]} )) || steps=(check stress stack)
status=0
python3 -m torch.distributed.run --nproc-per-node "$W" tests/gpu/gpu_check.py 2>&1 | tee "$OUT/gpu_check.log"
(( PIPESTATUS[0] == 0 )) || status=1
python3 -m torch.distributed.run --nproc-per-node "$W" tests/gpu/fused_check.py --steps "${steps[@]}" --out "$OUT" \
  2>&1 | tee "$OUT/fused_check.log"
(( PIPESTATUS[0] == 0 )) || status=1
python3 -m torch.distributed.run --nproc-per-node "$W" tests/gpu/compile_check.py --layers 2 --iters 5 \
  2>&1 | tee "$OUT/compile_check.log"
(( PIPESTATUS[0] == 0 )) || status=1
CUDA_VISIBLE_DEVICES=0 python3 tests/gpu/persistent_check.py 2>&1 | tee "$OUT/persistent_check.log"
(( PIPESTATUS[0] == 0 )) || status=1
CUDA_VISIBLE_DEVICES=0 python3 tests/gpu/persistent_sim_check.py 2>&1 | tee "$OUT/persistent_sim_check.log"
(( PIPESTATUS[0] == 0 )) || status=1
python3 -m torch.distributed.run --nproc-per-node "$W" tests/gpu/persistent_dist_check.py --stress 1000 \
  2>&1 | tee "$OUT/persistent_dist_check.log"
(( PIPESTATUS[0] == 0 )) || status=1
CUDA_VISIBLE_DEVICES=0 python3 tests/gpu/hf_persistent_check.py 2>&1 | tee "$OUT/hf_persistent_check.log"
(( PIPESTATUS[0] == 0 )) || status=1
echo "gpu checks: $([[ $status == 0 ]] && echo passed || echo FAILED)"
exit $status
