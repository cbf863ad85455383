"""The expert block's four backward GEMMs one by one: interlace's kernels against torch._grouped_mm's
(CUTLASS on Hopper), on the bench's rows (one GPU's share of a ``--world``-GPU layer, balanced routing).

Torch's kernels are timed as its autograd runs them in the torch block: the graph of one grouped GEMM
is built once, and ``torch.autograd.grad`` with respect to one input alone runs that input's kernel
(the data gradient or the weight gradient). Interlace's are ``backward_steps``' launches, as the bench's
``--breakdown`` times them (d_pre_act includes the SwiGLU derivative's pass; dw_up the gather copy of
x's rows; torch's SwiGLU backward and gather are separate kernels, not in its columns). ``do_bench``
medians, rounds interleaved.

    python scripts/wgrad_vs_cutlass.py [--configs dsv3-like qwen3-30b-a3b ...] [--tokens 4096] [--rounds 3]
"""

import argparse
import statistics

import torch
import triton

from bench_expert_kernels import bench_rows, breakdown


def torch_backward_kernels(cfg, x, w_up, w_down, index):
    """{name: callable} running one of torch's four backward grouped GEMMs each."""
    roa, aor, ends, rows = index
    k = roa.shape[1]
    dev = x.device
    x_rows = x[(aor[:rows] // k).long()]
    h_width, K, N = w_up.shape[1], w_down.shape[2], cfg.hidden
    act = torch.randn(rows, K, device=dev).to(x.dtype)
    dy = torch.randn(rows, N, device=dev).to(x.dtype)
    d_h = torch.randn(rows, h_width, device=dev).to(x.dtype)
    offs = ends.to(torch.int32)

    def graph(a, w, grad):
        a = a.detach().requires_grad_()
        w = w.detach().requires_grad_()
        y = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
        return (lambda: torch.autograd.grad(y, [a], grad, retain_graph=True),
                lambda: torch.autograd.grad(y, [w], grad, retain_graph=True))

    d_act, dw_down = graph(act, w_down, dy)  # GEMM1: y = act @ W_downᵀ
    dx, dw_up = graph(x_rows, w_up, d_h)  # GEMM0: h = x_rows @ W_upᵀ
    return {"d_pre_act": d_act, "dw_down": dw_down, "dw_up": dw_up, "dx": dx}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", default=["dsv3-like", "qwen3-30b-a3b", "flashdmoe-cfg", "qwen2-moe",
                                                      "phi3.5-moe", "mixtral-8x7b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[4096])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print("| config | tokens | kernel | torch ms | interlace ms | torch TFLOP/s | interlace TFLOP/s | interlace ÷ torch time |")
    print("|---|---|---|---|---|---|---|---|")
    for name, cfg, T, w_up, w_down, weights, index, x, grad in bench_rows(args):
        rows = index[3]
        flops = {"d_pre_act": 2 * rows * cfg.hidden * cfg.ffn, "dw_down": 2 * rows * cfg.hidden * cfg.ffn,
                 "dw_up": 2 * rows * w_up.shape[1] * cfg.hidden, "dx": 2 * rows * w_up.shape[1] * cfg.hidden}
        theirs = torch_backward_kernels(cfg, x, w_up, w_down, index)
        t_torch = {n: [] for n in theirs}
        t_ours = {n: [] for n in theirs}
        for _ in range(args.rounds):
            for n, fn in theirs.items():
                t_torch[n].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
            for n, (ms, _) in breakdown(cfg, x, w_up, w_down, index).items():
                if n in t_ours:
                    t_ours[n].append(ms)
        for n in theirs:
            a, b = statistics.median(t_torch[n]), statistics.median(t_ours[n])
            print(f"| {name} | {T} | {n} | {a:.3f} | {b:.3f} | {flops[n] / a / 1e9:.0f} | {flops[n] / b / 1e9:.0f} | "
                  f"{b / a:.3f} |", flush=True)
        del theirs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
