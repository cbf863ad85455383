"""sm90 build of the W > 1 persistent kernel (run by tests/kernels/test_persistent_dist.py, without the
interpreter): prints BLOCK_M,E_PAD,EL_PAD,TOP_K[,TIMELINE[,BLOCK_N1[,ROUND_LOGITS[,WIDE[,CAPACITY[,FP8]]]]]], registers and
spill stack bytes and shared memory per spec (WIDE 1: the wide tiles, config.WIDE_TILES on WIDE_WARPS with TMA weights, SwiGLU
joint unless FP8; FP8 1: e4m3 expert weights and their fp32 block scales, W_FP8)."""
import os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from interlace.kernels.persistent.dist_kernel import persistent_dist_kernel as kernel
from interlace.kernels.persistent.dist_launch import DIST_BLOCK_G, INDEX_BLOCK, LOGITS_TILE, WIDE_LOGITS_TILE
from interlace.kernels.persistent.config import WIDE_TILES, WIDE_WARPS, PersistentKernelConfig, wide_stages

names = [p.name for p in kernel.params]
fp = {"rw_ptr": "*fp32", "bias_ptr": "*fp32", "wt_ptr": "*fp32", "logits_ptr": "*fp32", "w_up_scale_ptr": "*fp32",
      "w_down_scale_ptr": "*fp32"}
bf16 = {"x_ptr", "w_up_ptr", "w_down_ptr", "out_ptr", "h_ptr"}
i64 = {"recv_table", "amap_table", "ret_table", "counts_table", "sent_table", "done_table", "timeline_ptr", "timeline_clock"}
def kind(n, p, fp8):
    if p.is_constexpr:
        return "constexpr"
    if n in i64:
        return "*i64"  # (the timeline's records and clock too: unused with TIMELINE 0)
    if fp8 and n in ("w_up_ptr", "w_down_ptr"):
        return "*fp8e4nv"
    if n.endswith("_ptr"):
        return fp.get(n, "*bf16" if n in bf16 else "*i32")
    return "fp32" if n == "scale" else "i64" if n == "timeout_ns" else "i32"
DIVISIBLE = {"N", "K", "UP", "E", "E_loc", "max_tokens"}
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
config = PersistentKernelConfig()
for spec in sys.argv[1:]:
    block_m, e_pad, el_pad, top_k, timeline, n1, rounding, wide, capacity, fp8 = (list(map(int, spec.split(","))) + [0] * 6)[:10]
    sig = {n: kind(n, p, fp8) for n, p in zip(names, kernel.params)}
    k0, n0, default_n1, k1 = WIDE_TILES if wide else config.tiles(block_m)
    warps, stages = (WIDE_WARPS, wide_stages(block_m)) if wide else (config.num_warps, config.num_stages)
    n1 = n1 or default_n1
    logits_tile = WIDE_LOGITS_TILE if wide else LOGITS_TILE
    consts = dict(TOP_K=top_k, K_PAD=top_k, E_PAD=e_pad, EL_PAD=el_pad, BLOCK_T=logits_tile[0], BLOCK_TK=4, BLOCK_E=logits_tile[1], BLOCK_G=DIST_BLOCK_G,
                  BLOCK_S=config.block_s, BLOCK_NS=config.block_ns,
                  BLOCK_A=INDEX_BLOCK, G_CHUNK=max(1, min(16, 4096 // e_pad)), LS_MAX=8, BLOCK_J=max(16, min(64, 2048 // el_pad)),
                  BLOCK_M=block_m, BLOCK_K0=k0, BLOCK_N0=n0,
                  BLOCK_N1=n1, BLOCK_K1=k1, BLOCK_TC=16, BLOCK_NC=128, SOFTMAX=False, HAS_BIAS=True,
                  RENORMALIZE=True, ACTIVATION=0, W_PIECES=3, DOT_FP32=False, CLOCK=True, TIMELINE=timeline,
                  ROUND_LOGITS=rounding, W_TMA=bool(wide), JOINT=bool(wide) and not fp8, CAPACITY=bool(capacity),
                  W_FP8=bool(fp8))
    # (as a launch specializes them: pointers, and the shape arguments that are multiples of 16 at
    # every preset; without the hints the build loads the weights 2 bytes at a time, unpipelined)
    src = ASTSource(kernel, sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in names
                           if n not in consts and (n.endswith(("_ptr", "_table")) or n in DIVISIBLE)})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 128),
                              options=dict(num_warps=warps, num_stages=stages))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    print(spec, regs, stack, compiled.metadata.shared, flush=True)
