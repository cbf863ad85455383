"""``interlace tune-experts``: measure kernel configs of the Triton expert GEMMs per shape class
and rows-per-expert bucket, and write the tables :mod:`interlace.ops.tuning` looks up.

For every preset (experts per GPU = E / --world) and every bucket, each candidate config of
GEMM0 (with its default GEMM1) and then of GEMM1 (with the best GEMM0) is timed on balanced
rows with ``triton.testing.do_bench`` (median; on the CPU interpreter, a host timer). Failing
configs (too much shared memory, …) are skipped and reported. Prints the chosen configs, their
TFLOP/s and the time the tuning took.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

from interlace.ops import tuning
from interlace.ops.grouped_gemm import GEMM0_DEFAULT, GEMM1_DEFAULT, INTERPRETER_CONFIG, expert_ffn_triton
from interlace.ops.tuning import GemmConfig, ShapeClass

# A small candidate set (each config compiles once, a few seconds): GEMM0 holds two fp32
# accumulators (gate and up), so its tile is half as wide as GEMM1's.
GEMM0_CANDIDATES = [GemmConfig(128, 128, 64, 8, 4), GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 128, 64, 8, 4, 16),
                    GemmConfig(128, 64, 64, 4, 4)]
GEMM1_CANDIDATES = [GemmConfig(128, 256, 64, 8, 3), GemmConfig(128, 256, 64, 8, 4), GemmConfig(128, 256, 64, 8, 3, 16),
                    GemmConfig(128, 128, 64, 8, 4)]
INTERPRETER_CANDIDATES = [INTERPRETER_CONFIG, GemmConfig(32, 16, 16, 4, 1, 2)]


def _time_ms(fn, cuda: bool) -> float:
    if cuda:
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def tune_shape(shape: ShapeClass, dtype, device, buckets: list[int], candidates0, candidates1, show=True):
    """Entries (one per bucket) for both kernels: {"shape", "bucket", "config", "tflops"}."""
    from interlace.config import MoEConfig
    from interlace.experts import init_expert_weights

    cfg = MoEConfig(hidden=shape.hidden, ffn=shape.ffn, num_experts=shape.experts, top_k=1,
                    activation=shape.activation, dtype=dtype)
    w_up, w_down = init_expert_weights(cfg, range(shape.experts), 0, device)
    entries0, entries1, failures = [], [], []
    cuda = device.type == "cuda"
    for bucket in buckets:
        rows = bucket * shape.experts
        ends = torch.arange(1, shape.experts + 1, device=device, dtype=torch.int32) * bucket
        x = torch.randn(rows, shape.hidden, device=device).to(dtype)
        gather = torch.randperm(rows, device=device).to(torch.int32)  # rows are gathered in real use
        flops = 2 * rows * shape.hidden * shape.ffn * (3 if shape.activation == "swiglu" else 2)

        def run(c0, c1):
            return expert_ffn_triton(x, gather, 1, rows, w_up, w_down, ends, shape.activation, configs=(c0, c1))

        def best_of(cands, make):
            timed = []
            for c in cands:
                try:
                    timed.append((_time_ms(make(c), cuda), c))
                except Exception as err:  # a config the compiler or the GPU rejects
                    failures.append(f"{shape} bucket {bucket} {c}: {type(err).__name__}")
            return min(timed, key=lambda tc: tc[0])

        t0, c0 = best_of(candidates0, lambda c: (lambda: run(c, candidates1[0])))
        t1, c1 = best_of(candidates1, lambda c: (lambda: run(c0, c)))
        for entries, c, t in ((entries0, c0, t0), (entries1, c1, t1)):
            entries.append({"shape": shape.__dict__, "bucket": bucket, "config": c.__dict__,
                            "block_ms": t, "tflops": flops / t / 1e9})
        if show:
            print(f"  {shape} rows/expert {bucket}: gemm0 {tuple(c0.__dict__.values())} gemm1 "
                  f"{tuple(c1.__dict__.values())} → {flops / t1 / 1e9:.0f} TFLOP/s ({t1:.3f} ms)", flush=True)
    return entries0, entries1, failures


def main(argv=None) -> int:
    from interlace.bench.harness import bench_config
    from interlace.config import PRESETS

    p = argparse.ArgumentParser(prog="interlace tune-experts", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(PRESETS))
    p.add_argument("--world", type=int, default=2, help="experts per GPU = E / world")
    p.add_argument("--buckets", nargs="+", type=int, default=[64, 256, 1024, 4096],
                   help="rows per expert to tune for (powers of two)")
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help="instead of --buckets: per preset, the buckets of these tokens per GPU (T·k / experts per GPU)")
    p.add_argument("--out", default=None, help="folder for the tables (default: $INTERLACE_TUNING_DIR or "
                                                "the package's tuning folder)")
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
    out = Path(args.out) if args.out else tuning.tuning_dirs()[0]
    start = time.perf_counter()
    all0, all1, failures = [], [], []
    shapes = []
    for preset in args.configs:
        cfg = bench_config(preset, small=not cuda)
        shape = ShapeClass(cfg.hidden, cfg.ffn, cfg.num_experts // args.world, cfg.activation)
        if shape in shapes:
            continue
        shapes.append(shape)
        buckets = args.buckets if not args.tokens else sorted(
            {tuning.rows_bucket(t * cfg.top_k / shape.experts) for t in args.tokens})
        print(f"tuning {preset}: {shape} buckets {buckets}", flush=True)
        e0, e1, f = tune_shape(shape, cfg.dtype, device, buckets,
                               GEMM0_CANDIDATES if cuda else INTERPRETER_CANDIDATES,
                               GEMM1_CANDIDATES if cuda else INTERPRETER_CANDIDATES)
        all0 += e0
        all1 += e1
        failures += f
    seconds = time.perf_counter() - start
    meta = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "tuning_seconds": round(seconds, 1),
            "device": name, "sm_count": sms, "triton": triton.__version__, "torch": torch.__version__,
            "defaults": {"gemm0": GEMM0_DEFAULT.__dict__, "gemm1": GEMM1_DEFAULT.__dict__},
            "command": "interlace tune-experts " + " ".join(argv if argv is not None else sys.argv[1:])}
    for kernel, entries in (("expert_gemm0", all0), ("expert_gemm1", all1)):
        path = tuning.write_table(out / f"{tuning.table_key(kernel, name, sms)}.json", entries, meta)
        print(f"wrote {path}")
    for line in failures:
        print(f"skipped {line}")
    print(f"tuning took {seconds:.1f} s for {len(shapes)} shape classes, {len(all0)} (shape, bucket) entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
