#!/usr/bin/env bash
# Device calls on a 2-GPU machine for the fused (COMET) strategy. Steps:
#   tune     interlace tune (block split) for the benchmark presets → $OUT/tuning (used by later steps)
#   bench    the forward table (docs/performance.md): naive, sequential, fused at 4096/8192/16384 tokens
#   fb       forward+backward rows for mixtral-8x7b and qwen2-moe (fused: sequential's training path;
#            fused:train: the fused kernels backward too)
#   check    tests/gpu/fused_check.py: every preset against naive/sequential, 1000-call stress, hidden %
#   timeline per-block timeline PNGs of one qwen2-moe call per rank
#   atma     fused kernel-config variants (AB_VARIANTS; default: the A rows through TMA, a_tma0 for
#            layer0's remote tiles and a_tma1 for layer1's h rows, and layer1's deferred tile counts,
#            defer_count, each switched off) interleaved round by round with the default, sequential
#            and the bare transfers (fused_check ab): time, ratio to the default, hidden share, check
#   ab       the same A/B for any variants (AB_VARIANTS: FusedKernelConfig fields, plus n_comm /
#            n_comm1 for the block split, e.g. "default copy_rows=64,n_comm=8"); default: wider
#            combine tasks (block_t 64, 128) and taller send copy steps (copy_rows 32, 64) on every preset
# usage: bash benchmarks/device_fused.sh STEP [STEP ...]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench-out}
export INTERLACE_TUNING_DIR=${INTERLACE_TUNING_DIR:-$OUT/tuning}
mkdir -p "$OUT" "$INTERLACE_TUNING_DIR"
PRESETS="mixtral-8x7b phi3.5-moe qwen2-moe qwen3-30b-a3b dsv3-like flashdmoe-cfg"
status=0

for step in "$@"; do
  case $step in
    tune)  torchrun --nproc-per-node 2 -m interlace.tools.tune_fused --configs $PRESETS --tokens 4096 16384 \
             --iters 8 > "$OUT/tune_fused.log" 2>&1 || status=1
           tail -3 "$OUT/tune_fused.log" ;;
    bench) torchrun --nproc-per-node 2 -m interlace.tools.bench --strategies naive sequential fused \
             --tokens 4096 8192 16384 ${BENCH_ARGS:-} --out "$OUT/bench" > "$OUT/bench_fused.log" 2>&1 || status=1 ;;
    fb)    torchrun --nproc-per-node 2 -m interlace.tools.bench --strategies naive sequential fused fused:train \
             --tokens 4096 16384 --configs mixtral-8x7b qwen2-moe --mode fwdbwd ${BENCH_ARGS:-} --out "$OUT/bench_fb" \
             > "$OUT/bench_fused_fb.log" 2>&1 || status=1 ;;
    check) torchrun --nproc-per-node 2 tests/gpu/fused_check.py --steps check stress hidden train_check \
             --check-tokens 1000 4096 \
             --hidden-configs qwen2-moe qwen3-30b-a3b flashdmoe-cfg mixtral-8x7b --hidden-tokens 8192 16384 \
             --out "$OUT" > "$OUT/fused_check.log" 2>&1 || status=1 ;;
    timeline) torchrun --nproc-per-node 2 -m interlace.tools.timeline --config qwen2-moe --tokens 16384 \
             --out "$OUT" > "$OUT/timeline.log" 2>&1 || status=1 ;;
    atma)  torchrun --nproc-per-node 2 tests/gpu/fused_check.py --steps ab \
             --hidden-configs ${AB_CONFIGS:-$PRESETS} --hidden-tokens ${AB_TOKENS:-8192 16384} \
             --variants ${AB_VARIANTS:-default a_tma0=0,a_tma1=0,defer_count=0 a_tma0=0 a_tma1=0 defer_count=0} \
             --rounds ${AB_ROUNDS:-5} --out "$OUT" > "$OUT/atma.log" 2>&1 || status=1
           grep -E '^ab |disagree|FAILED' "$OUT/atma.log" | tail -80 ;;
    ab)    torchrun --nproc-per-node 2 tests/gpu/fused_check.py --steps ab \
             --hidden-configs ${AB_CONFIGS:-$PRESETS} --hidden-tokens ${AB_TOKENS:-8192 16384} \
             --variants ${AB_VARIANTS:-default block_t=64 block_t=128 copy_rows=32 copy_rows=64} --rounds ${AB_ROUNDS:-5} --out "$OUT" \
             > "$OUT/ab.log" 2>&1 || status=1
           grep -E '^ab |disagree|FAILED' "$OUT/ab.log" | tail -80 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
