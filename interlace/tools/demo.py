"""The demo README's first command runs.

* With ≥ 2 GPUs: a torchrun benchmark of the default config (qwen2-moe, 4096 and 16384
  tokens/GPU, random routing, forward; naive vs sequential vs fused), through the harness.
* Otherwise (a CPU-only machine, or ``--cpu``): 2 simulated ranks, processes joined by a gloo
  group on this machine, run the layer forward and backward on a small config with each
  strategy, check outputs and all gradients against the fp64 reference, and print a table.
  Triton kernels run under Triton's CPU interpreter there, so the CPU demo exercises the same
  kernels as the GPUs (slowly: it shows correctness, not speed).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
import time
import warnings

DEFAULT_CONFIG = "qwen2-moe"
GPU_STRATEGIES = ("naive", "sequential", "fused")
# A plain "fused" training call runs sequential's forward and backward (the faster training
# path); fused:train runs the fused kernels both ways, fused:recompute the fused forward
# recomputed through sequential for the backward.
CPU_STRATEGIES = ("naive", "sequential", "sequential:triton", "pipelined:3", "fused:train", "fused:recompute")


def _gpu_demo(args) -> int:
    import torch

    if "RANK" not in os.environ:
        n = torch.cuda.device_count()
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "-m", "interlace.tools.demo",
               "--config", args.config, "--out", args.out]
        if args.strategies:
            cmd += ["--strategies", *args.strategies]
        print("launching:", " ".join(cmd), flush=True)
        return subprocess.call(cmd)
    from interlace.tools.bench import main as bench_main

    bench_main(["--configs", args.config, "--tokens", "4096", "16384", "--strategies",
                *(args.strategies or GPU_STRATEGIES), "--out", args.out])
    return 0


def _cpu_worker(rank: int, world: int, port: int, queue, strategies: tuple[str, ...]) -> None:
    import torch
    import torch.distributed as dist

    from interlace import MoEConfig, MoELayer, reference_moe
    from interlace.experts import init_expert_weights
    from interlace.routing import Router
    from interlace.parallel import release_shared_buffers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # The interpreter computes masked-off lanes too (NaN/inf there are never stored): numpy's
    # warnings about them say nothing about the results, which the table checks.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    cfg = MoEConfig(hidden=64, ffn=48, num_experts=8, top_k=2, dtype=torch.float32, renormalize=True)
    tokens, seed = 48, 0
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(tokens, cfg.hidden, generator=gen) for _ in range(world)]
    gs = [torch.randn(tokens, cfg.hidden, generator=gen) for _ in range(world)]

    # fp64 reference over every rank's tokens, with every expert's weights.
    rw = Router(cfg, seed, torch.device("cpu")).weight.detach().double().requires_grad_()
    wu, wd = (w.double().requires_grad_() for w in init_expert_weights(cfg, range(cfg.num_experts), seed, "cpu"))
    ref_out, ref_dx = [], []
    for x, g in zip(xs, gs):
        xr = x.double().requires_grad_()
        out, _ = reference_moe(xr, rw, wu, wd, cfg)
        (out * g.double()).sum().backward()
        ref_out.append(out.detach())
        ref_dx.append(xr.grad)

    def err(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    rows = []
    for strategy in strategies:
        layer = MoELayer(cfg, strategy=strategy, seed=seed, device="cpu")
        x = xs[rank].clone().requires_grad_()
        t0 = time.perf_counter()
        out = layer(x)
        out.backward(gs[rank])
        ms = (time.perf_counter() - t0) * 1e3
        drouter = layer.router.weight.grad.clone()
        dist.all_reduce(drouter)
        lo, hi = layer.ep.first_expert, layer.ep.first_expert + layer.ep.num_local
        errs = [err(out, ref_out[rank]), err(x.grad, ref_dx[rank]), err(drouter, rw.grad),
                err(layer.experts.w_up.grad, wu.grad[lo:hi]), err(layer.experts.w_down.grad, wd.grad[lo:hi])]
        rows.append((strategy, ms, errs))
    queue.put((rank, rows))
    release_shared_buffers()  # before the group goes: see its docstring
    dist.destroy_process_group()


def _cpu_demo(args) -> int:
    # Run the real Triton kernels on the CPU (read by Triton in the worker processes, which
    # inherit the environment: this process has no kernel to run).
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.multiprocessing as mp

    strategies = tuple(args.strategies or CPU_STRATEGIES)

    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    print(f"CPU demo (no 2 GPUs here, or --cpu): {world} simulated ranks (gloo processes on this CPU), "
          f"Triton kernels under Triton's CPU interpreter; hidden 64, ffn 48, 8 experts (4/rank), top-2, fp32; "
          f"forward+backward against the fp64 reference", flush=True)
    mp.start_processes(_cpu_worker, args=(world, port, queue, strategies), nprocs=world, join=True,
                       start_method="spawn")
    results = dict(queue.get() for _ in range(world))
    tol = 1e-5
    print()
    print("| rank | strategy | first fwd+bwd ms | rel err out | dx | d router | d w_up | d w_down | check |")
    print("|---|---|---|---|---|---|---|---|---|")
    ok = True
    for rank in sorted(results):
        for strategy, ms, errs in results[rank]:
            good = all(e < tol for e in errs)
            ok &= good
            print(f"| {rank} | {strategy} | {ms:.1f} | " + " | ".join(f"{e:.1e}" for e in errs)
                  + f" | {'ok' if good else 'FAIL'} |")
    print(f"\n{'all strategies agree with the reference' if ok else 'MISMATCH'} (tolerance {tol:g}, fp32 vs fp64)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="interlace demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="preset of the GPU benchmark (default %(default)s)")
    p.add_argument("--out", default="bench-out", help="folder of the GPU benchmark's results (default %(default)s)")
    p.add_argument("--cpu", action="store_true", help="the CPU demo even if GPUs are present")
    p.add_argument("--strategies", nargs="+", metavar="NAME",
                   help=f"strategies to run (default: {' '.join(GPU_STRATEGIES)} on GPUs; "
                        f"{' '.join(CPU_STRATEGIES)} on the CPU)")
    args = p.parse_args(argv)
    import torch

    if not args.cpu and torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return _gpu_demo(args)
    return _cpu_demo(args)


if __name__ == "__main__":
    sys.exit(main())
