"""Capture a Hugging Face MoE model's whole decode step, interlace's blocks inside, in one CUDA graph.

What a serving engine does with a decode step: static buffers for the step's inputs (token ids and
cache positions), a static KV cache, eager warm-up calls (Triton compiles, `auto`'s decision for the
decode size, allocations), one capture of the model's forward, then per token: write the inputs into
the static buffers and replay. This example does that for a Qwen3-MoE-like model (random weights from
a config, nothing downloaded) and checks the replays against eager calls of the same model.

    python examples/captured_decode.py                      # 4 layers, 128 sequences, 32 tokens, bf16
    python examples/captured_decode.py --fp8                # the experts in block-scaled FP8 (docs/fp8.md)
    torchrun --nproc-per-node 2 examples/captured_decode.py # the experts sharded over 2 GPUs
    python examples/captured_decode.py --device cpu --layers 2 --hidden 64 --ffn 32 --experts 8 --vocab 256 \\
        --batch 4 --steps 4                                 # the same steps eagerly (no graph on a CPU)

Printed: whether every replayed step's logits equal the eager step's bitwise (with a fixed strategy they
do; with `auto` the eager steps may run another candidate than the captured one while its decode
bucket calibrates, and candidates round differently), the largest relative difference of the logits,
whether the greedy tokens agree with HF's own MoE blocks (before replacement; with random weights the
logits are flat, so bf16 rounding parts some sequences on a near tie), and the time per decode step
eager and replayed.

On 1x H200 (4 layers, 128 sequences, `--strategy sequential`): replays equal to eager bitwise, 2.19 ms
per step against 10.93 eager. On 2x H200 (torchrun, 128 sequences per GPU, `--moe-time`): `persistent`
replays equal to eager bitwise, 1.70 ms per step against 10.2 eager, the MoE block 0.134-0.135 ms per layer
inside the replay against 0.140-0.142 back to back (0.95-0.96x); `auto` 0.133-0.144 against 0.159-0.161.
"""

import argparse
import copy
import inspect
import os
import time

import torch
import torch.distributed as dist
import transformers
from transformers import StaticCache

import interlace
import interlace.hf
import interlace.parallel


# the cache's keyword: ``cache`` from transformers 5.2x, ``past_key_values`` before
CACHE_ARG = "cache" if "cache" in inspect.signature(transformers.Qwen3MoeForCausalLM.forward).parameters else \
    "past_key_values"


def build(args, device):
    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
        num_key_value_heads=4, head_dim=args.hidden // 16, moe_intermediate_size=args.ffn, num_experts=args.experts,
        num_experts_per_tok=args.top_k, norm_topk_prob=True, max_position_embeddings=args.prompt + args.steps + 8,
        tie_word_embeddings=False)
    torch.manual_seed(0)  # every rank builds the same model
    return transformers.Qwen3MoeForCausalLM(config).to(device=device, dtype=args.dtype).eval()


def decode(model, prompt, steps: int, graph: bool):
    """Greedy decode of ``steps`` tokens after ``prompt`` (B, P) with a static cache: eagerly, or
    through one captured step replayed per token. Returns (tokens (B, steps), logits per step, s/step)."""
    B, P = prompt.shape
    warmup = 12 if graph else 0
    cache = {CACHE_ARG: StaticCache(config=model.config, max_cache_len=P + steps + warmup)}
    logits = model(input_ids=prompt, cache_position=torch.arange(P, device=prompt.device), use_cache=True,
                   **cache).logits[:, -1]
    ids = logits.argmax(-1, keepdim=True)  # the static input buffers of a step
    position = torch.full((1,), P, dtype=torch.long, device=prompt.device)

    def step():
        return model(input_ids=ids, cache_position=position, use_cache=True, **cache).logits[:, -1]

    if graph:
        # Warm-up calls at the first step's position: enough for auto to decide at this token count.
        # HF's static cache layers write at their own device counter (not at cache_position), so the
        # counters go back to the prompt's length after them; what the warm-up wrote past it is masked
        # (the mask follows cache_position) until the replays overwrite it.
        for _ in range(warmup):
            step()
        for layer in cache[CACHE_ARG].layers:
            layer.cumulative_length.fill_(P)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
        run = lambda: (g.replay(), out)[1]  # noqa: E731
    else:
        run = step
    tokens, per_step = [], []
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        logits = run()
        per_step.append(logits.float().clone())
        next_ids = logits.argmax(-1, keepdim=True)
        tokens.append(next_ids)
        ids.copy_(next_ids)
        position += 1
    sync()
    return torch.cat(tokens, dim=1), per_step, (time.perf_counter() - start) / steps


