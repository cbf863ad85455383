"""FP8 checkpoints: interlace.fp8_checkpoint's layouts (DeepSeek-V3's per-expert tensors,
vLLM/SGLang's fused ones) both ways, and transformers' own FP8 experts (``FP8Experts``) run by
:func:`interlace.hf.replace_moe_blocks` as they are, against HF's forward.

HF's FP8 experts compute their GEMMs with the ``kernels-community/finegrained-fp8`` Triton
kernel, downloaded from the Hub at the first call: not here (no network, no GPU). The tests
replace ``FP8Experts.linear`` (one expert's GEMM) by what that kernel computes, W8A8: the
activations quantized per token and 128 columns (amax / 448 scales), the weight's 128 × 128
blocks, fp32 sums (:func:`w8a8_linear`); HF's forward (routing, gating, the combine) is its own.
"""

import copy

import pytest
import torch

from helpers import HF_COMMON, HF_FAMILIES, rel_err, run_gloo, shared_tempdir
from interlace import MoEConfig, MoELayer, quantize_experts
from interlace.fp8 import BlockFP8Weight, dequantize_rows, dequantize_weight, quantize_rows, quantize_weight
from interlace.fp8_checkpoint import from_deepseek, from_transformers, from_vllm, to_deepseek, to_vllm
from interlace.hf import gather_hf_state_dict, moe_blocks, replace_moe_blocks

# ------------------------------------------------------------------------------- loaders


def _experts(E: int, K: int, N: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return quantize_weight(torch.randn(E, 2 * K, N, generator=gen)), quantize_weight(torch.randn(E, N, K, generator=gen))


def _equal(a: BlockFP8Weight, b: BlockFP8Weight) -> bool:
    return torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8)) and torch.equal(a.scale_inv, b.scale_inv)


def test_deepseek_layout_round_trip():
    w_up, w_down = _experts(3, 256, 160)  # K a multiple of 128: exact both ways
    state = to_deepseek(w_up, w_down, "model.layers.3.mlp.", first_expert=4)
    assert state["model.layers.3.mlp.experts.5.gate_proj.weight"].shape == (256, 160)
    assert state["model.layers.3.mlp.experts.5.up_proj.weight_scale_inv"].shape == (2, 2)
    assert state["model.layers.3.mlp.experts.6.down_proj.weight_scale_inv"].shape == (2, 2)
    up, down = from_deepseek(state, "model.layers.3.mlp.", range(4, 7))
    assert _equal(up, w_up) and _equal(down, w_down)
    up, down = from_deepseek(state, "model.layers.3.mlp.", [5])  # a rank's own experts
    assert _equal(up, BlockFP8Weight(w_up.weight[1:2], w_up.scale_inv[1:2]))
    with pytest.raises(KeyError, match="experts.7.gate_proj.weight"):
        from_deepseek(state, "model.layers.3.mlp.", [7])


def test_deepseek_gate_and_up_quantized_apart():
    """DeepSeek's checkpoints quantize gate and up on their own grids: stacked exactly where
    K % 128 == 0; K = 72 refuses, or requantizes (a second rounding, within e4m3's error)."""
    gen = torch.Generator().manual_seed(1)
    for K in (128, 72):
        gate, up, down = (torch.randn(2, *s, generator=gen) for s in ((K, 96), (K, 96), (96, K)))
        state = {}
        for e in range(2):
            for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                q = quantize_weight(w[e])
                state[f"experts.{e}.{proj}.weight"], state[f"experts.{e}.{proj}.weight_scale_inv"] = q.weight, q.scale_inv
        separate = torch.cat([quantize_weight(gate).dequantize(), quantize_weight(up).dequantize()], dim=1)
        if K == 128:
            w_up, _ = from_deepseek(state, "", range(2))
            assert torch.equal(w_up.dequantize(), separate)
            continue
        with pytest.raises(ValueError, match="not a multiple of 128.*requantize=True"):
            from_deepseek(state, "", range(2))
        w_up, w_down = from_deepseek(state, "", range(2), requantize=True)
        assert w_up.scale_inv.shape == (2, 2, 1) and rel_err(w_up.dequantize(), separate) < 0.05
        with pytest.raises(ValueError, match="requantize=True"):
            to_deepseek(w_up, w_down, "")


