"""GPU check of a transformers MoE block in bf16 on ``persistent`` (world size 1, GPU 0): the
block's output against HF's own block, beside interlace's ``sequential`` (which routes on HF's
logits exactly), and against ``persistent`` with the logit rounding off (the kernel then routes
on fp32 logit sums, which HF's bf16 GEMM does not compute: near-ties go the other way).

    python3 tests/gpu/hf_persistent_check.py [--tokens 256] [--family qwen3_moe]
    python3 tests/gpu/hf_persistent_check.py --smoke   # CPU, fp32, a tiny block (the interpreter)

A Qwen3-MoE-like block (hidden 2048, 128 experts, top-8, expert FFN 768; or OLMoE-like:
hidden 2048, 64 experts, top-8, FFN 1024), bf16 weights, random tokens. Prints the relative
error ‖out − HF‖ / ‖HF‖ of each path; exits non-zero unless persistent (rounding on) is within
``TOL`` of HF and within 1.5× sequential's own error.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

TOL = 2e-2  # bf16 activations and weights


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float("inf") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm()).item()


def main(argv=None) -> int:
    import transformers

    from interlace.hf import KernelRouter, moe_blocks, replace_moe_blocks

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--family", default="qwen3_moe", choices=("qwen3_moe", "olmoe"))
    p.add_argument("--smoke", action="store_true", help="CPU, fp32, hidden 64, 8 experts, top-2, 24 tokens")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("needs a GPU (or --smoke)")
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    hidden, experts, top_k = (64, 8, 2) if args.smoke else (2048, 128 if args.family == "qwen3_moe" else 64, 8)
    tokens = 24 if args.smoke else args.tokens
    torch.manual_seed(0)
    if args.family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=hidden * 3 // 8,
                                             num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True)
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    else:
        config = transformers.OlmoeConfig(hidden_size=hidden, intermediate_size=hidden // 2, num_experts=experts,
                                          num_experts_per_tok=top_k, norm_topk_prob=False)
        block = transformers.models.olmoe.modeling_olmoe.OlmoeSparseMoeBlock(config)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.02)
    ref = block.to(device, dtype).eval()
    x = torch.randn(1, tokens, config.hidden_size, device=device).to(dtype)
    outs, rounding = {}, KernelRouter.logits_dtype  # (the class's property, restored below)
    with torch.inference_mode():
        expected = ref(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        for name, strategy in (("sequential", "sequential"), ("persistent", "persistent"),
                               ("persistent, logits in fp32", "persistent")):
            wrapper = torch.nn.Sequential(copy.deepcopy(ref))
            replace_moe_blocks(wrapper, strategy=strategy)
            if name.endswith("fp32"):
                KernelRouter.logits_dtype = property(lambda self: None)  # (the rounding off)
            for _ in range(3):  # (the last call replays persistent's CUDA graph)
                out = wrapper(x)
            outs[name] = rel_err(out, expected)
            if strategy == "persistent":
                moe_blocks(wrapper)[0].strategy.synchronize_and_check()
        KernelRouter.logits_dtype = rounding
    ok = outs["persistent"] < TOL and outs["persistent"] <= 1.5 * outs["sequential"] + 1e-4
    where = "CPU (interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(f"{args.family}-like block, {tokens} tokens, {str(dtype).removeprefix('torch.')}, {where}")
    print("| path | rel err against HF's block |\n|---|---|")
    for name, err in outs.items():
        print(f"| {name} | {err:.2e} |")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
