"""Train a small Hugging Face MoE causal LM with interlace's MoE blocks (or HF's own).

On 2 GPUs (NCCL; experts sharded over the 2 ranks, bf16):

    torchrun --nproc-per-node 2 examples/train_hf_moe.py
    torchrun --nproc-per-node 2 examples/train_hf_moe.py --impl hf          # HF's blocks, data parallel
    torchrun --nproc-per-node 2 examples/train_hf_moe.py --compare --steps 50
    torchrun --nproc-per-node 4 examples/train_hf_moe.py --fsdp --ep 2   # FSDP2, DP 2 x EP 2 (docs/training.md)
    torchrun --nproc-per-node 4 examples/train_hf_moe.py --ddp --ep 2    # DDP, DP 2 x EP 2

On a CPU (gloo, fp32). ``sequential``, ``pipelined`` and ``auto`` fall back to torch ops there;
TRITON_INTERPRET=1, set before Python starts, runs their Triton kernels instead (slowly), and the
Triton-only strategies (``fused``, ``fused:train``) need it:

    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 examples/train_hf_moe.py --device cpu \\
        --layers 2 --hidden 64 --ffn 64 --experts 8 --vocab 512 --seq 32 --batch 2 --steps 20 --strategy sequential

The model is built from a config (random weights, nothing downloaded). Data: random token
sequences from one fixed random "language" (every token has 4 possible successors), so the
loss visibly falls from ln(vocab) towards ln(4). Each rank trains on its own batches.
"""

import argparse
import copy
import gc
import os
import time

import torch
import torch.distributed as dist
import transformers

import interlace
import interlace.hf
import interlace.parallel

# family: (model class, config class, config fields from the command line's sizes)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", lambda a: dict(
        moe_intermediate_size=a.ffn, num_experts=a.experts, num_experts_per_tok=a.top_k, norm_topk_prob=True,
        head_dim=a.hidden // a.heads)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", lambda a: dict(
        intermediate_size=a.ffn, num_local_experts=a.experts, num_experts_per_tok=a.top_k,
        head_dim=a.hidden // a.heads)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", lambda a: dict(
        intermediate_size=a.ffn, num_experts=a.experts, num_experts_per_tok=a.top_k, norm_topk_prob=False)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", lambda a: dict(
        moe_intermediate_size=a.ffn, shared_expert_intermediate_size=2 * a.ffn, num_experts=a.experts,
        num_experts_per_tok=a.top_k)),
    # Every layer MoE (the real model keeps its first 3 dense); 4 expert groups, 2 kept per token.
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", lambda a: dict(
        intermediate_size=4 * a.ffn, moe_intermediate_size=a.ffn, n_routed_experts=a.experts, n_shared_experts=1,
        num_experts_per_tok=a.top_k, n_group=4, topk_group=2, first_k_dense_replace=0,
        kv_lora_rank=a.hidden // 2, q_lora_rank=a.hidden // 2, qk_rope_head_dim=a.hidden // a.heads // 2,
        qk_nope_head_dim=a.hidden // a.heads // 2, v_head_dim=a.hidden // a.heads)),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=(
        "On a CPU, the Triton-only strategies (fused, fused:train) need TRITON_INTERPRET=1 in the "
        "environment before Python starts (this script does not set it); with it, the others run their "
        "Triton kernels under the interpreter too, else torch ops."))
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=512, help="each expert's FFN width")
    p.add_argument("--experts", type=int, default=32, help="routed experts (a multiple of the world size)")
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", choices=("interlace", "hf"), default="interlace")
    p.add_argument("--strategy", default="auto", help="interlace strategy (auto, sequential, pipelined:2, ...)")
    p.add_argument("--compare", action="store_true", help="train both impls from the same weights and data")
    p.add_argument("--show", type=int, default=10, help="--compare: steps shown side by side")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    wrap = p.add_mutually_exclusive_group()
    wrap.add_argument("--fsdp", action="store_true", help="FSDP2 through interlace.parallelize (experts over dp)")
    wrap.add_argument("--ddp", action="store_true", help="DDP through interlace.parallelize (experts reduced over dp)")
    p.add_argument("--ep", type=int, default=None, help="--fsdp/--ddp: expert-parallel size (default: all ranks); "
                                                         "the data-parallel size is the world size / ep")
    p.add_argument("--save", default=None, help="write the trained model's full HF state dict here (torch.save)")
    return p.parse_args()


