"""``auto`` on shapes it never saw (issue 32): is it within 5% of the fastest strategy, and what
does its calibration cost?

    torchrun --nproc-per-node 2 benchmarks/auto_grid.py --part 1/2 --out auto-grid-1
    torchrun --nproc-per-node 2 benchmarks/auto_grid.py --part 2/2 --out auto-grid-2 --ship
    python3 benchmarks/auto_grid.py --plan                         # estimated compute, no GPU
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 benchmarks/auto_grid.py --smoke --out /tmp/g   # CPU, gloo

**Grid rows**: :data:`GRID` (shapes not among the presets: hidden 1000–8192, some not multiples of
128; FFN 512–32768; 8–250 experts, some not powers of two; top-k 1–8) × tokens per GPU
(128, 3000, 8192; equal on every rank) × (fwd, fwd+bwd), router-chosen experts. Per row, on one
layer: every candidate auto would consider (``sequential``, ``pipelined:r`` at the planner's
degree where it is > 1, ``fused`` / ``fused:train`` with buffers for the token bucket, as auto
sizes them), each warmed up, then a *fresh* ``auto``
(empty decision cache in a temporary folder, no shipped decisions) is called until it has
decided: its calibration calls are timed as a whole (wall clock, synchronized). Then every
candidate and ``auto`` are timed round-robin (``--iters`` rounds, CUDA events, a barrier before
each call); a strategy's time is the median of its rounds, max over ranks. Outputs of every
strategy are checked against ``sequential``'s on the same input (bf16 tolerance).
**Preset rows**: each preset at 4096 and 16384 tokens, fwd: today's profile-only choice
(``auto`` with ``calibrate=False``) against the new ``auto`` (fresh; with ``--ship`` its
decisions accumulate in ``OUT/ship/<device key>.json``, the file to copy into
``interlace/tuning/decisions/``), timed round-robin.

Rows go to ``OUT/rows.jsonl`` as they finish (a run cut short keeps them); rows start only while
``--budget-s`` is not spent (ranks agree on it). Last, a summary: the share of grid rows where
``auto`` is within 5% of the fastest, the worst ratio, the median and max first-call overhead
(``overhead_ms``: calibration calls' time minus as many calls at auto's steady time), preset
rows new/old. ``--part k/n`` runs every n-th shape (presets with the last part).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from interlace import MoEConfig, MoELayer
from interlace.config import PRESETS
from interlace.parallel import release_shared_buffers
from interlace.planning.rounds import round_order
from interlace.strategies.auto_prior import predicted_candidates
from interlace.strategies.auto_decisions import token_bucket
from interlace.tools.bench import barrier, bench_config, init_env, reduce_max, rel_err

# (hidden, ffn, experts, top_k); none is a preset's shape class.
GRID = [
    (1024, 512, 8, 1), (1024, 32768, 8, 1), (1000, 2816, 16, 2), (1536, 1024, 24, 3),
    (2048, 1536, 40, 4), (2880, 2880, 32, 4), (3000, 1000, 96, 6), (4096, 2048, 10, 2),
    (4096, 7168, 16, 2), (5120, 1536, 160, 6), (6144, 4096, 8, 2), (7168, 1024, 256, 8),
    (8192, 8192, 8, 1), (8000, 2000, 24, 2), (1280, 640, 72, 8), (2560, 1408, 60, 4),
    (3584, 2560, 64, 8), (1024, 768, 128, 8), (2048, 768, 200, 8), (4000, 3000, 12, 3),
    (1160, 16384, 8, 2), (6000, 12000, 8, 2), (2304, 2304, 48, 2), (5000, 800, 120, 4),
    (1024, 4096, 256, 1), (3072, 6144, 20, 2), (1792, 512, 250, 8), (7000, 5000, 14, 2),
    (4608, 1536, 36, 5), (2112, 9000, 10, 1), (1600, 24576, 8, 2), (3200, 1280, 80, 7),
]
TOKENS = (128, 3000, 8192)
MODES = ("fwd", "fwdbwd")
PRESET_TOKENS = (4096, 16384)
ACHIEVED_TFLOPS = 700.0  # H200 bf16, for --plan's estimate only
WITHIN = 1.05


def grid_config(shape, smoke: bool, cuda: bool) -> MoEConfig:
    hidden, ffn, experts, top_k = shape
    if smoke:  # tiny and fp32 on the CPU: hidden/ffn ÷ 64 (multiples of 8), at most 16 experts
        hidden, ffn = max(16, hidden // 64 // 8 * 8), max(16, ffn // 64 // 8 * 8)
        experts = min(experts, 16)
        top_k = min(top_k, experts)
    return MoEConfig(hidden=hidden, ffn=ffn, num_experts=experts, top_k=top_k,
                     dtype=torch.bfloat16 if cuda else torch.float32)


def candidate_specs(cfg: MoEConfig, tokens: int, world: int, mode: str) -> list[str]:
    """What auto would consider for this key (before its pruning), from the planner's prior."""
    predicted, _ = predicted_candidates(cfg, tokens, world, None, mode)
    return list(predicted)


