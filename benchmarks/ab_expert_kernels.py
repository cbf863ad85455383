"""Interleaved A/B of one Triton expert kernel's configs on bench shapes (one GPU).

    python benchmarks/ab_expert_kernels.py --config dsv3-like [qwen2-moe ...] --tokens 4096 [16384 ...] \
        --kernel gemm1 --variants table 128,256,64,8,3,16,tma_store=1 [--rounds 5] [--routing balanced|ragged]

Each (config, tokens) pair is one A/B, run in turn in this process (one compile per kernel).

The tuner (``interlace tune-experts``) picks among its candidates by a few rounds of timing; its
spread between runs of the same config can bury the few-percent effects of one config field. Here one kernel runs alone on the bench block's rows (``bench_expert_kernels``:
one GPU's share of a ``--world``-GPU layer; ``balanced``: every expert T·k/E rows, ``ragged``: the
tuner's counts within ±1/8 of that, so experts end mid-tile), and the variants are timed in turn,
``--rounds`` times (``do_bench`` medians), so drift between calls hits every variant alike.

Kernels: ``gemm0`` (gate/up GEMM with its activation; with ``a_tma`` the gather copy it needs
is included; ``gemm0_train`` storing h as well, from the training table), ``gemm1`` (down projection), ``d_pre_act`` and ``dx`` (backward GEMMs), ``dw_down``
and ``dw_up`` (weight gradients; dW_up includes the gather copy of x's rows). A variant
is ``table`` (the tuning table's choice for this shape) or a config
(``bm,bn,bk,warps,stages[,group_m][,field=value...]``, :func:`interlace.tuning.tables.parse_config`).
Outputs are checked against the first variant's (bf16 tolerance).
"""

import argparse
import json
import statistics
import time

import torch
import triton

from interlace.tools.bench import bench_config, rel_err
from interlace.experts import init_expert_weights
from interlace.kernels.expert_gemm import configs as expert_configs
from interlace.kernels.expert_gemm.backward import backward_steps
from interlace.kernels.expert_gemm.gemm0 import launch_gemm0
from interlace.kernels.expert_gemm.grouped import launch_gemm
from interlace.kernels.expert_gemm.schedule import tile_schedule
from interlace.kernels.tma import ensure_allocator, use_tma
from interlace.tools.tune_experts import ragged_ends
from interlace.tuning.tables import GemmConfig, parse_config

TABLE_INDEX = {"gemm0": (expert_configs.FORWARD_KERNELS, 0), "gemm0_train": (expert_configs.TRAIN_FORWARD_KERNELS, 0),
               "gemm1": (expert_configs.FORWARD_KERNELS, 1),
               "d_pre_act": (expert_configs.BACKWARD_KERNELS, 0), "dx": (expert_configs.BACKWARD_KERNELS, 1),
               "dw_down": (expert_configs.BACKWARD_KERNELS, 2), "dw_up": (expert_configs.BACKWARD_KERNELS, 2)}


def parse_variant(text: str, kernel: str, x, w_down, rows: int, activation: str) -> GemmConfig:
    if text == "table":
        kernels, i = TABLE_INDEX[kernel]
        return expert_configs._choose(kernels, x, w_down, rows, activation, expert_configs.DEFAULT_OPTIONS)[0][i]
    return parse_config(text)


