"""Writes docs/performance.md, the current standing, from the JSON sources listed in SOURCES.

The page opens with one table, drawn from the rows of the tables SUMMARY names: per preset and
regime (decode, prefill, training) the fastest strategy, its × floor and its speed-up over
``naive`` and over Tutel where the run has those rows; then the tables behind it, section by section.

    python benchmarks/performance_page.py            # rewrite docs/performance.md
    python benchmarks/performance_page.py --check    # exit 1 if docs/performance.md differs from its sources
    python benchmarks/performance_page.py --out P    # write elsewhere

To record a new standing: copy the run's ``results.json`` (``interlace bench --out DIR`` writes it) into
``benchmarks/results/`` under a name that says what it is, and add one line to SOURCES with the same
``table`` key as the row it replaces (the last source listed for a key wins). ``date``, ``commit``,
``device`` and ``command`` may be left out where the JSON's ``meta`` has them; give them where it does
not (hand-kept or older files). Then run this script and commit the page with its source.
The other kinds draw what their own scripts write (benchmarks/hf_models.py, auto_grid.py's rows.jsonl),
copied the same way; ``fp8_layer`` a bench run with ``--fp8``. The timing protocol behind every number is docs/benchmarking.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PAGE = os.path.join(ROOT, "docs", "performance.md")

NVLS_OFF = "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"

# One entry per table source. Keys: section (prefill, decode, training, hf, scaling, planner, auto), table
# (the table's identity: a later entry with the same key replaces an earlier one), kind (how it is drawn:
# bench, decode_bench, persistent_decode, weak_scaling, mesh, facts, hf_models, auto_grid, fp8_layer), file or
# files (under benchmarks/results/; auto_grid reads JSON lines), title, and where the
# JSON lacks them: device, date, commit, command. Optional: baseline (the strategy the others are
# compared with), env (variables set for the command; default NVLS_OFF), notes (lines under the table),
# peer_latency_us (decode_bench: the latency in µs its decode floor counts twice, None for none; default
# the run's own), timing (decode_bench: "back_to_back" reads the rows' back_to_back_ms, bench's
# --back-to-back; default their median_ms, a barrier before each call), barrier_line (decode_bench with
# timing="back_to_back": a line on the same rows' barrier-timed calls), source (facts: the line under the
# table, instead of the JSON's note), tokens (weak_scaling: the token counts shown; default all), presets
# (auto_grid: False leaves out its preset rows, auto against auto uncalibrated), timing (fp8_layer: as decode_bench's).
# The page is the standing, not its history: a note says what a table measured and how to read it, never
# how it compares with an earlier commit or what was tried and not kept (commit messages hold those).
# A fresh forward run on 2 GPUs, for example, is one line at the end:
#   dict(section="prefill", table="prefill-h200x2", kind="bench", file="h200x2-forward-2026-12-01.json",
#        title="Forward, 2× H200: sequential and fused", baseline="sequential"),
DECODE_COMMAND = ("torchrun --nproc-per-node 2 -m interlace.tools.bench --configs qwen3-30b-a3b mixtral-8x7b phi3.5-moe "
                  "qwen2-moe flashdmoe-cfg dsv3-like --tokens 1 8 32 128 512 --strategies fused sequential persistent "
                  "auto --interleave --back-to-back 20 --out DIR")
SOURCES = [
    dict(section="fp8", table="fp8-prefill-h200x2", kind="fp8_layer", file="h200x2-fp8-prefill.json",
         title="FP8 layer against bf16, prefill, 2× H200",
         notes=["FP8: the same weights in block-scaled e4m3 (W8A8 in `sequential`), 6.4e-2 from the bf16 "
                "`naive` output (block FP8's own error); its floor from the e4m3 peak. No FP8 strategy overlaps "
                "the all-to-all."]),
    dict(section="fp8", table="fp8-decode-h200x2", kind="fp8_layer", file="h200x2-fp8-decode.json",
         title="FP8 layer against bf16, decode, 2× H200: calls back to back", timing="back_to_back",
         notes=["ms as in the decode table. FP8 decode floor: e4m3 weights and scales ÷ HBM read. "
                "FP8 `persistent` is W8A16 ([fp8.md](fp8.md))."]),
    dict(section="training", table="training-h200x2", kind="bench", file="h200x2-training.json",
         title="Forward + backward, 2× H200: sequential, fused:train, fused:lean and auto", baseline="sequential",
         commit="f6cd237",
         command="torchrun --nproc-per-node 2 -m interlace.tools.bench --tokens 4096 8192 --mode fwdbwd --strategies "
                 "sequential fused:train fused:lean auto --interleave",
         notes=["GiB: steady peak, alone, graph pools included; fused:train keeps W·cap rows, fused:lean those "
                "received; auto calibrated."]),
    dict(section="training", table="roofline-qwen3-h200", kind="facts", file="h200-qwen3-roofline.json",
         title="Roofline of a qwen3-30b-a3b training call, 1× H200",
         device="1× NVIDIA H200", date="2026-11-29", commit="9882890", env="",
         command="python benchmarks/bench_expert_kernels.py --configs qwen3-30b-a3b --tokens 4096 16384 --world 2 "
                 "--breakdown --profile-fb"),
    dict(section="scaling", table="weak-scaling-h200", kind="weak_scaling",
         files=["h200x2-forward-3598717.json", "h200x4-forward.json"],
         title="Weak scaling T(2) ÷ T(4) at fixed tokens per GPU, forward (1.0 is perfect)", tokens=[4096, 16384],
         device="2× and 4× NVIDIA H200", date="2026-11-22", commit="3598717",
         command="torchrun --nproc-per-node W -m interlace.tools.bench --strategies sequential fused "
                 "--tokens 4096 8192 16384 --interleave   # W = 2, then W = 4; "
                 "python benchmarks/scaling_report.py W2/results.json W4/results.json"),
    dict(section="scaling", table="weak-scaling-decode-h200x4", kind="weak_scaling", timing="back_to_back",
         files=["h200x4-decode-weak-w2.json", "h200x4-decode-weak-w4.json"],
         title="Decode weak scaling T(2) ÷ T(4) at fixed tokens per GPU (FlashDMoE's overlap efficiency; 1.0 is "
               "perfect), calls back to back",
         device="4× NVIDIA H200 (W = 2 on two of them, in the same lease)", date="2026-11-26", commit="5c9a3b7",
         command="CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 -m interlace.tools.bench --configs "
                 "qwen3-30b-a3b --tokens 128 512 --strategies fused persistent --interleave --back-to-back 20 "
                 "--out W2; then --nproc-per-node 4 on all four, --out W4",
         notes=["Outputs checked against `naive`. At W = 4 a rank holds half the experts, so its floor halves "
                "while `persistent`'s fixed latencies stay."]),
    dict(section="scaling", table="mesh-h200x4", kind="mesh", file="h200x4-mesh.json",
         title="EP × TP at equal layer tokens M, mixtral-8x7b forward, 4× H200",
         device="4× NVIDIA H200", date="2026-11-22", commit="0032977",
         command="torchrun --nproc-per-node 4 benchmarks/mesh_bench.py --config mixtral-8x7b --layer-tokens 8192 32768"),
    dict(section="planner", table="planner-pipelined-h200x2", kind="facts", file="h200x2-planner-pipelined.json",
         title="Pipeline degree planner (`pipelined`, `auto`): 40-point grid, degrees 1–16",
         device="2× NVIDIA H200", date="2026-11-22", commit="fadf2b5",
         command="torchrun --nproc-per-node 2 -m interlace.tools.evaluate --profile-first --also-profile mixtral-8x7b "
                 "phi3.5-moe qwen2-moe qwen3-30b-a3b dsv3-like flashdmoe-cfg --warmup 3 --iters 10 --merge-points "
                 "interlace/tuning/profiles/runs/run7-NVIDIA_H200-sm132-w2-n1-p2p.json "
                 "interlace/tuning/profiles/runs/run13-NVIDIA_H200-sm132-w2-n1-p2p.json"),
    dict(section="planner", table="planner-tp-ep-h200x2", kind="facts", file="h200x2-planner-tp-ep.json",
         title="TP × EP planner (`interlace plan`, `tp_ep` forms): predicted against measured layer times",
         device="2× NVIDIA H200", date="2026-11-22", commit="fadf2b5",
         command="torchrun --nproc-per-node 2 benchmarks/device_tp_ep.py --configs qwen2-moe flashdmoe-cfg "
                 "mixtral-8x7b --profile-tp --skip-priority --skip-check"),
    dict(section="prefill", table="prefill-h200x2", kind="bench", file="h200x2-forward.json",
         title="Forward, 2× H200: sequential, fused, persistent and auto", baseline="sequential", commit="d4bcd34",
         command="torchrun --nproc-per-node 2 -m interlace.tools.bench --tokens 4096 16384 --strategies sequential "
                 "fused persistent auto --interleave",
         notes=["`auto` timed after its calibration (served first); its pick: the JSON's `choice`."]),
    dict(section="decode", table="decode-persistent-b2b-h200x2", kind="decode_bench", file="h200x2-decode-persistent.json",
         title="Decode, 2× H200: every strategy against the decode floor, calls back to back (as in a model's "
               "forward)",
         device="2× NVIDIA H200", date="2026-11-27", commit="59ce3d4", command=DECODE_COMMAND, timing="back_to_back",
         barrier_line=True,
         notes=["ms: 20 calls back to back (one barrier before them, CUDA events around them all) ÷ 20, median of 3 "
                "round-robin rounds, the slowest rank's; same input every call (the touched weights exceed the L2). "
                "The line above the table: a barrier and CUDA events around each call, median of 20. Every output "
                "checked against `naive` before and after timing.",
                "Decode floor: the largest of the prefill floor, the busiest rank's touched expert weights ÷ the HBM "
                "read bandwidth, and two peer latencies, all measured in the run (below 1.00×: streamed faster than "
                "the run's bandwidth measurement).",
                "auto ran: its decision for the row."]),
    dict(section="decode", table="persistent-timeline-h200x2", kind="facts", file="h200x2-persistent-timeline.json",
         title="Where a `persistent` decode call spends its time, 2× H200: qwen3-30b-a3b at 128 and 512 tokens per GPU",
         device="2× NVIDIA H200", date="2026-11-27", commit="59ce3d4",
         command="torchrun --nproc-per-node 2 -m interlace.tools.timeline --strategy persistent --config "
                 "qwen3-30b-a3b --tokens T --iters 10 --out $OUT   # T = 128, then 512",
         source="Per-task %globaltimer records of the last of 5 calls, rank 0 (rank 1's spans: 186.3 and 244.2 "
                "µs); windows from the first task's end of waits to the last task's end."),
    dict(section="hf", table="hf-models-h200x2", kind="hf_models", file="h200x2-hf-models.json",
         title="Qwen3-MoE-like and DeepSeek-V3-like models, 2× H200: HF's MoE blocks against interlace's default",
         device="2× NVIDIA H200", date="2026-11-30", commit="2682584",
         command="torchrun --nproc-per-node 2 benchmarks/hf_models.py --out $OUT --compile --baseline sequential",
         notes=["HF's blocks data parallel; interlace's experts sharded over the ranks, `auto` timed once decided."]),
    dict(section="auto", table="auto-grid-h100x2", kind="auto_grid", presets=False, file="h100x2-auto-grid.jsonl",
         title="`auto` on shapes it never saw, 2× H100: against the fastest candidate, timed round-robin",
         device="2× NVIDIA H100 80GB HBM3", date="2026-11-26", commit="d61bbaa",
         command="torchrun --nproc-per-node 2 benchmarks/auto_grid.py --part 1/2 --no-presets --budget-s 480 --out "
                 "grid1; ... --part 2/2 --no-presets --budget-s 330 --out grid2; ... --part 2/2 --limit 0 --ship "
                 "--budget-s 150 --out presets   # rows.jsonl of the three, concatenated",
         notes=["32 shapes × tokens {128, 3000, 8192} × {fwd, fwd+bwd}, candidates and auto interleaved per row. "
                "First-call overhead: the calibration calls minus "
                "as many steady calls, Triton compiles included."]),
]

SECTIONS = [
    ("prefill", "Prefill / inference forward",
     "Random routing (softmax top-k over random router weights), bf16. Training-size token counts per GPU."),
    ("decode", "Decode", "1 to 512 tokens per GPU, random routing, bf16."),
    ("fp8", "FP8 experts (inference)",
     "Block-scaled e4m3 experts ([fp8.md](fp8.md)) against bf16."),
    ("training", "Training (forward + backward)",
     "One training call: forward, then backward with a random output gradient; floor with 3× the FLOPs term."),
    ("hf", "Hugging Face models",
     "Whole transformers models (random weights) on HF's own MoE blocks and on interlace's "
     "(`interlace.hf.replace_moe_blocks`), bf16; tokens/s counts both ranks."),
    ("scaling", "Scaling", "Weak scaling from 2 to 4 GPUs (T(4): the 4-GPU times) and EP × TP factorisations."),
    ("planner", "Planner accuracy", "How close the planners' predictions come to measured layer times."),
    ("auto", "Strategy choice (auto)",
     "Whether `auto` runs the fastest strategy on shapes it never saw, and what its first calls cost."),
]

# What to run for a section that has no source yet.
PENDING: dict[str, str] = {}


def fmt(value, spec):
    return "–" if value is None else format(value, spec)


def load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def plain_command(meta):
    """The bench's recorded argv as a torchrun command (the meta keeps ``sys.argv``, not the launcher)."""
    args = shlex.split(meta.get("command", ""))
    if not args:
        return None
    rest, skip = [], False
    for a in args[1:]:
        if skip:
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        rest.append(a)
    return f"torchrun --nproc-per-node {meta.get('world', 1)} -m interlace.tools.bench " + " ".join(rest)