def build_model(args, device, dtype):
    """The HF model from its config. Built on the CPU from one seed, so every rank holds the same
    initial weights (replace_moe_blocks requires that; each rank then keeps its experts' slice)."""
    model_cls, config_cls, fields = FAMILIES[args.family]
    config = getattr(transformers, config_cls)(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=args.seq, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # the families' ids may lie past --vocab
        output_router_logits=True,  # HF's load-balancing loss; interlace's router feeds it too
        **fields(args))
    torch.manual_seed(args.seed)
    return getattr(transformers, model_cls)(config).to(device=device, dtype=dtype)


def token_batches(args, rank, device):
    """(steps, batch, seq) token ids for this rank, made up front so the timed loop only trains.
    The successor table is the same on every rank (one language); the sequences differ per rank."""
    successors = torch.randint(0, args.vocab, (args.vocab, 4), generator=torch.Generator().manual_seed(args.seed))
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    ids = torch.empty(args.steps * args.batch, args.seq, dtype=torch.long)
    ids[:, 0] = torch.randint(0, args.vocab, (ids.shape[0],), generator=gen)
    choice = torch.randint(0, 4, ids.shape, generator=gen)
    for t in range(1, args.seq):
        ids[:, t] = successors[ids[:, t - 1], choice[:, t]]
    return ids.view(args.steps, args.batch, args.seq).to(device)


