"""``torch.compile(fullgraph=True)`` of the layer (the strategy call as the custom op
``interlace::moe_experts``, interlace.strategies.custom_op): outputs and every gradient equal
eager (fp32, relative error ≤ TOL), no graph break (``fullgraph=True`` raises on one), dynamic
token counts, the kept autograd graph's lifetime and its errors, a compiled training loop of
several layers and micro-batches, ``fused`` / ``fused:train`` / ``auto`` at world size 1, 2 gloo
ranks, and the interlace.hf adapter's models.

Most compiles use the ``aot_eager`` backend (the same Dynamo graph, fake implementations and
AOTAutograd partition as inductor, without generating code: fast on a CPU); the dynamic-shape
test and the training loop use inductor, the default backend.
"""

import copy
import gc

import pytest
import torch
from torch import nn

from helpers import HF_COMMON, HF_FAMILIES, assert_grads_match, reference_grads, rel_err, run_gloo
from interlace import MoEConfig, MoELayer
from interlace.strategies import custom_op
from interlace.strategies.base import strategy_by_key
from interlace.strategies.sequential import SequentialStrategy

# fp32 throughout. Compiled and eager runs pick the same experts (the router's Triton top-k is the
# op interlace::route_topk under compile); they differ where the compiled weights come from plain
# torch (eagerly from the kernel) and inductor reorders fp32 sums.
TOL = 1e-5
CFG = MoEConfig(hidden=32, ffn=16, num_experts=8, top_k=2, dtype=torch.float32)
# A shared expert with its gate and the balance loss: their compiled code is ordinary torch.
CFG_SHARED = CFG.with_(shared_ffn=8, shared_gate=True, aux_loss_coef=0.01)


class CountingSequential(SequentialStrategy):
    """``sequential`` that counts its calls: the compiled backward must not run the forward again."""

    def __init__(self, config, ep):
        super().__init__(config, ep)
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return super().__call__(*args)


def _forward_backward(layer, fn, x, grad):
    """(out, [dx, grads of every parameter]) of ``fn(x)`` with output gradient ``grad``."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = fn(x)
    out.backward(grad)
    return out.detach(), [x.grad] + [p.grad for p in layer.parameters()]


def _assert_close(got, ref, where):
    out, grads = got
    out_ref, grads_ref = ref
    assert rel_err(out, out_ref) < TOL, f"{where}: output"
    assert len(grads) == len(grads_ref)
    for i, (g, r) in enumerate(zip(grads, grads_ref)):
        assert g is not None and r is not None, f"{where}: gradient {i} missing"
        assert rel_err(g, r) < TOL, f"{where}: gradient {i}"


def test_sequential_compiled_equals_eager_dynamic_tokens():
    """inductor, one dynamic-shape graph for three token counts: outputs, dx, the router's, experts' and shared expert's gradients equal eager; the
    strategy runs once per forward + backward (the backward replays the kept graph)."""
    layer = MoELayer(CFG_SHARED, strategy="sequential", seed=3, device="cpu")
    layer.strategy = CountingSequential(CFG_SHARED, layer.ep)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for T in (13, 29, 21):
        x = torch.randn(T, CFG.hidden, generator=gen)
        grad = torch.randn(T, CFG.hidden, generator=gen)
        calls = layer.strategy.calls
        got = _forward_backward(layer, compiled, x, grad)
        assert layer.strategy.calls == calls + 1, "the compiled forward + backward ran the strategy again"
        aux = layer.last_aux_loss
        ref = _forward_backward(layer, layer, x, grad)
        _assert_close(got, ref, f"T={T}")
        assert rel_err(aux, layer.last_aux_loss) < TOL
    assert not custom_op._PENDING, "a call's autograd graph outlived its backward"


def test_graph_lifetime_and_errors():
    """A forward whose backward never runs frees its graph; a double backward raises. Through the
    op called eagerly: a second backward of one call and a double backward raise clear errors."""
    layer = MoELayer(CFG, strategy="sequential", seed=1, device="cpu")
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(10, CFG.hidden, requires_grad=True)
    out = compiled(x)
    assert len(custom_op._PENDING) == 1
    del out
    gc.collect()
    assert not custom_op._PENDING, "a forward without backward leaked its autograd graph"

    out = compiled(x)
    with pytest.raises(RuntimeError):  # torch.compile's own refusal (its message varies by version)
        (dx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        dx.sum().backward()
    del out
    gc.collect()
    assert not custom_op._PENDING

    # The op called eagerly. (A compiled graph refuses retain_graph=True itself.)
    topk_idx, topk_weight, _ = layer.router(x)
    args = (x, topk_idx, topk_weight, layer.experts.w_up, layer.experts.w_down)
    out = custom_op.strategy_op(layer.strategy, *args)
    assert rel_err(out, layer.strategy(*args)) < TOL
    out.sum().backward(retain_graph=True)
    assert not custom_op._PENDING
    with pytest.raises(RuntimeError, match="second backward"):
        out.sum().backward()
    out = custom_op.strategy_op(layer.strategy, *args)
    (dx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dx.sum().backward()
    with torch.no_grad():
        assert rel_err(compiled(x), layer(x)) < TOL, "no_grad"


class TwoMoE(nn.Module):
    """A linear layer, then two MoE layers with a nonlinearity between them."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(CFG.hidden, CFG.hidden)
        self.moe1 = MoELayer(CFG_SHARED, strategy="sequential", seed=seed + 1, device="cpu")
        self.moe2 = MoELayer(CFG, strategy="auto", seed=seed + 2, device="cpu")

    def forward(self, x):
        h = self.moe1(self.proj(x))
        return self.moe2(torch.tanh(h)) + h


