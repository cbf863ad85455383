"""``interlace tune``: profile the fused strategy's block split per shape and store it.

Launch with ``torchrun --nproc-per-node W -m interlace.tools.tune_fused [--configs ...]
[--tokens ...]`` (or ``interlace tune`` under torchrun). For every config × tokens-per-GPU
bucket it times the layer (random routing, CUDA events, slowest rank's median) for candidate
numbers of layer0 communication programs ``n_comm`` (with the default ``n_comm1``), then for
candidate layer1 combine programs ``n_comm1`` with the best ``n_comm`` (a coordinate search:
the two layers are separate launches, so their splits are nearly independent), prints a
progress line per measurement, and merges the chosen split into
``$INTERLACE_TUNING_DIR`` (default: the package's ``interlace/tuning``) as
``fused-split-<device>.json`` keyed as :mod:`interlace.tuning.fused_split` describes.

The candidates are timed in ``--rounds`` interleaved rounds (each round times every candidate
once, in a rotated order) and compared by their median over rounds, so a slow drift of the
machine falls on all of them alike. A split already in the tables (the incumbent) is kept unless
a candidate beats it by ``--margin``: a single short pass per candidate moves most entries by
noise alone, and can make rows slower than the table it replaces.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from interlace.tools.bench import init_env, make_routing, reduce_max, time_cuda
from interlace.tools.command_line import command_parser
from interlace.config import preset
from interlace.layer import MoELayer
from interlace.tuning.fused_split import PACKAGE_DIR, load_entries, split_key, write_entries
from interlace.env import settings

CANDIDATES = (4, 8, 12, 16, 24, 32, 48)


def pick_split(samples: dict[int, list[float]], incumbent: int | None, margin: float) -> int:
    """The candidate with the lowest median over rounds (``samples``: candidate → ms per round),
    unless ``incumbent`` (the table's current value, if it was timed) is within ``margin`` of it."""
    med = {c: statistics.median(v) for c, v in samples.items()}
    best = min(med, key=lambda c: (med[c], c))
    if incumbent in med and med[best] > med[incumbent] * (1 - margin):
        return incumbent
    return best


def main(argv=None) -> int:
    p = command_parser("tune", "Time the fused strategy's split of programs between communication and GEMMs "
                               "per shape and store the fastest. Launch under torchrun with 2 or more GPUs.")
    p.add_argument("--configs", nargs="+", default=["mixtral-8x7b", "phi3.5-moe", "qwen2-moe", "qwen3-30b-a3b",
                                                    "dsv3-like", "flashdmoe-cfg"], help="presets to tune")
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384], help="tokens per GPU, one split each")
    p.add_argument("--candidates", nargs="+", type=int, default=list(CANDIDATES),
                   help="program counts to try for layer0's communication (n_comm) and layer1's combine (n_comm1)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before each candidate's timed ones")
    p.add_argument("--iters", type=int, default=10, help="timed calls per candidate and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the candidates")
    p.add_argument("--margin", type=float, default=0.02,
                   help="a tabled split stays unless a candidate is this much faster (0: always the fastest)")
    p.add_argument("--out-dir", default=str(settings().tuning_dir or PACKAGE_DIR),
                   help="folder the fused-split-<device>.json table is merged into")
    args = p.parse_args(argv)
    env = init_env()
    if not env.cuda or env.world < 2:
        print("interlace tune: needs ≥ 2 GPUs under torchrun (the split only matters with peers)", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(env.device).multi_processor_count
    device_name = torch.cuda.get_device_name(env.device).replace(" ", "_")
    candidates = [c for c in args.candidates if 0 < c < sms]
    total = len(args.configs) * len(args.tokens) * 2 * len(candidates) * args.rounds
    done, started = 0, time.perf_counter()
    tabled = load_entries()  # the incumbents (package tables and $INTERLACE_TUNING_DIR)
    entries: dict[str, dict[str, list[int]]] = {}
    for name in args.configs:
        cfg = preset(name)
        layer = MoELayer(cfg, group=env.group, strategy="naive", seed=0, device=env.device)
        for tokens in args.tokens:
            x = torch.randn(tokens, cfg.hidden, device=env.device).to(cfg.dtype)
            idx = make_routing(cfg, "random", tokens, env, 0)
            best = {"n_comm": None, "n_comm1": None}
            default1 = max(1, sms // 8)
            incumbent = dict(zip(("n_comm", "n_comm1"), tabled.get(split_key(cfg, env.world, sms), {}).get(
                str(tokens), (None, None))))
            for which in ("n_comm", "n_comm1"):
                strategies = {}
                for c in candidates:  # set up each split once (buffers, plan, CUDA graph) outside the timing
                    split = {"n_comm": c, "n_comm1": default1} if which == "n_comm" else \
                        {"n_comm": best["n_comm"], "n_comm1": c}
                    layer.set_strategy("fused", max_tokens=max(args.tokens), **split)
                    with torch.no_grad():
                        layer(x, expert_indices=idx)
                    strategies[c] = layer.strategy
                samples: dict[int, list[float]] = {c: [] for c in candidates}
                for r in range(args.rounds):
                    shift = r % len(candidates)
                    for c in candidates[shift:] + candidates[:shift]:
                        layer.strategy = strategies[c]
                        with torch.no_grad():
                            times = time_cuda(lambda: layer(x, expert_indices=idx), args.warmup, args.iters, env)
                        samples[c].append(reduce_max(env, statistics.median(times)))
                        done += 1
                        if env.rank == 0:
                            print(f"[{done}/{total} {time.perf_counter() - started:6.0f}s] {name} T={tokens} "
                                  f"{which}={c} round {r + 1}: {samples[c][-1]:.3f} ms", flush=True)
                best[which] = pick_split(samples, incumbent[which], args.margin)
                if env.rank == 0:
                    med = {c: round(statistics.median(v), 3) for c, v in samples.items()}
                    print(f"  {name} T={tokens} {which}: medians {med}; table had {incumbent[which]} → "
                          f"{best[which]}", flush=True)
                del strategies
            entries.setdefault(split_key(cfg, env.world, sms), {})[str(tokens)] = [best["n_comm"], best["n_comm1"]]
            if env.rank == 0:
                print(f"  → {name} T={tokens}: n_comm={best['n_comm']} n_comm1={best['n_comm1']}", flush=True)
        del layer
        torch.cuda.empty_cache()
    if env.rank == 0:
        path = Path(args.out_dir) / f"fused-split-{device_name}.json"
        write_entries(path, entries, {"device": torch.cuda.get_device_name(env.device), "sm_count": sms,
                                      "world": env.world, "torch": torch.__version__,
                                      "seconds": round(time.perf_counter() - started, 1)})
        print(f"wrote {path} ({time.perf_counter() - started:.0f} s)")
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
