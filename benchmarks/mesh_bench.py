"""EP × TP inside the MoE layer on any number of GPUs (COMET Fig. 12's experiment).

    torchrun --nproc-per-node W benchmarks/mesh_bench.py [--config mixtral-8x7b] [--tokens 8192 | --layer-tokens M ...]

For every factorisation EP × TP = W (e.g. 8×1, 4×2, 2×4 on 8 GPUs) it builds the mesh
(``MoEMesh.build``; TP ranks of one group hold the same tokens) and times the forward with each
all-to-all form (``tp_ep:O0``…``O3``; EP-only meshes: ``sequential`` and ``fused``) with the
harness's timing (CUDA events, 5 warm-ups, median of 20, slowest rank). ``--tokens`` fixes the
tokens each rank holds, so the layer's distinct tokens grow with EP (EP × tokens); ``--layer-tokens M``
fixes the layer's distinct tokens instead (COMET Fig. 12: M = 8192 for every factorisation, each EP
group's ranks hold M / EP), which is the comparison of factorisations at equal work. Each strategy's
output is checked against the first one timed on the same mesh (same weights, same tokens):
relative error 2e-2 in bf16, 1e-5 in fp32, or the script exits non-zero after the table (the
forms against the fp64 reference: ``benchmarks/device_tp_ep.py`` on GPUs, the gloo tests on CPU).
Writes ``$OUT/mesh_bench.json`` and prints a table last.

Without CUDA (gloo, as the CI test runs it) it times host wall time on the ``--small`` shape:
a check that the script runs at any world size, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from interlace import MoELayer
from interlace.tools.bench import bench_config, init_env, reduce_max, time_cpu, time_cuda
from interlace.parallel.mesh import MoEMesh

FORMS = ("tp_ep:O0", "tp_ep:O1", "tp_ep:O2", "tp_ep:O3")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="mixtral-8x7b")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank (ignored with --layer-tokens)")
    ap.add_argument("--layer-tokens", type=int, nargs="+", default=None, metavar="M",
                    help="distinct tokens of the whole layer (each rank holds M / EP); one table block per M")
    ap.add_argument("--small", action="store_true", help="the config's hidden and ffn / 16 (CPU runs)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    env = init_env()
    cfg = bench_config(args.config, small=args.small)
    timer = time_cuda if env.cuda else time_cpu
    W = env.world
    tol = 2e-2 if cfg.dtype in (torch.bfloat16, torch.float16) else 1e-5  # vs the mesh's first strategy
    meshes = [(W // tp, tp) for tp in range(1, W + 1) if W % tp == 0
              and cfg.num_experts % (W // tp) == 0 and cfg.ffn % tp == 0]
    if args.layer_tokens:
        for m in args.layer_tokens:
            bad_ep = [ep for ep, _ in meshes if m % ep]
            if bad_ep:
                raise SystemExit(f"--layer-tokens {m} is not divisible by EP={bad_ep[0]}")
        runs = [(ep, tp, m // ep) for m in args.layer_tokens for ep, tp in meshes]
    else:
        runs = [(ep, tp, args.tokens) for ep, tp in meshes]
    rows, bad = [], 0
    for ep, tp, tokens in runs:
        mesh = MoEMesh.build(tp=tp, ep=ep)
        # Tokens are shared inside a TP group: seed by the EP coordinate.
        gen = torch.Generator(device=env.device).manual_seed(1000 + mesh.ep_rank)
        x = torch.randn(tokens, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
        strategies = FORMS if tp > 1 else ("sequential", "fused")
        first = None  # the mesh's first strategy's output: the others must match it
        for strategy in strategies:
            layer = MoELayer(cfg, mesh=mesh, strategy=strategy, seed=7, device=env.device)
            with torch.no_grad():
                out = layer(x).float()
                first = out if first is None else first
                err = reduce_max(env, ((out - first).norm() / first.norm().clamp_min(1e-30)).item())
                times = timer(lambda: layer(x), warmup=args.warmup, iters=args.iters, env=env)
            ms = reduce_max(env, statistics.median(times))
            ok = err < tol
            bad += not ok
            rows.append(dict(config=args.config, tokens=tokens, layer_tokens=ep * tokens, world=W, ep=ep, tp=tp, strategy=strategy, ms=ms,
                             rel_err_vs_first=err, ok=ok))
            if env.rank == 0:
                print(f"M={ep * tokens} EP={ep} TP={tp} {strategy:10s} {ms:8.3f} ms  rel err vs {strategies[0]} {err:.1e}"
                      f"{'' if ok else '  WRONG'}", flush=True)
            del layer
            if env.cuda:
                torch.cuda.empty_cache()
    if env.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "mesh_bench.json"), "w") as f:
            json.dump(rows, f, indent=1)
        print("\n| config | layer tokens M | tokens/rank | GPUs | EP | TP | strategy | median ms "
              "| rel err vs the mesh's first |\n|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['config']} | {r['layer_tokens']} | {r['tokens']} | {r['world']} | {r['ep']} | {r['tp']} | {r['strategy']} "
                  f"| {r['ms']:.3f} | {r['rel_err_vs_first']:.1e}{'' if r['ok'] else ' WRONG'} |")
    dist.barrier()
    if bad:
        raise SystemExit(f"mesh_bench: {bad} strategies disagree with their mesh's first one beyond {tol}")
    return rows


if __name__ == "__main__":
    main()
