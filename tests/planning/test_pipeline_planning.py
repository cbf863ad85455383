"""The profile → planner → evaluation chain end to end on CPU (gloo, interpreter, toy sizes),
and the planner's own logic on a synthetic profile."""

import json
import math

import pytest
import torch

from helpers import run_gloo
from interlace import MoEConfig
from interlace.planning.pipemoe.models import AlphaBeta, SizeCurve
from interlace.planning.pipemoe.degree import choose_degree, predict_layer_ms
from interlace.planning.profile import Profile, ShapeProfile, shape_key
from interlace import env


def synthetic_profile(world, cfg, a2a_alpha, a2a_gbps, expert_alpha, expert_tflops, host=0.0):
    sizes = [1e3 * 2 ** i for i in range(21)]  # dense, like a measured sweep
    a2a = SizeCurve(sizes, [a2a_alpha + s / (a2a_gbps * 1e6) for s in sizes])
    flops_per_row = 2 * cfg.hidden * cfg.ffn * 3
    rows = [2 ** i for i in range(25)]
    expert = SizeCurve(rows, [expert_alpha + r * flops_per_row / (expert_tflops * 1e9) for r in rows])
    prof = Profile("synthetic", world, a2a, host, 3000.0, {"index": host, "prep": host, "combine": host})
    prof.shapes[shape_key(cfg, world)] = ShapeProfile(expert, host, AlphaBeta(0.1, 0.0))
    return prof


def test_planner_prefers_pipelining_only_when_it_pays():
    cfg = MoEConfig(hidden=4096, ffn=14336, num_experts=8, top_k=2)
    # Balanced compute and comm, cheap start-up: pipelining wins at large T.
    prof = synthetic_profile(2, cfg, a2a_alpha=0.02, a2a_gbps=100, expert_alpha=0.02, expert_tflops=500)
    plan = choose_degree(cfg, 16384, 2, prof)
    assert plan.degree > 1 and plan.per_degree_ms[plan.degree] < plan.per_degree_ms[1]
    # Huge start-up costs: one chunk is best.
    prof = synthetic_profile(2, cfg, a2a_alpha=5.0, a2a_gbps=100, expert_alpha=5.0, expert_tflops=500)
    assert choose_degree(cfg, 16384, 2, prof).degree == 1
    # Host-bound: every chunk costs 1 ms of issue time; at tiny T pipelining cannot pay.
    prof = synthetic_profile(2, cfg, 0.01, 100, 0.01, 500, host=1.0)
    assert choose_degree(cfg, 256, 2, prof).degree == 1


def test_planner_predicts_r1_as_comm_plus_compute_plus_fixed():
    cfg = MoEConfig(hidden=1024, ffn=1024, num_experts=8, top_k=2)
    prof = synthetic_profile(2, cfg, 0.05, 50, 0.03, 400)
    T = 4096
    rows, nbytes = T * 2, T * 2 * 1024 * 2
    expected = 0.1 + 2 * prof.a2a(nbytes) + prof.shapes[shape_key(cfg, 2)].expert(rows)
    expected += 2 * nbytes / (3000 * 1e6) + (nbytes + T * 1024 * 2) / (3000 * 1e6)  # gather + combine
    assert predict_layer_ms(prof, cfg, T, 2, 1) == pytest.approx(expected, rel=1e-6)


def test_unprofiled_shape_uses_the_nearest_class_and_says_so():
    cfg = MoEConfig(hidden=4096, ffn=14336, num_experts=8, top_k=2)
    prof = synthetic_profile(2, cfg, 0.02, 100, 0.02, 500)
    plan = choose_degree(cfg.with_(ffn=12288), 8192, 2, prof)
    assert plan.shape_used == shape_key(cfg, 2) and "not profiled" in plan.notes[0]


def _profile_and_eval(rank, world, tmp):
    from interlace.tools import evaluate

    evaluate.main(["--grid", "tiny", "--profile-first", "--profile", f"{tmp}/profile.json", "--degrees", "1", "2",
                   "--warmup", "0", "--iters", "1", "--expert-points", "3", "--out", f"{tmp}/eval"])
    # The stored profile now drives the "auto" degree of the strategy.
    from interlace import MoELayer

    cfg = MoEConfig(hidden=32, ffn=16, num_experts=4, top_k=2, dtype=torch.float32)
    layer = MoELayer(cfg, strategy="pipelined", strategy_options={"profile": f"{tmp}/profile.json"}, device="cpu")
    out = layer(torch.randn(8, 32))
    assert out.shape == (8, 32) and torch.isfinite(out).all()
    assert layer.strategy.degree_for(8) in (1, 2, 3, 4, 6, 8, 12, 16)


