"""TP × EP on 2 GPUs: correctness of every tp_ep form, layer times, communication priority.

    torchrun --nproc-per-node 2 benchmarks/device_tp_ep.py [--tokens 4096 16384] [--out DIR]

1. Check: TP=2/EP=1 with forms O0–O3 and TP=1/EP=2 ``sequential``, forward and backward,
   against an fp32 single-process reference (bf16 tolerance 2e-2, relative ‖·‖₂), 256 tokens,
   on each config.
2. Time (``interlace.tools.bench.time_cuda``: CUDA events around the layer call, 5 warm-ups,
   median of 20, a barrier before each call, slowest rank) the forward, and forward+backward
   (``--modes``), of TP=2/EP=1 (O0–O3)
   and TP=1/EP=2 (``sequential``) for mixtral-8x7b, qwen2-moe, flashdmoe-cfg at each token
   count. T is the tokens of each rank's input: with TP=2 both ranks hold the same T tokens
   (T distinct tokens per call), with EP=2 each rank holds its own (2T distinct).
3. Priority: TP=1/EP=2 ``sequential`` (qwen2-moe, the largest T) alone, and with a 512 MiB
   all-reduce on the world communicator started just before each call, once with the MoE
   mesh's communicator on a normal-priority stream and once on a high-priority stream.

Writes ``$OUT/tp_ep.json`` (or ``--out``) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from interlace import MoELayer, preset, reference_moe
from interlace.tools.bench import barrier, init_env, reduce_max, time_cuda
from interlace.experts import init_expert_weights, shard_ffn
from interlace.parallel.mesh import MoEMesh
from interlace.routing import Router
from interlace.parallel import release_shared_buffers
from interlace.planning.profile import PACKAGED_DIR, load_profile
from interlace.tools.profile import profile_tp

CONFIGS = ("mixtral-8x7b", "qwen2-moe", "flashdmoe-cfg")
FORMS = ("tp_ep:O0", "tp_ep:O1", "tp_ep:O2", "tp_ep:O3")
TIMED_FORMS = FORMS + ("tp_ep:O2-4", "tp_ep:O3-4")  # O2/O3 with 2 (default) and 4 chunks
TOL = 2e-2


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(env, cfg, meshes, seed=3, tokens=256):
    """Errors (out, dx, router, w_up, w_down) of every (mesh, strategy) vs fp32; max over ranks."""
    dev = env.device
    rw = Router(cfg, seed, dev).weight.detach().float().requires_grad_()
    wu, wd = (w.float().requires_grad_() for w in init_expert_weights(cfg, range(cfg.num_experts), seed, dev))
    gen = torch.Generator(device=dev).manual_seed(11)
    xs = [torch.randn(tokens, cfg.hidden, device=dev, generator=gen).to(cfg.dtype) for _ in range(2)]
    gs = [torch.randn(tokens, cfg.hidden, device=dev, generator=gen).to(cfg.dtype) for _ in range(2)]
    refs = {}
    for batches in (1, 2):  # TP=2/EP=1: one batch on both ranks; TP=1/EP=2: a batch per rank
        for p in (rw, wu, wd):
            p.grad = None
        outs, dxs = [], []
        for b in range(batches):
            xr = xs[b].float().requires_grad_()
            out, _ = reference_moe(xr, rw, wu, wd, cfg, compute_dtype=torch.float32)
            (out * gs[b].float()).sum().backward()
            outs.append(out.detach())
            dxs.append(xr.grad)
        refs[batches] = (outs, dxs, rw.grad.clone(), wu.grad.clone(), wd.grad.clone())
    results = []
    for mesh, strategies in meshes:
        outs, dxs, drw, dwu, dwd = refs[mesh.ep]
        b = mesh.ep_rank
        layer = MoELayer(cfg, mesh=mesh, strategy=strategies[0], seed=seed, device=dev)
        first, n = layer.ep.first_expert, layer.ep.num_local
        ref_wu, ref_wd = shard_ffn(dwu[first:first + n], dwd[first:first + n], cfg, *mesh.shard_ffn(cfg.ffn))
        for strategy in strategies:
            layer.set_strategy(strategy)
            layer.zero_grad(set_to_none=True)
            x = xs[b].clone().requires_grad_()
            out = layer(x)
            out.backward(gs[b])
            router = layer.router.weight.grad.clone()
            if mesh.ep > 1:
                dist.all_reduce(router, group=mesh.ep_group)
            errs = [rel(out, outs[b]), rel(x.grad, dxs[b]), rel(router, drw), rel(layer.experts.w_up.grad, ref_wu),
                    rel(layer.experts.w_down.grad, ref_wd)]
            errs = [reduce_max(env, e) for e in errs]
            results.append({"mesh": f"tp{mesh.tp}xep{mesh.ep}", "strategy": strategy, "errors": errs,
                            "ok": all(e < TOL for e in errs)})
        del layer
    return results


def time_layer(env, layer, x, warmup=5, iters=20, mode="fwd"):
    """Slowest rank's median ms of a forward (``fwd``) or forward+backward (``fwdbwd``) call."""
    if mode == "fwd":
        with torch.no_grad():
            times = time_cuda(lambda: layer(x), warmup=warmup, iters=iters, env=env)
    else:
        xi = x.detach().requires_grad_()
        grad = torch.randn_like(x)
        times = time_cuda(lambda: layer(xi).backward(grad), warmup=warmup, iters=iters, env=env)
    return reduce_max(env, statistics.median(times))


