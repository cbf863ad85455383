"""Single-GPU check and timing of the FP8 (W8A8, 128 × 128 block scales) expert block against bf16.

    python benchmarks/fp8_experts.py [--presets ...] [--tokens 128 512 4096 16384] [--world 2] [--json F]

The block is what ``sequential`` runs at world size 1 on one GPU's share of a W-GPU layer: T
tokens routed to k of the E/W local experts ("balanced" routing), dispatch, the two expert
GEMMs with the activation, and the weighted top-k combine. Three variants, interleaved in
rounds (each round times each variant once with ``do_bench``; medians over rounds):

* ``bf16:torch`` — gather + ``torch._grouped_mm`` + SwiGLU + ``torch._grouped_mm``;
* ``bf16:triton`` — interlace's Triton GEMMs (gather fused into GEMM0's A load);
* ``fp8:triton`` — interlace's W8A8 Triton kernels (:mod:`interlace.kernels.expert_gemm.fp8`);
* ``fp8:blockwise`` — cuBLAS's block-scaled GEMM per expert (:mod:`~interlace.kernels.expert_gemm.fp8_blockwise`);
* ``fp8`` — what ``expert_ffn_fp8`` picks (``backend="auto"``).

Correctness, per row before timing: the FP8 block against the fp32 reference of the same
arithmetic (:func:`interlace.fp8.expert_ffn_fp8_reference`, end to end relative Frobenius error
≤ 3e-2: tests/gpu/fp8_check.py says why and checks each GEMM tighter), and against the fp32 block
of the bf16 weights it was quantized from
(reported: what block FP8 costs). Floors (``../shared/BENCHMARKS.md``): max(FLOPs ÷ matmul peak,
touched expert weight bytes ÷ HBM read bandwidth); FP8 bytes are 1 per element plus the fp32
block scales, its FLOPs term uses an e4m3 ``torch._scaled_mm`` of 8192³ measured in the run.
"""

import argparse
import json
import statistics
import time

import torch
import triton

from interlace.config import PRESETS
from interlace.experts import init_expert_weights
from interlace.fp8 import expert_ffn_fp8_reference, quantize_weight
from interlace.kernels.expert_gemm.autograd import TritonExpertFFN
from interlace.kernels.expert_gemm.fp8 import expert_ffn_fp8
from interlace.kernels.expert_gemm.fp8_blockwise import supports_blockwise
from interlace.kernels.routing_index import build_dispatch_index
from interlace.kernels.rows import CombineRows, DispatchRows
from interlace.strategies.sequential import expert_ffn


def balanced_routing(T: int, k: int, E: int, dev):
    """(T, k) expert ids, each expert chosen T·k/E times (±1), distinct per token when k ≤ E,
    tokens shuffled; fp32 softmax routing weights."""
    perm = torch.randperm(T, device=dev)
    idx = ((perm[:, None] * k + torch.arange(k, device=dev)[None, :]) % E).to(torch.int32)
    return idx, torch.softmax(torch.randn(T, k, device=dev), dim=-1)


def block(variant: str, x, weights, index, w, activation: str):
    """x (T, N) → (T, N): dispatch, expert FFN, combine, with the variant's weights ``w``."""
    row_of_assignment, assignment_of_row, ends, rows = index
    k = row_of_assignment.shape[1]
    if variant.startswith("fp8"):
        y = expert_ffn_fp8(x, assignment_of_row, k, rows, w[0], w[1], ends, activation,
                           backend=variant[4:] or "auto")
    elif variant == "bf16:triton":
        y = TritonExpertFFN.apply(x, w[0], w[1], assignment_of_row, k, rows, ends, activation, row_of_assignment, None)
    else:
        y = expert_ffn(DispatchRows.apply(x, assignment_of_row, row_of_assignment), w[0], w[1], ends, activation)
    return CombineRows.apply(y, weights, row_of_assignment, x.dtype)


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def hbm_read_tbps(dev) -> float:
    buf = torch.ones(2 << 30, dtype=torch.bfloat16, device=dev)
    ms = bench_ms(lambda: torch.sum(buf, dtype=torch.float32))
    del buf
    return (4 << 30) / (ms * 1e-3) / 1e12