def test_profile_and_eval_commands_end_to_end(tmp_path):
    run_gloo(_profile_and_eval, 2, str(tmp_path))
    result = json.loads((tmp_path / "eval" / "pipeline_eval.json").read_text())
    assert result["summary"]["configs"] == 2 and result["summary"]["wrong"] == 0
    for row in result["rows"]:
        assert set(row["measured_ms"]) == {"1", "2"} and row["chosen"] in (1, 2)
    prof = json.loads((tmp_path / "profile.json").read_text())
    assert prof["world"] == 2 and len(prof["shapes"]) == 1 and prof["a2a"]["fit"]["beta"] >= 0
    # The fused forward beside sequential's at each profiled token count (auto's fused choice).
    (shape,) = prof["shapes"].values()
    assert [p[:2] for p in shape["fused"]] == [[10, 2], [30, 2]] and all(p[2] > 0 and p[3] > 0 for p in shape["fused"])
    # and fused:train's forward + backward beside sequential's (auto's training choice)
    assert [p[:2] for p in shape["fused_train"]] == [[10, 2], [30, 2]]
    assert all(p[2] > 0 and p[3] > 0 for p in shape["fused_train"])


def test_calibration_recovers_chunk_cost_and_interference():
    from interlace.planning.pipemoe.calibration import calibrate
    from interlace.planning.pipemoe.degree import model_terms

    cfg = MoEConfig(hidden=2048, ffn=1408, num_experts=64, top_k=4)
    prof = synthetic_profile(2, cfg, 0.02, 200, 0.05, 450, host=0.03)
    skey = shape_key(cfg, 2)
    truth = dict(alpha=0.4, beta=5e-6, chunk=0.35, kappa=0.6)
    points = []
    for T in (3000, 12000, 40000):
        for r in (1, 2, 4):
            sim, overlapped = model_terms(prof, cfg, T, 2, r)
            ms = sim + truth["alpha"] + truth["beta"] * T * 4  # the fixed line is over rows T·k
            if r > 1:
                ms += (r - 1) * (prof.host_ms["index"] + truth["chunk"]) + truth["kappa"] * overlapped
            points.append((T, 4, r, ms))
    prof.shapes[skey].calibration = points
    calibrate(prof, skey)
    shape = prof.shapes[skey]
    assert shape.fixed.alpha == pytest.approx(0.4, rel=1e-6) and shape.fixed.beta == pytest.approx(5e-6, rel=1e-6)
    assert shape.chunk_ms == pytest.approx(0.35, rel=1e-6) and shape.interference == pytest.approx(0.6, rel=1e-6)
    for T, _, r, ms in points:
        assert predict_layer_ms(prof, cfg, T, 2, r) == pytest.approx(ms, rel=1e-9)
    assert shape.model_error < 1e-9


def test_planner_keeps_degree_1_unless_the_gain_beats_the_model_error():
    cfg = MoEConfig(hidden=4096, ffn=14336, num_experts=8, top_k=2)
    prof = synthetic_profile(2, cfg, a2a_alpha=0.02, a2a_gbps=100, expert_alpha=0.02, expert_tflops=500)
    plan = choose_degree(cfg, 16384, 2, prof)
    gain = 1 - plan.per_degree_ms[plan.degree] / plan.per_degree_ms[1]
    assert plan.degree > 1 and gain > 0.05
    prof.shapes[shape_key(cfg, 2)].model_error = gain  # the model is no better than the gain
    plan = choose_degree(cfg, 16384, 2, prof)
    assert plan.degree == 1 and "margin" in plan.notes[-1]


def test_shipped_profile_loads_and_plans_the_presets():
    from interlace.tools.bench import bench_config
    from interlace.planning.profile import PACKAGED_DIR

    paths = sorted(PACKAGED_DIR.glob("*.json"))
    assert paths, "the measured 2xH200 profile ships with the package"
    for path in paths:
        prof = Profile.from_json(json.loads(path.read_text()))
        for name in ("mixtral-8x7b", "qwen2-moe", "dsv3-like"):
            plan = choose_degree(bench_config(name, small=False), 8192, prof.world, prof)
            assert plan.degree in plan.per_degree_ms and all(t > 0 for t in plan.per_degree_ms.values())
            assert plan.shape_used == shape_key(bench_config(name, small=False), prof.world)
            # Measured fused/sequential pairs for auto's forward-only choice.
            assert prof.shapes[plan.shape_used].fused, f"{path.name}: no fused pairs for {name}"


