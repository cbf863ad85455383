"""Soak of the public ``MoELayer`` API with ``auto`` among the strategies (issue 32's GPU test).

    torchrun --nproc-per-node 2 benchmarks/soak.py --out soak-out                 # 2×H200, ≤ 240 s
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 benchmarks/soak.py --smoke --out /tmp/soak   # CPU, gloo

Five layers over two small shapes: two ``auto`` layers (one per shape; their decisions go to a
temporary cache), ``sequential``, ``pipelined:2`` and ``fused``. Each call (the same on every
rank, drawn from a shared seed) picks a layer (half the calls an ``auto`` one), a routing
(``random``: the router's own; ``skewed``: Zipf-popular experts; ``one-expert``: every token on
the same k experts) and whether it trains (~15%: forward + backward). Each rank draws its own
token count, 0–2048 (``--max-tokens``), zero on ~10% of ranks' calls and on every rank at once on
~2% of calls. Every ``--check-every``-th call is compared with a ``naive`` layer of the same
weights on the same inputs and routing: the output (and the input gradient of a training call)
within ``--tolerance`` relative error (fp64 norms, max over ranks; bf16 default 2e-2). Memory:
allocated bytes after the warm-up (``--warmup-calls``) against the end, growth over
``--max-growth-mib`` fails. Every wait is bounded: the process group's timeout and ``auto``'s
``agree_timeout_s``. Stops at ``--calls`` or after ``--budget-s`` (ranks agree). Writes
``OUT/soak.json`` every ``--report-every`` calls and at the end; prints calls/s, the worst error
and the failures last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from interlace import MoEConfig, MoELayer
from interlace.parallel import release_shared_buffers
from interlace.tools.bench import make_routing, rel_err

ROUTINGS = ("random", "skewed", "one-expert")


def configs(smoke: bool, cuda: bool) -> dict[str, MoEConfig]:
    dtype = torch.bfloat16 if cuda else torch.float32
    if smoke:
        return {"A": MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=dtype),
                "B": MoEConfig(hidden=24, ffn=16, num_experts=6, top_k=3, dtype=dtype)}
    return {"A": MoEConfig(hidden=1024, ffn=1536, num_experts=8, top_k=2, dtype=dtype),
            "B": MoEConfig(hidden=1000, ffn=704, num_experts=12, top_k=3, dtype=dtype)}


class Env:
    def __init__(self, timeout_s: float):
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": torch.device("cuda", torch.cuda.current_device())} if cuda else {}))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.cuda = cuda

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())


def routing_indices(cfg: MoEConfig, routing: str, tokens: int, env: Env, seed: int) -> torch.Tensor | None:
    if routing == "random":
        return None
    if routing == "one-expert":  # every token on the same k experts (one of them owns all the load)
        first = seed % cfg.num_experts
        row = (first + torch.arange(cfg.top_k, device=env.device)) % cfg.num_experts
        return row.expand(tokens, cfg.top_k).contiguous()
    return make_routing(cfg, "skewed", tokens, env, seed)


def run_call(layer: MoELayer, x: torch.Tensor, idx, grad: torch.Tensor | None):
    """(output, input gradient or None) of one call."""
    if grad is None:
        with torch.no_grad():
            return layer(x, expert_indices=idx), None
    for p in layer.parameters():
        p.grad = None
    xi = x.detach().requires_grad_()
    out = layer(xi, expert_indices=idx)
    out.backward(grad)
    return out.detach(), xi.grad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="soak-out")
    p.add_argument("--calls", type=int, default=10000, help="calls per rank")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--train-share", type=float, default=0.15)
    p.add_argument("--check-every", type=int, default=10)
    p.add_argument("--tolerance", type=float, default=None, help="max relative error vs naive (bf16: 2e-2)")
    p.add_argument("--warmup-calls", type=int, default=None, help="calls before the memory baseline (10%%)")
    p.add_argument("--max-growth-mib", type=float, default=64.0)
    p.add_argument("--budget-s", type=float, default=220.0)
    p.add_argument("--timeout-s", type=float, default=120.0, help="bound on every collective's and agreement's wait")
    p.add_argument("--report-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny fp32 shapes, 0–40 tokens, 150 calls (CPU, gloo)")
    args = p.parse_args(argv)
    if args.smoke:
        args.calls, args.max_tokens, args.report_every = min(args.calls, 150), 40, 50
    env = Env(args.timeout_s)
    tolerance = args.tolerance or (2e-2 if env.cuda else 1e-4)
    warmup = args.warmup_calls if args.warmup_calls is not None else args.calls // 10
    cfgs = configs(args.smoke, env.cuda)
    cache = tempfile.mkdtemp(prefix=f"soak-decisions-r{env.rank}-")
    auto_opts = {"decisions_dir": cache, "shipped_decisions": False, "agree_timeout_s": args.timeout_s}
    layers = {
        "auto-A": MoELayer(cfgs["A"], strategy="auto", seed=1, device=env.device, strategy_options=auto_opts),
        "auto-B": MoELayer(cfgs["B"], strategy="auto", seed=2, device=env.device, strategy_options=auto_opts),
        "sequential-A": MoELayer(cfgs["A"], strategy="sequential", seed=1, device=env.device),
        "pipelined:2-B": MoELayer(cfgs["B"], strategy="pipelined:2", seed=2, device=env.device),
        "fused-A": MoELayer(cfgs["A"], strategy="fused", seed=1, device=env.device,
                            strategy_options={"max_tokens": args.max_tokens}),
    }
    naive = {"A": MoELayer(cfgs["A"], strategy="naive", seed=1, device=env.device),
             "B": MoELayer(cfgs["B"], strategy="naive", seed=2, device=env.device)}
    names = list(layers)
    weights = [0.25, 0.25, 1 / 6, 1 / 6, 1 / 6]
    shared = random.Random(args.seed)  # the same draws on every rank
    mine = random.Random(args.seed * 1000 + 17 + env.rank)  # this rank's token counts
    gen = torch.Generator(device=env.device).manual_seed(args.seed + 31 * env.rank)
    os.makedirs(args.out, exist_ok=True)
    stats = {"calls": 0, "checked": 0, "train_calls": 0, "zero_calls": 0, "worst_err": 0.0, "failures": [],
             "per_layer": {n: 0 for n in names}, "per_routing": {r: 0 for r in ROUTINGS}}
    base_mib = end_mib = None
    start = time.perf_counter()
    if env.rank == 0:
        print(f"# soak: {args.calls} calls per rank, world {env.world}, {env.device}, tolerance {tolerance:g}, "
              f"layers {names}", flush=True)

    def report(final: bool = False):
        if env.rank != 0:
            return
        elapsed = time.perf_counter() - start
        stats.update(elapsed_s=elapsed, calls_per_s=stats["calls"] / max(elapsed, 1e-9), base_mib=base_mib,
                     end_mib=end_mib, tolerance=tolerance, final=final,
                     choices={n: {f"{k[0]}/{k[1]}": c.spec for k, c in layers[n].strategy.choices.items()}
                              for n in names if n.startswith("auto")})
        with open(os.path.join(args.out, "soak.json"), "w") as f:
            json.dump(stats, f, indent=1)

    try:
        for i in range(args.calls):
            if i % 100 == 0 and env.max(time.perf_counter() - start) > args.budget_s:
                break
            name = shared.choices(names, weights)[0]
            layer = layers[name]
            cfg = layer.config
            routing = shared.choice(ROUTINGS)
            train = shared.random() < args.train_share
            all_zero = shared.random() < 0.02
            tokens = 0 if all_zero or mine.random() < 0.10 else mine.randint(1, args.max_tokens)
            x = torch.randn(tokens, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
            grad = torch.randn(tokens, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype) if train else None
            idx = routing_indices(cfg, routing, tokens, env, args.seed + i)
            out, dx = run_call(layer, x, idx, grad)
            stats["calls"] += 1
            stats["train_calls"] += train
            stats["zero_calls"] += tokens == 0
            stats["per_layer"][name] += 1
            stats["per_routing"][routing] += 1
            if i % args.check_every == 0:
                ref, ref_dx = run_call(naive[name[-1]], x, idx, grad)
                err = rel_err(out, ref) if tokens else 0.0
                if train and tokens:
                    err = max(err, rel_err(dx, ref_dx))
                err = env.max(err)
                stats["checked"] += 1
                stats["worst_err"] = max(stats["worst_err"], err)
                if not err <= tolerance:
                    stats["failures"].append({"call": i, "layer": name, "routing": routing, "train": train,
                                              "tokens": tokens, "rel_err": err})
                    if env.rank == 0:
                        print(f"  WRONG call {i}: {name} {routing} train={train} T={tokens} rel err {err:.2e}",
                              flush=True)
            del x, grad, out, dx
            if i + 1 == warmup and env.cuda:
                torch.cuda.synchronize()
                base_mib = env.max(torch.cuda.memory_allocated() / 2**20)
            if (i + 1) % args.report_every == 0:
                report()
                if env.rank == 0:
                    elapsed = time.perf_counter() - start
                    print(f"  {i + 1} calls, {elapsed:.0f} s, {stats['calls'] / elapsed:.0f} calls/s, worst err "
                          f"{stats['worst_err']:.2e}, failures {len(stats['failures'])}", flush=True)
    except Exception as err:  # a hang is bounded by the timeouts; any error ends the soak as a failure
        stats["failures"].append({"call": stats["calls"], "error": f"{type(err).__name__}: {err}"})
        print(f"rank {env.rank}: FAILED at call {stats['calls']}: {type(err).__name__}: {err}", flush=True)
        report(final=True)
        raise
    if env.cuda:
        torch.cuda.synchronize()
        end_mib = env.max(torch.cuda.memory_allocated() / 2**20)
        if base_mib is not None and end_mib - base_mib > args.max_growth_mib:
            stats["failures"].append({"memory_growth_mib": end_mib - base_mib})
    report(final=True)
    if env.rank == 0:
        s = stats
        print(f"\n| calls/rank | train | zero-token | checked | calls/s | worst rel err (tol {tolerance:g}) | "
              f"allocated MiB after warm-up → end | failures |")
        print("|---|---|---|---|---|---|---|---|")
        mem = "-" if base_mib is None else f"{base_mib:.0f} → {end_mib:.0f}"
        print(f"| {s['calls']} | {s['train_calls']} | {s['zero_calls']} | {s['checked']} | {s['calls_per_s']:.0f} | "
              f"{s['worst_err']:.2e} | {mem} | {len(s['failures'])} |")
        print(f"per layer {s['per_layer']}; per routing {s['per_routing']}")
        print(f"auto's choices: {s['choices']}")
        if s["calls"] < args.calls:
            print(f"stopped by --budget-s {args.budget_s:.0f} after {s['calls']} of {args.calls} calls")
    failed = bool(stats["failures"])
    dist.barrier()
    del layers, naive
    release_shared_buffers()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
