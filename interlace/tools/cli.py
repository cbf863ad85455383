"""The ``interlace`` command: ``interlace bench ...`` and ``interlace demo``."""

from __future__ import annotations

import sys

USAGE = """usage: interlace <command> [options]

commands:
  demo     run the layer on this machine (GPUs: torchrun benchmark; CPU: 2 simulated gloo ranks)
  bench          the BENCHMARKS.md harness (launch with torchrun --nproc-per-node W for W GPUs)
  profile        microbenchmarks → the performance profile the pipelined strategy plans with
  pipeline-eval  measure every pipeline degree on a grid of configs against the planner's choice
  tune-experts   measure kernel configs of the Triton expert GEMMs and write the tuning tables
  tune           profile the fused strategy's communication/GEMM block split (torchrun, ≥ 2 GPUs)
  plan           rank layouts, MoE strategies and all-to-all forms for a model on a cluster (no GPU)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from interlace.tools.bench import main as bench_main

        bench_main(rest)
        return 0
    if command == "profile":
        from interlace.planning.profile import main as profile_main

        return profile_main(rest)
    if command == "pipeline-eval":
        from interlace.tools.evaluate import main as eval_main

        return eval_main(rest)
    if command == "tune-experts":
        from interlace.tools.tune_experts import main as tune_main

        return tune_main(rest)
    if command == "plan":
        from interlace.tools.plan_cli import main as plan_main

        return plan_main(rest)
    if command == "tune":
        from interlace.tools.tune_fused import main as tune_fused_main

        return tune_fused_main(rest)
    if command == "demo":
        from interlace.tools.demo import main as demo_main

        return demo_main(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