def _synthetic_points(prof, cfg, truth, mode, tokens=(1000, 3000, 12000, 40000), degrees=(1, 2, 4, 8, 16)):
    from interlace.planning.pipemoe.degree import model_terms

    points = []
    for T in tokens:
        for r in degrees:
            sim, overlapped = model_terms(prof, cfg, T, prof.world, r, mode, host_extra=truth["host"])
            ms = sim + truth["alpha"] + truth["beta"] * T * cfg.top_k + (r - 1) * prof.host_ms["index"]
            if r > 1:
                ms += truth["pipe"] + (r - 1) * truth["chunk"] + truth["kappa"] * overlapped
            points.append((T, cfg.top_k, r, ms))
    return points


def test_calibration_recovers_host_cost_per_chunk_and_both_modes():
    from interlace.planning.pipemoe.calibration import calibrate_profile

    cfg = MoEConfig(hidden=2048, ffn=1408, num_experts=64, top_k=4)
    prof = synthetic_profile(2, cfg, 0.02, 200, 0.05, 450, host=0.03)
    shape = prof.shapes[shape_key(cfg, 2)]
    fwd = dict(host=0.4, alpha=0.3, beta=4e-6, pipe=0.5, chunk=0.05, kappa=0.3)
    bwd = dict(fwd, alpha=0.9, beta=9e-6, pipe=1.1, chunk=0.0, kappa=0.6)
    shape.calibration = _synthetic_points(prof, cfg, fwd, "fwd")
    shape.calibration_fwdbwd = _synthetic_points(prof, cfg, bwd, "fwdbwd", degrees=(1, 2, 4))
    calibrate_profile(prof, host_grid=(0.0, 0.2, 0.4, 0.6))
    assert prof.chunk_host_ms == pytest.approx(0.4, abs=1e-9)
    for mode, truth in (("fwd", fwd), ("fwdbwd", bwd)):
        cal = shape.terms(mode)
        assert cal.fixed.alpha == pytest.approx(truth["alpha"], rel=1e-6)
        assert cal.fixed.beta == pytest.approx(truth["beta"], rel=1e-6)
        assert cal.pipe_ms == pytest.approx(truth["pipe"], rel=1e-6, abs=1e-9)
        assert cal.chunk_ms == pytest.approx(truth["chunk"], rel=1e-6, abs=1e-9)
        assert cal.interference == pytest.approx(truth["kappa"], rel=1e-6)
        assert cal.model_error < 1e-9
        for T, _, r, ms in shape.points(mode):
            assert predict_layer_ms(prof, cfg, T, 2, r, mode=mode) == pytest.approx(ms, rel=1e-9)
    # The fitted terms survive the JSON round trip.
    again = Profile.from_json(json.loads(json.dumps(prof.to_json())))
    assert again.chunk_host_ms == prof.chunk_host_ms
    assert json.dumps(again.shapes[shape_key(cfg, 2)].to_json()) == json.dumps(shape.to_json())


def test_host_cost_per_chunk_is_hidden_when_gpu_bound_and_paid_when_host_bound():
    from interlace.planning.pipemoe.degree import model_terms

    cfg = MoEConfig(hidden=4096, ffn=14336, num_experts=8, top_k=2)
    prof = synthetic_profile(2, cfg, 0.02, 200, 0.02, 500)
    # Tiny T: the layer is host-bound, each chunk's extra host time adds up.
    small = [model_terms(prof, cfg, 64, 2, 8, host_extra=h)[0] for h in (0.5, 1.0)]
    assert small[1] - small[0] == pytest.approx(8 * 0.5, rel=1e-6)
    # Large T: the GPU is busy for tens of ms, the host runs ahead.
    big = [model_terms(prof, cfg, 32768, 2, 4, host_extra=h)[0] for h in (0.0, 0.5)]
    assert big[1] - big[0] < 0.5


