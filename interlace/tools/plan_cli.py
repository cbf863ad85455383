"""``interlace plan``: rank layouts × MoE strategies × all-to-all forms for a model on a cluster.

    interlace plan --model mixtral-8x7b --cluster h100x1024 --seq 4096 --global-batch 1024
    interlace plan --all-presets --out ''

    interlace plan --model my_model.json --cluster my_cluster.json --out plan-out

Prints the ranked table (layout, form and chunks, strategy, predicted ms per MoE layer forward +
backward, the MoE part of a step, memory per GPU, why), writes ``plan.json`` and ``timeline.png``
(the best plan's simulated layer) under ``--out``. Model presets: ``interlace.planning.monta.model``;
cluster presets: ``interlace.planning.monta.cluster``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from interlace.planning.monta.cluster import PRESET_NAMES, load_cluster
from interlace.planning.monta.memory import RECOMPUTE
from interlace.planning.monta.model import MODEL_PRESETS, load_model
from interlace.planning.monta.search import STRATEGIES, Planner, PlanResult, TrainSetup
from interlace.planning.monta.simulate import timeline, write_timeline_png
from interlace.tools.command_line import command_parser

LEGEND = """legend:
  TPt EPe CPc PPp DPd  tensor-, expert-, context-, pipeline- and data-parallel group sizes; CPcv ("vertical"):
                       the EP group is the CP group, so EP adds no dimension of its own
  O0                   plain all-to-all over EP (with TP > 1 every assignment crosses it once per TP rank)
  O1                   MoNTA: drop the TP duplicates, all-to-all 1/t of the volume, all-gather over TP
  O2×n, O3×n           O1 in n chunks: chunk c+1's all-to-all beside chunk c's all-gather (O3: and beside
                       chunk c's re-layout copy); n from MoNTA's chunk search
  sequential           dispatch, then experts, then combine
  pipelined:r          PipeMoE: r token chunks, chunk i+1's dispatch beside chunk i's experts
  layer fwd+bwd ms     one MoE layer's forward + backward on one GPU
  MoE step ms          all MoE layers of a training step, pipeline bubbles and expert-gradient sync included
  GiB/GPU              predicted peak memory of one GPU"""


def format_table(result: PlanResult, top: int) -> str:
    lines = [f"{result.model.name} on {result.cluster.name} ({result.cluster.world} GPUs, {result.cluster.gpu}); "
             f"seq {result.setup.seq}, global batch {result.setup.global_batch}, micro-batch "
             f"{result.setup.micro_batch}, ZeRO-{result.setup.zero}, SP {'on' if result.setup.sp else 'off'}, "
             f"recompute {result.setup.recompute}",
             f"{result.layouts} layouts, {len(result.rejected)} rejected, {len(result.ranked)} candidates",
             "| # | layout | form | strategy | layer fwd+bwd ms | MoE step ms | GiB/GPU | why |",
             "|---|---|---|---|---|---|---|---|"]
    for i, c in enumerate(result.ranked[:top], 1):
        form = c.form + (f"×{c.chunks}" if c.form in ("O2", "O3") else "")
        lines.append(f"| {i} | {c.layout.label()} | {form} | {c.strategy} | {c.time.layer_ms:.3f} | "
                     f"{c.time.step_ms:.1f} | {c.memory.total / 1024 ** 3:.1f} | {c.why} |")
    if not result.ranked:
        lines.append("no layout fits: " + "; ".join(f"{lay.label()}: {why}" for lay, why, _ in result.rejected[:3])
                     + f" (try {', '.join(_remedies(result.setup))} or more GPUs)")
    if result.ranked:
        lines.append(LEGEND)
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def _remedies(setup: TrainSetup) -> list[str]:
    tips = [] if setup.zero == 3 else ["--zero 3"]
    tips += [] if setup.recompute == "full" else ["--recompute full"]
    tips += [] if setup.micro_batch == 1 else ["a smaller --micro-batch"]
    return tips


def plan_once(model_spec, cluster_spec, setup: TrainSetup, out: Path | None, top: int,
              strategies=STRATEGIES) -> PlanResult:
    cluster, model = load_cluster(cluster_spec), load_model(model_spec)
    planner = Planner(cluster, model, setup, strategies)
    result = planner.run()
    print(format_table(result, top))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = f"{model.name}-{cluster.name}"
        (out / f"{stem}.json").write_text(json.dumps(result.to_json(), indent=1))
        msg = f"wrote {out / (stem + '.json')}"
        if result.ranked:
            best = result.ranked[0]
            plan, _, _ = planner.layer(best.layout, best.form, best.strategy)
            msg += "; " + write_timeline_png(timeline(planner.machine, plan), out / f"{stem}.png",
                                             f"{model.name} on {cluster.name}: {best.layout.label()} "
                                             f"{best.form} {best.strategy}")
        print(msg)
    return result


def parser() -> argparse.ArgumentParser:
    ap = command_parser("plan", "Rank layouts × MoE strategies × all-to-all forms for a model on a cluster, "
                                "from the cost models (no GPU needed).",
                        epilog="e.g. interlace plan --model mixtral-8x7b --cluster h100x1024")
    ap.add_argument("--model", default=None, help=f"model: a preset ({', '.join(MODEL_PRESETS)}) or a JSON file")
    ap.add_argument("--cluster", default=None, help=f"cluster: a preset ({', '.join(PRESET_NAMES)}) or a JSON file")
    ap.add_argument("--all-presets", action="store_true",
                    help="plan every model preset on every cluster preset (instead of --model/--cluster)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length in tokens")
    ap.add_argument("--global-batch", type=int, default=1024, help="sequences per training step")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch on one GPU")
    ap.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3),
                    help="ZeRO stage: how far optimizer states, gradients and weights are sharded")
    ap.add_argument("--no-sp", action="store_true", help="no sequence parallelism")
    ap.add_argument("--recompute", default="selective", choices=RECOMPUTE,
                    help="activation recomputation in the backward (memory model)")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES,
                    help="MoE strategies to consider")
    ap.add_argument("--top", type=int, default=15, help="rows of the ranked table to print")
    ap.add_argument("--out", default="plan-out", help="directory for the JSON and PNG ('' for none)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if not args.all_presets and (args.model is None or args.cluster is None):
        ap.print_usage(sys.stderr)
        missing = " and ".join(f"--{n}" for n in ("model", "cluster") if getattr(args, n) is None)
        print(f"interlace plan: give {missing} (or --all-presets); --help lists the presets", file=sys.stderr)
        return 2
    try:
        setup = TrainSetup(args.seq, args.global_batch, args.micro_batch, args.zero, not args.no_sp, args.recompute)
        out = Path(args.out) if args.out else None
        pairs = ([(m, c) for c in PRESET_NAMES for m in MODEL_PRESETS] if args.all_presets
                 else [(args.model, args.cluster)])
        for m, c in pairs:
            t0 = time.perf_counter()
            plan_once(m, c, setup, out, args.top, args.strategies)
            print(f"planned in {time.perf_counter() - t0:.2f} s\n")
    except ValueError as err:
        print(f"interlace plan: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
