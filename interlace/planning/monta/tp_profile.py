"""Measurements of TP shard classes for the TP × EP planner (``interlace profile --tp 2``).

With TP = t each rank holds every local expert's K/t slice, so its grouped GEMMs form a shape
class the EP profile never timed (flashdmoe-cfg at TP = 2: 64 experts of K = 1024 per rank), and
a ``tp_ep`` layer call has fixed costs ``sequential``'s calibration does not see: every TP rank
routes and sorts all T tokens, the count exchange runs over both groups, the host sync. Run 15
predicted TP = 2 from the nearest EP class and ``sequential``'s fixed line and was off by
−45…−68% on flashdmoe-cfg.

:func:`profile_tp` measures, on a TP = t mesh (EP = world / t), per config: the shard's expert
stage (as ``interlace.planning.profile.profile_expert_stage`` does for EP classes) and the
``tp_ep`` layer in each form (O0, O1, O2/O3 with 2 and 4 chunks) forward and forward + backward
at the calibration token counts (not the evaluation's). :func:`fit_tp_shape` fits, per mode,
the line over dispatched rows T·k of measured − simulated O0 time, which the planner
(:func:`interlace.planning.monta.layer.predict_layer_ms`) adds to the simulated op list of every form,
and keeps each point's measured/modelled ratio, which it interpolates over rows per form: the
tp_ep layer is host-bound up to ~10k tokens (~2.5 ms of Python per call on 2× H200), and
how much of a form's extra collectives hides under that host time is not something the
stream simulation gets right (first 2× H200 comparison: O2/O3 over-predicted by 10–66%).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from interlace.config import MoEConfig
from interlace.planning.pipemoe.models import AlphaBeta, interp_log_rows


def tp_shard_key(cfg: MoEConfig, tp: int, e_local: int) -> str:
    """Key of a TP shard class: ``tp{t}:N{hidden}-K{ffn/t}-El{experts per rank}-{activation}``."""
    return f"tp{tp}:N{cfg.hidden}-K{cfg.ffn // tp}-El{e_local}-{cfg.activation}"


def tp_fixed_line(entry, mode: str, rows: int) -> float:
    """The fitted fixed ms at ``rows`` dispatched rows (the forward line where a mode has none),
    never below 0 (a line over a few token counts must not extrapolate negative)."""
    line = entry.fixed.get(mode) or entry.fixed.get("fwd")
    return max(line(rows), 0.0) if line is not None else 0.0


def form_key(form: str, chunks: int) -> str:
    """``O0``, ``O1``, or ``O2:4`` / ``O3:2`` (the chunk count is part of a chunked form)."""
    return f"{form}:{chunks}" if form in ("O2", "O3") else form


def tp_residual_ratio(entry, mode: str, form: str, rows: int) -> float:
    """Measured / modelled at ``rows`` for ``form`` (a :func:`form_key`), interpolated in
    log(rows) between its calibration points and held flat beyond them; a chunked form not
    measured uses the same form at the nearest measured chunk count; 1 without points."""
    import math

    pts = entry.residuals.get(mode, [])
    mine = [(x, q) for x, f, q in pts if f == form]
    if not mine and ":" in form:
        base, n = form.split(":")
        counts = sorted({int(f.split(":")[1]) for _, f, _ in pts if f.startswith(base + ":")},
                        key=lambda c: (abs(math.log(c / int(n))), c))
        if counts:
            mine = [(x, q) for x, f, q in pts if f == f"{base}:{counts[0]}"]
    if not mine or rows <= 0:
        return 1.0
    return interp_log_rows(mine, rows)


def _simulated_ms(m, cfg: MoEConfig, T: int, tp: int, ep: int, form: str, mode: str) -> tuple[float, str]:
    from interlace.planning.monta.layer import make_plan, simulate_layer

    plan = make_plan(m, cfg, T, tp, ep, form, "sequential")
    sim = simulate_layer(m, plan)[0]
    if mode == "fwdbwd":
        sim += simulate_layer(m, plan, backward=True)[0]
    return sim, form_key(plan.form, plan.form_chunks)


def fit_tp_shape(prof, cfg: MoEConfig, tp: int, ep: int) -> None:
    """Fit ``prof.tp_shapes[key]`` from its raw points ``(T, k, ms, form)``, in place: per mode
    the fixed line from the O0 points, then every point's measured / (simulated + line) ratio
    (``residuals``) for :func:`tp_residual_ratio`."""
    from interlace.planning.monta.layer import ProfileMachine

    entry = prof.tp_shapes[tp_shard_key(cfg, tp, cfg.num_experts // ep)]
    m = ProfileMachine(prof)
    m.raw_fixed = True
    entry.fixed, entry.residuals = {}, {}
    for mode, points in (("fwd", entry.calibration), ("fwdbwd", entry.calibration_fwdbwd)):
        sims = [_simulated_ms(m, replace(cfg, top_k=p[1]), p[0], tp, ep, _form_of(p), mode) for p in points]
        xs = [p[0] * p[1] for p, (_, f) in zip(points, sims) if f == "O0"]
        ys = [p[2] - sim for p, (sim, f) in zip(points, sims) if f == "O0"]
        if not xs:
            continue
        if len(set(xs)) > 1:
            beta, alpha = np.polyfit(np.array(xs, dtype=float), np.array(ys, dtype=float), 1)
        else:
            alpha, beta = float(np.mean(ys)), 0.0
        entry.fixed[mode] = AlphaBeta(float(alpha), float(beta))
        entry.residuals[mode] = [[p[0] * p[1], f, p[2] / (sim + tp_fixed_line(entry, mode, p[0] * p[1]))]
                                 for p, (sim, f) in zip(points, sims)]


def _form_of(point) -> str:
    return point[3] if len(point) > 3 else "O0"


def profile_tp(prof, configs: list[MoEConfig], tokens: list[int], tp: int, show: bool = True,
               warmup: int = 3, iters: int = 10, forms=("O0", "O1", "O2:2", "O3:2", "O2:4", "O3:4")) -> None:
    """Measure each config's TP shard class on a TP = ``tp`` mesh over the whole world into
    ``prof.tp_shapes`` and fit it (collective: every rank calls it with the same arguments)."""
    import torch.distributed as dist

    from interlace.layer import MoELayer
    from interlace.parallel.mesh import MoEMesh
    from interlace.planning.profile import TPShapeProfile, Timer, _progress, profile_expert_stage, time_layer_ms

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % tp:
        raise ValueError(f"tp={tp} must divide the world size {world}")
    ep = world // tp
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = MoEMesh.build(tp=tp, ep=ep)
    timer = Timer(device, dist.group.WORLD if dist.is_initialized() else None)  # barrier + slowest rank
    for cfg in configs:
        key = tp_shard_key(cfg, tp, cfg.num_experts // ep)
        if key in prof.tp_shapes:
            continue
        # The shard's grouped GEMMs: E/ep experts of K/tp, rows arriving from `ep` sources.
        shard = replace(cfg, ffn=cfg.ffn // tp)
        curve, _ = profile_expert_stage(timer, shard, ep, max(tokens) * cfg.top_k, show)
        entry = prof.tp_shapes[key] = TPShapeProfile(tp, curve)
        for T in _progress(tokens, f"layer {key}", show):
            layer = MoELayer(cfg, mesh=mesh, strategy="tp_ep:O0", seed=0, device=device)
            gen = torch.Generator(device=device).manual_seed(4321 + T + mesh.ep_rank)  # TP ranks: same tokens
            x = torch.randn(T, cfg.hidden, device=device, generator=gen).to(cfg.dtype)
            for form in forms:
                base, _, n = form.partition(":")
                layer.set_strategy(f"tp_ep:{base}" + (f"-{n}" if n else ""))
                entry.calibration.append((T, cfg.top_k, time_layer_ms(layer, x, timer, warmup, iters), form))
                entry.calibration_fwdbwd.append(
                    (T, cfg.top_k, time_layer_ms(layer, x, timer, max(1, warmup - 1), max(2, iters // 2),
                                                 backward=True), form))
            del layer, x
            if device.type == "cuda":
                torch.cuda.empty_cache()
        fit_tp_shape(prof, cfg, tp, ep)
