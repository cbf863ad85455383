"""Strategy "auto" deciding from the profile alone (``calibrate=False``; its calibration on
the layer's own calls is tests/strategies/test_auto.py): picks from the shipped profile (or
sequential without one) and its output and gradients equal the fp64 reference on 2 gloo ranks;
fused is chosen for forward-only calls, and fused:lean (fused:train's kernels, the rows received
kept) for training calls, only where the profile measured fused:train faster (pairs timed by `interlace profile` or added from `interlace bench`
results). Decisions are keyed by the power-of-two bucket of the group's largest token count."""

import json

import pytest
import torch

from helpers import reference_grads, rel_err, run_gloo
from interlace import MoEConfig, MoELayer
from interlace.planning.profile import PACKAGED_DIR, Profile, shape_key
from interlace.tools.profile import add_fused_points
from test_pipeline_planning import synthetic_profile

PROFILE = PACKAGED_DIR / "NVIDIA_H200-sm132-w2-n1-p2p.json"
CFG = MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32)


def _auto_matches_reference(rank, world, tmp):
    import os
    import warnings

    os.environ["INTERLACE_PROFILE_DIR"] = tmp  # no profile for the CPU machine key here
    from interlace import env
    env.refresh()
    g = torch.Generator().manual_seed(5)
    for profile, tokens in ((str(PROFILE), 37), (None, 24)):
        layer = MoELayer(CFG, strategy="auto", seed=3, device="cpu",
                         strategy_options={"calibrate": False, "profile": profile})
        xs = [torch.randn(tokens, CFG.hidden, generator=g) for _ in range(world)]
        gs = [torch.randn(tokens, CFG.hidden, generator=g) for _ in range(world)]
        x = xs[rank].clone().requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = layer(x)
        out.backward(gs[rank])
        outs, dxs, *_ = reference_grads(CFG, 3, xs, gs)
        assert rel_err(out, outs[rank]) < 2e-6 and rel_err(x.grad, dxs[rank]) < 2e-6
        choice = layer.strategy.choice_for(tokens, "fwdbwd").spec  # a training call
        if profile is None:
            assert choice == "sequential"
            assert any("auto:" in str(w.message) for w in caught)
        else:
            assert choice == "sequential" or choice.startswith("pipelined:")
            assert layer.strategy.choice_for(tokens, "fwdbwd").notes


def test_auto_on_gloo(tmp_path):
    run_gloo(_auto_matches_reference, 2, str(tmp_path))


FUSED_CFG = MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32)


def fused_profile(speedups: dict[int, float], world: int = 2, train: dict[int, float] | None = None):
    """A synthetic profile of FUSED_CFG whose fused/sequential forward pairs give ``speedups``
    at T (and its fused:train/sequential training pairs ``train``)."""
    prof = synthetic_profile(world, FUSED_CFG, 0.02, 100, 0.02, 500)
    shape = prof.shapes[shape_key(FUSED_CFG, world)]
    shape.fused = [(t, 2, 1.0 / sp, 1.0) for t, sp in speedups.items()]
    shape.fused_train = [(t, 2, 1.0 / sp, 1.0) for t, sp in (train or {}).items()]
    return prof


def test_fused_speedup_interpolates_in_log_rows_and_holds_flat_outside():
    from interlace.planning.pipemoe.degree import fused_speedup

    shape = fused_profile({1000: 2.0, 4000: 1.0}).shapes[shape_key(FUSED_CFG, 2)]
    assert fused_speedup(shape, 2000 * 2) == pytest.approx(1.5)  # halfway in log T
    assert fused_speedup(shape, 10) == pytest.approx(2.0) and fused_speedup(shape, 10 ** 6) == pytest.approx(1.0)
    shape.fused.append((1000, 2, 1.0, 1.0))  # a repeat of T=1000 at speedup 1: averaged
    assert fused_speedup(shape, 2000) == pytest.approx(1.5)
    shape.fused.clear()
    assert fused_speedup(shape, 2000) is None


def test_auto_chooses_fused_only_for_measured_forward_gains():
    from interlace.strategies.auto_prior import FUSED_MARGIN, choose_strategy

    prof = fused_profile({1000: 2.0, 8000: 1.0})
    spec, notes = choose_strategy(FUSED_CFG, 1000, 2, prof, mode="fwd")
    assert spec == "fused" and any("2.00x sequential" in n for n in notes)
    # A training call never runs fused (its train path would be sequential's anyway), and
    # forward pairs say nothing about fused:train.
    spec, notes = choose_strategy(FUSED_CFG, 1000, 2, prof, mode="fwdbwd")
    assert not spec.startswith("fused") and any("no measured fused:train" in n for n in notes)
    # Parity, and a gain below the margin, keep the planner's pick.
    assert choose_strategy(FUSED_CFG, 8000, 2, prof, mode="fwd")[0] != "fused"
    prof = fused_profile({1000: 1 + FUSED_MARGIN / 2})
    assert choose_strategy(FUSED_CFG, 1000, 2, prof, mode="fwd")[0] != "fused"
    # No pairs for this exact shape class (a nearest class's pairs do not count).
    spec, notes = choose_strategy(FUSED_CFG.with_(ffn=48), 1000, 2, fused_profile({1000: 2.0}), mode="fwd")
    assert spec != "fused" and any("no measured fused" in n for n in notes)


