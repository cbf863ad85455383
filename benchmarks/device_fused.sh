#!/usr/bin/env bash
# Device calls on the 2×H200 machine for the fused (COMET) strategy. Steps:
#   tune     interlace tune (block split) for the BENCHMARKS presets → $OUT/tuning (used by later steps)
#   bench    BENCHMARKS.md forward table: naive, sequential, fused at 4096/8192/16384 tokens
#   fb       forward+backward rows for mixtral-8x7b and qwen2-moe (fused: sequential's training path;
#            fused:train: the fused kernels backward too)
#   check    tests/gpu/fused_check.py: every preset against naive/sequential, 1000-call stress, hidden %
#   timeline per-block timeline PNGs of one qwen2-moe call per rank
#   atma     fused kernel-config variants (AB_VARIANTS; default: the A rows through TMA, a_tma0 for
#            layer0's remote tiles and a_tma1 for layer1's h rows, and layer1's deferred tile counts,
#            defer_count, each switched off) interleaved round by round with the default, sequential
#            and the bare transfers (fused_check ab): time, ratio to the default, hidden share, check
#   ab       the same A/B for any variants (AB_VARIANTS: INTERLACE_FUSED fields, plus n_comm /
#            n_comm1 for the block split, e.g. "default copy_rows=64,n_comm=8"); default: wider
#            combine tasks (block_t 64, 128) and taller send copy steps (copy_rows 32, 64) on every
#            preset (run 53: neither gained)
#   pull     layer1 in pull mode (combine_pull=1: GEMM1 tiles stored locally, the homes' combine
#            programs load the rows from their owners): gpu_check.py with it, then the A/B against
#            the default with more combine programs (n_comm1 8, 16, 24) on the small-expert presets
#   push     layer1 in push mode (combine_push=1: GEMM1 tiles with a remote home staged locally, the
#            combine programs push them home as they are ready): gpu_check.py with it, the same A/B,
#            then qwen3-30b-a3b 8192 timelines: the default, push mode, push mode with n_comm1 16
# usage: bash benchmarks/device_fused.sh STEP [STEP ...]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench-out}
export INTERLACE_TUNING_DIR=${INTERLACE_TUNING_DIR:-$OUT/tuning}
mkdir -p "$OUT" "$INTERLACE_TUNING_DIR"
PRESETS="mixtral-8x7b phi3.5-moe qwen2-moe qwen3-30b-a3b dsv3-like flashdmoe-cfg"
status=0

# layer1_mode MODE FIELD: gpu_check.py with INTERLACE_FUSED=FIELD=1, then the A/B of that layer1 mode
# against the default with 8-24 combine programs on the small-expert presets (log: $OUT/MODE.log).
layer1_mode() {
  local mode=$1 f=$2
  INTERLACE_FUSED=$f=1 torchrun --nproc-per-node 2 tests/gpu/gpu_check.py > "$OUT/check_$mode.log" 2>&1 || status=1
  tail -1 "$OUT/check_$mode.log"
  torchrun --nproc-per-node 2 tests/gpu/fused_check.py --steps ab \
    --hidden-configs ${AB_CONFIGS:-qwen2-moe qwen3-30b-a3b flashdmoe-cfg} --hidden-tokens ${AB_TOKENS:-8192 16384} \
    --variants ${AB_VARIANTS:-default $f=1 $f=1,n_comm1=8 $f=1,n_comm1=16 $f=1,n_comm1=24} \
    --rounds ${AB_ROUNDS:-5} --out "$OUT" > "$OUT/$mode.log" 2>&1 || status=1
  grep -E '^ab |disagree|FAILED' "$OUT/$mode.log" | tail -80
}

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
    pull)  layer1_mode pull combine_pull ;;
    push)  layer1_mode push combine_push
           for v in ${PUSH_TIMELINES:-default push push16}; do  # push16: push mode with 16 combine programs
             mkdir -p "$OUT/timeline_$v"
             INTERLACE_FUSED=$([ $v = default ] || echo combine_push=1) torchrun --nproc-per-node 2 \
               -m interlace.tools.timeline --config qwen3-30b-a3b --tokens 8192 \
               $([ $v = push16 ] && echo --n-comm1 16) --out "$OUT/timeline_$v" > "$OUT/timeline_$v.log" 2>&1 || status=1
             grep -E '^\|' "$OUT/timeline_$v.log" | tail -3; grep -E 'layer median' "$OUT/timeline_$v.log"
           done ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
