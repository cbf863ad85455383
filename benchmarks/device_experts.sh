#!/usr/bin/env bash
# One device call on a single GPU for the Triton expert kernels (issue 3): tune the tables for
# this GPU and/or bench the expert block against torch._grouped_mm with named table sets.
#   usage (repository root, on the GPU machine):
#     bash benchmarks/device_experts.sh tune                 # tables for this GPU → $OUT/tables
#     bash benchmarks/device_experts.sh bench LABEL[=DIR] …  # one bench process per label, tables from DIR
#                                                       # (DIR empty: the packaged tables only)
# Full logs and JSON land under $OUT; each step is bounded by STEP_TIMEOUT seconds (default 400).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-experts-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 - <<'PY'
import torch, triton
a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=200, return_mode="median")
print(f"ceiling: bf16 matmul 8192^3 {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s (median {ms:.3f} ms)")
PY
step=${1:-tune}; shift || true
status=0
case $step in
  tune)
    timeout "${STEP_TIMEOUT:-400}" python3 -m interlace.tools.cli tune-experts --world 2 --tokens 4096 16384 \
      --out "$OUT/tables" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" || status=1 ;;
  bench)
    for spec in "$@"; do
      label=${spec%%=*}; dir=${spec#*=}; [[ $dir == "$spec" ]] && dir=""
      echo "+ bench $label (INTERLACE_TUNING_DIR=${dir:-unset})"
      INTERLACE_TUNING_DIR="$dir" timeout "${STEP_TIMEOUT:-400}" python3 benchmarks/bench_expert_kernels.py \
        --json "$OUT/bench_$label.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_$label.log" || status=1
    done ;;
esac
exit $status
