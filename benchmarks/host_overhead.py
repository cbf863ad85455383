"""Host time of one expert block, forward + backward, per expert backend (one GPU).

The block of ``sequential`` at EP world size ``--world``: this rank's share of the experts
(E / world) over the rows it would receive with balanced routing (tokens · k), gathered through
a permutation as after the all-to-all. Per backend:

* GPU ms: CUDA events around forward + backward (median of ``--iters``), the GPU idle at the
  start, so a host slower than the kernels shows here; "host ahead": the same events with the
  GPU held busy (``torch.cuda._sleep``) while the host issues the call, i.e. the kernels' own time;
* host ms: wall time until ``backward()`` returns, the GPU idle at the start. A block whose host
  time exceeds its GPU time starves the GPU: in a layer the next all-to-all then waits for the
  slower rank;
* host syncs in one call (``torch.cuda.set_sync_debug_mode``);
* with ``--profile``, the top host functions of the Triton backend (cProfile).

Backend ``triton-jit`` is the Triton backend launching through ``kernel[grid](...)`` instead of
the cached launch path (:mod:`interlace.kernels.launch`); ``--backends`` takes repeats, so
``torch triton-jit triton triton-jit triton`` interleaves two rounds of the A/B.

usage: python benchmarks/host_overhead.py [--configs ...] [--tokens 4096] [--world 2] [--profile]
       [--backends torch triton triton-jit ...]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import time

import torch

from interlace.config import PRESETS
from interlace.kernels import launch
from interlace.kernels.routing_index import expert_major_index
from interlace.strategies.sequential import gathered_expert_ffn
from interlace.tools.bench_timing import host_syncs


def block(cfg, tokens: int, world: int, device, routing: str = "balanced"):
    El = cfg.num_experts // world
    R = tokens * cfg.top_k
    counts = torch.full((world, El), R // (world * El), dtype=torch.int32, device=device)
    counts[0, : R - int(counts.sum())] += 1  # the remainder, so the rows sum to R
    if routing == "random":  # each source's tokens pick k distinct experts uniformly (the bench's "random")
        gen = torch.Generator().manual_seed(1)
        for w in range(world):
            picks = torch.rand(tokens, cfg.num_experts, generator=gen).topk(cfg.top_k, dim=1).indices
            counts[w] = torch.bincount(picks.flatten(), minlength=cfg.num_experts)[:El].to(counts.device)
        R = int(counts.sum())
    src_row, inverse, offs = expert_major_index(counts, R)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(R, cfg.hidden, device=device, dtype=cfg.dtype, generator=gen).requires_grad_()
    up = 2 * cfg.ffn if cfg.activation == "swiglu" else cfg.ffn
    w_up = (torch.randn(El, up, cfg.hidden, device=device, dtype=cfg.dtype, generator=gen) * 0.02).requires_grad_()
    w_down = (torch.randn(El, cfg.hidden, cfg.ffn, device=device, dtype=cfg.dtype, generator=gen) * 0.02).requires_grad_()
    dy = torch.randn(R, cfg.hidden, device=device, dtype=cfg.dtype, generator=gen)
    return x, w_up, w_down, src_row, inverse, offs, dy, R


def measure(backend, cfg, tokens, world, iters, profile, routing="balanced", kernels=False):
    device = torch.device("cuda")
    x, w_up, w_down, src_row, inverse, offs, dy, R = block(cfg, tokens, world, device, routing)

    def call():
        with launch.jit_path() if backend == "triton-jit" else contextlib.nullcontext():
            y = gathered_expert_ffn(backend.removesuffix("-jit"), x, src_row, inverse, R, w_up, w_down, offs,
                                    cfg.activation)
            y.backward(dy)
        x.grad = w_up.grad = w_down.grad = None

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    gpu, host, ahead = [], [], []
    cycles = int(torch.cuda.get_device_properties(device).clock_rate * 1e3 * 0.02)  # ~20 ms of spinning
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        a.record()
        call()
        b.record()
        b.synchronize()
        ahead.append(a.elapsed_time(b))
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record()
        call()
        b.record()
        host.append((time.perf_counter() - t0) * 1e3)
        b.synchronize()
        gpu.append(a.elapsed_time(b))
    syncs = len(host_syncs(call))
    top = ""
    if kernels:  # GPU time per kernel name, per call (the host ahead: a sleep first)
        from torch.profiler import ProfilerActivity, profile as torch_profile

        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                torch.cuda._sleep(cycles)
                call()
            torch.cuda.synchronize()
        rows = sorted(((e.key, e.device_time_total / 5e3) for e in prof.key_averages() if e.device_time_total > 0
                       and "sleep" not in e.key), key=lambda kv: -kv[1])
        top += "".join(f"    {ms:8.3f} ms  {name[:90]}\n" for name, ms in rows[:10])
    if profile:
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(iters):
            call()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
        top = s.getvalue()
    return statistics.median(gpu), statistics.median(ahead), statistics.median(host), syncs, top


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["qwen3-30b-a3b", "qwen2-moe", "mixtral-8x7b"])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="cProfile the Triton backend (top 25 by own time)")
    p.add_argument("--routing", nargs="+", default=["balanced"], choices=["balanced", "random"],
                   help="rows per expert: equal, or counted from uniformly random top-k picks")
    p.add_argument("--kernels", action="store_true", help="GPU ms per kernel and call (torch.profiler)")
    p.add_argument("--backends", nargs="+", default=["torch", "triton"], choices=["torch", "triton", "triton-jit"],
                   help="in this order, repeats allowed (interleaved rounds); triton-jit: the Triton backend "
                        "launching through kernel[grid](...) instead of interlace.kernels.launch's cached path")
    args = p.parse_args()
    rows = []
    for name in args.configs:
        cfg = PRESETS[name]
        for tokens in args.tokens:
            for routing in args.routing:
                for backend in args.backends:
                    gpu, ahead, host, syncs, top = measure(backend, cfg, tokens, args.world, args.iters,
                                                           args.profile and backend != "torch", routing, args.kernels)
                    rows.append((name, tokens, routing, backend, gpu, ahead, host, syncs))
                    print(f"{name} T={tokens} {routing} {backend}: GPU {gpu:.3f} ms (host ahead {ahead:.3f}), "
                          f"host {host:.3f} ms, syncs {syncs}", flush=True)
                    if top:
                        print(top, flush=True)
    print("\n| config | tokens | routing | backend | GPU ms (fwd+bwd) | GPU ms, host ahead | host ms | host syncs |\n"
          "|---|---|---|---|---|---|---|---|")
    for name, tokens, routing, backend, gpu, ahead, host, syncs in rows:
        print(f"| {name} | {tokens} | {routing} | {backend} | {gpu:.3f} | {ahead:.3f} | {host:.3f} | {syncs} |")


if __name__ == "__main__":
    main()
