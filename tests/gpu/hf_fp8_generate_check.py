"""GPU check: an FP8 Qwen3-MoE-like HF model generates the same greedy tokens under interlace's
blocks as under HF's own FP8 experts, for 32 steps.

    python tests/gpu/hf_fp8_generate_check.py [--steps 32] [--dtype float32 bfloat16]

The model (random weights, built from a config: 4 layers, hidden 512, 16 experts of 256, top-4,
vocabulary 1024) is quantized the way transformers quantizes a ``FineGrainedFP8Config`` model
(its ``Fp8Quantize`` op on the expert weights: e4m3, 128 × 128 block scales; everything else
dense). HF's ``FP8Experts`` compute with the ``kernels-community/finegrained-fp8`` kernel, which
transformers downloads from the Hub: where it cannot be loaded (no network), they compute what
that kernel computes (W8A8: activations per token and 128 columns, fp32 sums; tests/hf's
``w8a8_linear``), and the check says which ran. interlace: ``replace_moe_blocks`` (``auto`` and
``sequential``), the FP8 tensors taken as they are.

Per dtype and strategy: 8 prompts of 16 tokens, ``generate(max_new_tokens=steps, do_sample=False)``
with HF's blocks and with interlace's; PASS where every prompt's tokens agree. Where a prompt's
tokens part, the line gives the step and HF's top-2 logit margin there against the two models'
logit difference at that step (a near tie that the sums' order decides, or not). The last line
per dtype is the noise floor: HF's own FP8 arithmetic with its sums taken in another order (128
columns at a time) against itself (only meaningful where the kernel is emulated). With the
emulated kernel every line is INFO: its exact fp32 GEMMs are not what a GPU's FP8 tensor cores
(interlace's, and the hub kernel's) compute.
"""

import argparse
import copy
import sys

import torch

from interlace.fp8 import dequantize_rows, dequantize_weight, quantize_rows
from interlace.hf import replace_moe_blocks

results = []


def report(name: str, ok: bool, detail: str = "", judged: bool = True) -> None:
    """A PASS / FAIL line; ``judged`` False: an INFO line that counts for nothing."""
    if judged:
        results.append(bool(ok))
    print(f"{('PASS' if ok else 'FAIL') if judged else 'INFO'} {name} {detail}", flush=True)


def fp8_model(dtype: torch.dtype, seed: int = 0):
    import transformers
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize, replace_with_fp8_linear

    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        max_position_embeddings=128, initializer_range=0.05, tie_word_embeddings=False, output_router_logits=False)
    torch.manual_seed(seed)
    dense = transformers.Qwen3MoeForCausalLM(config).to(dtype)
    qc = FineGrainedFP8Config(weight_block_size=(128, 128), modules_to_not_convert=[r"^(?!.*\.experts$).*"])
    model = copy.deepcopy(dense)
    replace_with_fp8_linear(model, modules_to_not_convert=qc.modules_to_not_convert, quantization_config=qc)
    quantizer = Fp8Quantize(type("Q", (), {"quantization_config": qc})())
    state = {}
    for key, value in dense.state_dict().items():
        state.update(quantizer._quantize_one(key, value) if ".experts." in key else {key: value})
    model.load_state_dict(state, assign=True)
    model.set_experts_implementation("eager")
    return model.cuda().eval()


def w8a8_linear(self, input, weight, weight_scale_inv, activation_scale=None):
    """One expert GEMM as the finegrained-fp8 kernel computes it (tests/hf/test_hf_fp8.py's twin)."""
    q, s = quantize_rows(input.reshape(-1, input.shape[-1]))
    return (dequantize_rows(q, s) @ dequantize_weight(weight, weight_scale_inv).t()).to(input.dtype)


def w8a8_linear_by_blocks(self, input, weight, weight_scale_inv, activation_scale=None):
    """:func:`w8a8_linear` with its fp32 sum taken 128 columns at a time (as the GPU kernels sum
    each block's products before adding it): the same arithmetic in another order."""
    q, s = quantize_rows(input.reshape(-1, input.shape[-1]))
    a, w = dequantize_rows(q, s), dequantize_weight(weight, weight_scale_inv)
    out = sum(a[:, k:k + 128] @ w[:, k:k + 128].t() for k in range(0, a.shape[1], 128))
    return out.to(input.dtype)


def hf_kernel() -> str:
    """'hub' where transformers' finegrained-fp8 kernel loads, else 'emulated' (w8a8_linear put in)."""
    from transformers.integrations import finegrained_fp8

    try:
        finegrained_fp8._load_finegrained_fp8_kernel()
        return "hub"
    except Exception as err:  # (no network on the device: the kernel comes from the Hub)
        finegrained_fp8.FP8Experts.linear = w8a8_linear
        print(f"HF's finegrained-fp8 kernel not loadable ({str(err).splitlines()[0][:100]}): "
              f"HF's FP8Experts compute its arithmetic in torch (W8A8, fp32)", flush=True)
        return "emulated"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    kernel = hf_kernel()
    prompts = torch.randint(0, 1024, (8, 16), generator=torch.Generator().manual_seed(5)).cuda()
    kw = dict(max_new_tokens=args.steps, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    for name in args.dtype:
        dtype = getattr(torch, name)
        ref = fp8_model(dtype)
        with torch.inference_mode():
            want = ref.generate(prompts, **kw)
        for strategy in ("auto", "sequential", "HF, sums by blocks"):
            model = copy.deepcopy(ref)
            if strategy.startswith("HF"):  # the noise floor: HF's own arithmetic in another order
                from transformers.integrations import finegrained_fp8

                linear = finegrained_fp8.FP8Experts.linear
                finegrained_fp8.FP8Experts.linear = w8a8_linear_by_blocks
            else:
                replace_moe_blocks(model, strategy=strategy)
            with torch.inference_mode():
                got = model.generate(prompts, **kw)
            if strategy.startswith("HF"):
                finegrained_fp8.FP8Experts.linear = linear
            new_w, new_g = want.sequences[:, 16:], got.sequences[:, 16:]
            same = (new_w == new_g).all(dim=1)
            detail = f"{int(same.sum())}/{len(same)} prompts equal over {args.steps} steps (HF kernel: {kernel})"
            for p in (~same).nonzero().flatten().tolist():
                step = int((new_w[p] != new_g[p]).nonzero()[0])
                top2 = want.logits[step][p].float().topk(2).values
                diff = (want.logits[step][p].float() - got.logits[step][p].float()).abs().max()
                detail += f"; prompt {p} parts at step {step}: HF's top-2 margin {float(top2[0] - top2[1]):.2e}, " \
                          f"max |logit difference| {float(diff):.2e}"
            # Emulated, HF's GEMMs are exact fp32 while interlace's run on Hopper's FP8 tensor cores
            # (each 128-column block summed with ~1e-4 relative error: some e4m3 activations land
            # a step away), as the hub kernel's would: only the hub kernel is the bar's reference.
            report(f"{name} {strategy}", bool(same.all()), detail, judged=kernel == "hub")
            del model
        del ref
        torch.cuda.empty_cache()
    passed = sum(results)
    print(f"{passed} PASS, {len(results) - passed} FAIL")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