def test_vllm_layout_round_trip():
    w_up, w_down = _experts(2, 128, 200)
    state = to_vllm(w_up, w_down)
    assert state["w13_weight_scale_inv"].shape == (2, 2, 2) and state["w2_weight_scale_inv"].shape == (2, 2, 1)
    up, down = from_vllm(**state)
    assert _equal(up, w_up) and _equal(down, w_down)
    w_up, w_down = _experts(2, 72, 64)  # K = 72: vLLM's grid has 2·1 block rows, interlace's stack ⌈144/128⌉ = 2
    with pytest.raises(ValueError, match="requantize"):
        to_vllm(w_up, w_down)
    state = to_vllm(w_up, w_down, requantize=True)
    up, _ = from_vllm(**state, requantize=True)
    assert rel_err(up.dequantize(), w_up.dequantize()) < 0.05
    with pytest.raises(ValueError, match="block rows"):
        from_vllm(state["w13_weight"], state["w13_weight_scale_inv"][:, :1], state["w2_weight"],
                  state["w2_weight_scale_inv"])


def test_transformers_layout_and_ue8m0_scales():
    w_up, w_down = _experts(2, 128, 64)
    up, down = from_transformers(w_up.weight, w_up.scale_inv, w_down.weight, w_down.scale_inv)
    assert up.weight.data_ptr() == w_up.weight.data_ptr() and _equal(down, w_down)  # (no copy)
    pow2 = torch.exp2(torch.randint(-8, 0, w_down.scale_inv.shape).float())
    _, down = from_transformers(w_up.weight, w_up.scale_inv, w_down.weight, pow2.to(torch.float8_e8m0fnu))
    assert torch.equal(down.scale_inv, pow2)
    small = quantize_weight(torch.randn(2, 64, 64))  # K = 32: transformers allocates 2 scale rows (one per half)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        from_transformers(small.weight, small.scale_inv.repeat(1, 2, 1), w_down.weight[:, :, :32].contiguous(),
                          w_down.scale_inv[:, :, :1].contiguous())


def test_load_into_an_fp8_layer():
    cfg = MoEConfig(hidden=64, ffn=128, num_experts=4, top_k=2, dtype=torch.float32, expert_quant="fp8")
    src = MoELayer(cfg, seed=0, device="cpu", strategy="sequential")
    ex = src.experts
    state = to_deepseek(*ex.expert_weights(), "mlp.")
    layer = MoELayer(cfg, seed=1, device="cpu", strategy="sequential")
    layer.experts.load_fp8_(*from_deepseek(state, "mlp.", range(4)))
    layer.router.load_state_dict(src.router.state_dict())
    x = torch.randn(8, 64)
    with torch.no_grad():
        assert torch.equal(layer(x), src(x))
    with pytest.raises(ValueError, match="dense"):
        MoELayer(cfg.with_(expert_quant=None), device="cpu").experts.load_fp8_(*ex.expert_weights())


# ------------------------------------------------------------------------------- transformers

# hidden 128, expert FFN 128: transformers' on-the-fly quantizer only quantizes tensors whose
# dims are multiples of the block (it leaves others dense).
FP8_FAMILIES = {
    "qwen3_moe": dict(hidden_size=128, moe_intermediate_size=128, num_experts=4, head_dim=32),
    "deepseek_v3": dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=256),
}
# Logits of the interlace model against HF's FP8 forward, both W8A8, fp32: the same roundings,
# but an activation whose fp32 value differs in its last bits (GEMMs over other row batches sum
# in another order) may round to the neighbouring e4m3 value, a step of 2⁻³ relative on that
# element. Measured with the fp32 reference path: 2.9e-7 (qwen3_moe), 7.8e-8 (deepseek_v3) at
# world size 1, 3.4e-7 and 3.6e-5 on the 2 gloo ranks; with the Triton W8A8 kernels under the
# interpreter (they sum each 128-column block's e4m3 products before scaling): 3.6e-5, 6.0e-4.
TOL = 2e-3