def _host_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", nargs="+", default=["dsv3-like"], help="one A/B per config and token count")
    p.add_argument("--tokens", nargs="+", type=int, default=[4096])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--kernel", choices=list(TABLE_INDEX), default="gemm1")
    p.add_argument("--variants", nargs="+", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--routing", choices=["balanced", "ragged"], default="balanced")
    p.add_argument("--json", default=None, help="also write the A/Bs here: a list, one entry per (config, tokens)")
    args = p.parse_args()
    results = []
    for config in args.config:
        for tokens in args.tokens:
            results.append(ab_one(args, config, tokens))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the next shape's weights
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def ab_one(args, config: str, tokens: int) -> dict:
    """One interleaved A/B of ``args.variants`` on one bench shape; prints its table, returns its rows."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")  # CPU: the interpreter at small shapes (a smoke run)
    cfg = bench_config(config, small=not cuda)
    E = cfg.num_experts // args.world
    R = tokens * cfg.top_k
    N, K = cfg.hidden, cfg.ffn
    w_up, w_down = init_expert_weights(cfg, range(E), 0, dev)
    if args.routing == "balanced":
        ends = ((torch.arange(1, E + 1, device=dev) * R) // E).to(torch.int32)
    else:
        ends = ragged_ends(R // E, E, dev)
        R = int(ends[-1])  # host sync once, in setup
    divisor = cfg.top_k
    x = torch.randn(tokens, N, device=dev).to(cfg.dtype)
    gather = torch.randperm(tokens * divisor, device=dev)[:R].to(torch.int32)
    up_width = w_up.shape[1]
    act_in = torch.randn(R, K, device=dev).to(cfg.dtype)
    dy = torch.randn(R, N, device=dev).to(cfg.dtype)
    h = torch.randn(R, up_width, device=dev).to(cfg.dtype)
    tma = use_tma(w_up, w_down)
    if tma:
        ensure_allocator()
    variants = [parse_variant(v, args.kernel, x, w_down, R, cfg.activation) for v in args.variants]
    flops = 2 * R * N * K * {"gemm0": up_width // K, "gemm0_train": up_width // K, "gemm1": 1, "d_pre_act": 1,
                             "dx": up_width // K, "dw_down": 1, "dw_up": up_width // K}[args.kernel]

    def runner(c: GemmConfig):
        if args.kernel in ("gemm0", "gemm0_train", "gemm1"):
            sched = tile_schedule(ends, R, c.block_m)
            out = torch.empty(R, N if args.kernel == "gemm1" else K, device=dev, dtype=cfg.dtype)
            if args.kernel != "gemm1":  # gemm0_train stores h too, as the training forward does
                h_out = torch.empty_like(h) if args.kernel == "gemm0_train" else None
                return out, lambda: launch_gemm0(x, gather, divisor, w_up, out, h_out, sched, R, cfg.activation,
                                                 c, tma)
            return out, lambda: launch_gemm(act_in, w_down, out, None, ends, R, cols=N, red=K, b_trans=True,
                                            epilogue=0, config=c, schedule=sched, tma=tma)
        c_act, c_dx, c_w = expert_configs.choose_backward_configs(dy, w_down, R, cfg.activation)[:3]
        configs = {"d_pre_act": (c, c_dx, c_w), "dx": (c_act, c, c_w)}.get(args.kernel, (c_act, c_dx, c))
        outputs, steps = backward_steps(dy, x, gather, divisor, w_up, w_down, ends, cfg.activation, h, act_in,
                                        configs)
        launch = dict((name, fn) for name, _, fn in steps)
        if args.kernel == "dx":
            launch["d_pre_act"]()  # dx reads d(pre-activation)
            return None, lambda: (launch["dx"](), outputs[0])[1]
        if args.kernel in ("dw_down", "dw_up"):
            launch["d_pre_act"]()  # dW_up reads d(pre-activation)
            out = outputs[2] if args.kernel == "dw_down" else outputs[1]
            return out, launch[args.kernel]
        return None, launch["d_pre_act"]  # returns d(pre-activation)

    runs = [runner(c) for c in variants]
    # Compile, warm, and compare each variant with the first as it runs, holding one copy of the first's
    # output (fp32 copies of every variant's dsv3-like dW_up run an H100 out of memory).
    first = None
    for i, (out, fn) in enumerate(runs):
        got = fn()
        got = out if out is not None else got
        if first is None:
            first = got.clone()
            continue
        err = rel_err(got, first)
        assert err < 1e-2, f"variant {args.variants[i]} differs from {args.variants[0]}: rel err {err:.2e}"
    del first
    times = [[] for _ in variants]
    for _ in range(args.rounds):
        for i, (_, fn) in enumerate(runs):
            times[i].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") if cuda
                            else _host_ms(fn))
    print(f"# {torch.cuda.get_device_name() if cuda else 'cpu'}, {config} {tokens} tokens, {R} rows over {E} experts "
          f"({args.routing}), kernel {args.kernel}, {args.rounds} rounds")
    print("| variant | config | median ms | min–max ms | TFLOP/s | ÷ first |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(times[0])
    rows = []
    for text, c, t in zip(args.variants, variants, times):
        med = statistics.median(t)
        rows.append({"variant": text, "config": list(c.__dict__.values()), "ms": t})
        print(f"| {text} | {tuple(c.__dict__.values())} | {med:.4f} | {min(t):.4f}–{max(t):.4f} | "
              f"{flops / med / 1e9:.0f} | {base / med:.3f} |")
    return {"config": config, "tokens": tokens, "kernel": args.kernel, "routing": args.routing, "rows": rows}


if __name__ == "__main__":
    main()