def test_auto_chooses_fused_train_only_for_measured_training_gains():
    from interlace.strategies.auto_prior import FUSED_MARGIN, choose_strategy

    prof = fused_profile({1000: 0.5}, train={1000: 1.3, 8000: 0.9})
    spec, notes = choose_strategy(FUSED_CFG, 1000, 2, prof, mode="fwdbwd")
    assert spec == "fused:train" and any("fused:train: 1.30x sequential" in n for n in notes)
    assert choose_strategy(FUSED_CFG, 1000, 2, prof, mode="fwd")[0] != "fused"  # forward pairs: a loss
    assert not choose_strategy(FUSED_CFG, 8000, 2, prof, mode="fwdbwd")[0].startswith("fused")
    prof = fused_profile({}, train={1000: 1 + FUSED_MARGIN / 2})
    assert not choose_strategy(FUSED_CFG, 1000, 2, prof, mode="fwdbwd")[0].startswith("fused")
    # train_fused=False keeps training calls off it (it holds more memory than sequential)
    prof = fused_profile({}, train={1000: 2.0})
    spec, notes = choose_strategy(FUSED_CFG, 1000, 2, prof, mode="fwdbwd", train_fused=False)
    assert spec == "sequential" or spec.startswith("pipelined:")
    assert any("train_fused=False" in n for n in notes)


def _auto_runs_fused_for_inference(rank, world, path):
    g = torch.Generator().manual_seed(7)
    layer = MoELayer(FUSED_CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"profile": path, "calibrate": False})
    # Growing token counts: the fused buffers sized for 20 tokens must not refuse 40 later.
    for tokens in (20, 40, 20):
        xs = [torch.randn(tokens, FUSED_CFG.hidden, generator=g) for _ in range(world)]
        outs = reference_grads(FUSED_CFG, 3, xs, [torch.zeros_like(x) for x in xs])[0]
        with torch.no_grad():
            out = layer(xs[rank])
        assert all(c.spec == "fused" for c in layer.strategy.choices.values())
        assert rel_err(out, outs[rank]) < 2e-6, tokens
    assert layer.strategy._impls["fused"].max_tokens >= 40
    xs = [torch.randn(40, FUSED_CFG.hidden, generator=g) for _ in range(world)]
    gs = [torch.randn(40, FUSED_CFG.hidden, generator=g) for _ in range(world)]
    outs, dxs, *_ = reference_grads(FUSED_CFG, 3, xs, gs)
    x = xs[rank].clone().requires_grad_()
    out = layer(x)
    out.backward(gs[rank])
    train = [c.spec for (_, mode), c in layer.strategy.choices.items() if mode == "fwdbwd"]
    assert train and "fused" not in train
    assert rel_err(out, outs[rank]) < 2e-6 and rel_err(x.grad, dxs[rank]) < 2e-6


def test_auto_runs_fused_for_inference_on_gloo(tmp_path):
    path = tmp_path / "profile.json"
    fused_profile({10: 3.0, 100: 3.0}).save(path)
    run_gloo(_auto_runs_fused_for_inference, 2, str(path))


def _auto_runs_fused_train_for_training(rank, world, path):
    g = torch.Generator().manual_seed(11)
    layer = MoELayer(FUSED_CFG, strategy="auto", seed=3, device="cpu",
                     strategy_options={"profile": path, "calibrate": False})
    for tokens in (20, 40):  # growing: the fused:train buffers are re-sized
        xs = [torch.randn(tokens, FUSED_CFG.hidden, generator=g) for _ in range(world)]
        gs = [torch.randn(tokens, FUSED_CFG.hidden, generator=g) for _ in range(world)]
        outs, dxs, *_ = reference_grads(FUSED_CFG, 3, xs, gs)
        x = xs[rank].clone().requires_grad_()
        layer.zero_grad()
        out = layer(x)
        out.backward(gs[rank])
        # (the profile's fused:train pairs: auto trains through their kernels as fused:lean)
        assert all(c.spec == "fused:lean" for c in layer.strategy.choices.values())
        assert rel_err(out, outs[rank]) < 2e-6 and rel_err(x.grad, dxs[rank]) < 2e-6, tokens
    assert layer.strategy._impls["fused:lean"].max_tokens >= 40


