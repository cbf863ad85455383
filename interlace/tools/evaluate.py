"""``interlace pipeline-eval``: how well the planner picks the pipeline degree (PipeMoE Table IV
in spirit).

For every configuration of a grid (tokens, hidden, FFN size, experts, top-k, routing skew) it
measures the ``pipelined`` layer at every degree of ``--degrees`` (each checked against degree
1 on the same inputs first), asks the planner for its choice and its predicted time at every
degree, and reports: the chosen r, the best measured r, the regret of the choice
(t(chosen)/t(best) − 1), PipeMoE's Theorem-1 r, and predicted vs measured time. The summary
gives the share of configs whose choice is within 3% of the best, the worst regret, and the
median absolute prediction error. Launch under torchrun, one process per GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from interlace.config import MoEConfig
from interlace.layer import MoELayer
from interlace.planning.pipemoe.calibration import calibrate_profile, merge_points
from interlace.planning.pipemoe.degree import DEFAULT_DEGREES, choose_degree
from interlace.planning.profile import Profile, load_profile
from interlace.tools.bench import bench_config, init_env, make_routing, reduce_max, rel_err, time_cpu, time_cuda
from interlace.tools.command_line import command_parser
from interlace.tools.profile import run_profile

# (hidden N, FFN K, experts E, top-k) shape classes × variants (tokens per rank, top-k, routing).
SHAPES = [
    ("mixtral-like", 4096, 14336, 8, 2),
    ("phi-like", 4096, 6400, 16, 2),
    ("qwen2-like", 2048, 1408, 64, 4),
    ("qwen3-like", 2048, 768, 128, 8),
    ("flashdmoe-like", 2048, 2048, 64, 2),
    ("wide-ffn", 1024, 4096, 16, 2),
    ("dsv3-narrow", 7168, 2048, 64, 4),
    ("mid", 3072, 1536, 32, 4),
]
VARIANTS = [(2048, 1, "random"), (8192, 1, "random"), (32768, 1, "random"), (8192, 1, "skewed"),
            (16384, 2, "random")]  # (tokens, top-k multiplier, routing)


@dataclass
class GridPoint:
    name: str
    config: MoEConfig
    tokens: int
    routing: str


def default_grid() -> list[GridPoint]:
    grid = []
    for name, n, k_ffn, e, topk in SHAPES:
        for tokens, mult, routing in VARIANTS:
            top = min(e, topk * mult)
            cfg = MoEConfig(hidden=n, ffn=k_ffn, num_experts=e, top_k=top)
            grid.append(GridPoint(f"{name}/T{tokens}/k{top}/{routing}", cfg, tokens, routing))
    return grid


def tiny_grid() -> list[GridPoint]:
    """CPU smoke grid (gloo, interpreter): the same code paths at toy sizes."""
    cfg = MoEConfig(hidden=32, ffn=16, num_experts=4, top_k=2, dtype=torch.float32)
    return [GridPoint("tiny/T8", cfg, 8, "random"), GridPoint("tiny/T24/skewed", cfg, 24, "skewed")]


@dataclass
class EvalRow:
    name: str
    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    routing: str
    measured_ms: dict = field(default_factory=dict)
    predicted_ms: dict = field(default_factory=dict)
    wrong: list = field(default_factory=list)
    chosen: int = 1
    best: int = 1
    regret: float = 0.0
    theorem1: int = 1
    notes: list = field(default_factory=list)


def run_eval(grid: list[GridPoint], degrees, env, profile, warmup: int, iters: int, seed: int = 0,
             tolerance: float = 2e-2, show: bool = True) -> list[EvalRow]:
    rows = []
    for i, point in enumerate(grid):
        cfg = point.config
        layer = MoELayer(cfg, group=env.group, strategy="pipelined", strategy_options={"degree": 1},
                         seed=seed, device=env.device)
        gen = torch.Generator(device=env.device).manual_seed(seed + 7919 * env.rank + i)
        x = torch.randn(point.tokens, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
        indices = make_routing(cfg, point.routing, point.tokens, env, seed + i)
        plan = choose_degree(cfg, point.tokens, env.world, profile, degrees=degrees)
        row = EvalRow(point.name, point.tokens, cfg.hidden, cfg.ffn, cfg.num_experts, cfg.top_k, point.routing,
                      predicted_ms={r: plan.per_degree_ms[r] for r in degrees}, chosen=plan.degree,
                      theorem1=plan.theorem1.degree, notes=plan.notes)
        reference = None
        with torch.no_grad():
            for r in degrees:
                layer.set_strategy("pipelined", degree=r)
                out = layer(x, expert_indices=indices)
                if reference is None:
                    reference = out.clone()
                elif reduce_max(env, rel_err(out, reference)) > tolerance:
                    row.wrong.append(r)
                    continue
                timer = time_cuda if env.cuda else time_cpu
                times = timer(lambda: layer(x, expert_indices=indices), warmup, iters, env)
                row.measured_ms[r] = reduce_max(env, statistics.median(times))
        good = {r: t for r, t in row.measured_ms.items()}
        row.best = min(good, key=good.get)
        row.regret = good[row.chosen] / good[row.best] - 1 if row.chosen in good else float("inf")
        rows.append(row)
        if show:
            meas = " ".join(f"{r}:{t:.2f}/{row.predicted_ms[r]:.2f}" for r, t in row.measured_ms.items())
            print(f"[{i + 1}/{len(grid)}] {row.name:38s} chosen {row.chosen:2d} best {row.best:2d} "
                  f"regret {row.regret * 100:5.1f}%  pred {plan.per_degree_ms[row.chosen]:.2f} "
                  f"meas {good.get(row.chosen, float('nan')):.2f} | r:measured/predicted {meas}", flush=True)
        layer = None  # free the weights before the next config
        if env.cuda:
            torch.cuda.empty_cache()
    return rows


def summarize(rows: list[EvalRow]) -> dict:
    regrets = [r.regret for r in rows]
    errors_all = [abs(r.predicted_ms[d] / t - 1) for r in rows for d, t in r.measured_ms.items()]
    errors_chosen = [abs(r.predicted_ms[r.chosen] / r.measured_ms[r.chosen] - 1) for r in rows
                     if r.chosen in r.measured_ms]
    return {
        "configs": len(rows),
        "within_3pct": sum(g <= 0.03 for g in regrets) / max(len(rows), 1),
        "best_or_equal": sum(g <= 1e-9 for g in regrets) / max(len(rows), 1),
        "max_regret": max(regrets, default=0.0),
        "median_abs_error_all_degrees": statistics.median(errors_all) if errors_all else None,
        "median_abs_error_chosen": statistics.median(errors_chosen) if errors_chosen else None,
        "wrong": sum(len(r.wrong) for r in rows),
        "theorem1_within_3pct": sum(
            (r.theorem1 in r.measured_ms and r.measured_ms[r.theorem1] / r.measured_ms[r.best] - 1 <= 0.03)
            for r in rows) / max(len(rows), 1),
    }


def markdown(rows: list[EvalRow], summary: dict, degrees) -> str:
    head = "| config | " + " | ".join(f"r={d}" for d in degrees) + " | chosen | best | regret | Thm-1 r | pred/meas at chosen |"
    lines = [head, "|" + "---|" * (len(degrees) + 6)]
    for r in rows:
        cells = []
        for d in degrees:
            if d in r.wrong:
                cells.append("WRONG")
            elif d in r.measured_ms:
                mark = "**" if d == r.best else ""
                cells.append(f"{mark}{r.measured_ms[d]:.2f}{mark}")
            else:
                cells.append("-")
        ratio = r.predicted_ms[r.chosen] / r.measured_ms[r.chosen] if r.chosen in r.measured_ms else float("nan")
        lines.append(f"| {r.name} | " + " | ".join(cells) +
                     f" | {r.chosen} | {r.best} | {r.regret * 100:.1f}% | {r.theorem1} | {ratio:.2f} |")
    s = summary
    lines.append("")
    lines.append(f"{s['configs']} configs: chosen r within 3% of the best measured r in {s['within_3pct'] * 100:.0f}%, "
                 f"best or equal in {s['best_or_equal'] * 100:.0f}%, worst regret {s['max_regret'] * 100:.1f}%; "
                 f"median |predicted/measured − 1| {s['median_abs_error_all_degrees'] * 100:.1f}% over all degrees, "
                 f"{s['median_abs_error_chosen'] * 100:.1f}% at the chosen r; Theorem-1 r within 3% in "
                 f"{s['theorem1_within_3pct'] * 100:.0f}%; {s['wrong']} wrong outputs.")
    return "\n".join(lines)


def rows_from_markdown(text: str, grid: list[GridPoint] | None = None) -> list[EvalRow]:
    """The measured per-degree times of an evaluation table written by :func:`markdown` (the
    first table whose rows name grid points), for
    re-scoring a new model offline with :func:`rescore`."""
    points = {p.name: p for p in (grid or default_grid())}
    degrees, rows = None, []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "config" and len(cells) > 1 and cells[1].startswith("r="):
            if rows:
                break  # only the first evaluation table
            degrees = [int(c[2:]) for c in cells[1:] if c.startswith("r=")]
        elif degrees and cells[0] in points:
            p = points[cells[0]]
            row = EvalRow(p.name, p.tokens, p.config.hidden, p.config.ffn, p.config.num_experts, p.config.top_k,
                          p.routing)
            for d, c in zip(degrees, cells[1:]):
                if c == "WRONG":
                    row.wrong.append(d)
                elif c != "-":
                    row.measured_ms[d] = float(c.strip("*"))
            rows.append(row)
    if not rows:
        raise ValueError("no evaluation table with grid rows found")
    return rows


def rescore(rows: list[EvalRow], profile, world: int = 2, grid: list[GridPoint] | None = None) -> list[EvalRow]:
    """Re-plan measured rows with ``profile`` (no device): the chosen degree, regret and
    predictions of the current model against the stored measurements."""
    points = {p.name: p for p in (grid or default_grid())}
    out = []
    for row in rows:
        plan = choose_degree(points[row.name].config, row.tokens, world, profile, degrees=list(row.measured_ms))
        new = EvalRow(**{**asdict(row), "predicted_ms": dict(plan.per_degree_ms), "chosen": plan.degree,
                         "theorem1": plan.theorem1.degree, "notes": plan.notes})
        new.best = min(new.measured_ms, key=new.measured_ms.get)
        new.regret = new.measured_ms[new.chosen] / new.measured_ms[new.best] - 1
        out.append(new)
    return out


def error_by_degree(rows: list[EvalRow]) -> dict[int, tuple[float, float]]:
    """Per degree: (median signed, median absolute) relative prediction error."""
    degrees = sorted({d for r in rows for d in r.measured_ms})
    result = {}
    for d in degrees:
        e = [r.predicted_ms[d] / r.measured_ms[d] - 1 for r in rows if d in r.measured_ms]
        result[d] = (statistics.median(e), statistics.median([abs(v) for v in e]))
    return result


def errors_text(rows: list[EvalRow]) -> str:
    return "\n".join(f"r={d}: median error {signed * 100:+.1f}%, median |error| {absolute * 100:.1f}%"
                     for d, (signed, absolute) in error_by_degree(rows).items())


def parser() -> argparse.ArgumentParser:
    p = command_parser("pipeline-eval", "How well the planner picks the pipeline degree: the pipelined layer "
                                        "measured at every degree on a grid of configs, against the planner's "
                                        "choice and predicted times (PipeMoE Table IV in spirit). Launch under "
                                        "torchrun, one process per GPU.")
    p.add_argument("--grid", choices=["default", "tiny"], default="default",
                   help="configurations to evaluate: the default grid, or a tiny one for CPU tests")
    p.add_argument("--degrees", nargs="+", type=int, default=list(DEFAULT_DEGREES),
                   help="pipeline degrees to measure and plan among")
    p.add_argument("--profile", default=None, help="profile JSON (default: this machine's stored profile)")
    p.add_argument("--profile-first", action="store_true",
                   help="measure the grid's shape classes into the profile before evaluating")
    # Deliberately not the grid's token counts: the evaluation tests the model away from the
    # points it was calibrated on.
    p.add_argument("--profile-tokens", nargs="+", type=int, default=[1000, 3000, 12000, 40000],
                   help="with --profile-first: tokens per rank of the calibration points")
    p.add_argument("--expert-points", type=int, default=None, metavar="N",
                   help="with --profile-first: row counts of each expert-stage sweep (default: the "
                        "profiler's own; fewer only for a smoke run)")
    p.add_argument("--also-profile", nargs="*", default=[], metavar="PRESET",
                   help="with --profile-first: also profile these presets' shape classes")
    p.add_argument("--merge-points", nargs="*", default=[], metavar="PROFILE",
                   help="with --profile-first: pool these earlier profiles' raw layer timings into the "
                        "fresh one (interlace.planning.pipemoe.calibration.merge_points); the fresh-only profile is kept "
                        "as OUT/profile_fresh.json")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed calls before timing each degree (--grid tiny: also the profile's layer timings)")
    p.add_argument("--iters", type=int, default=20,
                   help="timed calls per degree, the median reported (--grid tiny: also the profile's)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N grid points")
    p.add_argument("--out", default="bench-out/pipeline-eval",
                   help="directory for pipeline_eval.json and pipeline_eval.md")
    p.add_argument("--rescore", default=None, metavar="MARKDOWN",
                   help="no device: re-score the first evaluation table in this file (pipeline_eval.md "
                        "of an earlier run) with --profile, refitting its calibration")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.rescore:
        if not args.profile:
            p.error("--rescore needs --profile")
        profile = Profile.from_json(json.loads(open(args.profile).read()))
        calibrate_profile(profile)
        rows = rescore(rows_from_markdown(open(args.rescore).read()), profile, profile.world)
        print(markdown(rows, summarize(rows), sorted({d for r in rows for d in r.measured_ms})))
        print(errors_text(rows))
        return 0
    env = init_env()
    grid = default_grid() if args.grid == "default" else tiny_grid()
    if args.limit:
        grid = grid[: args.limit]
    try:
        # --profile-first measures afresh (or extends the user's own profile), never the shipped one.
        profile = load_profile(env.world, env.device, args.profile, packaged=not args.profile_first)
    except FileNotFoundError:
        if not args.profile_first:
            raise
        profile = None
    if args.profile_first:
        configs, seen = [], set()
        extra = [GridPoint(name, bench_config(name, small=False), 0, "random") for name in args.also_profile]
        for point in grid + extra:
            key = (point.config.hidden, point.config.ffn, point.config.num_experts, point.config.activation)
            if key not in seen:
                seen.add(key)
                configs.append(point.config)
        tokens = args.profile_tokens if args.grid == "default" else [10, 30]
        # (the tiny grid is a smoke run: few degrees, and the evaluation's own call counts)
        small = {} if args.grid == "default" else {"calibration_degrees": (2,), "fwdbwd_degrees": (2,), "timing": {
            "fwd": (args.warmup, args.iters), "fwdbwd": (args.warmup, args.iters)}}
        if args.expert_points is not None:
            small["expert_points"] = args.expert_points
        profile = run_profile(configs, tokens, env.group, env.device, show=env.rank == 0, existing=profile, **small)
        if args.merge_points:
            if env.rank == 0:
                os.makedirs(args.out, exist_ok=True)
                profile.save(os.path.join(args.out, "profile_fresh.json"))
            try:
                merge_points(profile, [Profile.from_json(json.loads(open(f).read())) for f in args.merge_points])
            except ValueError as err:  # another machine's profile: evaluate the fresh one alone
                print(f"--merge-points ignored: {err}", flush=True)
        if env.rank == 0:
            print(f"profile saved to {profile.save(args.profile)}", flush=True)
    rows = run_eval(grid, args.degrees, env, profile, args.warmup, args.iters, show=env.rank == 0)
    summary = summarize(rows)
    if env.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "pipeline_eval.json"), "w") as f:
            json.dump({"summary": summary, "degrees": args.degrees, "profile": profile.key,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)
        table = markdown(rows, summary, args.degrees)
        with open(os.path.join(args.out, "pipeline_eval.md"), "w") as f:
            f.write(table + "\n")
        print()
        print(table)
        print(errors_text(rows))
    if dist.is_initialized():
        dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
