"""Decode with FP8 experts on one GPU: ``persistent`` (W8A16) against bf16 ``persistent`` and
FP8 ``sequential`` (W8A8), and both weight-read floors.

    python3 benchmarks/fp8_decode.py [--presets ...] [--tokens 1 8 32 128 512] [--world 2] [--json F]

Per preset, the experts of one rank of ``--world`` (E/W experts, world size 1: no torchrun; the
router and top-k of the preset), three layers of one seed: bf16 ``persistent``, and the same
weights quantized to block FP8 (:func:`interlace.quantize_experts`: e4m3, 128 × 128 fp32 block
scales) under ``persistent`` and under ``sequential``.

1. Check, per token count, before timing: FP8 ``persistent`` against a dense bf16 ``sequential``
   layer holding the dequantized weights (the same arithmetic but for the sums' order and where
   bf16 rounds: relative Frobenius ≤ 3e-2), and, reported, against the bf16 layer the weights
   came from (what block FP8 weights cost).
2. Time, back to back as inside a decode step: per round each variant runs ``--calls`` calls in a
   row between two CUDA events (ms per call); variants interleaved in rotated order, the median
   over ``--rounds`` rounds. ``persistent`` replays its CUDA graph of the token count.
3. Floors: bytes of the experts the call's routing touches ÷ the HBM read bandwidth measured in
   the run (a read-only reduction over 4 GiB): bf16 weights at 2 bytes per element, FP8 at 1
   plus their fp32 block scales.

The table printed last: preset, tokens, experts touched, ms of each variant, × its floor, the
FP8 speed-up over bf16 ``persistent``, and the check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from interlace import MoELayer  # noqa: E402
from interlace.config import PRESETS  # noqa: E402
from interlace.fp8 import BlockFP8Weight  # noqa: E402
from interlace.tools.bench_timing import time_back_to_back  # noqa: E402

VARIANTS = ("bf16:persistent", "fp8:persistent", "fp8:sequential")
ONE_GPU = SimpleNamespace(world=1)  # (the harness's timing takes the run's env: one rank, no barrier)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def read_bandwidth(device: torch.device, gib: float = 4.0) -> float:
    """Bytes per second of a read-only fp32 sum over ``gib`` GiB (median of 10)."""
    a = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a.sum()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    del a
    return gib * 2**30 / (statistics.median(times) * 1e-3)


def bench_preset(name: str, args, device, bandwidth: float) -> list[dict]:
    cfg = PRESETS[name]
    cfg = cfg.with_(num_experts=cfg.num_experts // args.world)
    bf16 = MoELayer(cfg, strategy="persistent", seed=0, device=device)
    fp8 = MoELayer(cfg, strategy="persistent", seed=0, device=device)
    fp8.quantize_experts_(strategy="persistent")
    fp8_seq = MoELayer(cfg, strategy="sequential", seed=0, device=device)
    fp8_seq.quantize_experts_(strategy="sequential")
    fp8_seq.load_state_dict(fp8.state_dict())
    twin = MoELayer(cfg, strategy="sequential", seed=0, device=device)  # the dequantized weights, dense
    with torch.no_grad():
        for w in ("w_up", "w_down"):
            q = BlockFP8Weight(getattr(fp8.experts, w), getattr(fp8.experts, w + "_scale_inv"))
            getattr(twin.experts, w).copy_(q.dequantize(cfg.dtype))
    layers = dict(zip(VARIANTS, (bf16, fp8, fp8_seq)))
    ex = fp8.experts
    fp8_bytes = (ex.w_up[0].numel() + ex.w_down[0].numel() + 4 * (ex.w_up_scale_inv[0].numel()
                                                                    + ex.w_down_scale_inv[0].numel()))
    bf16_bytes = 2 * (ex.w_up[0].numel() + ex.w_down[0].numel())
    gen = torch.Generator(device=device).manual_seed(11)
    rows = []
    for T in args.tokens:
        x = torch.randn(T, cfg.hidden, generator=gen, device=device).to(cfg.dtype)
        row = {"preset": name, "tokens": T}
        with torch.inference_mode():
            touched = int(bf16.router(x, fused=True)[0].unique().numel())
            out = {v: layer(x) for v, layer in layers.items()}
            row["err_vs_dequantized"] = rel(out["fp8:persistent"], twin(x))
            row["err_vs_bf16"] = rel(out["fp8:persistent"], out["bf16:persistent"])
            row["err_seq_vs_bf16"] = rel(out["fp8:sequential"], out["bf16:persistent"])
            row["ok"] = row["err_vs_dequantized"] <= 3e-2
            times = {v: [] for v in VARIANTS}
            for r in range(args.rounds):
                order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
                for v in order:
                    layer = layers[v]
                    times[v].append(time_back_to_back(lambda: layer(x), args.calls, ONE_GPU))
            again = fp8(x)  # a graph replay after the timed calls: the first call's bits
            row["replay_same"] = torch.equal(again, out["fp8:persistent"])
            row["ok"] = row["ok"] and row["replay_same"]
        for v in VARIANTS:
            row[f"{v}_ms"] = statistics.median(times[v])
        row["touched"] = touched
        row["bf16_floor_ms"] = touched * bf16_bytes / bandwidth * 1e3
        row["fp8_floor_ms"] = touched * fp8_bytes / bandwidth * 1e3
        rows.append(row)
        print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
    del layers, bf16, fp8, fp8_seq, twin
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 512])
    parser.add_argument("--world", type=int, default=2, help="the experts of one rank of W")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20, help="calls back to back per timing")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    bandwidth = read_bandwidth(device)
    rows = []
    for name in args.presets:
        rows += bench_preset(name, args, device, bandwidth)
    print(f"\nHBM read bandwidth (this run): {bandwidth / 1e12:.3f} TB/s; ms per call, {args.calls} calls back to back")
    print("| preset | tokens | touched | bf16 persistent ms (× floor) | fp8 persistent ms (× fp8 floor) | "
          "fp8 sequential ms | fp8 ÷ bf16 speed-up | err vs dequantized | err vs bf16 | check |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, f, s = (r[f"{v}_ms"] for v in VARIANTS)
        print(f"| {r['preset']} | {r['tokens']} | {r['touched']} | {b:.3f} ({b / r['bf16_floor_ms']:.2f}) | "
              f"{f:.3f} ({f / r['fp8_floor_ms']:.2f}) | {s:.3f} | {b / f:.2f} | {r['err_vs_dequantized']:.1e} | "
              f"{r['err_vs_bf16']:.1e} | {'ok' if r['ok'] else 'FAIL'} |")
    if args.json:
        facts = {"device": torch.cuda.get_device_name(device), "hbm_read_tbps": bandwidth / 1e12,
                 "calls_back_to_back": args.calls, "rounds": args.rounds, "world_share": args.world}
        Path(args.json).write_text(json.dumps({"facts": facts, "rows": rows}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
