"""GPU correctness check: every strategy against an fp32 reference, bf16 tolerances.

    torchrun --nproc-per-node W tests/gpu/gpu_check.py        (any W; configs whose experts do not
                                                             divide over W are skipped, said so)

Runs the routing cases of the CPU tests (random, balanced, all tokens to one expert, a rank
that receives nothing, an empty rank, an empty batch) on several configs, forward and
backward, checks outputs and every gradient, that two runs are bitwise identical
(deterministic combine), and that a NaN token stays in its own row; the inference-only
``persistent`` strategy forward, on the cases its router can make (:func:`check_persistent`). Exits non-zero on any
failure; prints one line per check and a summary last. ``GPU_CHECK_CONFIGS``,
``GPU_CHECK_CASES`` and ``GPU_CHECK_STRATEGIES`` (space-separated names) narrow it to a subset,
e.g. to repeat one failing check under ``CUDA_LAUNCH_BLOCKING=1``.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cases import CASES, case_indices, case_tokens  # noqa: E402

from interlace import MoEConfig, MoELayer, reference_moe  # noqa: E402
from interlace.experts import init_expert_weights  # noqa: E402
from interlace.routing import Router  # noqa: E402
from interlace.parallel import release_shared_buffers  # noqa: E402

TOL = 2e-2  # bf16 layer vs fp32 reference, relative ‖·‖₂
CONFIGS = {
    "swiglu-16e": MoEConfig(hidden=1024, ffn=768, num_experts=16, top_k=4),
    "capacity": MoEConfig(hidden=512, ffn=256, num_experts=8, top_k=2, capacity_factor=0.7),
    "sigmoid-64e": MoEConfig(hidden=2048, ffn=256, num_experts=64, top_k=8, router="sigmoid", renormalize=True,
                             route_scale=2.5),
    "gelu": MoEConfig(hidden=256, ffn=512, num_experts=4, top_k=1, activation="gelu"),
    # hidden ≥ 4096: fused's layer0 gathers its local rows first and joins gate and up (gather0 / joint0 auto)
    "swiglu-h4096": MoEConfig(hidden=4096, ffn=384, num_experts=8, top_k=2),
}


ALL_STRATEGIES = ("naive", "sequential", "sequential:triton", "pipelined:3", "fused", "fused:train", "fused:lean")  # (+ persistent)


def _only(name: str, default):
    """The names in env ``name`` (space-separated) that are in ``default``, or all of it."""
    chosen = os.environ.get(name, "").split()
    unknown = [c for c in chosen if c not in default]
    if unknown:
        raise SystemExit(f"{name}: unknown {unknown}; choose from {list(default)}")
    return [d for d in default if not chosen or d in chosen]


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def zero_if_none(grad, like):
    return torch.zeros_like(like) if grad is None else grad


def check_shared_overlap(dev, rank, world, strategies, report):
    cfg = MoEConfig(hidden=1024, ffn=512, num_experts=16, top_k=4, shared_ffn=1408, shared_gate=True)
    seed = 4
    gen = torch.Generator(device=dev).manual_seed(12)
    xs = [torch.randn(512, cfg.hidden, device=dev, generator=gen).to(cfg.dtype) for _ in range(world)]
    gs = [torch.randn(512, cfg.hidden, device=dev, generator=gen).to(cfg.dtype) for _ in range(world)]
    layers = {overlap: MoELayer(cfg.with_(shared_overlap=overlap), strategy="sequential", seed=seed, device=dev)
              for overlap in (True, False)}
    plain = layers[False]
    params = [p.detach().float().clone().requires_grad_() for p in
              (plain.router.weight, plain.shared.w_up, plain.shared.w_down, plain.shared.gate)]
    wu, wd = (w.float().requires_grad_() for w in init_expert_weights(cfg, range(cfg.num_experts), seed, dev))
    ref_out, ref_dx = [], []
    for r in range(world):
        xr = xs[r].detach().float().requires_grad_()
        out, _ = reference_moe(xr, params[0], wu, wd, cfg, compute_dtype=torch.float32, shared=tuple(params[1:]))
        (out * gs[r].float()).sum().backward()
        ref_out.append(out.detach())
        ref_dx.append(xr.grad)
    names = ["router.weight", "shared.w_up", "shared.w_down", "shared.gate"]
    for strategy in [s for s in strategies if s in ("sequential", "pipelined:3", "fused", "fused:train")]:
        outs = {}
        for overlap, layer in layers.items():
            layer.set_strategy(strategy)
            layer.zero_grad(set_to_none=True)
            x = xs[rank].clone().requires_grad_()
            out = layer(x)
            out.backward(gs[rank])
            grads = dict(layer.named_parameters())
            errs = [rel(out, ref_out[rank]), rel(x.grad, ref_dx[rank])]
            for name, ref in zip(names, params):
                grad = grads[name].grad.clone()
                dist.all_reduce(grad)
                errs.append(rel(grad, ref.grad))
            lo, hi = layer.ep.first_expert, layer.ep.first_expert + layer.ep.num_local
            errs += [rel(layer.experts.w_up.grad, wu.grad[lo:hi]), rel(layer.experts.w_down.grad, wd.grad[lo:hi])]
            outs[overlap] = out
            report(all(e < TOL for e in errs), f"shared-expert overlap={overlap!s:5} {strategy:11s} rank {rank} "
                   f"rel err out {errs[0]:.1e} dx {errs[1]:.1e} grads " + " ".join(f"{e:.1e}" for e in errs[2:]))
        torch.cuda.synchronize()
        report(torch.equal(outs[True], outs[False]), f"shared-expert overlap {strategy:11s} rank {rank}: "
               f"output bitwise equal to the non-overlapped one")


# persistent routes itself (forced choices would run sequential's path): its cases are those the
# router makes; "one_expert" and "zero_recv_rank" are made by steering the router (steer_router).
PERSISTENT_CASES = ("random", "one_expert", "zero_recv_rank", "uneven_and_empty_rank", "empty_batch")


def steer_router(layer, case, world, xs, dev):
    """Make the router choose as ``case`` forces: every token gets a large component along a
    shared unit direction u; "one_expert": the rows of experts 0..k−1 point along u (all traffic
    to them, the first rank's); "zero_recv_rank": the last rank's experts' rows point against u
    (it receives nothing). The same u on every rank. Returns the steered tokens."""
    cfg = layer.config
    u = torch.randn(cfg.hidden, device=dev, generator=torch.Generator(device=dev).manual_seed(7))
    u /= u.norm()
    w = layer.router.weight.data
    if case == "one_expert":
        for j in range(cfg.top_k):
            w[j] = u * (1.0 - 0.1 * j)
    else:
        w[cfg.num_experts - cfg.num_experts // world:] = -u
    return [(x.float() + 4.0 * cfg.hidden**0.5 * u).to(cfg.dtype) for x in xs]


def check_persistent(dev, rank, world, configs, cases, report, base=256, seed=3):
    """The persistent strategy (inference; one launch per call and rank) on the routing cases of
    :data:`PERSISTENT_CASES` against the fp32 reference (the layer's own routing, steered where
    the case forces choices), three calls per case bitwise identical (eager, CUDA-graph capture,
    replay on a GPU), then a NaN token that must stay in its own row. Configs the kernel does not
    take (``unsupported``) are skipped, said so. Every rank makes every call (zero tokens too)."""
    from interlace.routing import route
    from interlace.strategies.persistent import unsupported

    for name, cfg in configs.items():
        why = unsupported(cfg, world)
        if why:
            if rank == 0:
                print(f"SKIP {name} persistent: {why}", flush=True)
            continue
        wu, wd = (w.float() for w in init_expert_weights(cfg, range(cfg.num_experts), seed, dev))
        for case in [c for c in cases if c in PERSISTENT_CASES]:
            tokens = case_tokens(case, world, base=base)
            gen = torch.Generator(device=dev).manual_seed(11)
            xs = [torch.randn(T, cfg.hidden, device=dev, generator=gen).to(cfg.dtype) for T in tokens]
            layer = MoELayer(cfg, strategy="persistent", seed=seed, device=dev,
                             strategy_options={"max_tokens": max(1, max(tokens))})
            if case in ("one_expert", "zero_recv_rank"):
                xs = steer_router(layer, case, world, xs, dev)
            rw, bias = layer.router.weight.detach().float(), layer.router.expert_bias
            x = xs[rank]
            with torch.inference_mode():
                outs = [layer(x).clone() for _ in range(3)]
            if hasattr(layer.strategy, "synchronize_and_check"):
                layer.strategy.synchronize_and_check()
            ref, _ = reference_moe(x.float(), rw, wu, wd, cfg, expert_bias=bias, compute_dtype=torch.float32)
            routed = route(x.float(), rw, bias, cfg)[0] if tokens[rank] else torch.empty(0, cfg.top_k, device=dev)
            first_last = cfg.num_experts - cfg.num_experts // world
            steered = {"one_expert": bool((routed < cfg.top_k).all()),
                       "zero_recv_rank": not bool((routed >= first_last).any())}.get(case, True)
            err = rel(outs[0], ref) if tokens[rank] else 0.0
            where = f"{name:12s} {case:22s} persistent rank {rank}"
            report(err < TOL and steered and outs[0].shape == x.shape,
                   f"{where} rel err out {err:.1e}" + ("" if steered else ", the router did not steer as the case asks"))
            report(all(torch.equal(outs[0], o) for o in outs[1:]), f"{where} bitwise identical across 3 calls")
            del layer
    cfg = next((c for n, c in configs.items() if not unsupported(c, world)), None)
    if cfg is None:
        return
    layer = MoELayer(cfg, strategy="persistent", seed=0, device=dev, strategy_options={"max_tokens": base})
    x = torch.randn(base, cfg.hidden, device=dev, generator=torch.Generator(device=dev).manual_seed(5 + rank))
    x = x.to(cfg.dtype)
    row = base // 2
    bad = x.clone()
    bad[row, 3] = float("nan")
    with torch.inference_mode():
        clean, out = layer(x).clone(), layer(bad).clone()
    others = torch.ones(base, dtype=torch.bool, device=dev)
    others[row] = False
    err = rel(out[others], clean[others])
    report(bool(torch.isnan(out[row]).all()) and err < TOL and torch.equal(out[others], clean[others]),
           f"nan-row persistent rank {rank}: NaN only in its own row; other rows bitwise equal (rel change {err:.1e})")


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    failures, checks = [], 0

    def report(ok, what):
        nonlocal checks
        checks += 1
        if not ok:
            failures.append(what)
        if rank == 0 or not ok:
            print(("PASS " if ok else "FAIL ") + what, flush=True)

    configs = _only("GPU_CHECK_CONFIGS", CONFIGS)
    cases = _only("GPU_CHECK_CASES", CASES)
    strategies = [s for s in _only("GPU_CHECK_STRATEGIES", ALL_STRATEGIES + ("persistent",)) if s != "persistent"]
    for name in configs:
        cfg = CONFIGS[name]
        if cfg.num_experts % world:
            if rank == 0:
                print(f"SKIP {name}: {cfg.num_experts} experts do not divide over {world} ranks", flush=True)
            continue
        seed = 3
        rw = Router(cfg, seed, dev).weight.detach().float()
        wu, wd = (w.float() for w in init_expert_weights(cfg, range(cfg.num_experts), seed, dev))
        for case in cases:
            tokens = case_tokens(case, world, base=256)
            indices = case_indices(case, cfg, world, tokens, seed=1)
            indices = None if indices is None else [i.to(dev) for i in indices]
            gen = torch.Generator(device=dev).manual_seed(11)
            xs = [torch.randn(T, cfg.hidden, device=dev, generator=gen).to(cfg.dtype) for T in tokens]
            gs = [torch.randn(T, cfg.hidden, device=dev, generator=gen).to(cfg.dtype) for T in tokens]
            # fp32 reference (every rank computes it for all ranks' tokens).
            rwr, wur, wdr = (t.clone().requires_grad_() for t in (rw, wu, wd))
            ref_out, ref_dx = [], []
            for r in range(world):
                xr = xs[r].float().requires_grad_()
                out, _ = reference_moe(xr, rwr, wur, wdr, cfg, compute_dtype=torch.float32,
                                       expert_indices=None if indices is None else indices[r])
                loss = (out * gs[r].float()).sum()
                if loss.requires_grad:  # a rank with no tokens contributes no gradient
                    loss.backward()
                ref_out.append(out.detach())
                ref_dx.append(xr.grad if xr.grad is not None else torch.zeros_like(xr))
            # sequential:triton: interlace's expert kernels (forward and backward) in sequential;
            # fused: its kernels forward, sequential's backward (the default train path);
            # fused:train: the fused kernels both ways.
            for strategy in strategies:
                layer = MoELayer(cfg, strategy=strategy, seed=seed, device=dev)
                lo, hi = layer.ep.first_expert, layer.ep.first_expert + layer.ep.num_local
                runs = []
                # fused:train: the first call eager, the second captures its CUDA graphs, the third replays them
                for _ in range(3 if strategy == "fused:train" else 2):
                    layer.zero_grad(set_to_none=True)
                    x = xs[rank].clone().requires_grad_()
                    out = layer(x, expert_indices=None if indices is None else indices[rank])
                    out.backward(gs[rank])
                    drouter = layer.router.weight.grad.clone()
                    dist.all_reduce(drouter)
                    runs.append([out, x.grad, drouter, layer.experts.w_up.grad.clone(),
                                 layer.experts.w_down.grad.clone()])
                torch.cuda.synchronize()
                out, dx, drouter, dwu, dwd = runs[0]
                where = f"{name:12s} {case:22s} {strategy:10s} rank {rank}"
                errs = [rel(out, ref_out[rank]), rel(dx, ref_dx[rank]) if tokens[rank] else 0.0,
                        rel(drouter, zero_if_none(rwr.grad, rwr)), rel(dwu, zero_if_none(wur.grad, wur)[lo:hi]),
                        rel(dwd, zero_if_none(wdr.grad, wdr)[lo:hi])]
                report(all(e < TOL for e in errs),
                       f"{where} rel err out {errs[0]:.1e} dx {errs[1]:.1e} drouter {errs[2]:.1e} "
                       f"dw_up {errs[3]:.1e} dw_down {errs[4]:.1e}")
                if strategy != "naive":
                    same = all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run) if a is not None)
                    report(same, f"{where} bitwise identical across {len(runs)} runs")

    if "persistent" in _only("GPU_CHECK_STRATEGIES", ("persistent",) + ALL_STRATEGIES):
        check_persistent(dev, rank, world, {n: CONFIGS[n] for n in configs}, cases, report)

    # Shared experts (Qwen2-MoE's gated one) with the side-stream overlap on and off: against the
    # fp32 reference, and the overlapped output bitwise the plain one (the same sum).
    if not os.environ.get("GPU_CHECK_CONFIGS"):
        check_shared_overlap(dev, rank, world, strategies, report)

    # A NaN token stays in its own row.
    cfg = CONFIGS["swiglu-16e"]
    if os.environ.get("GPU_CHECK_CONFIGS") and "swiglu-16e" not in configs:
        strategies_nan = ()
    else:
        strategies_nan = ("naive", "sequential")
    x = torch.randn(300, cfg.hidden, device=dev).to(cfg.dtype)
    for strategy in strategies_nan:
        layer = MoELayer(cfg, strategy=strategy, seed=0, device=dev)
        clean = layer(x)
        bad = x.clone()
        bad[7, 3] = float("nan")
        out = layer(bad)
        others = torch.ones(300, dtype=torch.bool, device=dev)
        others[7] = False
        err = rel(out[others], clean[others])
        report(bool(torch.isnan(out[7]).all()) and err < TOL,
               f"nan-row {strategy:10s} rank {rank}: NaN only in its own row; other rows rel change {err:.1e}, "
               f"bitwise equal: {torch.equal(out[others], clean[others])}")

    total_fail = torch.tensor([len(failures)], device=dev)
    dist.all_reduce(total_fail)
    if rank == 0:
        print(f"\ngpu_check: {checks * world - int(total_fail)} passed, {int(total_fail)} failed "
              f"({world} ranks, {torch.cuda.get_device_name()})")
    release_shared_buffers()  # before the group goes: see its docstring
    dist.destroy_process_group()
    sys.exit(1 if int(total_fail) else 0)


if __name__ == "__main__":
    main()
