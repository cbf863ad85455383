"""Per-block timeline of the fused kernels as a PNG Gantt chart per rank.

``FusedStrategy(timeline=True)`` records, for every work item a program of the two fused
kernels executes, its start, the end of its flag wait and its end (``%globaltimer`` ns on
GPUs; see :mod:`interlace.kernels.timeline`). This module draws one rank's records: one row per
program, colour = kind (send copy, GEMM0 on local rows, GEMM0 on remote rows, GEMM1,
combine), the wait before an item in grey in front of it; layer0 above layer1 on one time
axis, so one can see the communication programs' copies run under the GEMMs.

    torchrun --nproc-per-node 2 -m interlace.tools.timeline --config qwen2-moe --tokens 16384

runs the fused layer ``--calls`` times with the timeline on (the last call is drawn), times
it with the timeline off and on (the recording's cost), checks that both give the same
output, and writes ``timeline_rank{r}.png`` and ``timeline_rank{r}.json`` to ``--out``
(default ``$OUT`` or ``bench-out``), with a summary table printed last.

``--strategy persistent`` draws the one-launch persistent kernel's tasks instead (one row per
program, SM utilization in the summary; :mod:`interlace.tools.task_timeline`), at a decode size
(``--tokens`` default 128), with plain ``python`` at world size 1 or under torchrun::

    python -m interlace.tools.timeline --strategy persistent --config qwen3-30b-a3b
    torchrun --nproc-per-node 2 -m interlace.tools.timeline --strategy persistent --config qwen3-30b-a3b
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from interlace.kernels.timeline import KINDS

COLORS = {"send": "#d62728", "gemm0_local": "#1f77b4", "gemm0_remote": "#17becf", "gemm1": "#2ca02c",
          "gemm1_remote": "#98df8a", "combine": "#ff7f0e"}
WAIT_COLOR = "#bbbbbb"


# ----------------------------------------------------------------------------- analysis
def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted union of [a, b) intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def covered(intervals: list[tuple[float, float]], by: list[tuple[float, float]]) -> float:
    """Length of ∪intervals that lies inside ∪by."""
    a_u, b_u = union(intervals), union(by)
    total, j = 0.0, 0
    for a, b in a_u:
        while j < len(b_u) and b_u[j][1] <= a:
            j += 1
        k = j
        while k < len(b_u) and b_u[k][0] < b:
            total += min(b, b_u[k][1]) - max(a, b_u[k][0])
            k += 1
    return total


def summarize(records: list[dict]) -> dict:
    """Per kind: items, busy time (Σ end − waited), wait time (Σ waited − start); per layer:
    span (first start → last end); overlap: the share of the send copies' (layer0) and the
    combine's (layer1) active time during which GEMM work ran on other programs."""
    out: dict = {"kinds": {}, "layers": {}}
    for kind in KINDS:
        rs = [r for r in records if r["kind"] == kind]
        out["kinds"][kind] = {"items": len(rs), "busy": sum(r["end"] - r["waited"] for r in rs),
                              "wait": sum(r["waited"] - r["start"] for r in rs)}
    for layer in (0, 1):
        rs = [r for r in records if r["layer"] == layer]
        out["layers"][layer] = {"start": min((r["start"] for r in rs), default=0),
                                "end": max((r["end"] for r in rs), default=0)}

    def work(kinds):
        return [(r["waited"], r["end"]) for r in records if r["kind"] in kinds and r["end"] > r["waited"]]

    send, combine = work({"send"}), work({"combine"})
    gemm0, gemm1 = work({"gemm0_local", "gemm0_remote"}), work({"gemm1", "gemm1_remote"})
    send_len, combine_len = covered(send, send), covered(combine, combine)
    out["send_under_gemm0"] = covered(send, gemm0) / send_len if send_len else None
    out["combine_under_gemm1"] = covered(combine, gemm1) / combine_len if combine_len else None
    return out


