"""The FP8 (W8A8) expert kernels on one GPU against the fp32 reference of the same arithmetic.

    python tests/gpu/fp8_check.py

Cases: every preset's expert shape (one GPU's share of 2), token counts from 1 to 4096, ragged
and zero-row experts, N and K not multiples of 128, fp32 and bf16 activations, a NaN token
(its rows NaN, no other), bitwise repeatability, outputs poisoned (NaN) before each run, and
the quantizer kernel bitwise against :func:`interlace.fp8.quantize_rows`.

Tolerances. Hopper's FP8 tensor cores sum a k block's products with about 1.3e-4 relative error
(measured: e4m3 operands, unit scales, K = 128), so GEMM0's output differs from the fp32 sums by
that much, and where a value lies near an e4m3 rounding boundary its quantization (for GEMM1)
rounds to the neighbour. So GEMM0 is checked by its quantized output (fewer than 5% of values
one e4m3 step off, none off by more than 33 units of its group scale, a top step:
:func:`interlace.fp8.act_agreement`), GEMM1 on
that output (relative Frobenius error < 5e-4 fp32, < 5e-3 bf16 output), and the whole block
end to end (< 3e-2: the neighbours' effect).
Prints one line per case and ``N PASS, M FAIL``; exits 1 on a failure.
"""

import sys

import torch

from interlace.config import PRESETS
from interlace.fp8 import BlockFP8Weight, act_agreement, expert_ffn_fp8_reference, quantize_rows, quantize_weight
from interlace.kernels import alloc
from interlace.kernels.expert_gemm.fp8 import expert_ffn_fp8, quantize_rows_fp8
from interlace.kernels.expert_gemm.fp8_blockwise import supports_blockwise

results = []


def report(name: str, ok: bool, detail: str = "") -> None:
    results.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def ragged_ends(rows: int, E: int, dev) -> torch.Tensor:
    """Random expert-major row counts summing to ``rows``, a few experts empty."""
    weights = torch.rand(E) * (torch.rand(E) > 0.2)
    weights[0] += 1e-3
    counts = torch.floor(weights / weights.sum() * rows).long()
    counts[int(torch.argmax(weights))] += rows - int(counts.sum())
    return counts.cumsum(0).to(torch.int32).to(dev)


