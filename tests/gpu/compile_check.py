"""GPU check of ``torch.compile(fullgraph=True)``: a stack of MoE layers compiled against eager.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc-per-node 2 tests/gpu/compile_check.py [--tokens 4096] [--layers 4]

Per strategy (sequential, fused, fused:train, auto): the model ``x → x + moe_i(norm(x))`` for
``--layers`` layers (Qwen3-30B-A3B's shape, bf16, experts sharded over the ranks) compiled with
``fullgraph=True`` (inductor) and run eagerly on the same weights and inputs; a training step
(forward + backward of a fixed loss) of each, and of the same model in fp32 (the bf16 weights
exactly, strategy ``sequential``, TF32 off): the reference ``ref``.

Checks, per strategy:

* routing: each layer's compiled router, given the eager run's input of that layer, picks exactly
  the experts the eager router picks (the router's Triton top-k is the op ``interlace::route_topk``
  under compile); the stack's own compiled and eager runs are reported (tokens routed differently,
  inputs of the router that differ): those can differ only where the code around the layers
  (RMSNorm, residual adds) rounds differently, compiled;
* accuracy: output and the gradients of the input and every parameter, for each quantity
  ``rel(compiled, ref) ≤ C · rel(eager, ref) + A`` (relative ‖·‖₂), ``C``, ``A`` below;
* time, eager and compiled, of a training step and of a forward under no_grad, two ways: steps
  back to back (``--iters`` of them between CUDA events, as a training loop runs them: a step's
  host work overlaps the GPU's tail of the step before), and one step alone after a barrier
  (median of ``--iters``; the GPU idles until the host issues the first kernel, so a compiled
  step's fixed host cost, Dynamo's guards and AOTAutograd's wrappers, counts in full).

Prints per strategy the times, the routing counts and each quantity's three distances; exits non-zero when a check fails or a compiled step (training or
forward) back to back takes longer than ``--max-ratio`` × eager's. First, the forward of the stack with
each MoE layer an opaque stand-in (what surrounds the layers), eager and compiled; each strategy's
forward ratio is then reported also less those times (the layers' part).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from interlace import MoELayer, preset
from interlace.parallel import release_shared_buffers

# Tolerance (docs/architecture.md, "Under torch.compile"). A bf16 model differs from its fp32
# twin by the bf16 roundings of its activations (unit roundoff u = 2^-8 each) and, through them,
# by the tokens whose k-th and (k+1)-th experts are nearer than those roundings move the router's
# input (a token routed otherwise changes its row, and the router's and those experts' gradients,
# by O(1) of its own share). Eager and compiled are two such bf16 models with the same roundings
# inside the layer (the strategy runs eagerly in the op; the router's kernels are the same ops);
# compiled code rounds what surrounds the layer at most as often as eager (inductor fuses RMSNorm
# and the residual add in fp32 registers). So compiled is as far from the fp32 model as eager,
# up to the sampling spread of those errors: C = 1.5, and one more bf16 rounding of the quantity
# where eager's own error is below it, A = u = 2^-8. Compiled vs eager directly is no criterion:
# one token routed otherwise at a near-tie moves the router gradient by ~sqrt(1/T) relative.
C = 1.5
A = 2.0**-8


# An opaque stand-in for an MoE layer (an op inductor cannot see into, as interlace's): the stack
# with it instead of the layers times what surrounds them, eager and compiled.
_LIB = torch.library.Library("compile_check", "FRAGMENT")
_LIB.define("stand_in(Tensor h) -> Tensor")
_LIB.impl("stand_in", lambda h: h.mul(0.5), "CompositeExplicitAutograd")
_LIB._register_fake("stand_in", lambda h: torch.empty_like(h))


class Stack(nn.Module):
    """``x → x + moe_i(norm(x))``; ``strategy`` None: each MoE layer the opaque ``stand_in``."""

    def __init__(self, strategy: str | None, layers: int, max_tokens: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        cfg = preset("qwen3-30b-a3b").with_(dtype=dtype)
        self.norms = nn.ModuleList(nn.RMSNorm(cfg.hidden, device="cuda", dtype=cfg.dtype) for _ in range(layers))
        if strategy is None:
            self.moes = [torch.ops.compile_check.stand_in] * layers
        else:
            opts = {"max_tokens": max_tokens} if strategy.startswith("fused") else {}
            self.moes = nn.ModuleList(MoELayer(cfg, strategy=strategy, seed=i, strategy_options=opts)
                                      for i in range(layers))
        self.taps: list[torch.Tensor] = []

    def forward(self, x):
        taps = []
        for norm, moe in zip(self.norms, self.moes):
            h = norm(x)
            taps.append(h.detach())  # each layer's input (the router's), for the routing report
            x = x + moe(h)
        self.taps = taps
        return x


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if torch.isfinite(a).all() else float("inf")


def step(fn, model, x, grad):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = fn(x)
    out.backward(grad)
    return out.detach(), [x.grad] + [p.grad for p in model.parameters()], [t.clone() for t in model.taps]


def routed_differently(moe, a, b):
    """Tokens whose set of k experts differs between router inputs a and b."""
    with torch.no_grad():
        ia, ib = (moe.router(t, fused=True)[0].sort(dim=1).values for t in (a, b))
    return int((ia != ib).any(dim=1).sum())


def median_ms(bodies, iters: int) -> list[tuple[float, float]]:
    """Per body of ``bodies``: (median GPU ms, median host ms to enqueue) of one call after a
    barrier, over ``iters`` calls, the bodies interleaved."""
    times, host = [[] for _ in bodies], [[] for _ in bodies]
    for _ in range(iters):
        for i, body in enumerate(bodies):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            body()
            end.record()
            host[i].append((time.perf_counter() - t0) * 1e3)
            end.synchronize()
            times[i].append(start.elapsed_time(end))
    return [(sorted(t)[len(t) // 2], sorted(h)[len(h) // 2]) for t, h in zip(times, host)]


def back_to_back_ms(bodies, iters: int, rounds: int = 3) -> list[float]:
    """GPU ms per call of each of ``bodies`` run ``iters`` times back to back, as a training loop
    runs its steps (each step's host work overlaps the GPU's tail of the one before): one barrier,
    CUDA events around all ``iters`` calls; the median of ``rounds`` rounds, the bodies
    interleaved within each round (so a drift of the clocks over the run favours none)."""
    per = [[] for _ in bodies]
    for _ in range(rounds):
        for i, body in enumerate(bodies):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                body()
            end.record()
            end.synchronize()
            per[i].append(start.elapsed_time(end) / iters)
    return [sorted(p)[len(p) // 2] for p in per]


def profile_steps(model, compiled, x, grad):
    """The host's share of one training step, eager and compiled: the ops with the most CPU time
    and the number of kernels each launches."""
    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("eager", model), ("compiled", compiled)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step(fn, model, x, grad)
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 3
        print(f"--- {name}: {kernels:.0f} kernels per step", flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--max-ratio", type=float, default=1.0, help="largest compiled/eager step time allowed")
    parser.add_argument("--profile", action="store_true",
                        help="print the host-side ops of one eager and one compiled training step (first strategy)")
    parser.add_argument("--strategies", nargs="+", default=["sequential", "fused", "fused:train", "auto"])
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference in fp32
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    rank = dist.get_rank()
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    hidden = preset("qwen3-30b-a3b").hidden
    x = torch.randn(args.tokens, hidden, device=dev, generator=gen, dtype=torch.bfloat16)
    grad = torch.randn(args.tokens, hidden, device=dev, generator=gen, dtype=torch.bfloat16)
    reference = Stack("sequential", args.layers, args.tokens, torch.float32)
    # What surrounds the layers, forward, back to back: its compiled/eager difference is part of
    # every stack's, and not the layers' (reported beside each strategy's forward ratio).
    surroundings = Stack(None, args.layers, args.tokens)
    compiled_surroundings = torch.compile(surroundings, fullgraph=True)
    with torch.no_grad():
        for _ in range(2):
            compiled_surroundings(x), surroundings(x)
        sur_b2b = back_to_back_ms([lambda fn=fn: fn(x) for fn in (surroundings, compiled_surroundings)], args.iters)
    if rank == 0:
        print(f"surroundings (each MoE layer an opaque stand-in), fwd back to back: eager {sur_b2b[0]:.3f} ms "
              f"compiled {sur_b2b[1]:.3f} ratio {sur_b2b[1] / sur_b2b[0]:.3f}", flush=True)
    failed = False
    for strategy in args.strategies:
        t0 = time.perf_counter()
        model = Stack(strategy, args.layers, args.tokens)
        reference.load_state_dict(model.state_dict())  # the bf16 weights, exactly, in fp32
        ref = step(reference, reference, x.float(), grad.float())
        compiled = torch.compile(model, fullgraph=True)
        for _ in range(2):  # compile, warm up (fused: the first call per T runs eagerly, the next captures)
            step(compiled, model, x, grad)
            step(model, model, x, grad)
        run_c = step(compiled, model, x, grad)
        run_e = step(model, model, x, grad)
        run_e2 = step(model, model, x, grad)
        names = ["out", "dx"] + [n for n, _ in model.named_parameters()]
        quantities = list(zip(names, [run_c[0]] + run_c[1], [run_e[0]] + run_e[1], [ref[0]] + ref[1]))
        bad = []
        worst_ce = worst_ratio = 0.0
        for name, c, e, r in quantities:
            d_cr, d_er, d_ce = rel(c, r), rel(e, r), rel(c, e)
            worst_ce = max(worst_ce, d_ce)
            worst_ratio = max(worst_ratio, d_cr / max(d_er, 1e-30))
            if not d_cr <= C * d_er + A:
                bad.append(f"{name}: compiled {d_cr:.2e} eager {d_er:.2e} vs fp32")
        repeat = max(rel(a, b) for a, b in zip([run_e[0]] + run_e[1], [run_e2[0]] + run_e2[1]))
        # Routing: the compiled router on the eager run's layer inputs picks the eager router's experts.
        same_routing = True
        for moe, h in zip(model.moes, run_e[2]):
            croute = torch.compile(lambda t, moe=moe: moe.router(t, fused=True)[0], fullgraph=True)
            with torch.no_grad():
                same_routing &= torch.equal(croute(h), moe.router(h, fused=True)[0])
        flips = [routed_differently(moe, hc, he) for moe, hc, he in zip(model.moes, run_c[2], run_e[2])]
        diff_in = [int((hc != he).sum()) for hc, he in zip(run_c[2], run_e[2])]
        flips_ref = [routed_differently(moe, he.float(), hr) for moe, he, hr in zip(reference.moes, run_e[2], ref[2])]
        train = median_ms([lambda fn=fn: step(fn, model, x, grad) for fn in (model, compiled)], args.iters)
        train_b2b = back_to_back_ms([lambda fn=fn: step(fn, model, x, grad) for fn in (model, compiled)], args.iters)
        with torch.no_grad():
            compiled(x), model(x)
            fwd = median_ms([lambda fn=fn: fn(x) for fn in (model, compiled)], args.iters)
            fwd_b2b = back_to_back_ms([lambda fn=fn: fn(x) for fn in (model, compiled)], args.iters)
        if args.profile and rank == 0 and strategy == args.strategies[0]:
            profile_steps(model, compiled, x, grad)
        ratios = (train[1][0] / train[0][0], fwd[1][0] / fwd[0][0])
        ratios_b2b = (train_b2b[1] / train_b2b[0], fwd_b2b[1] / fwd_b2b[0])
        ok = not bad and same_routing and max(ratios_b2b) <= args.max_ratio
        failed |= not ok
        if rank == 0:
            print(f"{strategy}: train eager {train[0][0]:.2f} ms (host {train[0][1]:.2f}) compiled {train[1][0]:.2f} "
                  f"(host {train[1][1]:.2f}) ratio {ratios[0]:.3f}; fwd eager {fwd[0][0]:.2f} (host {fwd[0][1]:.2f}) "
                  f"compiled {fwd[1][0]:.2f} (host {fwd[1][1]:.2f}) ratio {ratios[1]:.3f}", flush=True)
            layers_part = (fwd_b2b[1] - sur_b2b[1]) / (fwd_b2b[0] - sur_b2b[0])
            print(f"  back to back: train eager {train_b2b[0]:.2f} ms compiled {train_b2b[1]:.2f} ratio "
                  f"{ratios_b2b[0]:.3f}; fwd eager {fwd_b2b[0]:.2f} compiled {fwd_b2b[1]:.2f} ratio {ratios_b2b[1]:.3f} "
                  f"(less the surroundings' times: {layers_part:.3f})", flush=True)
            print(f"  accuracy: max rel(compiled, eager) {worst_ce:.2e}, eager repeat {repeat:.2e}, "
                  f"max rel(c,ref)/rel(e,ref) {worst_ratio:.2f}; routing: compiled router = eager router "
                  f"{same_routing}, stack tokens routed otherwise compiled vs eager {flips} (router inputs "
                  f"differing {diff_in} elements), eager vs fp32 {flips_ref}; {time.perf_counter() - t0:.0f} s"
                  f"{'  FAIL' if not ok else ''}", flush=True)
            for name, c, e, r in quantities:
                print(f"    {name:<28} c-e {rel(c, e):.2e}  c-ref {rel(c, r):.2e}  e-ref {rel(e, r):.2e}", flush=True)
            for line in bad:
                print("  FAIL", line, flush=True)
        del model, compiled
        torch._dynamo.reset()
    release_shared_buffers()  # before the group goes
    dist.destroy_process_group()
    if rank == 0:
        print("compile check:", "FAILED" if failed else "passed", flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
