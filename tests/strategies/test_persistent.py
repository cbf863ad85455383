"""The ``persistent`` strategy (world size 1) under TRITON_INTERPRET=1: inference calls route
inside the kernel (the layer's hook), training calls and forced indices run ``sequential``'s
path; both against the fp64 reference. Phase-1 refusals are one-line ValueErrors."""

from __future__ import annotations

import pytest
import torch

from interlace import MoEConfig, MoELayer, reference_moe
from interlace.kernels.persistent.launch import PersistentKernelConfig
from interlace.parallel.comm import ExpertParallel
from interlace.strategies import auto
from interlace.strategies.persistent import PersistentStrategy

CPU = torch.device("cpu")


def layer_for(router="softmax", strategy_options=None, **changes):
    changes = {"dtype": torch.float32, **changes}
    cfg = MoEConfig(hidden=32, ffn=24, num_experts=4, top_k=2, router=router, **changes)
    layer = MoELayer(cfg, strategy="persistent", seed=3, device=CPU, strategy_options=strategy_options)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.randn(cfg.num_experts) * 0.1)
    return layer


def reference(layer, x, **kw):
    shared = None
    if layer.shared is not None:
        shared = (layer.shared.w_up.detach(), layer.shared.w_down.detach(),
                  None if layer.shared.gate is None else layer.shared.gate.detach())
    ref, _ = reference_moe(x.reshape(-1, layer.config.hidden), layer.router.weight.detach(),
                           layer.experts.w_up.detach(), layer.experts.w_down.detach(), layer.config,
                           expert_bias=layer.router.expert_bias, shared=shared, **kw)
    return ref.reshape(x.shape)


def epoch(layer) -> int:
    buf = layer.strategy.state.buffer
    return 0 if buf is None else int(buf[0])


@pytest.mark.parametrize("T", [0, 1, 7, 33])
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_inference_routes_in_the_kernel(T, router):
    extra = dict(renormalize=True, route_scale=2.5) if router == "sigmoid" else {}
    layer = layer_for(router, **extra)
    x = torch.randn(T, 32)
    with torch.no_grad():
        out = layer(x)
        again = layer(x)
    assert epoch(layer) == (2 if T else 0)  # two launches of the kernel (none for T = 0)
    assert torch.equal(out, again)
    assert torch.isfinite(out).all()
    if T:
        assert (out.double() - reference(layer, x)).abs().max() < 1e-4


def test_batched_input_and_shared_expert():
    layer = layer_for(shared_ffn=16, shared_gate=True)
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == x.shape and epoch(layer) == 1
    assert (out.double() - reference(layer, x)).abs().max() < 1e-4


def test_training_call_runs_sequential():
    layer = layer_for()
    x = torch.randn(7, 32, requires_grad=True)
    out = layer(x)
    assert epoch(layer) == 0  # not the kernel
    assert (out.double() - reference(layer, x.detach())).abs().max() < 1e-4
    out.sum().backward()
    assert x.grad is not None and layer.experts.w_up.grad is not None and layer.router.weight.grad is not None


def test_forced_indices_run_sequential():
    layer = layer_for()
    x = torch.randn(7, 32)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3], [0, 3]])
    with torch.no_grad():
        out = layer(x, expert_indices=idx)
    assert epoch(layer) == 0
    assert (out.double() - reference(layer, x, expert_indices=idx)).abs().max() < 1e-4


def test_broken_task_order_raises():
    layer = layer_for(strategy_options={"task_order": "combine_first", "max_spins": 1})
    with torch.no_grad(), pytest.raises(RuntimeError, match="timed out waiting for the GEMM1 counter"):
        layer(torch.randn(7, 32))


def test_kernel_option_and_bad_options():
    layer = layer_for(strategy_options={"kernel": PersistentKernelConfig(block_m=32, programs=2)})
    x = torch.randn(33, 32)
    with torch.no_grad():
        assert (layer(x).double() - reference(layer, x)).abs().max() < 1e-4
    with pytest.raises(TypeError, match="PersistentKernelConfig"):
        layer_for(strategy_options={"kernel": {"block_m": 16}})
    with pytest.raises(ValueError, match="task_order"):
        layer_for(strategy_options={"task_order": "backwards"})


@pytest.mark.parametrize("changes, message", [
    (dict(capacity_factor=1.0), "dropless only"),
    (dict(n_group=2, topk_group=1), "group-limited routing"),
    (dict(softmax_after_topk=True), "softmax_after_topk"),
    (dict(dtype=torch.float64), "bf16/fp16/fp32"),
])
def test_phase_one_refusals(changes, message):
    with pytest.raises(ValueError, match=message):
        layer_for(**changes)


def test_world_size_above_one_is_refused():
    cfg = MoEConfig(hidden=32, ffn=24, num_experts=4, top_k=2, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^persistent: world size 1 only in this phase \(issue 30\)$"):
        PersistentStrategy(cfg, ExpertParallel(None, 0, 2, 2))


def test_not_an_auto_candidate():
    import inspect

    assert "persistent" not in inspect.getsource(auto)
