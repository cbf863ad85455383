"""GPU check of the ``persistent`` strategy (world size 1, one GPU; no torchrun).

    python3 tests/gpu/persistent_check.py [--stress-calls 1000]
    TRITON_INTERPRET=1 python3 tests/gpu/persistent_check.py --smoke    # CPU: tiny fp32 shapes

Per config (three shapes: many small experts with top-8, few large ones with top-2, a sigmoid
router with a selection bias), against the fp32 reference :func:`interlace.reference_moe` on
the same weights (relative ‖·‖₂ within ``TOL``):

* token counts 0, 1, 7, 128, 512 with the router's own (random) routing;
* skewed routing: every token shares one direction that k router rows point at, so most
  assignments (at least 60%) land on k experts;
* NaN rows: a token row of NaNs leaves every other row finite and right;
* bitwise repeatability: the same input twice gives the same bits;
* a stress of ``--stress-calls`` calls with token counts drawn from 0–512 and random or skewed
  routing, every 10th checked; the error record checked at the end;
* the error path: a broken task order (``task_order="combine_first"``, one poll per wait) times
  out in an eager call and in a graph replay; the kernel writes the record into its host mirror
  (page-locked memory, no copy in the stream) and the next call after the failing one has
  completed raises it, naming the wait.

Outputs are poisoned before each checked call: a NaN-filled block is freed just before, so the
caching allocator hands its memory to the call's outputs. Prints PASS/FAIL lines and exits
non-zero on any failure.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402

from interlace import MoEConfig, MoELayer, reference_moe  # noqa: E402

TOL = 2e-2  # bf16 activations and weights against the fp32 reference
CONFIGS = {
    "small-experts-k8": MoEConfig(hidden=2048, ffn=768, num_experts=64, top_k=8, dtype=torch.bfloat16),
    "large-experts-k2": MoEConfig(hidden=4096, ffn=7168, num_experts=4, top_k=2, dtype=torch.bfloat16),
    "sigmoid-bias-k4": MoEConfig(hidden=2048, ffn=1408, num_experts=32, top_k=4, dtype=torch.bfloat16,
                                 router="sigmoid", renormalize=True),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def poison(device) -> None:
    """Leave NaNs in memory the caching allocator will hand out next."""
    block = torch.full((1 << 24 if device.type == "cuda" else 1 << 12,), float("nan"), dtype=torch.bfloat16,
                       device=device)
    del block


def reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    r = layer.router
    return reference_moe(x, r.weight.detach(), layer.experts.w_up.detach(), layer.experts.w_down.detach(),
                         layer.config, expert_bias=r.expert_bias, compute_dtype=torch.float32)[0]


def skewed_input(layer: MoELayer, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, tuple]:
    """(x, saved router state): x shares a direction u; router rows 0..k-1 are set to point at it
    (and, for a sigmoid router, whose scores saturate, their selection bias raised)."""
    cfg, dev = layer.config, layer.router.weight.device
    u = torch.randn(cfg.hidden, generator=gen, device=dev)
    u /= u.norm()
    x = (torch.randn(tokens, cfg.hidden, generator=gen, device=dev) + 4.0 * cfg.hidden**0.5 * u).to(cfg.dtype)
    bias = layer.router.expert_bias
    saved = (layer.router.weight.data[:cfg.top_k].clone(), None if bias is None else bias.clone())
    layer.router.weight.data[:cfg.top_k] = u * 0.5
    if bias is not None:
        bias[:cfg.top_k] += 2.0
    return x, saved


def restore(layer: MoELayer, saved: tuple) -> None:
    weight, bias = saved
    layer.router.weight.data[:weight.shape[0]] = weight
    if bias is not None:
        layer.router.expert_bias.copy_(bias)


def check_config(name: str, cfg: MoEConfig, device, report) -> MoELayer:
    layer = MoELayer(cfg, strategy="persistent", seed=5, device=device)
    if cfg.router == "sigmoid":
        layer.router.expert_bias.copy_(torch.randn(cfg.num_experts, device=device) * 0.1)
    gen = torch.Generator(device=device).manual_seed(11)
    with torch.inference_mode():
        for tokens in (0, 1, 7, 128, 512):
            x = torch.randn(tokens, cfg.hidden, generator=gen, device=device).to(cfg.dtype)
            for attempt in range(2):  # the second call of a token count may replay a graph
                poison(device)
                out = layer(x)
                ok = out.shape == x.shape and (tokens == 0 or rel_err(out, reference(layer, x)) < TOL)
                report(ok, f"{name} T={tokens} call {attempt + 1}: rel err "
                           f"{0.0 if tokens == 0 else rel_err(out, reference(layer, x)):.2e}")
        x, saved = skewed_input(layer, 256, gen)
        poison(device)
        out = layer(x)
        counts = torch.bincount(layer.router(x, fused=True)[0].flatten(), minlength=cfg.num_experts)
        err = rel_err(out, reference(layer, x))
        report(err < TOL and counts[:cfg.top_k].sum() >= 0.6 * x.shape[0] * cfg.top_k,
               f"{name} skewed: {int(counts[:cfg.top_k].sum())}/{x.shape[0] * cfg.top_k} assignments on "
               f"{cfg.top_k} experts, rel err {err:.2e}")
        restore(layer, saved)
        x = torch.randn(64, cfg.hidden, generator=gen, device=device).to(cfg.dtype)
        bad = x.clone()
        bad[3] = float("nan")
        poison(device)
        out = layer(bad)
        keep = torch.arange(64, device=device) != 3
        err = rel_err(out[keep], reference(layer, x)[keep])
        report(err < TOL, f"{name} NaN row: other rows rel err {err:.2e}")
        a, b = layer(x).clone(), layer(x).clone()
        report(torch.equal(a, b), f"{name} bitwise repeatable")
    layer.strategy.synchronize_and_check()
    return layer


def check_error_path(device, report) -> None:
    """A timed-out wait surfaces at the next call, from an eager call and from a graph replay."""
    cfg = MoEConfig(hidden=512, ffn=256, num_experts=8, top_k=2, dtype=torch.bfloat16)
    layer = MoELayer(cfg, strategy="persistent", seed=5, device=device,
                     strategy_options={"task_order": "combine_first", "max_spins": 1})
    x = torch.randn(256, cfg.hidden, device=device).to(cfg.dtype)
    with torch.inference_mode():
        for what in ("eager call", "graph replay"):  # (the first call of a T runs eagerly, the next captures)
            message = None
            try:  # (the interpreter raises in the failing call itself; CUDA at the next one)
                layer(x)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                layer(x)
            except RuntimeError as err:
                message = str(err)
            report(message is not None and "timed out" in message, f"error path, {what}: raised {message!r}")
    mirror = layer.strategy.state.host_error
    report(not mirror.any(), f"error path: the host mirror cleared after the raise ({mirror.tolist()})")


def stress(layer: MoELayer, calls: int, device, report) -> None:
    cfg = layer.config
    rng = random.Random(3)
    gen = torch.Generator(device=device).manual_seed(13)
    worst, checked, start = 0.0, 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(calls):
            tokens = rng.choice([0, 1, 2, 8, 32, 128, 512, rng.randint(0, 512)])
            skew = rng.random() < 0.5 and tokens > 0
            if skew:
                x, saved = skewed_input(layer, tokens, gen)
            else:
                x = torch.randn(tokens, cfg.hidden, generator=gen, device=device).to(cfg.dtype)
            if i % 10 == 0:
                poison(device)
            out = layer(x)
            if i % 10 == 0 and tokens:
                worst = max(worst, rel_err(out, reference(layer, x)))
                checked += 1
            if skew:
                restore(layer, saved)
    try:
        layer.strategy.synchronize_and_check()
        record = "no error record"
    except RuntimeError as err:
        record = f"error record: {err}"
        worst = float("inf")
    report(worst < TOL, f"stress: {calls} calls ({checked} checked) in {time.perf_counter() - start:.1f} s, "
                        f"worst rel err {worst:.2e}, {record}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stress-calls", type=int, default=1000)
    p.add_argument("--configs", nargs="*", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny fp32 shapes, 30 stress calls (CPU, interpreter)")
    args = p.parse_args()
    configs = {n: CONFIGS[n] for n in (args.configs or CONFIGS)}
    if args.smoke:
        configs = {n: c.with_(hidden=64, ffn=48, num_experts=min(c.num_experts, 8), top_k=min(c.top_k, 4),
                              dtype=torch.float32) for n, c in configs.items()}
        args.stress_calls = min(args.stress_calls, 30)
    elif not torch.cuda.is_available():
        print("persistent_check needs a GPU (or --smoke under TRITON_INTERPRET=1)")
        return 2
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    failures = []

    def report(ok: bool, what: str) -> None:
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    layer = None
    for name, cfg in configs.items():
        layer = check_config(name, cfg, device, report)
    if layer is not None and args.stress_calls:
        stress(layer, args.stress_calls, device, report)
    check_error_path(device, report)
    print(f"\n{'all passed' if not failures else f'{len(failures)} FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
