"""Single-GPU check and timing of the whole expert block: torch path vs interlace's Triton kernels.

    python benchmarks/bench_expert_kernels.py [--tokens 4096 16384] [--world 2] [--configs ...] [--json F]

The block is what ``sequential`` runs at world size 1 on one GPU's share of a W-GPU layer:
T tokens routed to k of the E/W local experts ("balanced": every expert gets T·k/(E/W) rows,
tokens in random order), dispatch gather, GEMM0 + activation, GEMM1, weighted top-k combine
(fp32, deterministic). torch path = gather kernel + ``torch._grouped_mm`` + SwiGLU kernel +
``torch._grouped_mm`` + combine; Triton path = interlace's persistent GEMM0 with the gather
fused into its A load and the activation in its epilogue, GEMM1, the same combine kernel.

Correctness: forward and backward (dx, dW_up, dW_down, d routing weights) of both bf16 paths
against an fp32 per-expert loop, fresh random inputs; a Triton error more than 2× the torch
path's (+1e-3) marks the row FAIL. Timing: ``triton.testing.do_bench`` medians of forward
(no grad) and forward+backward, ≥ 20 timed calls (``--bench-rounds R``: R rounds alternating
torch and Triton, the median over the rounds: one process's torch-then-Triton order can move rows
between passes); TFLOP/s of the three expert GEMMs (×3 with backward); the
backward's TFLOP/s is 2× the forward FLOPs over (fwd+bwd − fwd) time. The Triton block's training
forward (grad enabled: it stores h and the activations) is timed too, and "bwd/fwd (f+b − train fwd)"
takes the backward as f+b minus it: the backward pass itself, where f+b − fwd also charges it what
storing h costs the training forward over the inference one. (Timing ``backward`` alone between CUDA
events after a synchronize measures the host's launches on the small rows instead.) "first s" is the first
Triton forward+backward call of the row (compiles on the first row of a config set).
``--paired N`` times instead call by call: N iterations, each running the five timed calls once in a
rotated order (medians per call; the rounds are then not run), so that every number of a row saw the
same clock.
``--breakdown`` adds a table of the Triton path's kernels timed one by one (forward GEMMs, the
four backward kernels). ``--profile-fwd`` adds, per backend, the GPU µs per forward call of each
kernel (torch.profiler over 10 no-grad calls), so the two forwards can be compared kernel by kernel;
``--profile-fb`` the same for forward+backward calls.

``--tables NAME=DIR …`` instead A/Bs sets of tuning tables in one process: per row, ``--rounds``
interleaved rounds, each timing the Triton block's forward and forward+backward once per set
(tables from DIR through ``$INTERLACE_TUNING_DIR``; an empty DIR: the packaged tables), then the
medians per set. Drift between processes hits every set alike there.
``--options NAME=[FIELD=VALUE[/FIELD=VALUE]] …`` does the same for sets of
:class:`~interlace.kernels.expert_gemm.configs.ExpertKernelOptions` (FIELD ``gemm0``, ``gemm1``,
``bwd_act``, ``bwd_dx``, ``wgrad``: a config as ``bm,bn,bk,warps,stages[,group_m][,field=value...]``;
``tma``: 0 or 1; e.g. ``table= flat1=gemm1=128,256,64,8,3,a_tma=1,persistent=2``) and reports whether
every set's output and gradients are bitwise equal to the first set's.
"""

import argparse
import json
import os
import statistics
import time

import torch
import triton

from interlace.tools.bench import bench_config, squared_error_sums
from interlace.config import PRESETS
from interlace.experts import init_expert_weights
from interlace.kernels.activation import activation_reference
from interlace.env import refresh as refresh_environment, settings
from interlace.kernels.expert_gemm.autograd import TritonExpertFFN
from interlace.kernels.expert_gemm.backward import backward_steps
from interlace.kernels.expert_gemm.configs import ExpertKernelOptions, choose_backward_configs, choose_configs
from interlace.kernels.expert_gemm.forward import expert_ffn_triton
from interlace.tuning import tables as tuning
from interlace.kernels.routing_index import build_dispatch_index
from interlace.kernels.rows import CombineRows, DispatchRows
from interlace.strategies.sequential import expert_ffn