def case(name, N, K, E, T, k, activation, dtype, dev, q_up=None, q_down=None):
    if q_up is None:
        up_rows = 2 * K if activation == "swiglu" else K
        q_up = quantize_weight(torch.randn(E, up_rows, N, device=dev) / N**0.5)
        q_down = quantize_weight(torch.randn(E, N, K, device=dev) / K**0.5)
    R = T * k
    ends = ragged_ends(R, E, dev)
    x = torch.randn(T, N, device=dev).to(dtype)
    gather = torch.randperm(R, device=dev).to(torch.int32)
    y, act = expert_ffn_fp8(x, gather, k, R, q_up, q_down, ends, activation, return_act=True, backend="triton")
    rows = x[gather.long() // k]
    ref, ref_act = expert_ffn_fp8_reference(rows, q_up, q_down, ends, activation, torch.float32, return_act=True)
    flipped, units = act_agreement(act, ref_act)
    down_ref = expert_ffn_fp8_reference(rows, q_up, q_down, ends, activation, torch.float32, act=act)
    err_down, err = rel(y, down_ref), rel(y, ref)
    again = expert_ffn_fp8(x, gather, k, R, q_up, q_down, ends, activation, backend="triton")
    bound = 5e-4 if dtype == torch.float32 else 5e-3
    ok = (flipped < 5e-2 and units <= 33 and err_down < bound and err < 3e-2 and not y.isnan().any()
          and torch.equal(y, again))
    report(f"{name} T={T} {str(dtype)[6:]}", ok,
           f"act: {flipped:.1e} one step off (< 5e-2), largest {units:.1f} scale units (<= 33); GEMM1 on it rel "
           f"{err_down:.1e} (< {bound:g}); end to end rel {err:.1e} (< 3e-2); repeatable {torch.equal(y, again)}")


def blockwise_case(name, q_up, q_down, T, k, activation, dev):
    """cuBLAS's per-expert block-scaled GEMMs (backend "blockwise") end to end against the
    reference (< 3e-2: GEMM0's bf16 output moves activation values one e4m3 step), repeatable."""
    E, N = q_up.shape[0], q_down.shape[1]
    R = T * k
    ends = ragged_ends(R, E, dev)
    x = torch.randn(T, N, device=dev).bfloat16()
    gather = torch.randperm(R, device=dev).to(torch.int32)
    y = expert_ffn_fp8(x, gather, k, R, q_up, q_down, ends, activation, backend="blockwise")
    ref = expert_ffn_fp8_reference(x[gather.long() // k], q_up, q_down, ends, activation, torch.float32)
    again = expert_ffn_fp8(x, gather, k, R, q_up, q_down, ends, activation, backend="blockwise")
    err = rel(y, ref)
    ok = err < 3e-2 and not y.isnan().any() and torch.equal(y, again)
    report(f"blockwise {name} T={T}", ok, f"end to end rel {err:.1e} (< 3e-2); repeatable {torch.equal(y, again)}")


def main() -> int:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    alloc.poison(True)
    for cols in (128, 200, 7168):
        x = torch.randn(513, cols, device=dev) * torch.logspace(-3, 3, 513, device=dev)[:, None]
        x[4] = 0
        q, s = quantize_rows_fp8(x.bfloat16())
        qr, sr = quantize_rows(x.bfloat16())
        report(f"quantize_rows cols={cols}", torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
               and torch.equal(s, sr), "bitwise")
    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "dsv3-like", "qwen2-moe", "phi3.5-moe", "flashdmoe-cfg"):
        cfg = PRESETS[name]
        E = max(1, min(cfg.num_experts // 2, 16))  # a 16-expert slice keeps the fp32 reference small
        up_rows = cfg.up_width
        q_up = quantize_weight(torch.randn(E, up_rows, cfg.hidden, device=dev) / cfg.hidden**0.5)
        q_down = quantize_weight(torch.randn(E, cfg.hidden, cfg.ffn, device=dev) / cfg.ffn**0.5)
        for T in (1, 7, 128, 512, 4096):
            case(name, cfg.hidden, cfg.ffn, E, T, min(cfg.top_k, E), cfg.activation, torch.bfloat16, dev, q_up,
                 q_down)
        if supports_blockwise(torch.empty(1, device=dev), q_up, q_down):
            for T in (7, 512, 4096):
                blockwise_case(name, q_up, q_down, T, min(cfg.top_k, E), cfg.activation, dev)
        del q_up, q_down
    for activation, N, K in (("swiglu", 160, 200), ("gelu", 130, 300), ("relu", 96, 64), ("swiglu", 2048, 1408)):
        for dtype in (torch.float32, torch.bfloat16):
            case(f"{activation} N={N} K={K}", N, K, 5, 300, 2, activation, dtype, dev)
    # a NaN token keeps to its rows
    N, K, E = 256, 384, 4
    q_up = quantize_weight(torch.randn(E, 2 * K, N, device=dev) / N**0.5)
    q_down = quantize_weight(torch.randn(E, N, K, device=dev) / K**0.5)
    x = torch.randn(64, N, device=dev).bfloat16()
    x[11, 5] = float("nan")
    gather = torch.randperm(128, device=dev).int()
    y = expert_ffn_fp8(x, gather, 2, 128, q_up, q_down, ragged_ends(128, E, dev), "swiglu")
    bad = (gather.long() // 2) == 11
    report("NaN token", bool(y[bad].isnan().all()) and not y[~bad].isnan().any())
    N, K = 512, 512
    q_up = quantize_weight(torch.randn(E, 2 * K, N, device=dev) / N**0.5)
    q_down = quantize_weight(torch.randn(E, N, K, device=dev) / K**0.5)
    x = torch.randn(64, N, device=dev).bfloat16()
    x[11, 5] = float("nan")
    y = expert_ffn_fp8(x, gather, 2, 128, q_up, q_down, ragged_ends(128, E, dev), "swiglu", backend="blockwise")
    report("NaN token, blockwise", bool(y[bad].isnan().all()) and not y[~bad].isnan().any())
    assert isinstance(q_up, BlockFP8Weight)
    passed = sum(results)
    print(f"{passed} PASS, {len(results) - passed} FAIL")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
