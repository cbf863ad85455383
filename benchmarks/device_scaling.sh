#!/usr/bin/env bash
# One call per machine size (2, 4 or 8 GPUs; W = the GPUs visible). Steps:
#   check    every strategy (naive, sequential, pipelined:3, fused, fused:train) against an fp32
#            reference at EP=W, forward and backward, all routing cases (tests/gpu/gpu_check.py)
#   tune     the fused strategy's block split (every candidate of tune_fused, 4–48) at this world
#            size into .scaling/tuning (H200 tables ship for W = 2 and 4; without one the fused rows
#            run the default split, with a warning). Run it before profile: profile times fused
#            beside sequential with the split tune finds
#   profile  `interlace profile` at this world size into .scaling/profiles (pipelined's chosen
#            degree needs a profile for W; H200 profiles ship for W = 2 and 4); later steps read it
#   fwd      the forward table (docs/benchmarking.md) at EP=W: naive, sequential, pipelined (chosen degree), fused,
#            auto (the planner's pick with the profile step's fused/sequential pairs)
#   fb       forward+backward table at EP=W (mixtral-8x7b, qwen2-moe; fused:train = the fused backward)
#   hidden   fused communication-hidden percentage (tests/gpu/fused_check.py --steps hidden)
#   mesh     EP×TP factorisations of W for mixtral-8x7b at a fixed layer token count M = 8192 (COMET
#            Fig. 12) and 32768 (each rank holds M / EP; benchmarks/mesh_bench.py)
# Weak scaling T(2)/T(W) at fixed tokens/GPU: run on each machine size, then
#   python benchmarks/scaling_report.py OUT_2GPU/fwd/results.json OUT_WGPU/fwd/results.json
# usage (first call on a machine size: check tune profile):
#   [STEP_TIMEOUT=S] bash benchmarks/device_scaling.sh STEP [STEP ...]
# Each step runs under `timeout` (default 280 s) so one slow or stuck step cannot eat the whole call;
# its wall seconds and the status so far (0 while every step passed) go to $OUT/steps.txt.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench-out}
W=${W:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
mkdir -p "$OUT"
# Measured profile and tuning live in the tree (git-ignored), not in $OUT: a later call on the
# same machine (the device tool empties $OUT per call) reads them; each step's end copies them to $OUT.
export INTERLACE_PROFILE_DIR=${INTERLACE_PROFILE_DIR:-$PWD/.scaling/profiles}
export INTERLACE_TUNING_DIR=${INTERLACE_TUNING_DIR:-$PWD/.scaling/tuning}
mkdir -p "$INTERLACE_PROFILE_DIR" "$INTERLACE_TUNING_DIR"
STEP_TIMEOUT=${STEP_TIMEOUT:-280}
torchrun() { timeout -k 15 "$STEP_TIMEOUT" python3 -m torch.distributed.run "$@"; }
status=0
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    check)  torchrun --nproc-per-node "$W" tests/gpu/gpu_check.py > "$OUT/check.log" 2>&1 || status=1
            tail -1 "$OUT/check.log" ;;
    profile) torchrun --nproc-per-node "$W" -m interlace.tools.cli profile --configs mixtral-8x7b phi3.5-moe qwen2-moe \
              qwen3-30b-a3b dsv3-like flashdmoe-cfg > "$OUT/profile.log" 2>&1 || status=1 ;;
    tune)   torchrun --nproc-per-node "$W" -m interlace.tools.tune_fused --tokens 4096 16384 \
              --iters 8 > "$OUT/tune.log" 2>&1 || status=1 ;;
    fwd)    torchrun --nproc-per-node "$W" -m interlace.tools.bench --strategies naive sequential pipelined fused auto \
              --tokens 4096 8192 16384 --out "$OUT/fwd" > "$OUT/fwd.log" 2>&1 || status=1 ;;
    fb)     torchrun --nproc-per-node "$W" -m interlace.tools.bench --strategies naive sequential pipelined fused fused:train \
              --tokens 4096 16384 --configs mixtral-8x7b qwen2-moe --mode fwdbwd --interleave --out "$OUT/fb" \
              > "$OUT/fb.log" 2>&1 || status=1 ;;
    hidden) torchrun --nproc-per-node "$W" tests/gpu/fused_check.py --steps hidden \
              --hidden-configs qwen2-moe qwen3-30b-a3b flashdmoe-cfg mixtral-8x7b --hidden-tokens 8192 16384 \
              --out "$OUT" > "$OUT/hidden.log" 2>&1 || status=1 ;;
    mesh)   torchrun --nproc-per-node "$W" benchmarks/mesh_bench.py --config mixtral-8x7b --layer-tokens 8192 32768 --out "$OUT" \
              > "$OUT/mesh.log" 2>&1 || status=1 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
  echo "$step $(( $(date +%s) - t0 )) s status-so-far $status" | tee -a "$OUT/steps.txt"
  mkdir -p "$OUT/profiles" "$OUT/tuning"
  cp -r "$INTERLACE_PROFILE_DIR"/. "$OUT/profiles/" 2>/dev/null
  cp -r "$INTERLACE_TUNING_DIR"/. "$OUT/tuning/" 2>/dev/null
done
exit $status
