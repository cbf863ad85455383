"""TP shard classes in the profile: fit (interlace.planning.monta.tp_profile), prediction,
measurement (interlace.tools.profile.profile_tp)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import run_gloo
from interlace import MoEConfig
from interlace.planning.pipemoe.models import SizeCurve
from interlace.planning.profile import Profile, TPShapeProfile, tp_residual_ratio, tp_shard_key
from interlace.planning.monta.layer import ProfileMachine, make_plan, predict_layer_ms, simulate_layer
from interlace.planning.monta.tp_profile import fit_tp_shape


def _profile(world=2):
    sizes = [1e3 * 2 ** i for i in range(24)]
    a2a = SizeCurve(sizes, [0.02 + s / 2e8 for s in sizes])
    return Profile("synthetic", world, a2a, 0.01, 3000.0, {"index": 0.01, "prep": 0.01, "combine": 0.01})


def _raw_ms(prof, cfg, T, form, backward):
    m = ProfileMachine(prof)
    m.raw_fixed = True
    plan = make_plan(m, cfg, T, 2, 1, form, "sequential")
    total = simulate_layer(m, plan)[0]
    return total + (simulate_layer(m, plan, backward=True)[0] if backward else 0.0)


def test_fit_recovers_the_fixed_line_and_every_form_uses_the_shard_curve():
    cfg = MoEConfig(hidden=2048, ffn=2048, num_experts=64, top_k=2)
    prof = _profile()
    rows = [2 ** i for i in range(6, 22)]
    # The shard class's own expert curve: 64 experts of K = 1024, slow per row.
    curve = SizeCurve(rows, [0.05 + r * 2e-5 for r in rows])
    key = tp_shard_key(cfg, 2, 64)
    assert key == "tp2:N2048-K1024-El64-swiglu"
    entry = prof.tp_shapes[key] = TPShapeProfile(2, curve)
    truth = {"fwd": (0.7, 3e-6), "fwdbwd": (1.9, 8e-6)}
    for T in (1000, 3000, 12000):
        for mode, (a, b) in truth.items():
            ms = _raw_ms(prof, cfg, T, "O0", mode == "fwdbwd") + a + b * T * 2
            (entry.calibration if mode == "fwd" else entry.calibration_fwdbwd).append((T, 2, ms))
    fit_tp_shape(prof, cfg, 2, 1)
    for mode, (a, b) in truth.items():
        assert entry.fixed[mode].alpha == pytest.approx(a, rel=1e-6)
        assert entry.fixed[mode].beta == pytest.approx(b, rel=1e-6)
    # Other forms and token counts: their own op list + the same line.
    for form in ("O0", "O1", "O2:2", "O3:4"):
        for T, backward in ((4096, False), (16384, True)):
            a, b = truth["fwdbwd" if backward else "fwd"]
            expect = _raw_ms(prof, cfg, T, form, backward) + a + b * T * 2
            assert predict_layer_ms(cfg, T, 2, 1, form, "sequential", prof, backward=backward) == pytest.approx(expect)
    # A chunked form measured 20% above its model at every calibration point: its predictions
    # (and those of the same form at another chunk count) carry that; other forms do not.
    for T in (1000, 3000, 12000):
        a, b = truth["fwd"]
        entry.calibration.append((T, 2, 1.2 * (_raw_ms(prof, cfg, T, "O2:2", False) + a + b * T * 2), "O2:2"))
    fit_tp_shape(prof, cfg, 2, 1)
    assert tp_residual_ratio(entry, "fwd", "O2:2", 5000 * 2) == pytest.approx(1.2)
    assert tp_residual_ratio(entry, "fwd", "O2:4", 5000 * 2) == pytest.approx(1.2)  # nearest chunk count
    assert tp_residual_ratio(entry, "fwd", "O3:2", 5000 * 2) == 1.0
    a, b = truth["fwd"]
    for form, factor in (("O2:2", 1.2), ("O2:4", 1.2), ("O1", 1.0)):
        expect = factor * (_raw_ms(prof, cfg, 4096, form, False) + a + b * 4096 * 2)
        assert predict_layer_ms(cfg, 4096, 2, 1, form, "sequential", prof) == pytest.approx(expect)
    # The expert stage is the shard curve, not a scaled EP class.
    m = ProfileMachine(prof)
    assert m.expert(cfg, 5000, 2, 64) == pytest.approx(curve(5000))
    # JSON round trip.
    again = Profile.from_json(json.loads(json.dumps(prof.to_json())))
    assert json.dumps(again.tp_shapes[key].to_json()) == json.dumps(entry.to_json())


def _measure(rank, world):
    from interlace.tools.profile import profile_tp

    cfg = MoEConfig(hidden=32, ffn=16, num_experts=4, top_k=2, dtype=torch.float32)
    prof = _profile(world)
    # (4 and 8 tokens, no warm-up and one timed call each, 3 expert-stage points: under the
    # interpreter every call costs in proportion to its tokens; two token counts fit the line)
    profile_tp(prof, [cfg], [4, 8], tp=2, show=False, warmup=0, iters=1, expert_points=3)
    entry = prof.tp_shapes[tp_shard_key(cfg, 2, 4)]
    forms = ("O0", "O1", "O2:2", "O3:2", "O2:4", "O3:4")
    for points in (entry.calibration, entry.calibration_fwdbwd):
        assert [(T, f) for T, _, _, f in points] == [(T, f) for T in (4, 8) for f in forms]
        assert all(ms > 0 for _, _, ms, _ in points)
    assert set(entry.fixed) == {"fwd", "fwdbwd"}
    # Every measured form is reproduced at its calibration points.
    for backward, points in ((False, entry.calibration), (True, entry.calibration_fwdbwd)):
        for T, _, ms, form in points:
            got = predict_layer_ms(cfg, T, 2, 1, form, "sequential", prof, backward=backward)
            assert got == pytest.approx(ms, rel=1e-6)


def test_profile_tp_measures_the_shard_class_on_a_tp_mesh_under_gloo():
    run_gloo(_measure, 2)