def test_backward_prediction_mirrors_the_pipeline_and_pays_weight_gradient_accumulation():
    from interlace.planning.pipemoe.degree import expert_params

    cfg = MoEConfig(hidden=4096, ffn=14336, num_experts=8, top_k=2)
    prof = synthetic_profile(2, cfg, 0.02, 100, 0.02, 500)
    T = 16384
    fwd = {r: predict_layer_ms(prof, cfg, T, 2, r) for r in (1, 2, 4)}
    fb = {r: predict_layer_ms(prof, cfg, T, 2, r, mode="fwdbwd") for r in (1, 2, 4)}
    expert = prof.shapes[shape_key(cfg, 2)].expert(T * 2)
    assert fb[1] > fwd[1] + 2 * expert  # backward: twice the GEMM work, plus its all-to-alls
    # Each chunk of a pipelined backward sums its weight gradients into fp32 (10 bytes per
    # parameter); pipelining can hide at most the backward's all-to-all time.
    accumulate = 10 * expert_params(cfg, 2) / (prof.copy_gbps * 1e6)
    hidden = 2 * prof.a2a(T * 2 * 4096 * 2)
    assert (fb[4] - fwd[4]) - (fb[1] - fwd[1]) > 4 * accumulate - hidden > 0
    plan_fwd = choose_degree(cfg, T, 2, prof)
    plan_fb = choose_degree(cfg, T, 2, prof, mode="fwdbwd")
    assert plan_fb.mode == "fwdbwd" and plan_fb.per_degree_ms[1] == pytest.approx(fb[1])
    assert plan_fwd.degree > 1 and plan_fb.degree < plan_fwd.degree
    with pytest.raises(ValueError, match="mode"):
        choose_degree(cfg, T, 2, prof, mode="train")


def test_auto_degree_is_planned_per_token_count_and_mode():
    from interlace.parallel.comm import ExpertParallel
    from interlace.strategies.pipelined import PipelinedStrategy

    cfg = MoEConfig(hidden=4096, ffn=14336, num_experts=8, top_k=2)
    prof = synthetic_profile(2, cfg, 0.02, 100, 0.02, 500)
    # Planning needs no process group: a rank of a 2-rank group, planned on the synthetic profile.
    strategy = PipelinedStrategy(cfg, ExpertParallel(None, 0, 2, 4), profile=prof)
    fwd, fb = strategy.degree_for(16384, "fwd"), strategy.degree_for(16384, "fwdbwd")
    assert (fwd, fb) == (choose_degree(cfg, 16384, 2, prof).degree,
                         choose_degree(cfg, 16384, 2, prof, mode="fwdbwd").degree)
    assert fwd != fb and set(strategy._chosen) == {(16384, "fwd"), (16384, "fwdbwd")}


def test_offline_rescoring_reads_a_recorded_evaluation_table():
    from interlace.tools.evaluate import EvalRow, default_grid, markdown, rescore, rows_from_markdown, summarize

    cfg = MoEConfig(hidden=4096, ffn=14336, num_experts=8, top_k=2)
    prof = synthetic_profile(2, cfg, 0.02, 200, 0.02, 500)
    grid = [p for p in default_grid() if p.name.startswith("mixtral-like")][:2]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for p in grid:
        times = {d: 1 + float(torch.rand((), generator=gen)) * 10 for d in (1, 2, 4)}
        rows.append(EvalRow(p.name, p.tokens, 4096, 14336, 8, p.config.top_k, p.routing, measured_ms=times,
                            predicted_ms=dict(times), best=min(times, key=times.get)))
    text = "intro\n\n" + markdown(rows, summarize(rows), [1, 2, 4]) + "\n"
    parsed = rows_from_markdown(text, grid)
    assert [r.name for r in parsed] == [p.name for p in grid]
    for a, b in zip(parsed, rows):
        assert a.measured_ms == pytest.approx(b.measured_ms, abs=5e-3)
    scored = rescore(parsed, prof, 2, grid)
    for row in scored:
        assert row.chosen in row.measured_ms and row.regret >= 0
        assert row.predicted_ms[row.chosen] == choose_degree(cfg.with_(top_k=row.top_k), row.tokens, 2, prof,
                                                             degrees=[1, 2, 4]).per_degree_ms[row.chosen]


def test_profiling_never_extends_the_shipped_profile(tmp_path, monkeypatch):
    from interlace.planning import profile as profile_mod

    cfg = MoEConfig(hidden=64, ffn=32, num_experts=4, top_k=2)
    shipped = synthetic_profile(1, cfg, 0.02, 100, 0.02, 500)
    key = profile_mod.machine_key(1, torch.device("cpu"))
    (tmp_path / "shipped").mkdir()
    shipped.key = key
    shipped.save(tmp_path / "shipped" / f"{key}.json")
    monkeypatch.setattr(profile_mod, "PACKAGED_DIR", tmp_path / "shipped")
    monkeypatch.setenv("INTERLACE_PROFILE_DIR", str(tmp_path / "user"))
    env.refresh()
    assert profile_mod.load_profile(1, torch.device("cpu")).key == key  # run time: the shipped one is found
    with pytest.raises(FileNotFoundError):
        profile_mod.load_profile(1, torch.device("cpu"), packaged=False)  # `profile` / `--profile-first`


