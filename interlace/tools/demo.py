"""``interlace demo``, the README's first command: run the layer on this machine and check it.

* With ≥ 2 GPUs: a torchrun benchmark of the default config (qwen2-moe, 4096 and 16384
  tokens/GPU, random routing, forward; naive vs sequential vs fused), through the harness.
* Otherwise (a CPU-only machine, or ``--cpu``): 2 ranks, processes joined by a gloo group on
  this machine, run each strategy on a small config and check it against the fp64 reference:
  a training call (forward and backward: the output and every gradient) for the strategies
  that train, an inference call (forward, no autograd graph) for ``fused`` and ``persistent``,
  whose training calls run ``sequential``'s path. The ``tp_ep`` forms run on a TP = 2 × EP = 1
  mesh of the two ranks. Triton kernels run under Triton's CPU interpreter there, so the CPU
  demo exercises the same kernels as the GPUs (slowly: it shows correctness, not speed).
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time
import warnings

from interlace.tools.command_line import command_parser

DEFAULT_CONFIG = "qwen2-moe"
GPU_STRATEGIES = ("naive", "sequential", "fused")
# Every strategy the README names that runs on a CPU (all of them, under the interpreter). A
# plain "fused" or "persistent" training call runs sequential's forward and backward (the
# faster training path), so those two are checked on an inference call; fused:train runs the
# fused kernels both ways, fused:recompute the fused forward recomputed through sequential.
CPU_STRATEGIES = ("naive", "sequential", "sequential:triton", "pipelined:3", "fused", "fused:train", "fused:lean",
                  "fused:recompute", "persistent", "tp_ep:O0", "tp_ep:O1", "tp_ep:O2", "tp_ep:O3", "auto")
INFERENCE_ONLY = ("fused", "persistent")  # their own kernels run on inference calls only
CPU_CONFIG = dict(hidden=64, ffn=32, num_experts=8, top_k=2, renormalize=True)
CPU_TOKENS = 16  # per rank


def _gpu_demo(args) -> int:
    import torch

    strategies = args.strategies or GPU_STRATEGIES
    if "RANK" not in os.environ:
        n = torch.cuda.device_count()
        print(f"GPU demo: {n} GPUs; benchmarks {', '.join(strategies)} on {args.config} (forward, "
              f"4096 and 16384 tokens per GPU; each output checked against naive's)", flush=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "-m", "interlace.tools.demo",
               "--config", args.config, "--out", args.out, "--strategies", *strategies]
        print("launching:", " ".join(cmd), flush=True)
        return subprocess.call(cmd)
    from interlace.tools.bench import main as bench_main

    bench_main(["--configs", args.config, "--tokens", "4096", "16384", "--strategies", *strategies,
                "--out", args.out])
    return 0


def _reference(cfg, seed, xs, gs):
    """Per batch b: the fp64 output, input gradient and every weight's gradient of
    ``reference_moe`` over all experts (each batch's gradients apart, so that a layer can sum
    those of the batches its group saw)."""
    import torch

    from interlace import reference_moe
    from interlace.experts import init_expert_weights
    from interlace.routing import Router

    rw0 = Router(cfg, seed, torch.device("cpu")).weight.detach().double()
    wu0, wd0 = (w.double() for w in init_expert_weights(cfg, range(cfg.num_experts), seed, "cpu"))
    refs = []
    for x, g in zip(xs, gs):
        xr, rw, wu, wd = (t.clone().requires_grad_() for t in (x.double(), rw0, wu0, wd0))
        out, _ = reference_moe(xr, rw, wu, wd, cfg)
        (out * g.double()).sum().backward()
        refs.append(dict(out=out.detach(), dx=xr.grad, drouter=rw.grad, dwu=wu.grad, dwd=wd.grad))
    return refs


def _check(strategy, cfg, seed, xs, gs, refs, world):
    """One strategy's call on this rank: (call, ms, {what: relative error against the fp64
    reference}). Training calls check the output and all gradients, inference calls the output."""
    import torch
    import torch.distributed as dist

    from interlace import MoELayer
    from interlace.experts import shard_ffn
    from interlace.parallel.mesh import MoEMesh

    mesh = MoEMesh.build(tp=world) if strategy.startswith("tp_ep") else None
    layer = MoELayer(cfg, strategy=strategy, seed=seed, device="cpu", mesh=mesh)
    batch = layer.mesh.ep_rank  # the ranks of a TP group hold the same tokens: batch j of EP rank j
    ref = refs[batch]
    err = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    x = xs[batch].clone().requires_grad_()
    t0 = time.perf_counter()
    if strategy in INFERENCE_ONLY:
        with torch.no_grad():
            out = layer(x)
        return "inference", (time.perf_counter() - t0) * 1e3, {"out": err(out, ref["out"])}
    out = layer(x)
    out.backward(gs[batch])
    ms = (time.perf_counter() - t0) * 1e3
    ran = list(getattr(layer.strategy, "_impls", {}))  # auto: the candidate that served its first call
    call = f"training (ran {ran[0]})" if len(ran) == 1 else "training"
    drouter = layer.router.weight.grad.clone()
    dist.all_reduce(drouter, group=layer.mesh.ep_group)  # the router is data parallel over EP
    seen = refs[:layer.mesh.ep]  # the batches of this rank's EP group
    lo, hi = layer.ep.first_expert, layer.ep.first_expert + layer.ep.num_local
    dwu, dwd = shard_ffn(sum(r["dwu"] for r in seen)[lo:hi], sum(r["dwd"] for r in seen)[lo:hi], cfg,
                         *layer.mesh.shard_ffn(cfg.ffn))
    return call, ms, {"out": err(out, ref["out"]), "dx": err(x.grad, ref["dx"]),
                      "d router": err(drouter, sum(r["drouter"] for r in seen)),
                      "d w_up": err(layer.experts.w_up.grad, dwu), "d w_down": err(layer.experts.w_down.grad, dwd)}


def _cpu_worker(rank: int, world: int, port: int, queue, strategies: tuple[str, ...]) -> None:
    import torch
    import torch.distributed as dist

    from interlace import MoEConfig
    from interlace.parallel import release_shared_buffers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # The interpreter computes masked-off lanes too (NaN/inf there are never stored): numpy's
    # warnings about them say nothing about the results, which the table checks.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    cfg, seed = MoEConfig(**CPU_CONFIG, dtype=torch.float32), 0
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(CPU_TOKENS, cfg.hidden, generator=gen) for _ in range(world)]
    gs = [torch.randn(CPU_TOKENS, cfg.hidden, generator=gen) for _ in range(world)]
    refs = _reference(cfg, seed, xs, gs)
    for strategy in strategies:
        queue.put((rank, strategy) + _check(strategy, cfg, seed, xs, gs, refs, world))
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
    c = CPU_CONFIG
    print(f"CPU demo (no 2 GPUs here, or --cpu): {world} ranks (gloo processes on this CPU), Triton kernels "
          f"under Triton's CPU interpreter; hidden {c['hidden']}, ffn {c['ffn']}, {c['num_experts']} experts "
          f"({c['num_experts'] // world}/rank), top-{c['top_k']}, fp32, {CPU_TOKENS} tokens per rank; each "
          f"against the fp64 reference.", flush=True)
    print(f"Checks {len(strategies)} strategies: {', '.join(strategies)}.", flush=True)
    if any(s in INFERENCE_ONLY for s in strategies):
        print(f"{' and '.join(s for s in INFERENCE_ONLY if s in strategies)}: an inference call (their training "
              f"calls run sequential's path); the others: forward and backward.", flush=True)
    if any(s.startswith("tp_ep") for s in strategies):
        print(f"tp_ep forms: on a TP = {world} × EP = 1 mesh (both ranks hold the same tokens, each half of "
              f"every expert's FFN).", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    t0 = time.perf_counter()
    mp.start_processes(_cpu_worker, args=(world, port, queue, strategies), nprocs=world, join=True,
                       start_method="spawn")
    rows = sorted((queue.get() for _ in range(world * len(strategies))),
                  key=lambda r: (r[0], strategies.index(r[1])))
    tol = 1e-5
    cols = ("out", "dx", "d router", "d w_up", "d w_down")
    print()
    print("| rank | strategy | call | first call ms | rel err " + " | ".join(cols) + " | check |")
    print("|---|---|---|---|" + "---|" * len(cols) + "---|")
    ok = True
    for rank, strategy, call, ms, errs in rows:
        good = all(e < tol for e in errs.values())
        ok &= good
        print(f"| {rank} | {strategy} | {call} | {ms:.0f} | "
              + " | ".join(f"{errs[k]:.1e}" if k in errs else "–" for k in cols) + f" | {'ok' if good else 'FAIL'} |")
    print(f"\n{'all strategies agree with the reference' if ok else 'MISMATCH'} ({len(strategies)} checked; "
          f"tolerance {tol:g}, fp32 against fp64; {time.perf_counter() - t0:.0f} s)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = command_parser("demo", "Run the MoE layer on this machine and check it. With 2 or more GPUs: a torchrun "
                               "benchmark of the default config. Otherwise: 2 gloo ranks on the CPU run each "
                               "strategy forward and backward against the fp64 reference (Triton kernels under "
                               "its interpreter).")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="preset of the GPU benchmark")
    p.add_argument("--out", default="bench-out", help="folder of the GPU benchmark's results")
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