# ----------------------------------------------------------------------------- drawing
def draw_timeline(records: list[dict], path: str, title: str, unit: str = "µs", scale: float = 1e-3,
                  splits: tuple[int, int] | None = None, n_programs: int | None = None) -> None:
    """Write a Gantt chart PNG of one rank's ``records`` (:meth:`FusedStrategy.timeline_records`).

    ``scale`` converts record times to ``unit`` (ns → µs by default; 1 with ``unit="ticks"``
    for the interpreter's logical clock). ``splits``: (n_comm, n_comm1), drawn as a line
    between the communication/combine programs and the GEMM programs. ``n_programs``: rows
    to draw (default: the highest program id seen + 1).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not records:
        raise ValueError("no timeline records to draw (was the strategy built with timeline=True and called?)")
    n_prog = max(n_programs or 0, max(r["pid"] for r in records) + 1)
    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(14, 2.2 + 2 * max(1.2, 0.05 * n_prog)))
    for layer, ax in enumerate(axes):
        rs = [r for r in records if r["layer"] == layer]
        bars: dict[tuple[int, str], list] = {}
        for r in rs:
            if r["waited"] > r["start"]:
                bars.setdefault((r["pid"], "wait"), []).append((r["start"] * scale, (r["waited"] - r["start"]) * scale))
            # Zero-length items (coarse clocks) still get a sliver so they show.
            bars.setdefault((r["pid"], r["kind"]), []).append((r["waited"] * scale,
                                                               max(r["end"] - r["waited"], 0) * scale))
        for (pid, kind), spans in bars.items():
            ax.broken_barh(spans, (pid - 0.4, 0.8), facecolors=WAIT_COLOR if kind == "wait" else COLORS[kind],
                           edgecolor="none" if kind == "wait" else "black", linewidth=0.1)
        if splits is not None:
            ax.axhline(splits[layer] - 0.5, color="black", linewidth=0.6, linestyle="--")
        ax.set_ylim(n_prog - 0.5, -0.5)
        ax.set_ylabel(f"layer{layer}: program")
        span = summarize(rs)["layers"][layer]
        ax.set_title(f"layer{layer} ({'dispatch → GEMM0' if layer == 0 else 'GEMM1 → combine'}): "
                     f"{len(rs)} items, span {(span['end'] - span['start']) * scale:.1f} {unit}", fontsize=9)
    axes[-1].set_xlabel(f"time since the call's first item ({unit})")
    handles = [Patch(color=COLORS[k], label=k) for k in KINDS] + [Patch(color=WAIT_COLOR, label="flag wait")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    from interlace.tools.bench import ROUTINGS

    p = argparse.ArgumentParser(prog="python -m interlace.tools.timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="fused", choices=("fused", "persistent"))
    p.add_argument("--config", default="qwen2-moe")
    p.add_argument("--tokens", type=int, default=None, help="tokens per GPU (default: fused 16384, persistent 128)")
    p.add_argument("--routing", default="random", choices=ROUTINGS)
    p.add_argument("--calls", type=int, default=5, help="calls with the timeline on; the last one is drawn")
    p.add_argument("--iters", type=int, default=20, help="timed calls (timeline off, then on); 0 skips timing")
    p.add_argument("--n-comm", type=int, default=None, help="layer0 communication programs (default: tuned/auto)")
    p.add_argument("--n-comm1", type=int, default=None, help="layer1 combine programs (default: tuned/auto)")
    p.add_argument("--programs", type=int, default=None, help="persistent: the kernel's grid (default: co-resident)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="shrink the config (hidden/ffn ÷ 16; CPU smoke runs)")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench-out")
    args = p.parse_args(argv)
    if args.tokens is None:
        args.tokens = 128 if args.strategy == "persistent" else 16384
    if args.calls < 1 or args.tokens < 1:
        p.error("--calls and --tokens must be positive")
    if args.strategy == "persistent" and (args.routing != "random" or args.n_comm is not None
                                          or args.n_comm1 is not None):
        p.error("--strategy persistent routes inside its kernel (--routing random only) and has no --n-comm/--n-comm1")
    if args.programs is not None and (args.strategy != "persistent" or args.programs < 1):
        p.error("--programs is a positive grid size of --strategy persistent")
    return args


def main(argv=None) -> dict:
    from interlace.tools.bench import bench_config, git_commit, init_env, make_routing, reduce_max, time_cpu, time_cuda
    from interlace.layer import MoELayer

    args = parse_args(argv)
    if args.strategy == "persistent":
        from interlace.tools.task_timeline import run_persistent

        return run_persistent(args)
    env = init_env()
    cfg = bench_config(args.config, args.small)
    opts = {k: v for k, v in (("n_comm", args.n_comm), ("n_comm1", args.n_comm1)) if v is not None}
    layer = MoELayer(cfg, group=env.group, strategy="fused", seed=args.seed, device=env.device,
                     strategy_options={**opts, "timeline": True})
    gen = torch.Generator(device=env.device).manual_seed(args.seed + 7919 * env.rank)
    x = torch.randn(args.tokens, cfg.hidden, device=env.device, generator=gen).to(cfg.dtype)
    indices = make_routing(cfg, args.routing, args.tokens, env, args.seed)
    strategy = layer.strategy
    with torch.no_grad():
        for _ in range(args.calls):
            out_on = layer(x, expert_indices=indices)
        records = strategy.timeline_records()  # host sync
        strategy.synchronize_and_check()
        layer.set_strategy("fused", **opts)  # same weights, timeline off (compiled out)
        out_off = layer(x, expert_indices=indices)
        same = bool(torch.equal(out_on, out_off))
        timer = time_cuda if env.cuda else time_cpu
        times = {}
        if args.iters > 0:
            times["off"] = statistics.median(timer(lambda: layer(x, expert_indices=indices), 3, args.iters, env))
            layer.strategy = strategy  # back to the timeline-on strategy (set up, same buffers)
            times["on"] = statistics.median(timer(lambda: layer(x, expert_indices=indices), 3, args.iters, env))
    times = {k: reduce_max(env, v) for k, v in times.items()}
    gpu = env.cuda
    device = torch.cuda.get_device_name() if gpu else "cpu (interpreter, logical clock)"
    commit = git_commit()
    n_comm, n_comm1 = strategy.split
    title = (f"interlace fused timeline — {args.config}{' (small)' if args.small else ''}, T={args.tokens}/rank, "
             f"{args.routing} routing, rank {env.rank} of {env.world}\n"
             f"{strategy.engine.n_programs} programs, n_comm={n_comm}, n_comm1={n_comm1} — {device}, commit {commit}")
    os.makedirs(args.out, exist_ok=True)
    unit, scale = ("µs", 1e-3) if gpu else ("ticks", 1.0)
    png = os.path.join(args.out, f"timeline_rank{env.rank}.png")
    draw_timeline(records, png, title, unit, scale, (n_comm, n_comm1), strategy.engine.n_programs)
    summary = summarize(records)
    summary.update(rank=env.rank, unit=unit, scale=scale, same_output=same, times_ms=times, title=title)
    from interlace.tools.task_timeline import save_and_gather

    summaries = save_and_gather(args.out, env, summary, records)
    if env.rank == 0:
        print(summary_table(summaries, args))
    if dist.is_initialized():
        dist.barrier()
    return summary


def summary_table(summaries: list[dict], args) -> str:
    s0 = summaries[0]
    unit, scale = s0["unit"], s0["scale"]
    lines = [f"# {s0['title'].split(', rank ')[0]}",
             f"| rank | layer0 span {unit} | layer1 span {unit} | items {'/'.join(KINDS)} "
             f"| send busy {unit} | GEMM0 wait {unit} | combine wait {unit} | GEMM1 {unit}/tile, home here / remote "
             f"| send under GEMM0 | combine under GEMM1 | same output as off |",
             "|" + "---|" * 11]
    for s in summaries:
        k, ly = s["kinds"], s["layers"]

        def pct(v):
            return "-" if v is None else f"{100 * v:.0f}%"

        def per_item(kind):
            return "-" if not k[kind]["items"] else f"{k[kind]['busy'] / k[kind]['items'] * scale:.1f}"

        lines.append(
            f"| {s['rank']} | {(ly[0]['end'] - ly[0]['start']) * scale:.1f} | {(ly[1]['end'] - ly[1]['start']) * scale:.1f} "
            f"| {'/'.join(str(k[n]['items']) for n in KINDS)} | {k['send']['busy'] * scale:.1f} "
            f"| {(k['gemm0_local']['wait'] + k['gemm0_remote']['wait']) * scale:.1f} | {k['combine']['wait'] * scale:.1f} "
            f"| {per_item('gemm1')} / {per_item('gemm1_remote')} "
            f"| {pct(s['send_under_gemm0'])} | {pct(s['combine_under_gemm1'])} | {s['same_output']} |")
    t = s0["times_ms"]
    if t:
        lines.append(f"\nlayer median ms (slowest rank, {args.iters} calls): timeline off {t['off']:.3f}, "
                     f"on {t['on']:.3f} ({100 * (t['on'] / t['off'] - 1):+.1f}%)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
