"""``interlace tune-experts``: measure kernel configs of the Triton expert kernels per shape class
and rows-per-expert bucket, and write the tables :mod:`interlace.tuning.tables` looks up.

For every preset (experts per GPU = E / --world) and every bucket, on gathered rows whose
experts end mid-block (counts within ±1/8 of the bucket): the candidates of each kernel in turn
(GEMM0 as inference runs it, GEMM1, GEMM0 storing h as training does — ``expert_gemm0_train`` —
then the backward's d(pre-activation) GEMM, dx GEMM and weight gradients), the kernels not yet
tuned at their defaults. Each candidate first runs the whole forward or backward and is checked
against the default config's output (relative error > 1e-2, or a failure to compile or run:
skipped and reported). The survivors are then timed on their own kernel's launches only (GEMM0
with its gather copy where the config reads rows through TMA, with or without storing h; GEMM1;
the backward kernel's steps), ``--rounds`` times in turn, each a
``triton.testing.do_bench`` median (on the CPU interpreter, one host-timed call), and the
candidate with the lowest median over the rounds wins (timing the forward kernels inside the whole
forward, each once, spread too much between runs of one config and picked by noise). Prints the
chosen configs, their TFLOP/s and the time the tuning took.
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

from interlace.tools.bench import rel_err
from interlace.tools.command_line import command_parser
from interlace.tuning import tables as tuning
from interlace.kernels.expert_gemm.backward import backward_steps, expert_ffn_triton_backward
from interlace.kernels.expert_gemm.configs import (BACKWARD_KERNELS, FORWARD_KERNELS, INTERPRETER_CONFIG,
                                                   TRAIN_GEMM0_KERNEL)
from interlace.kernels.expert_gemm.forward import expert_ffn_triton
from interlace.kernels.expert_gemm.gemm0 import launch_gemm0
from interlace.kernels.expert_gemm.grouped import launch_gemm
from interlace.kernels.expert_gemm.schedule import tile_schedule
from interlace.kernels.tma import ensure_allocator, use_tma
from interlace.tuning.tables import GemmConfig, ShapeClass

# Small candidate sets (each config compiles once, a few seconds); the first is the default.
# GEMM0 and the d(pre-activation) GEMM hold two fp32 tiles (gate and up), so their tiles are
# half as wide as GEMM1's. Positional fields: block m, n, k, warps, stages, group_m.
A = dict(a_tma=1)  # the A rows through TMA too (a gathered A copied contiguous first)
J = dict(joint=1)  # GEMM0: gate and up as one 3-D TMA block and one double-width dot
F = dict(a_tma=1, persistent=2)  # weight gradients: persistent programs in one flat loop, TMA stores
T = dict(tma_store=1)  # full tiles stored through TMA (smem: 3 stages at 128 × 256)
L = dict(a_tma=1, persistent=2)  # GEMM0/GEMM1/dx/d(act): one flat loop over (tile, k step), TMA in and out
U = dict(unfused_act=1)  # d(act): the SwiGLU derivative in a separate pass
CANDIDATES = {
    "expert_gemm0": [GemmConfig(128, 128, 64, 8, 4), GemmConfig(128, 128, 64, 8, 3),
                     GemmConfig(128, 128, 64, 8, 4, 16),
                     GemmConfig(128, 128, 64, 8, 4, **A), GemmConfig(128, 128, 64, 8, 3, **A),
                     GemmConfig(128, 128, 64, 8, 4, **J), GemmConfig(128, 128, 64, 8, 3, **J),
                     GemmConfig(128, 128, 64, 8, 4, **A, **J), GemmConfig(128, 128, 64, 8, 3, **A, **J),
                     GemmConfig(128, 128, 64, 8, 3, **J, **T), GemmConfig(128, 128, 64, 8, 4, **J, **T),
                     GemmConfig(128, 128, 64, 8, 3, **A, **J, **T),
                     GemmConfig(128, 128, 64, 8, 4, **A, **J, **T),
                     GemmConfig(128, 128, 64, 8, 3, **L, **J), GemmConfig(128, 128, 64, 8, 4, **L, **J)],
    "expert_gemm1": [GemmConfig(128, 256, 64, 8, 3), GemmConfig(128, 256, 64, 8, 4),
                     GemmConfig(128, 256, 64, 8, 3, 16),
                     GemmConfig(128, 256, 64, 8, 3, **A), GemmConfig(128, 256, 64, 8, 4, **A),
                     GemmConfig(128, 256, 64, 8, 3, **T), GemmConfig(128, 256, 64, 8, 3, 16, **T),
                     GemmConfig(128, 256, 64, 8, 3, **A, **T),
                     GemmConfig(128, 256, 64, 8, 3, **L), GemmConfig(128, 128, 64, 8, 4, **L)],
    "expert_bwd_act": [GemmConfig(128, 128, 64, 8, 4), GemmConfig(128, 128, 64, 8, 3),
                       GemmConfig(128, 128, 128, 8, 3),
                       # the SwiGLU derivative in a separate pass
                       # (a plain store holds no h tile in registers: wider tiles fit)
                       GemmConfig(128, 128, 64, 8, 4, **U), GemmConfig(128, 256, 64, 8, 3, **U),
                       GemmConfig(128, 256, 64, 8, 4, **U), GemmConfig(128, 256, 64, 8, 3, **U, **A),
                       GemmConfig(128, 256, 64, 8, 3, **U, **T), GemmConfig(128, 256, 64, 8, 3, **U, **A, **T),
                       GemmConfig(128, 256, 64, 8, 3, **U, **L)],
    "expert_bwd_dx": [GemmConfig(128, 256, 64, 8, 4), GemmConfig(128, 256, 64, 8, 3),
                      GemmConfig(128, 128, 64, 8, 4), GemmConfig(128, 256, 64, 8, 4, **A),
                      GemmConfig(128, 256, 64, 8, 3, **A), GemmConfig(128, 256, 64, 8, 3, **T),
                      GemmConfig(128, 256, 64, 8, 3, **A, **T), GemmConfig(128, 256, 64, 8, 3, **L)],
    # a_tma for the weight gradients: an expert's whole blocks of rows (both operands) through
    # descriptors, its last partial block through masked loads
    "expert_wgrad": [GemmConfig(128, 128, 64, 8, 4), GemmConfig(128, 256, 64, 8, 3),
                     GemmConfig(128, 128, 64, 8, 3, 16), GemmConfig(128, 128, 64, 8, 4, **A),
                     GemmConfig(128, 256, 64, 8, 3, **A), GemmConfig(128, 256, 64, 8, 4, **A),
                     GemmConfig(128, 128, 128, 8, 3, **A),
                     # short reductions (few rows per expert): smaller programs, two per SM, so one
                     # program's epilogue and pipeline fill run under another's main loop
                     GemmConfig(128, 128, 64, 4, 3, **A), GemmConfig(128, 128, 64, 4, 2, **A),
                     GemmConfig(128, 256, 64, 8, 2, **A), GemmConfig(128, 256, 64, 8, 3, 16, **A),
                     # persistent programs in one flat loop over (block, row block) steps, blocks
                     # stored through TMA: short reductions lose no pipeline fill per block
                     GemmConfig(128, 256, 64, 8, 3, **F), GemmConfig(128, 256, 64, 8, 3, 16, **F),
                     GemmConfig(128, 256, 64, 8, 2, **F), GemmConfig(128, 128, 64, 8, 4, **F)],
}
INTERPRETER_CANDIDATES = [INTERPRETER_CONFIG, GemmConfig(32, 16, 16, 4, 1, 2)]
# expert_gemm0 is timed as the inference forward runs it, expert_gemm0_train storing h as the
# training forward does (the same candidates)
CANDIDATES["expert_gemm0_train"] = CANDIDATES["expert_gemm0"]
KERNELS = [k for k, _, _ in FORWARD_KERNELS + TRAIN_GEMM0_KERNEL + BACKWARD_KERNELS]
BACKWARD_NAMES = {k for k, _, _ in BACKWARD_KERNELS}
# The backward steps (expert_gemm.backward.backward_steps) a backward kernel's config runs: a candidate
# is timed on those alone (timing the whole backward buries a kernel's difference in its noise).
BACKWARD_STEPS = {"expert_bwd_act": ("d_pre_act",), "expert_bwd_dx": ("dx",), "expert_wgrad": ("dw_down", "dw_up")}


def ragged_ends(bucket: int, experts: int, device) -> torch.Tensor:
    """Inclusive row ends of ``experts`` experts with ``bucket`` rows on average, each count drawn
    within ±1/8 of it (seeded) and the total exactly bucket·experts: experts end mid-block, as
    under real routing (equal multiples of the block favour kernels that pay for partial
    blocks)."""
    g = torch.Generator().manual_seed(bucket * 1009 + experts)
    spread = bucket // 8
    shift = torch.randint(-spread, spread + 1, (experts // 2,), generator=g)
    counts = torch.full((experts,), bucket, dtype=torch.int64)
    counts[0:2 * (experts // 2):2] += shift  # in pairs, +d and -d: the total stays exact
    counts[1:2 * (experts // 2):2] -= shift
    return counts.cumsum(0).to(device=device, dtype=torch.int32)


def _time_ms(fn, cuda: bool) -> float:
    if cuda:
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    t0 = time.perf_counter()  # the interpreter: one host-timed call (the tests only need the plumbing)
    fn()
    return (time.perf_counter() - t0) * 1e3


def pick_config(samples: list[list[float]]) -> int:
    """Index of the candidate with the lowest median over its rounds (ties: the earlier one)."""
    medians = [statistics.median(t) for t in samples]
    return min(range(len(medians)), key=lambda i: (medians[i], i))


def tune_shape(shape: ShapeClass, dtype, device, buckets: list[int], candidates: dict, show=True,
               kernels: list[str] | None = None, rounds: int = 3):
    """Entries per kernel of ``kernels`` (default: all; the others run their default config), one
    per bucket: {"shape", "bucket", "config", "ms", "tflops"} (ms: the winner's median over
    ``rounds`` interleaved rounds of its own kernel's launches), and the failures."""
    from interlace.config import MoEConfig
    from interlace.experts import init_expert_weights

    cfg = MoEConfig(hidden=shape.hidden, ffn=shape.ffn, num_experts=shape.experts, top_k=1,
                    activation=shape.activation, dtype=dtype)
    w_up, w_down = init_expert_weights(cfg, range(shape.experts), 0, device)
    entries = {k: [] for k in KERNELS}
    failures = []
    cuda = device.type == "cuda"
    for bucket in buckets:
        rows = bucket * shape.experts
        ends = ragged_ends(bucket, shape.experts, device)
        x = torch.randn(rows, shape.hidden, device=device).to(dtype)
        dy = torch.randn(rows, shape.hidden, device=device).to(dtype)
        gather = torch.randperm(rows, device=device).to(torch.int32)  # rows are gathered in real use
        chosen = {k: candidates[k][0] for k in KERNELS}

        def forward(train=True):
            gemm0 = chosen["expert_gemm0_train" if train else "expert_gemm0"]
            return expert_ffn_triton(x, gather, 1, rows, w_up, w_down, ends, shape.activation, store_h=train,
                                     configs=(gemm0, chosen["expert_gemm1"]), return_act=True)

        _, h, act = forward()

        def backward():
            return expert_ffn_triton_backward(dy, x, gather, 1, w_up, w_down, ends, shape.activation, h, act,
                                              configs=tuple(chosen[k] for k, _, _ in BACKWARD_KERNELS))

        def kernel_steps(kernel):
            """The backward once (its intermediates), then a function running ``kernel``'s steps."""
            _, steps = backward_steps(dy, x, gather, 1, w_up, w_down, ends, shape.activation, h, act,
                                      configs=tuple(chosen[k] for k, _, _ in BACKWARD_KERNELS))
            for _, _, launch in steps:
                launch()
            mine = [launch for name, _, launch in steps if name in BACKWARD_STEPS[kernel]]
            work = sum(f for name, f, _ in steps if name in BACKWARD_STEPS[kernel])
            return (lambda: [launch() for launch in mine]), work

        def forward_kernel(kernel):
            """A function launching the forward kernel alone with its chosen config, and its FLOPs:
            GEMM0 (its gather copy included; h stored for expert_gemm0_train, as in training) or
            GEMM1 (on act)."""
            c = chosen[kernel]
            tma = use_tma(w_up, w_down)
            if tma:
                ensure_allocator()
            sched = tile_schedule(ends, rows, c.block_m)
            if kernel in ("expert_gemm0", "expert_gemm0_train"):
                act_out = torch.empty_like(act)
                h_out = torch.empty_like(h) if kernel == "expert_gemm0_train" else None
                return (lambda: launch_gemm0(x, gather, 1, w_up, act_out, h_out, sched, rows, shape.activation, c,
                                             tma)), 2 * rows * shape.hidden * w_up.shape[1]
            y_out = torch.empty(rows, shape.hidden, device=device, dtype=dtype)
            return (lambda: launch_gemm(act, w_down, y_out, None, ends, rows, cols=shape.hidden, red=shape.ffn,
                                        b_trans=True, epilogue=0, config=c, schedule=sched, tma=tma)), \
                2 * rows * shape.hidden * shape.ffn

        for kernel in kernels or KERNELS:
            if kernel in BACKWARD_NAMES:
                run, make = backward, kernel_steps
            else:  # the check runs the forward as the kernel's table serves it (inference: no h)
                run, make = (lambda: forward(kernel != "expert_gemm0")), forward_kernel
            want, passed = None, []
            for c in candidates[kernel]:
                chosen[kernel] = c
                try:
                    # fresh outputs every call (no clone: dsv3-like's weight gradients are 11 GB,
                    # and clones plus fp32 copies run an 80 GB H100 out of memory)
                    outs = [t for t in run() if t is not None]
                    if want is None:  # the first candidate (the default) is the reference
                        want = outs
                    err = max(rel_err(got, ref) for got, ref in zip(outs, want))
                    del outs
                    if err > 1e-2:
                        raise ValueError(f"relative error {err:.1e} against the default config")
                    make(kernel)  # compiles the kernel alone too (a different launch for the forward ones)
                    passed.append(c)
                except Exception as err:  # a config the compiler, the GPU or the check rejects
                    failures.append(f"{shape} bucket {bucket} {kernel} {c}: {type(err).__name__} {str(err)[:120]}")
            if not passed:  # every candidate failed: keep the default, write no entry
                chosen[kernel] = candidates[kernel][0]
                continue
            # Interleaved rounds: drift between calls hits every candidate alike. Each timing builds
            # its launch afresh (one candidate's buffers at a time: a backward's are GBs at 16384 rows).
            samples, work = [[] for _ in passed], 0
            for _ in range(rounds):
                for i, c in enumerate(passed):
                    chosen[kernel] = c
                    timed_fn, work = make(kernel)
                    samples[i].append(_time_ms(timed_fn, cuda))
                    del timed_fn
            best = pick_config(samples)
            c, t = passed[best], statistics.median(samples[best])
            chosen[kernel] = c
            entries[kernel].append({"shape": shape.__dict__, "bucket": bucket, "config": c.__dict__,
                                    "ms": t, "tflops": work / t / 1e9, "rounds": rounds})
            if show:
                what = "+".join(BACKWARD_STEPS[kernel]) if kernel in BACKWARD_NAMES else "alone"
                print(f"  {shape} rows/expert {bucket}: {kernel} {tuple(c.__dict__.values())} → "
                      f"{what} {work / t / 1e9:.0f} TFLOP/s ({t:.3f} ms, median of {rounds})", flush=True)
                print("    candidates (median ms): " + "; ".join(
                    f"{tuple(c.__dict__.values())} {statistics.median(ts):.3f}" for c, ts in zip(passed, samples)),
                    flush=True)
    return entries, failures


def write_tables(out: Path, name: str, sms: int, found: dict, seconds: float, argv, kernels=None) -> list[Path]:
    """Write each kernel's table, merged into the table already at that path: entries of a
    (shape class, bucket) this run did not measure are kept, so tuning one preset does not drop
    the others' entries (``meta["kept"]`` counts them; ``meta["previous"]`` is the old meta)."""
    defaults = {k: d.__dict__ for k, _, d in FORWARD_KERNELS + TRAIN_GEMM0_KERNEL + BACKWARD_KERNELS}
    meta = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "tuning_seconds": round(seconds, 1), "device": name, "sm_count": sms, "triton": triton.__version__,
            "torch": torch.__version__, "capability": list(_capability()), "defaults": defaults,
            "command": "interlace tune-experts " + " ".join(argv if argv is not None else sys.argv[1:])}
    paths = []
    for kernel in kernels or KERNELS:
        path = out / f"{tuning.table_key(kernel, name, sms)}.json"
        entries, kernel_meta = merge_entries(path, found[kernel]), dict(meta)
        kept = len(entries) - len(found[kernel])
        if kept:
            kernel_meta.update(kept=kept, previous=_read_meta(path))
        paths.append(tuning.write_table(path, entries, kernel_meta))
    return paths