def provenance(src, meta=None):
    """(date, device, commit) of a source: its own keys, else its JSON's meta."""
    meta = meta or {}
    date = src.get("date") or (meta.get("date") or "")[:10] or "–"
    commit = src.get("commit") or meta.get("commit") or "–"
    device = src.get("device") or (f"{meta['world']}× {meta['device']}" if meta.get("device") else "–")
    return date, device, commit


def header(src, meta=None):
    meta = meta or {}
    date, device, commit = provenance(src, meta)
    command = src.get("command") or plain_command(meta) or "–"
    lines = [f"### {src['title']}", "", f"{date} · {device} · commit `{commit}`"]
    ceilings = meta.get("ceilings") or {}
    if ceilings.get("matmul_tflops"):
        lines[-1] += (f" · ceilings in the same run: bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s, "
                      f"peer copy {fmt(ceilings.get('peer_gbps'), '.0f')} GB/s")
    env = src.get("env", NVLS_OFF)  # every recorded GPU run had NVLink multicast off
    env = f"{env} " if env else ""
    lines += ["", "```bash", env + command, "```", ""]
    return lines


REFERENCES = ("naive", "tutel")  # the baselines the summary compares with: never a row's fastest


def strategy_order(seen, first=("naive",)):
    """``first`` (those present), then the others as they appear, ``auto`` last."""
    order = [s for s in first if s in seen] + [s for s in seen if s not in first and s != "auto"]
    return order + (["auto"] if "auto" in seen else [])


