"""interlace.hf: tiny transformers MoE models (built from a config, no downloads) with their MoE
blocks replaced by interlace's, against the same model with HF's own blocks: logits, every
gradient, two optimizer steps and the state-dict round trip, at world size 1 and under gloo
with 2 ranks (experts sharded)."""

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from helpers import HF_COMMON as _COMMON, HF_FAMILIES as FAMILIES, rel_err, run_gloo  # noqa: E402
from interlace.hf import (  # noqa: E402
    expert_parameters, gather_hf_state_dict, moe_blocks, replace_moe_blocks, replicated_parameters,
)

TOL = 1e-5
VOCAB, BATCH, SEQ, STEPS, LR = _COMMON["vocab_size"], 2, 8, 2, 0.05
# Blocks per model: DeepSeek-V3's first layer is dense.
MOE_LAYERS = {"deepseek_v3": 1}


def build(family: str, seed: int = 0):
    """The tiny HF model of ``family`` in fp32, weights a function of ``seed``."""
    model_cls, config_cls, fields = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **fields})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():
        for module in model.modules():  # DeepSeek-V3: a selection bias that changes choices
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, module.num_experts))
    return model


def token_batches(world: int):
    """(world, BATCH, SEQ) token ids: rank r's batch is [r]."""
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (world, BATCH, SEQ), generator=gen)


def loss_of(model, ids):
    """The causal-LM loss with HF's auxiliary balance loss (router logits through the hooks)."""
    return model(ids, labels=ids).loss


def check_family(family: str, strategy: str, rank: int, world: int):
    """Interlace's model on rank ``rank``'s tokens against HF's on all ranks' tokens."""
    ref = build(family)
    model = copy.deepcopy(ref)
    names = replace_moe_blocks(model, strategy=strategy)
    expected = MOE_LAYERS.get(family, 2)
    assert len(names) == expected and len(moe_blocks(model)) == expected
    batches = token_batches(world)
    ids = batches[rank]
    where = f"{family} {strategy} rank {rank}/{world}"

    # logits
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref(ids).logits) < TOL, where + " logits"

    # gradients and two SGD steps (the second's loss is of updated weights); the loss is the sum of
    # every rank's loss, so the replicated parameters' gradients are summed over ranks and the
    # experts' already are (all-to-all backward).
    sharded = {id(p) for p in expert_parameters(model)}
    ref_params = dict(ref.named_parameters())
    for step in range(STEPS):
        model.zero_grad()
        ref.zero_grad()
        loss = loss_of(model, ids)
        loss.backward()
        ref_loss = sum(loss_of(ref, batches[r]) for r in range(world))
        ref_loss.backward()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
            for p in replicated_parameters(model):
                dist.all_reduce(p.grad)
        assert rel_err(total, ref_loss) < TOL, f"{where} loss at step {step}"
        for name, p in model.named_parameters():
            expected = ref_params[name].grad
            if id(p) in sharded:
                lo = p.shape[0] * rank
                expected = expected[lo:lo + p.shape[0]]
            if step == 0:
                assert rel_err(p.grad, expected) < TOL, f"{where} grad of {name}"
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
            for p in ref.parameters():
                p -= LR * p.grad

    # state-dict round trip: the trained weights load into plain HF models, and a full HF state
    # dict loads back into a (sharded) interlace model.
    state = gather_hf_state_dict(model)
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    plain = build(family, seed=1)
    plain.load_state_dict(state)
    again = build(family, seed=2)
    replace_moe_blocks(again, strategy=strategy)
    again.load_state_dict(state)
    with torch.no_grad():
        got = model(ids).logits
        assert rel_err(got, ref(ids).logits) < TOL, where + " logits after training"
        assert rel_err(plain(ids).logits, got) < TOL, where + " HF model from the interlace state dict"
        assert rel_err(again(ids).logits, got) < TOL, where + " interlace model from the HF state dict"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_world_one_matches_hf(family):
    check_family(family, "sequential", 0, 1)


def test_state_dict_equals_hf_at_world_one():
    """Keys, shapes and the very tensors: at world size 1 the replacement copies nothing."""
    ref = build("qwen3_moe")
    model = copy.deepcopy(ref)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    replace_moe_blocks(model, strategy="sequential")
    after = model.state_dict()
    assert list(after) == list(ref.state_dict())
    assert {k: v.data_ptr() for k, v in after.items()} == before


# One gloo launch for every family (a launch costs more than a family's check); the strategies vary.
GLOO_CASES = [("mixtral", "sequential"), ("qwen3_moe", "pipelined:2"), ("olmoe", "auto"),
              ("qwen2_moe", "sequential"), ("deepseek_v3", "sequential"), ("deepseek_v2", "pipelined:2")]


def _gloo_families(rank, world, cases):
    for family, strategy in cases:
        check_family(family, strategy, rank, world)


def test_gloo_two_ranks_match_hf():
    run_gloo(_gloo_families, 2, GLOO_CASES)


def test_unknown_model_raises():
    with pytest.raises(ValueError, match="no transformers MoE block"):
        replace_moe_blocks(torch.nn.Linear(4, 4))