def test_residual_correction_reproduces_calibration_points_and_interpolates_between_them():
    """What the fitted terms miss at the raw points is interpolated (log rows, then log r),
    held flat outside the calibrated range, and averaged over repeated points."""
    from interlace.planning.pipemoe.calibration import calibrate_profile
    from interlace.planning.pipemoe.degree import residual_ratio

    cfg = MoEConfig(hidden=2048, ffn=1408, num_experts=64, top_k=4)
    prof = synthetic_profile(2, cfg, 0.02, 200, 0.05, 450, host=0.03)
    shape = prof.shapes[shape_key(cfg, 2)]
    truth = dict(host=0.2, alpha=0.3, beta=4e-6, pipe=0.5, chunk=0.05, kappa=0.3)
    clean = _synthetic_points(prof, cfg, truth, "fwd")
    # A bump the model's form cannot describe: r = 8 at 12000 tokens is 30% slower.
    shape.calibration = [(T, k, r, ms * (1.3 if (T, r) == (12000, 8) else 1.0)) for T, k, r, ms in clean]
    calibrate_profile(prof, host_grid=(0.0, 0.2, 0.4))
    for T, _, r, ms in shape.calibration:  # every calibration point is reproduced
        assert predict_layer_ms(prof, cfg, T, 2, r) == pytest.approx(ms, rel=1e-9)
    q = {(int(x), int(d)): v for x, d, v in shape.residuals["fwd"]}
    # Between token counts: linear in log(rows) between the two neighbours.
    lo, hi = q[(3000 * 4, 8)], q[(12000 * 4, 8)]
    w = (math.log(6000) - math.log(3000)) / (math.log(12000) - math.log(3000))
    assert residual_ratio(shape, "fwd", 6000 * 4, 8) == pytest.approx((1 - w) * lo + w * hi, rel=1e-12)
    # Between degrees: linear in log(r) between the calibrated degrees around it.
    w = (math.log(6) - math.log(4)) / (math.log(8) - math.log(4))
    expect = (1 - w) * q[(12000 * 4, 4)] + w * q[(12000 * 4, 8)]
    assert residual_ratio(shape, "fwd", 12000 * 4, 6) == pytest.approx(expect, rel=1e-12)
    # Outside the calibrated range: held flat; no residuals for a mode: no correction.
    assert residual_ratio(shape, "fwd", 10 ** 9, 32) == pytest.approx(q[(40000 * 4, 16)], rel=1e-12)
    assert residual_ratio(shape, "fwdbwd", 12000 * 4, 8) == 1.0
    # The correction is what distinguishes the 30% bump from its neighbours.
    assert residual_ratio(shape, "fwd", 12000 * 4, 8) > 1.1 * residual_ratio(shape, "fwd", 12000 * 4, 4)
    uncorrected = predict_layer_ms(prof, cfg, 12000, 2, 8, corrected=False)
    assert predict_layer_ms(prof, cfg, 12000, 2, 8) == pytest.approx(uncorrected * q[(12000 * 4, 8)], rel=1e-12)
    # JSON round trip keeps them.
    again = Profile.from_json(json.loads(json.dumps(prof.to_json())))
    assert again.shapes[shape_key(cfg, 2)].residuals == shape.residuals


def test_merging_profiles_pools_raw_points_and_refits():
    from interlace.planning.pipemoe.calibration import calibrate_profile, merge_points

    cfg = MoEConfig(hidden=2048, ffn=1408, num_experts=64, top_k=4)
    truth = dict(host=0.2, alpha=0.3, beta=4e-6, pipe=0.5, chunk=0.05, kappa=0.3)
    runs = []
    for factor in (0.8, 1.2):  # two leases, one 20% fast and one 20% slow at every point
        prof = synthetic_profile(2, cfg, 0.02, 200, 0.05, 450, host=0.03)
        pts = _synthetic_points(prof, cfg, truth, "fwd", tokens=(3000, 12000))
        prof.shapes[shape_key(cfg, 2)].calibration = [(T, k, r, ms * factor) for T, k, r, ms in pts]
        calibrate_profile(prof, host_grid=(0.0, 0.2, 0.4))
        runs.append((prof, pts))
    (fast, pts), (slow, _) = runs
    merge_points(fast, [slow])
    assert len(fast.shapes[shape_key(cfg, 2)].calibration) == 2 * len(pts)
    for T, _, r, ms in pts:  # the pooled prediction sits between the two leases' measurements
        assert 0.8 * ms < predict_layer_ms(fast, cfg, T, 2, r) < 1.2 * ms
    other = synthetic_profile(4, cfg, 0.02, 200, 0.05, 450)
    other.key = "another-machine"
    with pytest.raises(ValueError, match="cannot merge"):
        merge_points(fast, [other])
