"""A/B two checkouts of interlace with the bench, in interleaved rounds, on one machine.

    python3 benchmarks/ab_trees.py --tree old=/path/to/old --tree new=. --rounds 2 --out OUT \\
        -- --tokens 4096 16384 --strategies sequential pipelined fused auto

Each round runs ``interlace bench`` (``torchrun -m``; ``--nproc`` ranks) once per tree, in the order
given, rotated every round, each from its own folder (``python -m`` puts the working folder first on
``sys.path``, so a tree is imported from where it runs). Arguments after ``--`` go to every bench call.
Per row (config, tokens, routing, mode, strategy) the result is the median of the rounds' medians for
each tree and the ratio ``tree_i / tree_0``; rows any tree failed on are listed as failed. Writes
``OUT/ab.json`` (every round's rows), ``OUT/LABEL-median.json`` per tree (a bench results file whose rows
carry the median over rounds, its ratios recomputed from it: what ``benchmarks/performance_page.py``
takes as a source) and prints the table last. Rounds split over several machine calls
are pooled afterwards with ``python3 benchmarks/ab_trees.py --merge A/ab.json B/ab.json``. A tree without ``interlace/tools/bench.py``
is run as ``-m interlace.bench`` (the layout before the move to ``interlace/tools``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def bench_module(tree: str) -> str:
    return "interlace.tools.bench" if os.path.exists(os.path.join(tree, "interlace", "tools", "bench.py")) \
        else "interlace.bench"


PIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pin_cpus")


def run_round(label: str, tree: str, nproc: int, bench_args: list[str], out: str, timeout: float,
              pin: bool = False) -> list[dict]:
    tree = os.path.abspath(tree)
    dest = os.path.join(out, label)
    # --pin: pin_cpus/sitecustomize.py gives each rank its own block of physical cores.
    path = tree + (os.pathsep + PIN_DIR if pin else "")
    env = dict(os.environ, PYTHONPATH=path, INTERLACE_COMMIT=label, PYTHONUNBUFFERED="1")
    cmd = ["torchrun", "--nproc-per-node", str(nproc), "-m", bench_module(tree), *bench_args, "--out", dest]
    print(f"+ ({label}) {' '.join(cmd)}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired as err:
        print(f"  ({label}) no result within {timeout:.0f} s; this round counts as failed for it")
        partial = b"".join(p if isinstance(p, bytes) else p.encode() for p in (err.stdout, err.stderr) if p)
        with open(os.path.join(out, f"{label}.log"), "a") as f:
            f.write(partial.decode(errors="replace") + f"\n[timed out after {timeout:.0f} s]\n")
        return []
    with open(os.path.join(out, f"{label}.log"), "a") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(f"  ({label}) exit {proc.returncode}; last lines:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
        return []
    with open(os.path.join(dest, "results.json")) as f:
        return json.load(f)["rows"]


def row_key(r: dict) -> tuple:
    return (r["config"], r["tokens"], r["routing"], r["mode"], r["strategy"])


TIMINGS = {"median_ms": "a barrier before each call", "back_to_back_ms": "calls back to back"}


def print_table(labels: list[str], rounds: list[dict], field: str = "median_ms") -> float:
    """The per-row table of medians over the rounds of ``field`` (a bench row's ``median_ms`` or
    ``back_to_back_ms``) and their ratios; returns the largest |ratio − 1|. The last column is
    the range of the per-round ratios (tree i / tree 0 of the same round): how far one round
    alone can be off, which says how many rounds a row needs."""
    times: dict[tuple, dict[str, list[float]]] = {}
    paired: dict[tuple, dict[tuple, float]] = {}
    for rnd in rounds:
        for r in rnd["rows"]:
            if r.get("status") == "ok" and r.get(field) is not None:
                times.setdefault(row_key(r), {}).setdefault(rnd["tree"], []).append(r[field])
                paired.setdefault(row_key(r), {})[(rnd.get("file", 0), rnd["round"], rnd["tree"])] = r[field]
    if not times:
        return 0.0
    print(f"\n{field} ({TIMINGS.get(field, field)}), the median over rounds:")
    print("\n| config | tokens | routing | mode | strategy | " + " | ".join(f"{l} ms" for l in labels)
          + " | " + " | ".join(f"{l}/{labels[0]}" for l in labels[1:]) + " | per-round range |")
    print("|" + "---|" * (5 + 2 * len(labels)))
    worst = 0.0
    for key in sorted(times):
        per = times[key]
        meds = [statistics.median(per[l]) if l in per else None for l in labels]
        ratios = [f"{m / meds[0]:.3f}" if m and meds[0] else "failed" for m in meds[1:]]
        for m in meds[1:]:
            if m and meds[0]:
                worst = max(worst, abs(m / meds[0] - 1))
        pairs = paired[key]
        per_round = [pairs[(f, i, labels[1])] / pairs[(f, i, labels[0])] for (f, i, t) in pairs
                     if t == labels[0] and (f, i, labels[1]) in pairs]
        spread = f"{min(per_round):.2f}–{max(per_round):.2f}" if per_round else "-"
        print("| " + " | ".join(str(k) for k in key) + " | "
              + " | ".join(f"{m:.3f}" if m else "failed" for m in meds) + " | " + " | ".join(ratios)
              + f" | {spread} |")
    print(f"\nlargest |ratio − 1|: {worst:.3f}")
    return worst


def median_results(label: str, rounds: list[dict], meta: dict) -> dict:
    """One bench results file for ``label``: each row's median over the rounds, with × floor,
    speedup over naive and TFLOP/s scaled to it; ``times_ms`` holds every round's median. A row
    timed back to back too gets the median of those (``back_to_back_ms``; every round's in
    ``back_to_back_times_ms``): the last round's alone would be one sample."""
    per: dict[tuple, list[dict]] = {}
    for rnd in rounds:
        if rnd["tree"] == label:
            for r in rnd["rows"]:
                if r.get("status") == "ok" and r.get("median_ms"):
                    per.setdefault(row_key(r), []).append(r)
    rows = []
    for key, rs in per.items():
        ms = statistics.median(r["median_ms"] for r in rs)
        row = dict(rs[-1], median_ms=ms, times_ms=[r["median_ms"] for r in rs])
        if row.get("floor_ms"):
            row["x_floor"] = ms / row["floor_ms"]
        if rs[-1].get("tflops"):
            row["tflops"] = rs[-1]["tflops"] * rs[-1]["median_ms"] / ms
        if row.get("decode_floor_ms"):
            row["x_decode_floor"] = ms / row["decode_floor_ms"]
        b2b = [r["back_to_back_ms"] for r in rs if r.get("back_to_back_ms") is not None]
        if b2b:
            row["back_to_back_ms"], row["back_to_back_times_ms"] = statistics.median(b2b), b2b
        rows.append(row)
    naive = {row_key(r)[:4]: r["median_ms"] for r in rows if r["strategy"] == "naive"}
    for r in rows:
        if row_key(r)[:4] in naive:
            r["speedup_vs_naive"] = naive[row_key(r)[:4]] / r["median_ms"]
    rows.sort(key=lambda r: (r["config"], r["tokens"], r["routing"], r["mode"]))
    return {"meta": dict(meta, rounds=len({rnd["round"] for rnd in rounds if rnd["tree"] == label})), "rows": rows}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--merge"]:
        files = [json.load(open(f)) for f in argv[1:]]
        rounds = [dict(rnd, file=i) for i, f in enumerate(files) for rnd in f["rounds"]]
        for field in TIMINGS:
            print_table(list(files[0]["trees"]), rounds, field)
        return 0
    own, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, help="LABEL=PATH of a checkout (two or more)")
    p.add_argument("--rounds", type=int, default=2, help="bench calls per tree")
    p.add_argument("--nproc", type=int, default=2, help="ranks (GPUs) per bench call")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--timeout", type=float, default=900, help="seconds per bench call")
    p.add_argument("--pin", action="store_true",
                   help="pin each rank to its own block of physical CPU cores (benchmarks/pin_cpus)")
    args = p.parse_args(own)
    trees = [t.split("=", 1) for t in args.tree]
    if len(trees) < 2 or any(len(t) != 2 for t in trees):
        p.error("give at least two --tree LABEL=PATH")
    os.makedirs(args.out, exist_ok=True)
    rounds = []
    for i in range(args.rounds):
        order = trees[i % len(trees):] + trees[:i % len(trees)]
        for label, path in order:
            rows = run_round(label, path, args.nproc, bench_args, args.out, args.timeout, args.pin)
            rounds.append({"round": i, "tree": label, "rows": rows})
            # after every call, so a machine call that ends early still leaves the rounds done so far
            with open(os.path.join(args.out, "ab.json"), "w") as f:
                json.dump({"trees": dict(trees), "bench_args": bench_args, "pin": args.pin, "rounds": rounds}, f, indent=1)
    for label, _ in trees:
        meta_path = os.path.join(args.out, label, "results.json")
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                meta = json.load(f)["meta"]
            with open(os.path.join(args.out, f"{label}-median.json"), "w") as f:
                json.dump(median_results(label, rounds, meta), f, indent=1)
    for field in TIMINGS:
        print_table([t[0] for t in trees], rounds, field)
    return 0


if __name__ == "__main__":
    sys.exit(main())
