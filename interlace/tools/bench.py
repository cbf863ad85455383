"""The benchmark harness: the protocol of docs/benchmarking.md, timed on this machine.

Launch with ``torchrun --nproc-per-node W -m interlace.tools.bench [options]`` (one process per GPU;
a plain ``python -m interlace.tools.bench`` runs world size 1). For every config × tokens/GPU ×
routing × mode it:

1. builds fresh random inputs (never zeros) on every rank;
2. runs ``naive`` and checks every other strategy's output (and, with backward, its input
   and weight gradients) against naive on the same inputs — a strategy that disagrees is
   reported WRONG and never timed;
3. times each strategy with CUDA events around the whole layer call: ≥ 5 warm-up calls, a
   barrier before each timed call, the median of the timed calls, the slowest rank's median;
4. reports × floor (and, forward, × decode floor), speedup over naive, TFLOP/s and peak memory,
   with the ceilings (bf16 matmul 8192³, peer copy GPU0→GPU1 and its latency, HBM read)
   measured in the same run (the peer ones by rank 0 while the other ranks wait on the host:
   interlace/tools/bench_timing.py).

Floor (docs/benchmarking.md): ``max(FLOPs / matmul peak, 2 × remote bytes / peer bandwidth)`` with
FLOPs = 2·T·k·N·3·K and remote bytes = T·k·(W−1)/W·N·2. Forward+backward: 3× the FLOPs term
and, since backward moves the same bytes again, 2× the communication term. Decode floor (forward):
``max(floor, touched expert weight bytes of the busiest rank / HBM read bandwidth, 2 × peer
latency)``, where a local expert is touched when any token of any rank chose it.

``--fp8 S …`` (forward): the same layer with its experts in block-scaled FP8 (an FP8 twin built
from the same seed: its weights are the bf16 layer's, quantized) is timed too, on the strategies
S that run FP8 experts, round-robin with the bf16 ones. Its rows (``experts = "fp8"``) are checked
against the bf16 ``naive`` output within ``--fp8-tolerance`` (block FP8's own error, W8A8, is about
5e-2) and floored with the e4m3 matmul peak measured in the run (``torch._scaled_mm`` 8192³) and
the e4m3 weight and fp32 scale bytes they read. Their peak memory counts the bf16 layer, held beside
the twin.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from interlace.config import PRESETS, MoEConfig, preset
from interlace.planning.rounds import round_order
from interlace.layer import MoELayer
from interlace.strategies import STRATEGIES
from interlace.strategies.base import fp8_strategy_names
from interlace.env import settings
from interlace.tools.command_line import command_parser
from interlace.tools.bench_floors import (  # noqa: F401 — re-exported: the tools import these from here
    decode_floor_ms, expert_bytes, floor_ms, rel_err, squared_error_sums, touched_expert_bytes)
from interlace.tools.bench_strategies import (  # noqa: F401 — re-exported
    AUTO_SETTLE_CALLS, STEADY_CALLS, auto_choice, graph_pools_unallocated, isolated_peaks, settle_auto)
from interlace.tools.bench_timing import (  # noqa: F401 — re-exported: the tools import these from here
    barrier, measure_fp8_matmul_tflops, measure_hbm_read_tbps, measure_matmul_tflops, measure_peer_gbps,
    measure_peer_latency_us, reduce_max, time_back_to_back, time_cpu, time_cuda)

ROUTINGS = ("random", "balanced", "skewed", "local")
ZIPF_EXPONENT = 1.2


# ----------------------------------------------------------------------------- setup
@dataclass
class Env:
    rank: int
    world: int
    device: torch.device
    group: object

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def init_env() -> Env:
    """torchrun-launched: NCCL on CUDA (gloo on CPU); otherwise a single process."""
    if "RANK" in os.environ and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        else:
            dist.init_process_group("gloo")
    if dist.is_initialized():
        rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    else:
        rank, world, group = 0, 1, None
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return Env(rank, world, device, group)


# ----------------------------------------------------------------------------- inputs
def make_routing(cfg: MoEConfig, routing: str, tokens: int, env: Env, seed: int) -> torch.Tensor | None:
    """Forced (T, k) expert choices for ``balanced``, ``skewed`` and ``local``; None for ``random``
    (the router's own softmax top-k over random router weights). ``local``: every token picks k
    distinct experts of its own rank (no remote traffic; the "without remote traffic" time of
    the fused strategy's hidden share; needs k ≤ experts per rank)."""
    E, k = cfg.num_experts, cfg.top_k
    if routing == "random":
        return None
    if routing == "balanced":
        t = torch.arange(tokens, device=env.device) + env.rank * tokens
        return (t.unsqueeze(1) * k + torch.arange(k, device=env.device)) % E
    if routing == "skewed":
        gen = torch.Generator(device=env.device).manual_seed(seed + 1000 * env.rank)
        popularity_order = torch.randperm(E, generator=torch.Generator().manual_seed(seed)).to(env.device)
        p = torch.empty(E, device=env.device)
        p[popularity_order] = 1.0 / torch.arange(1, E + 1, device=env.device, dtype=torch.float32) ** ZIPF_EXPONENT
        if tokens == 0:
            return torch.empty(0, k, dtype=torch.long, device=env.device)
        return torch.multinomial(p.expand(tokens, E), k, replacement=False, generator=gen)
    if routing == "local":
        local = E // env.world
        if k > local:
            raise ValueError(f"local routing needs top_k ({k}) ≤ experts per rank ({local})")
        t = torch.arange(tokens, device=env.device)
        return env.rank * local + (t.unsqueeze(1) * k + torch.arange(k, device=env.device)) % local
    raise ValueError(f"unknown routing {routing!r}; choose from {ROUTINGS}")


@dataclass
class Row:
    config: str
    tokens: int
    routing: str
    mode: str
    strategy: str
    world: int
    status: str = "ok"
    experts: str = "bf16"  # "fp8": the layer's FP8 twin (--fp8), floored with the e4m3 peak
    median_ms: float | None = None
    back_to_back_ms: float | None = None  # forward, --back-to-back N: ms per call of N calls issued back to back
    floor_ms: float | None = None
    x_floor: float | None = None
    decode_floor_ms: float | None = None
    x_decode_floor: float | None = None
    weight_bytes: int | None = None  # forward: touched expert weight bytes of the busiest rank (decode floor)
    speedup_vs_naive: float | None = None
    tflops: float | None = None
    peak_gib: float | None = None  # GPU: steady state, no other strategy alive (see isolated_peaks)
    first_peak_gib: float | None = None  # GPU: the same over the first call and the warm-ups (auto: its calibration)
    first_call_ms: float | None = None
    choice: str | None = None  # auto's rows: the strategy it ran for this row's bucket and mode, and why
    rel_err_vs_naive: dict = field(default_factory=dict)
    times_ms: list = field(default_factory=list)


# ----------------------------------------------------------------------------- one case
BACK_TO_BACK_ROUNDS = 3


def run_case(layer: MoELayer, name: str, tokens: int, routing: str, mode: str, strategies: list[str],
             env: Env, args, ceilings, fp8_layer: MoELayer | None = None) -> list[Row]:
    """One case's rows: ``strategies`` on ``layer`` and, forward, ``args.fp8``'s on its FP8 twin
    ``fp8_layer`` (the same weights quantized)."""
    cfg = layer.config
    gen = torch.Generator(device=env.device).manual_seed(args.seed + 7919 * env.rank + tokens)
    x = torch.randn(tokens, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
    grad = torch.randn(tokens, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
    indices = make_routing(cfg, routing, tokens, env, args.seed)
    backward = mode == "fwdbwd"
    params = [layer.experts.w_up, layer.experts.w_down, layer.router.weight]
    weight_bytes = None
    if not backward:
        with torch.no_grad():
            topk_idx = indices if indices is not None else layer.router(x, None)[0]
        weight_bytes = touched_expert_bytes(cfg, topk_idx, env)

    def make_call(lay: MoELayer):
        def call():
            xi = x.requires_grad_(backward) if backward else x
            if backward:
                for p in params:
                    p.grad = None
                xi.grad = None
            out = lay(xi, expert_indices=indices)
            if backward:
                out.backward(grad)
            return out
        return call

    call = make_call(layer)

    # Correctness: every strategy against naive on the same inputs, before any timing.
    results = {}
    for strategy in ["naive"] + [s for s in strategies if s != "naive"]:
        layer.set_strategy(strategy)
        with torch.no_grad() if not backward else torch.enable_grad():
            out = call()
        results[strategy] = [out.detach().clone()] + (
            [x.grad.clone(), layer.experts.w_up.grad.clone(), layer.router.weight.grad.clone()] if backward else [])
    rows = []
    naive_ms = None
    timer = time_cuda if env.cuda else time_cpu

    def prepare(row: Row, lay: MoELayer, lay_call) -> None:
        """The row's first call (timed), ``auto``'s settling, the warm-ups, and without
        --interleave the timed calls; the strategy object and call kept for the round-robin."""
        ctx = torch.no_grad() if not backward else torch.enable_grad()
        with ctx:
            if env.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            lay_call()
            if env.cuda:
                torch.cuda.synchronize()
            row.first_call_ms = reduce_max(env, (time.perf_counter() - t0) * 1e3)
            settle_auto(lay.strategy, lay_call, tokens, mode)
            if getattr(args, "interleave", False):  # warm-ups now; the timed calls round-robin below
                for _ in range(args.warmup):
                    lay_call()
                times = []
            else:
                times = timer(lay_call, args.warmup, args.iters, env)
        row.times_ms = times
        row.median_ms = reduce_max(env, statistics.median(times)) if times else None
        # kept for the round-robin (caches such as the chosen degree); dropped before the rows return
        row.strategy_object, row.layer_object, row.call = lay.strategy, lay, lay_call

    for strategy in strategies:
        row = Row(name, tokens, routing, mode, strategy, env.world)
        errs = {}
        for label, got, ref in zip(("out", "dx", "dw_up", "drouter"), results[strategy], results["naive"]):
            errs[label] = reduce_max(env, rel_err(got, ref))
        row.rel_err_vs_naive = errs
        if strategy != "naive" and any(e > args.tolerance for e in errs.values()):
            row.status = "WRONG"
            rows.append(row)
            continue
        layer.set_strategy(strategy)
        prepare(row, layer, call)
        rows.append(row)
    fp8_call = None
    if fp8_layer is not None and not backward:
        # The FP8 twin (inference only): each strategy checked against the bf16 naive output
        # (its error is block FP8's own), then timed with the others.
        fp8_call = make_call(fp8_layer)
        for strategy in args.fp8:
            row = Row(name, tokens, routing, mode, strategy, env.world, experts="fp8")
            fp8_layer.set_strategy(strategy)
            with torch.no_grad():
                row.rel_err_vs_naive = {"out": reduce_max(env, rel_err(fp8_call(), results["naive"][0]))}
            if row.rel_err_vs_naive["out"] > args.fp8_tolerance:
                row.status = "WRONG"
            else:
                prepare(row, fp8_layer, fp8_call)
            rows.append(row)
    if getattr(args, "interleave", False):
        # Round-robin: timed call i of every strategy runs back to back, so clock and thermal
        # drift over the case (two runs of the same code path timed one after the other can
        # differ by several percent) falls on all strategies alike. Each strategy follows each
        # other one equally often: a GPU-bound call depends on the call before it (after naive's
        # call, less power-dense, the same code ran faster: docs/benchmarking.md).
        timed = [row for row in rows if row.status == "ok"]
        ctx = torch.no_grad() if not backward else torch.enable_grad()
        with ctx:
            for i in range(args.iters):
                for row in round_order(timed, i):
                    row.layer_object.strategy = row.strategy_object
                    row.times_ms += timer(row.call, 0, 1, env)
        for row in timed:
            row.median_ms = reduce_max(env, statistics.median(row.times_ms))
    if getattr(args, "back_to_back", 0) and not backward and env.cuda:
        # Each strategy's calls back to back (rounds round-robin over the strategies, the median
        # round): the layer's time inside a model's forward, its host time hidden where it can be.
        timed = [row for row in rows if row.status == "ok"]
        rounds = {id(row): [] for row in timed}
        with torch.no_grad():
            for i in range(BACK_TO_BACK_ROUNDS):
                for row in round_order(timed, i):
                    row.layer_object.strategy = row.strategy_object
                    rounds[id(row)].append(time_back_to_back(row.call, args.back_to_back, env))
        for row in timed:
            row.back_to_back_ms = reduce_max(env, statistics.median(rounds[id(row)]))
    # Once more after the timing, against naive's output on the same inputs: strategies that
    # cache work between calls (fused replays CUDA graphs from its second call per token count)
    # are checked on what the timed calls ran, not only on their first call.
    for row in rows:
        if row.status != "ok" or (row.strategy == "naive" and row.experts == "bf16"):
            continue
        row.layer_object.strategy = row.strategy_object
        with torch.no_grad() if not backward else torch.enable_grad():
            err = reduce_max(env, rel_err(row.call(), results["naive"][0]))
        row.rel_err_vs_naive["out_after_timing"] = err
        if err > (args.fp8_tolerance if row.experts == "fp8" else args.tolerance):
            row.status = "WRONG"
    for row in rows:
        row.choice = auto_choice(row.__dict__.get("strategy_object"), tokens, mode)
        for kept in ("strategy_object", "layer_object", "call"):
            row.__dict__.pop(kept, None)
    isolated_peaks(layer, [r for r in rows if r.experts == "bf16"], call, [x, *params], args.warmup, backward, env)
    if fp8_call is not None:
        isolated_peaks(fp8_layer, [r for r in rows if r.experts == "fp8"], fp8_call, [x], args.warmup, False, env,
                       idle="sequential")
    fp8_weight_bytes = (touched_expert_bytes(fp8_layer.config, topk_idx, env)
                        if fp8_call is not None else None)
    for row in rows:
        if row.status != "ok" or row.median_ms is None:
            continue
        fp8 = row.experts == "fp8"
        peak = ceilings.get("fp8_tflops") if fp8 else ceilings["matmul_tflops"]
        row.floor_ms = floor_ms(cfg, tokens, env.world, mode, peak, ceilings["peer_gbps"])
        if row.floor_ms:
            row.x_floor = row.median_ms / row.floor_ms
        if weight_bytes is not None:
            row.weight_bytes = fp8_weight_bytes if fp8 else weight_bytes
            row.decode_floor_ms = decode_floor_ms(row.floor_ms, row.weight_bytes, ceilings.get("hbm_tbps"), env.world,
                                                  ceilings.get("peer_latency_us"))
            if row.decode_floor_ms:
                row.x_decode_floor = row.median_ms / row.decode_floor_ms
        flops = cfg.flops_per_token() * tokens * (3 if backward else 1)
        row.tflops = flops / (row.median_ms * 1e-3) / 1e12
        if row.strategy == "naive" and not fp8:
            naive_ms = row.median_ms
    for row in rows:
        if naive_ms and row.median_ms:
            row.speedup_vs_naive = naive_ms / row.median_ms
    x.requires_grad_(False)
    return rows


# ----------------------------------------------------------------------------- report
def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def label(row: Row) -> str:
    """The row's strategy, marked where it ran the FP8 twin."""
    return row.strategy if row.experts == "bf16" else f"{row.strategy} ({row.experts})"


def markdown_table(rows: list[Row]) -> str:
    head = ("| config | tokens/GPU | routing | mode | strategy | median ms | × floor | × decode floor | vs naive "
            "| TFLOP/s | peak GiB | max rel err vs naive | status | auto's choice |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        err = max(r.rel_err_vs_naive.values()) if r.rel_err_vs_naive else None
        lines.append(
            f"| {r.config} | {r.tokens} | {r.routing} | {r.mode} | {label(r)} | {fmt(r.median_ms, '.3f')} | "
            f"{fmt(r.x_floor, '.2f')} | {fmt(r.x_decode_floor, '.2f')} | {fmt(r.speedup_vs_naive, '.2f')} | "
            f"{fmt(r.tflops, '.0f')} | "
            f"{fmt(r.peak_gib, '.2f')} | {fmt(err, '.1e')} | {r.status} | {r.choice or ''} |"
        )
    return "\n".join(lines)


def git_commit(where: str | None = None) -> str:
    """INTERLACE_COMMIT if set (copies without .git, e.g. the GPU machine), else git's HEAD of the
    checkout at ``where`` (default: this package's), with ``-dirty`` where tracked files differ
    from it: a copy of a working tree whose ``.git`` lags behind its files (as a GPU machine's may
    between calls) must not be recorded as the older commit."""
    if settings().commit:
        return settings().commit
    where = where or os.path.dirname(__file__)

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=where, timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        if not head:
            return "unknown"
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def parse_args(argv=None):
    p = command_parser("bench", "The benchmark harness: the protocol of docs/benchmarking.md, timed on this machine. "
                                "Launch with torchrun --nproc-per-node W for W GPUs (without torchrun: world size 1).")
    p.add_argument("--configs", nargs="+", default=list(PRESETS), help="preset names")
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384], help="tokens per GPU")
    p.add_argument("--routing", nargs="+", default=["random"], choices=ROUTINGS,
                   help="how tokens choose experts: random (the router's top-k over random weights), balanced "
                        "(round robin), skewed (Zipf popularity), local (only experts of the token's own rank)")
    p.add_argument("--strategies", nargs="+", default=["naive", "sequential"],
                   help="strategies to time, name or name:arg (naive is always run: the others are checked "
                        "against it)")
    p.add_argument("--mode", nargs="+", default=["fwd"], choices=["fwd", "fwdbwd"],
                   help="fwd: forward only; fwdbwd: forward and backward")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before the timed ones")
    p.add_argument("--iters", type=int, default=20, help="timed calls per strategy and case, the median reported")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, inputs and forced routing")
    p.add_argument("--interleave", action="store_true",
                   help="time the strategies round-robin (call i of each back to back) instead of one after "
                        "another, so drift over a case falls on all of them alike")
    p.add_argument("--back-to-back", type=int, default=0, metavar="N",
                   help="forward on GPUs: also time N calls issued back to back (back_to_back_ms; 0: off)")
    p.add_argument("--tolerance", type=float, default=2e-2, help="max relative error vs naive (bf16)")
    p.add_argument("--fp8", nargs="+", default=[], metavar="STRATEGY",
                   help="forward: also time the layer with its experts in block-scaled FP8 (the same weights "
                        "quantized) on these strategies (those that run FP8 experts)")
    p.add_argument("--fp8-tolerance", type=float, default=1e-1,
                   help="max relative error of an FP8 row vs the bf16 naive output (block FP8's own: ~5e-2)")
    p.add_argument("--out", default="bench-out", help="folder for results.json and results.md")
    p.add_argument("--small", action="store_true", help="shrink every config (hidden/ffn ÷ 16) for CPU smoke runs")
    args = p.parse_args(argv)
    for s in args.strategies:
        if s.partition(":")[0] not in STRATEGIES:
            p.error(f"unknown strategy {s!r}; available: {', '.join(sorted(STRATEGIES))} "
                    f"(with an argument as name:arg, e.g. pipelined:4, sequential:triton)")
    supported = fp8_strategy_names()
    for s in args.fp8:
        if s.partition(":")[0] not in supported:
            p.error(f"--fp8 {s!r}: the strategies that run FP8 experts are {', '.join(supported)}")
    if args.fp8 and "fwd" not in args.mode:
        p.error("--fp8 times inference calls: it needs --mode fwd")
    if "naive" not in args.strategies:
        args.strategies = ["naive"] + args.strategies  # speedups and checks are against naive
    if args.warmup < 5 or args.iters < 20:
        print("note: docs/benchmarking.md asks for >= 5 warm-up and >= 20 timed calls", file=sys.stderr)
    return args


def bench_config(name: str, small: bool) -> MoEConfig:
    # docs/benchmarking.md: "random" routing is softmax top-k with random router weights, for every
    # config (dsv3-like's sigmoid router costs the same; the protocol fixes softmax).
    cfg = preset(name, router="softmax", route_scale=1.0)
    if small:
        cfg = cfg.with_(hidden=max(cfg.hidden // 16, 16), ffn=max(cfg.ffn // 16, 16),
                        dtype=torch.float32 if not torch.cuda.is_available() else cfg.dtype)
    return cfg


def write_json(out: str, meta: dict, rows: list[Row]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)


def main(argv=None) -> list[Row]:
    args = parse_args(argv)
    env = init_env()
    if not env.cuda:
        print("note: no CUDA device; timing the CPU path (numbers are not comparable to GPU rows)", file=sys.stderr)
    ceilings = {"matmul_tflops": measure_matmul_tflops(env), "peer_gbps": measure_peer_gbps(env),
                "hbm_tbps": measure_hbm_read_tbps(env), "peer_latency_us": measure_peer_latency_us(env)}
    if args.fp8:
        ceilings["fp8_tflops"] = measure_fp8_matmul_tflops(env)
    if env.cuda:
        for peak in ("matmul_tflops", "fp8_tflops"):  # the slowest rank's peaks
            if ceilings.get(peak) is not None:
                ceilings[peak] = reduce_max(env, -ceilings[peak]) * -1
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": torch.cuda.get_device_name() if env.cuda else platform.processor() or "cpu",
        "sm_count": torch.cuda.get_device_properties(env.device).multi_processor_count if env.cuda else None,
        "world": env.world, "torch": torch.__version__,
        "command": " ".join(sys.argv), "small": args.small, "ceilings": ceilings,
    }
    if env.rank == 0:
        print(f"# interlace bench — {meta['device']} ×{env.world}, commit {meta['commit']}, torch {meta['torch']}")
        print(f"# ceilings: bf16 matmul 8192³ {fmt(ceilings['matmul_tflops'], '.0f')} TFLOP/s, "
              f"peer copy GPU0→GPU1 {fmt(ceilings['peer_gbps'], '.0f')} GB/s, "
              f"HBM read {fmt(ceilings['hbm_tbps'], '.2f')} TB/s, peer latency "
              f"{fmt(ceilings['peer_latency_us'], '.1f')} µs"
              + (f", e4m3 matmul 8192³ {fmt(ceilings['fp8_tflops'], '.0f')} TFLOP/s" if args.fp8 else ""), flush=True)
    rows: list[Row] = []
    for name in args.configs:
        cfg = bench_config(name, args.small)
        layer = MoELayer(cfg, group=env.group, strategy="naive", seed=args.seed, device=env.device)
        # The FP8 twin: the same seed's weights, quantized (MoELayer's seeded init draws the dense
        # weights first), and the same router.
        fp8_layer = (MoELayer(cfg.with_(expert_quant="fp8"), group=env.group, strategy=args.fp8[0], seed=args.seed,
                              device=env.device) if args.fp8 else None)
        for mode in args.mode:
            for tokens in args.tokens:
                for routing in args.routing:
                    case_rows = run_case(layer, name, tokens, routing, mode, args.strategies, env, args, ceilings,
                                         fp8_layer)
                    rows.extend(case_rows)
                    if env.rank == 0:
                        for r in case_rows:
                            print(f"  {r.config:14s} T={r.tokens:<6d} {r.routing:8s} {r.mode:6s} {label(r):17s} "
                                  f"{fmt(r.median_ms, '8.3f')} ms  ×floor {fmt(r.x_floor, '5.2f')}  "
                                  f"×decode {fmt(r.x_decode_floor, '5.2f')}  "
                                  f"vs naive {fmt(r.speedup_vs_naive, '5.2f')}  {r.status}"
                                  + (f"  auto ran {r.choice}" if r.choice else ""), flush=True)
        del layer, fp8_layer
        if env.cuda:
            torch.cuda.empty_cache()
        if env.rank == 0:  # after every config: a run cut short by a time limit keeps its rows
            write_json(args.out, meta, rows)
    if env.rank == 0:
        table = markdown_table(rows)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(f"{meta['date']} · {meta['device']} ×{env.world} · commit {meta['commit']} · "
                    f"matmul {fmt(ceilings['matmul_tflops'], '.0f')} TFLOP/s · peer {fmt(ceilings['peer_gbps'], '.0f')} GB/s\n\n")
            f.write(table + "\n")
        print()
        print(table)
    if dist.is_initialized():
        dist.barrier()
    return rows


if __name__ == "__main__":
    main()