def wrap(model, impl, args, device, world):
    """--fsdp / --ddp: the model on a ("dp", "ep") DeviceMesh (interlace's blocks over its 'ep' groups,
    interlace.parallelize for the wrapper); returns (the module to train through, the mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    ep = args.ep or world
    if world % ep:
        raise SystemExit(f"error: --ep {ep} does not divide the world size {world}")
    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp", "ep"))
    if impl == "hf":  # HF's blocks: every weight replicated, the wrappers as they are
        if args.ddp:
            return torch.nn.parallel.DistributedDataParallel(model), mesh
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model), mesh
    interlace.hf.replace_moe_blocks(model, group=mesh["ep"].get_group(), strategy=args.strategy)
    units = tuple(model.model.layers) if args.fsdp else ()
    return interlace.parallelize(model, mesh, wrapper="fsdp" if args.fsdp else "ddp", units=units), mesh


def train(model, impl, args, data, device, world, say):
    """Trains ``model`` in place; returns (per-step loss averaged over ranks, tokens/s after step 1)."""
    wrapped = None
    if args.fsdp or args.ddp:
        # Experts sharded (FSDP) or replicated (DDP) over the dp ranks of one EP index, gradients
        # reduced over dp with the right scale; the rest over all ranks; the loss each rank's mean.
        wrapped, _ = wrap(model, impl, args, device, world)
        synced = []
    elif impl == "interlace":
        try:
            interlace.hf.replace_moe_blocks(model, strategy=args.strategy)
        except ValueError as exc:  # e.g. a Triton-only strategy on a CPU without TRITON_INTERPRET=1
            raise SystemExit(f"error: {exc}") from None
        # Expert parallelism over every rank (one data-parallel replica): rank r holds only experts
        # [r*E/W, (r+1)*E/W); their gradients already sum every rank's tokens (the all-to-all's
        # backward brought them here), so with dp = 1 nothing else reduces them. Everything else
        # (attention, norms, embeddings, routers) is replicated: all-reduce it. With dp > 1 the experts
        # need a reduction over dp too: --fsdp / --ddp (interlace.parallelize) do both.
        synced = interlace.hf.replicated_parameters(model)
    else:
        synced = list(model.parameters())  # HF's blocks: plain data parallel, every weight replicated
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    cuda = device.type == "cuda"
    clock = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else None
    tokens_per_step = args.batch * args.seq * world  # every rank's tokens

    def now():
        """A timestamp: a CUDA event (no host sync here) or, on the CPU, perf_counter."""
        if not cuda:
            return time.perf_counter()
        event = clock()
        event.record()
        return event

    def seconds(start, end):
        if not cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    losses, pending = [], []
    start = first = now()
    for step in range(args.steps):
        ids = data[step]
        if wrapped is not None:  # the wrapper reduces every gradient
            loss = wrapped(ids, labels=ids).loss
            loss.backward()
        else:
            loss = model(ids, labels=ids).loss  # causal-LM loss + HF's auxiliary balance loss
            # The global loss is the mean of the W ranks' losses: scale by 1/W here, then a SUM all-reduce
            # of the replicated gradients (and the experts' sums through the all-to-all) give its gradient.
            (loss / world).backward()
            if world > 1:
                for p in synced:
                    dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pending.append(loss.detach().float())  # read at the log step: no host sync per step
        if step == 0:
            first = now()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean = torch.stack(pending)
            if world > 1:
                dist.all_reduce(mean)
            losses += (mean / world).tolist()
            end = now()
            n = len(pending)
            say(f"[{impl}] step {step + 1:5d}/{args.steps}  loss {losses[-1]:.6f}  "
                f"tokens/s {n * tokens_per_step / seconds(start, end):,.0f}")
            start, pending = now(), []
    end = now()
    rate = (args.steps - 1) * tokens_per_step / seconds(first, end) if args.steps > 1 else float("nan")
    if args.save and impl == "interlace":
        # every layout: experts all-gathered, FSDP's shards gathered (a collective on every rank)
        state = interlace.hf.gather_hf_state_dict(wrapped if wrapped is not None else model)
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(state, args.save)
            say(f"[{impl}] saved the HF state dict ({len(state)} tensors) to {args.save}")
    return losses, rate


def main():
    args = parse_args()
    distributed = "RANK" in os.environ  # started by torchrun
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device, dtype, backend = torch.device("cuda", local), torch.bfloat16, "nccl"
    else:
        device, dtype, backend = torch.device("cpu"), torch.float32, "gloo"
    if distributed:
        dist.init_process_group(backend)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    def say(line):
        if rank == 0:
            print(line, flush=True)

    say(f"{args.family}: {args.layers} layers, hidden {args.hidden}, {args.experts} experts of FFN {args.ffn}, "
        f"top-{args.top_k}; {world} rank(s) x {args.batch}x{args.seq} tokens per step, {dtype}, {device.type}")
    data = token_batches(args, rank, device)
    model = build_model(args, device, dtype)
    impls = ("hf", "interlace") if args.compare else (args.impl,)
    results = {}
    for impl in impls:
        # --compare: each impl trains a copy of the same initial model on the same batches.
        results[impl] = train(copy.deepcopy(model) if args.compare else model, impl, args, data, device, world, say)
        say(f"[{impl}] done: {args.steps} steps, final loss {results[impl][0][-1]:.6f}, "
            f"{results[impl][1]:,.0f} tokens/s after step 1"
            + (f" (strategy {args.strategy})" if impl == "interlace" else ""))
    if args.compare:
        hf, il = results["hf"][0], results["interlace"][0]
        say(f"{'step':>5}  {'loss hf':>12}  {'loss interlace':>14}  {'difference':>10}")
        for step in range(min(args.show, args.steps)):
            say(f"{step + 1:5d}  {hf[step]:12.6f}  {il[step]:14.6f}  {il[step] - hf[step]:10.2e}")
        diff = max(abs(a - b) for a, b in zip(hf, il))
        rel = max(abs(a - b) / abs(a) for a, b in zip(hf, il))
        say(f"max loss difference over {args.steps} steps: {diff:.2e} (relative {rel:.2e}; expect ~1e-6 in fp32, "
            f"bf16 noise on GPU); tokens/s hf {results['hf'][1]:,.0f}, interlace {results['interlace'][1]:,.0f}")
    if distributed:
        # Whatever holds the process group goes before it: the model (its interlace layers keep
        # the group) and interlace's shared buffers and side channels. A group destroyed later, at
        # the interpreter's exit, can abort the process ("terminate called without an active
        # exception") when its threads outlive Python.
        del model
        gc.collect()
        interlace.parallel.release_shared_buffers()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
