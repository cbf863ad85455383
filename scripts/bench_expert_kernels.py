"""Single-GPU check and timing of the expert block: torch path vs interlace's Triton grouped GEMMs.

    python scripts/bench_expert_kernels.py [--tokens 4096 16384] [--world 2]

For every BENCHMARKS.md config, rows = tokens·k received rows spread evenly over E/world local
experts, read through a random gather index (as after the all-to-all). Checks the Triton output
against the torch path (bf16, relative error) and times both with triton.testing.do_bench
(median), reporting TFLOP/s of the three expert GEMMs (×3 with --backward) and the first call's
compile time.
"""

import argparse
import time

import torch
import triton

from interlace.bench.harness import bench_config
from interlace.config import PRESETS
from interlace.experts import init_expert_weights
from interlace.ops.grouped_gemm import TritonExpertFFN
from interlace.ops.rows import PermuteRows
from interlace.strategies.sequential import expert_ffn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--world", type=int, default=2, help="experts per GPU = E / world")
    p.add_argument("--configs", nargs="+", default=list(PRESETS))
    p.add_argument("--backward", action="store_true", help="time forward+backward (grads of x and weights)")
    args = p.parse_args()
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| config | tokens | rows | torch ms | triton ms | torch TFLOP/s | triton TFLOP/s | speedup | rel err | first call s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.configs:
        cfg = bench_config(name, small=False)
        E_local = cfg.num_experts // args.world
        w_up, w_down = init_expert_weights(cfg, range(E_local), 0, dev)
        for T in args.tokens:
            rows = T * cfg.top_k
            counts = torch.full((E_local,), rows // E_local, dtype=torch.int32)
            counts[: rows % E_local] += 1
            ends = counts.cumsum(0).to(torch.int32).to(dev)
            x = torch.randn(rows, cfg.hidden, device=dev).to(cfg.dtype)
            src = torch.randperm(rows, device=dev).to(torch.int32)

            inverse = torch.empty_like(src)
            inverse[src.long()] = torch.arange(rows, device=dev, dtype=torch.int32)
            grad = torch.randn(rows, cfg.hidden, device=dev).to(cfg.dtype)
            leaves = [t.detach().requires_grad_(args.backward) for t in (x, w_up, w_down)]

            def torch_path():
                xl, wu, wd = leaves
                y = expert_ffn(PermuteRows.apply(xl, src, inverse), wu, wd, ends, cfg.activation)
                if args.backward:
                    y.backward(grad)
                return y

            def triton_path():
                xl, wu, wd = leaves
                y = TritonExpertFFN.apply(xl, wu, wd, src, 1, rows, ends, cfg.activation, inverse)
                if args.backward:
                    y.backward(grad)
                return y

            t0 = time.perf_counter()
            y_tri = triton_path()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            y_ref = torch_path()
            err = ((y_tri.detach().float() - y_ref.detach().float()).norm() / y_ref.detach().float().norm()).item()
            t_torch = triton.testing.do_bench(torch_path, warmup=25, rep=100, return_mode="median")
            t_tri = triton.testing.do_bench(triton_path, warmup=25, rep=100, return_mode="median")
            flops = 2 * rows * cfg.hidden * cfg.ffn * 3 * (3 if args.backward else 1)
            print(f"| {name} | {T} | {rows} | {t_torch:.3f} | {t_tri:.3f} | {flops / t_torch / 1e9:.0f} | "
                  f"{flops / t_tri / 1e9:.0f} | {t_torch / t_tri:.2f} | {err:.1e} | {first:.1f} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