def fastest(ms):
    """The fastest strategy of one case's {strategy: ms}, ``auto`` (it runs one of the others) and
    the references aside; None if none is left."""
    contest = {s: t for s, t in ms.items() if s != "auto" and s not in REFERENCES}
    return min(contest, key=contest.get) if contest else None


def bench_cases(src, data=None):
    """A bench source's rows as one case per (config, tokens, routing, mode), in the order they
    first appear: ``by`` {strategy: row}, ``ms`` {strategy: median ms} and ``x`` {strategy: × floor}
    of the rows that ran and passed their check."""
    data = data or load(src["file"])
    cases = {}
    for r in data["rows"]:
        case = cases.setdefault((r["config"], r["tokens"], r.get("routing", "random"), r.get("mode", "fwd")),
                                dict(config=r["config"], tokens=r["tokens"], routing=r.get("routing", "random"),
                                     by={}, ms={}, x={}))
        case["by"][r["strategy"]] = r
        if r.get("status", "ok") == "ok" and r.get("median_ms"):
            case["ms"][r["strategy"]] = r["median_ms"]
            if r.get("x_floor") is not None:
                case["x"][r["strategy"]] = r["x_floor"]
    return list(cases.values())


def bench_table(src):
    """A bench ``results.json`` as one line per (config, tokens, routing): each strategy's median ms
    side by side, the fastest strategy (``auto`` aside) with its × floor and its speed-up over
    ``naive``, and each strategy's peak memory; then, with a ``baseline``, each strategy against it."""
    data = load(src["file"])
    rows = data["rows"]
    cases = bench_cases(src, data)
    order = strategy_order(list(dict.fromkeys(r["strategy"] for r in rows)))
    routings = len({c["routing"] for c in cases}) > 1
    lines = header(src, data.get("meta"))
    head = (["config", "tokens/GPU"] + (["routing"] if routings else []) + [f"{s} ms" for s in order]
            + ["fastest", "× floor", "vs naive"] + [f"{s} GiB" for s in order])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        best = fastest(c["ms"])
        naive = c["ms"].get("naive")
        cells = [c["config"], str(c["tokens"])] + ([c["routing"]] if routings else [])
        cells += [fmt(c["ms"][s], ".3f") if s in c["ms"] else c["by"][s].get("status", "–") if s in c["by"] else "–"
                  for s in order]
        cells += [best or "–", fmt(c["x"].get(best), ".2f"), fmt(naive / c["ms"][best] if naive and best else None, ".2f")]
        cells += [fmt((c["by"].get(s) or {}).get("peak_gib"), ".2f") for s in order]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    baseline = src.get("baseline")
    if baseline:
        for strategy in order:
            if strategy in ("naive", baseline):
                continue
            ratios = [c["ms"][baseline] / c["ms"][strategy] for c in cases if strategy in c["ms"] and baseline in c["ms"]]
            if ratios:
                ahead = sum(x > 1 for x in ratios)
                lines.append(f"`{strategy}` against `{baseline}` ({baseline} ms ÷ {strategy} ms): "
                             f"{min(ratios):.2f}–{max(ratios):.2f}×, ahead on {ahead} of {len(ratios)} rows.")
        lines.append("")
    return lines


