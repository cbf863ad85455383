"""GPU check: an FP8 Qwen3-MoE-like HF model generates the same greedy tokens under interlace's
blocks as under HF's own FP8 experts, for 32 steps.

    python tests/gpu/hf_fp8_generate_check.py [--steps 32] [--dtype float32 bfloat16] [--hub-kernel DIR]

The model (random weights, built from a config: 4 layers, hidden 512, 16 experts of 256, top-4,
vocabulary 1024) is quantized the way transformers quantizes a ``FineGrainedFP8Config`` model
(its ``Fp8Quantize`` op on the expert weights: e4m3, 128 × 128 block scales; everything else
dense). HF's ``FP8Experts`` compute with the ``kernels-community/finegrained-fp8`` kernel, which
transformers downloads from the Hub. On a machine without network, ``--hub-kernel DIR`` gives the
kernel's source instead: DIR holds its ``finegrained_fp8`` package (``finegrained-fp8/torch-ext``
of a checkout of github.com/huggingface/kernels-community; Triton and Python, no build step), which
the check imports and hands to transformers as the loaded kernel. Where neither loads, HF's
blocks compute what that kernel computes (W8A8: activations per token and 128 columns, fp32
sums; tests/hf's ``w8a8_linear``), and the check says which ran. interlace: ``replace_moe_blocks`` (``auto`` and
``sequential``), the FP8 tensors taken as they are.

Per dtype, 8 prompts of 16 tokens, ``generate(max_new_tokens=steps, do_sample=False)`` with HF's
blocks, then with interlace's (``auto``, ``sequential``, ``persistent``) and with the noise floor: HF's
own W8A8 arithmetic computed exactly, its sums taken 128 columns at a time (``w8a8_linear_by_blocks``).

- Free-running (INFO, the issue's literal bar): how many prompts' 32 tokens equal HF's, and where a
  prompt parts, HF's top-2 logit margin there against the two models' logit difference.
- Teacher-forced: every model decodes HF's own tokens (a logits processor forces them), so each
  step's logits compare on the same input: how many of the steps' greedy tokens are HF's, and the
  largest and median logit difference from HF's. The noise floor's numbers are FP8's own: two
  computations of the same W8A8 arithmetic differ by them (Hopper's FP8 tensor cores sum each
  128-column block with ~1e-4 relative error, and an e4m3 activation near a rounding boundary
  lands one step away). Judged for ``sequential`` (W8A8, HF's arithmetic): PASS where it picks
  HF's token at as many steps as the noise floor does (less 1% of the steps) and its median logit
  difference is within 1.5× the floor's. ``persistent`` (and ``auto``, which takes it at decode
  sizes) is W8A16: activations stay unquantized, a more accurate arithmetic than HF's W8A8
  (docs/fp8.md), so its lines are INFO. With the emulated kernel every line is INFO (exact fp32
  GEMMs are not what a GPU's FP8 tensor cores compute).

Random weights give flat logits (HF's top-2 margin below 2e-2 at many steps), so free-running
generations part at such near-ties within 32 steps, the noise floor's too (on an H200 with the hub
kernel: 4 of 8 prompts equal in fp32, 1 of 8 in bf16): token equality over 32 free-running steps is
below FP8's own noise on such a model, and the teacher-forced comparison is what can be judged.
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


def load_hub_kernel_source(path: str) -> None:
    """Import the finegrained-fp8 kernel's package from ``path`` and install its entry points as
    the kernel transformers loaded (the ``FineGrainedFP8`` bundle its loader builds from the Hub's
    module). The Hub's builds carry an ``_ops`` module that kernel-builder generates (the op
    namespace); a source checkout has none, so one is made here, with a namespace of its own."""
    import importlib
    import os
    import types

    from transformers.integrations import finegrained_fp8

    if not os.path.isdir(os.path.join(path, "finegrained_fp8")):
        raise SystemExit(f"--hub-kernel {path}: no finegrained_fp8 package there")
    sys.path.insert(0, path)
    if not os.path.exists(os.path.join(path, "finegrained_fp8", "_ops.py")):
        namespace = "_finegrained_fp8_source"
        ops = types.ModuleType("finegrained_fp8._ops")
        ops.ops = getattr(torch.ops, namespace)
        ops.add_op_namespace_prefix = lambda name: f"{namespace}::{name}"
        sys.modules["finegrained_fp8._ops"] = ops
    kernel = importlib.import_module("finegrained_fp8")
    finegrained_fp8._FINEGRAINED_FP8 = finegrained_fp8.FineGrainedFP8(
        matmul=kernel.matmul_2d, batched_matmul=kernel.matmul_batched, grouped_matmul=kernel.matmul_grouped)


def hf_kernel(source: str | None) -> str:
    """'hub' where transformers' finegrained-fp8 kernel loads (from the Hub, or from ``source``:
    :func:`load_hub_kernel_source`), else 'emulated' (w8a8_linear put in)."""
    from transformers.integrations import finegrained_fp8

    if source is not None:
        load_hub_kernel_source(source)
    try:
        finegrained_fp8._load_finegrained_fp8_kernel()
        return "hub" if source is None else "hub kernel's source"
    except Exception as err:  # (no network on the device: the kernel comes from the Hub)
        finegrained_fp8.FP8Experts.linear = w8a8_linear
        print(f"HF's finegrained-fp8 kernel not loadable ({str(err).splitlines()[0][:100]}): "
              f"HF's FP8Experts compute its arithmetic in torch (W8A8, fp32)", flush=True)
        return "emulated"


class ForceTokens:
    """A logits processor that makes ``generate`` decode the given tokens (B, steps) after a prompt of
    ``prompt_len``: the scores of every other token become -inf (``output_logits`` keeps the raw ones)."""

    def __init__(self, tokens: torch.Tensor, prompt_len: int):
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_len
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, self.tokens[:, step:step + 1], 0.0)


def generate(model, prompts, steps: int, force: torch.Tensor | None = None):
    """(new tokens (B, steps), raw logits (B, steps, V) fp32) of greedy decoding, ``force``d or free."""
    from transformers import LogitsProcessorList

    kw = dict(max_new_tokens=steps, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    if force is not None:
        kw["logits_processor"] = LogitsProcessorList([ForceTokens(force, prompts.shape[1])])
    with torch.inference_mode():
        out = model.generate(prompts, **kw)
    return out.sequences[:, prompts.shape[1]:], torch.stack(out.logits, dim=1).float()


NOISE_FLOOR = "HF, sums by blocks"


def interlace_model(ref, strategy: str):
    """A copy of ``ref`` with interlace's blocks (``strategy``), or with the noise floor's HF blocks."""
    from transformers.integrations import finegrained_fp8

    model = copy.deepcopy(ref)
    if strategy == NOISE_FLOOR:
        for module in model.modules():
            if isinstance(module, finegrained_fp8.FP8Experts):
                module.linear = w8a8_linear_by_blocks.__get__(module)
    else:
        replace_moe_blocks(model, strategy=strategy)
    return model


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--hub-kernel", metavar="DIR", help="the directory holding the finegrained-fp8 "
                        "kernel's finegrained_fp8 package, where the Hub cannot be reached")
    args = parser.parse_args()
    kernel = hf_kernel(args.hub_kernel)
    judged = kernel != "emulated"
    prompts = torch.randint(0, 1024, (8, 16), generator=torch.Generator().manual_seed(5)).cuda()
    for name in args.dtype:
        ref = fp8_model(getattr(torch, name))
        want, want_logits = generate(ref, prompts, args.steps)
        top2 = want_logits.topk(2, dim=-1).values
        margin = top2[..., 0] - top2[..., 1]  # (B, steps): HF's greedy margin at each step
        floor = None
        for strategy in (NOISE_FLOOR, "auto", "sequential", "persistent"):
            model = interlace_model(ref, strategy)
            got, got_logits = generate(model, prompts, args.steps)
            same = (want == got).all(dim=1)
            detail = f"{int(same.sum())}/{len(same)} prompts equal over {args.steps} steps (HF kernel: {kernel})"
            for p in (~same).nonzero().flatten().tolist():
                step = int((want[p] != got[p]).nonzero()[0])
                diff = (want_logits[p, step] - got_logits[p, step]).abs().max()
                detail += (f"; prompt {p} parts at step {step}: HF's top-2 margin {float(margin[p, step]):.2e}, "
                           f"max |logit difference| {float(diff):.2e}")
            report(f"{name} {strategy} free-running", bool(same.all()), detail, judged=False)

            _, forced_logits = generate(model, prompts, args.steps, force=want)
            diff = (want_logits - forced_logits).abs().amax(dim=-1)  # (B, steps)
            parted = forced_logits.argmax(dim=-1) != want
            detail = (f"{int((~parted).sum())}/{parted.numel()} steps pick HF's token; max |logit difference| "
                      f"{float(diff.max()):.2e}, median {float(diff.median()):.2e}")
            agree, median = int((~parted).sum()), float(diff.median())
            if strategy == NOISE_FLOOR:
                floor = (agree, median)
                report(f"{name} {strategy} teacher-forced (the noise floor)", True, detail, judged=False)
            else:
                ok = agree >= floor[0] - max(1, parted.numel() // 100) and median <= 1.5 * floor[1]
                detail += f" (noise floor: {floor[0]} steps, median {floor[1]:.2e})"
                report(f"{name} {strategy} teacher-forced", ok, detail, judged and strategy == "sequential")
            del model
        del ref
        torch.cuda.empty_cache()
    passed = sum(results)
    print(f"{passed} PASS, {len(results) - passed} FAIL")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
