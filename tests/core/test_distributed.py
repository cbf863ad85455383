"""naive and sequential under gloo with 2 and 4 processes: outputs and every gradient
against the fp64 single-process reference, all routing cases, forward and backward."""

import pytest
import torch
import torch.distributed as dist

from cases import CASES, case_indices, case_tokens, make_inputs
from helpers import assert_grads_match, reference_grads, rel_err, run_gloo
from interlace import MoEConfig, MoELayer

TOL = 2e-6
CONFIGS = {
    "swiglu": MoEConfig(hidden=32, ffn=24, num_experts=8, top_k=2, dtype=torch.float32),
    "capacity": MoEConfig(hidden=16, ffn=8, num_experts=8, top_k=3, dtype=torch.float32, capacity_factor=0.5,
                          renormalize=True),
    "sigmoid-gelu": MoEConfig(hidden=16, ffn=12, num_experts=16, top_k=4, dtype=torch.float32, router="sigmoid",
                              activation="gelu", renormalize=True, route_scale=2.0, aux_loss_coef=0.01),
}


def _check_all(rank, world, strategy, config_names, cases, backward_cases=None, base=12):
    """Every config × case forward; backward too for ``backward_cases`` (None: all cases).
    ``base``: the first rank's token count (cases.case_tokens)."""
    for name in config_names:
        cfg = CONFIGS[name]
        for case in cases:
            tokens = case_tokens(case, world, base)
            indices = case_indices(case, cfg, world, tokens, seed=world)
            xs, gs = make_inputs(cfg, tokens, seed=world)
            layer = MoELayer(cfg, strategy=strategy, seed=11, device="cpu")
            with_grad = backward_cases is None or case in backward_cases
            x = xs[rank].clone().requires_grad_(with_grad)
            with torch.set_grad_enabled(with_grad):
                out = layer(x, expert_indices=None if indices is None else indices[rank])
            refs = reference_grads(cfg, 11, xs, gs, indices, aux_coef=cfg.aux_loss_coef)
            where = f"rank {rank}/{world} {strategy} {name} {case}"
            assert rel_err(out, refs[0][rank]) < TOL, where + " output"
            if with_grad:
                out.backward(gs[rank])
                assert_grads_match(layer, x, refs, rank, tokens[rank], where, TOL)


def _every_strategy(rank, world, strategies, config_names, cases, backward_cases=None, base=12):
    for strategy in strategies:
        _check_all(rank, world, strategy, config_names, cases, backward_cases, base)


# What each world size checks (every case, forward and backward, at both):
# 2 ranks: every strategy × every config: the whole product, at the cheapest launch.
# 4 ranks: what a rank with several peers adds (split sizes over 3 peers, a rank that receives
#   nothing while others do, chunks of several peers' rows): every strategy whose communication
#   differs (naive; sequential; pipelined at degree 2 and at 5, chunks of one token), on the
#   configs that between them hold every routing property: capacity (softmax, top-3, drops,
#   renormalized, swiglu) and sigmoid-gelu (sigmoid router, dropless, top-4 over 4 ranks, 4
#   experts per rank, aux loss). Not at 4 ranks, and why no behaviour goes unchecked:
#   - sequential:triton: its communication, counts and re-layout index are sequential's (checked
#     here); it differs only in the expert FFN (Triton grouped GEMMs reading the received rows
#     through that index), a rank-local computation checked at 2 ranks in every config and case
#     and on its own in tests/kernels/test_grouped_gemm.py;
#   - pipelined:1 and :3: degree 1 is sequential's path, degree 3 lies between 2 and 5;
#   - the swiglu config: each of its properties (softmax router, dropless, swiglu, 8 experts of
#     2 per rank) is one of the two configs' here; the combination is checked at 2 ranks.
# 8 ranks (test_gloo_eight_ranks_every_strategy): one expert per rank and the fused strategies.
STRATEGIES = {2: ["naive", "sequential", "sequential:triton", "pipelined:1", "pipelined:2", "pipelined:3",
                  "pipelined:5"],
              4: ["naive", "sequential", "pipelined:2", "pipelined:5"]}
