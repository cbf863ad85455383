"""``auto``'s prior: what the performance model predicts for a layer call before anything is
timed (the profile-only choice, the candidates and their predicted times, the pruning), and the
fused buffers' size for the memory cap. No state; :mod:`interlace.strategies.auto` uses it.
"""

from __future__ import annotations

from interlace.planning.pipemoe.degree import choose_degree, fused_speedup
from interlace.planning.profile import as_profile, shape_key

# Smallest measured-and-interpolated gain of fused over the best alternative that the
# profile-only choice acts on (timings of one strategy move between machine leases).
FUSED_MARGIN = 0.05


def choose_strategy(config, tokens: int, world: int, profile, max_degree: int = 16,
                    mode: str = "fwd", train_fused: bool = True) -> tuple[str, list[str]]:
    """The profile's choice, nothing timed: (strategy spec, notes) for ``tokens`` tokens per rank
    and a ``"fwd"`` or ``"fwdbwd"`` call; raises FileNotFoundError without a profile.
    ``fused`` / ``fused:train`` only where the profile measured it beside ``sequential`` for this
    exact shape class and it wins by more than ``FUSED_MARGIN``."""
    if world == 1:
        return "sequential", ["world size 1: nothing to overlap"]
    profile = as_profile(profile, world)
    plan = choose_degree(config, tokens, world, profile, max_degree=max_degree, mode=mode)
    notes = list(plan.notes) + [f"predicted ms per degree: { {r: round(ms, 3) for r, ms in plan.per_degree_ms.items()} }"]
    spec = "sequential" if plan.degree == 1 else f"pipelined:{plan.degree}"
    fused = "fused" if mode == "fwd" else "fused:train"
    if mode != "fwd" and not train_fused:
        notes.append("fused:train: not considered (train_fused=False)")
        return spec, notes
    shape = profile.shapes.get(shape_key(config, world))
    speedup = None if shape is None else fused_speedup(shape, tokens * config.top_k, mode)
    if speedup is None:
        notes.append(f"{fused}: no measured {fused}/sequential {mode} pairs for this shape class in the profile")
        return spec, notes
    fused_ms = plan.per_degree_ms[1] / speedup if 1 in plan.per_degree_ms else float("inf")
    best_ms = plan.per_degree_ms[plan.degree]
    measured_at = sorted({int(t) for t, *_ in shape.fused_pairs(mode)})
    notes.append(f"{fused}: {speedup:.2f}x sequential at T={tokens} (pairs measured at T={measured_at}, held flat "
                 f"outside), predicted {fused_ms:.3f} ms against {best_ms:.3f} ms for {spec}")
    if fused_ms < best_ms * (1 - FUSED_MARGIN):
        return fused, notes
    return spec, notes


def predicted_candidates(config, tokens: int, world: int, profile, mode: str, max_degree: int = 16
                         ) -> tuple[dict[str, float | None], list[str]]:
    """The model's prior: candidate spec → predicted ms (None: no prediction) and notes.
    ``sequential`` always; ``pipelined:r`` where the planner's degree r > 1; the fused path of
    ``mode`` with a prediction only where the profile measured its pairs for this shape class.
    Without a profile: ``sequential`` and the fused path, unpredicted."""
    fused = "fused" if mode == "fwd" else "fused:train"
    try:
        prof = as_profile(profile, world)
        plan = choose_degree(config, max(tokens, 1), world, prof, max_degree=max_degree, mode=mode)
    except FileNotFoundError as err:
        return {"sequential": None, fused: None}, [f"no profile ({err}): candidates unpredicted"]
    out = {"sequential": plan.per_degree_ms.get(1)}
    if plan.degree > 1:
        out[f"pipelined:{plan.degree}"] = plan.per_degree_ms[plan.degree]
    shape = prof.shapes.get(shape_key(config, world))
    speedup = None if shape is None else fused_speedup(shape, max(tokens, 1) * config.top_k, mode)
    out[fused] = None if speedup is None or out["sequential"] is None else out["sequential"] / speedup
    return out, list(plan.notes)


def prune(predicted: dict[str, float | None], ratio: float) -> tuple[list[str], list[str]]:
    """(kept candidates fastest-predicted first, unpredicted last; notes on the dropped ones)."""
    known = [ms for ms in predicted.values() if ms is not None]
    best = min(known) if known else None
    kept, notes = [], []
    for spec, ms in predicted.items():
        if ms is not None and best is not None and ms > ratio * best:
            notes.append(f"{spec}: predicted {ms:.3f} ms, over {ratio}x the best {best:.3f} ms: not timed")
        else:
            kept.append(spec)
    kept.sort(key=lambda s: (predicted[s] is None, predicted[s] or 0.0))
    return kept, notes


def fused_train_rows_ratio(config, world: int) -> float:
    """Rows ``fused:train`` keeps per call for its backward (every source's receive region at
    capacity: W · T · min(k, E_local)) over the rows a balanced call routes to a rank (T · k),
    which is what ``sequential`` keeps: about the ratio of their activation memory, T aside."""
    return world * min(config.top_k, config.num_experts // world) / config.top_k


def fused_buffer_bytes(config, world: int, tokens: int) -> int:
    """Bytes of the fused strategy's peer buffers for ``tokens`` tokens per rank (GPU tiles)."""
    from interlace.parallel.peer_buffer import BufferSpec
    from interlace.strategies.fused.options import GPU_CONFIG

    spec = BufferSpec(world, config.num_experts // world, config.hidden, config.top_k, max(tokens, 1),
                      GPU_CONFIG.block_m, GPU_CONFIG.block_n1, config.dtype)
    return spec.regions()["_total"][0]