def matmul_tflops(dev, fp8: bool, n: int = 8192) -> float:
    a = torch.randn(n, n, device=dev).to(torch.bfloat16)
    b = torch.randn(n, n, device=dev).to(torch.bfloat16)
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        fn = lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        fn = lambda: a @ b  # noqa: E731
    return 2 * n**3 / (bench_ms(fn) * 1e-3) / 1e12


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def fp32_dense_block(x, weights, index, w_up, w_down, activation, limit: int = 4096):
    """The fp32 block of the dense weights on the first ``limit`` rows' tokens (a memory bound)."""
    from interlace.kernels.activation import activation_reference

    row_of_assignment, assignment_of_row, ends, rows = index
    k = row_of_assignment.shape[1]
    bounds = [0] + ends.tolist()
    y = torch.zeros(rows, x.shape[1], device=x.device)
    for e in range(w_up.shape[0]):
        s, t = bounds[e], bounds[e + 1]
        if t > s:
            xs = x[assignment_of_row[s:t].long() // k].float()
            y[s:t] = activation_reference(xs @ w_up[e].float().t(), activation) @ w_down[e].float().t()
    return (y[row_of_assignment.long()] * weights[..., None]).sum(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["mixtral-8x7b", "phi3.5-moe", "qwen2-moe", "qwen3-30b-a3b",
                                                           "dsv3-like", "flashdmoe-cfg"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[128, 512, 4096, 16384])
    parser.add_argument("--world", type=int, default=2, help="the block is one GPU's share of a layer over W GPUs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "hbm_read_tbps": hbm_read_tbps(dev), "bf16_tflops": matmul_tflops(dev, False),
            "fp8_tflops": matmul_tflops(dev, True), "world_share": args.world,
            "date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/fp8_experts.py " + " ".join(
                f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()
                if v is not None and k != "json")}
    print(json.dumps(meta), flush=True)
    rows = []
    for name in args.presets:
        cfg = PRESETS[name]
        E = cfg.num_experts // args.world
        w_up, w_down = init_expert_weights(cfg, range(E), seed=1, device=dev, dtype=torch.bfloat16)
        q_up, q_down = quantize_weight(w_up), quantize_weight(w_down)
        weights_of = {"bf16:torch": (w_up, w_down), "bf16:triton": (w_up, w_down), "fp8:triton": (q_up, q_down),
                      "fp8:blockwise": (q_up, q_down), "fp8": (q_up, q_down)}
        if not supports_blockwise(w_up, q_up, q_down):
            del weights_of["fp8:blockwise"]
        elems = w_up[0].numel() + w_down[0].numel()
        scale_elems = q_up.scale_inv[0].numel() + q_down.scale_inv[0].numel()
        for T in args.tokens:
            idx, weights = balanced_routing(T, cfg.top_k, E, dev)
            row_of_assignment, assignment_of_row, _, ends = build_dispatch_index(idx, E, None)
            index = (row_of_assignment, assignment_of_row, ends, T * cfg.top_k)
            x = torch.randn(T, cfg.hidden, device=dev).to(torch.bfloat16)
            with torch.no_grad():
                y8 = {v: block(v, x, weights, index, (q_up, q_down), cfg.activation)
                      for v in ("fp8:triton", "fp8:blockwise") if v in weights_of}
                sub = min(T, 1024)  # the references on the first tokens' rows (memory)
                idx_s, _ = idx[:sub], None
                r_s, a_s, _, e_s = build_dispatch_index(idx_s, E, None)
                ref = CombineRows.apply(expert_ffn_fp8_reference(x[:sub][a_s.long() // cfg.top_k], q_up, q_down, e_s,
                                                                 cfg.activation, torch.float32),
                                        weights[:sub], r_s, torch.float32)
                err_ref = {v: rel(y[:sub], ref) for v, y in y8.items()}
                dense = fp32_dense_block(x[:sub], weights[:sub], (r_s, a_s, e_s, sub * cfg.top_k), w_up, w_down,
                                         cfg.activation)
                err_dense = {v: rel(y[:sub], dense) for v, y in y8.items()}
                y16 = block("bf16:triton", x, weights, index, (w_up, w_down), cfg.activation)
                err_bf16 = rel(y16[:sub], dense)
            touched = int((torch.bincount(idx.flatten().long(), minlength=E) > 0).sum())
            flops = 2 * T * cfg.top_k * cfg.hidden * (cfg.up_width + cfg.ffn)
            floors = {}
            for variant in weights_of:
                fp8 = variant.startswith("fp8")
                wbytes = touched * (elems + 4 * scale_elems if fp8 else 2 * elems)
                floors[variant] = max(flops / (meta["fp8_tflops" if fp8 else "bf16_tflops"] * 1e9),
                                      wbytes / (meta["hbm_read_tbps"] * 1e9))
            times = {v: [] for v in weights_of}
            with torch.no_grad():
                for _ in range(args.rounds):
                    for variant, w in weights_of.items():
                        times[variant].append(bench_ms(lambda: block(variant, x, weights, index, w, cfg.activation)))
            best16 = min(statistics.median(times["bf16:torch"]), statistics.median(times["bf16:triton"]))
            for variant in weights_of:
                ms = statistics.median(times[variant])
                row = {"config": name, "tokens": T, "mode": "fwd", "strategy": variant, "median_ms": ms,
                       "x_floor": ms / floors[variant], "floor_ms": floors[variant],
                       "speedup_vs_best_bf16": best16 / ms,
                       "rounds_ms": times[variant]}
                if variant in err_ref:
                    row.update(err_vs_fp8_reference=err_ref[variant], err_vs_dense_fp32=err_dense[variant],
                               check="PASS" if err_ref[variant] <= 3e-2 else "FAIL")
                else:
                    row["err_vs_dense_fp32"] = err_bf16 if variant == "bf16:triton" else None
                rows.append(row)
                print(json.dumps(row), flush=True)
            del x, idx, weights, index
        del w_up, w_down, q_up, q_down, weights_of
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{'preset':15} {'T':>6} {'variant':14} {'ms':>8} {'x floor':>8} {'vs bf16':>8} {'err ref':>8} "
          f"{'err dense':>9}")
    for r in rows:
        print(f"{r['config']:15} {r['tokens']:6} {r['strategy']:14} {r['median_ms']:8.3f} {r['x_floor']:8.2f} "
              f"{r['speedup_vs_best_bf16']:8.2f} {r.get('err_vs_fp8_reference') or 0:8.1e} "
              f"{r.get('err_vs_dense_fp32') or 0:9.1e} {r.get('check', '')}")


if __name__ == "__main__":
    main()
