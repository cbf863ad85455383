"""Where the chained forward's time goes (interlace.ops.expert_chain), on one GPU.

Per config and token count (balanced routing, one GPU's share of a 2-GPU layer, no gather),
interleaved rounds of ``do_bench`` medians of the expert FFN's two GEMMs in four forms:

* ``two``: GEMM0 and GEMM1 as two launches (the tables' kernels, INTERLACE_CHAIN=0);
* ``chain``: one chained launch;
* ``split``: the chained kernel as a GEMM0-only and a GEMM1-only launch (its code, no counts or waits);
* ``nosync``: one launch with the counts and waits compiled out — a race, timed only to bound
  what the synchronization costs (its output is not used).

Usage (GPU): ``python scripts/chain_probe.py --configs phi3.5-moe qwen3-30b-a3b --tokens 4096 --rounds 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton

from interlace.bench.harness import bench_config
from interlace.experts import init_expert_weights
from interlace.ops import expert_chain
from interlace.ops import grouped_gemm as gg


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", default=["phi3.5-moe", "mixtral-8x7b", "qwen3-30b-a3b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[4096])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    gg._ensure_allocator()
    real_launch = expert_chain.launch
    rows_out = []
    for name in args.configs:
        cfg = bench_config(name, small=False)
        E = cfg.num_experts // args.world
        w_up, w_down = init_expert_weights(cfg, range(E), 0, dev)
        for T in args.tokens:
            R = T * cfg.top_k
            counts = torch.full((E,), R // E, dtype=torch.int64)
            counts[: R % E] += 1
            ends = counts.cumsum(0).to(device=dev, dtype=torch.int32)
            x = torch.randn(R, cfg.hidden, device=dev).to(cfg.dtype)
            os.environ["INTERLACE_CHAIN"] = "0"
            c0, c1, source = gg.choose_configs(x, w_down, R, cfg.activation)
            act = torch.empty(R, cfg.ffn, device=dev, dtype=cfg.dtype)
            y = torch.empty(R, cfg.hidden, device=dev, dtype=cfg.dtype)

            def two():
                os.environ["INTERLACE_CHAIN"] = "0"
                gg.expert_ffn_triton(x, None, 1, R, w_up, w_down, ends, cfg.activation)

            def chain():
                os.environ["INTERLACE_CHAIN"] = "1"
                gg.expert_ffn_triton(x, None, 1, R, w_up, w_down, ends, cfg.activation)

            def split():
                sched = gg.tile_schedule(ends, R, c0.block_m, with_ready=True)
                for phases in (1, 2):
                    expert_chain.ffn_chain(x, None, 1, w_up, w_down, act, None, y, sched, R, cfg.activation, c0, c1,
                                           True, phases=phases)

            def nosync():
                expert_chain.launch = lambda *a, **k: real_launch(*a, **dict(k, CHAINED=False))
                try:
                    sched = gg.tile_schedule(ends, R, c0.block_m, with_ready=True)
                    expert_chain.ffn_chain(x, None, 1, w_up, w_down, act, None, y, sched, R, cfg.activation, c0, c1,
                                           True)
                finally:
                    expert_chain.launch = real_launch

            forms = {"two": two, "chain": chain, "split": split, "nosync": nosync}
            times = {f: [] for f in forms}
            with torch.no_grad():
                for f in forms.values():
                    f()
                for r in range(args.rounds):
                    for f, fn in (forms.items() if r % 2 == 0 else reversed(forms.items())):
                        times[f].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
            os.environ.pop("INTERLACE_CHAIN", None)
            expert_chain.check_chain_errors()
            med = {f: statistics.median(t) for f, t in times.items()}
            flops = 2 * R * cfg.hidden * cfg.ffn * (3 if cfg.activation == "swiglu" else 2)
            row = {"config": name, "tokens": T, "configs": source, "c0": str(c0), "c1": str(c1), "ms": times,
                   "median_ms": med, "tflops": {f: flops / m / 1e9 for f, m in med.items()}}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
            del x, act, y
        del w_up, w_down
        torch.cuda.empty_cache()
    print("\n| config | tokens | two ms | chain ms | split ms | nosync ms | two ÷ chain | two ÷ split | two ÷ nosync |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        m = r["median_ms"]
        print(f"| {r['config']} | {r['tokens']} | {m['two']:.3f} | {m['chain']:.3f} | {m['split']:.3f} | "
              f"{m['nosync']:.3f} | {m['two'] / m['chain']:.3f} | {m['two'] / m['split']:.3f} | "
              f"{m['two'] / m['nosync']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
