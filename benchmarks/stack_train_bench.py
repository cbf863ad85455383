"""Training steps of several stacked MoE layers (one process per GPU, torchrun): step time and memory.

    torchrun --nproc-per-node 2 benchmarks/stack_train_bench.py [--config qwen2-moe] [--tokens 4096] [--layers 4]
        [--variants sequential fused:train fused:train:eager]

A step is forward through ``--layers`` MoE layers (each a residual ``x + layer(x)``), then backward
from a random output gradient. Unlike the one-layer bench, the host may run ahead of the GPU
from one layer to the next, as in a model. Per variant (``fused:train:eager`` is ``fused:train``
without CUDA graphs): median step ms over ``--steps`` timed steps (CUDA events, a barrier before
each step, slowest rank), and the peak allocated and the reserved GiB after the steps. Variants run
in turn, ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from interlace import MoELayer
from interlace.tools.bench import init_env, reduce_max, time_cuda
from interlace.config import preset
from interlace.parallel import release_shared_buffers


def build(cfg, env, variant: str, layers: int):
    strategy, options = variant, {}
    if variant == "fused:train:eager":
        strategy, options = "fused:train", {"cuda_graph": False}
    return [MoELayer(cfg, group=env.group, strategy=strategy, seed=10 + i, device=env.device, strategy_options=options)
            for i in range(layers)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="qwen2-moe")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--variants", nargs="+", default=["sequential", "fused:train", "fused:train:eager"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    env = init_env()
    cfg = preset(args.config)
    x = torch.randn(args.tokens, cfg.hidden, device=env.device).to(cfg.dtype)
    g = torch.randn_like(x)
    times = {v: [] for v in args.variants}
    memory = {}
    for _ in range(args.rounds):
        for variant in args.variants:
            stack = build(cfg, env, variant, args.layers)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()

            def step():
                h = x.detach().requires_grad_()
                y = h
                for layer in stack:
                    y = y + layer(y)
                y.backward(g)

            ms = statistics.median(time_cuda(step, 3, args.steps, env))
            times[variant].append(reduce_max(env, ms))
            memory[variant] = (reduce_max(env, (torch.cuda.max_memory_allocated() - base) / 2**30),
                               reduce_max(env, torch.cuda.memory_reserved() / 2**30))
            del stack
            release_shared_buffers()
            torch.cuda.empty_cache()
    if env.rank == 0:
        print(f"# {args.config}, {args.tokens} tokens/GPU, {args.layers} layers, {env.world} ranks, "
              f"{torch.cuda.get_device_name()}")
        print("| variant | step ms (per round) | peak GiB above the inputs | reserved GiB |")
        print("|---|---|---|---|")
        for v in args.variants:
            print(f"| {v} | {' / '.join(f'{t:.3f}' for t in times[v])} | {memory[v][0]:.2f} | {memory[v][1]:.2f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
