"""Weak scaling from harness results at several world sizes (FlashDMoE's overlap efficiency).

    python benchmarks/scaling_report.py RESULTS_W2.json RESULTS_W4.json [RESULTS_W8.json ...]

Each file is an ``interlace bench`` results.json taken at a fixed tokens-per-GPU grid on a
different machine size. For every (config, tokens/GPU, routing, mode, strategy) present in the
smallest world and in a larger one it prints T(W_min)/T(W) — 1.0 is perfect weak scaling
(the per-GPU work is the same, only the communication fan-out grows).
"""

from __future__ import annotations

import json
import sys


def load(path):
    data = json.load(open(path))
    world = data["meta"]["world"]
    return world, {(r["config"], r["tokens"], r["routing"], r["mode"], r["strategy"]): r["median_ms"]
                   for r in data["rows"] if r.get("median_ms")}


def main(paths):
    runs = sorted((load(p) for p in paths), key=lambda wr: wr[0])
    if len(runs) < 2:
        raise SystemExit("give results of at least two world sizes")
    base_world, base = runs[0]
    worlds = [w for w, _ in runs[1:]]
    print("| config | tokens/GPU | routing | mode | strategy | " + " | ".join(
        f"T({base_world})/T({w})" for w in worlds) + " |")
    print("|---|---|---|---|---|" + "---|" * len(worlds))
    for key, t0 in sorted(base.items()):
        cells = [f"{t0 / rows[key]:.2f}" if key in rows else "–" for _, rows in runs[1:]]
        print("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
