"""The W > 1 persistent kernel on ONE device, with simulated ranks: every rank's buffers and plans
in one process, each of the kernel's three phases a launch per rank (gate → send, receive →
GEMM1, combine), so no launch waits on another process and a memory fault names its launch.

    python3 tests/gpu/persistent_sim_check.py [--presets ...] [--world 2]
    CUDA_LAUNCH_BLOCKING=1 compute-sanitizer --tool memcheck python3 tests/gpu/persistent_sim_check.py \\
        --presets qwen3-30b-a3b --small
    TRITON_INTERPRET=1 python3 tests/gpu/persistent_sim_check.py --smoke     # CPU: tiny fp32 shapes

This is the single-GPU way to debug the W > 1 kernel (tests/gpu/persistent_dist_check.py runs
it for real, one process per GPU, where a fault on one rank leaves the other polling until its
wait times out). Per preset (bf16; ``--small`` divides hidden and FFN sizes by 8): token counts
per rank with an empty rank, uneven ranks and full ranks, each call against an fp32 reference of
the whole layer (relative ‖·‖₂ ≤ 2e-2; fp32 ``--smoke`` ≤ 1e-4), then the error records.
Prints one line per call and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from interlace.config import MoEConfig, preset  # noqa: E402
from interlace.experts import init_expert_weights  # noqa: E402
from interlace.kernels.activation import activation_reference  # noqa: E402
from interlace.kernels.persistent.dist_launch import DistPlan, DistSpec, run_simulated, simulated_world  # noqa: E402
from interlace.kernels.persistent.config import PersistentKernelConfig, router_pieces  # noqa: E402
from interlace.routing import route  # noqa: E402


def reference(x: torch.Tensor, rw: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, cfg: MoEConfig):
    """fp32 output of one rank's tokens over all E experts (the router's own routing)."""
    x = x.float()
    idx, weight, _ = route(x, rw, None, cfg, input_dtype=cfg.dtype)
    out = torch.zeros_like(x)
    for e in range(cfg.num_experts):
        t, j = torch.nonzero(idx == e, as_tuple=True)
        if t.numel():
            h = activation_reference(x[t] @ w_up[e].float().t(), cfg.activation)
            out.index_add_(0, t, weight[t, j].float().unsqueeze(-1) * (h @ w_down[e].float().t()))
    return out


def check_preset(cfg: MoEConfig, world: int, cases, device, tol: float, report) -> None:
    E, L, N = cfg.num_experts, cfg.num_experts // world, cfg.hidden
    gen = torch.Generator(device=device).manual_seed(0)
    rw = torch.randn(E, N, generator=gen, device=device) / N**0.5
    w_up, w_down = init_expert_weights(cfg, range(E), seed=5, device=device)
    max_tokens = max(max(c) for c in cases)
    bufs = simulated_world(DistSpec(world, L, N, cfg.top_k, max_tokens, cfg.dtype), device)
    for tokens in cases:
        xs = [torch.randn(t, N, generator=gen, device=device).to(cfg.dtype) for t in tokens]
        plans = [DistPlan(x, rw, None, w_up[r * L:(r + 1) * L].contiguous(), w_down[r * L:(r + 1) * L].contiguous(),
                          bufs[r], top_k=cfg.top_k, softmax=True, renormalize=cfg.renormalize,
                          route_scale=cfg.route_scale, activation=cfg.activation,
                          w_pieces=router_pieces(x.dtype, cfg.router_gemm), config=PersistentKernelConfig(),
                          max_spins=1 << 20)
                 for r, x in enumerate(xs)]
        outs = run_simulated(plans, xs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # (a fault surfaces here, after this call's launches)
        errs = []
        for r, (x, out) in enumerate(zip(xs, outs)):
            if x.shape[0]:
                ref = reference(x, rw, w_up, w_down, cfg)
                errs.append(((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item())
        worst = max(errs, default=0.0)
        report(worst <= tol, f"tokens per rank {tokens}: max rel err {worst:.2e} (block_m {plans[0].block_m})")
    for r, buf in enumerate(bufs):
        try:
            buf.check()
            report(True, f"rank {r}: no wait timed out")
        except RuntimeError as exc:
            report(False, f"rank {r}: {exc}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b", "dsv3-like"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--small", action="store_true", help="hidden and FFN sizes ÷ 8 (faster under a sanitizer)")
    p.add_argument("--smoke", action="store_true", help="one tiny fp32 config (CPU, interpreter)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("persistent_sim_check needs a GPU (or --smoke under TRITON_INTERPRET=1)")
        return 2
    failures = []

    def report(ok, msg):
        failures.extend([] if ok else [msg])
        print(("PASS " if ok else "FAIL ") + msg, flush=True)

    W = args.world
    if args.smoke:
        cfg = MoEConfig(hidden=32, ffn=24, num_experts=4 * W, top_k=2, router="softmax", dtype=torch.float32)
        check_preset(cfg, W, [[3] + [5] * (W - 1), [0] + [4] * (W - 1), [6] * W], device, 1e-4, report)
    else:
        for name in args.presets:
            cfg = preset(name, router="softmax")
            if args.small:
                cfg = cfg.with_(hidden=cfg.hidden // 8, ffn=cfg.ffn // 8)
            print(f"# {name}: N {cfg.hidden}, K {cfg.ffn}, E {cfg.num_experts}, k {cfg.top_k}, W {W}", flush=True)
            cases = [[1] * W, [0] + [5] * (W - 1), [37] + [0] * (W - 1), [128] * W, [512] + [300] * (W - 1)]
            check_preset(cfg, W, cases, device, 2e-2, report)
    print(f"{len(failures)} failed checks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