class _NoExperts(torch.nn.Module):
    """Stands in for an MoE block while the rest of the step is timed: zeros of its input's shape."""

    def forward(self, hidden_states):
        return torch.zeros_like(hidden_states)


def moe_time_in_replay(model, prompt, steps: int, step_s: float) -> tuple[float, float, float]:
    """The MoE blocks' share of a replayed step: ``(per layer inside the replay, step without
    them, one block back to back)`` in seconds. Inside the replay: the step's time less a replay
    of the same model whose blocks return zeros, over the layer count. Back to back: block 0 on
    a decode step's hidden states, 20 calls issued back to back (every rank alike)."""
    blocks = interlace.hf.moe_blocks(model)
    ids = {id(b) for b in blocks}
    owners = [(m, name, c) for m in model.modules() for name, c in m.named_children() if id(c) in ids]
    for m, name, _ in owners:
        setattr(m, name, _NoExperts())
    try:
        _, _, rest_s = decode(model, prompt, steps, graph=True)
    finally:
        for m, name, block in owners:
            setattr(m, name, block)
    x = torch.randn(prompt.shape[0], 1, model.config.hidden_size, device=prompt.device, dtype=model.dtype)
    for _ in range(5):
        blocks[0](x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if dist.is_initialized():
        dist.barrier()
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        blocks[0](x)
    end.record()
    end.synchronize()
    return (step_s - rest_s) / len(blocks), rest_s, start.elapsed_time(end) / 20 * 1e-3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=128, help="sequences per GPU: the decode step's tokens per GPU")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--fp8", action="store_true", help="quantize the experts to block-scaled FP8 (W8A8)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--moe-time", action="store_true",
                    help="also time the MoE blocks inside the replayed step against one block back to back")
    args = ap.parse_args()
    distributed = "RANK" in os.environ
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        args.dtype = torch.bfloat16
    else:
        device, args.dtype = torch.device("cpu"), torch.float32
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0

    hf_model = build(args, device)
    model = copy.deepcopy(hf_model)
    interlace.hf.replace_moe_blocks(model, strategy=args.strategy)
    if args.fp8:
        interlace.quantize_experts(model, "fp8")
    torch.manual_seed(1 + rank)  # each rank decodes its own sequences
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), device=device)
    with torch.inference_mode():
        hf_tokens, _, hf_s = decode(hf_model, prompt, args.steps, graph=False)
        del hf_model
        eager_tokens, eager_logits, eager_s = decode(model, prompt, args.steps, graph=False)
        if device.type == "cuda":
            graph_tokens, graph_logits, graph_s = decode(model, prompt, args.steps, graph=True)
            same = all(torch.equal(a, b) for a, b in zip(eager_logits, graph_logits))
            worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(graph_logits, eager_logits))
            print(f"rank {rank}: replayed steps equal eager bitwise: {same} (largest relative difference "
                  f"{worst:.1e}); tokens equal: {torch.equal(graph_tokens, eager_tokens)}; per step: eager "
                  f"{eager_s * 1e3:.2f} ms, replayed {graph_s * 1e3:.2f} ms ({eager_s / graph_s:.2f}x)", flush=True)
            if args.moe_time:
                layer_s, rest_s, b2b_s = moe_time_in_replay(model, prompt, args.steps, graph_s)
                print(f"rank {rank}: MoE block per layer inside the replay {layer_s * 1e3:.3f} ms (the step "
                      f"without the blocks {rest_s * 1e3:.2f} ms), one block back to back {b2b_s * 1e3:.3f} ms: "
                      f"{layer_s / b2b_s:.2f}x", flush=True)
        agree = (eager_tokens == hf_tokens).float().mean().item()
        print(f"rank {rank}: greedy tokens equal to HF's own blocks: {agree:.1%} of {eager_tokens.numel()} "
              f"(HF eager {hf_s * 1e3:.2f} ms per step)", flush=True)
    if distributed:
        interlace.parallel.release_shared_buffers()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