WORLD_CONFIGS = {2: list(CONFIGS), 4: ["capacity", "sigmoid-gelu"]}
# Tokens of the first rank (the others 3 more each; cases.case_tokens): 6 keeps every rank at
# least one token per chunk of pipelined:5, at half the interpreted kernels' work of the default 12.
BASE = 6


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_matches_reference(world):
    """Every strategy of ``STRATEGIES[world]`` on every config of ``WORLD_CONFIGS[world]`` in one
    launch (the launch, 4 processes importing torch on CI's 2 cores, cost more than a strategy's
    checks when each had its own)."""
    run_gloo(_every_strategy, world, STRATEGIES[world], WORLD_CONFIGS[world], CASES, None, BASE)


def _mismatched_config(rank, world):
    cfg = CONFIGS["swiglu"] if rank == 0 else CONFIGS["swiglu"].with_(top_k=3)
    # The message names the field and each rank's value, not a hash of the config.
    with pytest.raises(ValueError, match=r"^MoEConfig differs across the expert-parallel group: "
                                         r"top_k: 2 on ranks \[0\], 3 on ranks \[1\]$"):
        MoELayer(cfg, device="cpu")
    cfg = CONFIGS["swiglu"] if rank == 0 else CONFIGS["swiglu"].with_(activation="gelu", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"activation: 'swiglu' on ranks \[0\], 'gelu' on ranks \[1\]; "
                                         r"dtype: torch.float32 on ranks \[0\], torch.float64 on ranks \[1\]$"):
        MoELayer(cfg, device="cpu")
    with pytest.raises(ValueError, match=r"^seed differs across the expert-parallel group: "
                                         r"0 on ranks \[0\], 7 on ranks \[1\]$"):
        MoELayer(CONFIGS["swiglu"], seed=7 * rank, device="cpu")


def test_mismatched_config_across_ranks_raises():
    run_gloo(_mismatched_config, 2)


def _indivisible(rank, world):
    with pytest.raises(ValueError, match="not divisible"):
        MoELayer(MoEConfig(hidden=8, ffn=8, num_experts=4, top_k=1, dtype=torch.float32), device="cpu")


def test_experts_not_divisible_by_world_raises():
    run_gloo(_indivisible, 3)


def _nan_rows(rank, world):
    cfg = CONFIGS["swiglu"]
    xs, _ = make_inputs(cfg, [10] * world, seed=2)
    xs = [x.clone() for x in xs]
    xs[0][4, 1] = float("nan")  # one poisoned token on rank 0
    for strategy in ("naive", "sequential"):
        out = MoELayer(cfg, strategy=strategy, seed=1, device="cpu")(xs[rank])
        clean = [x.clone() for x in xs]
        clean[0][4] = 0.0
        ref = reference_grads(cfg, 1, clean, [torch.zeros_like(x) for x in clean])[0][rank]
        ok = torch.ones(10, dtype=torch.bool)
        if rank == 0:
            ok[4] = False
            assert torch.isnan(out[4]).all(), "NaN must reach its own row"
        assert rel_err(out[ok], ref[ok]) < TOL, f"rank {rank} {strategy}: NaN leaked into other tokens"


def test_nan_token_does_not_corrupt_others():
    run_gloo(_nan_rows, 2)


def _degree_disagreement(rank, world):
    cfg = CONFIGS["swiglu"]
    layer = MoELayer(cfg, strategy=f"pipelined:{2 + rank}", device="cpu")
    with pytest.raises(ValueError, match="disagree on the pipeline degree"):
        layer(torch.randn(9, cfg.hidden))


def test_pipeline_degree_disagreement_raises_instead_of_hanging():
    run_gloo(_degree_disagreement, 2)


def test_gloo_eight_ranks_every_strategy():
    """EP=8 (the size of the 8-GPU runs): every strategy family on a config with two experts per
    rank and one with one expert per rank and capacity drops; forward on a rank that receives
    nothing and on the router's own choice with a rank that sends nothing (uneven_and_empty_rank),
    backward on the latter (8 processes on CI's 2 cores made backward on every case the suite's
    slowest test). The router's choice with every rank sending (the case "random") is not run
    here: uneven_and_empty_rank's routing is the router's too, and its 7 ranks that hold tokens
    send to every peer, forward and backward."""
    strategies = ["naive", "sequential", "pipelined:2", "fused", "fused:train"]
    run_gloo(_every_strategy, 8, strategies, ["sigmoid-gelu", "capacity"],
             ["zero_recv_rank", "uneven_and_empty_rank"], ["uneven_and_empty_rank"], BASE)