class FrozenRouterMoE(nn.Module):
    """A linear layer, an MoE layer whose router does not train, and code after it that needs a
    fresh buffer of x's shape: nothing but the MoE op reads x once the router has run."""

    def __init__(self, strategy):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(CFG.hidden, CFG.hidden)
        self.moe = MoELayer(CFG, strategy=strategy, seed=1, device="cpu")
        self.moe.router.weight.requires_grad_(False)

    def forward(self, x):
        y = self.moe(self.proj(x) * 2)
        z = torch.exp(y * 3)
        return z * y


@pytest.mark.parametrize("strategy", ["sequential", "sequential:triton"])
def test_compiled_code_keeps_the_inputs_the_kept_graph_reads(strategy):
    """inductor reuses a buffer in place once no op of its graph reads it: the layer's input x,
    when the router does not train, after the MoE op. The Triton expert kernels' backward reads x
    itself (through the op's kept eager graph, which inductor does not see): the op saves x for
    its backward so that its buffer stays intact (without it the expert gradients here were off
    by a relative 7.7e2)."""
    eager, compiled_model = FrozenRouterMoE(strategy), FrozenRouterMoE(strategy)
    compiled = torch.compile(compiled_model, fullgraph=True)
    x = torch.randn(24, CFG.hidden)
    for model, fn in ((eager, eager), (compiled_model, compiled)):
        model.zero_grad(set_to_none=True)
        fn(x).sum().backward()
    for (name, p), q in zip(compiled_model.named_parameters(), eager.parameters()):
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) < TOL, name


