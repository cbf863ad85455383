"""Why one bench row's forward+backward moves between rounds (flashdmoe-cfg 16384: 4.4 or 4.9 ms).

Alternating phases of torch and Triton forward+backward calls on one bench row (the bench's own
data), each call between CUDA events, with the host's time to issue it (no sync inside a phase).
Per phase it prints the median and spread of the GPU times and the host issue times, and the
largest gaps between one call's end and the next call's start on the GPU (the GPU waiting for the
host). If the slow phases show host issue times above the GPU times, the row is host-bound there.

Usage (GPU): ``python scripts/fb_spread_probe.py --config flashdmoe-cfg --tokens 16384 --phases 6 --calls 30``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from bench_expert_kernels import bench_rows, block


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="flashdmoe-cfg")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--phases", type=int, default=6)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = bench_rows(SimpleNamespace(configs=[args.config], tokens=[args.tokens], world=2, seed=0))
    name, cfg, T, w_up, w_down, weights, index, x, grad = next(rows)
    leaves = {b: [t.detach().requires_grad_() for t in (x, w_up, w_down, weights)] for b in ("torch", "triton")}
    phases = []
    for ph in range(args.phases):
        backend = ("torch", "triton")[ph % 2]
        ls = leaves[backend]
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.calls)]
        issue = []
        torch.cuda.synchronize()
        for start, end in events:
            for t in ls:
                t.grad = None
            t0 = time.perf_counter()
            start.record()
            block(backend, *ls, index, cfg.activation).backward(grad)
            end.record()
            issue.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        gpu = [s.elapsed_time(e) for s, e in events]
        gaps = [events[i][1].elapsed_time(events[i + 1][0]) for i in range(len(events) - 1)]
        phase = {"phase": ph, "backend": backend, "gpu_ms": gpu, "issue_ms": issue, "gap_ms": gaps}
        phases.append(phase)
        print(f"phase {ph} {backend:6s} gpu median {statistics.median(gpu):.3f} ms (min {min(gpu):.3f}, max "
              f"{max(gpu):.3f}); host issue median {statistics.median(issue):.3f} ms (max {max(issue):.3f}); "
              f"GPU idle between calls: median {statistics.median(gaps):.3f}, max {max(gaps):.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": name, "tokens": T, "phases": phases}, f)


if __name__ == "__main__":
    main()
