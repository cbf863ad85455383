"""tp_ep (TP × EP experts, MoNTA's all-to-all forms O0–O3) under gloo with 4 ranks (2×2) and
8 ranks (2×4, 4×2): outputs and every gradient against the fp64 single-process reference; FP8
experts at 2×2 against the single-process W8A8 reference."""

import pytest
import torch
import torch.distributed as dist

from cases import case_indices, case_tokens, make_inputs
from helpers import fp8_expected, reference_grads, rel_err, run_gloo
from interlace import MoEConfig, MoELayer
from interlace.experts import init_expert_weights, shard_ffn
from interlace.parallel.mesh import MoEMesh

TOL = 2e-6
FORMS = ["tp_ep:O0", "tp_ep:O1", "tp_ep:O2", "tp_ep:O3-3"]
CONFIGS = {
    "swiglu": MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32),
    "capacity-gelu": MoEConfig(hidden=16, ffn=8, num_experts=8, top_k=3, dtype=torch.float32, capacity_factor=0.5,
                               activation="gelu", router="sigmoid", renormalize=True, aux_loss_coef=0.01),
}
# Tokens of the first batch (the others 3 more each, uneven_and_empty_rank's 5 more): 6 gives
# every batch at least one token per chunk of O3-3 and capacity drops in capacity-gelu, at half
# the interpreted kernels' work of cases.case_tokens' default 12.
BASE = 6


def _check_mesh(rank, world, tp, runs):
    mesh = MoEMesh.build(tp=tp)
    ep = world // tp
    assert (mesh.tp, mesh.ep, mesh.tp_rank, mesh.ep_rank) == (tp, ep, rank % tp, rank // tp)
    j = mesh.ep_rank  # this rank's batch: its TP group's tokens
    for name, case in runs:
        cfg = CONFIGS[name]
        tokens = case_tokens(case, ep, BASE)
        indices = case_indices(case, cfg, ep, tokens, seed=world + tp)
        xs, gs = make_inputs(cfg, tokens, seed=world + tp)
        outs, dxs, drw, dwu, dwd = reference_grads(cfg, 5, xs, gs, indices, aux_coef=cfg.aux_loss_coef)
        lo, hi = mesh.shard_ffn(cfg.ffn)
        first, num_local = j * cfg.num_experts // ep, cfg.num_experts // ep
        ref_wu, ref_wd = shard_ffn(dwu[first:first + num_local], dwd[first:first + num_local], cfg, lo, hi)
        for form in FORMS:
            layer = MoELayer(cfg, mesh=mesh, strategy=form, seed=5, device="cpu")
            x = xs[j].clone().requires_grad_()
            out = layer(x, expert_indices=None if indices is None else indices[j])
            out.backward(gs[j])
            where = f"rank {rank} (ep {j}, tp {mesh.tp_rank}) {tp}x{ep} {form} {name} {case}"
            assert rel_err(out, outs[j]) < TOL, where + " output"
            if tokens[j]:
                assert rel_err(x.grad, dxs[j]) < TOL, where + " dx"
            router_grad = layer.router.weight.grad.clone()
            dist.all_reduce(router_grad, group=mesh.ep_group)  # replicated over TP, summed over batches
            assert rel_err(router_grad, drw) < TOL, where + " router grad"
            assert rel_err(layer.experts.w_up.grad, ref_wu) < TOL, where + " w_up grad"
            assert rel_err(layer.experts.w_down.grad, ref_wd) < TOL, where + " w_down grad"
    return mesh


def _four_ranks(rank, world):
    mesh = _check_mesh(rank, world, 2, [("swiglu", "one_expert"), ("capacity-gelu", "uneven_and_empty_rank")])
    cfg = CONFIGS["swiglu"]
    with pytest.raises(ValueError, match="does not shard experts over a tensor-parallel group"):
        MoELayer(cfg, mesh=mesh, strategy="sequential", device="cpu")
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        MoELayer(cfg.with_(ffn=25), mesh=mesh, strategy="tp_ep:O1", device="cpu")
    with pytest.raises(ValueError, match="form must be one of"):
        MoELayer(cfg, mesh=mesh, strategy="tp_ep:O5", device="cpu")
    layer = MoELayer(cfg, mesh=mesh, strategy="tp_ep:O2", device="cpu")
    with pytest.raises(ValueError, match="must hold the same tokens"):
        layer(torch.randn(6 + rank, cfg.hidden))
    # The caller's own groups give the same mesh and the same layer.
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    given = MoEMesh.from_groups(tp_groups[rank // 2], ep_groups[rank % 2])
    assert (given.tp, given.ep, given.tp_rank, given.ep_rank) == (mesh.tp, mesh.ep, mesh.tp_rank, mesh.ep_rank)
    x = torch.randn(9, cfg.hidden, generator=torch.Generator().manual_seed(rank // 2))
    assert torch.equal(MoELayer(cfg, mesh=given, strategy="tp_ep:O2", device="cpu")(x), layer(x))
    # FP8 experts (inference): K = 256, one 128-block per TP rank; N = 160 has a partial block.
    fp8 = MoEConfig(hidden=160, ffn=256, num_experts=4, top_k=2, dtype=torch.float32, expert_quant="fp8")
    j = mesh.ep_rank
    x = torch.randn(7 + 5 * j, fp8.hidden, generator=torch.Generator().manual_seed(30 + j))  # batch j
    with torch.no_grad():
        out = MoELayer(fp8, mesh=mesh, strategy="tp_ep:O2", seed=6, device="cpu")(x)
    assert rel_err(out, fp8_expected(fp8, 6, x)) < 2e-4, f"rank {rank} FP8: {rel_err(out, fp8_expected(fp8, 6, x))}"


def _eight_ranks(rank, world):
    _check_mesh(rank, world, 2, [("swiglu", "random")])
    _check_mesh(rank, world, 4, [("capacity-gelu", "zero_recv_rank")])


def test_tp_ep_forms_match_reference_2x2():
    """TP=2 × EP=2, every form; plus the errors of a bad mesh or input, and FP8 experts."""
    run_gloo(_four_ranks, 4)


def test_tp_ep_forms_match_reference_2x4_and_4x2():
    run_gloo(_eight_ranks, 8)


def test_shard_weights_are_slices_of_the_full_experts():
    cfg = CONFIGS["swiglu"]
    w_up, w_down = init_expert_weights(cfg, range(cfg.num_experts), 3, torch.device("cpu"))
    x = torch.randn(5, cfg.hidden, dtype=torch.float64)
    full = torch.stack([torch.nn.functional.silu(x @ w_up[e, :24].double().t()) * (x @ w_up[e, 24:].double().t())
                        for e in range(cfg.num_experts)]) @ w_down.double().transpose(1, 2)
    parts = 0
    for lo in (0, 8, 16):
        su, sd = shard_ffn(w_up, w_down, cfg, lo, lo + 8)
        assert su.shape == (8, 16, 32) and sd.shape == (8, 32, 8)
        parts = parts + torch.stack([torch.nn.functional.silu(x @ su[e, :8].double().t()) * (x @ su[e, 8:].double().t())
                                     for e in range(cfg.num_experts)]) @ sd.double().transpose(1, 2)
    assert rel_err(parts, full) < 1e-12
