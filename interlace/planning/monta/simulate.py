"""Event simulation of a training step's MoE layers, and its timeline as a PNG.

One MoE layer call is an op list on streams (:func:`interlace.planning.monta.layer.simulate_layer`, which
runs :func:`interlace.planning.pipemoe.schedule.simulate_ops`: the host issues ops in order, an op starts
when issued, when its stream is free and when the ops it waits for are done). A step on one GPU
of pipeline stage 0 runs, per micro-batch, its l/p MoE layers forward and backward; with 1F1B
the stage idles (p − 1) micro-batch slots, so the MoE part of a step is

    step = (m + p − 1) · (l/p) · (forward + backward of one layer)  +  expert-gradient sync

where the expert gradients are reduce-scattered (ZeRO ≥ 1) or all-reduced over the R₂ copies of
each expert shard, once per step, not overlapped (a conservative choice).
"""

from __future__ import annotations

from dataclasses import dataclass

from interlace.planning.monta.layer import ClusterMachine, LayerPlan, simulate_layer


@dataclass(frozen=True)
class StepTime:
    layer_fwd_ms: float
    layer_bwd_ms: float
    layers_per_stage: float
    slots: int  # m + p − 1
    grad_sync_ms: float

    @property
    def layer_ms(self) -> float:
        return self.layer_fwd_ms + self.layer_bwd_ms

    @property
    def step_ms(self) -> float:
        return self.slots * self.layers_per_stage * self.layer_ms + self.grad_sync_ms


def simulate_step(m: ClusterMachine, plan: LayerPlan, moe_layers: int, pp: int, microbatches: int,
                  grad_sync_ms: float = 0.0) -> StepTime:
    fwd = simulate_layer(m, plan)[0]
    bwd = simulate_layer(m, plan, backward=True)[0]
    return StepTime(fwd, bwd, moe_layers / pp, microbatches + pp - 1, grad_sync_ms)


def timeline(m: ClusterMachine, plan: LayerPlan) -> list[tuple[str, str, float, float]]:
    """(stream, op name, start ms, end ms) of one layer's forward then backward."""
    rows = []
    offset = 0.0
    for phase, backward in (("fwd", False), ("bwd", True)):
        total, ops, ends = simulate_layer(m, plan, backward=backward)
        for op, end in zip(ops, ends):
            if op.gpu > 0:
                rows.append((op.stream, f"{phase}:{op.name}", offset + end - op.gpu, offset + end))
        offset += total
    return rows


OP_COLORS = {"A2A": "tab:red", "AG": "tab:blue", "RS": "tab:cyan", "AR": "tab:purple", "D2D": "tab:olive",
             "expert": "tab:green", "unpermute": "tab:gray", "route+sync": "tab:orange"}
OTHER_COLOR = "tab:brown"


def legend_entries(rows) -> list[tuple[str, str]]:
    """(op kind, color) of every kind drawn in ``rows`` (what :func:`timeline` returns), in the
    order of :data:`OP_COLORS`, then others in order of appearance: the legend lists only what
    the picture shows."""
    kinds = list(dict.fromkeys(name.split(":", 1)[1] for _, name, _, _ in rows))
    known = [k for k in OP_COLORS if k in kinds]
    return [(k, OP_COLORS[k]) for k in known] + [(k, OTHER_COLOR) for k in kinds if k not in OP_COLORS]


def write_timeline_png(rows, path, title: str) -> str:
    """Draw the timeline with matplotlib; returns a message saying what was written (or why not)."""
    try:  # matplotlib is optional: imported only when a PNG is wanted
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"timeline PNG not written: matplotlib is not installed (pip install matplotlib); wanted {path}"
    streams = sorted({r[0] for r in rows}, key=["compute", "a2a", "tp"].index
                     if all(r[0] in ("compute", "a2a", "tp") for r in rows) else str)
    entries = legend_entries(rows)
    colors = dict(entries)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.6 * len(streams)))
    for stream, name, start, end in rows:
        y = streams.index(stream)
        kind = name.split(":", 1)[1]
        ax.broken_barh([(start, end - start)], (y - 0.4, 0.8), facecolors=colors[kind],
                       edgecolor="black", linewidth=0.3, alpha=0.9 if name.startswith("fwd") else 0.6)
    ax.set_yticks(range(len(streams)), streams)
    ax.set_xlabel("ms (forward, then backward, of one MoE layer)")
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c in entries]
    ax.legend(handles, [k for k, _ in entries], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"timeline written to {path}"