def test_auto_runs_fused_train_for_training_on_gloo(tmp_path):
    path = tmp_path / "profile.json"
    fused_profile({}, train={10: 3.0, 100: 3.0}).save(path)
    run_gloo(_auto_runs_fused_train_for_training, 2, str(path))


def test_fused_pairs_from_bench_results():
    from interlace.tools.bench import bench_config

    cfg = bench_config("qwen2-moe", small=False)
    prof = synthetic_profile(2, cfg, 0.02, 100, 0.02, 500)

    def row(config, tokens, strategy, ms, status="ok", mode="fwd"):
        return dict(config=config, tokens=tokens, strategy=strategy, median_ms=ms, status=status, mode=mode,
                    routing="random")

    results = {"meta": {"world": 2, "date": "d", "device": "D", "commit": "c", "small": False},
               "rows": [row("qwen2-moe", 4096, "sequential", 2.0), row("qwen2-moe", 4096, "fused", 1.0),
                        row("qwen2-moe", 8192, "fused", 1.5),  # no sequential beside it
                        row("qwen2-moe", 16384, "sequential", 4.0), row("qwen2-moe", 16384, "fused", 9.0, "failed"),
                        row("qwen2-moe", 2048, "sequential", 9.0, mode="fwdbwd"),
                        row("qwen2-moe", 2048, "fused", 1.0, mode="fwdbwd"),  # sequential's path: no pair
                        row("qwen2-moe", 4096, "sequential", 6.0, mode="fwdbwd"),
                        row("qwen2-moe", 4096, "fused:train", 5.0, mode="fwdbwd"),
                        row("mixtral-8x7b", 4096, "sequential", 6.0), row("mixtral-8x7b", 4096, "fused", 5.0)]}
    lines = add_fused_points(prof, results)
    assert prof.shapes[shape_key(cfg, 2)].fused == [(4096, cfg.top_k, 1.0, 2.0)]
    assert prof.shapes[shape_key(cfg, 2)].fused_train == [(4096, cfg.top_k, 5.0, 6.0)]
    assert any("8192 fwd: left out (no sequential" in ln for ln in lines)
    assert any("mixtral-8x7b T=4096 fwd: left out (shape class" in ln for ln in lines)
    assert prof.meta["fused_points_from"] == ["d D commit c"]
    # The pairs survive the JSON round trip; results of another world size are refused.
    again = Profile.from_json(json.loads(json.dumps(prof.to_json())))
    assert again.shapes[shape_key(cfg, 2)].fused == [[4096, cfg.top_k, 1.0, 2.0]]
    assert again.shapes[shape_key(cfg, 2)].fused_train == [[4096, cfg.top_k, 5.0, 6.0]]
    with pytest.raises(ValueError, match="world size 4"):
        add_fused_points(prof, {"meta": {"world": 4}, "rows": []})
    # replace: newer results of a shape class drop its older pairs (and say so); appending keeps them
    newer = {"meta": {"world": 2, "small": False},
             "rows": [row("qwen2-moe", 8192, "sequential", 3.0), row("qwen2-moe", 8192, "fused", 2.5)]}
    add_fused_points(prof, newer)
    assert len(prof.shapes[shape_key(cfg, 2)].fused) == 2
    lines = add_fused_points(prof, newer, replace=True)
    assert prof.shapes[shape_key(cfg, 2)].fused == [(8192, cfg.top_k, 2.5, 3.0)]
    assert any("2 older fwd pairs dropped" in ln for ln in lines)
    assert len(prof.shapes[shape_key(cfg, 2)].fused_train) == 1  # only the modes the results have are replaced


def test_layer_planner_predicts_fused_from_measured_pairs():
    """`interlace plan`'s layer model (TP = 1 at the profile's world size): fused = sequential's
    calibrated forward / the measured speedup; a training call swaps only the forward. Without
    pairs it keeps the COMET-overlap model."""
    from interlace.planning.pipemoe.degree import predict_layer_ms as calibrated
    from interlace.planning.monta.layer import predict_layer_ms

    prof = fused_profile({1000: 2.0})
    seq, seq_fb = calibrated(prof, FUSED_CFG, 1000, 2, 1), calibrated(prof, FUSED_CFG, 1000, 2, 1, mode="fwdbwd")
    assert predict_layer_ms(FUSED_CFG, 1000, 1, 2, "O0", "fused", prof) == pytest.approx(seq / 2)
    assert predict_layer_ms(FUSED_CFG, 1000, 1, 2, "O0", "fused", prof, backward=True) == pytest.approx(
        seq_fb - seq / 2)
    prof.shapes[shape_key(FUSED_CFG, 2)].fused.clear()
    modelled = predict_layer_ms(FUSED_CFG, 1000, 1, 2, "O0", "fused", prof)
    assert modelled > 0 and modelled != pytest.approx(seq / 2)
