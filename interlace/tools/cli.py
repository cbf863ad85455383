"""The ``interlace`` command: ``interlace <command> [options]``; ``interlace <command> --help``
describes each command's options."""

from __future__ import annotations

import sys

from interlace.tools import bench, demo, evaluate, plan_cli, profile, tune_experts, tune_fused

USAGE = """usage: interlace <command> [options]     (interlace <command> --help: the command's options)

commands:
  demo           run the layer on this machine (GPUs: torchrun benchmark; CPU: every strategy on 2 gloo ranks)
  bench          the benchmark harness (docs/benchmarking.md) (launch with torchrun --nproc-per-node W for W GPUs)
  profile        microbenchmarks → the performance profile the pipelined strategy plans with
  pipeline-eval  measure every pipeline degree on a grid of configs against the planner's choice
  tune-experts   measure kernel configs of the Triton expert GEMMs and write the tuning tables
  tune           profile the fused strategy's communication/GEMM block split (torchrun, ≥ 2 GPUs)
  plan           rank layouts, MoE strategies and all-to-all forms for a model on a cluster (no GPU)
"""


def _bench(argv: list[str]) -> int:
    bench.main(argv)
    return 0


COMMANDS = {
    "demo": demo.main,
    "bench": _bench,
    "profile": profile.main,
    "pipeline-eval": evaluate.main,
    "tune-experts": tune_experts.main,
    "tune": tune_fused.main,
    "plan": plan_cli.main,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return COMMANDS[command](rest)


if __name__ == "__main__":
    sys.exit(main())
