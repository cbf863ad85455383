"""Where the Triton expert block's forward spread comes from (one GPU).

    python scripts/fwd_spread_probe.py [--configs phi3.5-moe qwen2-moe] [--tokens 4096 16384] [--rounds 12]

Runs 174-175 saw a Triton forward move 10-11% between interleaved rounds of one process while the
torch block stayed within 2-3%. Per row this times the bench block's no-grad forward of both
backends in alternating rounds and keeps every call's time (``do_bench(..., return_mode="all")``),
so the spread shows as round-level shifts (a state lasting a round) or as slow calls inside a
round. It also times the Triton forward with its outputs and schedule allocated once (``static``:
the GEMMs alone through the launchers, the same configs), to tell allocation effects from the
kernels'. Prints per round the median and the 10th/90th percentiles; JSON with every call to --json.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_expert_kernels import bench_rows, block  # noqa: E402

from interlace.ops import grouped_gemm as gg  # noqa: E402


def pct(ts, q):
    ts = sorted(ts)
    return ts[min(len(ts) - 1, int(q * len(ts)))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", default=["phi3.5-moe", "qwen2-moe"])
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = []
    for name, cfg, T, w_up, w_down, weights, index, x, grad in bench_rows(args):
        roa, aor, ends, rows = index
        k = roa.shape[1]
        c0, c1, _ = gg.choose_configs(x, w_down, rows, cfg.activation)

        def fwd(b):
            with torch.no_grad():
                return block(b, x, w_up, w_down, weights, index, cfg.activation)

        # the two GEMMs alone with outputs and schedules made once (GEMM0 with its gather)
        tma = gg.use_tma(w_up, w_down)
        if tma:
            gg._ensure_allocator()
        s0, s1 = gg.tile_schedule(ends, rows, c0.block_m), gg.tile_schedule(ends, rows, c1.block_m)
        act = torch.empty(rows, cfg.ffn, device=x.device, dtype=x.dtype)
        y = torch.empty(rows, cfg.hidden, device=x.device, dtype=x.dtype)

        def static():
            gg._launch_gemm0(x, aor, k, w_up, act, None, s0, rows, cfg.activation, c0, tma)
            gg._launch_gemm(act, w_down, y, None, ends, rows, cols=cfg.hidden, red=cfg.ffn, b_trans=True,
                            epilogue=0, config=c1, schedule=s1, tma=tma)

        variants = {"torch": lambda: fwd("torch"), "triton": lambda: fwd("triton"), "static": static}
        row = {"config": name, "tokens": T, "configs": [list(c0.__dict__.values()), list(c1.__dict__.values())],
               "calls": {v: [] for v in variants}}
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for v in order:
                row["calls"][v].append(triton.testing.do_bench(variants[v], warmup=25, rep=200, return_mode="all"))
        out.append(row)
        print(f"\n{name} {T}: per round median (p10-p90) ms")
        for v, rounds in row["calls"].items():
            cells = [f"{statistics.median(ts):.3f} ({pct(ts, 0.1):.3f}-{pct(ts, 0.9):.3f})" for ts in rounds]
            meds = [statistics.median(ts) for ts in rounds]
            print(f"  {v:7s} spread of round medians {min(meds):.3f}-{max(meds):.3f} ({max(meds) / min(meds) - 1:.1%}): "
                  + "; ".join(cells), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
