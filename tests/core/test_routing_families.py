"""Routing and experts of real model families against the fp64 reference, every strategy that
runs on a CPU, forward and backward: DeepSeek-V3 group-limited sigmoid routing with its
selection bias and routed scaling and shared experts, DeepSeek-V2's max-score groups,
Qwen2-MoE's gated shared expert, top-k-then-softmax; and the same under gloo with 2 ranks."""

import pytest
import torch
import torch.distributed as dist

from cases import make_inputs
from helpers import full_weights, rel_err, run_gloo
from interlace import MoEConfig, MoELayer, reference_moe
from interlace.experts import SharedExpert, shard_ffn
from interlace.parallel.mesh import MoEMesh
from interlace.routing import limit_to_groups

TOL = 2e-6
BASE = dict(hidden=32, ffn=16, num_experts=16, top_k=3, dtype=torch.float32)
CONFIGS = {
    "deepseek-v3": MoEConfig(**BASE, router="sigmoid", n_group=4, topk_group=2, renormalize=True, route_scale=2.5,
                             shared_ffn=32),
    "deepseek-v2": MoEConfig(**BASE, n_group=8, topk_group=3, group_score="max", route_scale=1.5, shared_ffn=16),
    "qwen2-moe": MoEConfig(**BASE, shared_ffn=24, shared_gate=True),
    "topk-then-softmax": MoEConfig(**BASE, softmax_after_topk=True, route_scale=2.0),
}
STRATEGIES = ["naive", "sequential", "sequential:triton", "pipelined:2", "fused", "fused:train", "auto"]
SEED = 5


def selection_bias(cfg: MoEConfig) -> torch.Tensor | None:
    """A nonzero selection bias for the sigmoid router, large enough to change choices."""
    if cfg.router != "sigmoid":
        return None
    return torch.linspace(-0.3, 0.3, cfg.num_experts, dtype=torch.float32).flip(0)


def build(cfg: MoEConfig, strategy: str) -> MoELayer:
    layer = MoELayer(cfg, strategy=strategy, seed=SEED, device="cpu")
    if cfg.router == "sigmoid":
        layer.router.expert_bias.copy_(selection_bias(cfg))
    return layer


def references(cfg: MoEConfig, xs, gs):
    """fp64 outputs and dx per rank, and the router, expert and shared-expert gradients summed
    over ranks (the loss is Σ_r <g_r, out_r>)."""
    rw, _, wu, wd = full_weights(cfg, SEED)
    shared = SharedExpert(cfg, SEED, torch.device("cpu"))
    params = [rw, wu, wd, shared.w_up, shared.w_down] + ([shared.gate] if cfg.shared_gate else [])
    params = [p.detach().double().requires_grad_() for p in params]
    rw, wu, wd, s_up, s_down, *s_gate = params
    outs, dxs = [], []
    for x, g in zip(xs, gs):
        x = x.detach().double().requires_grad_()
        out, _ = reference_moe(x, rw, wu, wd, cfg, expert_bias=selection_bias(cfg),
                               shared=(s_up, s_down, s_gate[0] if s_gate else None))
        (out * g.double()).sum().backward()
        outs.append(out.detach())
        dxs.append(x.grad)
    return outs, dxs, {name: p.grad for name, p in zip(
        ["router.weight", "experts.w_up", "experts.w_down", "shared.w_up", "shared.w_down", "shared.gate"], params)}