def balanced_routing(T: int, k: int, E: int, dev):
    """(T, k) expert ids, each expert chosen T·k/E times (±1), distinct per token, tokens shuffled;
    fp32 routing weights (softmax of random logits)."""
    perm = torch.randperm(T, device=dev)
    idx = ((perm[:, None] * k + torch.arange(k, device=dev)[None, :]) % E).to(torch.int32)
    weights = torch.softmax(torch.randn(T, k, device=dev), dim=-1)
    return idx, weights


def block(backend: str, x, w_up, w_down, weights, index, activation: str, options: ExpertKernelOptions | None = None):
    """The expert block x (T, N) → (T, N) on one backend (``index`` from build_dispatch_index;
    ``options``: the Triton kernels')."""
    row_of_assignment, assignment_of_row, ends, rows = index
    k = row_of_assignment.shape[1]
    if backend == "triton":
        y = TritonExpertFFN.apply(x, w_up, w_down, assignment_of_row, k, rows, ends, activation, row_of_assignment,
                                  options)
    else:
        y = expert_ffn(DispatchRows.apply(x, assignment_of_row, row_of_assignment), w_up, w_down, ends, activation)
    return CombineRows.apply(y, weights, row_of_assignment, x.dtype)


def block_grads(backend: str, cfg, x, w_up, w_down, weights, index, grad, options=None) -> list[torch.Tensor]:
    """One backend's block output and its gradients (x, W_up, W_down, routing weights) for ``grad``."""
    leaves = [t.detach().requires_grad_() for t in (x, w_up, w_down, weights)]
    out = block(backend, *leaves, index, cfg.activation, options)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def reference_block(x, w_up, w_down, weights, index, activation: str, first: int = 0):
    """fp32 per-expert loop with autograd (the leaves are fp32 copies). ``w_up``/``w_down`` may hold
    a slice of the experts, those from ``first`` on: the result is then their contribution alone
    (the other experts' rows count as zero)."""
    row_of_assignment, assignment_of_row, ends, rows = index
    k = row_of_assignment.shape[1]
    bounds = [0] + ends.tolist()
    lo, hi = bounds[first], bounds[first + w_up.shape[0]]
    ys = []
    for e in range(w_up.shape[0]):
        start, end = bounds[first + e], bounds[first + e + 1]
        xs = x[assignment_of_row[start:end].long() // k]
        ys.append(activation_reference(xs @ w_up[e].t(), activation) @ w_down[e].t())
    pad = [x.new_zeros(lo, x.shape[1]), x.new_zeros(bounds[-1] - hi, x.shape[1])]
    y = torch.cat([pad[0]] + ys + [pad[1]])
    return (y[row_of_assignment.long()] * weights[..., None]).sum(1)


def check(cfg, x, w_up, w_down, weights, index, grad, group_bytes: float = 2e9):
    """Max relative errors vs fp32 of (out, dx, dW_up, dW_down, d weights) for torch and triton.

    The fp32 reference runs over groups of experts whose fp32 weights take at most ``group_bytes``
    and is compared group by group: fp32 copies and gradients of every expert at once, beside
    both backends' gradients, are more than an 80 GB H100 holds at dsv3-like 16384."""
    got = {backend: block_grads(backend, cfg, x, w_up, w_down, weights, index, grad)
           for backend in ("torch", "triton")}
    E = w_up.shape[0]
    per_expert = (w_up[0].numel() + w_down[0].numel()) * 4
    group = max(1, min(E, int(group_bytes // per_expert)))
    sq = {b: [[0.0, 0.0] for _ in range(5)] for b in got}  # per tensor: Σ diff², Σ ref²
    whole = [torch.zeros(x.shape, device=x.device), torch.zeros(x.shape, device=x.device),
             torch.zeros(weights.shape, device=x.device)]  # out, dx, d weights: sums over the groups

    def add(b, i, mine, ref):
        d, r = squared_error_sums(mine, ref)
        sq[b][i][0] += d
        sq[b][i][1] += r

    for first in range(0, E, group):
        sl = slice(first, min(E, first + group))
        leaves32 = [t.detach().float().requires_grad_() for t in (x, w_up[sl], w_down[sl], weights)]
        part = reference_block(*leaves32, index, cfg.activation, first=first)
        part.backward(grad.float())
        for acc, t in zip(whole, (part.detach(), leaves32[0].grad, leaves32[3].grad)):
            acc += t
        for b in got:
            add(b, 2, got[b][2][sl], leaves32[1].grad)
            add(b, 3, got[b][3][sl], leaves32[2].grad)
        del leaves32, part
    for b in got:
        for i, ref in zip((0, 1, 4), whole):
            add(b, i, got[b][i], ref)
    return {b: [d**0.5 / max(r**0.5, 1e-30) for d, r in sq[b]] for b in got}


def bench_ms(fn, grad_to_none=None) -> float:
    """``do_bench`` median over at least 20 timed calls after at least 5 warm-ups (BENCHMARKS.md)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end), 1e-3)
    return triton.testing.do_bench(fn, warmup=max(25, 5 * est), rep=max(100, 20 * est), grad_to_none=grad_to_none,
                                   return_mode="median")


def time_backend(backend, cfg, x, w_up, w_down, weights, index, grad, train_forward: bool = False, options=None):
    """(fwd ms, fwd+bwd ms) medians; ``train_forward``: also the training forward's (grad enabled:
    it stores what the backward reads, and its graph is dropped), so that f+b minus it is the
    backward's time in the same steady state. ``options``: the Triton kernels'."""
    def fwd():
        with torch.no_grad():
            return block(backend, x, w_up, w_down, weights, index, cfg.activation, options)

    leaves = [t.detach().requires_grad_() for t in (x, w_up, w_down, weights)]

    def fwd_train():
        block(backend, *leaves, index, cfg.activation, options)

    def fwd_bwd():
        block(backend, *leaves, index, cfg.activation, options).backward(grad)

    t_f = bench_ms(fwd)
    t_fb = bench_ms(fwd_bwd, grad_to_none=leaves)
    return (t_f, t_fb, bench_ms(fwd_train)) if train_forward else (t_f, t_fb)


def paired_times(cfg, x, w_up, w_down, weights, index, grad, calls: int, warmup: int = 3) -> dict:
    """``--paired N``: N iterations, each running every timed call once (torch forward and forward+backward,
    the Triton forward, training forward and forward+backward) in an order rotated per iteration, each
    between CUDA events after a 256 MB L2 flush, as ``do_bench`` times one call; {name: [ms per call]}.
    The five see the same clock: under the H100's 700 W cap the SM clock moves between phases of one
    process, which separate ``do_bench`` blocks (one per backend and kind) each catch apart."""
    leaves = {b: [t.detach().requires_grad_() for t in (x, w_up, w_down, weights)] for b in ("torch", "triton")}

    def fwd(b):
        with torch.no_grad():
            block(b, x, w_up, w_down, weights, index, cfg.activation)

    def train(b):
        block(b, *leaves[b], index, cfg.activation)  # the graph is dropped on return

    def fwd_bwd(b):
        block(b, *leaves[b], index, cfg.activation).backward(grad)

    runs = {"torch_fwd": lambda: fwd("torch"), "torch_fb": lambda: fwd_bwd("torch"),
            "triton_fwd": lambda: fwd("triton"), "triton_train_fwd": lambda: train("triton"),
            "triton_fb": lambda: fwd_bwd("triton")}
    names = list(runs)
    cache = torch.empty(64 * 2**20, dtype=torch.int32, device=x.device)
    events = {n: [] for n in names}
    for i in range(warmup + calls):
        for n in names[i % len(names):] + names[:i % len(names)]:
            cache.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runs[n]()
            end.record()
            if i >= warmup:
                events[n].append((start, end))
            for leaf in leaves["torch"] + leaves["triton"]:
                leaf.grad = None  # (host only: the gradients' memory returns once the stream is past them)
    torch.cuda.synchronize()
    return {n: [s.elapsed_time(e) for s, e in ev] for n, ev in events.items()}


def breakdown(cfg, x, w_up, w_down, index):
    """{kernel: (ms, TFLOP/s)} of the Triton path's GEMM kernels, timed one by one."""
    row_of_assignment, assignment_of_row, ends, rows = index
    k = row_of_assignment.shape[1]

    def forward(store_h=False):
        return expert_ffn_triton(x, assignment_of_row, k, rows, w_up, w_down, ends, cfg.activation,
                                 store_h=store_h, return_act=True)

    _, h, act = forward(store_h=True)
    dy = torch.randn(rows, cfg.hidden, device=x.device).to(x.dtype)
    fwd_flops = 2 * rows * cfg.hidden * cfg.ffn * (3 if cfg.activation == "swiglu" else 2)
    steps = [("fwd_gemms", fwd_flops, forward)]
    steps += backward_steps(dy, x, assignment_of_row, k, w_up, w_down, ends, cfg.activation, h, act)[1]
    out = {}
    for name, flops, launch in steps:
        ms = bench_ms(launch)
        out[name] = (ms, flops / ms / 1e9)
    return out


def profile_block(backend, cfg, x, w_up, w_down, weights, index, grad=None, calls: int = 10):
    """One backend's block under torch.profiler over ``calls`` calls (the no-grad forward, or with
    ``grad`` forward+backward): ``{"kernels": [[name, GPU µs per call], …] in launch order,
    "wall_us": µs per call between CUDA events around the calls}``. The order tells apart kernels
    that share a name (torch's grouped GEMMs are all one CUTLASS template); wall minus the sum is
    time the GPU had no kernel of the block running."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    leaves = [t.detach().requires_grad_(grad is not None) for t in (x, w_up, w_down, weights)]

    def call():
        if grad is None:
            with torch.no_grad():
                return block(backend, *leaves, index, cfg.activation)
        for t in leaves:
            t.grad = None
        block(backend, *leaves, index, cfg.activation).backward(grad)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(calls):
            call()
        end.record()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per_call = len(kernels) // calls
    seq = []
    if per_call * calls == len(kernels):  # the same kernels every call: medians per launch position
        for i in range(per_call):
            us = [kernels[c * per_call + i].time_range.elapsed_us() for c in range(calls)]
            seq.append([kernels[i].name[:50], statistics.median(us)])
    else:  # not one sequence per call: totals per name
        totals = {}
        for e in kernels:
            totals[e.name[:50]] = totals.get(e.name[:50], 0.0) + e.time_range.elapsed_us() / calls
        seq = sorted(([k, v] for k, v in totals.items()), key=lambda kv: -kv[1])
    return {"kernels": seq, "wall_us": start.elapsed_time(end) * 1e3 / calls}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--world", type=int, default=2, help="experts per GPU = E / world")
    p.add_argument("--configs", nargs="+", default=list(PRESETS))
    p.add_argument("--no-backward", action="store_true", help="forward only (no check or timing of backward)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--breakdown", action="store_true", help="also time the Triton path's kernels one by one")
    p.add_argument("--profile-fwd", action="store_true", help="also list each backend's forward kernels (GPU µs)")
    p.add_argument("--profile-fb", action="store_true",
                   help="also list each backend's forward+backward kernels (GPU µs)")
    p.add_argument("--seed", type=int, default=0, help="seeds the routing permutation, tokens and gradients")
    p.add_argument("--tables", nargs="+", default=None, metavar="NAME=DIR",
                   help="A/B these sets of tuning tables instead (interleaved rounds, Triton block only)")
    p.add_argument("--options", nargs="+", default=None, metavar="NAME=[FIELD=VALUE[/FIELD=VALUE]]",
                   help="A/B these sets of expert kernel options instead (interleaved rounds, Triton block only; "
                        "the gradients of every set are compared with the first's, bitwise)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the --tables or --options A/B")
    p.add_argument("--bench-rounds", type=int, default=1,
                   help="interleaved torch/Triton rounds per row (medians over them; the order alternates)")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="time instead with N interleaved iterations of every call, one call at a time (medians)")
    args = p.parse_args()
    if args.paired and (args.no_backward or args.paired < 1):
        p.error("--paired N times the forward+backward calls too: it needs N ≥ 1 and no --no-backward")
    if args.tables and args.options:
        p.error("--tables and --options are two separate A/Bs")
    if args.tables or args.options:
        return ab_sets(args)
    results = []
    for name, cfg, T, w_up, w_down, weights, index, x, grad in bench_rows(args):
        row = {"config": name, "tokens": T, "rows": T * cfg.top_k}
        try:
            row["configs"] = (choose_configs(x, w_down, T * cfg.top_k, cfg.activation)[2] + "; "
                              + choose_backward_configs(x, w_down, T * cfg.top_k, cfg.activation)[3])
            leaves = [t.detach().requires_grad_(not args.no_backward) for t in (x, w_up, w_down, weights)]
            t0 = time.perf_counter()
            out = block("triton", *leaves, index, cfg.activation)
            if not args.no_backward:
                out.backward(grad)
            torch.cuda.synchronize()
            row["first_s"] = time.perf_counter() - t0
            del out, leaves
            if not args.no_backward:
                errs = check(cfg, x, w_up, w_down, weights, index, grad)
                row["err_torch"], row["err_triton"] = errs["torch"], errs["triton"]
                row["ok"] = all(t <= 2 * r + 1e-3 for t, r in zip(errs["triton"], errs["torch"]))
            flops = 2 * T * cfg.top_k * cfg.hidden * cfg.ffn * (3 if cfg.activation == "swiglu" else 2)
            samples = {"torch": [], "triton": [], "triton_train_fwd": []}
            if args.paired:
                calls = paired_times(cfg, x, w_up, w_down, weights, index, grad, args.paired)
                row["paired_calls"] = calls
                samples = {"torch": [(statistics.median(calls["torch_fwd"]), statistics.median(calls["torch_fb"]))],
                           "triton": [(statistics.median(calls["triton_fwd"]),
                                       statistics.median(calls["triton_fb"]))],
                           "triton_train_fwd": [statistics.median(calls["triton_train_fwd"])]}
            for r in range(0 if args.paired else args.bench_rounds):  # interleaved, the order alternating per round
                for backend in ("torch", "triton") if r % 2 == 0 else ("triton", "torch"):
                    if args.no_backward:
                        def fwd(b=backend):
                            with torch.no_grad():
                                return block(b, x, w_up, w_down, weights, index, cfg.activation)
                        samples[backend].append((bench_ms(fwd), None))
                    else:
                        t = time_backend(backend, cfg, x, w_up, w_down, weights, index, grad,
                                         train_forward=backend == "triton")
                        samples[backend].append(t[:2])
                        if backend == "triton":
                            samples["triton_train_fwd"].append(t[2])
            if samples["triton_train_fwd"]:
                row["triton_train_fwd"] = statistics.median(samples["triton_train_fwd"])
            del samples["triton_train_fwd"]
            for backend, ts in samples.items():
                fb = None if args.no_backward else statistics.median(t[1] for t in ts)
                row[backend] = (statistics.median(t[0] for t in ts), fb)
                row[f"{backend}_rounds"] = ts
            row["flops"] = flops
            if args.breakdown:
                row["kernels"] = breakdown(cfg, x, w_up, w_down, index)
            if args.profile_fwd:
                row["fwd_profile"] = {b: profile_block(b, cfg, x, w_up, w_down, weights, index)
                                      for b in ("torch", "triton")}
            if args.profile_fb and not args.no_backward:
                row["fb_profile"] = {b: profile_block(b, cfg, x, w_up, w_down, weights, index, grad)
                                     for b in ("torch", "triton")}
        except Exception as err:  # report the row and go on with the others
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"{name} {T}: {row['error']}", flush=True)
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)


def bench_rows(args):
    """Every bench row's data, seeded (the same rows in every process, so a spread between processes
    is not the data's): (config name, cfg, T, w_up, w_down, routing weights, dispatch index, x, grad)."""
    dev = torch.device("cuda")
    torch.manual_seed(args.seed)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    for name in args.configs:
        cfg = bench_config(name, small=False)
        E_local = cfg.num_experts // args.world
        w_up, w_down = init_expert_weights(cfg, range(E_local), 0, dev)
        for T in args.tokens:
            idx, weights = balanced_routing(T, cfg.top_k, E_local, dev)
            roa, aor, _, ends = build_dispatch_index(idx, E_local, None)
            x = torch.randn(T, cfg.hidden, device=dev).to(cfg.dtype)
            grad = torch.randn(T, cfg.hidden, device=dev).to(cfg.dtype)
            yield name, cfg, T, w_up, w_down, weights, (roa, aor, ends, T * cfg.top_k), x, grad
            del x, grad, weights
            torch.cuda.empty_cache()
        del w_up, w_down
        torch.cuda.empty_cache()


def use_tables(directory: str) -> None:
    """Lookups from now on read ``directory``'s tables first (empty: the packaged ones only)."""
    if directory:
        os.environ["INTERLACE_TUNING_DIR"] = directory
    else:
        os.environ.pop("INTERLACE_TUNING_DIR", None)
    refresh_environment()
    tuning.clear_cache()  # also expires the expert block's memo of its configs


def parse_options(spec: str) -> ExpertKernelOptions:
    """``FIELD=VALUE[/FIELD=VALUE]`` → :class:`ExpertKernelOptions` (configs as
    :func:`interlace.tuning.tables.parse_config` reads them, ``tma`` 0 or 1; empty: the defaults)."""
    fields = {}
    for item in filter(None, spec.split("/")):
        name, _, value = item.partition("=")
        fields[name] = bool(int(value)) if name == "tma" else tuning.parse_config(value)
    return ExpertKernelOptions(**fields)


def ab_sets(args) -> None:
    """Interleaved A/B of table sets (``--tables``) or kernel option sets (``--options``): per row
    and round, the Triton block timed once per set."""
    specs = [(spec.split("=", 1) + [""])[:2] for spec in (args.tables or args.options)]
    if args.tables:
        sets = [(label, setting, None) for label, setting in specs]
    else:
        sets = [(label, None, parse_options(setting)) for label, setting in specs]

    def apply(directory):
        if directory is not None:
            use_tables(directory)
    results = []
    for name, cfg, T, w_up, w_down, weights, index, x, grad in bench_rows(args):
        row = {"config": name, "tokens": T, "sets": {}}
        times = {label: ([], []) for label, _, _ in sets}
        for _ in range(args.rounds):
            for label, directory, options in sets:
                apply(directory)
                f, fb = time_backend("triton", cfg, x, w_up, w_down, weights, index, grad, options=options)
                times[label][0].append(f)
                times[label][1].append(fb)
        reference = None
        for label, directory, options in sets:
            apply(directory)
            source = (choose_configs(x, w_down, T * cfg.top_k, cfg.activation, options=options)[2] + "; "
                      + choose_backward_configs(x, w_down, T * cfg.top_k, cfg.activation, options=options)[3])
            f, fb = times[label]
            row["sets"][label] = {"fwd": f, "fb": fb, "configs": source}
            if args.options:  # e.g. another kernel form of the same sums: the same bits?
                got = block_grads("triton", cfg, x, w_up, w_down, weights, index, grad, options)
                if reference is None:
                    reference = got
                else:
                    row["sets"][label]["bitwise_equal_to_first"] = all(torch.equal(a, b)
                                                                       for a, b in zip(reference, got))
                del got
        del reference
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    first = sets[0][0]
    print(f"\nmedian ms over {args.rounds} interleaved rounds; ratio = {first} ÷ set (> 1: the set is faster)\n")
    print("| config | tokens | " + " | ".join(f"{lb} fwd | {lb} bwd" for lb, _, _ in sets) + " | "
          + " | ".join(f"fwd {first}/{lb} | bwd {first}/{lb}" for lb, _, _ in sets[1:]) + " |")
    print("|---|---|" + "---|---|" * len(sets) + "---|---|" * (len(sets) - 1))
    for r in results:
        med = {lb: (statistics.median(v["fwd"]), statistics.median(v["fb"]) - statistics.median(v["fwd"]))
               for lb, v in r["sets"].items()}
        cells = [f"{med[lb][0]:.3f} | {med[lb][1]:.3f}" for lb, _, _ in sets]
        cells += [f"{med[first][0] / med[lb][0]:.3f} | {med[first][1] / med[lb][1]:.3f}" for lb, _, _ in sets[1:]]
        same = [str(r["sets"][lb]["bitwise_equal_to_first"]) for lb, _, _ in sets[1:]
                if "bitwise_equal_to_first" in r["sets"][lb]]
        print(f"| {r['config']} | {r['tokens']} | " + " | ".join(cells) + " |" + (" bitwise equal: " + ", ".join(same)
                                                                                 if same else ""))


def spread(values) -> str:
    """``median [p10, p90]`` of a list of ratios."""
    q = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else [values[0]] * 9
    return f"{statistics.median(values):.3f} [{q[0]:.3f}, {q[-1]:.3f}]"


def print_table(results):
    print("\n| config | tokens | torch fwd ms | triton fwd ms | fwd speedup | torch TFLOP/s | triton TFLOP/s | "
          "torch f+b ms | triton f+b ms | f+b speedup | triton bwd TFLOP/s | bwd/fwd | triton train fwd ms | "
          "bwd/fwd (f+b − train fwd) | max err torch | max err triton | check | first s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['config']} | {r['tokens']} | error: {r['error'][:80]} |")
            continue
        (tf, tfb), (xf, xfb), F = r["torch"], r["triton"], r["flops"]
        cells = [r["config"], r["tokens"], f"{tf:.3f}", f"{xf:.3f}", f"{tf / xf:.2f}", f"{F / tf / 1e9:.0f}",
                 f"{F / xf / 1e9:.0f}"]
        if tfb is not None:
            bwd_tflops = 2 * F / max(xfb - xf, 1e-9) / 1e9
            train = r.get("triton_train_fwd")
            bwd = xfb - train if train else None
            cells += [f"{tfb:.3f}", f"{xfb:.3f}", f"{tfb / xfb:.2f}", f"{bwd_tflops:.0f}",
                      f"{bwd_tflops / (F / xf / 1e9):.2f}", f"{train:.3f}" if train else "-",
                      f"{2 * xf / bwd:.2f}" if bwd else "-", f"{max(r['err_torch']):.1e}",
                      f"{max(r['err_triton']):.1e}", "ok" if r["ok"] else "FAIL"]
        else:
            cells += ["-"] * 10
        cells.append(f"{r['first_s']:.1f}")
        print("| " + " | ".join(str(c) for c in cells) + " |")
    paired = [r for r in results if "paired_calls" in r]
    if paired:
        print("\nTimed call by call (--paired): the table's ms are medians of the calls; here the ratios of each "
              "iteration's own calls, median [p10, p90] over the iterations:\n")
        print("| config | tokens | calls | fwd speedup | f+b speedup | bwd/fwd (f+b − train fwd) |")
        print("|---|---|---|---|---|---|")
        for r in paired:
            c = r["paired_calls"]
            its = range(len(c["triton_fb"]))
            cols = [[c["torch_fwd"][i] / c["triton_fwd"][i] for i in its],
                    [c["torch_fb"][i] / c["triton_fb"][i] for i in its],
                    [2 * c["triton_fwd"][i] / (c["triton_fb"][i] - c["triton_train_fwd"][i]) for i in its]]
            print(f"| {r['config']} | {r['tokens']} | {len(its)} | "
                  + " | ".join(spread(v) for v in cols) + " |")
    for r in results:
        for key, what in (("fwd_profile", "forward"), ("fb_profile", "forward+backward")):
            for backend, prof in r.get(key, {}).items():
                busy = sum(us for _, us in prof["kernels"])
                print(f"\n{r['config']} {r['tokens']} {backend} {what}, GPU µs per call in launch order "
                      f"(sum {busy:.1f}, wall {prof['wall_us']:.1f}, idle {prof['wall_us'] - busy:.1f}):")
                for name, us in prof["kernels"]:
                    print(f"  {us:9.1f}  {name}")
    rows = [r for r in results if "kernels" in r]
    if rows:
        names = list(rows[0]["kernels"])
        print("\nTriton kernels one by one, ms (TFLOP/s):\n")
        print("| config | tokens | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
        for r in rows:
            print(f"| {r['config']} | {r['tokens']} | "
                  + " | ".join(f"{r['kernels'][n][0]:.3f} ({r['kernels'][n][1]:.0f})" for n in names) + " |")


if __name__ == "__main__":
    main()
