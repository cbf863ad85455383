"""GPU check and measurements of the ``fused`` strategy (torchrun --nproc-per-node W).

Steps (``--steps``; all by default):
  check   every preset, bf16: fused against sequential and naive on fresh random inputs with
          poisoned outputs, random / skewed / all-to-one-rank routing
  stress  N calls of qwen2-moe with token counts per rank drawn from a few repeated values (CUDA
          graph replays and evictions) or at random, Zipf-skewed routing, 2 in 10 checked against
          naive; the error record checked at the end
  hidden  communication hidden: 1 − (t_fused − t_fused_local) / t_transfers, where
          t_fused_local routes every token to its own rank's experts (same rows per expert,
          no remote traffic) and t_transfers is the same remote bytes moved alone by copy
          engines (dispatch + return, both ranks at once)
  split   layer time for a few (n_comm, n_comm1) splits (what `interlace tune` automates)
  graph   ``fused`` with CUDA-graph replay of inference calls (the default): six calls with fresh
          inputs and routing each, checked against sequential; then sequential / fused:eager /
          fused timed round-robin
  stack   a stack of layers whose graphs share one memory pool (strategies/graphs.py): fused and
          persistent inference, fused:train and fused:lean steps over several token counts interleaved, each
          layer's replayed call against the same call run eagerly; the memory the graphs keep
Writes a JSON of everything to --out and prints a short table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from interlace import MoELayer  # noqa: E402
from interlace.tools.bench import init_env, make_routing, reduce_max, time_cuda  # noqa: E402
from interlace.tools.bench_timing import host_syncs  # noqa: E402
from interlace.tools.bench import rel_err as rel  # noqa: E402
from interlace.config import preset  # noqa: E402
from interlace.kernels import alloc  # noqa: E402
from interlace.parallel import release_shared_buffers  # noqa: E402


def worst(env, v: float) -> float:
    return reduce_max(env, v)


ENV = None  # set by main(): time_ms puts a barrier across its ranks before each timed call


def time_ms(fn, iters=20, warmup=5):
    """Median ms of ``fn`` (the harness's timing: CUDA events, a barrier before each call)."""
    return statistics.median(time_cuda(fn, warmup, iters, ENV))


def step_check(env, args, log):
    rows = []
    for name in args.configs:
        cfg = preset(name)
        layer = MoELayer(cfg, group=env.group, strategy="naive", seed=3, device=env.device)
        for tokens in args.check_tokens:
            for routing in ("random", "skewed", "one_rank"):
                gen = torch.Generator(device=env.device).manual_seed(100 + env.rank + tokens)
                x = torch.randn(tokens, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
                if routing == "one_rank":
                    idx = (torch.arange(tokens, device=env.device)[:, None] + torch.arange(cfg.top_k, device=env.device)) \
                        % (cfg.num_experts // env.world)  # everything to rank 0's experts
                else:
                    idx = make_routing(cfg, routing, tokens, env, 5)
                outs = {}
                with torch.no_grad():
                    for strategy in ("naive", "sequential", "fused"):
                        layer.set_strategy(strategy, **({"max_tokens": max(args.check_tokens)} if strategy == "fused" else {}))
                        alloc.poison(True)
                        outs[strategy] = layer(x, expert_indices=idx).clone()
                        alloc.poison(False)
                        if strategy == "fused":
                            torch.cuda.synchronize()
                            layer.strategy.synchronize_and_check()
                e_naive = worst(env, rel(outs["fused"], outs["naive"]))
                e_seq = worst(env, rel(outs["fused"], outs["sequential"]))
                rows.append(dict(config=name, tokens=tokens, routing=routing, err_vs_naive=e_naive, err_vs_seq=e_seq,
                                 ok=e_naive < 2e-2))
                log(f"check {name:14s} T={tokens:<6d} {routing:9s} fused vs naive {e_naive:.2e} vs sequential {e_seq:.2e}")
        del layer
        torch.cuda.empty_cache()
    return rows


def step_stress(env, args, log):
    cfg = preset("qwen2-moe")
    max_t = 2048
    layer = MoELayer(cfg, group=env.group, strategy="naive", seed=4, device=env.device)
    naive = layer.strategy
    layer.set_strategy("fused", max_tokens=max_t)
    fused = layer.strategy  # kept across calls: its CUDA graphs are captured, replayed and evicted
    rng = random.Random(env.rank * 7 + 1)
    worst_err, checked = 0.0, 0
    for i in range(args.stress_calls):
        # Half the calls repeat one of a few token counts (graph replays, more of them than the
        # graph cache holds), half draw a fresh one (eager calls).
        tokens = rng.choice((0, 1, 17, 256, 700, 1000, 1500, 1999, 2048, 64)) if i % 2 else rng.randint(0, max_t)
        x = torch.randn(tokens, cfg.hidden, device=env.device).to(cfg.dtype)
        idx = make_routing(cfg, "skewed", tokens, env, i) if tokens else None
        with torch.no_grad():
            layer.strategy = fused
            out = layer(x, expert_indices=idx)
            if i % 10 < 2:
                layer.strategy = naive
                ref = layer(x, expert_indices=idx)
                if tokens:
                    worst_err = max(worst_err, rel(out, ref))
                checked += 1
    torch.cuda.synchronize()
    fused.synchronize_and_check()
    worst_err = worst(env, worst_err)
    log(f"stress {args.stress_calls} calls, {checked} checked against naive, worst rel err {worst_err:.2e}")
    return dict(calls=args.stress_calls, checked=checked, worst_err=worst_err, ok=worst_err < 2e-2)


def bare_transfers(env, cfg, tokens):
    """The remote bytes of a fused call alone, as a callable: each rank sends T·k/W rows to each
    of its W − 1 peers and gets as many back, as peer copies on one stream per peer (all peers at
    once, as the fused kernels write them; with 2 ranks: one copy of T·k/2 rows each way). The
    callable holds its symmetric buffer; drop it before the group goes."""
    import torch.distributed._symmetric_memory as symm_mem

    peers = [(env.rank + d) % env.world for d in range(1, env.world)]
    share = tokens * cfg.top_k // env.world
    src = torch.randn(share, cfg.hidden, device=env.device).to(cfg.dtype)
    peer_buf = symm_mem.empty(max(1, len(peers)) * share * cfg.hidden, dtype=cfg.dtype, device=env.device)
    hdl = symm_mem.rendezvous(peer_buf, env.group)
    # Region d − 1 of a rank's buffer takes the rows of the rank d places before it.
    dsts = [hdl.get_buffer(p, (share, cfg.hidden), cfg.dtype, storage_offset=(d - 1) * share * cfg.hidden)
            for d, p in enumerate(peers, 1)]
    streams = [torch.cuda.Stream(device=env.device) for _ in peers]

    def transfers():
        cur = torch.cuda.current_stream()
        for stream, dst in zip(streams, dsts):
            stream.wait_stream(cur)
            with torch.cuda.stream(stream):
                dst.copy_(src)  # dispatch
                dst.copy_(src)  # return
        for stream in streams:
            cur.wait_stream(stream)
    transfers.keep = (peer_buf, hdl)  # the symmetric buffer lives as long as the callable
    return transfers


def step_hidden(env, args, log):
    rows = []
    for name in args.hidden_configs:
        cfg = preset(name)
        for tokens in args.hidden_tokens:
            layer = MoELayer(cfg, group=env.group, strategy="fused", seed=5, device=env.device,
                             strategy_options={"max_tokens": tokens})
            x = torch.randn(tokens, cfg.hidden, device=env.device).to(cfg.dtype)
            bal, loc = make_routing(cfg, "balanced", tokens, env, 0), make_routing(cfg, "local", tokens, env, 0)
            with torch.no_grad():
                t_fused = time_ms(lambda: layer(x, expert_indices=bal))
                t_local = time_ms(lambda: layer(x, expert_indices=loc))
                layer.set_strategy("sequential")
                t_seq = time_ms(lambda: layer(x, expert_indices=bal))
            transfers = bare_transfers(env, cfg, tokens)
            t_tr = time_ms(transfers)
            t_fused, t_local, t_tr, t_seq = (worst(env, v) for v in (t_fused, t_local, t_tr, t_seq))
            hidden = 1 - (t_fused - t_local) / t_tr
            rows.append(dict(config=name, tokens=tokens, t_fused=t_fused, t_fused_local=t_local, t_transfers=t_tr,
                             t_sequential=t_seq, hidden=hidden))
            log(f"hidden {name:14s} T={tokens:<6d} fused {t_fused:.3f} local-only {t_local:.3f} transfers {t_tr:.3f} "
                f"sequential {t_seq:.3f} ms → hidden {hidden:.1%}")
            del layer, transfers
            torch.cuda.empty_cache()
    return rows


def step_phases(env, args, log):
    """Per-layer kernel times of fused (local-only and balanced routing) under kernel-config variants
    given as "field=value,..." strings of FusedKernelConfig fields in --variants."""
    rows = []
    for name in args.hidden_configs:
        cfg = preset(name)
        tokens = args.split_tokens
        layer = MoELayer(cfg, group=env.group, strategy="naive", seed=6, device=env.device)
        x = torch.randn(tokens, cfg.hidden, device=env.device).to(cfg.dtype)
        routings = {r: make_routing(cfg, r, tokens, env, 0) for r in ("balanced", "local")}
        first = {}  # routing → the first variant's output: every variant must compute the same layer
        for variant in args.variants:
            kernel, _ = split_variant(variant)
            layer.set_strategy("fused", max_tokens=tokens, kernel=kernel)
            layer.strategy.profile_phases = True
            for rname, idx in routings.items():
                with torch.no_grad():
                    total = worst(env, time_ms(lambda: layer(x, expert_indices=idx), iters=10, warmup=3))
                    out = layer(x, expert_indices=idx).float()
                    ph = layer.strategy.phase_ms()
                ref = first.setdefault(rname, out)
                err = worst(env, ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item())
                l0, l1 = worst(env, ph["layer0"]), worst(env, ph["layer1"])
                ok = err < 2e-2 and bool(torch.isfinite(out).all())
                rows.append(dict(config=name, tokens=tokens, variant=variant, routing=rname, total=total, layer0=l0,
                                 layer1=l1, rel_err_vs_first_variant=err, ok=ok))
                log(f"phases {name:14s} T={tokens} {variant:34s} {rname:8s} total {total:.3f} layer0 {l0:.3f} "
                    f"layer1 {l1:.3f} ms  rel err vs {args.variants[0]} {err:.1e}{'' if ok else '  WRONG'}")
        del layer
        torch.cuda.empty_cache()
    return rows


def split_variant(variant):
    """An ``ab`` variant "copy_rows=64,n_comm=8" → (FusedKernelConfig fields to override, strategy
    options): ``n_comm``/``n_comm1`` set the block split (the other stays tuned), the rest the kernels."""
    kernel, split = {}, {}
    for item in ([] if variant == "default" else variant.split(",")):
        key, _, value = item.partition("=")
        (split if key.strip() in ("n_comm", "n_comm1") else kernel)[key.strip()] = int(value)
    return kernel, split


def step_ab(env, args, log):
    """Fused kernel-config variants against each other, interleaved: per round, every variant is
    timed on balanced and on local-only routing, then sequential and the bare transfers, so slow
    drift (clocks, other tenants) falls on all of them alike. Reports per variant the median over
    rounds, its median per-round ratio to the first variant, fused vs sequential and the hidden
    share 1 − (t_fused − t_local) / t_transfers. Outputs are checked against the first variant's
    first call, on each variant's first call and again after the timing (graph replays)."""
    rows = []
    for name in args.hidden_configs:
        cfg = preset(name)
        for tokens in args.hidden_tokens:
            layer = MoELayer(cfg, group=env.group, strategy="sequential", seed=5, device=env.device)
            seq = layer.strategy
            x = torch.randn(tokens, cfg.hidden, device=env.device).to(cfg.dtype)
            bal, loc = make_routing(cfg, "balanced", tokens, env, 0), make_routing(cfg, "local", tokens, env, 0)
            strategies, ref, errs = {}, None, {}
            with torch.no_grad():
                for variant in args.variants:
                    kernel, split = split_variant(variant)
                    layer.set_strategy("fused", max_tokens=tokens, kernel=kernel, **split)
                    out = layer(x, expert_indices=bal).float()  # first call: sets up
                    strategies[variant] = layer.strategy
                    ref = out if ref is None else ref
                    errs[variant] = worst(env, rel(out, ref))
            transfers = bare_transfers(env, cfg, tokens)

            def run(strategy, idx):
                layer.strategy = strategy
                return lambda: layer(x, expert_indices=idx)

            times = {(v, r): [] for v in args.variants for r in ("bal", "loc")}
            times["seq"], times["tr"] = [], []
            with torch.no_grad():
                for _ in range(args.rounds):
                    for v, s in strategies.items():
                        times[(v, "bal")].append(worst(env, time_ms(run(s, bal), iters=args.iters, warmup=3)))
                        times[(v, "loc")].append(worst(env, time_ms(run(s, loc), iters=args.iters, warmup=3)))
                    times["seq"].append(worst(env, time_ms(run(seq, bal), iters=args.iters, warmup=3)))
                    times["tr"].append(worst(env, time_ms(transfers, iters=args.iters, warmup=3)))
                for v, s in strategies.items():  # once more: the timed calls replayed CUDA graphs
                    errs[v] = max(errs[v], worst(env, rel(run(s, bal)().float(), ref)))
            med = {k: statistics.median(v) for k, v in times.items()}
            first = args.variants[0]
            for v in args.variants:
                ratio = statistics.median(a / b for a, b in zip(times[(v, "bal")], times[(first, "bal")]))
                hidden = 1 - (med[(v, "bal")] - med[(v, "loc")]) / med["tr"]
                ok = errs[v] < 2e-2
                rows.append(dict(config=name, tokens=tokens, variant=v, t_fused=med[(v, "bal")],
                                 t_local=med[(v, "loc")], t_sequential=med["seq"], t_transfers=med["tr"],
                                 ratio_to_first=ratio, hidden=hidden, rel_err_vs_first=errs[v], ok=ok,
                                 rounds={"bal": times[(v, "bal")], "loc": times[(v, "loc")]}))
                log(f"ab {name:14s} T={tokens:<6d} {v:34s} fused {med[(v, 'bal')]:.3f} local {med[(v, 'loc')]:.3f} "
                    f"ms  /{first} {ratio:.3f}  seq/fused {med['seq'] / med[(v, 'bal')]:.2f}  "
                    f"hidden {hidden:.1%}  err {errs[v]:.1e}{'' if ok else '  WRONG'}")
            layer.strategy = seq
            del layer, strategies, transfers
            torch.cuda.empty_cache()
    return rows


def step_train(env, args, log):
    """``fused:train`` forward+backward: per-step CUDA-event times of one call (slowest rank),
    and the fwd+bwd medians of ``sequential`` and ``fused:train`` timed round-robin."""
    from interlace.strategies.fused.train import step_ms

    rows = []
    for name in args.hidden_configs:
        cfg = preset(name)
        tokens = args.split_tokens
        idx = make_routing(cfg, "balanced", tokens, env, 0)
        x = torch.randn(tokens, cfg.hidden, device=env.device).to(cfg.dtype)
        g = torch.randn_like(x)
        layers = {s: MoELayer(cfg, group=env.group, strategy=s, seed=6, device=env.device)
                  for s in ("sequential", "fused:train")}

        def step(layer):
            xr = x.detach().requires_grad_()
            layer(xr, expert_indices=idx).backward(g)

        for layer in layers.values():
            for _ in range(3):
                step(layer)
        times = {s: [] for s in layers}
        for _ in range(10):
            for s, layer in layers.items():
                times[s].append(time_ms(lambda: step(layer), iters=1, warmup=0))
        med = {s: worst(env, sorted(v)[len(v) // 2]) for s, v in times.items()}
        ft = layers["fused:train"].strategy
        ft.profile_phases = True
        step(layers["fused:train"])
        ft.profile_phases = False
        parts = [(k, worst(env, v)) for k, v in step_ms(ft)]
        row = dict(config=name, tokens=tokens, sequential=med["sequential"], fused_train=med["fused:train"],
                   steps=parts)
        rows.append(row)
        log(f"train {name:14s} T={tokens} sequential {med['sequential']:.3f} fused:train {med['fused:train']:.3f} ms; "
            + ", ".join(f"{k} {v:.3f}" for k, v in parts))
        del layers
        torch.cuda.empty_cache()
    return rows


def step_train_check(env, args, log):
    """Two stacked ``fused:train`` layers (one shared peer buffer: forward 1, forward 2,
    backward 2, backward 1) for ``--stress-calls`` // 100 steps with fresh tokens, token counts
    and (skewed, forced) routing, each step's output, dx and weight gradients against the same
    two layers on ``sequential``. The routing is forced because in bf16 the second layer's
    router would otherwise flip near-tied choices between the two strategies."""
    rows = []
    for name in args.configs:
        cfg = preset(name)
        stacks = {s: [MoELayer(cfg, group=env.group, strategy=s, seed=seed, device=env.device,
                               strategy_options={"max_tokens": max(args.check_tokens)} if s != "sequential" else {})
                      for seed in (21, 22)] for s in ("sequential", "fused:train")}
        worst_err, worst_what = 0.0, []
        for step in range(max(1, args.stress_calls // 100)):
            tokens = random.Random(step * 31 + env.rank).choice(args.check_tokens)
            x = torch.randn(tokens, cfg.hidden, device=env.device).to(cfg.dtype)
            g = torch.randn_like(x)
            idx = [make_routing(cfg, "skewed", tokens, env, step * 2 + i) for i in range(2)]
            got = {}
            for s, (a, b) in stacks.items():
                xr = x.clone().requires_grad_()
                out = b(a(xr, expert_indices=idx[0]), expert_indices=idx[1])
                out.backward(g)
                got[s] = [out, xr.grad] + [p.grad.clone() for p in (*a.parameters(), *b.parameters())]
                for p in (*a.parameters(), *b.parameters()):
                    p.grad = None
            errs = [worst(env, rel(h, w)) for h, w in zip(got["fused:train"], got["sequential"])]
            if max(errs) > worst_err:
                worst_err, worst_what = max(errs), errs
        syncs = train_step_syncs(stacks["fused:train"], x, g, idx)
        names = ["out", "dx"] + [f"{i}.{n}" for i, layer in enumerate(stacks["sequential"])
                                 for n, _ in layer.named_parameters()]
        log("  " + ", ".join(f"{n} {e:.1e}" for n, e in zip(names, worst_what)))
        ok = worst_err < 2e-2 and syncs == 0
        rows.append(dict(config=name, steps=max(1, args.stress_calls // 100), worst=worst_err, host_syncs=syncs,
                         ok=ok))
        log(f"train_check {name:14s} two layers, {rows[-1]['steps']} steps: worst rel err vs sequential "
            f"{worst_err:.2e}, host syncs in a step {syncs} {'ok' if ok else 'FAIL'}")
        del stacks
        torch.cuda.empty_cache()
    return rows


def train_step_syncs(stack, x, g, idx) -> int:
    """Host syncs (``torch.cuda.set_sync_debug_mode``) in one warm forward + backward of the
    ``fused:train`` stack: none is expected at any world size (the error record is read behind
    the kernels)."""

    def step():
        xr = x.clone().requires_grad_()
        stack[1](stack[0](xr, expert_indices=idx[0]), expert_indices=idx[1]).backward(g)
        for p in (*stack[0].parameters(), *stack[1].parameters()):
            p.grad = None

    for _ in range(2):  # this token count's eager call and its graph capture (which syncs) first
        step()
    syncs = host_syncs(step)
    for w in syncs[:3]:  # where (the warning names the call; its stack is the step's)
        print(f"rank {ENV.rank}: host sync in a fused:train step: {w.filename}:{w.lineno}: {w.message}", flush=True)
    return int(worst(ENV, float(len(syncs))))


def step_trace(env, args, log):
    """torch.profiler kernel table of a few calls of fused and sequential (first hidden config)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = preset(args.hidden_configs[0])
    tokens = args.split_tokens
    layer = MoELayer(cfg, group=env.group, strategy="naive", seed=6, device=env.device)
    x = torch.randn(tokens, cfg.hidden, device=env.device).to(cfg.dtype)
    idx = make_routing(cfg, "balanced", tokens, env, 0)
    tables = {}
    for strategy in ("fused", "sequential"):
        layer.set_strategy(strategy, **({"max_tokens": tokens} if strategy == "fused" else {}))
        with torch.no_grad():
            for _ in range(3):
                layer(x, expert_indices=idx)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    layer(x, expert_indices=idx)
                torch.cuda.synchronize()
        tables[strategy] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
        if env.rank == 0:
            prof.export_chrome_trace(os.path.join(args.out, f"trace_{strategy}.json"))
            print(f"## {strategy}\n{tables[strategy]}", flush=True)
    return {"note": "tables printed to the log"}


def step_split(env, args, log):
    rows = []
    sms = torch.cuda.get_device_properties(env.device).multi_processor_count
    for name in args.split_configs:
        cfg = preset(name)
        tokens = args.split_tokens
        layer = MoELayer(cfg, group=env.group, strategy="naive", seed=6, device=env.device)
        x = torch.randn(tokens, cfg.hidden, device=env.device).to(cfg.dtype)
        idx = make_routing(cfg, "random", tokens, env, 9)
        for n0 in args.splits:
            for n1 in args.splits:
                if not (n0 < sms and n1 < sms):
                    continue
                layer.set_strategy("fused", max_tokens=tokens, n_comm=n0, n_comm1=n1)
                with torch.no_grad():
                    t = worst(env, time_ms(lambda: layer(x, expert_indices=idx), iters=10, warmup=3))
                rows.append(dict(config=name, tokens=tokens, n_comm=n0, n_comm1=n1, ms=t))
                log(f"split {name:14s} T={tokens} n_comm={n0:3d} n_comm1={n1:3d} {t:.3f} ms")
        del layer
        torch.cuda.empty_cache()
    return rows


def step_graph(env, args, log):
    """``fused:graph``: replays with fresh inputs (and routing) on every call, each checked against
    sequential on the same inputs with poisoned outputs; then eager vs replayed time, interleaved."""
    rows = []
    for name in args.graph_configs:
        cfg = preset(name)
        for tokens in args.graph_tokens:
            layer = MoELayer(cfg, group=env.group, strategy="sequential", seed=6, device=env.device)
            seq = layer.strategy
            layer.set_strategy("fused:eager")
            eager = layer.strategy
            layer.set_strategy("fused:graph")
            graph = layer.strategy
            worst_err = 0.0
            with torch.no_grad():
                for i in range(6):  # call 1 eager, call 2 captures + replays, then replays
                    gen = torch.Generator(device=env.device).manual_seed(1000 * i + env.rank + tokens)
                    x = torch.randn(tokens, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
                    idx = make_routing(cfg, "skewed" if i % 2 else "balanced", tokens, env, i)
                    layer.strategy = seq
                    ref = layer(x, expert_indices=idx).clone()
                    layer.strategy = graph
                    captured = graph._graphs.get(tokens)
                    if captured is not None:  # a replay must rewrite every row of its static output
                        captured.out.fill_(float("nan"))
                    alloc.poison(i != 1)  # not while capturing: the fills would be part of the graph
                    out = layer(x, expert_indices=idx)
                    alloc.poison(False)
                    worst_err = max(worst_err, rel(out, ref))
                torch.cuda.synchronize()
                graph.synchronize_and_check()
                x = torch.randn(tokens, cfg.hidden, device=env.device).to(cfg.dtype)
                times = {"sequential": [], "fused": [], "fused:graph": []}
                for _ in range(5):
                    for label, strat in (("sequential", seq), ("fused", eager), ("fused:graph", graph)):
                        layer.strategy = strat
                        layer(x)
                for _ in range(20):
                    for label, strat in (("sequential", seq), ("fused", eager), ("fused:graph", graph)):
                        layer.strategy = strat
                        times[label] += time_cuda(lambda: layer(x), 0, 1, env)
            med = {k: worst(env, statistics.median(v)) for k, v in times.items()}
            worst_err = worst(env, worst_err)
            rows.append(dict(config=name, tokens=tokens, err_vs_seq=worst_err, ok=worst_err < 2e-2, **med))
            log(f"graph {name:14s} T={tokens:<6d} replays vs sequential {worst_err:.2e}; ms sequential "
                f"{med['sequential']:.3f} fused {med['fused']:.3f} fused:graph {med['fused:graph']:.3f}")
            del layer, seq, eager, graph
            torch.cuda.empty_cache()
    return rows


def step_stack(env, args, log):
    """``--stack-layers`` layers, their CUDA graphs in one shared pool (strategies/graphs.py): the
    graphs of other layers and token counts replay between a graph's calls, inference calls
    between a training forward and its backward. Each layer's call through its graphs is
    compared with the same strategy run eagerly (``cuda_graph=False``: the same kernels) on the
    same inputs, layer by layer (every layer's input is the eager stack's); then the memory the
    graphs keep: ``memory_reserved`` with the graphs alive, after ``empty_cache``, less that before
    the first call. ``--private-pools`` captures each graph into a pool of its own instead, for
    comparison."""
    if args.private_pools:
        from interlace.strategies import graphs

        graphs.device_pool = lambda device: torch.cuda.graph_pool_handle()
    rows = []
    L = args.stack_layers
    for name in args.stack_configs:
        cfg = preset(name)
        T_max = max(args.stack_tokens)
        layers = [MoELayer(cfg, group=env.group, strategy="sequential", seed=40 + i, device=env.device) for i in range(L)]
        plain = [layer.strategy for layer in layers]  # (set back after each strategy: nothing of it stays alive)
        opts = {"fused": {"max_tokens": T_max}, "fused:train": {"max_tokens": T_max},
                "fused:lean": {"max_tokens": T_max}, "persistent": {}}

        def build(spec, **extra):
            out = []
            for layer in layers:
                layer.set_strategy(spec, **opts[spec], **extra)
                out.append(layer.strategy)
            return out

        for spec in args.stack_strategies:
            graph, eager = build(spec), build(spec, cuda_graph=False)
            train = spec.startswith("fused:")
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(env.device)
            worst_err, bitwise, calls = 0.0, True, 0
            for rnd in range(4):  # round 0 eager, 1 captures, 2-3 replay
                for T in args.stack_tokens:
                    gen = torch.Generator(device=env.device).manual_seed(7000 + 97 * rnd + T + env.rank)
                    x = torch.randn(T, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
                    g = torch.randn(T, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
                    idx = [make_routing(cfg, "skewed", T, env, 50 * rnd + i) for i in range(L)] if train else [None] * L
                    got = {}
                    for label, strats in (("graph", graph), ("eager", eager)):
                        ins, outs = [], []
                        h = x
                        for i, layer in enumerate(layers):
                            layer.strategy = strats[i]
                            xin = h.detach().clone().requires_grad_(train)
                            alloc.poison(rnd != 1)  # (not while capturing)
                            if train:
                                out = layer(xin, expert_indices=idx[i])
                            else:
                                with torch.no_grad():
                                    out = layer(xin)
                            alloc.poison(False)
                            ins.append(xin)
                            outs.append(out)
                            h = out
                        if train and label == "graph":
                            # inference calls (their graphs) between the training forward and its backward
                            with torch.no_grad():
                                for i, layer in enumerate(layers):
                                    layer.strategy = strats[i]
                                    layer(x[: args.stack_tokens[-1] // 2])
                        res = [o.detach().clone() for o in outs]
                        if train:
                            for i in reversed(range(L)):
                                layers[i].strategy = strats[i]
                                outs[i].backward(g)
                            res += [t.grad.clone() for t in ins]
                            for layer in layers:
                                res += [p.grad.clone() for p in layer.parameters()]
                                for p in layer.parameters():
                                    p.grad = None
                        got[label] = res
                    calls += 1
                    for a, b in zip(got["graph"], got["eager"]):
                        bitwise = bitwise and torch.equal(a, b)
                        worst_err = max(worst_err, rel(a, b))
            del got, res, outs, ins, h, out, xin, x, g
            torch.cuda.synchronize()
            for s in graph:
                if hasattr(s, "synchronize_and_check"):
                    s.synchronize_and_check()
            torch.cuda.empty_cache()
            kept = (torch.cuda.memory_reserved(env.device) - before) / 2**30
            worst_err, kept = worst(env, worst_err), worst(env, kept)
            bitwise = worst(env, 0.0 if bitwise else 1.0) == 0.0
            ok = worst_err < 1e-3
            rows.append(dict(config=name, layers=L, strategy=spec, tokens=args.stack_tokens, calls=calls,
                             err_vs_eager=worst_err, bitwise=bitwise, graph_gib=kept,
                             pools="private" if args.private_pools else "shared", ok=ok))
            log(f"stack {name:14s} {L} layers {spec:11s} T={args.stack_tokens}: graphs vs eager {worst_err:.1e} "
                f"(bitwise {bitwise}), memory the graphs keep {kept:.2f} GiB "
                f"({'private' if args.private_pools else 'shared'} pools) {'ok' if ok else 'FAIL'}")
            for s in graph + eager:
                s.close()
            for layer, s in zip(layers, plain):
                layer.strategy = s
            del graph, eager, s
            gc.collect()
            torch.cuda.empty_cache()
        del layers
        torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", nargs="+", default=["check", "stress", "hidden", "split"])
    p.add_argument("--configs", nargs="+", default=["mixtral-8x7b", "phi3.5-moe", "qwen2-moe", "qwen3-30b-a3b",
                                                    "dsv3-like", "flashdmoe-cfg"])
    p.add_argument("--check-tokens", nargs="+", type=int, default=[1000, 4096])
    p.add_argument("--stress-calls", type=int, default=1000)
    p.add_argument("--hidden-configs", nargs="+", default=["qwen2-moe", "qwen3-30b-a3b", "flashdmoe-cfg", "mixtral-8x7b"])
    p.add_argument("--hidden-tokens", nargs="+", type=int, default=[8192, 16384])
    p.add_argument("--split-configs", nargs="+", default=["qwen2-moe"])
    p.add_argument("--graph-configs", nargs="+", default=["qwen2-moe", "qwen3-30b-a3b", "flashdmoe-cfg", "mixtral-8x7b"])
    p.add_argument("--graph-tokens", nargs="+", type=int, default=[4096, 8192, 16384])
    p.add_argument("--split-tokens", type=int, default=16384)
    p.add_argument("--splits", nargs="+", type=int, default=[8, 16, 32])
    p.add_argument("--variants", nargs="+", default=["default", "copy_rows=64,n_comm=8"],
                   help="phases/ab: FusedKernelConfig fields (field=value,...); ab also takes n_comm/n_comm1")
    p.add_argument("--rounds", type=int, default=5, help="ab: interleaved rounds")
    p.add_argument("--iters", type=int, default=20, help="ab: timed calls per round and variant")
    p.add_argument("--stack-configs", nargs="+", default=["qwen3-30b-a3b"])
    p.add_argument("--stack-layers", type=int, default=8)
    p.add_argument("--stack-strategies", nargs="+", default=["fused", "persistent", "fused:train", "fused:lean"])
    p.add_argument("--stack-tokens", nargs="+", type=int, default=[4096, 2048, 3000])
    p.add_argument("--private-pools", action="store_true", help="stack: each graph its own pool (comparison)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args()
    global ENV
    env = ENV = init_env()
    lines = []

    def log(msg):
        if env.rank == 0:
            print(msg, flush=True)
            lines.append(msg)

    results = {}
    steps = {"check": step_check, "stress": step_stress, "hidden": step_hidden, "split": step_split,
             "phases": step_phases, "trace": step_trace, "graph": step_graph, "train": step_train,
             "train_check": step_train_check, "ab": step_ab, "stack": step_stack}
    for s in args.steps:
        try:
            results[s] = steps[s](env, args, log)
        except Exception as exc:  # keep going: the other steps' numbers are still worth having
            import traceback

            traceback.print_exc()
            results[s] = {"error": repr(exc)}
            log(f"{s}: FAILED {exc!r}")
    if env.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fused_check.json"), "w") as f:
            json.dump(results, f, indent=1)
        print("\n# summary")
        for line in lines:
            if line.startswith(("hidden", "stress", "split", "phases", "graph", "ab ", "stack")) or "FAILED" in line:
                print(line)
        bad = [r for r in results.get("check", []) if isinstance(r, dict) and not r.get("ok", True)]
        print(f"check: {len(results.get('check', [])) - len(bad)} ok, {len(bad)} wrong")
        wrong_variants = [r for s in ("phases", "ab") for r in results.get(s, [])
                          if isinstance(r, dict) and not r.get("ok", True)]
        if wrong_variants:
            print(f"phases: {len(wrong_variants)} variant rows disagree with the first variant")
    dist.barrier()
    release_shared_buffers()  # before the group goes: see its docstring
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