def check(cfg_name: str, strategy: str, rank: int = 0, world: int = 1, tp: int = 1):
    """The layer on rank ``rank`` against the fp64 reference. With ``tp`` > 1 (``tp_ep``), the
    world is one expert-parallel rank whose TP group holds the same tokens and shards each
    expert's FFN."""
    cfg = CONFIGS[cfg_name]
    batches = world // tp
    xs, gs = make_inputs(cfg, [37, 21][:batches], seed=3)
    if tp > 1:
        mesh = MoEMesh.build(tp=tp)
        layer = MoELayer(cfg, mesh=mesh, strategy=strategy, seed=SEED, device="cpu")
        if cfg.router == "sigmoid":
            layer.router.expert_bias.copy_(selection_bias(cfg))
        batch, ffn_slice = mesh.ep_rank, mesh.shard_ffn(cfg.ffn)
    else:
        layer, batch, ffn_slice = build(cfg, strategy), rank, (0, cfg.ffn)
    x = xs[batch].clone().requires_grad_()
    out = layer(x)
    out.backward(gs[batch])
    outs, dxs, grads = references(cfg, xs, gs)
    where = f"{cfg_name} {strategy} rank {rank}/{world}"
    assert rel_err(out, outs[batch]) < TOL, where + " output"
    assert rel_err(x.grad, dxs[batch]) < TOL, where + " dx"
    lo, hi = layer.ep.first_expert, layer.ep.first_expert + layer.ep.num_local
    expert_grads = shard_ffn(grads["experts.w_up"][lo:hi], grads["experts.w_down"][lo:hi], cfg, *ffn_slice)
    for name, p in layer.named_parameters():
        grad = p.grad.clone()
        if not name.startswith("experts.") and batches > 1:
            dist.all_reduce(grad, group=layer.ep.group)  # replicated: each batch holds its tokens' share
        expected = dict(zip(["experts.w_up", "experts.w_down"], expert_grads)).get(name, grads[name])
        assert rel_err(grad, expected) < TOL, f"{where} grad of {name}"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_world1_matches_reference(cfg_name, strategy):
    check(cfg_name, strategy)


def _gloo(rank, world):
    for cfg_name in CONFIGS:
        for strategy in ("sequential", "pipelined:2"):
            check(cfg_name, strategy, rank, world)


def test_gloo_two_ranks_match_reference():
    run_gloo(_gloo, 2)


def _gloo_tp(rank, world):
    for cfg_name in CONFIGS:
        check(cfg_name, "tp_ep:O1", rank, world, tp=2)


def test_gloo_tp_ep_matches_reference():
    """tp_ep with shared experts: 2 ranks, one TP group of 2 (each expert's FFN halved); the
    shared expert is replicated, so its gradient on each TP rank is the full one."""
    run_gloo(_gloo_tp, 2)


@pytest.mark.parametrize("strategy", ["sequential", "fused:train"])
def test_shared_overlap_off_is_the_same_on_cpu(strategy):
    """``shared_overlap`` only moves the shared expert to a side stream on CUDA; on a CPU the
    output and every gradient are bitwise those of the option turned off."""
    cfg = CONFIGS["qwen2-moe"]
    xs, gs = make_inputs(cfg, [29], seed=4)
    runs = []
    for overlap in (True, False):
        layer = build(cfg.with_(shared_overlap=overlap), strategy)
        x = xs[0].clone().requires_grad_()
        out = layer(x)
        out.backward(gs[0])
        runs.append([out, x.grad] + [p.grad for _, p in sorted(layer.named_parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert cfg.with_(shared_overlap=False).fingerprint() == cfg.fingerprint()  # ranks may differ in it
    with pytest.raises(TypeError, match="shared_overlap must be a bool"):
        cfg.with_(shared_overlap="yes")


def test_group_limit_keeps_only_the_best_groups():
    """DeepSeek-V3's rule written out: group score = sum of its two best scores; every chosen
    expert lies in one of the topk_group best groups."""
    cfg = CONFIGS["deepseek-v3"]
    choice = torch.rand(50, cfg.num_experts, dtype=torch.float64)
    limited = limit_to_groups(choice, cfg)
    per_group = cfg.num_experts // cfg.n_group
    for t in range(50):
        scores = [sorted(choice[t, g * per_group:(g + 1) * per_group].tolist())[-2:] for g in range(cfg.n_group)]
        best = sorted(range(cfg.n_group), key=lambda g: -sum(scores[g]))[:cfg.topk_group]
        for e in range(cfg.num_experts):
            kept = e // per_group in best
            assert (limited[t, e] == choice[t, e]) if kept else limited[t, e] == float("-inf")


def test_config_rejects_impossible_groups():
    with pytest.raises(ValueError, match="fewer than top_k"):
        MoEConfig(**{**BASE, "top_k": 5}, n_group=8, topk_group=2)
    with pytest.raises(ValueError, match="not divisible by n_group"):
        MoEConfig(**BASE, n_group=3)
    with pytest.raises(ValueError, match="shared_gate needs"):
        MoEConfig(**BASE, shared_gate=True)
