"""Fitting the TP shard classes of a profile for the TP × EP planner.

With TP = t each rank holds every local expert's K/t slice, so its grouped GEMMs form a shape
class the EP profile never timed, and a ``tp_ep`` layer call has fixed costs ``sequential``'s
calibration does not see: every TP rank routes and sorts all T tokens, the count exchange runs
over both groups, the host sync. Predicting TP = 2 from the nearest EP class and
``sequential``'s fixed line was far off, hence measured shard classes
(:func:`interlace.tools.profile.profile_tp`, ``interlace profile --tp 2``).

:func:`fit_tp_shape` fits, per mode, the line over dispatched rows T·k of measured − simulated
O0 time, which the planner (:func:`interlace.planning.monta.layer.predict_layer_ms`) adds to the
simulated op list of every form, and keeps each point's measured/modelled ratio, which it
interpolates over rows per form (:func:`interlace.planning.profile.tp_residual_ratio`): the
tp_ep layer is host-bound up to ~10k tokens, and how much of a form's extra collectives hides
under that host time is not something the stream simulation gets right.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from interlace.config import MoEConfig
from interlace.planning.monta.layer import ProfileMachine, make_plan, simulate_layer
from interlace.planning.pipemoe.models import AlphaBeta
from interlace.planning.profile import Profile, form_key, tp_fixed_line, tp_shard_key


def _simulated_ms(m, cfg: MoEConfig, T: int, tp: int, ep: int, form: str, mode: str) -> tuple[float, str]:
    plan = make_plan(m, cfg, T, tp, ep, form, "sequential")
    sim = simulate_layer(m, plan)[0]
    if mode == "fwdbwd":
        sim += simulate_layer(m, plan, backward=True)[0]
    return sim, form_key(plan.form, plan.form_chunks)


def _form_of(point) -> str:
    return point[3] if len(point) > 3 else "O0"


def fit_tp_shape(prof: Profile, cfg: MoEConfig, tp: int, ep: int) -> None:
    """Fit ``prof.tp_shapes[key]`` from its raw points ``(T, k, ms, form)``, in place: per mode
    the fixed line from the O0 points, then every point's measured / (simulated + line) ratio
    (``residuals``) for :func:`interlace.planning.profile.tp_residual_ratio`."""
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
