"""``auto``'s cost at decode sizes (issue 50, item 3): is a decided ``auto`` call within 5% or 15 µs
of the strategy it runs?

    torchrun --nproc-per-node 2 benchmarks/auto_decode.py --out DIR
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 benchmarks/auto_decode.py --smoke --out /tmp/d   # CPU, gloo

Per shape (the presets and :data:`SHAPES`, shapes outside them) and token count per GPU, on one
layer with the router's own (random) routing: a fresh ``auto`` (empty decision cache in a
temporary folder, no shipped decisions) is called until it has decided; then ``auto`` and the
strategy it chose, that strategy on its own layer object with the same weights, are timed in
alternation: with a barrier before each call (``--iters`` calls each, alternating call by call,
median, max over ranks) and back to back
(``--back-to-back`` calls issued together, ms per call; median of ``--rounds``, max over ranks).
Outputs of both are checked against each other (bf16 tolerance). Rows go to ``DIR/rows.jsonl`` as
they finish and, at the end, with the run's meta to ``DIR/results.json``; last, a table and the
share of rows within the bar.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from interlace import MoEConfig, MoELayer
from interlace.config import PRESETS
from interlace.parallel import release_shared_buffers
from interlace.tools.bench import bench_config, git_commit, init_env, reduce_max, rel_err
from interlace.tools.bench_timing import barrier, time_back_to_back, time_cpu, time_cuda

# (hidden, ffn, experts, top_k): none is a preset's shape
SHAPES = [(1000, 2816, 16, 2), (1536, 1024, 24, 3), (2048, 768, 200, 8), (2880, 2880, 32, 4),
          (3584, 2560, 64, 8), (5120, 1536, 160, 6)]


def parse_args():
    p = argparse.ArgumentParser(description="auto against the strategy it runs, at decode sizes")
    p.add_argument("--tokens", nargs="+", type=int, default=[8, 32, 128, 512], help="tokens per GPU")
    p.add_argument("--presets", nargs="*", default=list(PRESETS), help="presets to run (none: grid shapes only)")
    p.add_argument("--grid", type=int, default=len(SHAPES), help="how many of the non-preset shapes")
    p.add_argument("--iters", type=int, default=90, help="calls timed with a barrier before each (alternating)")
    p.add_argument("--back-to-back", type=int, default=20, help="calls issued together per round")
    p.add_argument("--rounds", type=int, default=5, help="back-to-back rounds (median)")
    p.add_argument("--smoke", action="store_true", help="tiny fp32 shapes (CPU, gloo)")
    p.add_argument("--out", default="auto-decode", help="folder for rows.jsonl")
    return p.parse_args()


def shapes(args) -> list[tuple[str, MoEConfig]]:
    if args.smoke:
        return [("smoke", MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32))]
    found = [(name, bench_config(name, False)) for name in args.presets]
    for h, f, e, k in SHAPES[:args.grid]:
        found.append((f"N{h}-K{f}-E{e}-k{k}", MoEConfig(hidden=h, ffn=f, num_experts=e, top_k=k)))
    return found


def run_row(env, name: str, cfg: MoEConfig, tokens: int, args, decisions: str) -> dict:
    auto = MoELayer(cfg, group=env.group, strategy="auto", seed=1, device=env.device,
                    strategy_options={"decisions_dir": decisions, "shipped_decisions": False})
    x = torch.randn(tokens, cfg.hidden, device=env.device, dtype=cfg.dtype,
                    generator=torch.Generator(env.device).manual_seed(env.rank))
    with torch.no_grad():
        for _ in range(16):  # calibration: until the bucket is decided
            auto(x)
            if auto.strategy.choice_for(tokens) is not None:
                break
        choice = auto.strategy.choice_for(tokens)
        spec = choice.spec if choice is not None else "undecided"
        alone = MoELayer(cfg, group=env.group, strategy=spec, seed=1, device=env.device)
        err = rel_err(auto(x), alone(x))
        timer = time_cuda if x.is_cuda else time_cpu
        barrier_ms = {"auto": [], spec: []}
        pair = (("auto", auto), (spec, alone))
        for key, layer in pair:
            timer(lambda: layer(x), 3, 0, env)  # (warm-up only)
        for i in range(args.iters):  # alternating calls, the order rotated: drift hits both alike
            for key, layer in pair[::1 if i % 2 else -1]:
                barrier_ms[key] += timer(lambda: layer(x), 0, 1, env)
        b2b = {"auto": [], spec: []}
        if x.is_cuda:
            for _ in range(args.rounds):
                for key, layer in (("auto", auto), (spec, alone)):
                    b2b[key].append(time_back_to_back(lambda: layer(x), args.back_to_back, env))
    row = {"shape": name, "tokens": tokens, "runs": spec, "rel_err": reduce_max(env, err),
           "decided_by": None if choice is None else choice.source,
           "calibration_ms": None if choice is None else choice.times_ms}
    for key, label in (("auto", "auto"), (spec, "alone")):
        row[f"{label}_barrier_ms"] = reduce_max(env, statistics.median(barrier_ms[key]))
        row[f"{label}_b2b_ms"] = reduce_max(env, statistics.median(b2b[key])) if b2b[key] else None
    del auto, alone
    release_shared_buffers()
    return row


def within_bar(auto_ms: float | None, alone_ms: float | None) -> bool | None:
    """The issue's bar: within 5% or 15 µs of the strategy auto runs."""
    if auto_ms is None or alone_ms is None:
        return None
    return auto_ms <= alone_ms * 1.05 or auto_ms - alone_ms <= 0.015


def main():
    args = parse_args()
    env = init_env()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as decisions:  # (fresh: nothing decided before this run)
        for name, cfg in shapes(args):
            for tokens in args.tokens:
                row = run_row(env, name, cfg, tokens, args, decisions)
                row["barrier_ok"] = within_bar(row["auto_barrier_ms"], row["alone_barrier_ms"])
                row["b2b_ok"] = within_bar(row["auto_b2b_ms"], row["alone_b2b_ms"])
                rows.append(row)
                if env.rank == 0:
                    with open(os.path.join(args.out, "rows.jsonl"), "a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(json.dumps(row), flush=True)
    if env.rank == 0:
        print(f"\n{'shape':<24} {'T':>5} {'runs':<12} {'auto|':>7} {'alone|':>7} {'auto b2b':>8} {'alone b2b':>9} ok")
        for r in rows:
            b2b = (f"{r['auto_b2b_ms']:8.3f} {r['alone_b2b_ms']:9.3f}" if r["auto_b2b_ms"] is not None
                   else f"{'-':>8} {'-':>9}")
            print(f"{r['shape']:<24} {r['tokens']:>5} {r['runs']:<12} {r['auto_barrier_ms']:7.3f} "
                  f"{r['alone_barrier_ms']:7.3f} {b2b} {r['barrier_ok']}/{r['b2b_ok']}")
        judged = [ok for r in rows for ok in (r["barrier_ok"], r["b2b_ok"]) if ok is not None]
        print(f"within 5% or 15 µs: {sum(judged)} of {len(judged)}")
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        meta = {"commit": git_commit(), "device": f"{env.world}x {device}", "world": env.world,
                "date": time.strftime("%Y-%m-%d"), "command": "torchrun --nproc-per-node 2 benchmarks/auto_decode.py "
                + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k in ("tokens", "grid"))}
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
