"""Host cost of each Triton launch in one expert block call, split into Triton's launch steps (one GPU).

    python benchmarks/launch_cost.py [--config qwen3-30b-a3b] [--tokens 4096] [--reps 200]

Records every ``JITFunction.run`` of one forward + backward of the Triton expert block, then
replays each recorded launch ``--reps`` times with the GPU held busy (``torch.cuda._sleep``, so
the launch queue never blocks the host) and reports host µs per launch for:

* ``jit``: ``kernel[grid](...)``, the path the library takes;
* ``bind``: Triton's argument binder and specialization alone;
* ``key``: the compile-cache key from that specialization;
* ``dev+stream``: the current device and stream lookups;
* ``run``: the compiled kernel's C launcher alone (``CompiledKernel.run`` with the bound args);
* ``fast``: :func:`interlace.kernels.launch.launch` (the library's cached launch path).

Uses Triton internals (3.6); a diagnostic, not part of the library.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction, compute_cache_key

from interlace.config import PRESETS


def record_launches(fn):
    """[(kernel, args, kwargs, grid)] of every Triton launch made while ``fn()`` runs."""
    launches, original = [], JITFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        if not warmup:
            launches.append((self, args, dict(kwargs), grid))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = spy
    try:
        fn()
    finally:
        JITFunction.run = original
    return launches


def time_us(fn, reps: int) -> float:
    """Median host µs of ``fn()`` over ``reps`` calls in blocks of 20, GPU kept busy."""
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.005)
    samples = []
    for _ in range(max(1, reps // 20)):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles * 4)
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        samples.append((time.perf_counter() - t0) / 20 * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()

    import host_overhead  # scripts/ sibling: the same block as the host-time table

    from interlace.strategies.sequential import gathered_expert_ffn

    cfg = PRESETS[args.config]
    x, w_up, w_down, src_row, inverse, offs, dy, R = host_overhead.block(cfg, args.tokens, args.world,
                                                                         torch.device("cuda"))

    def call():
        y = gathered_expert_ffn("triton", x, src_row, inverse, R, w_up, w_down, offs, cfg.activation)
        y.backward(dy)
        x.grad = w_up.grad = w_down.grad = None

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    from interlace.kernels import launch as fast_launch

    with fast_launch.jit_path():  # every launch through JITFunction.run, where the spy sees it
        launches = record_launches(call)
    torch.cuda.synchronize()

    rows = []
    device = driver.active.get_current_device()
    for kernel, a, kw, grid in launches:
        kernel_cache, key_cache, _, _, binder = kernel.device_caches[device]
        opts = dict(kw, debug=kw.get("debug", kernel.debug) or knobs.runtime.debug,
                    instrumentation_mode=knobs.compilation.instrumentation_mode)
        bound, spec, options = binder(*a, **opts)
        compiled = kernel_cache[compute_cache_key(key_cache, spec, options)]
        g = tuple(grid) + (1,) * (3 - len(grid))
        stream = driver.active.get_current_stream(device)
        values = tuple(bound.values())
        row = {
            "kernel": kernel.__name__,
            "jit": time_us(lambda: kernel[grid](*a, **kw), args.reps),
            "bind": time_us(lambda: binder(*a, **opts), args.reps),
            "key": time_us(lambda: compute_cache_key(key_cache, spec, options), args.reps),
            "dev+stream": time_us(lambda: driver.active.get_current_stream(driver.active.get_current_device()),
                                  args.reps),
            "run": time_us(lambda: compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                                                None, None, None, *values), args.reps),
        }
        fast_launch.launch(kernel, grid, *a, **kw)  # the first call fills the cache
        row["fast"] = time_us(lambda: fast_launch.launch(kernel, grid, *a, **kw), args.reps)
        rows.append(row)
    cols = [c for c in ("jit", "bind", "key", "dev+stream", "run", "fast") if c in rows[0]]
    print(f"{args.config} {args.tokens} tokens: {len(rows)} Triton launches per forward + backward")
    print("| kernel | " + " | ".join(f"{c} µs" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['kernel']} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |")
    print("| sum | " + " | ".join(f"{sum(r[c] for r in rows):.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
