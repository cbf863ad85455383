"""Memory model (interlace.planning.monta.memory) against hand-computed cases of MoNTA Tables 3–4."""

import random

import pytest

from interlace.config import MoEConfig
from interlace.planning.monta import memory
from interlace.planning.monta.model import ModelSpec


def test_table3_weights():
    rng = random.Random(0)
    P = rng.randint(10**8, 10**10)
    R = rng.choice([2, 4, 8, 16])
    t, p = rng.choice([2, 4, 8]), rng.choice([2, 4])
    assert memory.weight_bytes(P, 1, 0, tp=t, pp=p) == pytest.approx(16 * P / (p * t))  # Baseline row
    assert memory.weight_bytes(P, R, 1) == pytest.approx((4 + 12 / R) * P)  # ZeRO 1
    assert memory.weight_bytes(P, R, 2) == pytest.approx((2 + 14 / R) * P)  # ZeRO 2
    assert memory.weight_bytes(P, R, 3) == pytest.approx(16 / R * P)  # ZeRO 3
    # experts: each EP rank holds 1/e of them
    assert memory.weight_bytes(P, R, 1, tp=t, ep=4) == pytest.approx((4 + 12 / R) * P / (4 * t))
    with pytest.raises(ValueError):
        memory.weight_bytes(P, R, 4)


def test_table4_activations():
    b, s, h, a, l, k, t = 1, 8192, 8192, 64, 80, 2, 8
    coef = lambda **kw: memory.activation_coef(k, heads=a, seq=s, hidden=h, **kw)  # noqa: E731
    # Eq. 2 (no parallelism, scores kept)
    assert coef(tp=1, sp=False, recompute="none", flash_attention=False) == pytest.approx(13 + 21 * k + 5 * a * s / h)
    # TP (+EP), no SP: 5 + 5k + (8 + 16k)/t + 5as/(ht); k = 1 gives Megatron's 10 + 24/t
    assert coef(tp=t, sp=False, recompute="none", flash_attention=False) == pytest.approx(
        5 + 5 * k + (8 + 16 * k) / t + 5 * a * s / (h * t))
    assert memory.activation_coef(1, t, False, "none", a, s, h, True) == pytest.approx(10 + 24 / t)
    # TP + SP, selective recomputation, full recomputation
    assert coef(tp=t, sp=True, recompute="none", flash_attention=False) == pytest.approx(
        (13 + 21 * k) / t + 5 * a * s / (h * t))
    assert coef(tp=t, sp=True, recompute="selective") == pytest.approx((13 + 21 * k) / t)
    assert coef(tp=t, sp=True, recompute="full") == pytest.approx(2 / t)
    assert coef(tp=t, sp=False, recompute="full") == pytest.approx(2)


def test_estimate_adds_up():
    moe = MoEConfig(hidden=1024, ffn=2816, num_experts=16, top_k=2)
    model = ModelSpec("toy", moe, layers=8, heads=16, kv_heads=4, head_dim=64, vocab=32000)
    est = memory.estimate(model, micro_batch=2, seq=4096, tp=2, ep=4, cp=2, pp=2, replicas_non_moe=8,
                          replicas_moe=2, microbatches=8, zero=1, sp=True, recompute="selective")
    P1, P2 = model.non_moe_params(), model.moe_params()
    assert P2 == 8 * 16 * 1024 * 2816 * 3
    assert est.non_moe_weights == pytest.approx((4 + 12 / 8) * P1 / 4)
    assert est.moe_weights == pytest.approx((4 + 12 / 2) * P2 / 16)
    s_local = 4096 / 2
    # 1F1B: min(p, m) = 2 micro-batches of l/p = 4 layers in flight
    assert est.activations == pytest.approx(2 * s_local * 1024 * 4 * 2 * (13 + 21 * 2) / 2)
    assert est.total == pytest.approx(est.non_moe_weights + est.moe_weights + est.activations + est.buffers)
    assert est.buffers > 0
    with pytest.raises(ValueError):
        memory.estimate(model, micro_batch=1, seq=4096, tp=1, ep=3, cp=1, pp=1, replicas_non_moe=1,
                        replicas_moe=1, microbatches=1)