def w8a8_linear(self, input, weight, weight_scale_inv, activation_scale=None):
    """What transformers' finegrained-fp8 kernel computes for one expert GEMM (see the module doc)."""
    q, s = quantize_rows(input.reshape(-1, input.shape[-1]))
    return (dequantize_rows(q, s) @ dequantize_weight(weight, weight_scale_inv).t()).to(input.dtype)


def w8a16_linear(self, input, weight, weight_scale_inv, activation_scale=None):
    """The weights dequantized, the activations as they are (HF's backward's arithmetic)."""
    return input @ dequantize_weight(weight, weight_scale_inv).to(input.dtype).t()


def emulate_hf_kernel(linear=w8a8_linear):
    from transformers.integrations.finegrained_fp8 import FP8Experts

    FP8Experts.linear = linear


def hf_fp8_model(family: str, seed: int = 0):
    """The tiny HF model of ``family`` (fp32) and its FP8 twin: experts replaced by transformers'
    ``FP8Experts`` and quantized by transformers' own quantizer op (``Fp8Quantize``)."""
    import transformers
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize, replace_with_fp8_linear

    model_cls, config_cls, fields = HF_FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**HF_COMMON, **fields, **FP8_FAMILIES[family],
                                                  "output_router_logits": False})
    torch.manual_seed(seed)
    dense = getattr(transformers, model_cls)(config).float()
    state = dense.state_dict()
    qc = FineGrainedFP8Config(weight_block_size=(128, 128), modules_to_not_convert=[r"^(?!.*\.experts$).*"])
    model = copy.deepcopy(dense)
    replace_with_fp8_linear(model, modules_to_not_convert=qc.modules_to_not_convert, quantization_config=qc)
    quantizer = Fp8Quantize(type("Q", (), {"quantization_config": qc})())
    fp8_state = {}
    for key, value in state.items():
        fp8_state.update(quantizer._quantize_one(key, value) if ".experts." in key else {key: value})
    model.load_state_dict(fp8_state, assign=True)
    model.set_experts_implementation("eager")  # (the per-expert loop that calls FP8Experts.linear)
    return dense, model


@pytest.mark.parametrize("family", list(FP8_FAMILIES))
def test_fp8_model_matches_hf(family, monkeypatch):
    pytest.importorskip("transformers")
    from transformers.integrations.finegrained_fp8 import FP8Experts

    dense, ref = hf_fp8_model(family)
    experts = [m for m in ref.modules() if isinstance(m, FP8Experts)]
    assert experts and experts[0].gate_up_proj.dtype == torch.float8_e4m3fn
    model = copy.deepcopy(ref)
    pointers = {k: v.data_ptr() for k, v in model.state_dict().items()}
    replace_moe_blocks(model, strategy="auto")
    blocks = moe_blocks(model)
    assert blocks and all(b.config.expert_quant == "fp8" and b.config.dtype == torch.float32 for b in blocks)
    # taken as they are: no dequantization, no copy at world size 1
    assert [k for k in model.state_dict()] == [k for k in ref.state_dict()]
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == pointers
    ex = blocks[0].experts
    assert ex.gate_up_proj.dtype == torch.float8_e4m3fn and ex.scale_names == ("gate_up_proj_scale_inv",
                                                                               "down_proj_scale_inv")
    ids = torch.randint(0, HF_COMMON["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(FP8Experts, "linear", w8a8_linear)
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
        monkeypatch.setattr(FP8Experts, "linear", w8a16_linear)
        w8a16 = ref(ids).logits
        full = dense(ids).logits
    err, act_err, dense_err = rel_err(got, want), rel_err(want, w8a16), rel_err(got, full)
    print(f"{family}: logits vs HF W8A8 {err:.2e}, HF W8A8 vs HF W8A16 {act_err:.2e}, vs the dense model {dense_err:.2e}")
    assert err < TOL
    # The activations' quantization alone (HF's W8A8 against W8A16): measured 0.030 / 0.027; the
    # whole FP8 error against the dense model: 0.047 / 0.041.
    assert act_err < 0.05 and dense_err < 0.1
    # greedy generation agrees token for token
    monkeypatch.setattr(FP8Experts, "linear", w8a8_linear)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:1], **kw), ref.generate(ids[:1], **kw))
    # inference only; the state dict loads into HF's FP8 model
    with pytest.raises(RuntimeError, match="inference-only"):
        model(ids)
    _, plain = hf_fp8_model(family, seed=1)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, want)