def test_compiled_training_loop_equals_eager():
    """inductor: 3 optimizer steps of two MoE layers, each step over 2 micro-batches whose
    forwards both run before one backward (two calls of each layer in flight): losses and
    parameters equal eager."""
    eager, compiled_model = TwoMoE(5), TwoMoE(5)
    compiled = torch.compile(compiled_model, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    batches = [[(torch.randn(T, CFG.hidden, generator=gen), torch.randn(T, CFG.hidden, generator=gen))
                for T in (12, 12)] for _ in range(3)]
    for model, fn in ((eager, eager), (compiled_model, compiled)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model.losses = []
        for micro in batches:
            opt.zero_grad()
            losses = [((fn(x) - y) ** 2).mean() for x, y in micro]
            sum(losses).backward()
            opt.step()
            model.losses.append(sum(loss.item() for loss in losses))
    assert not custom_op._PENDING
    for step, (a, b) in enumerate(zip(compiled_model.losses, eager.losses)):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs eager {b}"
    for (name, p), q in zip(compiled_model.named_parameters(), eager.parameters()):
        assert rel_err(p, q) < TOL, f"{name} after 3 steps"


@pytest.mark.parametrize("strategy", ["fused", "fused:train"])
def test_fused_compiled_equals_eager(strategy):
    """World size 1, the Triton kernels under the interpreter: ``fused`` inference through its
    kernels, ``fused:train``'s forward and backward through them (its backward recorded the
    token count), equal to eager."""
    layer = MoELayer(CFG, strategy=strategy, seed=2, device="cpu", strategy_options={"max_tokens": 32})
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(11, CFG.hidden, generator=gen)
    with torch.no_grad():
        assert rel_err(compiled(x), layer(x)) < TOL, "no_grad forward"
    if strategy == "fused:train":
        grad = torch.randn(11, CFG.hidden, generator=gen)
        got = _forward_backward(layer, compiled, x, grad)
        assert 11 in layer.strategy._train_backward_seen, "the fused backward did not run"
        _assert_close(got, _forward_backward(layer, layer, x, grad), strategy)


def test_auto_compiles_without_graph_break():
    """The default strategy: no graph break (explain), outputs and gradients equal eager."""
    layer = MoELayer(CFG, strategy="auto", seed=6, device="cpu")
    x = torch.randn(10, CFG.hidden)
    explanation = torch._dynamo.explain(layer)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    grad = torch.randn_like(x)
    _assert_close(_forward_backward(layer, compiled, x, grad), _forward_backward(layer, layer, x, grad), "auto")


def test_compiled_inference_hands_the_router_to_persistent():
    """A compiled inference call of a strategy that routes inside its kernel (``persistent``, world
    size 1, the kernel interpreted) goes to it with the router (the op interlace::moe_routed), as
    an eager call does: bitwise eager's output. A training call routes first, as eagerly; a deep
    copy's router has its own key."""
    layer = MoELayer(CFG, strategy="persistent", seed=5, device="cpu")
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    strategy, handed = layer.strategy, []
    forward_layer = strategy.forward_layer
    strategy.forward_layer = lambda *args: handed.append(args[0].shape[0]) or forward_layer(*args)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(9, CFG.hidden, generator=gen)
    with torch.no_grad():
        eager = layer(x)
        assert handed == [9]
        got = compiled(x)
    assert handed == [9, 9], "the compiled inference call did not reach the strategy with its router"
    assert torch.equal(got, eager)
    grad = torch.randn(9, CFG.hidden, generator=gen)
    _assert_close(_forward_backward(layer, compiled, x, grad), _forward_backward(layer, layer, x, grad), "training")
    assert handed == [9, 9], "a training call was handed over with the router"
    clone = copy.deepcopy(layer)
    assert int(clone.router.op_key[0]) != int(layer.router.op_key[0])


def test_set_strategy_recompiles():
    """A layer that switches strategy is not run through the old one; a deep copy's strategy has
    its own key."""
    layer = MoELayer(CFG, strategy="sequential", seed=7, device="cpu")
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, CFG.hidden)
    with torch.no_grad():
        compiled(x)
        layer.strategy = counting = CountingSequential(CFG, layer.ep)
        assert rel_err(compiled(x), layer(x)) < TOL
    assert counting.calls == 2
    clone = copy.deepcopy(layer)  # a copy is another strategy, under its own key
    assert int(clone.strategy.op_key[0]) != int(layer.strategy.op_key[0])
    assert strategy_by_key(int(clone.strategy.op_key[0])) is clone.strategy


def _gloo_sequential(rank, world):
    tokens = [11, 7]
    gen = torch.Generator().manual_seed(9)
    xs = [torch.randn(T, CFG.hidden, generator=gen) for T in tokens]
    gs = [torch.randn(T, CFG.hidden, generator=gen) for T in tokens]
    layer = MoELayer(CFG, strategy="sequential", seed=11, device="cpu")
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = xs[rank].clone().requires_grad_()
    out = compiled(x)
    out.backward(gs[rank])
    refs = reference_grads(CFG, 11, xs, gs)
    where = f"rank {rank}/{world} compiled sequential"
    assert rel_err(out, refs[0][rank]) < TOL, where + " output"
    assert_grads_match(layer, x, refs, rank, tokens[rank], where, TOL)


def test_gloo_sequential_compiled():
    """2 gloo ranks (host-side split sizes inside the op): output and every gradient against the
    fp64 reference."""
    run_gloo(_gloo_sequential, 2)


def _gloo_auto_inference(rank, world):
    tokens = [11, 0]  # (rank 1 holds no tokens: it follows the group in the agreement)
    gen = torch.Generator().manual_seed(21)
    xs = [torch.randn(T, CFG.hidden, generator=gen) for T in tokens]
    layer = MoELayer(CFG, strategy="auto", seed=12, device="cpu")
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    refs = reference_grads(CFG, 12, xs, [torch.zeros_like(x) for x in xs])
    with torch.no_grad():
        for call in range(3):  # (calibration calls, then the decided strategy)
            out = compiled(xs[rank])
            assert rel_err(out, refs[0][rank]) < TOL, f"rank {rank}/{world} compiled auto inference, call {call}"


def test_gloo_auto_compiled_inference():
    """2 gloo ranks, ``auto`` compiled for inference (handed the router inside the op
    interlace::moe_routed, where it agrees with its peer), one rank without tokens: outputs
    against the fp64 reference."""
    run_gloo(_gloo_auto_inference, 2)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_hf_model_compiles(family):
    """interlace.hf with ``sequential``: the whole tiny HF model compiled with fullgraph=True gives
    the eager model's logits and gradients. (HF's router-logits capture,
    ``output_router_logits=True``, uses context variables Dynamo cannot trace: off here.)"""
    transformers = pytest.importorskip("transformers")
    from interlace.hf import replace_moe_blocks

    model_cls, config_cls, fields = HF_FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**HF_COMMON, "output_router_logits": False, **fields})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float()
    replace_moe_blocks(model, strategy="sequential")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    runs = []
    for fn in (compiled, model):
        model.zero_grad(set_to_none=True)
        out = fn(ids, labels=ids)
        out.loss.backward()
        runs.append((out.logits.detach(), [p.grad for p in model.parameters()]))
    (logits, grads), (logits_ref, grads_ref) = runs
    assert rel_err(logits, logits_ref) < TOL
    for (name, _), g, r in zip(model.named_parameters(), grads, grads_ref):
        assert g is not None and rel_err(g, r) < TOL, name