def _entry_key(entry: dict) -> tuple:
    return tuple(sorted(entry["shape"].items())), entry["bucket"]


def merge_entries(path: Path, new: list[dict]) -> list[dict]:
    """The entries of the table at ``path`` (if any) that ``new`` does not re-measure, then ``new``."""
    if not path.exists():
        return list(new)
    measured = {_entry_key(e) for e in new}
    old = json.loads(path.read_text()).get("entries", [])
    return [e for e in old if _entry_key(e) not in measured] + list(new)


def _read_meta(path: Path) -> dict:
    meta = json.loads(path.read_text()).get("meta", {})
    return meta.get("previous", meta) if "kept" in meta else meta  # one level: not a growing chain


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def main(argv=None) -> int:
    from interlace.tools.bench import bench_config
    from interlace.config import PRESETS

    p = command_parser("tune-experts", "Measure kernel configs of the Triton expert kernels per shape class and "
                                       "rows-per-expert bucket, and write the tuning tables they look up.")
    p.add_argument("--configs", nargs="+", default=list(PRESETS), help="presets whose shape classes to tune")
    p.add_argument("--world", type=int, default=2, help="experts per GPU = E / world")
    p.add_argument("--buckets", nargs="+", type=int, default=[64, 256, 1024, 4096],
                   help="rows per expert to tune for (powers of two)")
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help="instead of --buckets: per preset, the buckets of these tokens per GPU (T·k / experts per GPU)")
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS),
                   help="tune only these kernels and write only their tables (default: all)")
    p.add_argument("--out", default=None, help="folder for the tables (default: $INTERLACE_TUNING_DIR or "
                                                "the package's tuning folder)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved timing rounds per candidate (default 3 on a GPU, 1 on the CPU interpreter)")
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
    out = Path(args.out) if args.out else tuning.tuning_dirs()[0]
    start = time.perf_counter()
    found = {k: [] for k in KERNELS}
    failures, shapes, paths = [], [], []
    for preset in args.configs:
        cfg = bench_config(preset, small=not cuda)
        shape = ShapeClass(cfg.hidden, cfg.ffn, cfg.num_experts // args.world, cfg.activation)
        if shape in shapes:
            continue
        shapes.append(shape)
        buckets = args.buckets if not args.tokens else sorted(
            {tuning.rows_bucket(t * cfg.top_k / shape.experts) for t in args.tokens})
        print(f"tuning {preset}: {shape} buckets {buckets}", flush=True)
        cands = CANDIDATES if cuda else {k: INTERPRETER_CANDIDATES for k in KERNELS}
        entries, f = tune_shape(shape, cfg.dtype, device, buckets, cands, kernels=args.kernels,
                                rounds=args.rounds or (3 if cuda else 1))
        for k in KERNELS:
            found[k] += entries[k]
        failures += f
        seconds = time.perf_counter() - start
        paths = write_tables(out, name, sms, found, seconds, argv, args.kernels)  # after every shape: an interrupted run keeps them
    for path in paths:
        print(f"wrote {path}")
    for line in failures:
        print(f"skipped {line}")
    print(f"tuning took {seconds:.1f} s for {len(shapes)} shape classes, {len(found[args.kernels[0]])} "
          f"(shape, bucket) entries, {len(args.kernels)} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