def test_quantize_experts_on_hf_blocks():
    pytest.importorskip("transformers")
    dense, _ = hf_fp8_model("qwen3_moe")
    model = copy.deepcopy(dense)
    replace_moe_blocks(model, strategy="sequential")
    assert quantize_experts(model) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    block = moe_blocks(model)[0]
    assert block.config.expert_quant == "fp8" and block.gate.interlace_config is block.config
    assert block.experts.gate_up_proj_scale_inv.shape == (4, 2, 1)
    ids = torch.randint(0, HF_COMMON["vocab_size"], (2, 8))
    with torch.no_grad():
        assert rel_err(model(ids).logits, dense(ids).logits) < 0.1


def _gloo_hf_fp8(rank, world):
    emulate_hf_kernel()
    _, ref = hf_fp8_model("qwen3_moe")
    model = copy.deepcopy(ref)
    replace_moe_blocks(model, strategy="sequential")
    assert moe_blocks(model)[0].experts.gate_up_proj_scale_inv.shape[0] == 4 // world
    ids = torch.randint(0, HF_COMMON["vocab_size"], (world, 2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel_err(model(ids[rank]).logits, ref(ids[rank]).logits) < TOL
    def same_as_ref(state):
        return all(torch.equal(state[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else state[k],
                               v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v)
                   for k, v in ref.state_dict().items())

    assert same_as_ref(gather_hf_state_dict(model))
    # torch.distributed.checkpoint of the EP-sharded FP8 experts (HF's keys; the scales sharded as
    # the weights) into the replaced model of another seed's FP8 model, bitwise
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from interlace.checkpoint import expert_sharded_state_dict

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    with shared_tempdir("interlace-hf-fp8-dcp-") as path:  # (removed after the round trip)
        dcp.save(expert_sharded_state_dict(model, mesh), checkpoint_id=path)
        _, fresh = hf_fp8_model("qwen3_moe", seed=1)
        replace_moe_blocks(fresh, strategy="sequential")
        assert not same_as_ref(gather_hf_state_dict(fresh))
        dcp.load(expert_sharded_state_dict(fresh, mesh), checkpoint_id=path)
        assert same_as_ref(gather_hf_state_dict(fresh))


def test_gloo_two_ranks_fp8_hf():
    pytest.importorskip("transformers")
    run_gloo(_gloo_hf_fp8, 2)


@pytest.mark.parametrize("attr, value, match", [("block_size", (64, 64), "block_size"),
                                                ("activation_scheme", "static", "activation_scheme")])
def test_fp8_experts_interlace_cannot_take_raise(attr, value, match):
    pytest.importorskip("transformers")
    _, model = hf_fp8_model("qwen3_moe")
    setattr(model.model.layers[0].mlp.experts, attr, value)
    with pytest.raises(ValueError, match=match):
        replace_moe_blocks(model, strategy="sequential")
