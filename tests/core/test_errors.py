"""Bad input fails early with a clear ValueError/TypeError (before any kernel runs)."""

import pytest
import torch

from interlace import MoEConfig, MoELayer

BASE = dict(hidden=16, ffn=8, num_experts=4, top_k=2, dtype=torch.float32)


@pytest.mark.parametrize(
    "changes,error,match",
    [
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=5), ValueError, "top_k"),
        (dict(activation="swish"), ValueError, "activation"),
        (dict(router="hash"), ValueError, "router"),
        (dict(dtype=torch.int8), TypeError, "dtype"),
        (dict(router_dtype=torch.bfloat16), TypeError, "router_dtype"),
        (dict(router_gemm="fp8"), ValueError, "router_gemm"),
        (dict(capacity_factor=0.0), ValueError, "capacity_factor"),
        (dict(capacity_factor=-1.5), ValueError, "capacity_factor"),
        (dict(capacity_factor=float("nan")), ValueError, "capacity_factor"),
        (dict(hidden=0), ValueError, "positive"),
        (dict(num_experts=2.5), TypeError, "num_experts"),
        (dict(route_scale=0.0), ValueError, "route_scale"),
        (dict(aux_loss_coef=-1.0), ValueError, "aux_loss_coef"),
    ],
)
def test_bad_config(changes, error, match):
    with pytest.raises(error, match=match):
        MoEConfig(**{**BASE, **changes})


def test_bad_inputs():
    layer = MoELayer(MoEConfig(**BASE), device="cpu")
    with pytest.raises(ValueError, match="hidden"):
        layer(torch.randn(3, 17))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(3, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="is on meta"):
        layer(torch.randn(3, 16, device="meta"))
    with pytest.raises(TypeError, match="tensor"):
        layer([[0.0] * 16])
    with pytest.raises(ValueError, match="shape"):
        layer(torch.randn(3, 16), expert_indices=torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(TypeError, match="int32 or int64"):
        layer(torch.randn(3, 16), expert_indices=torch.zeros(3, 2))
    with pytest.raises(RuntimeError, match="out of range"):
        layer(torch.randn(3, 16), expert_indices=torch.full((3, 2), 4, dtype=torch.long))


def test_bad_strategy_and_options():
    cfg = MoEConfig(**BASE)
    with pytest.raises(ValueError, match="unknown strategy"):
        MoELayer(cfg, strategy="fancy", device="cpu")
    with pytest.raises(TypeError, match="takes no options"):
        MoELayer(cfg, strategy="naive", strategy_options={"degree": 2}, device="cpu")
    with pytest.raises(ValueError, match="expert_backend"):
        MoELayer(cfg, strategy="sequential:cutlass", device="cpu")
    with pytest.raises(ValueError, match="degree"):
        MoELayer(cfg, strategy="pipelined", strategy_options={"degree": 0}, device="cpu")
    with pytest.raises(TypeError, match="MoEConfig"):
        MoELayer(dict(BASE), device="cpu")


@pytest.mark.parametrize(
    "value,match",
    [
        ("copy_cols=500", "copy_cols must be a power of two"),
        ("block_t=0", "block_t must be a power of two"),
        ("defer_count=2", "defer_count is a switch"),
        ("flat1=3", "flat1 is 0"),
        ("gather0=2", "gather0 is -1"),
        ("slice_group=-1", "slice_group"),
        ("send_tma=1", "send_tma stores"),  # copy_cols 512 is past a TMA box's 256
        ("ret_tma=1,block_n1=512", "ret_tma stores"),
        ("no_such_field=1", "unknown field"),
    ],
)
def test_bad_fused_kernel_config_names_the_field(value, match, monkeypatch):
    """INTERLACE_FUSED overrides are checked when the config is built, before any kernel is
    compiled: the field is named (Triton's own errors for these come at compile time, on a GPU)."""
    from interlace.strategies.fused.inference import GPU_CONFIG, kernel_config_from_env

    monkeypatch.setenv("INTERLACE_FUSED", value)
    with pytest.raises(ValueError, match=match):
        kernel_config_from_env(GPU_CONFIG)
    monkeypatch.setenv("INTERLACE_FUSED", "send_tma=1,copy_cols=256,ret_tma=1")
    assert kernel_config_from_env(GPU_CONFIG).send_tma == 1  # within the limits: accepted