def time_with_allreduce(env, layer, x, buf, warmup=5, iters=20):
    """Layer call with a large all-reduce on the world communicator started just before it."""
    with torch.no_grad():
        for _ in range(warmup):
            work = dist.all_reduce(buf, async_op=True)
            layer(x)
            work.wait()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            barrier(env)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work = dist.all_reduce(buf, async_op=True)
            layer(x)
            end.record()
            work.wait()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return reduce_max(env, statistics.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--profile-tp", action="store_true",
                    help="first measure the configs' TP=2 shard classes (interlace.tools.profile.profile_tp) into a copy "
                         "of --profile, save it as OUT/profile_tp.json, and compare the planner with it last")
    ap.add_argument("--profile", default=None, help="base profile (default: the shipped 2xH200 one)")
    ap.add_argument("--profile-tokens", type=int, nargs="+", default=[1000, 3000, 12000, 40000],
                    help="calibration token counts of --profile-tp (deliberately not --tokens)")
    ap.add_argument("--skip-priority", action="store_true")
    args = ap.parse_args()
    env = init_env()
    if env.world != 2 or not env.cuda:
        sys.exit("run with torchrun --nproc-per-node 2 on 2 GPUs")
    t0 = time.time()
    tp2 = MoEMesh.build(tp=2, ep=1)
    ep2 = MoEMesh.build(tp=1, ep=2)
    ep2_low = MoEMesh.build(tp=1, ep=2, high_priority=False)
    meshes = [(tp2, FORMS), (ep2, ("sequential",))]
    timed = [(tp2, TIMED_FORMS), (ep2, ("sequential",))]
    report = {"device": torch.cuda.get_device_name(), "world": env.world, "torch": torch.__version__,
              "commit": os.environ.get("INTERLACE_COMMIT", "?"),
              "high_priority": [tp2.high_priority, ep2.high_priority],
              "checks": [], "times": [], "priority": []}

    def log(msg):
        if env.rank == 0:
            print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    def save():  # after every section, so a run cut short still leaves its measurements
        if env.rank == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "tp_ep.json"), "w") as f:
                json.dump(report, f, indent=1)

    profile_path = None
    if args.profile_tp:
        prof = load_profile(2, path=args.profile or PACKAGED_DIR / "NVIDIA_H200-sm132-w2-n1-p2p.json")
        profile_tp(prof, [preset(n) for n in args.configs], args.profile_tokens, tp=2, show=env.rank == 0)
        profile_path = os.path.join(args.out, "profile_tp.json")
        if env.rank == 0:
            os.makedirs(args.out, exist_ok=True)
            prof.save(profile_path)
        log(f"TP shard classes profiled: {sorted(prof.tp_shapes)} -> {profile_path}")
        torch.cuda.empty_cache()

    # Communication priority: the MoE all-to-all against a concurrent DP-style all-reduce.
    cfg, T = preset("qwen2-moe"), max(args.tokens)
    buf = torch.randn(256 << 20, device=env.device).to(torch.bfloat16)  # 512 MiB
    x = torch.randn(T, cfg.hidden, device=env.device).to(cfg.dtype)
    ar_ms = float("nan")
    if not args.skip_priority:
        with torch.no_grad():
            ar_ms = reduce_max(env, statistics.median(time_cuda(lambda: dist.all_reduce(buf), 3, 10, env)))
    report["allreduce_ms"] = ar_ms
    for label, mesh in () if args.skip_priority else (("normal", ep2_low), ("high", ep2)):
        layer = MoELayer(cfg, mesh=mesh, strategy="sequential", seed=0, device=env.device)
        alone = time_layer(env, layer, x)
        busy = time_with_allreduce(env, layer, x, buf)
        report["priority"].append({"config": "qwen2-moe", "tokens": T, "stream_priority": label,
                                   "high_priority_effective": mesh.high_priority, "alone_ms": alone,
                                   "with_allreduce_ms": busy})
        log(f"priority {label}: alone {alone:.3f} ms, with 512 MiB all-reduce {busy:.3f} ms "
            f"(all-reduce alone {ar_ms:.3f})")
        del layer
    buf = None  # free 512 MiB
    torch.cuda.empty_cache()
    save()

    def time_rows(name, mesh, strategies):
        cfg = preset(name)
        layer = MoELayer(cfg, mesh=mesh, strategy=strategies[0], seed=0, device=env.device)
        for T in args.tokens:
            gen = torch.Generator(device=env.device).manual_seed(100 + mesh.ep_rank)  # TP ranks: same tokens
            x = torch.randn(T, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
            for mode in args.modes:
                for strategy in strategies:
                    layer.set_strategy(strategy)
                    ms = time_layer(env, layer, x, mode=mode)
                    distinct = T * mesh.ep
                    flops = 2 * distinct * cfg.top_k * cfg.hidden * 3 * cfg.ffn * (3 if mode == "fwdbwd" else 1)
                    row = {"config": name, "tokens": T, "mesh": f"tp{mesh.tp}xep{mesh.ep}", "strategy": strategy,
                           "mode": mode, "median_ms": ms, "distinct_tokens": distinct,
                           "tflops": flops / (ms * 1e-3) / 1e12}
                    report["times"].append(row)
                    log(f"time {name} T={T} {row['mesh']} {strategy} {mode}: {ms:.3f} ms")
        del layer
        torch.cuda.empty_cache()
        save()

    # TP=1/EP=2 sequential first (the known path), then per config: check, TP=2 forms. A Python
    # error in one config's tp_ep section is logged and the next config still runs.
    for name in args.configs:
        time_rows(name, *timed[1])
    for name in args.configs:
        try:
            if not args.skip_check:
                for row in check(env, preset(name), meshes):
                    row["config"] = name
                    report["checks"].append(row)
                    log(f"check {name} {row['mesh']} {row['strategy']}: {'PASS' if row['ok'] else 'FAIL'} "
                        + " ".join(f"{e:.1e}" for e in row["errors"]))
                torch.cuda.empty_cache()
            time_rows(name, *timed[0])
        except Exception as err:  # noqa: BLE001  (record and go on)
            import traceback

            traceback.print_exc()
            report.setdefault("errors", []).append(f"{name}: {type(err).__name__}: {err}")
            save()

    report["elapsed_s"] = time.time() - t0
    save()
    if env.rank == 0:
        print("\n| config | tokens | mesh | strategy | mode | median ms | distinct tokens | TFLOP/s |")
        print("|---|---|---|---|---|---|---|---|")
        for r in report["times"]:
            print(f"| {r['config']} | {r['tokens']} | {r['mesh']} | {r['strategy']} | {r['mode']} | "
                  f"{r['median_ms']:.3f} | {r['distinct_tokens']} | {r['tflops']:.0f} |")
        print(f"\nall-reduce 512 MiB alone: {ar_ms:.3f} ms")
        for p in report["priority"]:
            print(f"priority {p['stream_priority']:6s} (effective {p['high_priority_effective']}): layer alone "
                  f"{p['alone_ms']:.3f} ms, beside the all-reduce {p['with_allreduce_ms']:.3f} ms")
        bad = [c for c in report["checks"] if not c["ok"]]
        print(f"checks: {len(report['checks']) - len(bad)} passed, {len(bad)} failed")
        if profile_path:  # the planner's predictions from the fresh TP profile vs these measurements
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from compare_tp_ep import main as compare

            print("\nplanner (profile with the TP shard classes measured above) vs these measurements:")
            compare([os.path.join(args.out, "tp_ep.json"), "--profile", profile_path])
    barrier(env)
    release_shared_buffers()  # before the group goes: see its docstring
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