def test_hf_model_compiled_inference_hands_the_router_to_persistent():
    """interlace.hf with ``persistent``, a tiny qwen3_moe model compiled with fullgraph=True for
    inference: each block reaches the strategy with its router (the op interlace::moe_routed, the
    HF router run by the kernel) and the logits equal eager's bitwise."""
    transformers = pytest.importorskip("transformers")
    from interlace.hf import moe_blocks, replace_moe_blocks

    model_cls, config_cls, fields = HF_FAMILIES["qwen3_moe"]
    config = getattr(transformers, config_cls)(**{**HF_COMMON, "output_router_logits": False, **fields})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float()
    replace_moe_blocks(model, strategy="persistent")
    handed = []
    for block in moe_blocks(model):
        forward_layer = block.strategy.forward_layer
        block.strategy.forward_layer = lambda *a, f=forward_layer: handed.append(a[0].shape[0]) or f(*a)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager = model(ids).logits
        calls = len(handed)
        got = compiled(ids).logits
    assert calls == len(moe_blocks(model)) and len(handed) == 2 * calls, handed
    assert torch.equal(got, eager)
    # A router with forward hooks (transformers' output capture: router logits for the balance
    # loss) runs its own forward in the compiled graph, and the strategy routes after it.
    block, fired = moe_blocks(model)[0], []
    block.gate.register_forward_hook(lambda module, args, out: fired.append(len(args)))
    h = torch.randn(2, 8, config.hidden_size, generator=torch.Generator().manual_seed(8))
    compiled_block = torch.compile(block, fullgraph=True, backend="aot_eager")
    handed.clear()
    with torch.no_grad():
        got = compiled_block(h)
        assert fired and not handed, (fired, handed)
        assert rel_err(got, block(h)) < TOL  # (eagerly no collector is active: the kernel routes there)


