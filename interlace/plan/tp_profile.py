"""Measurements of TP shard classes for the TP × EP planner (``interlace profile --tp-configs``).

With TP = t each rank holds every local expert's K/t slice, so its grouped GEMMs form a shape
class the EP profile never timed (flashdmoe-cfg at TP = 2: 64 experts of K = 1024 per rank), and
a ``tp_ep`` layer call has fixed costs ``sequential``'s calibration does not see: every TP rank
routes and sorts all T tokens, the count exchange runs over both groups, the host sync. Run 15
predicted TP = 2 from the nearest EP class and ``sequential``'s fixed line and was off by
−45…−68% on flashdmoe-cfg.

:func:`profile_tp` measures, on a TP = t mesh (EP = world / t), per config: the shard's expert
stage (as ``interlace.perf.profile.profile_expert_stage`` does for EP classes) and the
``tp_ep:O0`` layer forward and forward + backward at the calibration token counts (not the
evaluation's). :func:`fit_tp_shape` fits, per mode, the line over dispatched rows T·k of
measured − simulated O0 time; the planner (:func:`interlace.plan.layer.predict_layer_ms`) adds
that line to the simulated op list of every form O0–O3 at this shard class.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from interlace.config import MoEConfig
from interlace.perf.models import AlphaBeta


def tp_shard_key(cfg: MoEConfig, tp: int, e_local: int) -> str:
    """Key of a TP shard class: ``tp{t}:N{hidden}-K{ffn/t}-El{experts per rank}-{activation}``."""
    return f"tp{tp}:N{cfg.hidden}-K{cfg.ffn // tp}-El{e_local}-{cfg.activation}"


def tp_fixed_line(entry, mode: str, rows: int) -> float:
    """The fitted fixed ms at ``rows`` dispatched rows (the forward line where a mode has none),
    never below 0 (a line over a few token counts must not extrapolate negative)."""
    line = entry.fixed.get(mode) or entry.fixed.get("fwd")
    return max(line(rows), 0.0) if line is not None else 0.0


def fit_tp_shape(prof, cfg: MoEConfig, tp: int, ep: int) -> None:
    """Fit ``prof.tp_shapes[key].fixed`` per mode from its raw O0 points, in place."""
    from interlace.plan.layer import ProfileMachine, make_plan, simulate_layer

    entry = prof.tp_shapes[tp_shard_key(cfg, tp, cfg.num_experts // ep)]
    m = ProfileMachine(prof)
    m.raw_fixed = True
    entry.fixed = {}
    for mode, points in (("fwd", entry.calibration), ("fwdbwd", entry.calibration_fwdbwd)):
        xs, ys = [], []
        for T, k, ms in points:
            c = replace(cfg, top_k=k)
            plan = make_plan(m, c, T, tp, ep, "O0", "sequential")
            sim = simulate_layer(m, plan)[0]
            if mode == "fwdbwd":
                sim += simulate_layer(m, plan, backward=True)[0]
            xs.append(T * k)
            ys.append(ms - sim)
        if not xs:
            continue
        if len(set(xs)) > 1:
            beta, alpha = np.polyfit(np.array(xs, dtype=float), np.array(ys, dtype=float), 1)
        else:
            alpha, beta = float(np.mean(ys)), 0.0
        entry.fixed[mode] = AlphaBeta(float(alpha), float(beta))


def profile_tp(prof, configs: list[MoEConfig], tokens: list[int], tp: int, show: bool = True,
               warmup: int = 3, iters: int = 10) -> None:
    """Measure each config's TP shard class on a TP = ``tp`` mesh over the whole world into
    ``prof.tp_shapes`` and fit it (collective: every rank calls it with the same arguments)."""
    import torch.distributed as dist

    from interlace.layer import MoELayer
    from interlace.mesh import MoEMesh
    from interlace.perf.profile import TPShapeProfile, Timer, _progress, profile_expert_stage, time_layer_ms

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
            entry.calibration.append((T, cfg.top_k, time_layer_ms(layer, x, timer, warmup, iters)))
            entry.calibration_fwdbwd.append(
                (T, cfg.top_k, time_layer_ms(layer, x, timer, max(1, warmup - 1), max(2, iters // 2), backward=True)))
            del layer, x
            if device.type == "cuda":
                torch.cuda.empty_cache()
        fit_tp_shape(prof, cfg, tp, ep)
