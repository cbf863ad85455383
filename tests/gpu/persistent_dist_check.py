"""GPU check and decode timing of the ``persistent`` strategy at world size W > 1 (one launch per
rank, one-sided dispatch and combine over torch symmetric memory).

    torchrun --nproc-per-node 2 tests/gpu/persistent_dist_check.py [--presets ...] [--tokens ...]

Per preset (default: qwen3-30b-a3b, mixtral-8x7b, dsv3-like; bf16), one layer with
``max_tokens`` 512:

* correctness against an fp32 reference of the whole layer (every rank's tokens, all experts:
  each rank adds its own experts' part for every rank's tokens, summed by an all-reduce; relative
  ‖·‖₂ within ``TOL``), for uneven per-rank token counts from 0 to 512 (one rank empty in some
  calls), each count twice (the second call of a count replays a CUDA graph), and skewed
  routing (every token of every rank to k experts of the last rank);
* the routing: each checked call's picks (read from the kernel's workspace) against the fp32
  reference's, pick by pick; a pick may differ only at a near-tie (the two experts' selection
  scores, softmax probabilities or biased sigmoids, within ``NEAR_TIE`` of the row's largest:
  under a skew, the probabilities of the experts far below the dominating one underflow to 0), and then the output is checked against the
  reference computed with the kernel's picks (its weights still the reference's own): with a
  capacity factor a swapped pick order changes which assignments are dropped;
* bitwise repeatability (the same input twice, the same bits);
* the error record (no wait timed out) at the end;
* with ``--capacity-factor F``: the presets with that capacity factor (each rank's experts
  take ceil(F·T·k/E) of its own assignments; the reference drops per rank as the policy does);
* with ``--stress N``: N calls, each rank's token count drawn from 0–512 independently, every
  third call skewed (every token pushed towards one expert drawn per call), every 10th call
  checked against the fp32 reference, every output checked for NaN/inf on the device (one
  host read at the end), then the error record again.

Then timing: ``persistent``, ``fused`` and ``sequential`` (CUDA graphs where the strategy has
them) at 1, 8, 32, 128, 512 tokens per GPU, the router's own routing: CUDA events, a barrier
before each call, median of 20 calls after 5 warm-ups, the slowest rank's median. The table,
printed last by rank 0: ms per layer call per strategy, and persistent's speed-up over the
faster of the other two (> 1: persistent is faster). Exits non-zero on any failed check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from interlace import MoELayer  # noqa: E402
from interlace.config import preset  # noqa: E402
from interlace.kernels.activation import activation_reference  # noqa: E402
from interlace.parallel import release_shared_buffers  # noqa: E402
from interlace.reference import capacity_keep_mask  # noqa: E402
from interlace.routing import route  # noqa: E402
from interlace.tools.bench import init_env, reduce_max, time_cuda  # noqa: E402

TOL = 2e-2  # bf16 activations and weights against the fp32 reference
NEAR_TIE = 1e-4  # two selection scores this close (relative to the row's largest) are a tie to the check
MAX_TOKENS = 512


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def kernel_picks(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """(T, k) int64: the experts the kernel picked for this rank's last call of T tokens, in pick
    order (its plan's routing workspace, which a graph replay writes too)."""
    T, k = x.shape[0], layer.config.top_k
    return layer.strategy._plans[T].workspace["idx"][:T * k].view(T, k).long()


def pick_check(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(the kernel's picks, picks that differ from the reference's at near-ties, picks that differ
    beyond one), this rank's, against the fp32 reference routing of its tokens."""
    cfg = layer.config
    if not x.shape[0]:
        return torch.empty(0, cfg.top_k, dtype=torch.int64, device=x.device), 0, 0
    picks = kernel_picks(layer, x)
    bias = layer.router.expert_bias
    ref, _, logits = route(x.float(), layer.router.weight.detach().float(), bias, cfg, input_dtype=cfg.dtype)
    # (the scores the choice ranks: softmax probabilities, which underflow to equal zeros for the
    # experts far below a dominating one, so their order is a tie; sigmoid plus the selection bias)
    score = torch.softmax(logits.float(), dim=1) if cfg.router == "softmax" else torch.sigmoid(logits.float()) + (
        0.0 if bias is None else bias.float())
    scale = score.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    gap = (score.gather(1, picks) - score.gather(1, ref)).abs() / scale
    differ = picks != ref
    far = int((differ & (gap > NEAR_TIE)).sum())
    return picks, int(differ.sum()) - far, far


def checked_err(layer: MoELayer, x: torch.Tensor, out: torch.Tensor, env) -> tuple[float, int, int]:
    """(relative error, near-tie picks, far picks), each the worst over the ranks: the output
    against the reference with the kernel's picks where they differ only at near-ties."""
    picks, ties, far = pick_check(layer, x)
    ties, far = int(reduce_max(env, ties)), int(reduce_max(env, far))
    ref = reference(layer, x, env, forced=picks if ties and not far else None)  # (every rank: a collective)
    err = reduce_max(env, rel_err(out, ref) if x.shape[0] else 0.0)
    return err, ties, far


def picks_note(ties: int, far: int) -> str:
    """What the report says about picks that differ from the reference's (nothing if none)."""
    note = f", {ties} picks at near-ties (checked with the kernel's picks)" if ties else ""
    return note + (f", {far} picks differ beyond a near-tie" if far else "")


def reference(layer: MoELayer, x: torch.Tensor, env, forced: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 reference of this rank's output: every rank's tokens are gathered, each rank adds its
    local experts' part for all of them, an all-reduce sums the parts. ``forced``: (T, k) picks
    of this rank's tokens to use instead of the reference's choice (the weights are still the
    reference router's scores of those experts)."""
    cfg, ep = layer.config, layer.ep
    counts = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(env.world)]
    dist.all_gather(counts, torch.tensor([x.shape[0]], device=x.device))
    counts = [int(c) for c in counts]  # (a host sync: a check, not a timed call)
    padded = torch.zeros(max(counts), cfg.hidden, dtype=x.dtype, device=x.device)
    padded[:x.shape[0]] = x
    gathered = [torch.empty_like(padded) for _ in range(env.world)]
    dist.all_gather(gathered, padded)
    xs = torch.cat([g[:c] for g, c in zip(gathered, counts)]).float()
    every = None
    if forced is not None:
        mine = torch.zeros(max(counts), cfg.top_k, dtype=torch.int64, device=x.device)
        mine[:x.shape[0]] = forced
        theirs = [torch.empty_like(mine) for _ in range(env.world)]
        dist.all_gather(theirs, mine)
        every = torch.cat([g[:c] for g, c in zip(theirs, counts)])
    out = torch.zeros_like(xs)
    if xs.shape[0]:
        bias = layer.router.expert_bias
        idx, weight, _ = route(xs, layer.router.weight.detach().float(), bias, cfg, expert_indices=every,
                               input_dtype=cfg.dtype)
        # (a capacity factor applies to each rank's own tokens: the policy per rank's segment)
        keep = torch.cat([capacity_keep_mask(idx[sum(counts[:r]):sum(counts[:r + 1])].cpu(), cfg)
                          for r in range(env.world)]).to(idx.device)
        w_up, w_down = layer.experts.w_up.detach(), layer.experts.w_down.detach()
        for lo in range(ep.num_local):
            tokens, slots = torch.nonzero((idx == ep.first_expert + lo) & keep, as_tuple=True)
            if tokens.numel():
                h = activation_reference(xs[tokens] @ w_up[lo].float().t(), cfg.activation)
                out.index_add_(0, tokens, weight[tokens, slots].float().unsqueeze(-1) * (h @ w_down[lo].float().t()))
    dist.all_reduce(out)
    first = sum(counts[:env.rank])
    return out[first:first + x.shape[0]]


def check_preset(name, env, report, capacity_factor=None):
    cfg = preset(name).with_(capacity_factor=capacity_factor)
    layer = MoELayer(cfg, group=env.group, strategy="persistent", seed=5, device=env.device,
                     strategy_options={"max_tokens": MAX_TOKENS})
    if layer.router.expert_bias is not None:
        same = torch.Generator(device=env.device).manual_seed(3)  # (the same bias on every rank)
        layer.router.expert_bias.copy_(torch.randn(cfg.num_experts, generator=same, device=env.device) * 0.1)
    gen = torch.Generator(device=env.device).manual_seed(100 + env.rank)
    plan = [(0, 5), (1, 512), (37, 0), (512, 300), (128, 128), (7, 1)]  # (rank 0, others) token counts
    with torch.inference_mode():
        for t0, t1 in plan:
            tokens = t0 if env.rank == 0 else t1
            x = torch.randn(tokens, cfg.hidden, generator=gen, device=env.device).to(cfg.dtype)
            for attempt in range(2):
                out = layer(x)
                err, ties, far = checked_err(layer, x, out, env)  # (collectives: every rank, zero tokens too)
                report(err < TOL and not far, f"{name} tokens ({t0}, {t1}) call {attempt + 1}: rel err {err:.2e}"
                                              f"{picks_note(ties, far)}")
        # skewed: a shared direction u in every token, k router rows of the last rank's experts along it
        k, last = cfg.top_k, cfg.num_experts - cfg.top_k
        u = torch.randn(cfg.hidden, device=env.device, generator=torch.Generator(device=env.device).manual_seed(7))
        u /= u.norm()
        saved = layer.router.weight.data[last:].clone()
        layer.router.weight.data[last:] = u * 0.5
        bias_saved = None
        if layer.router.expert_bias is not None:
            bias_saved = layer.router.expert_bias.clone()
            layer.router.expert_bias[last:] += 2.0
        tokens = 200 + 50 * env.rank
        x = (torch.randn(tokens, cfg.hidden, generator=gen, device=env.device)
             + 4.0 * cfg.hidden**0.5 * u).to(cfg.dtype)
        out = layer(x)
        idx = layer.router(x, fused=True)[0]
        share = reduce_max(env, -float((idx >= last).float().mean()))
        err, ties, far = checked_err(layer, x, out, env)
        report(err < TOL and not far and -share >= 0.6, f"{name} skewed: ≥ {-share:.0%} of assignments on the "
                                                        f"last rank's {k} experts, rel err {err:.2e}"
                                                        f"{picks_note(ties, far)}")
        layer.router.weight.data[last:] = saved
        if bias_saved is not None:
            layer.router.expert_bias.copy_(bias_saved)
        x = torch.randn(64 + 3 * env.rank, cfg.hidden, generator=gen, device=env.device).to(cfg.dtype)
        a, b = layer(x).clone(), layer(x).clone()
        report(bool(reduce_max(env, float(not torch.equal(a, b))) == 0), f"{name} bitwise repeatable")
    try:
        layer.strategy.synchronize_and_check()
        report(True, f"{name} no wait timed out")
    except RuntimeError as exc:
        report(False, f"{name} error record: {exc}")
    return layer


def stress(name, layer, env, calls, report, max_tokens=MAX_TOKENS):
    """``calls`` calls of random, rank-local token counts 0–max_tokens (some skewed), every
    10th checked (tests/kernels/test_persistent_dist.py runs it on gloo ranks, small)."""
    cfg = layer.config
    counts = torch.Generator().manual_seed(1000 + env.rank)  # (host draws: no sync per call)
    gen = torch.Generator(device=env.device).manual_seed(1000 + env.rank)
    shared = torch.Generator().manual_seed(11)  # (the same draw on every rank: which calls skew, towards whom)
    bad = torch.zeros((), dtype=torch.int64, device=env.device)
    worst, checked, tied = 0.0, 0, 0
    start = time.time()
    with torch.inference_mode():
        for i in range(calls):
            if i and i % 100 == 0 and env.rank == 0:
                print(f"  {name} stress: {i} calls, {checked} checked, {time.time() - start:.0f} s", flush=True)
            tokens = int(torch.randint(0, max_tokens + 1, (1,), generator=counts))
            if i % 17 == 5:
                tokens = 0
            x = torch.randn(tokens, cfg.hidden, generator=gen, device=env.device)
            if i % 3 == 2:
                e = int(torch.randint(0, cfg.num_experts, (1,), generator=shared))
                w = layer.router.weight.detach()[e].float()
                x = x + 4.0 * cfg.hidden**0.5 * w / w.norm()
            x = x.to(cfg.dtype)
            out = layer(x)
            bad += (~torch.isfinite(out)).sum()
            if i % 10 == 9:
                err, ties, far = checked_err(layer, x, out, env)
                worst, checked, tied = max(worst, err if not far else float("inf")), checked + 1, tied + ties
                if err >= TOL or far:
                    report(False, f"{name} stress call {i}: {tokens} tokens here, rel err {err:.2e}"
                                  f"{picks_note(ties, far)}")
    nonfinite = int(reduce_max(env, float(bad)))  # (the one host read of the device counter)
    report(nonfinite == 0 and worst < TOL, f"{name} stress: {calls} calls of 0-{max_tokens} tokens per rank, "
                                           f"{checked} checked, worst rel err {worst:.2e}, non-finite outputs "
                                           f"{nonfinite}{picks_note(tied, 0)}")
    try:
        layer.strategy.synchronize_and_check()
        report(True, f"{name} stress: no wait timed out")
    except RuntimeError as exc:
        report(False, f"{name} stress: error record: {exc}")


def time_preset(name, layer, env, tokens_list, iters, warmup):
    cfg = layer.config
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, cfg.hidden, device=env.device).to(cfg.dtype)
        row = {"preset": name, "tokens": tokens}
        for strategy in ("persistent", "fused", "sequential"):
            options = {"max_tokens": MAX_TOKENS} if strategy in ("persistent", "fused") else {}
            layer.set_strategy(strategy, **options)
            with torch.inference_mode():
                times = time_cuda(lambda: layer(x), warmup, iters, env)
            row[strategy] = reduce_max(env, statistics.median(times))
        rows.append(row)
    layer.set_strategy("persistent", max_tokens=MAX_TOKENS)
    with torch.inference_mode():
        layer(torch.randn(1, cfg.hidden, device=env.device).to(cfg.dtype))
    layer.strategy.synchronize_and_check()
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b", "dsv3-like"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 512])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--stress", type=int, default=0, help="calls of random token counts after the checks (0: none)")
    p.add_argument("--stress-only", action="store_true", help="the stress alone: no checks, no timing")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="the presets with this capacity factor (default: dropless)")
    args = p.parse_args()
    env = init_env()
    if env.world < 2 or not torch.cuda.is_available():
        sys.exit("run with torchrun --nproc-per-node 2 (or more) on GPUs")
    start = time.time()
    failures = []

    def report(ok, msg):
        if not ok:
            failures.append(msg)
        if env.rank == 0:
            print(("PASS " if ok else "FAIL ") + msg, flush=True)

    rows = []
    for name in args.presets:
        try:
            if args.stress_only:
                layer = MoELayer(preset(name).with_(capacity_factor=args.capacity_factor), group=env.group,
                                 strategy="persistent", seed=5, device=env.device,
                                 strategy_options={"max_tokens": MAX_TOKENS})
            else:
                layer = check_preset(name, env, report, args.capacity_factor)
            if args.stress:
                stress(name, layer, env, args.stress, report)
            if not args.stress_only:
                rows += time_preset(name, layer, env, args.tokens, args.iters, args.warmup)
        except Exception as exc:  # keep going: the other presets are still worth checking
            import traceback

            traceback.print_exc()
            report(False, f"{name}: {exc!r}")
        layer = None
        torch.cuda.empty_cache()
    if env.rank == 0:
        print(f"\n{len(failures)} failed checks; {time.time() - start:.0f} s; world {env.world}, "
              f"{torch.cuda.get_device_name()}")
        print(f"\n| preset | tokens/GPU | persistent ms | fused ms | sequential ms | persistent speed-up |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            best_other = min(r["fused"], r["sequential"])
            print(f"| {r['preset']} | {r['tokens']} | {r['persistent']:.3f} | {r['fused']:.3f} | "
                  f"{r['sequential']:.3f} | {best_other / r['persistent']:.2f}x |", flush=True)
    release_shared_buffers()
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
