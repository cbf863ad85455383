"""Decode-sized calls of ``persistent`` against ``sequential`` on one GPU, and the weight-read floor.

For each preset of :data:`interlace.config.PRESETS`, with the experts of one rank of two (E/2
experts in all, the preset's top-k, world size 1: no torchrun), and tokens {1, 8, 32, 128, 512}:

1. check: ``persistent``'s output against ``sequential``'s on the same layer (same weights, same
   input, both under ``torch.inference_mode``): max |Δ| ≤ 3e-2 · max |sequential| in bf16
   (1e-4 in fp32, the smoke run); and a persistent call after the timed ones (a CUDA-graph
   replay) must give the first (eager) call's bits ("replay" in the check column);
2. time both: ≥ 5 warm-up calls, then ≥ 20 calls each timed by CUDA events with a
   ``torch.cuda.synchronize()`` before it; the median. Also the host time of one call (the same
   calls: ``time.perf_counter`` around the call, after the sync, before the end event; median):
   where it is near the CUDA-event time the call is bound by the host, not the GPU. Persistent's
   calls after the warm-up replay its CUDA graph of the token count (the first call runs eagerly,
   the second captures); ``--eager`` times its eager launches instead;
3. the weight-read floor: bytes of the expert weights this call's routing touches (every expert
   with at least one token: up_width·N + N·K elements each) ÷ the HBM read bandwidth measured in
   the same run by a large read-only reduction.

The table printed last: preset, tokens, experts touched, persistent ms and its host ms, sequential
ms and its host ms, floor ms, persistent ÷ floor, BLOCK_M of persistent's plan, and the check's
relative error.

    python3 benchmarks/persistent_decode.py                       # one GPU
    python3 benchmarks/persistent_decode.py --presets qwen2-moe --tokens 1 128
    TRITON_INTERPRET=1 python3 benchmarks/persistent_decode.py --smoke   # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from interlace import MoEConfig, MoELayer  # noqa: E402
from interlace.config import PRESETS  # noqa: E402

TOKENS = (1, 8, 32, 128, 512)


def median_ms(fn, warmup: int, iters: int, cuda: bool) -> tuple[float, float]:
    """(median device ms by CUDA events, median host ms of the call itself); on the CPU both
    the wall time."""
    for _ in range(warmup):
        fn()
    times, host = [], []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            host.append(times[-1])
    return statistics.median(times), statistics.median(host)


def read_bandwidth(device: torch.device, gib: float, cuda: bool) -> float:
    """Bytes per second of a read-only reduction over ``gib`` GiB (fp32 sum)."""
    a = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    ms = median_ms(lambda: a.sum(), 3, 10, cuda)[0]
    del a
    return gib * 2**30 / (ms * 1e-3)


def bench_preset(name: str, cfg: MoEConfig, tokens, device, args, bandwidth: float) -> list[dict]:
    cuda = device.type == "cuda"
    layer = MoELayer(cfg, strategy="persistent:eager" if args.eager else "persistent", seed=0, device=device)
    persistent = layer.strategy
    layer.set_strategy("sequential")
    sequential = layer.strategy
    # auto as a user gets it at world size 1 (a fresh decision cache, no shipped decisions).
    layer.set_strategy("auto", decisions_dir=tempfile.mkdtemp(prefix="decode-auto-"), shipped_decisions=False)
    auto = layer.strategy
    expert_bytes = (cfg.up_width * cfg.hidden + cfg.hidden * cfg.ffn) * layer.experts.w_up.element_size()
    tol = 3e-2 if cfg.dtype in (torch.bfloat16, torch.float16) else 1e-4
    rows = []
    gen = torch.Generator(device=device).manual_seed(7)
    for T in tokens:
        row = {"preset": name, "tokens": T}
        x = torch.randn(T, cfg.hidden, generator=gen, device=device, dtype=torch.float32).to(cfg.dtype)
        with torch.inference_mode():
            try:
                topk_idx = layer.router(x, fused=True)[0]
                row["touched"] = int(topk_idx.unique().numel())
                layer.strategy = persistent
                out_p = layer(x)
                layer.strategy = sequential
                out_s = layer(x)
                err = ((out_p.float() - out_s.float()).abs().max() / out_s.float().abs().max().clamp_min(1e-30)).item()
                row["rel_err"] = err
                row["ok"] = err <= tol
                layer.strategy = persistent
                row["persistent_ms"], row["persistent_host_ms"] = median_ms(lambda: layer(x), args.warmup, args.iters,
                                                                            cuda)
                persistent.synchronize_and_check()
                # A call after the timed ones (a graph replay unless --eager): the first call's bits.
                row["replay_same"] = torch.equal(layer(x), out_p)
                row["ok"] = row["ok"] and row["replay_same"]
                row["block_m"] = persistent._plans[T].block_m if T else 0
                layer.strategy = sequential
                row["sequential_ms"], row["sequential_host_ms"] = median_ms(lambda: layer(x), args.warmup, args.iters,
                                                                            cuda)
                layer.strategy = auto
                for calls in range(1, 33):  # calibration: until auto has decided this bucket
                    layer(x)
                    if auto.choice_for(T) is not None:
                        break
                choice = auto.choice_for(T)
                row["auto_choice"], row["auto_calibration_calls"] = (choice.spec if choice else None), calls
                row["auto_ms"], _ = median_ms(lambda: layer(x), args.warmup, args.iters, cuda)
            except Exception as exc:  # report the row and go on to the next
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        row["floor_ms"] = row.get("touched", 0) * expert_bytes / bandwidth * 1e3
        print(f"  {name} T={T}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in row.items() if k not in ("preset", "tokens")), flush=True)
        rows.append(row)
    del layer, persistent, sequential, auto
    if cuda:
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict], bandwidth: float) -> None:
    print(f"\nHBM read bandwidth (this run): {bandwidth / 1e12:.3f} TB/s")
    print(f"{'preset':<15}{'tokens':>7}{'touched':>8}{'persistent ms':>15}{'host ms':>9}{'sequential ms':>15}"
          f"{'host ms':>9}{'floor ms':>10}{'x floor':>9}{'BLOCK_M':>8}{'auto ms':>9}{'auto ran':>12}{'check':>16}")
    for r in rows:
        if "error" in r:
            print(f"{r['preset']:<15}{r['tokens']:>7}  ERROR {r['error']}")
            continue
        ratio = r["persistent_ms"] / r["floor_ms"] if r["floor_ms"] else float("nan")
        check = f"{'ok' if r['ok'] else 'FAIL'} {r['rel_err']:.1e}{'' if r['replay_same'] else ' replay≠'}"
        print(f"{r['preset']:<15}{r['tokens']:>7}{r['touched']:>8}{r['persistent_ms']:>15.3f}"
              f"{r['persistent_host_ms']:>9.3f}{r['sequential_ms']:>15.3f}{r['sequential_host_ms']:>9.3f}"
              f"{r['floor_ms']:>10.3f}{ratio:>9.2f}{r['block_m']:>8}{r.get('auto_ms', float('nan')):>9.3f}"
              f"{str(r.get('auto_choice')):>12}{check:>16}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="*", default=list(PRESETS))
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--eager", action="store_true", help="persistent without CUDA graphs (persistent:eager)")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--out", default=None, help="write the rows and the run's facts to OUT/persistent-decode.json")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.smoke:
        device = torch.device("cpu")
        configs = {
            "tiny-softmax": MoEConfig(hidden=64, ffn=48, num_experts=8, top_k=2, dtype=torch.float32),
            "tiny-sigmoid": MoEConfig(hidden=64, ffn=48, num_experts=8, top_k=2, router="sigmoid", renormalize=True,
                                      route_scale=2.5, dtype=torch.float32),
        }
        tokens, args.warmup, args.iters, gib = [1, 8, 32], 1, 2, 0.0625
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1 on the CPU)")
        if args.warmup < 5 or args.iters < 20:
            raise SystemExit("timing rules: --warmup ≥ 5 and --iters ≥ 20")
        device = torch.device("cuda", torch.cuda.current_device())
        unknown = [p for p in args.presets if p not in PRESETS]
        if unknown:
            raise SystemExit(f"unknown presets {unknown}; known: {list(PRESETS)}")
        # One rank of two: E/2 experts, the preset's top-k.
        configs = {p: PRESETS[p].with_(num_experts=PRESETS[p].num_experts // 2) for p in args.presets}
        tokens, gib = args.tokens, 4.0
    bandwidth = read_bandwidth(device, gib, device.type == "cuda")
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (interpreter)'}, "
          f"HBM read {bandwidth / 1e12:.3f} TB/s", flush=True)
    rows = []
    for name, cfg in configs.items():
        rows += bench_preset(name, cfg, tokens, device, args, bandwidth)
    print_table(rows, bandwidth)
    print(f"\ntotal {time.perf_counter() - started:.1f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
                "argv": sys.argv, "hbm_read_tb_s": bandwidth / 1e12,
                "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
        with open(os.path.join(args.out, "persistent-decode.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    failed = [r for r in rows if "error" in r or not r.get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
