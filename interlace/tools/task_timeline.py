"""Per-task timeline of the ``persistent`` strategy's one-launch kernel: analysis, Gantt chart, run.

``PersistentStrategy(timeline=True)`` records, for every task a program of the persistent
kernel takes (gate, index, send, receive, GEMM0, GEMM1, combine; "skip": a GEMM task past the
real row tiles), its program, SM, start, the end of its flag waits and its end
(:meth:`~interlace.strategies.persistent.PersistentStrategy.timeline_records`). This module
draws one rank's records (one row per program, colour per kind, the wait in front of a task in
grey) and summarizes them, with FlashDMoE's **SM utilization**: the programs' busy time (Σ end −
waited over the real tasks: the skips and every flag wait count as idle) ÷ (programs × the
call's span, first start → last end). 1 means every program of the grid worked through the
whole call; the rest is time spent waiting on flags, skipping, taking tasks, or with nothing
left to take (the tail).

Run through :mod:`interlace.tools.timeline` (``--strategy persistent``), which calls
:func:`run_persistent`.
"""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.distributed as dist

COLORS = {"gate": "#9467bd", "index": "#8c564b", "send": "#d62728", "receive": "#e377c2", "gemm0": "#1f77b4",
          "gemm1": "#2ca02c", "combine": "#ff7f0e", "skip": "#f2e394"}
WAIT_COLOR = "#bbbbbb"
IDLE_KINDS = ("skip",)  # recorded, but not work: excluded from the busy time


# ----------------------------------------------------------------------------- analysis
def summarize_tasks(records: list[dict], kinds: tuple[str, ...], n_programs: int | None = None) -> dict:
    """One rank's call: per kind the tasks, busy time (Σ end − waited) and wait time (Σ waited −
    start); ``span`` (first start → last end), ``programs`` (the grid: ``n_programs``, at least
    the highest program id seen + 1), ``busy`` (real tasks), ``wait`` (all tasks) and
    ``utilization`` = busy ÷ (programs × span) (None for an empty or zero-length call)."""
    programs = max(n_programs or 0, max((r["pid"] for r in records), default=-1) + 1)
    out: dict = {"kinds": {}, "programs": programs}
    for kind in kinds:
        rs = [r for r in records if r["kind"] == kind]
        out["kinds"][kind] = {"tasks": len(rs), "busy": sum(r["end"] - r["waited"] for r in rs),
                              "wait": sum(r["waited"] - r["start"] for r in rs)}
    span = (max(r["end"] for r in records) - min(r["start"] for r in records)) if records else 0
    busy = sum(v["busy"] for k, v in out["kinds"].items() if k not in IDLE_KINDS)
    out.update(span=span, busy=busy, wait=sum(v["wait"] for v in out["kinds"].values()),
               utilization=busy / (programs * span) if span > 0 and programs else None)
    return out


def save_and_gather(out: str, env, summary: dict, records: list[dict]) -> list[dict]:
    """Write this rank's ``timeline_rank{r}.json`` (the summary, then the records as rows of
    ``fields``) to ``out``; return every rank's summary (an all-gather at W > 1)."""
    with open(os.path.join(out, f"timeline_rank{env.rank}.json"), "w") as f:
        fields = list(records[0]) if records else []
        json.dump({"summary": summary, "fields": fields, "records": [[r[k] for k in fields] for r in records]}, f)
    summaries = [summary]
    if env.world > 1:
        summaries = [None] * env.world
        dist.all_gather_object(summaries, summary)
    return summaries


