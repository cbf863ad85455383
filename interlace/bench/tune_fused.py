"""``interlace tune``: profile the fused strategy's block split per shape and store it.

Launch with ``torchrun --nproc-per-node W -m interlace.bench.tune_fused [--configs ...]
[--tokens ...]`` (or ``interlace tune`` under torchrun). For every config × tokens-per-GPU
bucket it times the layer (random routing, CUDA events, slowest rank's median) for candidate
numbers of layer0 communication programs ``n_comm`` (with the default ``n_comm1``), then for
candidate layer1 combine programs ``n_comm1`` with the best ``n_comm`` (a coordinate search:
the two layers are separate launches, so their splits are nearly independent), prints a
progress line per measurement, and merges the fastest split into
``$INTERLACE_TUNING_DIR`` (default: the package's ``interlace/tuning``) as
``fused-split-<device>.json`` keyed as :mod:`interlace.ops.fused_tuning` describes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from interlace.bench.harness import init_env, make_routing, reduce_max, time_cuda
from interlace.config import preset
from interlace.layer import MoELayer
from interlace.ops.fused_tuning import PACKAGE_DIR, split_key, write_entries

CANDIDATES = (4, 8, 12, 16, 24, 32, 48)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="interlace tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["mixtral-8x7b", "phi3.5-moe", "qwen2-moe", "qwen3-30b-a3b",
                                                    "dsv3-like", "flashdmoe-cfg"])
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--candidates", nargs="+", type=int, default=list(CANDIDATES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out-dir", default=os.environ.get("INTERLACE_TUNING_DIR", str(PACKAGE_DIR)))
    args = p.parse_args(argv)
    env = init_env()
    if not env.cuda or env.world < 2:
        print("interlace tune: needs ≥ 2 GPUs under torchrun (the split only matters with peers)", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(env.device).multi_processor_count
    device_name = torch.cuda.get_device_name(env.device).replace(" ", "_")
    candidates = [c for c in args.candidates if 0 < c < sms]
    total = len(args.configs) * len(args.tokens) * 2 * len(candidates)
    done, started = 0, time.perf_counter()
    entries: dict[str, dict[str, list[int]]] = {}
    for name in args.configs:
        cfg = preset(name)
        layer = MoELayer(cfg, group=env.group, strategy="naive", seed=0, device=env.device)
        for tokens in args.tokens:
            x = torch.randn(tokens, cfg.hidden, device=env.device).to(cfg.dtype)
            idx = make_routing(cfg, "random", tokens, env, 0)
            best = {"n_comm": None, "n_comm1": None}
            default1 = max(1, sms // 8)
            for which in ("n_comm", "n_comm1"):
                timings = {}
                for c in candidates:
                    split = {"n_comm": c, "n_comm1": default1} if which == "n_comm" else \
                        {"n_comm": best["n_comm"], "n_comm1": c}
                    layer.set_strategy("fused", max_tokens=max(args.tokens), **split)
                    with torch.no_grad():
                        times = time_cuda(lambda: layer(x, expert_indices=idx), args.warmup, args.iters, env)
                    timings[c] = reduce_max(env, statistics.median(times))
                    done += 1
                    if env.rank == 0:
                        print(f"[{done}/{total} {time.perf_counter() - started:6.0f}s] {name} T={tokens} {which}={c}: "
                              f"{timings[c]:.3f} ms", flush=True)
                best[which] = min(timings, key=timings.get)
            entries.setdefault(split_key(cfg, env.world, sms), {})[str(tokens)] = [best["n_comm"], best["n_comm1"]]
            if env.rank == 0:
                print(f"  → {name} T={tokens}: n_comm={best['n_comm']} n_comm1={best['n_comm1']}", flush=True)
        del layer
        torch.cuda.empty_cache()
    if env.rank == 0:
        path = Path(args.out_dir) / f"fused-split-{device_name}.json"
        write_entries(path, entries, {"device": torch.cuda.get_device_name(env.device), "sm_count": sms,
                                      "world": env.world, "torch": torch.__version__,
                                      "seconds": round(time.perf_counter() - started, 1)})
        print(f"wrote {path} ({time.perf_counter() - started:.0f} s)")
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