def test_gpt_oss_raises_one_line():
    """gpt-oss's expert biases and clamped SwiGLU are not in interlace's kernels: a clear refusal,
    before any block is replaced."""
    config = transformers.GptOssConfig(**{**_COMMON, "num_hidden_layers": 1}, intermediate_size=24,
                                       num_local_experts=8, num_experts_per_tok=2, head_dim=8)
    model = transformers.GptOssForCausalLM(config)
    with pytest.raises(ValueError, match=r"GptOssMLP is not supported: .*expert biases.*clamped SwiGLU") as info:
        replace_moe_blocks(model, strategy="sequential")
    assert "\n" not in str(info.value)
    assert type(model.model.layers[0].mlp).__name__ == "GptOssMLP"


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_shared_overlap_option_reaches_the_blocks(family):
    """``shared_overlap=False`` (an MoEConfig field, through replace_moe_blocks' config changes)
    turns the side stream off; on a CPU both give HF's logits, bit for bit the same."""
    ref = build(family)
    ids = token_batches(1)[0]
    logits = []
    for overlap in (True, False):
        model = copy.deepcopy(ref)
        replace_moe_blocks(model, strategy="sequential", shared_overlap=overlap)
        assert all(block.config.shared_overlap is overlap for block in moe_blocks(model))
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.equal(logits[0], logits[1])
    with torch.no_grad():
        assert rel_err(logits[0], ref(ids).logits) < TOL


def test_default_strategy_is_auto():
    """Issue 32: the adapter's default strategy is auto, as MoELayer's."""
    from interlace.hf import moe_blocks

    model = build("mixtral")
    replace_moe_blocks(model)
    assert moe_blocks(model) and all(b.strategy.name == "auto" for b in moe_blocks(model))


ROUTED_TOL = 1e-4  # the persistent kernel's fp32 dots (interpreter) against HF's fp32 model


def check_routed_inference(family: str, strategy: str, options: dict, rank: int, world: int, calls: int = 3):
    """Inference calls reach the strategy with HF's router (KernelRouter) where it routes inside
    its kernel, and give HF's logits; while transformers collects the router logits the router's
    own forward runs instead (HF's hooks record them)."""
    ref = build(family)
    model = copy.deepcopy(ref)
    replace_moe_blocks(model, strategy=strategy, strategy_options=options)
    routed = []
    for block in moe_blocks(model):
        forward = block.strategy.forward_layer

        def spy(*args, forward=forward):
            routed.append(1)
            return forward(*args)

        block.strategy.forward_layer = spy
    ids = token_batches(world)[rank]
    where = f"{family} {strategy} rank {rank}/{world}"
    with torch.no_grad():
        for _ in range(calls):
            got = model(ids, output_router_logits=False).logits
            assert rel_err(got, ref(ids, output_router_logits=False).logits) < ROUTED_TOL, where
        assert len(routed) == calls * len(moe_blocks(model)), where
        out = model(ids, output_router_logits=True)
        assert len(routed) == calls * len(moe_blocks(model)), where + ": routed while collecting router logits"
        assert len(out.router_logits) == len(moe_blocks(model))
        assert rel_err(out.logits, ref(ids).logits) < ROUTED_TOL, where


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def test_world_one_persistent_routes_in_its_kernel(family):
    check_routed_inference(family, "persistent", {}, 0, 1)


def test_kernel_router_of_a_model_made_in_inference_mode():
    """A model copied or loaded under torch.inference_mode has inference tensors (no version
    counter): the router view still converts its weight once and follows a new weight."""
    from interlace.hf import KernelRouter

    ref = build("qwen3_moe").to(torch.bfloat16)
    ids = token_batches(1)[0]
    with torch.inference_mode():
        model = copy.deepcopy(ref)
        replace_moe_blocks(model, strategy="persistent")
        router: KernelRouter = moe_blocks(model)[0].kernel_router
        assert router.gate.weight.is_inference() and router.logits_dtype == torch.bfloat16
        first = router.weight
        assert first.dtype == torch.float32 and router.weight is first  # converted once
        router.gate.weight = torch.nn.Parameter(router.gate.weight * 2, requires_grad=False)
        assert torch.equal(router.weight, first * 2)
        model(ids[:, :2], output_router_logits=False)  # (bf16 under the interpreter: runs, values unchecked)


def _gloo_routed(rank, world):
    # auto weighs persistent (its kernel under the interpreter, the staged transport) against sequential
    check_routed_inference("qwen3_moe", "auto", {"candidates": ("sequential", "persistent"), "warmup": 0,
                                                 "samples": 1, "extra_samples": 0, "cache": False},
                          rank, world, calls=4)


def test_gloo_two_ranks_auto_routes_hf_blocks_through_persistent():
    run_gloo(_gloo_routed, 2)


def test_gpu_block_check_script_runs_on_the_cpu(capsys):
    """tests/gpu/hf_persistent_check.py --smoke: a tiny fp32 Qwen3-MoE block through sequential and
    persistent (rounding on and off) against HF's block, on the CPU."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "gpu" / "hf_persistent_check.py"
    spec = importlib.util.spec_from_file_location("hf_persistent_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--smoke"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASS")