def test_bf16_split_router_compiles():
    """bf16 activations with the fp32 router's ``"split"`` GEMM (the default on GPUs): its Triton
    kernel is the opaque op ``interlace::split_mm`` under compile (here through the interpreter),
    forward and backward equal to eager."""
    cfg = CFG.with_(dtype=torch.bfloat16)
    assert cfg.router_gemm == "split"
    layer = MoELayer(cfg, strategy="sequential", seed=8, device="cpu")
    assert layer.router.weight.dtype == torch.float32
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(12, cfg.hidden, generator=gen).to(torch.bfloat16)
    grad = torch.randn(12, cfg.hidden, generator=gen).to(torch.bfloat16)
    got, ref = _forward_backward(layer, compiled, x, grad), _forward_backward(layer, layer, x, grad)
    assert rel_err(got[0].float(), ref[0].float()) < 1e-2, "output"  # bf16 output, routing ties aside
    router_grad = [g for g, p in zip(got[1][1:], layer.parameters()) if p is layer.router.weight][0]
    router_ref = [g for g, p in zip(ref[1][1:], layer.parameters()) if p is layer.router.weight][0]
    assert rel_err(router_grad, router_ref) < 1e-2, "router gradient"


def test_compiled_router_picks_the_eager_experts():
    """The compiled router's choice is the Triton top-k kernel's (the op interlace::route_topk):
    softmax and sigmoid-with-bias routers, on rows where two experts' logits tie exactly or lie
    within 3 fp32 ulps of each other, where a top-k of other scores (torch's softmax or sigmoid,
    rounded otherwise than the kernel's) orders them differently in a few rows of each hundred."""
    from interlace.routing import route_logits

    for cfg in (CFG, CFG.with_(router="sigmoid", renormalize=True, route_scale=2.5)):
        gen = torch.Generator().manual_seed(12)
        logits = torch.randn(400, cfg.num_experts, generator=gen)
        ulps = (torch.arange(400) % 7 - 3).to(torch.int32)  # expert 2 within -3..3 ulps of expert 1
        logits[:, 2] = (logits[:, 1].view(torch.int32) + ulps).view(torch.float32)
        logits[:, 1:3] += 2.0  # (mostly among the top 2, where their order is the choice's order)
        bias = torch.randn(cfg.num_experts, generator=gen) * 1e-3 if cfg.router == "sigmoid" else None
        eager = route_logits(logits, bias, cfg, fused=True)
        compiled = torch.compile(lambda lg: route_logits(lg, bias, cfg, fused=True), fullgraph=True,
                                 backend="aot_eager")(logits)
        assert torch.equal(compiled[0], eager[0]), (
            f"{cfg.router}: {int((compiled[0] != eager[0]).any(1).sum())} of 400 rows chose otherwise")
        # No gradient wanted: the kernel's own weights, bitwise eager's.
        assert torch.equal(compiled[1], eager[1]), cfg.router
        # A gradient wanted: the weights in plain torch (differentiable), within fp32 rounding.
        leaf = logits.clone().requires_grad_()
        fn = torch.compile(lambda lg: route_logits(lg, bias, cfg, fused=True), fullgraph=True, backend="aot_eager")
        idx, weight = fn(leaf)
        assert torch.equal(idx, eager[0]) and rel_err(weight, eager[1]) < TOL, cfg.router
        assert weight.requires_grad, cfg.router