# ----------------------------------------------------------------------------- timing
class Caller:
    """Calls the layer with one strategy object on fixed inputs, fwd or fwd+bwd."""

    def __init__(self, layer: MoELayer, tokens: int, mode: str, env, seed: int):
        cfg = layer.config
        gen = torch.Generator(device=env.device).manual_seed(seed + 7919 * env.rank + tokens)
        self.x = torch.randn(tokens, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
        self.grad = torch.randn(tokens, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
        self.layer, self.backward = layer, mode == "fwdbwd"

    def __call__(self, strategy) -> torch.Tensor:
        layer = self.layer
        layer.strategy = strategy
        if not self.backward:
            with torch.no_grad():
                return layer(self.x)
        for p in layer.parameters():
            p.grad = None
        x = self.x.detach().requires_grad_()
        out = layer(x)
        out.backward(self.grad)
        return out.detach()


def sync(env) -> None:
    if env.cuda:
        torch.cuda.synchronize()


def time_one(env, fn) -> float:
    barrier(env)
    if env.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def round_robin(env, call, strategies: dict, iters: int) -> dict[str, float]:
    """Median ms per strategy over ``iters`` rounds (call i of each back to back, each round's order
    from :func:`interlace.planning.rounds.round_order`), max over ranks."""
    times = {name: [] for name in strategies}
    for i in range(iters):
        for name in round_order(list(strategies), i):
            times[name].append(time_one(env, lambda: call(strategies[name])))
    return {name: reduce_max(env, statistics.median(ts)) for name, ts in times.items()}


def calibrate(env, call, auto, tokens: int, mode: str, max_calls: int = 64) -> tuple[int, float]:
    """Call a fresh auto until it has decided this key: (calls, wall ms, max over ranks)."""
    sync(env)
    barrier(env)
    t0 = time.perf_counter()
    calls = 0
    while calls < max_calls:
        call(auto)
        calls += 1
        choice = auto.choice_for(tokens, mode)
        if choice is not None:
            break
    sync(env)
    return calls, reduce_max(env, (time.perf_counter() - t0) * 1e3)


def fresh_auto(layer: MoELayer, folder: str, **options):
    layer.set_strategy("auto", decisions_dir=folder, shipped_decisions=False, **options)
    return layer.strategy


# ----------------------------------------------------------------------------- rows
def grid_row(env, args, layer: MoELayer, shape, tokens: int, mode: str, tmp_root: str) -> dict:
    cfg = layer.config
    call = Caller(layer, tokens, mode, env, args.seed)
    specs = candidate_specs(cfg, tokens, env.world, mode)
    strategies = {}
    for spec in specs:
        # Fused buffers as auto sizes them (the token bucket): the same kernels' specializations
        # and work, so the steady-state comparison is like for like and Triton's compiles fall in
        # these warm-up calls, not in auto's calibration.
        layer.set_strategy(spec, **({"max_tokens": token_bucket(tokens)} if spec.startswith("fused") else {}))
        strategies[spec] = layer.strategy
    reference = call(strategies["sequential"]).float()
    errs = {}
    for spec, strategy in strategies.items():
        for _ in range(args.warmup):  # the first call compiles (Triton JIT) and sets up buffers
            out = call(strategy)
        errs[spec] = reduce_max(env, rel_err(out.float(), reference))
    auto = fresh_auto(layer, tempfile.mkdtemp(dir=tmp_root))
    calls, calib_ms = calibrate(env, call, auto, tokens, mode)
    errs["auto"] = reduce_max(env, rel_err(call(auto).float(), reference))
    choice = auto.choice_for(tokens, mode)
    times = round_robin(env, call, {**strategies, "auto": auto}, args.iters)
    best = min(specs, key=lambda s: times[s])
    row = {
        "kind": "grid", "shape": list(shape), "config": f"N{cfg.hidden}-K{cfg.ffn}-E{cfg.num_experts}-k{cfg.top_k}",
        "tokens": tokens, "mode": mode, "times_ms": times, "fastest": best, "fastest_ms": times[best],
        "auto_ms": times["auto"], "ratio": times["auto"] / times[best],
        "auto_choice": None if choice is None else choice.spec,
        "auto_source": None if choice is None else choice.source,
        "auto_times_ms": None if choice is None else choice.times_ms,
        "calibration_calls": calls, "calibration_wall_ms": calib_ms,
        "overhead_ms": max(0.0, calib_ms - calls * times["auto"]),
        "auto_overhead_ms": None if choice is None else choice.overhead_ms,
        "rel_err_vs_sequential": errs, "ok": all(e < args.tolerance for e in errs.values()),
    }
    layer.strategy = strategies["sequential"]
    del strategies, auto, call
    return row


def preset_rows(env, args, name: str, ship_dir: str | None, tmp_root: str) -> list[dict]:
    cfg = bench_config(name, small=False)
    if args.smoke:  # the preset's shape shrunk as the grid's (the Triton interpreter is slow)
        small = grid_config((cfg.hidden, cfg.ffn, cfg.num_experts, cfg.top_k), True, env.cuda)
        cfg = cfg.with_(hidden=small.hidden, ffn=small.ffn, num_experts=small.num_experts, top_k=small.top_k,
                        dtype=small.dtype, n_group=1, topk_group=None)
    layer = MoELayer(cfg, group=env.group, strategy="sequential", seed=args.seed, device=env.device)
    rows = []
    for tokens in args.preset_tokens:
        call = Caller(layer, tokens, "fwd", env, args.seed)
        layer.set_strategy("auto", calibrate=False)
        old = layer.strategy
        for _ in range(args.warmup):
            reference = call(old).float()
        new = fresh_auto(layer, ship_dir or tempfile.mkdtemp(dir=tmp_root))
        calls, calib_ms = calibrate(env, call, new, tokens, "fwd")
        err = reduce_max(env, rel_err(call(new).float(), reference))
        times = round_robin(env, call, {"old": old, "new": new}, args.iters)
        oc, nc = old.choice_for(tokens, "fwd"), new.choice_for(tokens, "fwd")
        rows.append({
            "kind": "preset", "config": name, "tokens": tokens, "mode": "fwd", "old_ms": times["old"],
            "new_ms": times["new"], "ratio": times["new"] / times["old"],
            "old_choice": oc.spec if oc else None, "new_choice": nc.spec if nc else None,
            "new_source": nc.source if nc else None, "calibration_calls": calls, "calibration_wall_ms": calib_ms,
            "overhead_ms": max(0.0, calib_ms - calls * times["new"]), "rel_err_new_vs_old": err,
            "ok": err < args.tolerance,
        })
        del old, new, call
    del layer
    return rows


# ----------------------------------------------------------------------------- report
def summary(rows: list[dict]) -> str:
    grid = [r for r in rows if r["kind"] == "grid"]
    presets = [r for r in rows if r["kind"] == "preset"]
    lines = []
    if grid:
        lines.append("| config | tokens | mode | fastest | ms | auto ran | auto ms | ratio | calls | overhead ms | ok |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in grid:
            lines.append(f"| {r['config']} | {r['tokens']} | {r['mode']} | {r['fastest']} | {r['fastest_ms']:.3f} | "
                         f"{r['auto_choice']} | {r['auto_ms']:.3f} | {r['ratio']:.3f} | {r['calibration_calls']} | "
                         f"{r['overhead_ms']:.1f} | {'ok' if r['ok'] else 'WRONG'} |")
    if presets:
        lines += ["", "| preset | tokens | old ran | old ms | new ran | new ms | new/old | overhead ms | ok |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in presets:
            lines.append(f"| {r['config']} | {r['tokens']} | {r['old_choice']} | {r['old_ms']:.3f} | {r['new_choice']} | "
                         f"{r['new_ms']:.3f} | {r['ratio']:.3f} | {r['overhead_ms']:.1f} | "
                         f"{'ok' if r['ok'] else 'WRONG'} |")
    lines.append("")
    if grid:
        ratios = [r["ratio"] for r in grid]
        over = [r["overhead_ms"] for r in grid]
        within = sum(x <= WITHIN for x in ratios)
        lines.append(f"grid rows: {len(grid)}; auto within 5% of the fastest: {within}/{len(grid)} "
                     f"({within / len(grid):.0%}); worst auto/fastest {max(ratios):.3f}; first-call overhead "
                     f"median {statistics.median(over):.1f} ms, max {max(over):.1f} ms; "
                     f"wrong outputs: {sum(not r['ok'] for r in grid)}")
    if presets:
        ratios = [r["ratio"] for r in presets]
        lines.append(f"preset rows: {len(presets)}; new/old median {statistics.median(ratios):.3f}, worst "
                     f"{max(ratios):.3f}; new slower than old by > 5%: {sum(x > WITHIN for x in ratios)}")
    return "\n".join(lines)


def load_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def job_key(row: dict):
    """What a row answers: a preset's name, or a grid row's (shape, tokens, mode)."""
    return row["config"] if row["kind"] == "preset" else (tuple(row["shape"]), row["tokens"], row["mode"])


def plan(args) -> None:
    """Estimated compute of each part at ACHIEVED_TFLOPS (calls per row as the run makes them)."""
    total = 0.0
    for k in range(args.parts):
        seconds = 0.0
        for shape in GRID[k::args.parts]:
            cfg = grid_config(shape, False, True)
            for mode in MODES:
                calls = 4 * (args.warmup + args.iters) + 14 + args.iters + 2  # ≤ 4 specs, ≤ 13 calibration calls
                for tokens in TOKENS:
                    seconds += calls * cfg.flops_per_token() * tokens * (3 if mode == "fwdbwd" else 1) / (
                        ACHIEVED_TFLOPS * 1e12)
        if k == args.parts - 1:
            for name in PRESETS:
                cfg = bench_config(name, small=False)
                for tokens in PRESET_TOKENS:
                    seconds += (3 * args.warmup + 14 + 2 * args.iters) * cfg.flops_per_token() * tokens / (
                        ACHIEVED_TFLOPS * 1e12)
        print(f"part {k + 1}/{args.parts}: {len(GRID[k::args.parts])} shapes, ~{seconds:.0f} s of GEMM time "
              f"at {ACHIEVED_TFLOPS:.0f} TFLOP/s (plus Triton compiles and host time)")
        total += seconds
    print(f"all parts: ~{total:.0f} s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="auto-grid-out")
    p.add_argument("--part", default="1/1", help="k/n: every n-th shape from the k-th; presets with the last part")
    p.add_argument("--iters", type=int, default=7, help="timed round-robin rounds per row")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per candidate (the first compiles)")
    p.add_argument("--budget-s", type=float, default=440.0, help="no row starts after this many seconds")
    p.add_argument("--limit", type=int, default=None, help="at most this many shapes (of this part)")
    p.add_argument("--tolerance", type=float, default=3e-2, help="max relative error vs sequential (bf16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-presets", action="store_true")
    p.add_argument("--resume", action="store_true", help="keep OUT/rows.jsonl and run only the jobs it lacks")
    p.add_argument("--ship", action="store_true", help="keep the presets' new decisions in OUT/ship/")
    p.add_argument("--smoke", action="store_true", help="tiny fp32 shapes and token counts (CPU, gloo)")
    p.add_argument("--plan", action="store_true", help="print the estimated compute per part and exit")
    args = p.parse_args(argv)
    k, _, n = args.part.partition("/")
    args.part_index, args.parts = int(k) - 1, int(n or 1)
    if not 0 <= args.part_index < args.parts:
        p.error(f"--part {args.part!r}: k must be in 1..n")
    args.tokens = (8, 30, 64) if args.smoke else TOKENS
    args.preset_tokens = (16, 40) if args.smoke else PRESET_TOKENS
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plan:
        return plan(args)
    env = init_env()
    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    tmp_root = tempfile.mkdtemp(prefix=f"auto-grid-r{env.rank}-")
    ship_dir = os.path.join(args.out, "ship") if args.ship else None
    shapes = GRID[args.part_index::args.parts][:args.limit]
    last = args.part_index == args.parts - 1 and not args.no_presets
    jobs = [("grid", s, t, m) for s in shapes for m in MODES for t in args.tokens]
    jobs += [("preset", name, None, None) for name in (PRESETS if last else [])]
    rows_path = os.path.join(args.out, "rows.jsonl")
    done = load_rows(rows_path) if args.resume else []
    if done:  # a run cut short by its budget: go on where it stopped (every rank reads the same file)
        have = {job_key(r) for r in done}
        jobs = [j for j in jobs if (j[1] if j[0] == "preset" else tuple(j[1:])) not in have]
    if env.rank == 0:
        print(f"# auto_grid part {args.part}: {len(shapes)} shapes × {len(args.tokens)} token counts × 2 modes"
              f"{' + ' + str(len(PRESETS)) + ' presets' if last else ''}, world {env.world}, "
              f"{torch.cuda.get_device_name() if env.cuda else 'cpu'}", flush=True)
        if not args.resume:
            open(rows_path, "w").close()
        elif done:
            print(f"# resuming: {len(done)} rows in {rows_path}, {len(jobs)} jobs left", flush=True)
    rows, skipped, layer = list(done), 0, None
    for i, (kind, what, tokens, mode) in enumerate(jobs):
        if reduce_max(env, time.perf_counter() - start) > args.budget_s:  # every rank stops at the same job
            skipped = len(jobs) - i
            break
        t0 = time.perf_counter()
        if kind == "grid":
            if layer is None or layer.shape != what:  # one layer per shape, for its six rows
                layer = None
                release_shared_buffers()
                layer = MoELayer(grid_config(what, args.smoke, env.cuda), group=env.group, strategy="sequential",
                                 seed=args.seed, device=env.device)
                layer.shape = what
            new = [grid_row(env, args, layer, what, tokens, mode, tmp_root)]
        else:
            layer = None
            new = preset_rows(env, args, what, ship_dir, tmp_root)
        release_shared_buffers()
        gc.collect()
        if env.cuda:
            torch.cuda.empty_cache()
        rows += new
        if env.rank == 0:
            with open(rows_path, "a") as f:
                for r in new:
                    f.write(json.dumps(r) + "\n")
            for r in new:
                if r["kind"] == "grid":
                    print(f"[{i + 1}/{len(jobs)} {time.perf_counter() - start:5.0f}s] {r['config']} T={r['tokens']} "
                          f"{r['mode']}: fastest {r['fastest']} {r['fastest_ms']:.3f} ms, auto ran "
                          f"{r['auto_choice']} {r['auto_ms']:.3f} ms (x{r['ratio']:.3f}), calibration "
                          f"{r['calibration_calls']} calls, overhead {r['overhead_ms']:.1f} ms"
                          f"{'' if r['ok'] else ', WRONG OUTPUT'} ({time.perf_counter() - t0:.1f} s)", flush=True)
                else:
                    print(f"[{i + 1}/{len(jobs)} {time.perf_counter() - start:5.0f}s] {r['config']} T={r['tokens']}: "
                          f"old {r['old_choice']} {r['old_ms']:.3f} ms, new {r['new_choice']} {r['new_ms']:.3f} ms "
                          f"(x{r['ratio']:.3f}){'' if r['ok'] else ', WRONG OUTPUT'}", flush=True)
    if env.rank == 0:
        text = summary(rows)
        if skipped:
            text += f"\nbudget of {args.budget_s:.0f} s spent: {skipped} of {len(jobs)} jobs not run"
        if ship_dir and os.path.isdir(ship_dir):
            text += (f"\nshipped decisions: copy {ship_dir}/*.json to interlace/tuning/decisions/ "
                     f"({', '.join(sorted(os.listdir(ship_dir)))})")
        with open(os.path.join(args.out, "summary.md"), "w") as f:
            f.write(text + "\n")
        print(text, flush=True)
    if dist.is_initialized():
        barrier(env)
        release_shared_buffers()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
