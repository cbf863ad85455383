"""Where the time of one layer call goes: torch.profiler over a few calls per strategy.

    torchrun --nproc-per-node 2 benchmarks/profile_layer.py [--configs qwen2-moe ...] [--tokens 4096] [--fwdbwd]
                                                            [--fp8]

Rank 0 prints, per config and strategy: the median wall time of a call, the host time to
*issue* a call (no sync at the end), and the top CUDA kernels by total device time. With
``--fwdbwd`` a call is forward and backward (input and weight gradients); with ``--fp8`` the
layer's experts are block-scaled FP8 (inference, docs/fp8.md). Chrome
traces land in $OUT (or ./bench-out) as trace_<config>_<strategy>.json.
"""

import argparse
import os
import re
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from interlace import MoELayer
from interlace.tools.bench import bench_config
from interlace.parallel import release_shared_buffers


def busy_ms(prof) -> float:
    """Device time of every kernel the profile recorded (ms; overlapping kernels counted each)."""
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", default=["flashdmoe-cfg", "qwen2-moe"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--strategies", nargs="+", default=["naive", "sequential"])
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--fwdbwd", action="store_true", help="profile forward + backward instead of forward")
    p.add_argument("--fp8", action="store_true", help="FP8 experts (inference: not with --fwdbwd)")
    args = p.parse_args()
    if args.fp8 and args.fwdbwd:
        p.error("--fp8 layers are inference-only: drop --fwdbwd")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    rank = dist.get_rank()
    out_dir = os.environ.get("OUT", "bench-out")
    os.makedirs(out_dir, exist_ok=True)
    for name in args.configs:
        cfg = bench_config(name, small=False)
        if args.fp8:
            cfg = cfg.with_(expert_quant="fp8")
        layer = MoELayer(cfg, strategy="naive" if not args.fp8 else "sequential", device=dev)
        layer.requires_grad_(args.fwdbwd)
        x = torch.randn(args.tokens, cfg.hidden, device=dev).to(cfg.dtype).requires_grad_(args.fwdbwd)
        grad = torch.randn_like(x)

        def call():
            if not args.fwdbwd:
                return layer(x)
            for p in (x, *layer.parameters()):  # fresh gradients, as the bench's calls (no accumulation kernels)
                p.grad = None
            layer(x).backward(grad)

        for strategy in args.strategies:
            layer.set_strategy(strategy)
            with torch.set_grad_enabled(args.fwdbwd):
                for _ in range(5):
                    call()
                torch.cuda.synchronize()
                walls, issue = [], []
                for _ in range(20):
                    dist.barrier()
                    t0 = time.perf_counter()
                    call()
                    issue.append((time.perf_counter() - t0) * 1e3)
                    torch.cuda.synchronize()
                    walls.append((time.perf_counter() - t0) * 1e3)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        call()
                    torch.cuda.synchronize()
            if rank == 0:
                mode = "fwd+bwd" if args.fwdbwd else ("fwd-fp8" if args.fp8 else "fwd")
                print(f"\n=== {name} T={args.tokens} {strategy} {mode}: wall {statistics.median(walls):.3f} ms, "
                      f"host issue {statistics.median(issue):.3f} ms (per call; profiled 5 calls below), "
                      f"GPU kernels {busy_ms(prof) / 5:.3f} ms per call")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))
                prof.export_chrome_trace(os.path.join(out_dir, re.sub(r"[^\w.-]", "-", f"trace_{name}_{strategy}_{mode}.json")))
    release_shared_buffers()  # before the group goes: see its docstring
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