# ----------------------------------------------------------------------------- drawing
def draw_tasks(records: list[dict], path: str, title: str, kinds: tuple[str, ...], unit: str = "µs",
               scale: float = 1e-3, n_programs: int | None = None) -> None:
    """Write a Gantt chart PNG of one rank's persistent-kernel ``records``: one row per program,
    a bar per task coloured by kind, its flag wait in grey in front of it. ``scale`` converts
    record times to ``unit`` (ns → µs by default; 1 with ``unit="ticks"`` for the logical clock)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not records:
        raise ValueError("no timeline records to draw (was the strategy built with timeline=True and called?)")
    s = summarize_tasks(records, kinds, n_programs)
    n_prog = s["programs"]
    fig, ax = plt.subplots(figsize=(14, 1.6 + max(1.2, 0.06 * n_prog)))
    bars: dict[tuple[int, str], list] = {}
    for r in records:
        if r["waited"] > r["start"]:
            bars.setdefault((r["pid"], "wait"), []).append((r["start"] * scale, (r["waited"] - r["start"]) * scale))
        # Zero-length tasks (coarse clocks) still get a sliver so they show.
        bars.setdefault((r["pid"], r["kind"]), []).append((r["waited"] * scale, max(r["end"] - r["waited"], 0) * scale))
    for (pid, kind), spans in bars.items():
        ax.broken_barh(spans, (pid - 0.4, 0.8), facecolors=WAIT_COLOR if kind == "wait" else COLORS.get(kind, "k"),
                       edgecolor="none" if kind in ("wait", "skip") else "black", linewidth=0.1)
    ax.set_ylim(n_prog - 0.5, -0.5)
    ax.set_ylabel("program")
    ax.set_xlabel(f"time since the call's first task ({unit})")
    util = "-" if s["utilization"] is None else f"{100 * s['utilization']:.0f}%"
    ax.set_title(f"{len(records)} tasks on {n_prog} programs, span {s['span'] * scale:.1f} {unit}, "
                 f"SM utilization {util}", fontsize=9)
    used = [k for k in kinds if s["kinds"][k]["tasks"]]
    handles = [Patch(color=COLORS.get(k, "k"), label=k) for k in used] + [Patch(color=WAIT_COLOR, label="flag wait")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- run
def timeline_kinds(world: int) -> tuple[str, ...]:
    """The record kinds of the persistent kernel at this world size."""
    from interlace.kernels.persistent import dist_tasks, tasks

    return tasks.TIMELINE_KINDS if world == 1 else dist_tasks.TIMELINE_KINDS


def run_persistent(args) -> dict:
    """``python -m interlace.tools.timeline --strategy persistent``: ``args.calls`` calls of
    ``args.tokens`` tokens per rank with the timeline on (the last one drawn), one call with it
    off (CUDA graphs, as served) that must give the same bits, and ``args.iters`` timed calls
    each of: off (graph), off eager, on (eager). Writes ``timeline_rank{r}.png`` / ``.json`` to
    ``args.out``; rank 0 prints the summary table last."""
    from interlace.kernels.persistent.launch import PersistentKernelConfig
    from interlace.layer import MoELayer
    from interlace.tools.bench import bench_config, git_commit, init_env, reduce_max, time_cpu, time_cuda

    env = init_env()
    cfg = bench_config(args.config, args.small)
    opts: dict = {}
    if args.programs is not None:
        opts["kernel"] = PersistentKernelConfig(programs=args.programs)
    if env.world > 1:
        opts["max_tokens"] = args.tokens  # (no all-reduce at the first call; the same buffer for every variant)
    layer = MoELayer(cfg, group=env.group, strategy="persistent", seed=args.seed, device=env.device,
                     strategy_options={**opts, "timeline": True})
    gen = torch.Generator(device=env.device).manual_seed(args.seed + 7919 * env.rank)
    x = torch.randn(args.tokens, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
    strategy = layer.strategy
    timer = time_cuda if env.cuda else time_cpu
    times = {}
    with torch.no_grad():
        for _ in range(args.calls):
            out_on = layer(x)
        records = strategy.timeline_records()  # host sync
        strategy.synchronize_and_check()
        plan = strategy._last_plan
        n_programs = plan.programs if hasattr(plan, "programs") else plan.grid
        variants = {"off": dict(opts), "off_eager": {**opts, "cuda_graph": False}}
        outs_off = {}
        for name, options in variants.items():
            layer.set_strategy("persistent", **options)  # same weights, timeline compiled out
            outs_off[name] = [layer(x) for _ in range(3 if env.cuda else 1)][-1]  # (the third replays a graph)
            if args.iters > 0:
                times[name] = statistics.median(timer(lambda: layer(x), 3, args.iters, env))
            layer.strategy.synchronize_and_check()
        same = all(bool(torch.equal(out_on, o)) for o in outs_off.values())
        if args.iters > 0:
            layer.strategy = strategy  # back to the timeline-on strategy (its plan, same buffers)
            times["on"] = statistics.median(timer(lambda: layer(x), 3, args.iters, env))
            strategy.synchronize_and_check()
    times = {k: reduce_max(env, v) for k, v in times.items()}
    gpu = env.cuda
    device = torch.cuda.get_device_name() if gpu else "cpu (interpreter, logical clock)"
    kinds = timeline_kinds(env.world)
    title = (f"interlace persistent timeline — {args.config}{' (small)' if args.small else ''}, T={args.tokens}/rank, "
             f"rank {env.rank} of {env.world}\n{n_programs} programs, block_m {plan.block_m} — {device}, "
             f"commit {git_commit()}")
    os.makedirs(args.out, exist_ok=True)
    unit, scale = ("µs", 1e-3) if gpu else ("ticks", 1.0)
    draw_tasks(records, os.path.join(args.out, f"timeline_rank{env.rank}.png"), title, kinds, unit, scale,
               n_programs)
    summary = summarize_tasks(records, kinds, n_programs)
    summary.update(rank=env.rank, unit=unit, scale=scale, same_output=same, times_ms=times, title=title)
    summaries = save_and_gather(args.out, env, summary, records)
    if env.rank == 0:
        print(task_summary_table(summaries, kinds, args.iters))
    if dist.is_initialized():
        dist.barrier()
    return summary


def task_summary_table(summaries: list[dict], kinds: tuple[str, ...], iters: int) -> str:
    """Markdown: per rank the span, SM utilization, tasks per kind, busy time per kind, the
    total flag wait; then the layer's median times with the timeline off (graph, eager) and on."""
    s0 = summaries[0]
    unit, scale = s0["unit"], s0["scale"]
    ms = "ms" if unit == "µs" else unit  # busy/wait sums read better in ms on a GPU
    to = scale * (1e-3 if unit == "µs" else 1.0)
    lines = [f"# {s0['title'].splitlines()[0].split(', rank ')[0]}",
             f"| rank | programs | span {unit} | SM utilization | tasks {'/'.join(kinds)} "
             f"| busy {ms} {'/'.join(kinds[:-1])} | flag wait {ms} | same output as off |",
             "|" + "---|" * 8]
    for s in summaries:
        k = s["kinds"]
        util = "-" if s["utilization"] is None else f"{100 * s['utilization']:.1f}%"
        lines.append(f"| {s['rank']} | {s['programs']} | {s['span'] * scale:.1f} | {util} "
                     f"| {'/'.join(str(k[n]['tasks']) for n in kinds)} "
                     f"| {'/'.join(format(k[n]['busy'] * to, '.3f') for n in kinds[:-1])} | {s['wait'] * to:.3f} "
                     f"| {s['same_output']} |")
    t = s0["times_ms"]
    if t:
        lines.append(f"\nlayer median ms (slowest rank, {iters} calls): timeline off {t['off']:.3f} (graph), "
                     f"off eager {t['off_eager']:.3f}, on {t['on']:.3f} (eager; "
                     f"{100 * (t['on'] / t['off_eager'] - 1):+.1f}% vs off eager)")
    lines.append("SM utilization = Σ over programs of (end − waited) of the real tasks ÷ (programs × span): "
                 "flag waits, skips, taking tasks and the tail count as idle.")
    return "\n".join(lines)