def _find(rows, like, strategy, key="median_ms"):
    for r in rows:
        if (r["strategy"] == strategy and r["config"] == like["config"] and r["tokens"] == like["tokens"]
                and r.get("routing") == like.get("routing") and r.get("mode") == like.get("mode")
                and r.get(key) and r.get("status", "ok") == "ok"):
            return r[key]
    return None


def weak_scaling_table(src):
    """T(W) per row of the runs in ``files`` (one per world size, the same tokens per GPU), and
    T(smallest W) ÷ T(W): FlashDMoE's overlap efficiency where the row is a decode call.
    ``timing="back_to_back"`` reads the rows' back-to-back times; ``tokens`` (optional) the token
    counts shown."""
    key = "back_to_back_ms" if src.get("timing") == "back_to_back" else "median_ms"
    shown = src.get("tokens")
    runs = [load(name) for name in src["files"]]
    runs.sort(key=lambda d: d["meta"]["world"])
    (w0, base), others = (runs[0]["meta"]["world"], runs[0]), runs[1:]
    lines = header(src)
    head = ["config", "tokens/GPU", "strategy", f"T({w0}) ms"]
    for d in others:
        head += [f"T({d['meta']['world']}) ms", f"T({w0}) ÷ T({d['meta']['world']})"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in base["rows"]:
        if r["strategy"] == "naive" or not r.get(key) or (shown and r["tokens"] not in shown):
            continue
        cells = [r["config"], str(r["tokens"]), r["strategy"], fmt(r[key], ".3f")]
        for d in others:
            t = _find(d["rows"], r, r["strategy"], key)
            cells += [fmt(t, ".3f"), fmt(r[key] / t if t else None, ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def mesh_table(src):
    data = load(src["file"])
    lines = header(src)
    lines += ["| layer tokens M | EP × TP | tokens/rank | strategy | median ms | vs the fastest at this M |",
              "|---|---|---|---|---|---|"]
    best = {}
    for r in data["rows"]:
        best[r["layer_tokens"]] = min(best.get(r["layer_tokens"], float("inf")), r["ms"])
    for r in data["rows"]:
        lines.append(f"| {r['layer_tokens']} | {r['ep']} × {r['tp']} | {r['tokens']} | {r['strategy']} | "
                     f"{r['ms']:.3f} | {r['ms'] / best[r['layer_tokens']]:.2f} |")
    return lines + [""]


def facts_table(src):
    data = load(src["file"])
    lines = header(src)
    lines += ["| measure | value |", "|---|---|"]
    cell = lambda text: str(text).replace("|", "\\|")  # a literal | would end the cell
    lines += [f"| {cell(r['what'])} | {cell(r['value'])} |" for r in data["rows"]]
    return lines + ["", f"Source: {src.get('source', data['note'])}", ""]


def hf_models_table(src):
    data = load(src["file"])
    lines = header(src)
    lines += ["| model | layers | optimizer | forward tokens/s HF | interlace | interlace ÷ HF | train step ms HF | "
              "interlace | HF ÷ interlace | sequential ÷ interlace | max rel. loss diff (steps) | compiled tokens/s | "
              "eager | compiled ÷ eager |", "|" + "---|" * 14]
    ratio = lambda a, b: a / b if a and b else None
    for model in dict.fromkeys(r["model"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["model"] == model]  # a skipped or failed part's row lacks its numbers
        part = lambda name, impl="": next((r for r in rows if r["part"] == name
                                           and r.get("impl", "").startswith(impl)), {})
        fwd_hf, fwd_il = (part("forward", impl).get("tokens_per_s") for impl in ("hf", "interlace"))
        step_hf, step_il, step_seq = (part("train", impl).get("step_s_median") for impl in ("hf", "interlace",
                                                                                          "baseline"))
        step_hf, step_il = (None if t is None else 1e3 * t for t in (step_hf, step_il))
        step_seq = 1e3 * step_seq if step_seq and part("train", "baseline").get("strategy") == "sequential" else None
        compiled, eager = (part("compile", impl).get("tokens_per_s")
                           for impl in ("interlace compiled", "interlace eager"))
        known, loss = next((r for r in rows if "layers" in r), {}), part("loss")
        cells = [model, str(known.get("layers", "–")), known.get("optimizer", "–"),
                 fmt(fwd_hf, ","), fmt(fwd_il, ","), fmt(ratio(fwd_il, fwd_hf), ".2f"),
                 fmt(step_hf, ".1f"), fmt(step_il, ".1f"), fmt(ratio(step_hf, step_il), ".2f"),
                 fmt(ratio(step_seq, step_il), ".2f"),
                 f"{fmt(loss.get('max_rel_diff'), '.2e')} ({loss.get('steps', '–')})",
                 fmt(compiled, ","), fmt(eager, ","), fmt(ratio(compiled, eager), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def auto_grid_table(src):
    with open(os.path.join(RESULTS, src["file"])) as f:
        every = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in every if r["kind"] == "grid"]
    presets = [r for r in every if r["kind"] == "preset"] if src.get("presets", True) else []
    lines = header(src)
    ratios, over = [r["ratio"] for r in rows], [r["overhead_ms"] for r in rows]
    within, fastest = sum(x <= 1.05 for x in ratios), [r for r in rows if r["auto_choice"] == r["fastest"]]
    behind = statistics.median(r["auto_ms"] - r["times_ms"][r["auto_choice"]] for r in rows)
    lines += [f"{len(rows)} rows over {len({r['config'] for r in rows})} shapes; auto within 5% of the fastest "
              f"candidate on {within} ({within / len(rows):.0%}); worst auto ÷ fastest {max(ratios):.3f}; auto ran "
              f"the fastest candidate on {len(fastest)} of {len(rows)}; auto behind the candidate it ran by a median "
              f"{1e3 * behind:.0f} µs per call; first-call overhead median {statistics.median(over):.1f} ms, max "
              f"{max(over):.1f} ms; wrong outputs {sum(not r['ok'] for r in rows)}.", ""]
    lines += ["| mode | tokens/GPU | rows | auto within 5% | auto ran the fastest | worst auto ÷ fastest | "
              "median first-call overhead ms |", "|" + "---|" * 7]
    for mode, tokens in dict.fromkeys((r["mode"], r["tokens"]) for r in rows):
        part = [r for r in rows if (r["mode"], r["tokens"]) == (mode, tokens)]
        lines.append(f"| {mode} | {tokens} | {len(part)} | {sum(r['ratio'] <= 1.05 for r in part)} | "
                     f"{sum(r['auto_choice'] == r['fastest'] for r in part)} | {max(r['ratio'] for r in part):.3f} | "
                     f"{statistics.median(r['overhead_ms'] for r in part):.1f} |")
    lines.append("")
    if presets:
        pr = [r["ratio"] for r in presets]
        lines += [f"Preset rows: {len(presets)}; new ÷ old median {statistics.median(pr):.3f}, worst {max(pr):.3f}; "
                  f"new slower than old by more than 5% on {sum(x > 1.05 for x in pr)}.", "",
                  "| preset | tokens/GPU | old ran | old ms | new ran | new ms | new ÷ old | first-call overhead ms |",
                  "|" + "---|" * 8]
        lines += [f"| {r['config']} | {r['tokens']} | {r['old_choice']} | {r['old_ms']:.3f} | {r['new_choice']} | "
                  f"{r['new_ms']:.3f} | {r['ratio']:.3f} | {r['overhead_ms']:.1f} |" for r in presets]
        lines.append("")
    return lines


def persistent_decode_table(src):
    d = load(src["file"])
    meta = d.get("meta", {})
    lines = header(src, {"date": meta.get("date")})
    rows = [r for r in d["rows"] if "error" not in r]
    faster = sum(r["persistent_ms"] < r["sequential_ms"] for r in rows)
    timed = [r for r in rows if r.get("auto_ms")]
    right = sum(r["auto_choice"] == ("persistent" if r["persistent_ms"] < r["sequential_ms"] else "sequential")
                for r in timed)
    lines += [f"HBM read bandwidth (this run): {meta.get('hbm_read_tb_s', 0):.2f} TB/s; `persistent` faster than "
              f"`sequential` on {faster} of {len(rows)} rows; `auto` ran the faster of the two on {right} of "
              f"{len(timed)}; rows in error: {len(d['rows']) - len(rows)}.", "",
              "| preset (E/2 experts) | tokens | experts touched | persistent ms | host ms | sequential ms | host ms "
              "| floor ms | persistent × floor | auto ran | auto ms |", "|" + "---|" * 11]
    lines += [f"| {r['preset']} | {r['tokens']} | {r['touched']} | {r['persistent_ms']:.3f} | "
              f"{r['persistent_host_ms']:.3f} | {r['sequential_ms']:.3f} | {r['sequential_host_ms']:.3f} | "
              f"{r['floor_ms']:.3f} | {r['persistent_ms'] / r['floor_ms']:.2f} | {r.get('auto_choice') or '–'} | "
              f"{fmt(r.get('auto_ms'), '.3f')} |" for r in rows]
    return lines + [""]


DECODE_ORDER = ("naive", "fused", "sequential", "persistent")  # then any others as they appear, auto last


def _expected_weight_bytes(config, tokens, world):
    """For rows written before the bench recorded ``weight_bytes``: the expert weight bytes of
    the local experts one rank can expect to touch under uniform routing (docs/benchmarking.md):
    E / W · (1 − (1 − 1/E)^(W·T·k)) experts (None for a name that is no preset)."""
    if ROOT not in sys.path:  # run as a script from anywhere
        sys.path.insert(0, ROOT)
    from interlace.config import PRESETS, preset  # only here: the page needs no torch otherwise
    if config not in PRESETS:
        return None
    cfg = preset(config)
    E = cfg.num_experts
    experts = E // world * (1 - (1 - 1 / E) ** (world * tokens * cfg.top_k))
    return experts * (cfg.up_width + cfg.ffn) * cfg.hidden * cfg.dtype.itemsize


def decode_cases(src, key=None):
    """A bench ``results.json`` of forward decode rows as one case per (config, tokens, routing), as
    :func:`bench_cases` (``ms`` read from ``key``, default the source's timing), with the decode floor
    ``decode`` recomputed from the rows' own terms (prefill floor, ``weight_bytes`` ÷ the run's HBM
    read bandwidth, two peer latencies: the source's ``peer_latency_us`` when it gives one, None to
    leave that term out, else the run's), ``x`` {strategy: ms ÷ decode floor} and ``estimated``
    (no touched weight bytes recorded: the floor's weights are the expectation under uniform
    routing). Returns (run, cases): run has the HBM bandwidth, latency and world size."""
    data = load(src["file"])
    key = key or ("back_to_back_ms" if src.get("timing") == "back_to_back" else "median_ms")
    meta = data.get("meta", {})
    ceilings = meta.get("ceilings") or {}
    hbm, world = ceilings.get("hbm_tbps"), meta.get("world", 1)
    latency = src["peer_latency_us"] if "peer_latency_us" in src else ceilings.get("peer_latency_us")
    run = dict(meta=meta, hbm=hbm, world=world, latency=latency,
               order=strategy_order(list(dict.fromkeys(r["strategy"] for r in data["rows"]
                                                       if r.get("mode", "fwd") == "fwd")), DECODE_ORDER))
    cases = {}
    for r in data["rows"]:
        if r.get("mode", "fwd") == "fwd":
            cases.setdefault((r["config"], r["tokens"], r.get("routing", "random")),
                             dict(config=r["config"], tokens=r["tokens"], routing=r.get("routing", "random"),
                                  by={}))["by"][r["strategy"]] = r
    for case in cases.values():
        by = case["by"]
        case["ms"] = {s: r[key] for s, r in by.items() if r.get("status", "ok") == "ok" and r.get(key)}
        floor = next((r["floor_ms"] for r in by.values() if r.get("floor_ms") is not None), None)
        weights = next((r["weight_bytes"] for r in by.values() if r.get("weight_bytes") is not None), None)
        estimated = weights is None and not meta.get("small")
        if estimated:
            weights = _expected_weight_bytes(case["config"], case["tokens"], world)
        terms = [floor, weights / (hbm * 1e12) * 1e3 if weights is not None and hbm else None,
                 2 * latency * 1e-3 if world > 1 and latency else None]
        decode = max(t for t in terms if t is not None) if floor is not None and terms[1] is not None else None
        case.update(decode=decode, estimated=bool(estimated and decode),
                    x={s: ms / decode for s, ms in case["ms"].items()} if decode else {})
    return run, list(cases.values())


def decode_bench_table(src):
    """The cases of :func:`decode_cases` as one line each: each strategy's ms side by side, the
    decode floor, × decode floor of ``persistent`` and of the fastest strategy (``auto`` aside: it
    runs one of the others), and what ``auto`` ran. ``timing="back_to_back"``: the rows'
    back-to-back times; ``barrier_line``: a line on the same run's barrier-timed calls too."""
    run, cases = decode_cases(src)
    order, hbm, world, latency = run["order"], run["hbm"], run["world"], run["latency"]
    routings = len({c["routing"] for c in cases}) > 1
    lines = header(src, run["meta"])
    head = ["config", "tokens/GPU"] + (["routing"] if routings else []) + [f"{s} ms" for s in order] + [
        "decode floor ms"] + (["persistent × decode floor"] if "persistent" in order else []) + [
        "fastest", "fastest × decode floor", "auto ran"]
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fastest_count = bar_large = bar_small = large = small = 0
    for c in cases:
        ok, by, decode, mark = c["ms"], c["by"], c["decode"], "≈" if c["estimated"] else ""
        ratio = lambda s: f"{mark}{c['x'][s]:.2f}" if s in c["x"] else "–"
        best = fastest(ok)
        cells = [c["config"], str(c["tokens"])] + ([c["routing"]] if routings else [])
        cells += [fmt(ok.get(s), ".3f") if s in ok else by[s].get("status", "–") if s in by else "–" for s in order]
        cells.append(fmt(decode, ".3f"))
        persistent = ok.get("persistent")
        if "persistent" in order:
            cells.append(ratio("persistent"))
            fastest_count += best == "persistent"
            if persistent and decode:
                if c["tokens"] >= 128:
                    large, bar_large = large + 1, bar_large + (persistent <= 1.5 * decode)
                else:
                    small, bar_small = small + 1, bar_small + (persistent <= 2 * decode or persistent - decode <= 0.030)
        choice = (by.get("auto") or {}).get("choice") or "–"
        cells += [best or "–", ratio(best), choice.split(",")[0] + (")" if "," in choice else "")]
        table.append("| " + " | ".join(cells) + " |")
    lines.append(f"HBM read bandwidth (this run): {fmt(hbm, '.2f')} TB/s; peer latency in the floor: "
                 + (f"{latency:.1f} µs" if world > 1 and latency else "none") + ".")
    if "persistent" in order:
        lines[-1] += (f" `persistent` fastest on {fastest_count} of {len(cases)} rows; within 1.5× the decode floor "
                      f"at ≥ 128 tokens on {bar_large} of {large}; within 2× or 30 µs of it below 128 tokens on "
                      f"{bar_small} of {small}.")
    bounded = sum(c["estimated"] for c in cases)
    if bounded:
        lines[-1] += (f" On {bounded} rows the run recorded no touched weight bytes: their floor counts the local "
                      "experts a rank can expect to touch under uniform routing, E / W · (1 − (1 − 1/E)^(W·T·k)), "
                      "so their × decode floor (≈) is an estimate (exact where every expert is touched: 128 tokens "
                      "and more on these presets).")
    if src.get("barrier_line"):
        _, timed = decode_cases(src, "median_ms")
        winners = [(c, fastest(c["ms"])) for c in timed]
        won = {s: sum(b == s for _, b in winners) for s in dict.fromkeys(b for _, b in winners if b)}
        x = [c["x"][b] for c, b in winners if b in c["x"]]
        lines.append("")
        lines.append("The same run with a barrier before each call (the GPU idle when a call starts, so its host "
                     "time counts): fastest " + ", ".join(f"`{s}` on {n} of {len(timed)} rows" for s, n in won.items())
                     + (f", at {min(x):.2f}–{max(x):.2f}× the decode floor (median {statistics.median(x):.2f})"
                        if x else "") + ".")
    return lines + [""] + table + [""]


# The page's first table: per regime, the key of the table whose rows it reads (that key's current source).
SUMMARY = (("decode", "decode-persistent-b2b-h200x2"), ("prefill", "prefill-h200x2"), ("training", "training-h200x2"))


def _span(values, spec, unit=""):
    """'a–b' over the values (one value where they format alike), '—' for none."""
    if not values:
        return "—"
    lo, hi = format(min(values), spec), format(max(values), spec)
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def summary_table(chosen):
    """Per preset and regime (SUMMARY): the fastest strategy of the regime's table (per token count,
    ``auto`` and the references aside), its × floor and its speed-up over each reference, as ranges
    over the token counts; '—' where the run has no row of a reference, said once under the table,
    and no column for a reference no run has."""
    by_key = {src["table"]: src for src in chosen}
    regimes = [(regime, by_key[key]) for regime, key in SUMMARY if key in by_key]
    cases = {regime: decode_cases(src)[1] if src["kind"] == "decode_bench" else bench_cases(src)
             for regime, src in regimes}
    presets = list(dict.fromkeys(c["config"] for regime, _ in regimes for c in cases[regime]))
    rows = []
    shown = {ref: 0 for ref in REFERENCES}  # rows with a speed-up over the reference
    total = 0
    for preset in presets:
        for regime, _ in regimes:
            won = [(c, fastest(c["ms"])) for c in cases[regime] if c["config"] == preset]
            won = [(c, best) for c, best in won if best]
            if not won:
                continue
            counts = {}
            for c, best in won:
                counts.setdefault(best, []).append(str(c["tokens"]))
            first, *others = sorted(counts, key=lambda s: -len(counts[s]))
            cell = f"`{first}`" + (" (" + "; ".join(f"`{s}` at {', '.join(counts[s])}" for s in others) + ")"
                                   if others else "")
            cells = [preset, regime, ", ".join(str(c["tokens"]) for c, _ in won), cell,
                     _span([c["x"][best] for c, best in won if best in c["x"]], ".2f")]
            for ref in REFERENCES:
                ratios = [c["ms"][ref] / c["ms"][best] for c, best in won if ref in c["ms"]]
                shown[ref] += bool(ratios)
                cells.append(_span(ratios, ".2f", "×"))
            rows.append(cells)
            total += 1
    names = {"naive": "`naive`", "tutel": "Tutel"}
    refs = [i for i, ref in enumerate(REFERENCES) if shown[ref]]  # (a reference no run has: no column)
    head = ["preset", "regime", "tokens/GPU", "fastest", "× floor"] + [
        ("speed-up over " if i == 0 else "over ") + names[REFERENCES[i]].strip("`") for i in refs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells[:5] + [cells[5 + i] for i in refs]) + " |" for cells in rows]
    lines.append("")
    lines.append("fastest: per token count, `auto` aside (it runs one of the others); where it differs between "
                 "token counts, the others follow. × floor and speed-ups: that strategy's, ranges over the token "
                 "counts. The rows come from:")
    lines.append("")
    for regime, src in regimes:
        date, device, commit = provenance(src, load(src["file"]).get("meta"))
        floor = ("the decode floor" if src["kind"] == "decode_bench" else "the training floor (3× the FLOPs term)"
                 if any(r.get("mode") == "fwdbwd" for r in load(src["file"])["rows"]) else "the floor")
        lines.append(f"- {regime}: *{src['title']}* ({date}, {device}, commit `{commit}`), × {floor}.")
    for ref in REFERENCES:
        if 0 < shown[ref] < total:
            lines.append(f"- Over {names[ref]}: — where the run behind the row has no `{ref}` row.")
    return lines + [""]


def fp8_layer_table(src):
    """A bench run with ``--fp8``: per case the fastest bf16 strategy against each strategy on the
    layer's FP8 twin (``experts = "fp8"``), each × its floor (FP8 rows: the e4m3 peak and weight
    bytes), and the fastest FP8 row's speed-up. ``timing="back_to_back"`` reads ``back_to_back_ms``
    and the decode floors; else the barrier-timed medians and the prefill floors."""
    data = load(src["file"])
    meta = data["meta"]
    lines = header(src, meta)
    ceilings = meta.get("ceilings") or {}
    lines[2] += (f", e4m3 matmul {fmt(ceilings.get('fp8_tflops'), '.0f')} TFLOP/s, HBM read "
                 f"{fmt(ceilings.get('hbm_tbps'), '.2f')} TB/s")
    b2b = src.get("timing") == "back_to_back"
    key, x_key = ("back_to_back_ms", "x_decode_floor") if b2b else ("median_ms", "x_floor")
    floor_key = "decode_floor_ms" if b2b else "floor_ms"
    cases, fp8_names = {}, []
    for r in data["rows"]:
        if r.get("status", "ok") != "ok" or r.get(key) is None or r["strategy"] == "naive":
            continue
        case = cases.setdefault((r["config"], r["tokens"]), {"bf16": {}, "fp8": {}})
        case[r.get("experts", "bf16")][r["strategy"]] = r
        if r.get("experts") == "fp8" and r["strategy"] not in fp8_names:
            fp8_names.append(r["strategy"])
    floor_word = "decode floor" if b2b else "floor"
    lines += ["| preset | tokens/GPU | fastest bf16 ms (× " + floor_word + ") | "
              + " | ".join(f"FP8 {name} ms (×)" for name in fp8_names)
              + " | FP8 speed-up |", "|" + "---|" * (4 + len(fp8_names))]
    for (config, tokens), case in cases.items():
        def ratio(r):  # (the page's own division: rows of a bench run before x_decode_floor was kept)
            return r[key] / r[floor_key] if r.get(floor_key) else None
        bf16 = {s: r for s, r in case["bf16"].items() if s != "auto"}
        best = min(bf16.values(), key=lambda r: r[key])
        fp8 = {s: r for s, r in case["fp8"].items()}
        best_fp8 = min((r for s, r in fp8.items() if s != "auto"), key=lambda r: r[key], default=None)
        cells = [config, str(tokens), f"{best['strategy']} {best[key]:.3f} ({fmt(ratio(best), '.2f')})"]
        for name in fp8_names:
            r = fp8.get(name)
            ran = f", {r['choice'].split(' ')[0]}" if r is not None and r.get("choice") else ""
            cells.append("–" if r is None else f"{r[key]:.3f} ({fmt(ratio(r), '.2f')}{ran})")
        cells.append(f"{best[key] / best_fp8[key]:.2f}×" if best_fp8 else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


KINDS = {"bench": bench_table, "decode_bench": decode_bench_table, "persistent_decode": persistent_decode_table, "weak_scaling": weak_scaling_table, "mesh": mesh_table, "facts": facts_table,
         "hf_models": hf_models_table, "auto_grid": auto_grid_table,
         "fp8_layer": fp8_layer_table}


def current_sources(sources=SOURCES):
    """The last source listed for each table key, in the order the keys first appear."""
    latest = {}
    for src in sources:
        latest[src["table"]] = src
    return list(latest.values())


def render(sources=SOURCES) -> str:
    chosen = current_sources(sources)
    lines = ["# Performance: the current standing", "",
             "<!-- Generated by `python benchmarks/performance_page.py` from benchmarks/results/; "
             "edit the sources, not this page. -->", "",
             "Per preset and regime, the fastest strategy, how close it comes to the floor, and its speed-up:", ""]
    lines += summary_table(chosen)
    lines += ["The tables behind it follow. Each names its date, device, commit and the command that produced it",
              "(commands are written with today's module paths). The protocol (configurations, timing, the floor) is",
              "[docs/benchmarking.md](benchmarking.md). Absolute times move 5–15% between machine leases; the claims",
              "are the ratios between strategies timed in the same run.", ""]
    for key, title, blurb in SECTIONS:
        lines += [f"## {title}", "", blurb, ""]
        here = [s for s in chosen if s["section"] == key]
        if not here:
            lines += ["Not measured yet. To measure it:", "", "```bash",
                      f"{NVLS_OFF} {PENDING.get(key, 'see benchmarks/README.md')}", "```", ""]
        for src in here:
            lines += KINDS[src["kind"]](src)
            lines += [f"- {note}" for note in src.get("notes", [])] + ([""] if src.get("notes") else [])
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=PAGE, help="where to write the page (default: docs/performance.md)")
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing; exit 1 if it differs")
    args = ap.parse_args(argv)
    page = render()
    if args.check:
        with open(args.out) as f:
            same = f.read() == page
        print("up to date" if same else f"{args.out} differs from its sources: run benchmarks/performance_page.py")
        return 0 if same else 1
    with open(args.out, "w") as f:
        f.write(page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
