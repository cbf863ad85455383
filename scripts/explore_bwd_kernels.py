"""Variants of the Triton backward's kernels, timed one by one on one GPU (issue 3 exploration).

    python scripts/explore_bwd_kernels.py [--configs mixtral-8x7b qwen2-moe dsv3-like] [--tokens 4096]

Per config (one GPU's share of a 2-GPU layer, balanced routing, as scripts/bench_expert_kernels.py):
the d(pre-activation) GEMM and the two weight-gradient kernels under each variant (a config
``bm,bn,bk,warps,stages[,group_m[,flatten[,unfused_act]]]``; ``plain`` = the tuned GEMM without
the SwiGLU-gradient epilogue, for reference: what the epilogue costs), each output
compared with the tuned config's (relative error), ``do_bench`` medians. A table per kernel.
"""

import argparse

import torch
import triton

from interlace.bench.harness import bench_config
from interlace.experts import init_expert_weights
from interlace.ops import grouped_gemm as gg
from interlace.ops.routing_index import build_dispatch_index
from interlace.ops.rows import gather_rows
from interlace.ops.tuning import GemmConfig

ACT_VARIANTS = ["tuned", "plain", "128,128,64,8,4", "128,128,64,8,3", "128,128,128,8,3", "128,128,64,8,4,8,0,1",
                "128,128,64,8,3,8,0,1", "128,128,128,8,3,8,0,1", "128,256,64,8,3,8,0,1"]
WGRAD_VARIANTS = ["tuned", "128,256,64,8,3", "256,128,64,8,3", "128,128,64,8,3", "128,128,128,8,3",
                  "128,128,64,4,3", "128,128,32,4,4", "64,128,64,4,4", "128,128,64,8,3,16"]


def parse(v, tuned):
    return tuned if v == "tuned" else GemmConfig(*(int(t) for t in v.split(",")))


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", default=["mixtral-8x7b", "qwen2-moe", "dsv3-like"])
    p.add_argument("--tokens", nargs="+", type=int, default=[4096])
    args = p.parse_args()
    dev = torch.device("cuda")
    gg._ensure_allocator()
    rows_out = []
    for name in args.configs:
        cfg = bench_config(name, small=False)
        E = cfg.num_experts // 2
        w_up, w_down = init_expert_weights(cfg, range(E), 0, dev)
        for T in args.tokens:
            k = cfg.top_k
            perm = torch.randperm(T, device=dev)
            idx = ((perm[:, None] * k + torch.arange(k, device=dev)[None, :]) % E).to(torch.int32)
            roa, aor, _, ends = build_dispatch_index(idx, E, None)
            R = T * k
            x = torch.randn(T, cfg.hidden, device=dev).to(cfg.dtype)
            dy = torch.randn(R, cfg.hidden, device=dev).to(cfg.dtype)
            _, h, act = gg.expert_ffn_triton(x, aor, k, R, w_up, w_down, ends, cfg.activation, store_h=True,
                                             return_act=True)
            c_act, c_dx, c_w, _ = gg.choose_backward_configs(dy, w_down, R, cfg.activation)
            K = w_down.shape[2]
            up = w_up.shape[1]
            tma = gg.use_tma(w_up, w_down)
            flops_act = 2 * R * cfg.hidden * K
            ref = None
            for v in ACT_VARIANTS:
                plain = v == "plain"
                conf = parse("tuned" if plain else v, c_act)
                out = torch.empty((R, K if plain else up), device=dev, dtype=cfg.dtype)

                def run():
                    if plain:
                        gg._launch_gemm(dy, w_down, out, None, ends, R, cols=K, red=cfg.hidden, b_trans=False,
                                        epilogue=0, config=conf, tma=tma)
                    else:
                        sched = gg.tile_schedule(ends, R, conf.block_m)
                        gg._launch_d_pre_act(dy, w_down, out, h, ends, R, cfg.hidden, K, cfg.activation, conf,
                                             sched, tma)
                try:
                    out.fill_(float("nan"))
                    run()
                    err = float("nan") if plain else (0.0 if ref is None else rel(out, ref))
                    if ref is None:
                        ref = out.clone()
                    ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                    rows_out.append((name, T, "d_pre_act", v, conf, ms, flops_act / ms / 1e9, err))
                except Exception as e:  # noqa: BLE001 (exploration: report and go on)
                    rows_out.append((name, T, "d_pre_act", v, conf, float("nan"), float("nan"), str(e)[:60]))
                print(rows_out[-1], flush=True)
            xg = gather_rows(x, aor[:R], k)
            d_h = ref
            for kernel, a, b, P, Q in (("dw_down", dy, act, cfg.hidden, K), ("dw_up", d_h, xg, up, cfg.hidden)):
                out = torch.empty((E, P, Q), device=dev, dtype=cfg.dtype)
                wref = None
                for v in WGRAD_VARIANTS:
                    conf = parse(v, c_w)

                    def run():
                        gg._launch_wgrad(a, b, None, 1, out, ends, P, Q, conf)
                    try:
                        out.fill_(float("nan"))
                        run()
                        err = 0.0 if wref is None else rel(out, wref)
                        if wref is None:
                            wref = out.clone()
                        ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                        rows_out.append((name, T, kernel, v, conf, ms, 2 * R * P * Q / ms / 1e9, err))
                    except Exception as e:  # noqa: BLE001
                        rows_out.append((name, T, kernel, v, conf, float("nan"), float("nan"), str(e)[:60]))
                    print(rows_out[-1], flush=True)
            torch.cuda.empty_cache()
    print("\n| config | tokens | kernel | variant | config used | ms | TFLOP/s | rel err vs tuned |")
    print("|---|---|---|---|---|---|---|---|")
    for name, T, kernel, v, conf, ms, tf, err in rows_out:
        c = ",".join(str(x) for x in conf.__dict__.values())
        e = err if isinstance(err, str) else f"{err:.1e}"
        print(f"| {name} | {T} | {kernel} | {v} | {c} | {ms:.3f} | {tf:.0f} | {e} |")


if __name__ == "__main__":
    main()
